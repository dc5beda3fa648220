"""The built docs site (``make docs``) in headless Chromium, offline: the lessons' plotly
figures draw, answer the mouse and fit the text column; their dashboards render from the
saved widget state as snapshots, each under its notice; a lesson's page loads plotly.js
once and weighs under 6 MB; the math renders; the landing page, the header's repository
and Binder links, and the API reference are there.

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
import re
import threading
from pathlib import Path
from urllib.parse import unquote, urlparse

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
    """A lesson's dashboard is drawn from the widget state the build saved, as static HTML
    (docs/widget_snapshot.py): its controls at their saved values and disabled, its plotly
    figures drawn and answering the mouse; no widget runtime, no kernel, no CDN."""
    page = new_page(DASHBOARD_PAGE)
    dash = page.locator(".fa-lab-rescale-dashboard").first
    k_scale = dash.locator(".fa-lab-snapshot-control", has_text="K scale")
    assert k_scale.count() == 1
    slider = k_scale.locator("input[type=range]")
    assert slider.is_disabled() and slider.input_value() == k_scale.locator("output").inner_text()
    policy = dash.locator(".fa-lab-snapshot-control", has_text="policy").locator("select")
    assert policy.is_disabled() and policy.input_value()
    page.wait_for_function(
        "document.querySelectorAll('.fa-lab-dashboard .js-plotly-plot .main-svg').length >= 4",
        timeout=30_000)
    assert dash.locator(".js-plotly-plot .scatterlayer .trace").count() >= 1
    assert dash.locator(".js-plotly-plot .heatmaplayer image, .js-plotly-plot .hm").count() >= 1
    assert page.locator("script[type*='jupyter.widget']").count() == 0
    assert page.evaluate("typeof window.requirejs") == "undefined"
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
    a dashboard, runs past the text column; and every trace is of a type the site's plotly.js
    bundle draws."""
    pages = _lesson_pages()
    assert len(pages) >= 8, pages
    over, unknown, drawn = {}, {}, 0
    for path in pages:
        page = new_page(path)
        if page.locator(".plotly-graph-div").count():
            with contextlib.suppress(PlaywrightTimeout):
                page.wait_for_load_state("networkidle", timeout=5_000)
            page.wait_for_selector(".js-plotly-plot .main-svg", timeout=30_000)
            if types := page.evaluate(_UNDRAWABLE_TRACES):
                unknown[path] = types
        for width in (1440, 1920):
            page.set_viewport_size({"width": width, "height": 1000})
            page.wait_for_timeout(400)  # responsive figures redraw after a resize
            drawn += page.locator(".js-plotly-plot .main-svg").count()
            if bad := _overflowing_figures(page):
                over[f"{path} at {width}px"] = bad
        page.close()
    assert drawn >= 40, drawn  # the figures drew, so their widths were measured
    assert not over, over
    assert not unknown, unknown


#: The trace types on ``page`` that its plotly.js bundle cannot draw (it would leave them out).
_UNDRAWABLE_TRACES = """() => {
    const known = window.Plotly.PlotSchema.get().traces;
    return [...document.querySelectorAll('.js-plotly-plot')]
        .flatMap(gd => (gd.data || []).map(t => t.type || 'scatter'))
        .filter(type => !(type in known));
}"""


def test_lesson_pages_link_the_repository_and_launch_on_binder_only_when_it_is_named(new_page):
    """With FA_LAB_REPOSITORY_URL set at build time, a lesson's header has the repository
    button and a Binder launch link that opens that lesson in JupyterLab, built from the
    repository (and so its environment.yml); without it, the site links no repository and
    no Binder (conf.py guesses no address), and the snapshot notice offers none."""
    repo_url = os.environ.get("FA_LAB_REPOSITORY_URL")
    page = new_page(FIGURES_PAGE)
    hrefs = page.locator(".article-header-buttons a").evaluate_all("as => as.map(a => a.href)")
    binder = [h for h in hrefs if "mybinder.org" in h]
    if not repo_url:
        assert not binder and not [h for h in hrefs if "github.com" in h], hrefs
        return
    owner_name = urlparse(repo_url).path.strip("/")
    assert repo_url in hrefs, hrefs
    assert binder == [f"https://mybinder.org/v2/gh/{owner_name}/main"
                      f"?urlpath=lab/tree/{FIGURES_PAGE.removesuffix('.html')}.ipynb"], hrefs
    assert (REPO / "environment.yml").is_file()


def test_every_dashboard_sits_under_the_snapshot_notice(new_page):
    """Each dashboard on the site, on every page, sits under a notice that says it is a
    snapshot and how to run it live; no page keeps a widget view the site cannot draw."""
    dashboards, bare, views = 0, {}, {}
    for html in sorted(HTML.rglob("*.html")):
        text = html.read_text(encoding="utf-8")
        name = str(html.relative_to(HTML))
        if "jupyter.widget-view+json" in text or "jupyter.widget-state+json" in text:
            views[name] = text.count("jupyter.widget-view+json")
        roots = len(re.findall(r'class="[^"]*\bfa-lab-dashboard\b', text))
        dashboards += roots
        under = len(re.findall(r'<div class="fa-lab-snapshot-dashboard"><div class="admonition note '
                               r'fa-lab-snapshot">.*?</div><div class="[^"]*\bfa-lab-dashboard\b',
                               text))
        if roots != under:
            bare[name] = roots - under
    assert dashboards >= 2 and not bare and not views, (dashboards, bare, views)
    page = new_page(DASHBOARD_PAGE)
    notice = page.locator(".fa-lab-snapshot").first
    text = notice.inner_text()
    assert "snapshot" in text and "make lab" in text and "fa-lab lab" in text
    assert ("Binder" in text) == bool(os.environ.get("FA_LAB_REPOSITORY_URL"))
    box, dash = notice.bounding_box(), page.locator(".fa-lab-dashboard").first.bounding_box()
    assert box["y"] + box["height"] <= dash["y"], (box, dash)


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
    # one card per lesson, laid out side by side (the table's rows as boxes, fa_lab.css)
    cards = article.locator("section#the-course table tbody tr")
    assert cards.count() >= len(lessons)
    assert cards.first.evaluate("tr => getComputedStyle(tr).display") == "flex"
    tops = {round(box["y"]) for box in (cards.nth(i).bounding_box() for i in range(cards.count()))}
    assert len(tops) < cards.count(), "the cards stack one a row, like a table"
    # "Next" leads into the course, not through the guide
    nxt = page.locator("a.right-next")
    assert nxt.get_attribute("href").endswith("notebooks/00_tour.html"), nxt.get_attribute("href")
    # furniture: a copy button on code blocks, and the version in the title
    assert page.locator("button.copybtn").count() >= 1
    import importlib.metadata
    assert importlib.metadata.version("fa_lab") in page.title()


#: The most a lesson's page may download, everything it loads counted (bytes).
LESSON_PAGE_BYTES = 6_000_000


def _site_file(url: str) -> Path | None:
    """The file of the built site that ``url`` (served from it) names."""
    path = unquote(urlparse(url).path).lstrip("/")
    return HTML / path if (HTML / path).is_file() else None


def test_every_lesson_loads_plotly_once_and_weighs_under_6_mb(new_page):
    """plotly.js comes once per page (one file, for the plain figures and the dashboards'
    alike), and a lesson's page with everything it loads (HTML, scripts, styles, fonts,
    images) is under 6 MB, as a reader's browser fetches it uncompressed."""
    twice, heavy, weights = {}, {}, {}
    for path in _lesson_pages():
        urls: list[str] = []     # every file the page fetched
        page = new_page(path, on_response=lambda response, urls=urls: urls.append(response.url))
        with contextlib.suppress(PlaywrightTimeout):
            page.wait_for_load_state("networkidle", timeout=10_000)
        page.wait_for_timeout(500)
        plotly = [u for u in urls  # Sphinx adds a ?v=<hash> query to its scripts
                  if "plotly" in u.split("?")[0].rsplit("/", 1)[-1] and u.split("?")[0].endswith(".js")]
        if len(plotly) > 1:
            twice[path] = plotly
        if "plotly-graph-div" in page.content():
            assert plotly, f"{path}: figures, but no plotly.js loaded"
        files = {u.split("?")[0]: _site_file(u) for u in urls}
        assert all(files.values()), [u for u, f in files.items() if f is None]
        weights[path] = sum(f.stat().st_size for f in files.values())
        if weights[path] > LESSON_PAGE_BYTES:
            heavy[path] = sorted(((f.stat().st_size, u.rsplit("/", 1)[-1])
                                  for u, f in files.items()), reverse=True)[:5]
        page.close()
    assert not twice, twice
    assert len(weights) >= 8 and not heavy, {p: (weights[p], top) for p, top in heavy.items()}


#: The API pages the issue asks an example on, each with the callable's anchor.
API_EXAMPLES = {"fa_lab.flash_attn_func": "fa_lab.flash_attn_func", "fa_lab.trace": "fa_lab.trace",
                "fa_lab.compare": "fa_lab.compare", "fa_lab.count_rescales": "fa_lab.count_rescales",
                "fa_lab.studies.onset.bound": "fa_lab.studies.onset.bound",
                "fa_lab.zoo": "fa_lab.zoo.get"}


@pytest.mark.parametrize("page, anchor", sorted(API_EXAMPLES.items()))
def test_api_page_has_parameters_and_an_example(page, anchor):
    """The built page of each main entry point lists its parameters and shows an example
    (a doctest block), inside that callable's own entry."""
    text = (HTML / "docs" / "generated" / f"{page}.html").read_text(encoding="utf-8")
    start = text.index(f'id="{anchor}"')
    entry = text[start:text.find('<dl class="py', start + 1) % (len(text) + 1)]
    assert re.search(r'<dt class="field-[a-z]+">Parameters', entry), anchor
    assert 'class="rubric">Examples</p>' in entry and 'class="doctest highlight' in entry, anchor
