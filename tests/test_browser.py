"""A real browser moves a dashboard slider and the plotly figure changes.

Starts JupyterLab from this virtual environment on a free localhost port, in a temporary
directory holding a one-cell notebook that shows ``widgets.rescale_dashboard``; opens it
in headless Chromium (Debian's /usr/bin/chromium, driven by playwright; no browser is ever
downloaded), runs the cell, waits for the FigureWidgets to render, moves the K-scale slider
with the keyboard and checks that the heatmap's data and the summary changed. This is
the check that the ipywidgets, anywidget and jupyterlab-plotly frontends work together.
Skipped only when /usr/bin/chromium is absent. A screenshot goes to
$TMPDIR/fa_lab_browser.png.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
SCREENSHOT = Path(tempfile.gettempdir()) / "fa_lab_browser.png"
# A small size: the point is the round trip browser -> kernel -> browser, not the model.
CELL = """\
from fa_lab import widgets
dashboard = widgets.rescale_dashboard(S=512, H=1, k_scale=40, row=0)
dashboard"""

pytestmark = pytest.mark.skipif(not CHROMIUM.exists(),
                                reason="needs Debian's /usr/bin/chromium (apt-get install chromium)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_notebook(path: Path, cells):
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    nb = new_notebook(cells=[new_code_cell(c) for c in cells], metadata={
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}})
    nbformat.write(nb, path)


@pytest.fixture
def jupyterlab(tmp_path):
    with jupyterlab_server(tmp_path, [CELL]) as server:
        yield server


@contextlib.contextmanager
def jupyterlab_server(tmp_path: Path, cells):
    """A JupyterLab server on tmp_path serving dashboard.ipynb made of ``cells``; yields
    its base URL and token; always stopped, with the kernels it started."""
    root = tmp_path / "root"
    root.mkdir()
    _write_notebook(root / "dashboard.ipynb", cells)
    port, token = _free_port(), secrets.token_hex(16)
    # No news or update pop-ups over the page.
    settings = tmp_path / "settings"
    notes = settings / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    notes.parent.mkdir(parents=True)
    notes.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    # Start the notebook's kernel without asking.
    panel = settings / "@jupyterlab" / "notebook-extension" / "panel.jupyterlab-settings"
    panel.parent.mkdir(parents=True)
    panel.write_text(json.dumps({"autoStartDefaultKernel": True}))
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"),
               JUPYTERLAB_SETTINGS_DIR=str(settings), JUPYTER_CONFIG_DIR=str(tmp_path / "config"))
    jupyter = Path(sys.executable).parent / "jupyter"
    log = open(tmp_path / "jupyterlab.log", "w")
    proc = subprocess.Popen(
        [str(jupyter), "lab", "--no-browser", "--ServerApp.ip=127.0.0.1",
         f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
         "--ServerApp.allow_root=True"],
        cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                pytest.fail(f"JupyterLab exited with {proc.returncode}: "
                            f"{(tmp_path / 'jupyterlab.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2) as r:
                    json.load(r)
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail("JupyterLab did not answer within 60 s")
                time.sleep(0.5)
        yield url, token
    finally:
        # The server and the kernels it started share the session made for it above.
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=5)
        log.close()


_READ_STATE = """() => {
    const dash = document.querySelector('.fa-lab-rescale-dashboard');
    if (!dash) return null;
    const plots = dash.querySelectorAll('.js-plotly-plot');
    const summary = dash.querySelector('.fa-lab-summary');
    if (plots.length < 3 || !summary || !plots[0].data) return null;
    const z = plots[0].data[1].z;
    return {n_plots: plots.length, summary: summary.innerText,
            z: JSON.stringify(Array.from(z, row => Array.from(row))),
            title: plots[0].layout.title.text};
}"""


def test_slider_redraws_the_figure(jupyterlab):
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import sync_playwright

    url, token = jupyterlab
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS,
                                    headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1800})
            page.goto(f"{url}/lab/tree/dashboard.ipynb?token={token}")
            cell = page.locator(".jp-Notebook .jp-Cell").first
            cell.wait_for(timeout=60_000)
            # If JupyterLab still asks which kernel to use, take the notebook's own.
            choose = page.locator(".jp-Dialog").get_by_role("button", name="Select")
            try:
                choose.click(timeout=5_000)
            except PlaywrightTimeout:
                pass
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']",
                                   state="attached", timeout=60_000)
            cell.locator(".jp-InputArea-editor").click()
            page.keyboard.press("Shift+Enter")

            page.wait_for_function(_READ_STATE, timeout=60_000)
            before = page.evaluate(_READ_STATE)
            assert before["n_plots"] == 3, before
            assert "K x40" in before["summary"], before["summary"]

            slider = page.locator(".fa-lab-rescale-dashboard .widget-slider").filter(
                has_text="K scale")
            handle = slider.locator(".noUi-handle")
            handle.focus()
            page.keyboard.press("ArrowRight")
            page.wait_for_function(
                """(old) => { const s = document.querySelector(
                    '.fa-lab-rescale-dashboard .fa-lab-summary');
                    return s && s.innerText !== old; }""", arg=before["summary"],
                timeout=30_000)
            page.wait_for_function(
                f"""(old) => {{ const st = ({_READ_STATE})();
                    return st && st.z !== old; }}""", arg=before["z"], timeout=30_000)
            after = page.evaluate(_READ_STATE)
            page.screenshot(path=str(SCREENSHOT), full_page=True)
            stderr = page.locator(".jp-OutputArea-output[data-mime-type="
                                  "'application/vnd.jupyter.stderr']").all_inner_texts()
        except Exception:
            # What the page showed when it failed, for the reader of the failure.
            page.screenshot(path=str(SCREENSHOT.with_name("fa_lab_browser_failed.png")),
                            full_page=True)
            raise
        finally:
            browser.close()
    # e.g. "Message serialization failed ... Out of range float values are not JSON
    # compliant": a figure sent NaN through the widget protocol.
    assert not stderr, stderr
    assert "K x41" in after["summary"], after["summary"]
    assert after["z"] != before["z"]
    assert after["n_plots"] == 3
