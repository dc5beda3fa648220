"""Variants of the Gluon kernel's module (``kernels/swp_bf16/hopper.py``) for the Hopper
benchmarks: a source, this tree's edited or an earlier commit's, compiled from a file of
its own (Gluon reads a kernel's source back) into a namespace outside ``sys.modules``."""
import os
import subprocess
import tempfile
import types

from fa_lab.kernels.swp_bf16 import hopper

PATH = "kernels/swp_bf16/hopper.py"


def load(src: str, name: str) -> types.SimpleNamespace:
    """The module built from ``src`` (its relative imports of ``_triton`` made absolute)."""
    src = src.replace("from .._triton", "from fa_lab.kernels._triton")
    path = os.path.join(tempfile.mkdtemp(), f"{name}.py")
    with open(path, "w") as f:
        f.write(src)
    ns = {"__name__": hopper.__name__, "__file__": path}
    exec(compile(src, path, "exec"), ns)
    return types.SimpleNamespace(**ns)


def at_commit(commit: str, source: str | None = None) -> types.SimpleNamespace:
    """The module as ``commit`` had it (``git show``), or as the copy at ``source``."""
    if source:
        with open(source) as f:
            src = f.read()
    else:
        src = subprocess.run(["git", "show", f"{commit}:{PATH}"], check=True,
                             capture_output=True, text=True).stdout
    return load(src, f"hopper_{commit}")
