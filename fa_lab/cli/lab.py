"""``fa-lab lab``: JupyterLab on the lessons (``notebooks/`` of a checkout). JupyterLab and
the dashboards' widgets come with the ``[lab]`` extra: ``pip install 'fa_lab[lab]'``."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

from fa_lab.studies import experiments as ex

from .args import UsageError

HELP = "JupyterLab on notebooks/ (needs the [lab] extra)"


def add_arguments(p) -> None:
    """No arguments."""


def run(args) -> int:
    missing = [m for m in ("jupyterlab", "ipywidgets", "plotly")
               if importlib.util.find_spec(m) is None]
    if missing:
        raise UsageError(f"the lab needs {', '.join(missing)}, which this install lacks: "
                         f"pip install 'fa_lab[lab]'")
    notebooks = ex.ROOT / "notebooks"
    if not notebooks.is_dir():
        raise UsageError(f"no lessons at {notebooks}: they come with a checkout of fa_lab, "
                         f"not with an installed wheel")
    root = ["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
    return subprocess.call([sys.executable, "-m", "jupyter", "lab", *root, str(notebooks)])
