"""``fa-lab lab``: JupyterLab on the lessons (``notebooks/`` of a checkout), as ``make lab``
runs it: one OpenMP thread that sleeps when idle, and the checkout's ``.jupyter/`` on
Jupyter's config path, so saving a lesson strips its outputs. JupyterLab and the
dashboards' widgets come with the ``[lab]`` extra: ``pip install 'fa_lab[lab]'``.

Installed from a wheel, with no checkout around it, fa_lab carries the lessons and the data
they read (``fa_lab/_course``): the command copies the lessons into a folder of the user's
(``--dir``, default ./fa_lab_lessons), keeping any lesson already there (the learner's own
work), and opens JupyterLab on it; the lessons read their data from the installed copy.

The server runs in a session of its own, so only this process takes a Ctrl-C or a
SIGTERM; it then stops the server with SIGTERM (JupyterLab shuts its kernels down on
it), waits up to ``STOP_GRACE_S`` seconds, and kills what is left."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from fa_lab.studies import experiments as ex

from .args import INTERRUPTED, UsageError, _int_at_least, add_bool_flag

HELP = "JupyterLab on notebooks/ (needs the [lab] extra)"

#: Seconds the server has to stop (and stop its kernels) after SIGTERM before it is killed.
STOP_GRACE_S = 20

#: What ``make lab`` sets (Makefile ``LAB_ENV``): one OpenMP thread, sleeping when idle.
LAB_ENV = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}

port_int = _int_at_least(1, "a port number in 1 .. 65535", hi=65535)


def add_arguments(p) -> None:
    p.add_argument("--port", type=port_int, default=None,
                   help="the port JupyterLab serves on (default: Jupyter's, 8888 or the next free)")
    add_bool_flag(p, "--no-browser", dest="no_browser",
                  help="do not open a browser (print the address only)")
    p.add_argument("--dir", dest="lessons_dir", metavar="DIR", default=None,
                   help=f"installed from a wheel: where the lessons are copied to and opened "
                        f"(default ./{LESSONS_DIRNAME}; lessons already there are kept)")


#: Where an installed fa_lab copies the lessons, under the working directory.
LESSONS_DIRNAME = "fa_lab_lessons"


def installed() -> bool:
    """Whether fa_lab runs from an installed wheel's copy of the course (no checkout)."""
    return ex.ROOT.name == "_course"


def copy_lessons(dest) -> Path:
    """The wheel's lessons copied into ``dest`` (created if need be): a lesson already there
    is kept, so a learner's work survives the next ``fa-lab lab``. Returns ``dest``."""
    dest = Path(dest)
    if dest.exists() and not dest.is_dir():
        raise UsageError(f"--dir {dest}: a file, not a folder")
    dest.mkdir(parents=True, exist_ok=True)
    for lesson in sorted((ex.ROOT / "notebooks").glob("*.ipynb")):
        if not (dest / lesson.name).exists():
            shutil.copyfile(lesson, dest / lesson.name)
    return dest


def lab_env(environ) -> dict:
    """The server's environment: ``environ`` with ``LAB_ENV`` and the checkout's
    ``.jupyter/`` first on ``JUPYTER_CONFIG_PATH`` (its save hook strips the lessons)."""
    env = dict(environ, **LAB_ENV)
    if installed():             # no checkout: no save hook (it strips the checkout's lessons)
        return env
    config = str(ex.ROOT / ".jupyter")
    env["JUPYTER_CONFIG_PATH"] = os.pathsep.join(
        [config] + [p for p in environ.get("JUPYTER_CONFIG_PATH", "").split(os.pathsep) if p])
    return env


def command(args, notebooks) -> list[str]:
    root = ["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
    port = [f"--ServerApp.port={args.port}", "--ServerApp.port_retries=0"] if args.port else []
    browser = ["--no-browser"] if args.no_browser else []
    return [sys.executable, "-m", "jupyterlab", *root, *port, *browser, str(notebooks)]


def run(args) -> int:
    missing = [m for m in ("jupyterlab", "ipywidgets", "plotly")
               if importlib.util.find_spec(m) is None]
    if missing:
        raise UsageError(f"the lab needs {', '.join(missing)}, which this install lacks: "
                         f"pip install 'fa_lab[lab]'")
    notebooks = ex.ROOT / "notebooks"
    if not notebooks.is_dir():
        raise UsageError(f"no lessons at {notebooks}: this install of fa_lab carries no "
                         "lessons; use a checkout (make lab) or a wheel built from one")
    if installed():
        notebooks = copy_lessons(args.lessons_dir or Path.cwd() / LESSONS_DIRNAME)
        print(f"fa-lab lab: the lessons are in {notebooks}", flush=True)
    elif args.lessons_dir is not None:
        raise UsageError("--dir is for an installed fa_lab; a checkout opens its own "
                         "notebooks/")
    elif not (ex.ROOT / ".jupyter").is_dir():
        raise UsageError(f"no {ex.ROOT / '.jupyter'}: the lab's Jupyter config comes with a "
                         "checkout of fa_lab")
    proc = subprocess.Popen(command(args, notebooks), env=lab_env(os.environ),
                            start_new_session=True)
    stopped = []

    def stop(signum, _frame):
        stopped.append(signum)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

    handled = (signal.SIGINT, signal.SIGTERM) + ((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ())
    old = {s: signal.signal(s, stop) for s in handled}
    try:
        while True:
            try:
                code = proc.wait(timeout=STOP_GRACE_S if stopped else None)
                break
            except subprocess.TimeoutExpired:  # the server did not stop in time
                _kill_session(proc)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if proc.poll() is None:  # this process is leaving: leave no server behind
            _kill_session(proc)
    if stopped:
        return INTERRUPTED if stopped[0] == signal.SIGINT else 128 + stopped[0]
    return code


def _kill_session(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
