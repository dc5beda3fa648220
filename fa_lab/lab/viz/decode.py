"""The paged decode's partitions and their merge (docs/semantics.md §13): for one query row,
each partition's maximum, its sum and the weight the split reduce gives it, beside its
tile range; the row's merged output against the fp64 reference."""

from __future__ import annotations

import math

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .style import NONFINITE_COLOR
from .tracedata import fmt_number

#: The panels, left to right: (recorder key, title).
PANELS = (("pmax", "partition max m_p"), ("psum", "partition sum l_p"),
          ("weights", "merge weight w_p"))
#: The MLA decode's panels: its splits store an LSE, not a (max, sum) pair.
MLA_PANELS = (("lse", "split LSE (natural log)"), ("weights", "merge weight w_j"))
#: The paged fp8 prefill's panels: per tile pair, the chosen row's largest score and its
#: mass there (``fa_lab.lab.widgets.paged_fp8``); it has no partitions to merge.
PAGED_PANELS = (("pmax", "tile-pair max (log2)"), ("psum", "tile-pair mass sum 2^(s - max)"))
BAR_COLOR = "#4c78a8"
EMPTY_COLOR = "#fff3b0"


def _finite(x: float) -> float:
    return x if math.isfinite(x) else 0.0


def partitions_figure(parts: list[dict], *, title: str, panels=PANELS,
                      unit: str = "tiles") -> go.Figure:
    """``parts``: one dict per partition with ``tiles`` (start, end), ``pmax``, ``psum`` and
    ``weight`` (floats; the weight NaN for a single partition's call, which has no reduce).
    A bar per partition and panel; a non-finite value is drawn as a black bar of height 0
    with its value in the hover text, an empty partition in yellow. ``panels``: (key,
    title) per panel (``MLA_PANELS`` for the MLA decode's splits, whose ``tiles`` are key
    ranges: ``unit="keys"``)."""
    fig = make_subplots(rows=1, cols=len(panels), subplot_titles=[t for _, t in panels])
    names = [f"p{i}: {unit} {p['tiles'][0]}..{p['tiles'][1] - 1}" if p["tiles"][1] > p["tiles"][0]
             else f"p{i}: empty" for i, p in enumerate(parts)]
    for col, (key, label) in enumerate(panels, start=1):
        vals = [p["weight" if key == "weights" else key] for p in parts]
        colors = [NONFINITE_COLOR if not math.isfinite(v) and not (key in ("pmax", "lse") and v == -math.inf)
                  else EMPTY_COLOR if p["tiles"][1] <= p["tiles"][0] else BAR_COLOR
                  for v, p in zip(vals, parts)]
        fig.add_trace(go.Bar(x=names, y=[_finite(v) for v in vals], marker_color=colors,
                             hovertext=[f"{label} = {fmt_number(v)}" for v in vals],
                             hoverinfo="text", showlegend=False), row=1, col=col)
    fig.update_layout(title=title, margin=dict(l=40, r=10, t=60, b=60), bargap=0.3)
    return fig
