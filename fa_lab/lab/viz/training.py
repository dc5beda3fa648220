"""A training run's non-finite onset: the first non-finite step per policy against the
logit scale (``fa_lab.studies.training.first_nonfinite_table``'s rows)."""

from __future__ import annotations

import math

import plotly.graph_objects as go

from .style import policy_color, policy_symbol


def first_nonfinite_steps(rows: list[dict], *, title: str | None = None) -> go.Figure:
    """One curve per policy: x the logit scale a run reaches at its last step (log axis),
    y the step of its first non-finite value. A run that stayed finite is drawn hollow at
    its last step, labelled "finite"; hovering names the module, phase and tensor. A run's
    ``first_step`` is None or NaN when it stayed finite (a table's ``to_dict("records")``
    turns None into NaN in a column of numbers); a policy draws only the traces it has
    points for."""
    if not rows:
        raise ValueError("rows is empty")
    fig = go.Figure()
    for pol in dict.fromkeys(r["policy"] for r in rows):
        rs = sorted((r for r in rows if r["policy"] == pol), key=lambda r: r["scale"])
        failed = [r for r in rs if not _stayed_finite(r["first_step"])]
        finite = [r for r in rs if _stayed_finite(r["first_step"])]
        if failed:
            fig.add_trace(go.Scatter(
                x=[r["scale"] for r in failed], y=[r["first_step"] for r in failed],
                mode="lines+markers", name=f"{pol}: first non-finite",
                marker=dict(symbol=policy_symbol(pol), size=11, color=policy_color(pol)),
                line=dict(color=policy_color(pol)),
                text=[f"{r['module']} {r['phase']} {r['tensor']}, {int(r['n_rows'])} rows, "
                      f"temperature {r['temperature']:.1f}" for r in failed],
                hovertemplate="scale %{x}<br>step %{y}<br>%{text}<extra></extra>"))
        if finite:
            fig.add_trace(go.Scatter(
                x=[r["scale"] for r in finite], y=[r["steps_run"] - 1 for r in finite],
                mode="markers+text", name=f"{pol}: finite to the last step",
                marker=dict(symbol=policy_symbol(pol, hollow=True), size=11,
                            color=policy_color(pol), line=dict(width=2)),
                text=["finite"] * len(finite), textposition="top center",
                textfont=dict(color=policy_color(pol))))
    fig.update_layout(title=title or "First non-finite step of a training run, by policy",
                      xaxis=dict(title="logit scale at the last step (temperature on q)",
                                 type="log", tickvals=sorted({r["scale"] for r in rows}),
                                 ticktext=[f"{x:g}" for x in sorted({r["scale"] for r in rows})]),
                      yaxis=dict(title="training step", rangemode="tozero"),
                      template="plotly_white", width=900, height=480,
                      legend=dict(orientation="h", y=-0.2))
    return fig


def _stayed_finite(first_step) -> bool:
    """Whether a run's first non-finite step says it never had one: None, or NaN."""
    return first_step is None or (isinstance(first_step, float) and math.isnan(first_step))


#: the fixed max's edges in log2 units: a P of 2^128 overflows; below -126 every P flushes
FIXED_MAX_OVERFLOW, FIXED_MAX_FLUSH = 128.0, -126.0


def score_growth(runs: list[dict], *, scale: float, title: str | None = None,
                 y_range: tuple | None = (-384.0, 640.0)) -> go.Figure:
    """The scores a training run meets, step by step, for each policy's run at logit
    ``scale`` (``fa_lab.studies.training.train``'s runs): the largest log2 score of any
    layer (solid) and the smallest row maximum (dotted), with the fixed max's overflow edge
    (128) and zero-row edge (-126) as lines, and a cross at the step where the run first
    produced a non-finite value (its module and tensor on hover). A layer's statistics
    that are NaN (it read a failed layer's output) are left out. ``y_range`` keeps the
    edges readable (None: autoscale); a curve that leaves it names its peak in the legend."""
    chosen = [r for r in runs if r["config"]["scale"] == scale]
    if not chosen:
        raise ValueError(f"no run at scale={scale!r}; scales: "
                         f"{sorted({r['config']['scale'] for r in runs})}")
    fig = go.Figure()

    def finite(xs):
        xs = [x for x in xs if x == x and abs(x) != float("inf")]
        return xs

    for r in chosen:
        pol = r["config"]["policy"]
        steps = list(range(len(r["scores"])))
        top = [max(finite([d["s_max"] for d in s]), default=None) for s in r["scores"]]
        low = [min(finite([d["best_min"] for d in s]), default=None) for s in r["scores"]]
        color = policy_color(pol)
        peak = max((t for t in top if t is not None), default=None)
        off = y_range is not None and peak is not None and peak > y_range[1]
        fig.add_trace(go.Scatter(x=steps, y=top, mode="lines",
                                 name=f"{pol}: largest score" + (f" (peak {peak:.0f})" if off else ""),
                                 line=dict(color=color)))
        fig.add_trace(go.Scatter(x=steps, y=low, mode="lines", name=f"{pol}: lowest row max",
                                 line=dict(color=color, dash="dot")))
        f = r["first"]
        if f is not None:
            fig.add_trace(go.Scatter(
                x=[f["step"]], y=[top[f["step"]]], mode="markers",
                name=f"{pol}: first non-finite (step {f['step']})",
                marker=dict(symbol="x", size=14, color=color, line=dict(width=1)),
                text=[f"{f['module']} {f['phase']} {f['tensor']} {f['kind']}, "
                      f"{f['n_rows']} rows"],
                hovertemplate="step %{x}<br>%{text}<extra></extra>"))
    for y, label, where in ((FIXED_MAX_OVERFLOW, "fixed max overflows (128)", "top left"),
                            (FIXED_MAX_FLUSH, "fixed max: zero row (-126)", "bottom left")):
        fig.add_hline(y=y, line=dict(color="#444", dash="dash", width=1),
                      annotation_text=label, annotation_position=where)
    fig.update_layout(title=title or f"Attention scores met in training (log2 units), logit "
                                     f"scale rising to {scale:g}",
                      xaxis=dict(title="training step"),
                      yaxis=dict(title="score, log2 units (q.k / sqrt(D) * log2 e)",
                                 range=list(y_range) if y_range is not None else None),
                      template="plotly_white", width=900, height=520,
                      legend=dict(orientation="h", y=-0.2))
    return fig
