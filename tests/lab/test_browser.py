"""A learner's view: the lessons' dashboards in real JupyterLab, in headless Chromium.

Starts JupyterLab from this virtual environment on a free localhost port, in a temporary
directory holding copies of lessons 02 and 03 (and the glossary they link to), with the
environment ``make lab`` sets (one OpenMP thread that sleeps when idle). For each lesson it
opens the notebook in headless Chromium at 1600 x 1000 (Debian's /usr/bin/chromium, driven
by playwright; no browser is ever downloaded), runs every cell, scrolls to the dashboard and
checks that

* the K-scale slider and the main figure are on screen together, nothing cut off;
* moving the slider with the keyboard redraws the main figure and the summary;
* no cell wrote to stderr (e.g. a figure that sent NaN through the widget protocol).

It times each redraw end to end (key press to the new main figure and summary in the
page): first with a CPU-bound process running beside the lab, starting with the first move
after Run All (issue 32's case: that move must stay under 1 s, the later ones' median under
0.3 s), then with the machine as it is. It records the times in
``data/results/browser_redraw.json`` (``FA_LAB_BROWSER_RESULTS`` names another file),
beside the kernel's clock on the same redraws (the dashboard prints it under its summary:
when the main figure was sent, and when the summary's numbers were done, which after a move
made in the browser waits for the main figure to be drawn).
Screenshots of each dashboard go to ``$FA_LAB_SCREENSHOT_DIR`` (``docs/img`` for the
README's), else to the temporary directory. Skipped only when /usr/bin/chromium is absent.

Two checks of the lab itself need no browser: saving a lesson from the lab strips its
outputs (.jupyter/jupyter_server_config.py, which ``make lab`` puts on Jupyter's config
path), and ``make lab`` keeps its defaults when LAB_FLAGS adds to them.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

import pytest

from fa_lab.results import atomic_write_json

pytestmark = pytest.mark.slow  # a real JupyterLab in a real browser

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
VIEWPORT = {"width": 1600, "height": 1000}
#: lesson -> (notebook, the dashboard's CSS class, the label of its scale slider)
LESSONS = {"02": ("02_lazy_rescale.ipynb", "fa-lab-rescale-dashboard", "K scale"),
           "03": ("03_fp8.ipynb", "fa-lab-fp8-dashboard", "k scale")}
MOVES = 5                # slider moves timed per condition
TARGET_S = 0.3           # the redraw goal (median), recorded beside the medians
FIRST_TARGET_S = 1.0     # the goal for the first move after Run All, under load
# Each run records its medians in data/results (the committed file is the last run a
# developer kept); FA_LAB_BROWSER_RESULTS names another file.
RESULTS = Path(os.environ.get("FA_LAB_BROWSER_RESULTS",
                              REPO / "data" / "results" / "browser_redraw.json"))

needs_chromium = pytest.mark.skipif(
    not CHROMIUM.exists(), reason="needs Debian's /usr/bin/chromium (apt-get install chromium)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def jupyterlab_server(tmp_path: Path, notebooks):
    """A JupyterLab server on a copy of ``notebooks`` (paths); yields its base URL and
    token; always stopped, with the kernels it started."""
    root = tmp_path / "root"
    root.mkdir()
    for nb in notebooks:
        shutil.copy(nb, root / Path(nb).name)
    port, token = _free_port(), secrets.token_hex(16)
    settings = tmp_path / "settings"
    # No news or update pop-ups over the page; the notebook's kernel starts without asking.
    for ext, name, value in (("apputils-extension", "notification",
                              {"fetchNews": "false", "checkForUpdates": False}),
                             ("notebook-extension", "panel", {"autoStartDefaultKernel": True})):
        f = settings / "@jupyterlab" / ext / f"{name}.jupyterlab-settings"
        f.parent.mkdir(parents=True)
        f.write_text(json.dumps(value))
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"),
               JUPYTERLAB_SETTINGS_DIR=str(settings), JUPYTER_CONFIG_DIR=str(tmp_path / "config"),
               OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE",    # what make lab sets
               FA_LAB_SOLUTIONS="1")  # run-all passes the exercise stubs with the answers
    jupyter = Path(sys.executable).parent / "jupyter"
    log = open(tmp_path / "jupyterlab.log", "w")
    proc = subprocess.Popen(
        [str(jupyter), "lab", "--no-browser", "--ServerApp.ip=127.0.0.1",
         f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
         "--ServerApp.allow_root=True", "--LabApp.expose_app_in_browser=True"],
        cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
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
                    pytest.fail("JupyterLab did not answer within 90 s")
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


@contextlib.contextmanager
def cpu_burner():
    """One CPU-bound process beside the lab (a busy loop), stopped on exit."""
    p = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    try:
        time.sleep(0.5)
        yield p
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=10)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lab")
    nbs = [REPO / "notebooks" / n for n, _, _ in LESSONS.values()] + [REPO / "notebooks" / "glossary.ipynb"]
    with jupyterlab_server(tmp, nbs) as server:
        yield server, tmp


@pytest.fixture(scope="module")
def results():
    """Collected per lesson, written once at the end."""
    found: dict = {}
    yield found
    if found:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "name": "browser_redraw",
            "what": ("seconds from a K-scale key press to the redrawn main figure and summary "
                     "in JupyterLab (headless Chromium, 1600 x 1000), one torch thread (make "
                     "lab's environment); 'loaded': with one CPU-bound process beside it, "
                     "the first of them the first move after Run All (first_move_loaded_s; "
                     "median_loaded_later_s: the moves after it); 'idle': then without it; "
                     "kernel_*: the kernel's clock on the same redraws, from the move's "
                     "arrival to the main figure sent, and to the summary's numbers done"),
            "target_s": TARGET_S,
            "first_move_target_s": FIRST_TARGET_S,
            "provenance": {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                           "cpus": os.cpu_count(), "machine": platform.machine(),
                           "python": platform.python_version(),
                           "load_average_1min": round(os.getloadavg()[0], 2)},
            "lessons": found,
        }
        atomic_write_json(RESULTS, record)


#: The dashboard of the notebook on screen (a hidden notebook panel is .lm-mod-hidden).
_DASH = ".jp-NotebookPanel:not(.lm-mod-hidden) .fa-lab-dashboard"
_READ_STATE = """() => {
    const dash = document.querySelector('""" + _DASH + """');
    if (!dash) return null;
    const plots = dash.querySelectorAll('.js-plotly-plot');
    const summary = dash.querySelector('.fa-lab-summary');
    if (plots.length < 1 || !summary || !plots[0].data) return null;
    const sig = JSON.stringify(plots[0].data.map(d => d.y ? Array.from(d.y).slice(0, 200) : null));
    const timing = dash.querySelector('.fa-lab-timing');
    return {n_plots: plots.length, summary: summary.innerText, sig: sig,
            kernel: timing ? timing.innerText : null, title: plots[0].layout.title.text};
}"""


def _box_inside(box, viewport) -> bool:
    return (box is not None and box["x"] >= 0 and box["y"] >= 0
            and box["x"] + box["width"] <= viewport["width"]
            and box["y"] + box["height"] <= viewport["height"])


def _scale(state) -> float:
    """The K (k) scale a dashboard's summary names: "... K x33, ..." or "... k x5610, ..."."""
    return float(re.search(r"[kK] x([0-9.]+)", state["summary"]).group(1))


def _run_all(page, url, token, notebook):
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    # a workspace of its own, reset: no tab of an earlier lesson comes back
    page.goto(f"{url}/lab/workspaces/{Path(notebook).stem}/tree/{notebook}?reset&token={token}")
    page.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=90_000)
    choose = page.locator(".jp-Dialog").get_by_role("button", name="Select")
    try:  # if JupyterLab still asks which kernel to use, take the notebook's own
        choose.click(timeout=3_000)
    except PlaywrightTimeout:
        pass
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']",
                           state="attached", timeout=90_000)
    page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
    page.wait_for_function(_READ_STATE, timeout=600_000)
    # the dashboard is the last output: wait until the whole notebook has run
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']",
                           state="attached", timeout=600_000)


def _move_and_time(page, handle, key, before):
    """Press ``key`` on the slider and return the seconds until the main figure and the
    summary both changed, and the new state."""
    t0 = time.perf_counter()
    handle.press(key)
    page.wait_for_function(
        f"""(old) => {{ const st = ({_READ_STATE})();
            return st && st.sig !== old.sig && st.summary !== old.summary; }}""",
        arg=before, polling="raf", timeout=60_000)
    seconds = time.perf_counter() - t0
    # the kernel's own share arrives in the summary right after the figures
    page.wait_for_function(f"""(old) => {{ const st = ({_READ_STATE})();
        return st && st.kernel && st.kernel !== old.kernel; }}""", arg=before, timeout=60_000)
    after = page.evaluate(_READ_STATE)
    kernel = after["kernel"]     # "redraw N: main figure sent after X s, all Y s (kernel clock)"
    return seconds, (float(kernel.split("after ")[1].split(" s")[0]),
                     float(kernel.split("all ")[1].split(" s")[0])), after


@needs_chromium
@pytest.mark.parametrize("lesson", list(LESSONS))
def test_lesson_dashboard_fits_and_redraws(lab, results, lesson):
    from playwright.sync_api import sync_playwright

    (url, token), tmp = lab
    notebook, css, slider_label = LESSONS[lesson]
    shots = Path(os.environ.get("FA_LAB_SCREENSHOT_DIR", tmp))
    shots.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS,
                                    headless=True)
        page = browser.new_page(viewport=VIEWPORT)
        try:
            _run_all(page, url, token, notebook)
            dash = page.locator(f"{_DASH}.{css}")
            dash.evaluate("el => el.scrollIntoView({block: 'start'})")
            page.wait_for_timeout(500)
            slider = dash.locator(".widget-slider").filter(has_text=slider_label)
            main = dash.locator(".js-plotly-plot").first
            boxes = {"slider": slider.bounding_box(), "main figure": main.bounding_box(),
                     "dashboard": dash.bounding_box()}
            page.screenshot(path=str(shots / f"dashboard_{lesson}.png"))
            for name in ("slider", "main figure"):
                assert _box_inside(boxes[name], VIEWPORT), (name, boxes)
            # nothing is cut off sideways: the whole dashboard is as wide as the screen allows
            assert boxes["dashboard"]["x"] + boxes["dashboard"]["width"] <= VIEWPORT["width"]

            handle = slider.locator(".noUi-handle")
            state = page.evaluate(_READ_STATE)
            k0 = _scale(state)
            times = {"loaded": [], "idle": []}
            kernel = {"loaded": [], "idle": []}
            # loaded first: the first move after Run All is the one a learner makes first
            for condition in ("loaded", "idle"):
                with (cpu_burner() if condition == "loaded" else contextlib.nullcontext()):
                    for _ in range(MOVES):
                        seconds, k_s, new = _move_and_time(page, handle, "ArrowRight", state)
                        kernel[condition].append(k_s)
                        assert _scale(new) > _scale(state)     # one step up the slider
                        assert new["sig"] != state["sig"] and new["n_plots"] == state["n_plots"]
                        times[condition].append(seconds)
                        state = new
            page.screenshot(path=str(tmp / f"dashboard_{lesson}_moved.png"))
            # a closed tab's figure is drawn when it opens, for the slider's latest value
            old_title = page.evaluate(f"""() => document.querySelectorAll(
                '{_DASH} .js-plotly-plot')[3].layout.title.text""")
            dash.get_by_role("tab", name="every bad row").click()
            page.wait_for_function(f"""(old) => {{
                const p = document.querySelectorAll('{_DASH} .js-plotly-plot')[3];
                return p && p.offsetParent !== null && p.layout.title.text !== old; }}""",
                arg=old_title, timeout=30_000)
            page.screenshot(path=str(tmp / f"dashboard_{lesson}_bad_rows.png"))
            stderr = page.locator(".jp-OutputArea-output[data-mime-type="
                                  "'application/vnd.jupyter.stderr']").all_inner_texts()
        except Exception:
            page.screenshot(path=str(tmp / f"dashboard_{lesson}_failed.png"), full_page=True)
            print(f"screenshot of the failure: {tmp / f'dashboard_{lesson}_failed.png'}")
            raise
        finally:
            browser.close()
    # recorded before the stderr check: a stray warning in a lesson does not hide its timings
    results[lesson] = {
        "notebook": notebook, "k_scale_from": k0, "moves": MOVES,
        "first_move_loaded_s": round(times["loaded"][0], 3),
        "median_loaded_later_s": round(statistics.median(times["loaded"][1:]), 3),
        "median_loaded_s": round(statistics.median(times["loaded"]), 3),
        "median_idle_s": round(statistics.median(times["idle"]), 3),
        "meets_targets": (times["loaded"][0] < FIRST_TARGET_S
                          and statistics.median(times["loaded"][1:]) < TARGET_S),
        "times_idle_s": [round(t, 3) for t in times["idle"]],
        "times_loaded_s": [round(t, 3) for t in times["loaded"]],
        # the kernel's clock on each move: (main figure sent, all done)
        "kernel_loaded_s": [[round(x, 3) for x in k] for k in kernel["loaded"]],
        "kernel_idle_s": [[round(x, 3) for x in k] for k in kernel["idle"]],
        **{f"kernel_{what}_median_{condition}_s":
           round(statistics.median(k[i] for k in kernel[condition]), 3)
           for i, what in enumerate(("main_figure", "all")) for condition in ("idle", "loaded")},
        "boxes": boxes,
    }
    assert not stderr, stderr
    # Loose bounds (a slow or shared CI machine must not fail here); the times and whether
    # they meet the goals are recorded.
    assert times["loaded"][0] < 10.0 and statistics.median(times["loaded"]) < 5.0, times


# ---- the lab itself ----------------------------------------------------------------------

def test_lab_saves_lessons_without_outputs(tmp_path):
    """The pre-save hook ``make lab`` installs: a lesson saved from the lab (autosave
    included) keeps its cells and ids but loses outputs, counts and widget state; a
    notebook outside notebooks/ is saved as it is."""
    import runpy

    import nbformat
    from nbformat.v4 import new_output
    from traitlets.config import Config

    cfg = Config()
    config = runpy.run_path(str(REPO / ".jupyter" / "jupyter_server_config.py"),
                            init_globals={"get_config": lambda: cfg})
    hook = config["strip_lesson_outputs"]
    lesson = nbformat.read(REPO / "notebooks" / "00_tour.ipynb", as_version=4)
    cell = next(c for c in lesson.cells if c.cell_type == "code")
    cell.outputs = [new_output("stream", text="hi")]
    cell.execution_count = 7
    cell.metadata["execution"] = {"iopub.status.busy": "now"}
    lesson.metadata["widgets"] = {"state": {}}
    model = {"type": "notebook", "content": json.loads(nbformat.writes(lesson))}
    hook(model=model, path="00_tour.ipynb", contents_manager=_Manager(REPO / "notebooks"))
    saved = model["content"]
    code = [c for c in saved["cells"] if c["cell_type"] == "code"]
    assert all(c["outputs"] == [] and c["execution_count"] is None for c in code)
    assert "widgets" not in saved["metadata"] and "execution" not in code[0]["metadata"]
    assert [c["id"] for c in saved["cells"]] == [c.id for c in lesson.cells]
    assert saved == json.loads(nbformat.writes(nbformat.read(
        REPO / "notebooks" / "00_tour.ipynb", as_version=4)))   # = the stripped file
    elsewhere = {"type": "notebook", "content": {"cells": [{"cell_type": "code", "outputs": [1],
                                                            "execution_count": 1, "metadata": {}}],
                                                 "metadata": {}}}
    hook(model=elsewhere, path="mine.ipynb", contents_manager=_Manager(tmp_path))
    assert elsewhere["content"]["cells"][0]["outputs"] == [1]
    assert cfg.ContentsManager.pre_save_hook is hook


class _Manager:
    def __init__(self, root):
        self.root_dir = str(root)


def test_make_lab_keeps_its_defaults_and_adds_lab_flags():
    if shutil.which("make") is None:
        pytest.skip("needs make")
    out = subprocess.run(["make", "-n", "-o", "setup", "lab", "LAB_FLAGS=--port 8899"],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    line = next(li for li in out.splitlines() if "jupyter lab" in li)
    assert "OMP_WAIT_POLICY=PASSIVE" in line and "OMP_NUM_THREADS=1" in line
    assert "JUPYTER_CONFIG_PATH=" in line and ".jupyter" in line
    assert line.rstrip().endswith("--port 8899 notebooks/")
    assert ("--allow-root" in line) == (os.getuid() == 0)
