"""``fa-lab lab`` as a user runs it: a real JupyterLab on the checkout's lessons, on a
loopback port the test picks, stopped by SIGTERM or Ctrl-C (SIGINT) with its kernel, and
saving a lesson strips it as ``make lab`` does."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

psutil = pytest.importorskip("psutil")

REPO = Path(__file__).resolve().parents[2]
START_S = 60    # JupyterLab's start on a busy CPU
STOP_S = 30     # the command's grace for the server, and then some


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _api(url, token, path, method="GET", body=None):
    req = urllib.request.Request(f"{url}{path}", method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Authorization": f"token {token}",
                                          "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)


def _start(tmp_path, port, token):
    env = dict(os.environ, JUPYTER_TOKEN=token, JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
               JUPYTER_CONFIG_DIR=str(tmp_path / "config"), JUPYTER_DATA_DIR=str(tmp_path / "data"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"),
               JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "settings"), BROWSER="false")
    env.pop("JUPYTER_CONFIG_PATH", None)
    log = open(tmp_path / "lab.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "fa_lab", "lab", "--port", str(port),
                             "--no-browser"], cwd=REPO, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_S
    while True:
        if proc.poll() is not None:
            log.close()
            pytest.fail(f"fa-lab lab exited with {proc.returncode}: "
                        f"{(tmp_path / 'lab.log').read_text()[-2000:]}")
        try:
            _api(url, token, "/api/status")
            return proc, url, log
        except OSError:
            if time.monotonic() > deadline:
                _kill(proc)
                log.close()
                pytest.fail(f"fa-lab lab did not answer on port {port} within {START_S} s")
            time.sleep(0.5)


def _kill(proc):
    for p in [proc, *psutil.Process(proc.pid).children(recursive=True)]:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_lab_stops_with_its_kernel_on_a_signal(tmp_path, sig):
    port, token = _free_port(), secrets.token_hex(16)
    proc, url, log = _start(tmp_path, port, token)
    lesson = REPO / "notebooks" / f"_fa_lab_save_test_{uuid.uuid4().hex[:8]}.ipynb"
    try:
        kernel = _api(url, token, "/api/kernels", "POST", {"name": "python3"})
        deadline = time.monotonic() + START_S
        while True:  # the kernel's process, under the server's
            tree = psutil.Process(proc.pid).children(recursive=True)
            if any("ipykernel" in " ".join(p.cmdline()) for p in tree):
                break
            assert time.monotonic() < deadline, "the kernel's process never appeared"
            time.sleep(0.3)
        assert kernel["id"]
        if sig == signal.SIGTERM:  # saving a lesson from the lab strips its outputs
            nb = {"nbformat": 4, "nbformat_minor": 5, "metadata": {},
                  "cells": [{"cell_type": "code", "id": "c1", "metadata": {}, "source": "1 + 1",
                             "execution_count": 3, "outputs": [
                                 {"output_type": "execute_result", "execution_count": 3,
                                  "data": {"text/plain": "2"}, "metadata": {}}]}]}
            _api(url, token, f"/api/contents/{lesson.name}", "PUT",
                 {"type": "notebook", "format": "json", "content": nb})
            saved = json.loads(lesson.read_text())
            assert saved["cells"][0]["outputs"] == [] and saved["cells"][0]["execution_count"] is None
        os.kill(proc.pid, sig)
        try:
            code = proc.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"fa-lab lab still runs {STOP_S} s after {sig.name}")
        gone, alive = psutil.wait_procs(tree, timeout=10)
        assert alive == [], f"left running after {sig.name}: {[p.cmdline() for p in alive]}"
        assert code == 128 + sig
        with pytest.raises(OSError):
            _api(url, token, "/api/status")
    finally:
        if proc.poll() is None:
            _kill(proc)
            proc.wait(timeout=10)
        log.close()
        lesson.unlink(missing_ok=True)


def test_lab_takes_port_and_no_browser_and_makes_labs_environment(monkeypatch):
    """The flags reach JupyterLab, and its environment is ``make lab``'s: .jupyter/ (the
    save hook) first on Jupyter's config path, one OpenMP thread that sleeps when idle."""
    from fa_lab.cli import build_parser
    from fa_lab.cli import lab

    args = build_parser().parse_args(["lab", "--port", "8899", "--no-browser"])
    cmd = lab.command(args, REPO / "notebooks")
    assert "--ServerApp.port=8899" in cmd and "--no-browser" in cmd
    env = lab.lab_env({"JUPYTER_CONFIG_PATH": "/elsewhere"})
    assert env["JUPYTER_CONFIG_PATH"].split(os.pathsep) == [str(REPO / ".jupyter"), "/elsewhere"]
    assert (env["OMP_NUM_THREADS"], env["OMP_WAIT_POLICY"]) == ("1", "PASSIVE")
    for bad in ("0", "65536", "http"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["lab", "--port", bad])
