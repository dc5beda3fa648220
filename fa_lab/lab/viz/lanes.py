"""One lane over the steps: its running max, tile max, l and the vote, fire and sweep
events, a sweep named by what the policy did to the row (``lane_lines``), and one lane
under several policies (``row_compare``)."""

from __future__ import annotations

import html
import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from .style import EVENT_COLORS, NONFINITE_COLOR, policy_color
from .heatmap import FP32_LOG2_MAX, _labels_unchecked
from .tracedata import (SWEEP_OUTCOMES, _check_index, _check_trace, _finite_or_none, fmt_number,
                        _is_fp8, _lane_label, _policy_label, step_axis_title, sweep_outcomes)


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
            text.append(f"step {s}: {name} = {fmt_number(v)}")
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
    threshold), with wave fires and sweeps marked on m, each sweep named by what the policy
    did to the row (``tracedata.SWEEP_OUTCOMES``: dragged, its base moved down, or left
    alone). Bottom: the deficit (true running
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
    color = policy_color(trace.policy)
    who = _lane_label(trace, lane)

    # Two panels sharing the step axis: (x, y) on top, (x2, y2) below. Axes are laid out by
    # hand and the figure built in one call, which is several times faster than
    # make_subplots + add_trace, and a dashboard redraws this figure on every move.
    data = []
    panel = {1: dict(xaxis="x", yaxis="y"), 2: dict(xaxis="x2", yaxis="y2")}

    def hover(name, vals):
        return [f"{who}<br>step {s}: {name} = {fmt_number(v)}" for s, v in zip(x, vals)]

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
    data.append(go.Scatter(x=vote_x, y=vote_y, name=f"vote line: previous m + {fmt_number(thr, 3)}",
                           mode="lines", line=dict(color=color, dash="dot", width=1),
                           hovertemplate="step %{x}: a tile max above %{y:.4g} votes"
                                         "<extra></extra>", **panel[1]))
    # A swept row is named by what its policy did to it (tracedata.SWEEP_OUTCOMES): a marker
    # trace per outcome, always, so a redraw keeps the traces; the legend lists those seen.
    events = [((d["fire"] & ~d["swept"]).to_numpy(), "wave fired", "circle-open",
               EVENT_COLORS["fire"])]
    events += [(mask, SWEEP_OUTCOMES[k][0], "x-thin", SWEEP_OUTCOMES[k][1])
               for k, mask in sweep_outcomes(d).items()]
    for mask, name, sym, col in events:
        xs = [s for s, k in zip(x, mask) if k]
        data.append(go.Scatter(x=xs, y=_finite_or_none(m[mask]), name=name, mode="markers",
                               showlegend=sym != "x-thin" or bool(mask.any()),
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
        title=dict(text=title or f"{who}, {_policy_label(trace)}: final LSE = {fmt_number(lse, 6)} (ln)",
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
    and the row's true running max (its largest tile max so far) with fires and sweeps,
    each sweep named by what that column's policy did to the row (dragged under the unfixed
    rule, left alone under the fix: ``tracedata.SWEEP_OUTCOMES``); bottom row: the deficit (true max - m) and log2(l), on one fixed scale up to fp32's
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
    axes, swept_shown = [], set()
    for i, name in enumerate(names):
        tr, s = traces[name], series[name]
        xa, ya = ("x", "y") if i == 0 else (f"x{i + 1}", f"y{i + 1}")
        xb, yb = f"x{n_cols + i + 1}", f"y{n_cols + i + 1}"
        x0 = i * (w + gap)
        color = policy_color(tr.policy)
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
                text=[f"{who}, {name}<br>step {st}: {nm} = {fmt_number(v)}" for st, v in zip(x, vals)],
                hovertemplate="%{text}<extra></extra>", **style))

        add(s["true_max"], "true running max", xa, ya, mode="lines",
            line=dict(color=EVENT_COLORS["true_max"], dash="dot", width=1.5, shape="hv"))
        add(s["m"], "m, the base", xa, ya, mode="lines+markers",
            line=dict(color=color, width=2.5), marker=dict(size=4))
        d = s["d"]
        # One event, named in each column by what that column's policy did to the row
        # (tracedata.SWEEP_OUTCOMES): a trace per outcome in every column, in the legend
        # once, from the first column where it happens.
        events = [((d["fire"] & ~d["swept"]).to_numpy(), "wave fired", "circle-open",
                   EVENT_COLORS["fire"], legend)]
        for k, mask in sweep_outcomes(d).items():
            seen = bool(mask.any())
            events.append((mask, SWEEP_OUTCOMES[k][0], "x-thin", SWEEP_OUTCOMES[k][1],
                           seen and k not in swept_shown))
            if seen:
                swept_shown.add(k)
        for mask, nm, sym, col, shown in events:
            data.append(dict(
                type="scatter",
                x=[st for st, k in zip(x, mask) if k], y=_finite_or_none(s["m"][mask]),
                name=nm, legendgroup=nm, showlegend=shown, mode="markers", xaxis=xa, yaxis=ya,
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
