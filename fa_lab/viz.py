"""Plotly figures for traces, outputs and the seed's tables: data in, figure out.

Every function takes something fa_lab already computed (a ``Trace``, an output tensor, an
LSE tensor, a table from ``experiments``) and returns a ``plotly.graph_objects.Figure``;
nothing here runs attention. The widgets in ``fa_lab.widgets`` call these same functions,
so every view a dashboard shows can be rebuilt in a script.

Conventions kept by every figure:
  * one colour per policy / variant everywhere (``POLICY_COLORS``);
  * running maxima in log2 units (the fp8 kernel's raw units are converted with
    ``Trace.log2_per_unit``), LSE in natural log as the kernels return it;
  * values that cannot be plotted (inf, NaN) are drawn as markers at the edge of the axis
    and named in the legend, never silently dropped;
  * each figure keeps the same list of traces whatever the data (empty when there is
    nothing to mark), so a dashboard can update a FigureWidget trace by trace.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

#: One colour per rescale policy (bf16 names) and per fp8-table variant label.
POLICY_COLORS = {
    "eager": "#1b9e77",         # green: the reference online softmax
    "lazy": "#1f77b4",          # blue: the fixed lazy rescale (PR #1033)
    "monotonic": "#1f77b4",     # the fp8 table's name for the same fixed rule
    "lazy_unfixed": "#d62728",  # red: upstream before the fix
    "unfixed": "#d62728",
    "lazy_capped": "#7b4fb8",   # purple: the seed's capped rebase (default bound 16)
    "bound 8": "#b79ddf",
    "bound 16": "#7b4fb8",
    "bound 32": "#3f1d78",
    "fp8": "#ff7f0e",           # orange: any fp8 output set beside bf16 ones
    "reference": "#444444",
}
#: Colour for names not in POLICY_COLORS.
OTHER_COLOR = "#8c8c8c"
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
#: Categories of nonfinite_map, in colour-bar order.
_ROW_STATES = (("finite", "#e6e6e6"), ("NaN", "#d62728"), ("+inf", "#ff7f0e"),
               ("-inf", "#1f77b4"))

#: Trace values a heatmap can show: column -> (label, how to turn it into a number).
_TRACE_VALUES = {
    "m": "running max m",
    "mt": "tile max",
    "l": "log2(l)",
    "corr": "log2(corr)",
    "vote": "row voted (1) or not (0)",
    "fire": "wave fired (1) or not (0)",
    "dragged": "row dragged (1) or not (0)",
    "o_finite": "O finite (1) or not (0)",
    "l_finite": "l finite (1) or not (0)",
}


def policy_color(name: str) -> str:
    """The colour of a policy or variant name (grey for names not in POLICY_COLORS)."""
    return POLICY_COLORS.get(str(name), OTHER_COLOR)


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


def trace_values(trace, value: str) -> pd.DataFrame:
    """Lanes x steps table of ``value`` in plotting units: m and mt in log2 units, l and
    corr as log2(.), flags as 0/1. Non-finite entries stay (as inf/NaN)."""
    _check_trace(trace)
    if value not in _TRACE_VALUES:
        raise ValueError(f"value={value!r}; choose one of {sorted(_TRACE_VALUES)}")
    mat = trace.matrix(value)
    if value in ("m", "mt"):
        return mat.astype(float) * float(trace.log2_per_unit)
    if value in ("l", "corr"):
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.log2(mat.astype(float))
    return mat.astype(float)


def value_title(trace, value: str) -> str:
    label = _TRACE_VALUES[value]
    if value in ("m", "mt", "l", "corr"):
        unit = "log2 units"
        if _is_fp8(trace) and value in ("m", "mt"):
            unit = "log2 units = raw fp8 units x log2_per_unit"
        return f"{label} ({unit})"
    return label


# ---- trace figures ---------------------------------------------------------------------

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


def running_max_heatmap(trace, value: str = "m", title: str | None = None) -> go.Figure:
    """Traced lanes (rows) x KV steps (columns) heatmap of one trace value.

    Markers: x where the row was dragged (its wave fired while its tile max sat below its
    running max), open circles where its wave fired otherwise, a black star at the first
    step where O or l stopped being finite.
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
    data = []
    # Cells that cannot be coloured by value: black for +inf / NaN, grey for -inf. They sit
    # under the value layer, which leaves them as gaps.
    flag = np.where(np.isnan(raw) | (raw == math.inf), 1.0,
                    np.where(raw == -math.inf, 0.0, np.nan))
    data.append(go.Heatmap(
        z=_grid(flag), x=steps, y=lane_ids, zmin=0, zmax=1, showscale=False,
        colorscale=[[0, "#bdbdbd"], [1, "#111111"]], hoverinfo="skip", name="not finite"))
    data.append(go.Heatmap(
        z=_grid(raw), x=steps, y=lane_ids, text=text,
        hovertemplate="%{text}<extra></extra>", colorscale="Viridis",
        colorbar=dict(title=dict(text=ctitle, side="right"), len=0.9), name=value,
        hoverongaps=True))

    st = trace.steps
    fired = st[st.fire & ~st.dragged]
    dragged = st[st.dragged]
    data.append(_event_markers(labels, fired, "wave fired (row not dragged)", "circle",
                                 "#ffffff", 6, edge="#000000"))
    data.append(_event_markers(labels, dragged, "dragged (wave fired, tile max < m)", "x-thin",
                                 "#ff2d2d", 9))
    first = lanes["first_nonfinite_step"].dropna()
    data.append(go.Scatter(
        x=first.to_numpy(dtype=int), y=first.index.to_numpy(dtype=int), mode="markers",
        name="first non-finite O or l", marker=dict(symbol="star", size=13,
                                                     color=NONFINITE_COLOR,
                                                     line=dict(color="#ffffff", width=1)),
        text=[f"{labels[int(i)]}<br>first non-finite at step {int(s)}"
              for i, s in first.items()],
        hovertemplate="%{text}<extra></extra>"))

    tickvals, ticktext, ytitle = _lane_ticks(lanes.loc[lane_ids.tolist()])
    n_bad = int((~lanes["out_finite"]).sum())
    notes = []
    if np.isfinite(flag).any():
        notes.append(dict(x=0, xref="paper", y=-0.16, yref="paper", xanchor="left",
                          yanchor="top", showarrow=False, font=dict(size=11),
                          text="black cell: value is +inf or NaN; grey cell: -inf "
                               "(e.g. log2(l) while l is still 0)"))
    layout = dict(
        annotations=notes,
        title=title or (f"{_TRACE_VALUES[value]} per traced row, {_policy_label(trace)}: "
                        f"{n_bad} of {len(lanes)} rows non-finite"),
        xaxis=dict(title=step_axis_title(trace)),
        yaxis=dict(title=ytitle, tickvals=tickvals, ticktext=ticktext, autorange="reversed"),
        legend=dict(orientation="h", yanchor="bottom", y=1.0, xanchor="left", x=0),
        height=max(360, min(900, 160 + 9 * len(lane_ids))),
        margin=dict(t=110, b=90), plot_bgcolor="#ffffff")
    # One constructor call: plotly validates far less than with add_trace/update_layout.
    return go.Figure(data=data, layout=layout)


def _event_markers(labels: dict, rows: pd.DataFrame, name, symbol, color, size,
                   edge=None) -> go.Scatter:
    text = [f"{labels[int(ln)]}<br>step {int(st)}: {name}"
            for ln, st in zip(rows["lane"], rows["step"])]
    return go.Scatter(x=rows["step"].to_numpy(dtype=int), y=rows["lane"].to_numpy(dtype=int),
                      mode="markers", name=name, text=text,
                      hovertemplate="%{text}<extra></extra>",
                      marker=dict(symbol=symbol, size=size, color=color,
                                  line=dict(color=edge or color, width=1 if edge else 1.5)))


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
    """Markers for the non-finite entries of each (name, values): x, y, hover text."""
    xs, ys, text = [], [], []
    for name, vals in named_series:
        for s, v in zip(x, vals):
            if not math.isfinite(v):
                xs.append(s)
                ys.append(bottom if v == -math.inf else top)
                text.append(f"step {s}: {name} = {_fmt(v)}")
    return xs, ys, text


def lane_lines(trace, lane: int, title: str | None = None) -> go.Figure:
    """One traced lane step by step: m, the tile max and the vote line (m before the step
    plus the threshold) on top; log2(l) and log2(corr) below. Wave fires and drags are
    marked on m; values that are not finite sit at the panel's top (+inf, NaN) or bottom
    (-inf) edge; the first non-finite step of O or l gets a vertical line."""
    _check_trace(trace)
    lane = _check_index("lane", lane, len(trace.lanes))
    d = trace.lane(lane)
    per = float(trace.log2_per_unit)
    x = d["step"].astype(int).tolist()
    m = d["m"].to_numpy(float) * per
    mt = d["mt"].to_numpy(float) * per
    with np.errstate(divide="ignore", invalid="ignore"):
        log_l = np.log2(d["l"].to_numpy(float))
        log_corr = np.log2(d["corr"].to_numpy(float))
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

    line("m, running max", m, 1, mode="lines+markers", line=dict(color=color, width=2.5),
         marker=dict(size=4))
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
    for mask, name, sym, col in ((fired, "wave fired", "circle-open", "#222222"),
                                 (dragged, "dragged (fired, tile max < m)", "x-thin", "#ff2d2d")):
        xs = [s for s, k in zip(x, mask) if k]
        data.append(go.Scatter(x=xs, y=_finite_or_none(m[mask]), name=name, mode="markers",
                               marker=dict(symbol=sym, size=12, color=col,
                                           line=dict(color=col, width=2)),
                               hovertemplate=f"step %{{x}}: {name}<extra></extra>", **panel[1]))
    # l is often corr times the previous l: the dashed corr line keeps l visible under it.
    line("log2(l)", log_l, 2, mode="lines+markers", line=dict(color="#2ca02c", width=3),
         marker=dict(size=6))
    line("log2(corr)", log_corr, 2, mode="lines+markers",
         line=dict(color="#ff7f0e", dash="dash", width=1.5), marker=dict(size=4))

    # Non-finite values at the panel edges, one marker trace per panel.
    # The fp32 ceiling is worth drawing only when l comes near it (or passes it).
    near_overflow = bool(np.any(np.isnan(log_l) | (log_l == math.inf)) or np.max(
        np.where(np.isfinite(log_l), log_l, 0.0), initial=0.0) > FP32_LOG2_MAX / 2)
    lower = [log_l, log_corr] + ([[FP32_LOG2_MAX]] if near_overflow else [])
    panels = ((1, [("m", m), ("tile max", mt)], _edges(m, mt)),
              (2, [("log2(l)", log_l), ("log2(corr)", log_corr)], _edges(*lower)))
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
                           line=dict(color="#2ca02c", dash="dot", width=1)))
        notes.append(dict(x=0, xref="x2 domain", y=FP32_LOG2_MAX, yref="y2", yanchor="bottom",
                          xanchor="left", showarrow=False, font=dict(color="#2ca02c", size=11),
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
    lse = float(info["lse"])
    layout = dict(
        title=dict(text=title or f"{who}, {_policy_label(trace)}: final LSE = {_fmt(lse, 6)} (ln)",
                   font=dict(size=14)),
        shapes=shapes, annotations=notes, height=580,
        legend=dict(orientation="h", yanchor="top", y=-0.12, xanchor="left", x=0),
        margin=dict(b=130),
        xaxis=dict(domain=[0, 1], anchor="y", matches="x2", showticklabels=False),
        yaxis=dict(domain=[0.47, 1], anchor="x", title="m, tile max (log2 units)",
                   range=ranges[1]),
        xaxis2=dict(domain=[0, 1], anchor="y2", title=step_axis_title(trace)),
        yaxis2=dict(domain=[0, 0.39], anchor="x2", title="log2(l), log2(corr)",
                    range=ranges[2]))
    return go.Figure(data=data, layout=layout)


# ---- output figures --------------------------------------------------------------------

def nonfinite_map(out: torch.Tensor, batch: int = 0, title: str | None = None) -> go.Figure:
    """Query rows x heads of an output [B, S, H, D]: finite, NaN, +inf or -inf per row
    (a row with NaN counts as NaN, then +inf, then -inf)."""
    _check_tensor("out", out, 4)
    batch = _check_index("batch", batch, out.shape[0])
    o = out[batch].detach().float().cpu()  # [S, H, D]
    nan = torch.isnan(o).sum(-1)
    pinf = (o == math.inf).sum(-1)
    ninf = (o == -math.inf).sum(-1)
    cat = torch.zeros_like(nan)
    cat = torch.where(ninf > 0, 3, cat)
    cat = torch.where(pinf > 0, 2, cat)
    cat = torch.where(nan > 0, 1, cat)
    S, H = cat.shape
    counts = [int((cat == i).sum()) for i in range(len(_ROW_STATES))]
    n = len(_ROW_STATES)
    scale = []
    for i, (_, c) in enumerate(_ROW_STATES):
        scale += [[i / n, c], [(i + 1) / n, c]]
    custom = torch.stack([nan, pinf, ninf], -1).numpy()
    fig = go.Figure(go.Heatmap(
        z=cat.numpy(), x=np.arange(H), y=np.arange(S), customdata=custom,
        zmin=-0.5, zmax=n - 0.5, colorscale=scale, xgap=1 if H <= 64 else 0,
        colorbar=dict(title=dict(text="row state"), tickvals=list(range(n)),
                      ticktext=[f"{name} ({k} rows)" for (name, _), k in zip(_ROW_STATES, counts)]),
        hovertemplate=("query row %{y}, head %{x}<br>NaN elements: %{customdata[0]}"
                       f"<br>+inf elements: %{{customdata[1]}}<br>-inf elements: "
                       f"%{{customdata[2]}} (of {o.shape[-1]})<extra></extra>")))
    bad = S * H - counts[0]
    fig.update_layout(
        title=title or f"Non-finite rows: {bad} of {S * H} ({100 * bad / (S * H):.2f} %)",
        xaxis=dict(title=f"head (batch {batch})", dtick=1 if H <= 16 else None),
        yaxis=dict(title="query row", autorange="reversed"), height=420)
    return fig


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
    fig.update_layout(
        title=title or f"Difference from the fp32 reference per query row (batch {batch}, head {head})",
        xaxis=dict(title="query row"),
        yaxis=dict(title="max |o - reference| over the head dim", type="log",
                   range=[math.log10(lo) - 0.3, math.log10(top) + 0.3], exponentformat="power"),
        legend=dict(orientation="h", yanchor="top", y=-0.18, xanchor="left", x=0),
        height=440, margin=dict(b=110))
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
    return 0 if name == "eager" else 1


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
    counts as a share of its own output size. A mean of exactly 0 cannot sit on a log
    axis: it is drawn as a triangle at the bottom edge."""
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
        fig.add_trace(go.Scatter(
            x=g.k_scale.tolist(), y=_finite_or_none(100 * n_nan / elements), name=var,
            showlegend=False, mode="lines+markers", text=text, **style,
            hovertemplate=f"{var}<br>k x%{{x}}<br>NaN %{{y:.3g}} %<br>%{{text}}<extra></extra>"),
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
                fig.add_trace(go.Scatter(
                    x=kx, y=[None if r.get("nan") is None else 100 * r["nan"] / n_seed for r in rs],
                    name=f"{label} NaN ({where})", showlegend=False, **style,
                    text=[f"{_fmt(r.get('nan'))} NaN elements of {n_seed}" for r in rs],
                    hovertemplate=f"{label}, seed<br>k x%{{x}}<br>NaN %{{y:.3g}} %<br>%{{text}}<extra></extra>"),
                    row=1, col=2)
            ks = sorted(set(ks) | set(kx))
    for col in (1, 2):
        fig.update_xaxes(type="log", tickvals=ks, title_text="k scale (k = 0.1 N(0,1) x k scale)",
                         row=1, col=col)
    fig.update_yaxes(type="log", exponentformat="power", dtick=1, title_text="mean |o - 1| (V = ones)",
                     row=1, col=1)
    fig.update_yaxes(title_text="NaN elements (%)", rangemode="tozero", row=1, col=2)
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
    from .experiments import atomic_write_bytes
    return atomic_write_bytes(path, png)
