"""The built docs site (``make docs``) in headless Chromium, offline: the lessons' plotly
figures draw and answer the mouse, their dashboards render from the saved widget state,
the math renders, and the API reference lists ``flash_attn_func``.

Serves ``_build/html`` (``DOCS_HTML`` names another folder) with http.server on a free
localhost port, opens pages in Debian's /usr/bin/chromium driven by playwright (no browser
is downloaded), and aborts every request that leaves localhost, so a page that needs a CDN
fails here as it would on an offline machine. ``make docs-test`` builds the site and runs
this file; under a plain ``pytest tests`` it skips until the site is built.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import threading
from pathlib import Path
from urllib.parse import urlparse

import pytest

try:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
except ImportError:  # the fixture skips
    PlaywrightTimeout = TimeoutError

REPO = Path(__file__).resolve().parents[2]
HTML = Path(os.environ.get("DOCS_HTML", REPO / "_build" / "html"))
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
#: a lesson whose figures are plain plotly figures, and one with a dashboard
FIGURES_PAGE = "notebooks/00_tour.html"
DASHBOARD_PAGE = "notebooks/02_lazy_rescale.html"

pytestmark = [
    pytest.mark.skipif(not CHROMIUM.exists(),
                       reason="needs Debian's /usr/bin/chromium (apt-get install chromium)"),
    pytest.mark.skipif(not (HTML / "index.html").exists(),
                       reason="no built site: make docs-test builds it and runs this file"),
]


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@contextlib.contextmanager
def serve(root: Path):
    handler = functools.partial(_QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def new_page():
    """A page factory; each page records the requests it tried to send off the machine
    (``page.external``), the URLs that answered 4xx/5xx (``page.missing``) and its
    JavaScript errors (``page.errors``)."""
    sync_api = pytest.importorskip("playwright.sync_api")
    with serve(HTML) as base, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        context = browser.new_context(viewport={"width": 1400, "height": 1000})

        def offline(route):
            host = urlparse(route.request.url).hostname
            if host in ("127.0.0.1", "localhost"):
                route.continue_()
            else:
                route.request.frame.page.external.append(route.request.url)
                route.abort()

        context.route("**/*", offline)

        def make(path: str, on_response=None):
            page = context.new_page()
            page.external, page.errors, page.missing = [], [], []
            page.on("pageerror", lambda exc: page.errors.append(str(exc)))
            page.on("response", lambda r: r.status >= 400 and page.missing.append(r.url))
            if on_response is not None:
                page.on("response", on_response)
            page.goto(f"{base}/{path}", wait_until="load")
            return page

        yield make
        browser.close()


def test_root_redirects_to_the_docs(new_page):
    page = new_page("index.html")
    page.wait_for_url("**/docs/index.html")
    assert "fa_lab" in page.title()
    # the course is in the navigation, lessons in order
    nav = page.locator("nav.bd-docs-nav a").all_inner_texts()
    lessons = [t for t in nav if t[:2].isdigit()]
    assert lessons[:3] == sorted(lessons)[:3] and len(lessons) >= 3, nav


def test_lesson_plotly_figure_draws_offline(new_page):
    page = new_page(FIGURES_PAGE)
    page.wait_for_selector(".js-plotly-plot .main-svg", timeout=20_000)
    # a trace drew, and the figure is interactive: plotly.js and its modebar are there
    assert page.locator(".js-plotly-plot .scatterlayer .trace").count() >= 1
    assert page.locator(".js-plotly-plot .modebar").count() >= 1
    assert page.evaluate("typeof window.Plotly") == "object"
    assert not page.errors, page.errors


def test_lesson_plotly_figure_hovers(new_page):
    """Interactive, not a picture: hovering a point shows plotly's hover label."""
    page = new_page(FIGURES_PAGE)
    page.wait_for_selector(".js-plotly-plot .main-svg", timeout=20_000)
    gd = page.locator(".js-plotly-plot").first
    gd.scroll_into_view_if_needed()
    # the pixel of the first trace's middle point, from plotly's own axes
    x, y = gd.evaluate("""gd => {
        const xa = gd._fullLayout.xaxis, ya = gd._fullLayout.yaxis, t = gd._fullData[0];
        const i = Math.floor(t.x.length / 2), r = gd.getBoundingClientRect();
        return [r.left + xa._offset + xa.l2p(t.x[i]), r.top + ya._offset + ya.l2p(t.y[i])];
    }""")
    page.mouse.move(x, y)
    page.wait_for_selector(".js-plotly-plot .hoverlayer .hovertext", timeout=5_000)


def _follow(page, css: str, text: str):
    """Click the one link ``css`` that reads ``text``."""
    link = page.locator(css, has_text=text)
    assert link.count() == 1, (text, link.count())
    link.click()


def test_api_page_lists_flash_attn_func(new_page):
    page = new_page("docs/api.html")
    _follow(page, "table.autosummary a", "flash_attn_func")
    page.wait_for_load_state("load")
    sig = page.locator("dt.sig#fa_lab\\.flash_attn_func")
    assert sig.count() == 1
    assert "causal" in sig.inner_text() and "rescale" in sig.inner_text()
    # the docstring itself, not only the signature
    assert "gfx950" in page.locator("dl.py.function").first.inner_text()


def test_dashboard_renders_from_saved_state(new_page):
    """A lesson's dashboard (ipywidgets and plotly FigureWidgets, an anywidget) renders
    from the widget state the build saved, with the page runtime from _static: no kernel,
    no CDN."""
    page = new_page(DASHBOARD_PAGE)
    page.wait_for_selector(".fa-lab-dashboard .widget-slider", timeout=30_000)
    dash = page.locator(".fa-lab-rescale-dashboard").first
    assert dash.locator(".widget-slider").filter(has_text="K scale").count() == 1
    page.wait_for_function(
        "document.querySelectorAll('.fa-lab-dashboard .js-plotly-plot .main-svg').length >= 2",
        timeout=30_000)
    assert dash.locator(".js-plotly-plot .scatterlayer .trace").count() >= 1
    assert not page.errors, page.errors


def test_math_renders_offline(new_page):
    page = new_page("docs/semantics.html")
    page.wait_for_selector("mjx-container", timeout=20_000)
    assert page.locator("mjx-container[display=true]").count() >= 1
    assert not page.errors, page.errors


def test_guide_links_reach_the_lessons(new_page):
    page = new_page("README.html")
    _follow(page, "article a", "00 a tour")
    page.wait_for_url("**/notebooks/00_tour.html")
    assert page.locator("h1").first.inner_text().startswith("00")


PAGES = ["docs/index.html", "README.html", "docs/semantics.html", "docs/api.html",
         FIGURES_PAGE, DASHBOARD_PAGE]


@pytest.mark.parametrize("path", PAGES)
def test_no_page_needs_the_network(new_page, path):
    """Every script, style and font a page loads comes from the site itself."""
    page = new_page(path)
    # widgets and MathJax load after "load"; Playwright's networkidle can fail to fire on a
    # page that is quiet, so it only bounds the wait
    with contextlib.suppress(PlaywrightTimeout):
        page.wait_for_load_state("networkidle", timeout=10_000)
    page.wait_for_timeout(500)
    assert page.external == [], page.external
    assert page.missing == [], page.missing
    assert not page.errors, page.errors


def _lesson_pages() -> list[str]:
    return sorted(f"notebooks/{p.name}" for p in (HTML / "notebooks").glob("*.html"))


def _overflowing_figures(page) -> list:
    """The plotly figures on ``page`` wider than the article's text column, by pixels: a
    figure wider than its column is cut off (the book theme clips the column)."""
    return page.evaluate("""() => {
        const col = document.querySelector('article.bd-article');
        const right = col.getBoundingClientRect().right + 1;
        return [...document.querySelectorAll('.js-plotly-plot')]
            .map(gd => [gd.id || gd.className, Math.round(gd.getBoundingClientRect().right - right)])
            .filter(([_, over]) => over > 0);
    }""")


def test_every_lesson_figure_fits_its_column(new_page):
    """At a laptop's and a desktop's width (1440 and 1920 px), no lesson figure, plain or in
    a dashboard, runs past the text column."""
    pages = _lesson_pages()
    assert len(pages) >= 8, pages
    over, drawn = {}, 0
    for path in pages:
        page = new_page(path)
        if page.locator(".js-plotly-plot, script[type*='widget-view']").count():
            with contextlib.suppress(PlaywrightTimeout):
                page.wait_for_load_state("networkidle", timeout=5_000)
            page.wait_for_selector(".js-plotly-plot .main-svg", timeout=30_000)
        for width in (1440, 1920):
            page.set_viewport_size({"width": width, "height": 1000})
            page.wait_for_timeout(400)  # responsive figures redraw after a resize
            drawn += page.locator(".js-plotly-plot .main-svg").count()
            if bad := _overflowing_figures(page):
                over[f"{path} at {width}px"] = bad
        page.close()
    assert drawn >= 40, drawn  # the figures drew, so their widths were measured
    assert not over, over


def test_every_dashboard_sits_under_the_snapshot_notice(new_page):
    """Each saved dashboard says it is a snapshot and how to run it live."""
    page = new_page(DASHBOARD_PAGE)
    page.wait_for_selector(".fa-lab-dashboard", timeout=30_000)
    views = page.locator("script[type='application/vnd.jupyter.widget-view+json']").count()
    notices = page.locator(".fa-lab-snapshot")
    assert views >= 1 and notices.count() == views, (views, notices.count())
    assert "make lab" in notices.first.inner_text()


def test_landing_page_has_a_pitch_a_quick_start_and_the_lessons(new_page):
    page = new_page("docs/index.html")
    article = page.locator("article.bd-article")
    assert page.locator("h1").first.inner_text().strip() != "fa_lab"  # not the guide's title
    assert article.locator("img").count() >= 1
    quick = article.locator("div.highlight pre").first.inner_text()
    assert "make setup" in quick and "make lab" in quick
    lessons = {p.split("/")[-1].removesuffix(".html") for p in _lesson_pages()
               if p.split("/")[-1][:2].isdigit()}
    linked = {h.split("/")[-1].split("#")[0].removesuffix(".html")
              for h in article.locator("table a").evaluate_all("as => as.map(a => a.href)")}
    assert lessons <= linked, lessons - linked
    # "Next" leads into the course, not through the guide
    nxt = page.locator("a.right-next")
    assert nxt.get_attribute("href").endswith("notebooks/00_tour.html"), nxt.get_attribute("href")
    # furniture: a copy button on code blocks, and the version in the title
    assert page.locator("button.copybtn").count() >= 1
    import importlib.metadata
    assert importlib.metadata.version("fa_lab") in page.title()


def test_every_lesson_loads_plotly_once(new_page):
    """plotly.js comes once per page (plotly.min.js for plain figures, or the dashboards'
    widget bundle, which holds it and draws the plain figures too)."""
    twice = {}
    for path in _lesson_pages():
        urls: list[str] = []     # every file the page fetched
        page = new_page(path, on_response=lambda response, urls=urls: urls.append(response.url))
        with contextlib.suppress(PlaywrightTimeout):
            page.wait_for_load_state("networkidle", timeout=10_000)
        page.wait_for_timeout(500)
        plotly = [u for u in urls  # Sphinx adds a ?v=<hash> query to its scripts
                  if u.split("?")[0].endswith(("plotly.min.js", "plotly-widgetbundle.js"))]
        if len(plotly) > 1:
            twice[path] = plotly
        if "plotly-graph-div" in page.content() or "widget-view" in page.content():
            assert plotly, f"{path}: figures, but no plotly.js loaded"
        page.close()
    assert not twice, twice
