"""Sphinx configuration of the docs site. `make docs` runs, from the repository root,
`python -m sphinx -W --keep-going -n -E -b html -c docs -d _build/doctrees . _build/html`.

The source folder is the repository root (not docs/), so README.md, docs/*.md and
notebooks/*.ipynb keep the relative links that work on GitHub and in JupyterLab
(README -> docs/semantics.md, a lesson -> ../docs/semantics.md#anchor); include_patterns
keeps everything else out. The built site needs no network: plotly.js and MathJax are
served from _static, and the lessons' dashboards are static HTML (widget_snapshot.py).
"""

import hashlib
import importlib.metadata
import inspect
import json
import os
import re
import sys
from pathlib import Path

import anywidget
import plotly
from sphinx.ext.napoleon import Config as NapoleonConfig
from sphinx.ext.napoleon.docstring import NumpyDocstring

DOCS = Path(__file__).resolve().parent
REPO = DOCS.parent
sys.path.insert(0, str(DOCS))
import widget_snapshot  # noqa: E402  (docs/widget_snapshot.py)
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
#: The repository's public home, where the site is published from: FA_LAB_REPOSITORY_URL
#: (e.g. https://github.com/OWNER/fa_lab). With it, each page's header gets the repository
#: button and each lesson a Binder launch button (JupyterLab, the environment built from that
#: repository's environment.yml); without it the site names no repository, since a guessed
#: address would send readers somewhere wrong.
REPOSITORY_URL = os.environ.get("FA_LAB_REPOSITORY_URL") or None
html_theme_options = {"show_toc_level": 2}
if REPOSITORY_URL:
    html_theme_options.update({
        "repository_url": REPOSITORY_URL,
        "repository_branch": "main",
        "path_to_docs": "",              # the source folder is the repository's root
        "use_repository_button": True,
        "launch_buttons": {"binderhub_url": "https://mybinder.org",
                           "notebook_interface": "jupyterlab"},
    })
html_css_files = ["fa_lab.css"]
html_extra_path = ["_extra"]             # index.html at the site root -> docs/index.html
# _build/vendor-js/ (make docs fetches it from the npm registry): mathjax/ and plotly.js.
html_static_path = ["_static", str(REPO / "_build" / "vendor-js")]
if not (REPO / "_build" / "vendor-js.stamp").exists():
    raise RuntimeError("_build/vendor-js is missing: run `make docs`, which fetches it")
# The theme's icons come from the Font Awesome web fonts in its CSS; its fontawesome.js (all
# of Font Awesome again, as SVG in JavaScript, 1.6 MB on every page) is left out
# (_templates/layout.html), as the site adds no icons of its own.
templates_path = ["_templates"]

_VENDOR = REPO / "_build" / "vendor-js"

#: plotly.js for every figure on the site, loaded once per page with a plain <script> (it
#: sets window.Plotly): the cartesian bundle (scatter, bar, heatmap and the other 2-d
#: traces; the lab draws no other), a third of the full plotly.min.js that plotly ships. It
#: must be the plotly.js version the installed plotly writes figures for.
PLOTLY_JS = "plotly-cartesian.min.js"


def _check_plotly_js() -> None:
    from plotly.offline import get_plotlyjs_version

    want = get_plotlyjs_version()
    head = (_VENDOR / PLOTLY_JS).read_text(encoding="utf-8")[:300]
    m = re.search(r"plotly\.js \(cartesian - minified\) v(\S+)", head)
    if m is None or m.group(1) != want:
        raise RuntimeError(
            f"_build/vendor-js/{PLOTLY_JS} is plotly.js {m and m.group(1)}, but plotly "
            f"{plotly.__version__} writes figures for plotly.js {want}: delete "
            "_build/vendor-js.stamp and run `make docs`, which fetches the matching one")


_check_plotly_js()


def _plotly_js_on_figure_pages(app, pagename, templatename, context, doctree):
    if "plotly-graph-div" in context.get("body", ""):
        app.add_js_file(PLOTLY_JS, priority=400)


#: Above every dashboard on the site: its figures were drawn when the site was built.
SNAPSHOT_NOTICE = (
    '<div class="admonition note fa-lab-snapshot"><p class="admonition-title">A snapshot</p>'
    "<p>This dashboard was saved when the site was built: its controls show the values its "
    "figures were drawn with, and do not move; the figures answer the mouse. To run it live, "
    "open the lesson in JupyterLab: <code>make lab</code> in a checkout or <code>fa-lab lab</code> "
    "from an installed package"
    + (", or on Binder from the launch button (the rocket) at the top of this page"
       if REPOSITORY_URL else "") + ".</p></div>")
_WIDGET_VIEW = re.compile(
    r'<script type="application/vnd\.jupyter\.widget-view\+json">(.*?)</script>', re.S)


def _static_dashboards(app, pagename, templatename, context, doctree):
    """Each saved dashboard on the page as static HTML under the snapshot notice
    (widget_snapshot.py says how), in place of ipywidgets' page runtime: MyST-NB's widget
    state and runtime scripts are taken off the page."""
    js_files = getattr(app.env, "nb_metadata", {}).get(pagename, {}).get("js_files", {})
    body = context.get("body", "")
    if "ipywidgets_state" not in js_files:
        if _WIDGET_VIEW.search(body):
            raise RuntimeError(f"{pagename}: a widget view without saved widget state")
        return
    state = json.loads(js_files["ipywidgets_state"][1]["body"])["state"]

    def snapshot(m):
        view = json.loads(m.group(1))
        return (f'<div class="fa-lab-snapshot-dashboard">{SNAPSHOT_NOTICE}'
                f'{widget_snapshot.render(view["model_id"], state)}</div>')

    context["body"] = _WIDGET_VIEW.sub(snapshot, body)
    for key in [k for k in js_files if k.startswith("ipywidgets_")]:
        del js_files[key]


def setup(app):
    app.connect("autodoc-process-docstring", _escape_bars)
    app.connect("autodoc-process-docstring", _numpy_sections, priority=550)
    app.connect("autodoc-process-docstring", _parameters_from_signature, priority=600)
    # before MyST-NB's own handler (priority 500) would put the widget state and runtime on it
    app.connect("html-page-context", _static_dashboards, priority=400)
    # after it: plotly.js on each page with a figure, plain or in a dashboard
    app.connect("html-page-context", _plotly_js_on_figure_pages, priority=450)
