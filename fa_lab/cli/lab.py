"""``fa-lab lab``: JupyterLab on the lessons (``notebooks/``)."""

from __future__ import annotations

import os
import subprocess
import sys

from fa_lab.studies import experiments as ex

HELP = "JupyterLab on notebooks/"


def add_arguments(p) -> None:
    """No arguments."""


def run(args) -> int:
    root = ["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
    return subprocess.call([sys.executable, "-m", "jupyter", "lab", *root, str(ex.ROOT / "notebooks")])


