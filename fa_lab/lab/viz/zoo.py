"""The failure zoo's figures: one entry's mechanism as a strip of a row's state per step
(before its fix beside after), and a hazard's boundary against its formula."""

from __future__ import annotations

import math

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .style import NONFINITE_COLOR
from .tracedata import fmt_number

#: The row state a strip shows, top to bottom: (``row_history`` key, label).
QUANTITIES = (("mt", "tile max mt"), ("m", "base m"), ("factor", "factor f (l)"),
              ("o_factor", "factor on O"), ("p_max", "largest P"), ("l", "row sum l"),
              ("o_max", "largest |O|"))
#: What a cell holds, and its colour: a finite value, one past the P cast's largest value,
#: -inf (an empty max), +inf, NaN.
CELL_KINDS = (("finite", "#eef2f7"), ("past the cast", "#f4a261"), ("-inf", "#fff3b0"),
              ("+inf", "#e76f51"), ("NaN", NONFINITE_COLOR))


def _kind(name: str, x: float, p_limit: float | None) -> int:
    if x is None or math.isnan(x):
        return 4
    if x == math.inf:
        return 3
    if x == -math.inf:
        return 2
    if name == "p_max" and p_limit is not None and x > p_limit:
        return 1
    return 0


#: A strip's title longer than this many characters is broken into lines at spaces.
TITLE_WIDTH = 70


def wrap_title(text: str, width: int = TITLE_WIDTH) -> str:
    """``text`` with ``<br>`` between words so that no line passes ``width`` characters (a
    single longer word keeps a line of its own)."""
    lines: list[str] = []
    for word in text.split():
        if lines and len(lines[-1]) + 1 + len(word) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return "<br>".join(lines)


def mechanism_strip(histories: dict, *, title: str, p_limit: float | None = None) -> go.Figure:
    """One row's state per step under each policy: ``histories`` maps a column title (e.g.
    "before: ..." and "after: ...") to ``fa_lab.kernels.online.row_history`` output (one
    dict per step). Each cell shows the value; its colour says whether it is finite, past
    ``p_limit`` (the P cast's largest value, for ``p_max``), -inf, +inf or NaN. A ``title``
    longer than ``TITLE_WIDTH`` characters is wrapped at spaces."""
    if not histories:
        raise ValueError("histories is empty: give at least one policy's row history")
    names = list(histories)
    fig = make_subplots(rows=1, cols=len(names), subplot_titles=names, horizontal_spacing=0.06,
                        shared_yaxes=True)
    scale = [[i / (len(CELL_KINDS) - 1), c] for i, (_, c) in enumerate(CELL_KINDS)]
    labels = [label for _, label in QUANTITIES]
    for col, name in enumerate(names, 1):
        steps = histories[name]
        z = [[_kind(q, s[q], p_limit) for s in steps] for q, _ in QUANTITIES]
        text = [[fmt_number(s[q], 3) for s in steps] for q, _ in QUANTITIES]
        x = [f"step {s['step']} (tile {s['tile']})" for s in steps]
        fig.add_trace(go.Heatmap(z=z, x=x, y=labels, text=text, texttemplate="%{text}",
                                 colorscale=scale, zmin=0, zmax=len(CELL_KINDS) - 1,
                                 showscale=False, xgap=2, ygap=2,
                                 hovertemplate="%{y} at %{x}: %{text}<extra></extra>"),
                      row=1, col=col)
    fig.update_yaxes(autorange="reversed")
    legend = "   ".join(f"<span style='color:{c}'>■</span> {k}" for k, c in CELL_KINDS)
    title = wrap_title(title)
    extra = title.count("<br>") * 34                 # each further title line
    fig.update_layout(title=dict(text=f"{title}<br><sup>{legend}</sup>"), height=330 + extra,
                      width=max(600, 260 * sum(len(h) for h in histories.values()) + 160),
                      margin=dict(l=110, r=20, t=90 + extra, b=40), plot_bgcolor="white")
    return fig


def boundary_curves(x, curves: dict, *, boundary: float, x_title: str, y_title: str,
                    title: str, colors: dict | None = None) -> go.Figure:
    """Measured curves (name -> y over ``x``) beside a hazard's formula: a vertical line at
    ``boundary``, the region's edge. Curves that lie on each other stay apart by their
    dashes and markers."""
    fig = go.Figure()
    dashes = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
    symbols = ("circle", "square", "diamond", "triangle-up", "cross", "x")
    for i, (name, y) in enumerate(curves.items()):
        fig.add_trace(go.Scatter(x=list(x), y=list(y), mode="lines+markers", name=name,
                                 marker=dict(size=5, symbol=symbols[i % len(symbols)]),
                                 line=dict(color=(colors or {}).get(name),
                                           dash=dashes[i % len(dashes)])))
    fig.add_vline(x=boundary, line=dict(color="#444444", dash="dash"),
                  annotation_text=f"formula: {boundary:.4g}", annotation_position="top left")
    fig.update_layout(title=title, xaxis_title=x_title, yaxis_title=y_title, height=380,
                      width=760, plot_bgcolor="white", legend=dict(orientation="h", y=-0.25))
    fig.update_xaxes(showgrid=True, gridcolor="#eeeeee")
    fig.update_yaxes(showgrid=True, gridcolor="#eeeeee")
    return fig
