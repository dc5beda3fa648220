"""Plotly figures for traces, outputs and the seed's tables: data in, figure out.

Every function takes something fa_lab already computed (a ``Trace``, an output tensor, an
LSE tensor, a table from ``experiments``) and returns a ``plotly.graph_objects.Figure``;
nothing here runs attention. The widgets in ``fa_lab.lab.widgets`` call these same functions,
so every view a dashboard shows can be rebuilt in a script.

Conventions kept by every figure:
  * one colour per policy (the registry's) and variant label everywhere (``policy_color``);
  * running maxima in log2 units (the fp8 kernel's raw units are converted with
    ``Trace.log2_per_unit``), LSE in natural log as the kernels return it;
  * values that cannot be plotted (inf, NaN) are drawn as markers at the edge of the axis
    and named in the legend, never silently dropped;
  * each figure keeps the same list of traces whatever the data (empty when there is
    nothing to mark), so a dashboard can update a FigureWidget trace by trace.
"""

from __future__ import annotations

import html
import math
import re
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from fa_lab import policies

#: Colours of labels that are not registered policies (a policy's colour is its own,
#: ``fa_lab.policies``): the fp8 tables' variant labels and other output sets.
LABEL_COLORS = {
    "monotonic": policies.color("lazy"),     # the fp8 table's name for the fixed rule
    "unfixed": policies.color("lazy_unfixed"),
    "bound 8": "#b79ddf",
    "bound 16": "#7b4fb8",
    "bound 32": "#3f1d78",
    "fp8": "#ff7f0e",           # orange: any fp8 output set beside bf16 ones
    "reference": "#444444",
}
#: Colour for names that are neither policies nor in LABEL_COLORS.
OTHER_COLOR = "#8c8c8c"
#: One colour per benchmarked implementation (``fa_lab.studies.bench``'s ``impl`` names): a fast
#: kernel takes its policy's colour, so a policy looks the same in a timing chart as in an
#: accuracy one; split-K and varlen variants are shades of the fixed lazy kernel's blue.
IMPL_COLORS = {
    "fast_lazy": policies.color("lazy"),
    "fast_eager": policies.color("eager"),
    "fast_lazy_unfixed": policies.color("lazy_unfixed"),
    "fast_fp8_lazy": LABEL_COLORS["fp8"],
    "fast_fp8_eager": "#fdbf6f",
    "fast_fp8_lazy_vt": "#d95f02",
    "faithful_lazy": "#08306b",
    "fast_lazy_split2": "#6baed6",
    "fast_lazy_split4": "#4292c6",
    "fast_lazy_split8": "#2171b5",
    "fast_lazy_varlen": "#9ecae1",
    "sdpa_flash": "#393b79",
    "sdpa_cudnn": "#9c9ede",
    "flex": "#637939",
}
#: Marker symbols per policy, so that curves lying on top of each other stay apart
#: (the fixed lazy and the eager rescale agree to 0.2 %).
POLICY_SYMBOLS = {
    "eager": "circle", "lazy": "diamond", "monotonic": "diamond", "lazy_unfixed": "square",
    "unfixed": "square", "lazy_capped": "triangle-up", "bound 8": "triangle-down",
    "bound 16": "triangle-up", "bound 32": "triangle-left", "fp8": "cross",
    "reference": "circle",
}

#: The fp8 seed table names its rows by policy and bound; the tables here by variant label.
_FP8_SEED_LABEL = {"lazy_unfixed": "unfixed", "lazy": "monotonic", "eager": "eager"}

NONFINITE_COLOR = "#000000"

#: Trace values a heatmap can show: column -> label.
_TRACE_VALUES = {
    "m": "running max m",
    "mt": "tile max",
    "deficit": "deficit: true running max - m",
    "l": "log2(l)",
    "corr": "log2(corr)",
    "vote": "row voted",
    "fire": "wave fired",
    "dragged": "row dragged",
    "o_finite": "O finite",
    "l_finite": "l finite",
}
#: The 0/1 trace values, drawn in two colours: (colour of 0, colour of 1, label of 0, of 1).
_FLAG_COLORS = {
    "vote": ("#eeeeee", "#ff7f0e", "no", "voted"),
    "fire": ("#eeeeee", "#555555", "no", "fired"),
    "dragged": ("#eeeeee", "#ff2d2d", "no", "dragged"),
    "o_finite": ("#111111", "#eeeeee", "not finite", "finite"),
    "l_finite": ("#111111", "#eeeeee", "not finite", "finite"),
}
#: Colour ranges that do not move with the data (a slider move keeps the colour bar):
#: fp32 overflows once a deficit or log2(l) nears 128.
FIXED_RANGES = {"deficit": (0.0, 128.0), "l": (0.0, 128.0), "corr": (-128.0, 128.0)}
#: Colours of the mechanism's events, the same in every figure.
EVENT_COLORS = {"vote": "#ff7f0e", "fire": "#555555", "dragged": "#ff2d2d",
                "true_max": "#000000", "deficit": "#8c564b", "l": "#2ca02c", "corr": "#ff7f0e"}


def policy_color(name: str) -> str:
    """The colour of a policy (the registry's), or of a variant label (grey for others)."""
    return policies.color(str(name)) or LABEL_COLORS.get(str(name), OTHER_COLOR)


def impl_color(name: str) -> str:
    """The colour of a benchmarked implementation (``IMPL_COLORS``), else of a policy or
    label (``policy_color``)."""
    return IMPL_COLORS.get(str(name)) or policy_color(name)


def policy_symbol(name: str, hollow: bool = False) -> str:
    """The marker symbol of a policy or variant name; ``hollow`` for the seed's points."""
    sym = POLICY_SYMBOLS.get(str(name), "circle")
    return f"{sym}-open" if hollow else sym


def _policy_line(name: str) -> dict:
    return dict(color=policy_color(name), dash="dash" if name in ("lazy", "monotonic") else None)


# ---- checks and small helpers ----------------------------------------------------------

def _check_trace(trace):
    for attr in ("steps", "lanes", "matrix", "log2_per_unit", "kernel"):
        if not hasattr(trace, attr):
            raise TypeError(f"trace must be a fa_lab.Trace (from fa_lab.trace(...)), "
                            f"got {type(trace).__name__}")
    if len(trace.steps) == 0:
        raise ValueError("trace has no recorded steps")


def _check_tensor(name, x, dim):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(x.shape)}")


def _check_index(name, i, n):
    if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(i).__name__}")
    if not 0 <= int(i) < n:
        raise ValueError(f"{name}={i} out of range [0, {n})")
    return int(i)


def _is_fp8(trace) -> bool:
    return trace.kernel == "swp_fp8"


def step_axis_title(trace) -> str:
    if _is_fp8(trace):
        return "KV step (tile pair of 128 columns)"
    return "KV step (tile of 64 columns)"


def _finite_or_none(a) -> np.ndarray:
    """Plotly cannot draw inf: non-finite entries become gaps (NaN). Numpy arrays go to
    plotly without per-element validation, which keeps a dashboard redraw fast."""
    a = np.asarray(a, dtype=float)
    return np.where(np.isfinite(a), a, np.nan)


def _grid(a) -> list:
    """A 2-D array as nested lists with None for the non-finite entries: a FigureWidget
    sends 2-D data as JSON, where NaN is not allowed (1-D float arrays travel as binary
    buffers and may hold NaN)."""
    a = np.asarray(a, dtype=float)
    return [[float(v) if math.isfinite(v) else None for v in row] for row in a]


def _fmt(x: float, digits=4) -> str:
    if isinstance(x, (bool, np.bool_)):
        return str(bool(x))
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "NaN"
    if math.isinf(x):
        return "+inf" if x > 0 else "-inf"
    return f"{x:.{digits}g}"


def _policy_label(trace) -> str:
    pol = trace.policy
    return pol.describe() if hasattr(pol, "describe") else str(pol)


def _policy_name(trace) -> str:
    return getattr(trace.policy, "name", str(trace.policy))


def _lane_labels(trace) -> dict:
    """lane -> 'row r (batch b, head h)'."""
    ln = trace.lanes
    return {int(i): f"row {int(r)} (batch {int(b)}, head {int(h)})"
            for i, b, h, r in zip(ln.index, ln["batch"], ln["head"], ln["row"])}


def _lane_label(trace, lane) -> str:
    return _lane_labels(trace)[int(lane)]


def _true_max(trace) -> pd.DataFrame:
    """Lanes x steps: the largest tile max each lane has seen so far (log2 units), the
    running max an eager rescale would hold."""
    mt = trace.matrix("mt").to_numpy(dtype=float) * float(trace.log2_per_unit)
    with np.errstate(invalid="ignore"):
        best = np.fmax.accumulate(np.where(np.isnan(mt), -np.inf, mt), axis=1)
    return pd.DataFrame(best, index=trace.matrix("mt").index, columns=trace.matrix("mt").columns)


def deficit(trace) -> pd.DataFrame:
    """Lanes x steps of the deficit (``docs/semantics.md`` section 7.1): the lane's true
    running max (its largest tile max so far) minus its base m, in log2 units. Eager keeps
    it at 0, the fixed lazy rescale at most the threshold; every P, l and O carries a
    factor 2**deficit, and fp32 overflows once it nears 128."""
    m = trace.matrix("m").to_numpy(dtype=float) * float(trace.log2_per_unit)
    best = _true_max(trace).to_numpy()
    with np.errstate(invalid="ignore"):
        d = best - m
    return pd.DataFrame(d, index=trace.matrix("m").index, columns=trace.matrix("m").columns)


def trace_values(trace, value: str) -> pd.DataFrame:
    """Lanes x steps table of ``value`` in plotting units: m, mt and the deficit in log2
    units, l and corr as log2(.), flags as 0/1. Non-finite entries stay (as inf/NaN)."""
    _check_trace(trace)
    if value not in _TRACE_VALUES:
        raise ValueError(f"value={value!r}; choose one of {sorted(_TRACE_VALUES)}")
    if value == "deficit":
        return deficit(trace)
    mat = trace.matrix(value)
    if value in ("m", "mt"):
        return mat.astype(float) * float(trace.log2_per_unit)
    if value in ("l", "corr"):
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.log2(mat.astype(float))
    return mat.astype(float)


def value_title(trace, value: str) -> str:
    label = _TRACE_VALUES[value]
    if value in ("m", "mt", "l", "corr", "deficit"):
        unit = "log2 units"
        if _is_fp8(trace) and value in ("m", "mt"):
            unit = "log2 units = raw fp8 units x log2_per_unit"
        return f"{label} ({unit})"
    return label


# ---- trace figures ---------------------------------------------------------------------

def _labels_unchecked(layout: dict) -> dict:
    """``layout`` with ``ticklabeloverflow="allow"`` on each of its axes. These figures leave
    margins for their tick labels, so plotly.js's default ("hide past div": measure every
    tick label on every redraw and hide any that reaches past the figure's edge) hides
    nothing in them, while its measurements cost time on every redraw of a dashboard, each
    one bringing the whole page's layout up to date first."""
    for key, axis in layout.items():
        if re.fullmatch(r"[xy]axis\d*", key) and isinstance(axis, dict):
            axis.setdefault("ticklabeloverflow", "allow")
    return layout


def _lane_ticks(lanes: pd.DataFrame, max_ticks=16):
    idx = list(lanes.index)
    every = max(1, math.ceil(len(idx) / max_ticks))
    vals = idx[::every]
    one_head = lanes[["batch", "head"]].drop_duplicates().shape[0] == 1
    text = [f"{int(lanes.loc[i, 'row'])}" if one_head else
            f"b{int(lanes.loc[i, 'batch'])} h{int(lanes.loc[i, 'head'])} r{int(lanes.loc[i, 'row'])}"
            for i in vals]
    if one_head:
        b, h = lanes.iloc[0][["batch", "head"]]
        title = f"query row (batch {int(b)}, head {int(h)})"
    else:
        title = "query row (batch, head, row)"
    return vals, text, title


def _flag_scale(value):
    c0, c1, t0, t1 = _FLAG_COLORS[value]
    return ([[0, c0], [0.5, c0], [0.5, c1], [1, c1]],
            dict(tickvals=[0.25, 0.75], ticktext=[t0, t1], len=0.5, y=0.75))


def running_max_heatmap(trace, value: str = "m", title: str | None = None, *,
                        zrange: tuple | None = None, markers: bool = True,
                        highlight: int | None = None) -> go.Figure:
    """Traced lanes (rows) x KV steps (columns) heatmap of one trace value.

    0/1 values (vote, fire, dragged, o_finite, l_finite) get two colours, not a colour
    scale. The deficit, log2(l) and log2(corr) get fixed colour ranges (``FIXED_RANGES``)
    so the colours mean the same thing whatever the data; m and the tile max follow the
    data unless ``zrange`` is given. With ``markers``: a small x where the row was dragged
    (its wave fired while its tile max sat below its running max), a small open circle
    where its wave fired otherwise, a black star at the first step where O or l stopped
    being finite. ``highlight`` (a lane) gets an arrow on the row axis.
    """
    z = trace_values(trace, value)
    lanes = trace.lanes
    steps = [int(s) for s in z.columns]
    lane_ids = [int(i) for i in z.index]
    raw = z.to_numpy(dtype=float)
    first_col = trace.steps.drop_duplicates("step").set_index("step")["col0"]
    width = 128 if _is_fp8(trace) else 64
    cols = {s: f"step {s} (columns {int(c)}-{int(c) + width - 1})" for s, c in first_col.items()}
    labels = _lane_labels(trace)
    name = _TRACE_VALUES[value]
    text = np.array([[f"{labels[lane]}<br>{cols.get(s, f'step {s}')}<br>{name} = {_fmt(raw[i, j])}"
                      for j, s in enumerate(steps)] for i, lane in enumerate(lane_ids)], dtype=object)
    steps, lane_ids = np.asarray(steps), np.asarray(lane_ids)
    ctitle = value_title(trace, value).replace(" (", "<br>(")
    flag_value = value in _FLAG_COLORS
    data = []
    # Cells that cannot be coloured by value: black for +inf / NaN, grey for -inf. They sit
    # under the value layer, which leaves them as gaps.
    flag = np.where(np.isnan(raw) | (raw == math.inf), 1.0,
                    np.where(raw == -math.inf, 0.0, np.nan))
    data.append(go.Heatmap(
        z=_grid(flag), x=steps, y=lane_ids, zmin=0, zmax=1, showscale=False,
        colorscale=[[0, "#bdbdbd"], [1, "#111111"]], hoverinfo="skip", name="not finite"))
    if flag_value:
        scale, bar = _flag_scale(value)
        zmin, zmax = 0.0, 1.0
    else:
        scale = "RdBu_r" if value == "corr" else "Viridis"
        bar = dict(len=0.9)
        zmin, zmax = zrange if zrange is not None else FIXED_RANGES.get(value, (None, None))
    data.append(go.Heatmap(
        z=_grid(raw), x=steps, y=lane_ids, text=text, zmin=zmin, zmax=zmax,
        hovertemplate="%{text}<extra></extra>", colorscale=scale,
        colorbar=dict(title=dict(text=ctitle, side="right"), **bar), name=value,
        hoverongaps=True))

    st = trace.steps
    show = markers and not flag_value
    fired = st[st.fire & ~st.dragged] if show else st.iloc[:0]
    dragged = st[st.dragged] if show else st.iloc[:0]
    data.append(_event_markers(labels, fired, "wave fired (row not dragged)", "circle-open",
                               "#c8c8c8", 5, edge="#c8c8c8"))
    data.append(_event_markers(labels, dragged, "dragged (wave fired, tile max < m)", "x-thin",
                               EVENT_COLORS["dragged"], 6))
    first = lanes["first_nonfinite_step"].dropna()
    data.append(go.Scatter(
        x=first.to_numpy(dtype=int), y=first.index.to_numpy(dtype=int), mode="markers",
        name="first non-finite O or l", marker=dict(symbol="star", size=12,
                                                     color=NONFINITE_COLOR,
                                                     line=dict(color="#ffffff", width=1)),
        text=[f"{labels[int(i)]}<br>first non-finite at step {int(s)}"
              for i, s in first.items()],
        hovertemplate="%{text}<extra></extra>"))

    tickvals, ticktext, ytitle = _lane_ticks(lanes.loc[lane_ids.tolist()])
    n_bad = int((~lanes["out_finite"]).sum())
    notes = []
    shapes = []
    if highlight is not None and int(highlight) in set(lane_ids.tolist()):
        hl = int(highlight)
        shapes.append(dict(type="rect", xref="x", yref="y", x0=steps.min() - 0.5,
                           x1=steps.max() + 0.5, y0=hl - 0.5, y1=hl + 0.5,
                           line=dict(color="#000000", width=2)))
    if np.isfinite(flag).any():
        notes.append(dict(x=0, xref="paper", y=-0.2, yref="paper", xanchor="left",
                          yanchor="top", showarrow=False, font=dict(size=11),
                          text="black cell: value is +inf or NaN; grey cell: -inf "
                               "(e.g. log2(l) while l is still 0)"))
    layout = dict(
        annotations=notes, shapes=shapes,
        title=dict(text=title or (f"{_TRACE_VALUES[value]} per traced row, {_policy_label(trace)}: "
                                  f"{n_bad} of {len(lanes)} rows non-finite"), font=dict(size=14)),
        xaxis=dict(title=step_axis_title(trace)),
        yaxis=dict(title=ytitle, tickvals=tickvals, ticktext=ticktext, autorange="reversed"),
        legend=dict(orientation="h", yanchor="bottom", y=1.0, xanchor="left", x=0),
        height=max(360, min(900, 160 + 9 * len(lane_ids))),
        margin=dict(t=90, b=90, l=80), plot_bgcolor="#ffffff")
    # One constructor call: plotly validates far less than with add_trace/update_layout.
    return go.Figure(data=data, layout=_labels_unchecked(layout))


def _event_markers(labels: dict, rows: pd.DataFrame, name, symbol, color, size,
                   edge=None) -> go.Scatter:
    text = [f"{labels[int(ln)]}<br>step {int(st)}: {name}"
            for ln, st in zip(rows["lane"], rows["step"])]
    return go.Scatter(x=rows["step"].to_numpy(dtype=int), y=rows["lane"].to_numpy(dtype=int),
                      mode="markers", name=name, text=text,
                      hovertemplate="%{text}<extra></extra>",
                      marker=dict(symbol=symbol, size=size, color=color,
                                  line=dict(color=edge or color, width=1)))


#: fp32 overflows past 2**128: where l and O go once a correction blows up.
FP32_LOG2_MAX = 128.0


def _edges(*series, pad_frac=0.08):
    """(bottom, top) y positions just outside the finite range of ``series``: where the
    values that cannot be plotted (+inf or NaN on top, -inf at the bottom) are drawn."""
    vals = np.concatenate([np.asarray(s, float) for s in series])
    fin = vals[np.isfinite(vals)]
    lo, hi = (float(fin.min()), float(fin.max())) if fin.size else (0.0, 1.0)
    pad = max(1.0, pad_frac * (hi - lo))
    return lo - pad, hi + pad


def _edge_points(x, named_series, bottom, top):
    """Markers for the failures among the entries of each (name, values, zero_ok): +inf and
    NaN at the top, -inf at the bottom. With ``zero_ok`` a -inf is log2 of an exact 0 (l
    before any P was added, the first step's correction): normal, not marked."""
    xs, ys, text = [], [], []
    for name, vals, zero_ok in named_series:
        for s, v in zip(x, vals):
            if math.isfinite(v) or (zero_ok and v == -math.inf):
                continue
            xs.append(s)
            ys.append(bottom if v == -math.inf else top)
            text.append(f"step {s}: {name} = {_fmt(v)}")
    return xs, ys, text


def _lane_series(trace, lane):
    """One lane's step-by-step values in plotting units."""
    d = trace.lane(lane)
    per = float(trace.log2_per_unit)
    m = d["m"].to_numpy(float) * per
    mt = d["mt"].to_numpy(float) * per
    with np.errstate(divide="ignore", invalid="ignore"):
        log_l = np.log2(d["l"].to_numpy(float))
        log_corr = np.log2(d["corr"].to_numpy(float))
        best = np.fmax.accumulate(np.where(np.isnan(mt), -np.inf, mt))
        deficit_ = best - m
    return dict(d=d, x=d["step"].astype(int).tolist(), m=m, mt=mt, true_max=best,
                deficit=deficit_, log_l=log_l, log_corr=log_corr)


def break_window(traces, lane: int, pad: int = 4, min_steps: int = 8):
    """(first, last) steps around where ``lane`` first goes non-finite in any of
    ``traces`` (a Trace or a list of them): from step 0 to ``pad`` steps past the latest
    first failure, or None when the lane stays finite everywhere."""
    traces = [traces] if hasattr(traces, "lanes") else list(traces)
    firsts = [t.lanes.loc[lane, "first_nonfinite_step"] for t in traces]
    firsts = [int(f) for f in firsts if not pd.isna(f)]
    if not firsts:
        return None
    n = max(t.n_steps for t in traces)
    return 0, min(n - 1, max(max(firsts) + pad, min_steps - 1))


def _window_buttons(window, n_steps, axes, y=1.0):
    """Two buttons that set the x range of ``axes``: the window, or every step."""
    lo, hi = window
    zoom = {f"{a}.range": [lo - 0.5, hi + 0.5] for a in axes}
    full = {f"{a}.range": [-0.5, n_steps - 0.5] for a in axes}
    return [dict(type="buttons", direction="right", x=1.0, xanchor="right", y=y,
                 yanchor="bottom", pad=dict(t=0, r=0), showactive=True, active=0,
                 font=dict(size=11),
                 buttons=[dict(label=f"steps {lo}-{hi}: the break", method="relayout",
                               args=[zoom]),
                          dict(label=f"all {n_steps} steps", method="relayout", args=[full])])]


def lane_lines(trace, lane: int, title: str | None = None, *, window="auto") -> go.Figure:
    """One traced lane step by step. Top: the base m, the row's true running max (its
    largest tile max so far), each tile max and the vote line (m before the step plus the
    threshold), with wave fires and drags marked on m. Bottom: the deficit (true running
    max - m), log2(l) and log2(corr), with fp32's overflow at 2^128 when it is near.

    Failures sit at a panel's edge: +inf or NaN at the top, -inf at the bottom (m only).
    log2(l) = -inf before any P was added (l = 0) and log2(corr) = -inf at the first step
    (nothing to rescale) are normal and left as gaps. The first non-finite step of O or l
    gets a vertical line. ``window``: "auto" opens zoomed to where the lane breaks (buttons
    widen it to every step); None shows every step; (first, last) picks the steps."""
    _check_trace(trace)
    lane = _check_index("lane", lane, len(trace.lanes))
    v = _lane_series(trace, lane)
    d, x = v["d"], v["x"]
    m, mt, log_l, log_corr = v["m"], v["mt"], v["log_l"], v["log_corr"]
    per = float(trace.log2_per_unit)
    color = policy_color(_policy_name(trace))
    who = _lane_label(trace, lane)

    # Two panels sharing the step axis: (x, y) on top, (x2, y2) below. Axes are laid out by
    # hand and the figure built in one call, which is several times faster than
    # make_subplots + add_trace, and a dashboard redraws this figure on every move.
    data = []
    panel = {1: dict(xaxis="x", yaxis="y"), 2: dict(xaxis="x2", yaxis="y2")}

    def hover(name, vals):
        return [f"{who}<br>step {s}: {name} = {_fmt(v)}" for s, v in zip(x, vals)]

    def line(name, vals, row, **style):
        data.append(go.Scatter(x=x, y=_finite_or_none(vals), name=name, text=hover(name, vals),
                               hovertemplate="%{text}<extra></extra>", **panel[row], **style))

    line("true running max (largest tile max so far)", v["true_max"], 1, mode="lines",
         line=dict(color=EVENT_COLORS["true_max"], width=1.5, dash="dot", shape="hv"))
    line("m, running max (the base)", m, 1, mode="lines+markers",
         line=dict(color=color, width=2.5), marker=dict(size=4))
    line("tile max", mt, 1, mode="markers",
         marker=dict(color="#555555", size=7, symbol="diamond-open"))
    # The vote compares a tile max with the running max before the step.
    thr = float(trace.threshold_units) * per
    voting = d["phase"].isin(["loop", "pair"]).to_numpy() & (np.arange(len(d)) > 0)
    vote_x, vote_y = [], []
    if math.isfinite(thr):
        prev = np.concatenate([[np.nan], m[:-1]])
        vote_x = [s for s, ok in zip(x, voting) if ok]
        vote_y = _finite_or_none((prev + thr)[voting])
    data.append(go.Scatter(x=vote_x, y=vote_y, name=f"vote line: previous m + {_fmt(thr, 3)}",
                           mode="lines", line=dict(color=color, dash="dot", width=1),
                           hovertemplate="step %{x}: a tile max above %{y:.4g} votes"
                                         "<extra></extra>", **panel[1]))
    fired = (d["fire"] & ~d["dragged"]).to_numpy()
    dragged = d["dragged"].to_numpy()
    for mask, name, sym, col in ((fired, "wave fired", "circle-open", EVENT_COLORS["fire"]),
                                 (dragged, "dragged (fired, tile max < m)", "x-thin",
                                  EVENT_COLORS["dragged"])):
        xs = [s for s, k in zip(x, mask) if k]
        data.append(go.Scatter(x=xs, y=_finite_or_none(m[mask]), name=name, mode="markers",
                               marker=dict(symbol=sym, size=12, color=col,
                                           line=dict(color=col, width=2)),
                               hovertemplate=f"step %{{x}}: {name}<extra></extra>", **panel[1]))
    line("deficit = true max - m", v["deficit"], 2, mode="lines+markers",
         line=dict(color=EVENT_COLORS["deficit"], width=2.5), marker=dict(size=5))
    # l is often corr times the previous l: the dashed corr line keeps l visible under it.
    line("log2(l)", log_l, 2, mode="lines+markers", line=dict(color=EVENT_COLORS["l"], width=2),
         marker=dict(size=5))
    line("log2(corr)", log_corr, 2, mode="lines+markers",
         line=dict(color=EVENT_COLORS["corr"], dash="dash", width=1.5), marker=dict(size=4))

    # Non-finite values at the panel edges, one marker trace per panel.
    # The fp32 ceiling is worth drawing only when l or the deficit come near it.
    lower_vals = np.concatenate([log_l, v["deficit"]])
    near_overflow = bool(np.any(np.isnan(lower_vals) | (lower_vals == math.inf)) or np.max(
        np.where(np.isfinite(lower_vals), lower_vals, 0.0), initial=0.0) > FP32_LOG2_MAX / 2)
    lower = [log_l, log_corr, v["deficit"]] + ([[FP32_LOG2_MAX]] if near_overflow else [])
    panels = ((1, [("m", m, False), ("tile max", mt, True)], _edges(m, mt, v["true_max"])),
              (2, [("log2(l)", log_l, True), ("log2(corr)", log_corr, True),
                   ("deficit", v["deficit"], False)], _edges(*lower)))
    ranges = {}
    for row, series, (bottom, top) in panels:
        xs, ys, text = _edge_points(x, series, bottom, top)
        data.append(go.Scatter(x=xs, y=ys, text=text, mode="markers",
                               name="not finite (top: +inf or NaN, bottom: -inf)",
                               showlegend=row == 2, legendgroup="nonfinite",
                               marker=dict(symbol="triangle-up", size=10, color=NONFINITE_COLOR),
                               hovertemplate="%{text}<extra></extra>", **panel[row]))
        span = top - bottom
        ranges[row] = [bottom - 0.04 * span, top + 0.04 * span]

    info = trace.lanes.loc[lane]
    first = info["first_nonfinite_step"]
    shapes, notes = [], []
    if near_overflow:
        shapes.append(dict(type="line", xref="x2 domain", yref="y2", x0=0, x1=1,
                           y0=FP32_LOG2_MAX, y1=FP32_LOG2_MAX,
                           line=dict(color="#444444", dash="dot", width=1)))
        notes.append(dict(x=0, xref="x2 domain", y=FP32_LOG2_MAX, yref="y2", yanchor="bottom",
                          xanchor="left", showarrow=False, font=dict(color="#444444", size=11),
                          text="fp32 overflows above 2^128"))
    if not pd.isna(first):
        first = int(first)
        for xref, yref in (("x", "y domain"), ("x2", "y2 domain")):
            shapes.append(dict(type="line", xref=xref, yref=yref, x0=first, x1=first, y0=0,
                               y1=1, line=dict(color=NONFINITE_COLOR, dash="dash", width=1.5)))
        notes.append(dict(x=first, xref="x", y=1, yref="y domain", yanchor="bottom",
                          xanchor="left", showarrow=False,
                          text=f" first non-finite O or l: step {first}",
                          font=dict(color=NONFINITE_COLOR)))
    n = trace.n_steps
    if isinstance(window, str) and window == "auto":
        window = break_window(trace, lane)
    xrange = [-0.5, n - 0.5] if window is None else [window[0] - 0.5, window[1] + 0.5]
    menus = [] if window is None else _window_buttons(window, n, ("xaxis", "xaxis2"), y=1.06)
    lse = float(info["lse"])
    layout = dict(
        title=dict(text=title or f"{who}, {_policy_label(trace)}: final LSE = {_fmt(lse, 6)} (ln)",
                   font=dict(size=14), x=0, xref="paper", xanchor="left"),
        shapes=shapes, annotations=notes, height=580, updatemenus=menus,
        legend=dict(orientation="h", yanchor="top", y=-0.12, xanchor="left", x=0),
        margin=dict(b=130, t=90),
        xaxis=dict(domain=[0, 1], anchor="y", matches="x2", showticklabels=False, range=xrange),
        yaxis=dict(domain=[0.5, 1], anchor="x", title="m, maxima (log2 units)",
                   range=ranges[1]),
        xaxis2=dict(domain=[0, 1], anchor="y2", title=step_axis_title(trace), range=xrange),
        yaxis2=dict(domain=[0, 0.42], anchor="x2", title="deficit, log2(l), log2(corr)",
                    range=ranges[2]))
    return go.Figure(data=data, layout=_labels_unchecked(layout))


def row_compare(traces: dict, lane: int, *, window="auto", title: str | None = None,
                height: int = 560) -> go.Figure:
    """One traced lane under several policies, side by side (a column each, e.g.
    ``{"lazy_unfixed": tr_u, "lazy": tr_f}``, traces of the same rows). Top row: the base m
    and the row's true running max (its largest tile max so far) with fires and drags;
    bottom row: the deficit (true max - m) and log2(l), on one fixed scale up to fp32's
    2^128, so the two columns compare at a glance. ``window`` as in ``lane_lines``: "auto"
    opens zoomed to where the lane breaks, with buttons to widen it to every step."""
    if not isinstance(traces, dict) or not traces:
        raise ValueError("traces must be a non-empty dict name -> Trace of the same rows")
    for t in traces.values():
        _check_trace(t)
    names = list(traces)
    first_tr = traces[names[0]]
    lane = _check_index("lane", lane, len(first_tr.lanes))
    rows_of = {n: tuple(t.lanes.row) for n, t in traces.items()}
    if len(set(rows_of.values())) != 1:
        raise ValueError("traces must trace the same rows (their lanes differ)")
    n_cols = len(names)
    gap = 0.06
    w = (1 - gap * (n_cols - 1)) / n_cols
    series = {n: _lane_series(t, lane) for n, t in traces.items()}
    top_vals = np.concatenate([np.concatenate([s["m"], s["true_max"]]) for s in series.values()])
    bottom, top = _edges(top_vals)
    low_vals = np.concatenate([np.concatenate([s["deficit"], s["log_l"]]) for s in series.values()])
    lo2, hi2 = _edges(low_vals, [0.0, FP32_LOG2_MAX])
    data, shapes, notes, layout = [], [], [], {}
    who = _lane_label(first_tr, lane)
    n_steps = max(t.n_steps for t in traces.values())
    if isinstance(window, str) and window == "auto":
        window = break_window(list(traces.values()), lane)
    xrange = [-0.5, n_steps - 0.5] if window is None else [window[0] - 0.5, window[1] + 0.5]
    axes = []
    for i, name in enumerate(names):
        tr, s = traces[name], series[name]
        xa, ya = ("x", "y") if i == 0 else (f"x{i + 1}", f"y{i + 1}")
        xb, yb = f"x{n_cols + i + 1}", f"y{n_cols + i + 1}"
        x0 = i * (w + gap)
        color = policy_color(_policy_name(tr))
        first = tr.lanes.loc[lane, "first_nonfinite_step"]
        state = ("stays finite" if pd.isna(first) else f"O or l non-finite from step {int(first)}")
        layout[f"xaxis{'' if i == 0 else i + 1}"] = dict(
            domain=[x0, x0 + w], anchor=ya, matches=xb, showticklabels=False, range=xrange)
        layout[f"yaxis{'' if i == 0 else i + 1}"] = dict(
            domain=[0.52, 1], anchor=xa, range=[bottom, top],
            title="m, true max" if i == 0 else None, showticklabels=i == 0)
        layout[f"xaxis{n_cols + i + 1}"] = dict(domain=[x0, x0 + w], anchor=yb, range=xrange,
                                                title=dict(text="KV step (tile pair of 128)" if
                                                           _is_fp8(tr) else "KV step (tile of 64)",
                                                           standoff=4))
        layout[f"yaxis{n_cols + i + 1}"] = dict(
            domain=[0, 0.44], anchor=xb, range=[lo2, hi2],
            title="deficit, log2 l" if i == 0 else None, showticklabels=i == 0)
        axes += [f"xaxis{'' if i == 0 else i + 1}", f"xaxis{n_cols + i + 1}"]
        notes.append(dict(x=x0 + w / 2, xref="paper", y=1.0, yref="paper", yanchor="bottom",
                          showarrow=False, font=dict(size=12, color=color),
                          text=f"<b>{html.escape(str(name))}</b>: {state}"))
        x = s["x"]
        legend = i == 0

        def add(vals, nm, xaxis, yaxis, **style):
            data.append(dict(
                type="scatter",
                x=x, y=_finite_or_none(vals), name=nm, legendgroup=nm, showlegend=legend,
                xaxis=xaxis, yaxis=yaxis,
                text=[f"{who}, {name}<br>step {st}: {nm} = {_fmt(v)}" for st, v in zip(x, vals)],
                hovertemplate="%{text}<extra></extra>", **style))

        add(s["true_max"], "true running max", xa, ya, mode="lines",
            line=dict(color=EVENT_COLORS["true_max"], dash="dot", width=1.5, shape="hv"))
        add(s["m"], "m, the base", xa, ya, mode="lines+markers",
            line=dict(color=color, width=2.5), marker=dict(size=4))
        d = s["d"]
        for mask, nm, sym, col in (((d["fire"] & ~d["dragged"]).to_numpy(), "wave fired",
                                    "circle-open", EVENT_COLORS["fire"]),
                                   (d["dragged"].to_numpy(), "dragged", "x-thin",
                                    EVENT_COLORS["dragged"])):
            data.append(dict(
                type="scatter",
                x=[st for st, k in zip(x, mask) if k], y=_finite_or_none(s["m"][mask]),
                name=nm, legendgroup=nm, showlegend=legend, mode="markers", xaxis=xa, yaxis=ya,
                marker=dict(symbol=sym, size=11, color=col, line=dict(color=col, width=2)),
                hovertemplate=f"step %{{x}}: {nm}<extra></extra>"))
        add(s["deficit"], "deficit = true max - m", xb, yb, mode="lines+markers",
            line=dict(color=EVENT_COLORS["deficit"], width=2.5), marker=dict(size=5))
        add(s["log_l"], "log2(l)", xb, yb, mode="lines",
            line=dict(color=EVENT_COLORS["l"], width=1.5))
        for (xr, yr, named, lo_, hi_) in ((xa, ya, [("m", s["m"], False)], bottom, top),
                                          (xb, yb, [("log2(l)", s["log_l"], True),
                                                    ("deficit", s["deficit"], False)], lo2, hi2)):
            xs, ys, text = _edge_points(x, named, lo_, hi_)
            data.append(dict(
                type="scatter",
                x=xs, y=ys, text=text, mode="markers",
                name="not finite (+inf or NaN on top)", legendgroup="nonfinite",
                showlegend=legend and yr == yb, xaxis=xr, yaxis=yr,
                marker=dict(symbol="triangle-up", size=10, color=NONFINITE_COLOR),
                hovertemplate="%{text}<extra></extra>"))
        shapes.append(dict(type="line", xref=f"{xb} domain", yref=yb, x0=0, x1=1,
                           y0=FP32_LOG2_MAX, y1=FP32_LOG2_MAX,
                           line=dict(color="#444444", dash="dot", width=1)))
        thr = float(tr.threshold_units) * float(tr.log2_per_unit)
        if math.isfinite(thr):
            shapes.append(dict(type="line", xref=f"{xb} domain", yref=yb, x0=0, x1=1, y0=thr,
                               y1=thr, line=dict(color=policy_color("lazy"), dash="dot", width=1)))
        if not pd.isna(first):
            for xr, yr in ((xa, f"{ya} domain"), (xb, f"{yb} domain")):
                shapes.append(dict(type="line", xref=xr, yref=yr, x0=int(first), x1=int(first),
                                   y0=0, y1=1, line=dict(color=NONFINITE_COLOR, dash="dash",
                                                         width=1.5)))
    notes.append(dict(x=0, xref=f"x{n_cols + 1} domain", y=FP32_LOG2_MAX, yref=f"y{n_cols + 1}",
                      yanchor="bottom", xanchor="left", showarrow=False,
                      font=dict(color="#444444", size=11), text="fp32 overflows above 2^128"))
    # Margins in pixels, so that the buttons, the column heads and the legend keep their
    # places at any height (the dashboard draws this figure 430 px tall).
    top, bottom_m = 72, 84
    plot_h = max(120, height - top - bottom_m)
    menus = [] if window is None else _window_buttons(window, n_steps, axes, y=1 + 34 / plot_h)
    layout.update(
        title=dict(text=title or f"{who}: base m vs true running max, and the deficit",
                   font=dict(size=13), x=0, xref="paper", xanchor="left", y=1 - 12 / height,
                   yanchor="top"),
        shapes=shapes, annotations=notes, updatemenus=menus, height=height,
        legend=dict(orientation="h", yanchor="top", y=-46 / plot_h, xanchor="left", x=0,
                    font=dict(size=11)),
        margin=dict(t=top, b=bottom_m, l=60, r=10))
    return go.Figure(data=data, layout=_labels_unchecked(layout))


def wave_ballot(trace, step: int, *, wave: int | None = None, highlight: int | None = None,
                title: str | None = None) -> go.Figure:
    """One wave at one KV step: its 64 lanes, their ballot, and what the rescale branch did
    to each of its 32 rows.

    Left: the 64 lanes (lanes r and r + 32 hold the two halves of row r), coloured by the
    row's vote, and the ballot, one decision for the whole wave. Right: each row's jump,
    tile max - m before the step (log2 units), against the vote line at the threshold. A
    row beyond it voted; when the wave fires, a row below 0 is dragged (unfixed: rebased
    down to its own tile max, corr = 2^(m - mt) > 1; fixed: left alone, corr = 1).
    ``wave``: the first query row of the wave (default: the wave of the first traced lane);
    ``highlight``: a lane to point at."""
    _check_trace(trace)
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
        raise TypeError(f"step must be an int, got {type(step).__name__}")
    if not 0 <= int(step) < trace.n_steps:
        raise ValueError(f"step={step} out of range [0, {trace.n_steps})")
    step = int(step)
    lanes = trace.lanes
    first = lanes.iloc[0]
    w0 = (int(first["row"]) // 32) * 32 if wave is None else (int(wave) // 32) * 32
    sel = lanes[(lanes["batch"] == first["batch"]) & (lanes["head"] == first["head"])
                & (lanes["row"] >= w0) & (lanes["row"] < w0 + 32)]
    if sel.empty:
        raise ValueError(f"wave={wave}: no traced lane holds a row of rows {w0}-{w0 + 31}")
    per = float(trace.log2_per_unit)
    st = trace.steps
    now = st[(st.step == step) & st.lane.isin(sel.index)].set_index("lane")
    before = st[(st.step == step - 1) & st.lane.isin(sel.index)].set_index("lane")["m"]
    now = now.reindex(sel.index)
    m_before = before.reindex(sel.index).to_numpy(float) * per
    mt = now["mt"].to_numpy(float) * per
    with np.errstate(invalid="ignore"):
        jump = mt - m_before
    r_in = (sel["row"].to_numpy(int) - w0)
    vote = now["vote"].to_numpy(bool)
    fire = bool(now["fire"].any())
    dragged = now["dragged"].to_numpy(bool)
    corr = now["corr"].to_numpy(float)
    thr = float(trace.threshold_units) * per
    policy = _policy_label(trace)
    phase = str(now["phase"].iloc[0])
    cats = np.where(vote, 0, np.where(dragged, 1, np.where(fire, 2, 3)))
    names = (f"voted: tile max > m + {_fmt(thr, 3)}", "dragged: wave fired, tile max < m",
             "rebased up (rose, at most the threshold)", "kept m (wave did not fire)")
    colors = (EVENT_COLORS["vote"], EVENT_COLORS["dragged"], "#7f7f7f", "#c7c7c7")
    data = []
    # left panel: 64 lanes as two columns of 32
    # the rows that did not vote first, so that a voter's squares are drawn on top
    for c, (nm, col) in enumerate(zip(("row did not vote", "row voted"),
                                      ("#e0e0e0", EVENT_COLORS["vote"]))):
        mask = ~vote if c == 0 else vote
        ys = np.concatenate([r_in[mask], r_in[mask]])
        xs = np.concatenate([np.zeros(int(mask.sum())), np.ones(int(mask.sum()))])
        lane_no = np.concatenate([r_in[mask], r_in[mask] + 32])
        data.append(dict(
            type="scatter",
            x=xs, y=ys, mode="markers", name=nm, xaxis="x", yaxis="y", showlegend=False,
            marker=dict(symbol="square", size=7, color=col, line=dict(color="#999999", width=0.5)),
            text=[f"lane {int(n)}: row {w0 + int(r)}, {nm}" for n, r in zip(lane_no, ys)],
            hovertemplate="%{text}<extra></extra>"))
    # right panel: each row's jump
    fin = jump[np.isfinite(jump)]
    lo = min(-1.0, float(fin.min())) if fin.size else -1.0
    hi = max(thr if math.isfinite(thr) else 1.0, float(fin.max()) if fin.size else 1.0)
    pad = 0.08 * (hi - lo)
    left, right = lo - pad, hi + pad
    shown = np.where(np.isfinite(jump), jump, np.where(jump == -math.inf, left, right))
    for c, (nm, col) in enumerate(zip(names, colors)):
        mask = cats == c
        stem_x, stem_y = [], []
        for j, r in zip(shown[mask], r_in[mask]):
            stem_x += [0.0, float(j), None]
            stem_y += [int(r), int(r), None]
        data.append(dict(type="scatter", x=stem_x, y=stem_y, mode="lines", xaxis="x2",
                         yaxis="y2", line=dict(color=col, width=1.5), hoverinfo="skip",
                         showlegend=False, legendgroup=nm))
        text = [f"row {w0 + int(r)}: m before {_fmt(mb)}, tile max {_fmt(t)}<br>jump "
                f"{_fmt(j)}; corr = {_fmt(cr)}" for r, mb, t, j, cr in
                zip(r_in[mask], m_before[mask], mt[mask], jump[mask], corr[mask])]
        data.append(dict(
            type="scatter",
            x=shown[mask], y=r_in[mask], mode="markers", name=f"{nm}: {int(mask.sum())}",
            legendgroup=nm, xaxis="x2", yaxis="y2", text=text,
            hovertemplate="%{text}<extra></extra>",
            marker=dict(size=9, color=col, symbol="x-thin" if c == 1 else "circle",
                        line=dict(color=col, width=2))))
    shapes = [dict(type="line", xref="x2", yref="y2 domain", x0=0, x1=0, y0=0, y1=1,
                   line=dict(color="#000000", width=1))]
    notes = [dict(x=0, xref="x2", y=1.0, yref="y2 domain", yanchor="bottom", xanchor="right",
                  showarrow=False, text="m", font=dict(size=11))]
    if math.isfinite(thr):
        shapes.append(dict(type="line", xref="x2", yref="y2 domain", x0=thr, x1=thr, y0=0, y1=1,
                           line=dict(color=EVENT_COLORS["vote"], dash="dot", width=1.5)))
        notes.append(dict(x=thr, xref="x2", y=1.0, yref="y2 domain", yanchor="bottom",
                          xanchor="right" if thr > left + 0.8 * (right - left) else "left",
                          showarrow=False, text=f"vote line m + {_fmt(thr, 3)}",
                          font=dict(size=11, color=EVENT_COLORS["vote"])))
    ballot = "FIRE: every row rescales" if fire else "no fire: every row keeps m"
    notes.append(dict(x=0.205, xref="paper", y=0.62, yref="paper", yanchor="middle",
                      showarrow=False, align="center", bgcolor="#fff4e5" if fire else "#f2f2f2",
                      bordercolor=EVENT_COLORS["vote"] if fire else "#999999", borderwidth=1.5,
                      text=f"ballot:<br>OR of the<br>64 votes<br><b>{ballot.split(':')[0]}</b>",
                      font=dict(size=11)))
    notes.append(dict(x=0.19, xref="paper", y=0.62, yref="paper", ax=-30, ay=0,
                      showarrow=True, arrowhead=2, arrowsize=1, arrowcolor="#999999", text=""))
    tickvals, ticktext = list(range(0, 32, 4)), [str(w0 + r) for r in range(0, 32, 4)]
    if highlight is not None and int(highlight) in set(sel.index.tolist()):
        r = int(lanes.loc[int(highlight), "row"]) - w0
        keep = [(v_, t_) for v_, t_ in zip(tickvals, ticktext) if abs(v_ - r) >= 3]
        tickvals = [v_ for v_, _ in keep] + [r]
        ticktext = [t_ for _, t_ in keep] + [f"<b>{w0 + r} &#9654;</b>"]
        shapes.append(dict(type="rect", xref="x2 domain", yref="y2", x0=0, x1=1, y0=r - 0.5,
                           y1=r + 0.5, line=dict(width=0), fillcolor="rgba(0,0,0,0.08)",
                           layer="below"))
    n_vote, n_drag = int(vote.sum()), int(dragged.sum())
    up = corr[dragged]
    drag_note = (f", corr up to 2^{_fmt(float(np.log2(up.max())), 3)}" if n_drag and
                 np.isfinite(up).all() and up.max() > 1 else "")
    layout = dict(
        title=dict(text=title or (f"Rows {w0}-{w0 + 31} at step {step} ({phase}), {policy}: "
                                  f"{n_vote} voted, the wave {'fired' if fire else 'did not fire'}, "
                                  f"{n_drag} dragged{drag_note}"), font=dict(size=14),
                   x=0, xref="paper", xanchor="left"),
        xaxis=dict(domain=[0, 0.12], range=[-0.8, 1.8], tickvals=[0, 1],
                   ticktext=["lanes<br>0-31", "lanes<br>32-63"], anchor="y", fixedrange=True),
        yaxis=dict(domain=[0.2, 1], range=[31.7, -0.7], title="query row", anchor="x",
                   tickvals=tickvals, ticktext=ticktext, fixedrange=True),
        xaxis2=dict(domain=[0.29, 1], range=[left, right], anchor="y2", zeroline=False,
                    title="jump = tile max - m before the step (log2 units)"),
        yaxis2=dict(domain=[0.2, 1], range=[31.7, -0.7], anchor="x2", tickvals=tickvals,
                    showticklabels=False),
        shapes=shapes, annotations=notes, height=520,
        legend=dict(orientation="h", yanchor="top", y=0.02, xanchor="left", x=0.29,
                    font=dict(size=11)),
        margin=dict(t=80, b=40, l=70, r=30), plot_bgcolor="#ffffff")
    return go.Figure(data=data, layout=_labels_unchecked(layout))


# ---- output figures --------------------------------------------------------------------

#: How a non-finite row reads, without and with its LSE (docs/semantics.md section 7.2):
#: (name, colour) by code; code 0 is a finite row.
ROW_STATES = (("finite", "#e6e6e6"), ("NaN", "#d62728"), ("+inf", "#ff7f0e"),
              ("-inf", "#1f77b4"))
ROW_FATES = (("finite", "#e6e6e6"), ("NaN output, LSE = +inf (l overflowed)", "#d62728"),
             ("inf output, LSE finite (O overflowed, l did not)", "#ff7f0e"),
             ("LSE = NaN", "#000000"), ("non-finite output, LSE = -inf", "#1f77b4"))


def row_fates(out: torch.Tensor, lse: torch.Tensor | None = None) -> torch.Tensor:
    """One code per row (b, s, h) of ``out`` [B, S, H, D]: 0 where the row is finite.
    Without ``lse``: 1 NaN in the row, else 2 +inf, else 3 -inf (``ROW_STATES``). With
    ``lse`` [B, H, S], how the row died (``ROW_FATES``, docs/semantics.md section 7.2): 1
    LSE = +inf (l overflowed; the output is NaN), 2 LSE finite (O overflowed and l did
    not: +-inf in the output, perhaps NaN), 3 LSE NaN, 4 LSE = -inf."""
    _check_tensor("out", out, 4)
    o = out.detach()
    bad = ~torch.isfinite(o).all(-1)
    cat = torch.zeros(bad.shape, dtype=torch.int64, device=o.device)
    if lse is None:
        cat = torch.where((o == -math.inf).any(-1), 3, cat)
        cat = torch.where((o == math.inf).any(-1), 2, cat)
        cat = torch.where(torch.isnan(o).any(-1), 1, cat)
        return cat.cpu()
    _check_tensor("lse", lse, 3)
    if (out.shape[0], out.shape[2], out.shape[1]) != tuple(lse.shape):
        raise ValueError(f"out {tuple(out.shape)} does not match lse {tuple(lse.shape)} "
                         "(out is [B, S, H, D], lse [B, H, S])")
    L = lse.detach().permute(0, 2, 1).to(cat.device)
    code = torch.where(L == math.inf, 1, torch.where(torch.isnan(L), 3,
                                                      torch.where(L == -math.inf, 4, 2)))
    return torch.where(bad, code, cat).cpu()


def nonfinite_map(out: torch.Tensor, batch: int = 0, title: str | None = None, *,
                  lse: torch.Tensor | None = None, highlight: tuple | None = None,
                  height: int = 420) -> go.Figure:
    """Every non-finite row of an output [B, S, H, D] (one batch) as one mark at
    (head, query row), coloured by category, so that no bad row disappears at any S or H
    (one trace per category, the commonest first, so the rarer ones stay on top).
    Without ``lse`` the category is the row's worst element (NaN, then +inf, then -inf);
    with ``lse`` [B, H, S] it is how the row died (``row_fates``). ``highlight`` = (row,
    head) rings a followed row. The legend counts the rows of each category."""
    _check_tensor("out", out, 4)
    batch = _check_index("batch", batch, out.shape[0])
    cat = row_fates(out, lse)[batch].numpy()      # [S, H]
    states = ROW_STATES if lse is None else ROW_FATES
    S, H = cat.shape
    o = out[batch].detach()
    counts = {i: int((cat == i).sum()) for i in range(len(states))}
    nan_n = torch.isnan(o).sum(-1).cpu().numpy()
    inf_n = (o == math.inf).sum(-1).cpu().numpy()
    ninf_n = (o == -math.inf).sum(-1).cpu().numpy()
    lse_v = None if lse is None else lse[batch].detach().double().cpu().numpy().T   # [S, H]
    bar = max(8, min(60, int(300 / H)))
    data = []
    # the commonest category first, so that the rarer ones are drawn over it where the marks
    # of a dense map overlap
    order = sorted(range(1, len(states)), key=lambda i: -counts[i])
    for i in order:
        name, color = states[i]
        rows, heads = np.nonzero(cat == i)
        text = [f"query row {r}, head {h}<br>NaN {nan_n[r, h]}, +inf {inf_n[r, h]}, -inf "
                f"{ninf_n[r, h]} of {o.shape[-1]}"
                + ("" if lse_v is None else f"<br>LSE = {_fmt(float(lse_v[r, h]), 6)}")
                for r, h in zip(rows, heads)]
        data.append(go.Scatter(
            x=heads, y=rows, mode="markers", name=f"{name}: {counts[i]} rows",
            marker=dict(symbol="line-ew", size=bar, color=color, line=dict(color=color, width=3)),
            text=text, hovertemplate="%{text}<extra></extra>"))
    hx, hy, htext = [], [], []
    if highlight is not None:
        r, h = (int(x) for x in highlight)
        if 0 <= r < S and 0 <= h < H:
            hx, hy = [h], [r]
            htext = [f"followed row {r}, head {h}: {states[int(cat[r, h])][0]}"]
    data.append(go.Scatter(
        x=hx, y=hy, mode="markers+text", name="followed row", text=[f"row {r}" for r in hy],
        textposition="middle right", hovertext=htext, hovertemplate="%{hovertext}<extra></extra>",
        marker=dict(symbol="circle-open", size=18, color="#000000", line=dict(width=2.5))))
    bad = S * H - counts[0]
    shapes = [dict(type="rect", xref="x", yref="y", x0=-0.5, x1=H - 0.5, y0=-0.5, y1=S - 0.5,
                   fillcolor=states[0][1], line=dict(width=0), layer="below")]
    top, bottom_m = 50, 96
    plot_h = max(100, height - top - bottom_m)
    layout = dict(
        title=dict(text=title or f"Non-finite rows: {bad} of {S * H} ({100 * bad / (S * H):.2f} %)"
                   f"; grey: {counts[0]} finite rows", font=dict(size=14), x=0, xref="paper",
                   xanchor="left", y=1 - 14 / height, yanchor="top"),
        xaxis=dict(title=f"head (batch {batch})", range=[-0.5, H - 0.5], zeroline=False,
                   dtick=1 if H <= 16 else None, showgrid=False),
        yaxis=dict(title="query row", range=[S - 0.5, -0.5], zeroline=False, showgrid=False),
        shapes=shapes, height=height, plot_bgcolor="#ffffff",
        legend=dict(orientation="h", yanchor="top", y=-52 / plot_h, xanchor="left", x=0,
                    font=dict(size=11)),
        margin=dict(t=top, b=bottom_m, l=70, r=20))
    return go.Figure(data=data, layout=_labels_unchecked(layout))


def lse_rows(lse: torch.Tensor, out: torch.Tensor | None = None, batch: int = 0, head: int = 0,
             title: str | None = None) -> go.Figure:
    """LSE (natural log) per query row of one (batch, head). Rows whose LSE is +inf or NaN
    are drawn as markers at the top edge, -inf (no visible column) at the bottom edge.
    Given ``out`` [B, S, H, D], finite-LSE rows whose output is not finite are singled out."""
    _check_tensor("lse", lse, 3)
    batch = _check_index("batch", batch, lse.shape[0])
    head = _check_index("head", head, lse.shape[1])
    y = lse[batch, head].detach().double().cpu().numpy()
    S = y.shape[0]
    rows = np.arange(S)
    out_ok = np.ones(S, dtype=bool)
    if out is not None:
        _check_tensor("out", out, 4)
        if (out.shape[0], out.shape[2], out.shape[1]) != tuple(lse.shape):
            raise ValueError(f"out {tuple(out.shape)} does not match lse {tuple(lse.shape)} "
                             "(out is [B, S, H, D], lse [B, H, S])")
        out_ok = torch.isfinite(out[batch, :, head]).all(-1).cpu().numpy()
    fin = np.isfinite(y)
    lo, hi = (float(y[fin].min()), float(y[fin].max())) if fin.any() else (0.0, 1.0)
    pad = max(1.0, 0.08 * (hi - lo))
    top, bottom = hi + pad, lo - pad
    fig = go.Figure()
    groups = (
        (fin & out_ok, "LSE finite, output finite", "circle", "#1f77b4", None),
        (fin & ~out_ok, "LSE finite, output non-finite", "circle", "#9467bd", None),
        (y == math.inf, "LSE = +inf (drawn at the top edge)", "triangle-up", "#d62728", top),
        (np.isnan(y), "LSE = NaN (drawn at the top edge)", "x", "#000000", top),
        (y == -math.inf, "LSE = -inf, no visible column (bottom edge)", "triangle-down",
         "#7f7f7f", bottom),
    )
    for mask, name, sym, color, edge in groups:
        ys = y[mask] if edge is None else np.full(int(mask.sum()), edge)
        fig.add_trace(go.Scatter(
            x=rows[mask], y=ys, mode="markers",
            name=f"{name}: {int(mask.sum())} rows",
            marker=dict(symbol=sym, size=5 if edge is None else 8, color=color),
            text=[_fmt(v, 6) for v in y[mask]],
            hovertemplate="query row %{x}<br>LSE = %{text}<extra></extra>"))
    fig.update_layout(
        title=title or f"LSE per query row (batch {batch}, head {head})",
        xaxis=dict(title="query row"),
        yaxis=dict(title="LSE (natural log)", range=[bottom - 0.5 * pad, top + 0.5 * pad]),
        legend=dict(orientation="h", yanchor="top", y=-0.18, xanchor="left", x=0),
        height=440, margin=dict(b=110))
    return fig


def output_difference_rows(outputs: dict, reference: torch.Tensor, batch: int = 0, head: int = 0,
                           title: str | None = None) -> go.Figure:
    """Per query row of (batch, head): max |o - reference| over the head dim, one marker
    series per named output (log y). Rows with a non-finite output are drawn as x at the
    top edge, rows exactly equal to the reference at the bottom edge."""
    if not isinstance(outputs, dict) or not outputs:
        raise ValueError("outputs must be a non-empty dict name -> output tensor [B, S, H, D]")
    _check_tensor("reference", reference, 4)
    batch = _check_index("batch", batch, reference.shape[0])
    head = _check_index("head", head, reference.shape[2])
    ref = reference[batch, :, head].detach().double().cpu()
    S = ref.shape[0]
    diffs, bad = {}, {}
    for name, o in outputs.items():
        _check_tensor(f"outputs[{name!r}]", o, 4)
        if tuple(o.shape) != tuple(reference.shape):
            raise ValueError(f"outputs[{name!r}] has shape {tuple(o.shape)}, reference has "
                             f"{tuple(reference.shape)}")
        row = o[batch, :, head].detach().double().cpu()
        ok = torch.isfinite(row).all(-1)
        d = (row - ref).abs().amax(-1)
        diffs[name] = torch.where(ok, d, torch.full_like(d, math.nan)).numpy()
        bad[name] = (~ok).numpy()
    finite = np.concatenate([d[np.isfinite(d) & (d > 0)] for d in diffs.values()])
    hi = float(finite.max()) if finite.size else 1.0
    # The bottom follows the bulk (1st percentile), not the odd exact row.
    lo = float(np.quantile(finite, 0.01)) if finite.size else 1e-3
    top = hi * 4
    # A row equal to the reference has no place on a log axis: drawn at the bottom edge.
    floor = lo * 10 ** -0.2
    rows = np.arange(S)
    fig = go.Figure()
    for name, d in diffs.items():
        color = policy_color(name)
        worst = np.nanmax(d) if np.isfinite(d).any() else math.nan
        fig.add_trace(go.Scatter(
            x=rows, y=_finite_or_none(np.where(d > 0, d, np.where(d == 0, floor, np.nan))),
            mode="markers",
            name=f"{name}: max {_fmt(float(worst), 3)} over finite rows",
            marker=dict(color=color, size=5, opacity=0.7, symbol=policy_symbol(name, hollow=True)),
            legendgroup=name,
            hovertemplate=f"{name}<br>query row %{{x}}<br>max |o - ref| = %{{y:.3g}}<extra></extra>"))
    for name, b in bad.items():
        color = policy_color(name)
        fig.add_trace(go.Scatter(
            x=rows[b], y=np.full(int(b.sum()), top), mode="markers", legendgroup=name,
            name=f"{name}: {int(b.sum())} non-finite rows (top edge)",
            marker=dict(symbol="x", size=8, color=color),
            hovertemplate=f"{name}<br>query row %{{x}}: output not finite<extra></extra>"))
    fig.update_layout(_labels_unchecked(dict(
        title=title or f"Difference from the fp32 reference per query row (batch {batch}, head {head})",
        xaxis=dict(title="query row"),
        yaxis=dict(title="max |o - reference| over the head dim", type="log",
                   range=[math.log10(lo) - 0.3, math.log10(top) + 0.3], exponentformat="power"),
        legend=dict(orientation="h", yanchor="top", y=-0.18, xanchor="left", x=0),
        height=440, margin=dict(b=110))))
    return fig


# ---- table figures ---------------------------------------------------------------------

def _check_table(table, columns, name):
    if not isinstance(table, pd.DataFrame):
        raise TypeError(f"table must be a pandas DataFrame (from experiments.{name}), "
                        f"got {type(table).__name__}")
    missing = [c for c in columns if c not in table.columns]
    if missing:
        raise ValueError(f"table lacks columns {missing} (expected experiments.{name}'s output)")
    if table.empty:
        raise ValueError("table is empty")


def _check_seed(seed):
    if seed is not None and (not isinstance(seed, dict) or "rows" not in seed):
        raise TypeError("seed must be experiments.seed_table(...)'s dict (with 'rows') or None")


def _draw_order(name) -> int:
    """Eager first, so the fixed lazy curve that lies on it stays visible on top."""
    return 0 if policies.color(name) is not None and not policies.get(name).lazy else 1


def bf16_table_curves(table: pd.DataFrame, seed: dict | None = None) -> go.Figure:
    """rel-L2 against fp32 (log y) and NaN % of output elements against K scale, one
    colour per policy; ``seed`` (experiments.seed_table("bf16")) adds the seed's MI355X
    figures as hollow markers. A missing rel-L2 point means that output had NaN."""
    _check_table(table, ("k_scale", "policy", "rel_l2", "nan_frac"), "bf16_table")
    _check_seed(seed)
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1,
                        subplot_titles=("rel-L2 against fp32 (no point: output had NaN)",
                                        "NaN elements (% of output)"))
    for pol, g in sorted(table.groupby("policy", sort=False), key=lambda pg: _draw_order(pg[0])):
        g = g.sort_values("k_scale")
        style = dict(mode="lines+markers", line=_policy_line(pol), legendgroup=pol,
                     marker=dict(size=9, symbol=policy_symbol(pol), color=policy_color(pol)))
        nan_pct = 100 * g.nan_frac.to_numpy(float)
        fig.add_trace(go.Scatter(
            x=g.k_scale.tolist(), y=_finite_or_none(g.rel_l2.to_numpy(float)), name=pol,
            text=[f"NaN {p:.3g} %" for p in nan_pct], **style,
            hovertemplate=f"{pol}<br>K x%{{x}}<br>rel-L2 %{{y:.4g}}<br>%{{text}}<extra></extra>"),
            row=1, col=1)
        fig.add_trace(go.Scatter(
            x=g.k_scale.tolist(), y=nan_pct.tolist(), name=pol, showlegend=False, **style,
            hovertemplate=f"{pol}<br>K x%{{x}}<br>NaN %{{y:.3g}} %<extra></extra>"),
            row=1, col=2)
    ks = sorted(set(table.k_scale.tolist()))
    if seed is not None:
        rows = seed["rows"]
        setup = seed.get("setup", {})
        where = f"seed: {setup.get('device', 'upstream')}, S={setup.get('S', '?')}"
        for pol in ("lazy_unfixed", "lazy", "eager"):
            style = dict(mode="markers", legendgroup=pol, marker=dict(
                symbol=policy_symbol(pol, hollow=True), size=15, color=policy_color(pol),
                line=dict(width=2)))
            if any(pol in r for r in rows):
                fig.add_trace(go.Scatter(
                    x=[r["k_scale"] for r in rows], y=[r.get(pol) for r in rows],
                    name=f"{pol} ({where})", **style,
                    hovertemplate=f"{pol}, seed<br>K x%{{x}}<br>rel-L2 %{{y:.4g}}<extra></extra>"),
                    row=1, col=1)
            key = f"{pol}_nan_pct"
            if any(key in r for r in rows):
                fig.add_trace(go.Scatter(
                    x=[r["k_scale"] for r in rows], y=[r.get(key) for r in rows],
                    name=f"{pol} NaN ({where})", showlegend=False, **style,
                    hovertemplate=f"{pol}, seed<br>K x%{{x}}<br>NaN %{{y:.3g}} %<extra></extra>"),
                    row=1, col=2)
        ks = sorted(set(ks) | {r["k_scale"] for r in rows})
    for col in (1, 2):
        fig.update_xaxes(title_text="K scale (k = N(0,1) x K)", tickvals=ks, row=1, col=col)
    fig.update_yaxes(type="log", exponentformat="power",
                     title_text="rel-L2 = ||o - ref|| / ||ref||", row=1, col=1)
    fig.update_yaxes(title_text="NaN elements (%)", rangemode="tozero", row=1, col=2)
    fig.update_layout(title="bf16: accuracy and NaN against K scale, per rescale policy",
                      height=460, width=1150, legend=dict(x=1.02, y=1, font=dict(size=11)))
    return fig


def _fp8_seed_label(r) -> str | None:
    if r.get("policy") == "lazy_capped":
        return f"bound {r['bound']:g}" if r.get("bound") is not None else None
    return _FP8_SEED_LABEL.get(r.get("policy"))


def fp8_table_curves(table: pd.DataFrame, seed: dict | None = None) -> go.Figure:
    """mean |o - 1| (V = ones; over the finite elements) and NaN elements (% of output,
    count in the hover) against the k scale, per variant, log x. ``seed``
    (experiments.seed_table("fp8")) adds the seed's figures as hollow markers, its NaN
    counts as a share of its own output size. Both y axes are logarithmic, so a leak of a
    few thousand elements (bound 32) shows beside a NaN share near 100 %; an exact 0 (a
    mean of 0, no NaN at all) cannot sit on a log axis and is drawn as a triangle at the
    bottom edge."""
    _check_table(table, ("k_scale", "variant", "mean_abs_dev", "nan"), "fp8_table")
    _check_seed(seed)
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1,
                        subplot_titles=("mean |o - 1| over finite elements",
                                        "NaN elements (% of output)"))
    mad = table.mean_abs_dev.to_numpy(float)
    if seed is not None:
        mad = np.concatenate([mad, [np.nan if r.get("mean_abs_dev") is None else
                                    r["mean_abs_dev"] for r in seed["rows"]]])
    pos = mad[np.isfinite(mad) & (mad > 0)]
    floor = float(pos.min()) / 3 if pos.size else 1e-5
    pcts = [100 * table.nan.to_numpy(float) / (table["elements"].to_numpy(float)
                                              if "elements" in table else np.nan)]
    if seed is not None:
        setup = seed.get("setup", {})
        if all(k in setup for k in ("B", "S", "H", "D")):
            n_all = math.prod(int(setup[k]) for k in ("B", "S", "H", "D"))
            pcts.append([100 * r["nan"] / n_all for r in seed["rows"] if r.get("nan") is not None])
    pcts = np.concatenate([np.asarray(p, float) for p in pcts])
    pos_pct = pcts[np.isfinite(pcts) & (pcts > 0)]
    # one decade under the smallest share that is not 0: where "no NaN at all" sits
    nan_floor = 10.0 ** (math.floor(math.log10(float(pos_pct.min()))) - 1) if pos_pct.size else 1e-4

    def on_log(p):
        p = np.asarray(p, dtype=float)
        return np.where(p > 0, p, np.where(p == 0, nan_floor, np.nan))

    def zero_symbols(p, sym):
        return [("triangle-down" + ("-open" if sym.endswith("-open") else "")) if v == 0 else sym
                for v in p]
    for var, g in sorted(table.groupby("variant", sort=False), key=lambda vg: _draw_order(vg[0])):
        g = g.sort_values("k_scale")
        c = policy_color(var)
        style = dict(legendgroup=var, line=_policy_line(var),
                     marker=dict(size=9, symbol=policy_symbol(var), color=c))
        y = g.mean_abs_dev.to_numpy(float)
        n_nan = g.nan.to_numpy(float)
        elements = g["elements"].to_numpy(float) if "elements" in g else np.full(len(g), np.nan)
        text = [f"{int(n)} NaN elements of {_fmt(e)}" for n, e in zip(n_nan, elements)]
        fig.add_trace(go.Scatter(
            x=g.k_scale.tolist(), y=_finite_or_none(np.where(y > 0, y, np.nan)), name=var,
            mode="lines+markers", text=text, **style,
            hovertemplate=f"{var}<br>k x%{{x}}<br>mean |o-1| %{{y:.3g}}<br>%{{text}}<extra></extra>"),
            row=1, col=1)
        zero = y == 0
        fig.add_trace(go.Scatter(
            x=g.k_scale[zero].tolist(), y=[floor] * int(zero.sum()), name=f"{var}: exactly 0",
            legendgroup=var, showlegend=False, mode="markers",
            marker=dict(symbol="triangle-down", size=12, color=c),
            hovertemplate=f"{var}<br>k x%{{x}}<br>mean |o-1| = 0 exactly (bottom edge)<extra></extra>"),
            row=1, col=1)
        pct = 100 * n_nan / elements
        nan_style = dict(style, marker=dict(style["marker"],
                                            symbol=zero_symbols(pct, policy_symbol(var))))
        fig.add_trace(go.Scatter(
            x=g.k_scale.tolist(), y=_finite_or_none(on_log(pct)), name=var,
            showlegend=False, mode="lines+markers", text=text, **nan_style,
            hovertemplate=f"{var}<br>k x%{{x}}<br>%{{text}}<extra></extra>"),
            row=1, col=2)
    ks = sorted(set(table.k_scale.tolist()))
    if seed is not None:
        setup = seed.get("setup", {})
        dims = ("B", "S", "H", "D")
        n_seed = math.prod(int(setup[k]) for k in dims) if all(k in setup for k in dims) else None
        where = f"seed: {setup.get('device', 'upstream')}, S={setup.get('S', '?')}"
        by_label: dict[str, list] = {}
        for r in seed["rows"]:
            label = _fp8_seed_label(r)
            if label is not None:
                by_label.setdefault(label, []).append(r)
        for label, rs in by_label.items():
            kx = [r["k_scale"] for r in rs]
            style = dict(legendgroup=label, mode="markers", marker=dict(
                symbol=policy_symbol(label, hollow=True), size=15, color=policy_color(label),
                line=dict(width=2)))
            ys = [r.get("mean_abs_dev") for r in rs]
            # The seed prints 0.0000 for means below 5e-5: on the bottom edge, like ours.
            style["marker"]["symbol"] = [("triangle-down-open" if v == 0 else
                                          policy_symbol(label, hollow=True)) for v in ys]
            fig.add_trace(go.Scatter(
                x=kx, y=[floor if v == 0 else v for v in ys],
                name=f"{label} ({where})", **style,
                hovertemplate=f"{label}, seed<br>k x%{{x}}<br>mean |o-1| %{{y:.3g}}<extra></extra>"),
                row=1, col=1)
            style["marker"]["symbol"] = policy_symbol(label, hollow=True)
            if n_seed:
                pct = [math.nan if r.get("nan") is None else 100 * r["nan"] / n_seed for r in rs]
                style["marker"]["symbol"] = zero_symbols(pct, policy_symbol(label, hollow=True))
                fig.add_trace(go.Scatter(
                    x=kx, y=[None if not math.isfinite(p) else float(y_) for p, y_ in
                             zip(pct, on_log(pct))],
                    name=f"{label} NaN ({where})", showlegend=False, **style,
                    text=[f"{_fmt(r.get('nan'))} NaN elements of {n_seed}" for r in rs],
                    hovertemplate=f"{label}, seed<br>k x%{{x}}<br>%{{text}}<extra></extra>"),
                    row=1, col=2)
            ks = sorted(set(ks) | set(kx))
    for col in (1, 2):
        fig.update_xaxes(type="log", tickvals=ks, title_text="k scale (k = 0.1 N(0,1) x k scale)",
                         row=1, col=col)
    fig.update_yaxes(type="log", exponentformat="power", dtick=1, title_text="mean |o - 1| (V = ones)",
                     row=1, col=1)
    fig.update_yaxes(type="log", exponentformat="power", dtick=1, row=1, col=2,
                     title_text=f"NaN elements (% of output; none: at {_fmt(nan_floor, 2)})",
                     range=[math.log10(nan_floor) - 0.3, math.log10(100) + 0.3])
    fig.update_layout(title="fp8: accuracy and NaN against k scale, per rebase rule",
                      height=460, width=1150, legend=dict(x=1.02, y=1, font=dict(size=11)))
    return fig


# ---- static export ---------------------------------------------------------------------

_SCOPE = None


def _kaleido_scope():
    """kaleido 0.2.1's scope, pointed at plotly's own plotly.js (it would fetch one from a
    CDN otherwise; plotly >= 6's write_image wants kaleido >= 1, which this repo pins out)."""
    global _SCOPE
    if _SCOPE is None:
        try:
            from kaleido.scopes.plotly import PlotlyScope
        except ImportError as e:  # pragma: no cover - kaleido is a dev dependency
            raise ImportError("to_png needs kaleido 0.2.1 (pip install 'kaleido==0.2.1')") from e
        import plotly
        js = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
        _SCOPE = PlotlyScope(plotlyjs=str(js))
    return _SCOPE


def to_png(fig: go.Figure, path, *, width: int | None = None, height: int | None = None,
           scale: float = 1.0) -> Path:
    """Write ``fig`` as a PNG at ``path`` (written beside it, then renamed into place)."""
    if not isinstance(fig, go.Figure):
        raise TypeError(f"fig must be a plotly Figure, got {type(fig).__name__}")
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ValueError(f"path must end in .png, got {str(path)!r}")
    width = width or fig.layout.width or 1000
    height = height or fig.layout.height or 500
    with warnings.catch_warnings():  # kaleido 0.2.1 starts its thread the old way
        warnings.simplefilter("ignore", DeprecationWarning)
        png = _kaleido_scope().transform(fig, format="png", width=width, height=height,
                                         scale=scale)
    from fa_lab.studies.experiments import atomic_write_bytes
    return atomic_write_bytes(path, png)
