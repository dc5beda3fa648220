"""A wave's lanes step by step (``running_max_heatmap``) and the ballot of one wave at one
step (``wave_ballot``). A swept row is named in both by what its policy did to it
(``tracedata.SWEEP_OUTCOMES``)."""

from __future__ import annotations

import math
import re

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from .style import EVENT_COLORS, FIXED_RANGES, NONFINITE_COLOR, _FLAG_COLORS, TRACE_VALUES
from .tracedata import (SWEEP_OUTCOMES, _check_trace, fmt_number, _grid, _is_fp8, _lane_labels,
                        _policy_label, step_axis_title, sweep_outcomes, trace_values, value_title)


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


def _sweep_cells(trace, z: pd.DataFrame):
    """The swept flag's cells, each named by what the policy did to the row: codes over
    ``z``'s lanes and steps (0: not swept; i + 1: the i-th of the outcomes the trace holds,
    in ``SWEEP_OUTCOMES`` order), their names, and a colour scale and bar with a band per
    code, so the bar lists only what happened (a drag under the unfixed rule, a row left
    alone under the fix)."""
    st = trace.steps
    masks = sweep_outcomes(st)
    held = [k for k, m in masks.items() if m.any()]
    code = np.zeros(len(st))
    for i, k in enumerate(held):
        code[masks[k]] = i + 1
    grid = (st.assign(code=code).pivot(index="lane", columns="step", values="code")
            .reindex(index=z.index, columns=z.columns).to_numpy(float))
    names = ["not swept"] + [SWEEP_OUTCOMES[k][0] for k in held]
    colors = [_FLAG_COLORS["swept"][0]] + [SWEEP_OUTCOMES[k][1] for k in held]
    n = max(len(names), 2)          # nothing swept: one band in use, the bar still drawn
    scale = [x for i, c in enumerate(colors) for x in ([i / n, c], [(i + 1) / n, c])]
    scale += [[1, colors[-1]]] if len(names) < n else []
    bar = dict(tickvals=[(i + 0.5) * (n - 1) / n for i in range(len(names))], ticktext=names,
               len=min(1.0, 0.25 * len(names)), y=1, yanchor="top")
    return grid, names, scale, bar, float(n - 1)


def running_max_heatmap(trace, value: str = "m", title: str | None = None, *,
                        zrange: tuple | None = None, markers: bool = True,
                        highlight: int | None = None) -> go.Figure:
    """Traced lanes (rows) x KV steps (columns) heatmap of one trace value.

    0/1 values (vote, fire, o_finite, l_finite) get two colours, not a colour scale; the
    swept flag a colour per outcome the trace holds (``tracedata.SWEEP_OUTCOMES``: dragged,
    its base moved down, or left alone, ...). The deficit, log2(l) and log2(corr) get fixed colour ranges (``FIXED_RANGES``)
    so the colours mean the same thing whatever the data; m and the tile max follow the
    data unless ``zrange`` is given. With ``markers``: a small x where the row was swept
    (its wave fired while its tile max sat below its running max), in the colour and under
    the name of what the policy did to it, a small open circle
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
    name = TRACE_VALUES[value]
    text = np.array([[f"{labels[lane]}<br>{cols.get(s, f'step {s}')}<br>{name} = {fmt_number(raw[i, j])}"
                      for j, s in enumerate(steps)] for i, lane in enumerate(lane_ids)], dtype=object)
    steps, lane_ids = np.asarray(steps), np.asarray(lane_ids)
    ctitle = value_title(trace, value).replace(" (", "<br>(")
    flag_value = value in _FLAG_COLORS
    if value == "swept":        # each swept cell named by what the policy did to the row
        codes, kinds, scale, bar, zmax = _sweep_cells(trace, z)
        text = np.array([[f"{labels[lane]}<br>{cols.get(s, f'step {s}')}<br>"
                          f"{kinds[int(c)] if np.isfinite(c) else 'no step'}"
                          for s, c in zip(steps, row)] for lane, row in zip(lane_ids, codes)],
                        dtype=object)
        raw = codes
    data = []
    # Cells that cannot be coloured by value: black for +inf / NaN, grey for -inf. They sit
    # under the value layer, which leaves them as gaps.
    flag = np.where(np.isnan(raw) | (raw == math.inf), 1.0,
                    np.where(raw == -math.inf, 0.0, np.nan))
    data.append(go.Heatmap(
        z=_grid(flag), x=steps, y=lane_ids, zmin=0, zmax=1, showscale=False,
        colorscale=[[0, "#bdbdbd"], [1, "#111111"]], hoverinfo="skip", name="not finite"))
    if value == "swept":
        zmin = 0.0
    elif flag_value:
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
    fired = st[st.fire & ~st.swept] if show else st.iloc[:0]
    data.append(_event_markers(labels, fired, "wave fired (row not swept)", "circle-open",
                               "#c8c8c8", 5, edge="#c8c8c8"))
    # a marker trace per outcome, always (a redraw keeps the traces); the legend lists
    # those that happen
    for k, mask in sweep_outcomes(st).items():
        rows = st[mask] if show else st.iloc[:0]
        data.append(_event_markers(labels, rows, SWEEP_OUTCOMES[k][0], "x-thin",
                                   SWEEP_OUTCOMES[k][1], 6, legend=len(rows) > 0))
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
        title=dict(text=title or (f"{TRACE_VALUES[value]} per traced row, {_policy_label(trace)}: "
                                  f"{n_bad} of {len(lanes)} rows non-finite"), font=dict(size=14)),
        xaxis=dict(title=step_axis_title(trace)),
        yaxis=dict(title=ytitle, tickvals=tickvals, ticktext=ticktext, autorange="reversed"),
        legend=dict(orientation="h", yanchor="bottom", y=1.0, xanchor="left", x=0),
        height=max(360, min(900, 160 + 9 * len(lane_ids))),
        margin=dict(t=90, b=90, l=80), plot_bgcolor="#ffffff")
    # One constructor call: plotly validates far less than with add_trace/update_layout.
    return go.Figure(data=data, layout=_labels_unchecked(layout))


def _event_markers(labels: dict, rows: pd.DataFrame, name, symbol, color, size,
                   edge=None, legend=True) -> go.Scatter:
    text = [f"{labels[int(ln)]}<br>step {int(st)}: {name}"
            for ln, st in zip(rows["lane"], rows["step"])]
    return go.Scatter(x=rows["step"].to_numpy(dtype=int), y=rows["lane"].to_numpy(dtype=int),
                      mode="markers", name=name, text=text, showlegend=legend,
                      hovertemplate="%{text}<extra></extra>",
                      marker=dict(symbol=symbol, size=size, color=color,
                                  line=dict(color=edge or color, width=1)))


#: fp32 overflows past 2**128: where l and O go once a correction blows up.
FP32_LOG2_MAX = 128.0


def wave_ballot(trace, step: int, *, wave: int | None = None, highlight: int | None = None,
                title: str | None = None) -> go.Figure:
    """One wave at one KV step: its 64 lanes, their ballot, and what the rescale branch did
    to each of its 32 rows.

    Left: the 64 lanes (lanes r and r + 32 hold the two halves of row r), coloured by the
    row's vote, and the ballot, one decision for the whole wave. Right: each row's jump,
    tile max - m before the step (log2 units), against the vote line at the threshold. A
    row beyond it voted; when the wave fires, a row below 0 is swept, and named by what the
    policy did to it (``tracedata.SWEEP_OUTCOMES``; unfixed: dragged, its base moved down to
    its own tile max, corr = 2^(m - mt) > 1; fixed: left alone, corr = 1).
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
    corr = now["corr"].to_numpy(float)
    outcomes = sweep_outcomes(now)
    thr = float(trace.threshold_units) * per
    policy = _policy_label(trace)
    phase = str(now["phase"].iloc[0])
    # a category per swept outcome, between the voters and the rows that rose
    n_out = len(outcomes)
    cats = np.where(vote, 0, np.where(fire, n_out + 1, n_out + 2))
    for i, mask in enumerate(outcomes.values()):
        cats = np.where(~vote & mask, i + 1, cats)
    names = (f"voted: tile max > m + {fmt_number(thr, 3)}",
             *(SWEEP_OUTCOMES[k][0] for k in outcomes),
             "rebased up (rose, at most the threshold)", "kept m (wave did not fire)")
    colors = (EVENT_COLORS["vote"], *(SWEEP_OUTCOMES[k][1] for k in outcomes), "#7f7f7f",
              "#c7c7c7")
    is_swept = [False, *([True] * n_out), False, False]
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
        text = [f"row {w0 + int(r)}: m before {fmt_number(mb)}, tile max {fmt_number(t)}<br>jump "
                f"{fmt_number(j)}; corr = {fmt_number(cr)}" for r, mb, t, j, cr in
                zip(r_in[mask], m_before[mask], mt[mask], jump[mask], corr[mask])]
        data.append(dict(
            type="scatter",
            x=shown[mask], y=r_in[mask], mode="markers", name=f"{nm}: {int(mask.sum())}",
            legendgroup=nm, xaxis="x2", yaxis="y2", text=text,
            hovertemplate=f"{nm}<br>%{{text}}<extra></extra>",
            showlegend=not is_swept[c] or bool(mask.any()),
            marker=dict(size=9, color=col, symbol="x-thin" if is_swept[c] else "circle",
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
                          showarrow=False, text=f"vote line m + {fmt_number(thr, 3)}",
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
    n_vote = int(vote.sum())
    up = corr[outcomes["dragged"]]
    swept_words = [f"{int(m.sum())} {SWEEP_OUTCOMES[k][0]}"
                   + (f", corr up to 2^{fmt_number(float(np.log2(up.max())), 3)}"
                      if k == "dragged" and np.isfinite(up).all() else "")
                   for k, m in outcomes.items() if m.any()]
    layout = dict(
        # the swept rows, named by outcome, on a line of their own: the names are long
        title=dict(text=title or (f"Rows {w0}-{w0 + 31} at step {step} ({phase}), {policy}: "
                                  f"{n_vote} voted, the wave {'fired' if fire else 'did not fire'}"
                                  + ("<br>" + "; ".join(swept_words) if swept_words else
                                     ", 0 swept")), font=dict(size=14),
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
