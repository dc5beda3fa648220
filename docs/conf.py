"""Sphinx configuration of the docs site. `make docs` runs, from the repository root,
`python -m sphinx -W --keep-going -n -E -b html -c docs -d _build/doctrees . _build/html`.

The source folder is the repository root (not docs/), so README.md, docs/*.md and
notebooks/*.ipynb keep the relative links that work on GitHub and in JupyterLab
(README -> docs/semantics.md, a lesson -> ../docs/semantics.md#anchor); include_patterns
keeps everything else out. The built site needs no network: plotly.js, the widget runtime
and MathJax are served from _static.
"""

import hashlib
import importlib.metadata
import inspect
import json
import os
import re
import shutil
from pathlib import Path

import anywidget
import plotly
from sphinx.ext.napoleon import Config as NapoleonConfig
from sphinx.ext.napoleon.docstring import NumpyDocstring

DOCS = Path(__file__).resolve().parent
REPO = DOCS.parent
PACKAGE = "fa_lab"

project = PACKAGE
release = version = importlib.metadata.version(PACKAGE)
author = f"{PACKAGE} developers"
copyright = f"2026, {PACKAGE} developers"

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx_copybutton",                 # a copy button on every code block
]
# The copy button leaves out prompts and the outputs of doctest-style blocks.
copybutton_prompt_text = r">>> |\.\.\. |\$ "
copybutton_prompt_is_regexp = True

root_doc = "docs/index"
include_patterns = ["README.md", "docs/**", "notebooks/*.ipynb"]
exclude_patterns = ["_build", "**/.ipynb_checkpoints", "docs/_extra"]

# --- MyST: Markdown as GitHub renders it
myst_heading_anchors = 3                 # GitHub-style links: semantics.md#72-the-three-outcomes
myst_enable_extensions = ["dollarmath"]  # $...$ and $$...$$
# MathJax 3 from _static (make docs fetches it), not Sphinx 9's default MathJax 4 from a CDN.
mathjax_path = "mathjax/tex-chtml-full.js"

# --- MyST-NB: lessons run at build time, once, through jupyter-cache
nb_execution_mode = "cache"
nb_execution_timeout = 600               # seconds per cell
nb_execution_raise_on_error = True       # a failing cell fails the build
nb_merge_streams = True
# Kernels that the build starts run this file first (IPython runs $PYTHONSTARTUP): plotly
# figures become HTML that needs plotly.js on the page, not a mime type MyST-NB can't show.
os.environ["PYTHONSTARTUP"] = str(DOCS / "docs_kernel_startup.py")
# The site shows each lesson run with the reference answers (fa_lab.lab.exercises.yours):
# a learner's exercise cell starts as a stub, and the built page keeps the stub's source.
os.environ["FA_LAB_SOLUTIONS"] = "1"
# The dashboards make their FigureWidgets at once (a saved lesson's waits for the first move:
# fa_lab.lab.widgets.Dashboard): the site shares one copy of their widget code per page.
os.environ["FA_LAB_LIVE_FIGURES"] = "1"
nb_execution_show_tb = True              # a failing lesson's traceback in the build log
# jupyter-cache keys a lesson by its code cells alone: a change to the package, the kernels,
# the reference data the lessons read, the kernel startup file or plotly would leave stale
# outputs. The cache's folder name carries a digest of them, so such a change starts a fresh
# cache (and, being a changed setting, a full re-read). Old caches stay until `make docs-clean`.
_sources = sorted(f for top in (PACKAGE, "kernels", "data") for f in (REPO / top).rglob("*")
                  if f.is_file() and "__pycache__" not in f.parts)
_sources.append(DOCS / "docs_kernel_startup.py")
_digest = hashlib.sha256()
for _f in _sources:
    _digest.update(str(_f.relative_to(REPO)).encode() + b"\0" + _f.read_bytes())
_digest.update(f"plotly {plotly.__version__} anywidget {anywidget.__version__}".encode())
nb_execution_cache_path = str(REPO / "_build" / f"jupyter_cache-{_digest.hexdigest()[:12]}")

# --- API reference: autosummary pages in docs/generated/ (not tracked)
autosummary_generate = True
# undoc-members: autosummary's class pages list every attribute; each needs a target (-n)
autodoc_default_options = {"members": True, "undoc-members": True, "show-inheritance": True}
autodoc_typehints = "description"
# Docstrings are prose with ``literals``; the main entry points add NumPy-style sections
# (Parameters, Returns, Examples), which _numpy_sections turns into fields. napoleon is not
# loaded as an extension: it would also read every constant's docstring "X: ..." as a type.
# A callable whose docstring has no Parameters section gets one from its signature
# (_parameters_from_signature).
# One field per entry ("q, k, v : torch.Tensor" stays one), as the docstring groups them.
_NAPOLEON = NapoleonConfig(napoleon_google_docstring=False, napoleon_use_param=False,
                           napoleon_use_rtype=False)
# -n (nitpicky): every cross-reference must resolve. intersphinx would need the network at
# build time, so types from other packages stay unlinked and are not reported.
nitpick_ignore_regex = [
    (r"py:.*", r"(numpy|np|torch|pandas|pd|plotly|go|ipywidgets|dask|distributed)(\..*)?"),
    (r"py:.*", r"(pathlib|os|collections|typing|datetime|contextlib)\..*"),   # the stdlib
    # fa_lab.studies.onset.bound is both a submodule and the function the package exports,
    # so autodoc cannot document names under the submodule's path; annotations there name
    # that path. The classes are documented as fa_lab.studies.onset.Region and .Measure.
    (r"py:class", r"fa_lab\.studies\.onset\.bound\.(Region|Measure|Hazard)"),
    # Region's checks come from a base shared with the kernels' own bounds (not public API);
    # the decode attack's record class is documented with the attack's return value only.
    (r"py:class", r"fa_lab\.kernels\._common\.hazard\.HazardChecks"),
    (r"py:obj", r"fa_lab\.studies\.onset\.Region\.(violated|contains|margins)"),
    (r"py:class", r"fa_lab\.studies\.adversary\.decode_search\.DecodeAttack"),
]


# fa_lab's docstrings are plain text with ``literals``: a bare "|" is a character (|o - 1|,
# an absolute value), never the start of an RST substitution, which the project never
# defines. Escaped here, outside literals, rather than in every docstring.
_LITERAL = re.compile(r"(``.+?``)")


def _numpy_sections(app, what, name, obj, options, lines):
    """A callable's NumPy-style sections (a heading over a line of dashes) as fields."""
    if what in ("function", "method", "class", "exception") and any(
            lines[i].strip() in ("Parameters", "Returns", "Examples")
            and set(lines[i + 1].strip()) == {"-"} for i in range(len(lines) - 1)):
        lines[:] = NumpyDocstring(lines, _NAPOLEON, app, what, name, obj, options).lines()


def _parameters_from_signature(app, what, name, obj, options, lines):
    """A Parameters section for a callable whose docstring has none: one field per
    parameter of its signature, its default, and the docstring's first sentence that names
    it in ``literals`` (a warning class takes its message)."""
    if what not in ("function", "method", "class", "exception"):
        return
    if any(line.lstrip().startswith((":param ", ":parameter ", ":Parameters:"))
           for line in lines):
        return
    if isinstance(obj, type) and issubclass(obj, BaseException):
        lines += ["", ":param message: what happened, and what to do about it.", ""]
        return
    try:
        params = list(inspect.signature(obj).parameters.values())
    except (TypeError, ValueError):
        return
    if params and params[0].name in ("self", "cls") and what == "method":
        params = params[1:]
    if not params:
        return
    text = " ".join(line.strip() for line in lines)
    sentences = re.split(r"(?<=[.;])\s+(?=[A-Z`(])", text)
    fields = [""]
    for p in params:
        star = {p.VAR_POSITIONAL: r"\*", p.VAR_KEYWORD: r"\*\*"}.get(p.kind, "")
        desc = next((s for s in sentences if f"``{p.name}``" in s), "")
        if p.default is not p.empty:
            desc = f"{desc} Default ``{p.default!r}``." if desc else f"Default ``{p.default!r}``."
        fields.append(f":param {star}{p.name}: {desc or 'see above.'}".rstrip())
    lines += fields + [""]


def _escape_bars(app, what, name, obj, options, lines):
    for i, line in enumerate(lines):
        if "|" in line:
            parts = _LITERAL.split(line)
            lines[i] = "".join(p if p.startswith("``") else re.sub(r"(?<!\\)\|", r"\\|", p)
                               for p in parts)


# --- HTML
html_theme = "sphinx_book_theme"
html_title = f"{PACKAGE} {version}"
html_theme_options = {"show_toc_level": 2}
html_css_files = ["fa_lab.css"]
html_extra_path = ["_extra"]             # index.html at the site root -> docs/index.html
# _build/vendor-js/ (make docs fetches it from the npm registry): jupyter-widgets/ (require.js,
# html-manager's embed-amd.js and its fonts) and mathjax/.
html_static_path = ["_static", str(REPO / "_build" / "vendor-js")]
if not (REPO / "_build" / "vendor-js.stamp").exists():
    raise RuntimeError("_build/vendor-js is missing: run `make docs`, which fetches it")

# Widgets: MyST-NB embeds the widget state saved by the execution and, on pages that have
# some, loads the ipywidgets page runtime, from CDNs unless told otherwise.
nb_ipywidgets_js = {
    "jupyter-widgets/require.js": {},
    "jupyter-widgets-offline.js": {},    # requirejs paths: anywidget etc. from _static
    "jupyter-widgets/embed-amd.js": {},
}

_PLOTLY_DATA = Path(plotly.__file__).parent / "package_data"
_PLOTLY_JS = _PLOTLY_DATA / "plotly.min.js"                # plotly.js, for go.Figure output
_PLOTLY_WIDGET_JS = _PLOTLY_DATA / "widgetbundle.js"       # FigureWidget's anywidget module
_ANYWIDGET_JS = Path(anywidget.__file__).parent / "nbextension" / "index.js"  # AMD build
# A FigureWidget's saved state holds plotly's whole widget bundle (its `_esm`, ~5 MB with
# plotly.js inside) once per figure. Each page gets a stub instead that imports one shared
# copy from _static, located from the page's own jupyter-widgets-offline.js tag.
_PLOTLY_WIDGET_STUB = (
    "const here = document.querySelector('script[src*=\"jupyter-widgets-offline.js\"]').src;\n"
    "const m = await import(new URL('jupyter-widgets/plotly-widgetbundle.js', here).href);\n"
    "export default m.default;\n")


#: A page's plain figures (plotly-graph-div) draw from a queue once plotly.js is there: at
#: once where plotly.min.js loaded, or after the dashboards' widget bundle (plotly.js inside;
#: importing it sets window.Plotly) loaded, on pages that have one. So plotly.js loads once.
_FIGURE_QUEUE = "(window.faLabFigures = window.faLabFigures || []).push(function () {%s});"
_DRAW_QUEUED = (
    "const here = document.querySelector('script[src*=\"jupyter-widgets-offline.js\"]').src;\n"
    "await import(new URL('jupyter-widgets/plotly-widgetbundle.js', here).href);\n"
    "const queued = window.faLabFigures || [];\n"
    "window.faLabFigures = {push: (draw) => draw()};\n"
    "for (const draw of queued) draw();\n")
_FIGURE_SCRIPT = re.compile(r"(<script[^>]*>)(\s*window\.PLOTLYENV.*?)(</script>)", re.S)


def _plotly_js_on_figure_pages(app, pagename, templatename, context, doctree):
    body = context.get("body", "")
    if "plotly-graph-div" not in body:
        return
    if pagename in _PAGES_WITH_PLOTLY_WIDGETS:
        context["body"] = _FIGURE_SCRIPT.sub(lambda m: m[1] + _FIGURE_QUEUE % m[2] + m[3], body)
        app.add_js_file(None, body=_DRAW_QUEUED, type="module", priority=900)
    else:
        app.add_js_file("plotly.min.js", priority=400)


#: Pages whose saved widget state holds plotly's widget bundle (filled while writing them).
_PAGES_WITH_PLOTLY_WIDGETS: set[str] = set()


#: Above every dashboard on the site: its figures were drawn when the site was built.
SNAPSHOT_NOTICE = (
    '<div class="admonition note fa-lab-snapshot"><p class="admonition-title">A snapshot</p>'
    "<p>This dashboard was saved when the site was built: its controls move, but its figures "
    "stay as they were drawn. To run it live, open the lesson in JupyterLab "
    "(<code>make lab</code>, or <code>fa-lab lab</code> from an installed package).</p></div>")
#: The book theme's text column at 1440 px and wider, less a margin (px): a box wider than
#: this takes the column's width on the site, a figure this width.
_COLUMN_PX = 760


def _px(width) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)px\s*", str(width or ""))
    return float(m.group(1)) if m else 0.0


def _fit_dashboard(state: dict) -> None:
    """The saved dashboards, made to fit the text column: boxes wider than it take its width,
    a row of boxes (an HBox: the controls beside the figures) wraps so its parts stack, and
    plotly figures wider than it are drawn at its width."""
    rows = {model["state"]["layout"].removeprefix("IPY_MODEL_") for model in state.values()
            if model.get("model_name") == "HBoxModel" and "layout" in model.get("state", {})}
    for key, model in state.items():
        s = model.get("state", {})
        if model.get("model_name") == "LayoutModel" and _px(s.get("width")) > _COLUMN_PX:
            s["width"] = "100%"
            if key in rows:
                s["flex_flow"] = "row wrap"
        width = s.get("_layout", {}).get("width") if isinstance(s.get("_layout"), dict) else None
        if isinstance(width, (int, float)) and width > _COLUMN_PX:
            s["_layout"] = {**s["_layout"], "width": _COLUMN_PX}


def _share_plotly_widget_bundle(app, pagename, templatename, context, doctree):
    js_files = getattr(app.env, "nb_metadata", {}).get(pagename, {}).get("js_files", {})
    if "ipywidgets_state" not in js_files:
        return
    uri, kwargs = js_files["ipywidgets_state"]
    state = json.loads(kwargs["body"])
    bundle = _PLOTLY_WIDGET_JS.read_text(encoding="utf-8")
    for model in state.get("state", {}).values():
        if model.get("state", {}).get("_esm") == bundle:
            model["state"]["_esm"] = _PLOTLY_WIDGET_STUB
            _PAGES_WITH_PLOTLY_WIDGETS.add(pagename)
    _fit_dashboard(state.get("state", {}))
    # each saved widget view on the page is a dashboard (or part of one): a notice above it
    context["body"] = re.sub(r'(<script type="application/vnd\.jupyter\.widget-view\+json">)',
                             SNAPSHOT_NOTICE.replace("\\", "\\\\") + r"\1", context["body"])
    body = json.dumps(state).replace("</script>", r"<\/script>")
    js_files["ipywidgets_state"] = (uri, {**kwargs, "body": body})


def _copy_js(app, exc):
    if exc is None and app.builder.format == "html":
        static = Path(app.outdir) / "_static"
        shutil.copyfile(_PLOTLY_JS, static / "plotly.min.js")
        shutil.copyfile(_ANYWIDGET_JS, static / "jupyter-widgets" / "anywidget.js")
        shutil.copyfile(_PLOTLY_WIDGET_JS, static / "jupyter-widgets" / "plotly-widgetbundle.js")


def setup(app):
    app.connect("autodoc-process-docstring", _escape_bars)
    app.connect("autodoc-process-docstring", _numpy_sections, priority=550)
    app.connect("autodoc-process-docstring", _parameters_from_signature, priority=600)
    # before MyST-NB's own handler (priority 500) puts the page's widget state on it
    app.connect("html-page-context", _share_plotly_widget_bundle, priority=400)
    # after it: a page with the widget bundle draws its plain figures with that plotly.js
    app.connect("html-page-context", _plotly_js_on_figure_pages, priority=450)
    app.connect("build-finished", _copy_js)
