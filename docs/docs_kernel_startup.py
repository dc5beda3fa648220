"""Runs in every kernel that the docs build starts (conf.py sets PYTHONSTARTUP to this file;
IPython kernels run it before the first cell). Not part of the package.

Plotly figures become plain HTML: a div and a ``Plotly.newPlot`` call, with neither
plotly.js nor MathJax in the output. The page loads plotly.js from ``_static`` (conf.py
adds it to pages that hold a figure), so a built page needs no network. Plotly's own
defaults don't fit a Sphinx site: under nbclient it emits only
``application/vnd.plotly.v1+json`` (MyST-NB has no renderer for it: a warning, and no
figure); ``notebook`` inlines 4.8 MB of plotly.js into every page with a figure;
``notebook_connected`` loads plotly.js from a CDN; and every HTML renderer adds a MathJax
<script> from a CDN to each figure.

A figure's own ``layout.width`` is dropped here: the lab sizes its figures for JupyterLab
(up to about 1700 px for the multi-panel ones), wider than the site's text column, where a
fixed width would be cut off. On the site every figure takes its column's width
(``responsive``) and keeps its height.
"""

try:
    import plotly.io as pio
    from plotly.io.base_renderers import MimetypeRenderer
except ImportError:  # a notebook that never imports plotly still runs
    pass
else:
    class _SphinxPageRenderer(MimetypeRenderer):
        def to_mimebundle(self, fig_dict):
            fig_dict = {**fig_dict, "layout": {k: v for k, v in fig_dict.get("layout", {}).items()
                                               if k not in ("width", "autosize")}}
            html = pio.to_html(fig_dict, include_plotlyjs=False, include_mathjax=False,
                               full_html=False, default_width="100%", default_height=525,
                               validate=False, config={"responsive": True})
            return {"text/html": html}

    pio.renderers["sphinx_page"] = _SphinxPageRenderer()
    pio.renderers.default = "sphinx_page"
    del _SphinxPageRenderer, MimetypeRenderer
