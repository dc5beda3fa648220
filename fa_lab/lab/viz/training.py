"""A training run's non-finite onset: the first non-finite step per policy against the
logit scale (``fa_lab.studies.training.first_nonfinite_table``'s rows)."""

from __future__ import annotations

import plotly.graph_objects as go

from .style import policy_color, policy_symbol


def first_nonfinite_steps(rows: list[dict], *, title: str | None = None) -> go.Figure:
    """One curve per policy: x the logit scale a run reaches at its last step (log axis),
    y the step of its first non-finite value. A run that stayed finite is drawn hollow at
    its last step, labelled "finite"; hovering names the module, phase and tensor."""
    if not rows:
        raise ValueError("rows is empty")
    fig = go.Figure()
    for pol in dict.fromkeys(r["policy"] for r in rows):
        rs = sorted((r for r in rows if r["policy"] == pol), key=lambda r: r["scale"])
        failed = [r for r in rs if r["first_step"] is not None]
        finite = [r for r in rs if r["first_step"] is None]
        if failed:
            fig.add_trace(go.Scatter(
                x=[r["scale"] for r in failed], y=[r["first_step"] for r in failed],
                mode="lines+markers", name=f"{pol}: first non-finite",
                marker=dict(symbol=policy_symbol(pol), size=11, color=policy_color(pol)),
                line=dict(color=policy_color(pol)),
                text=[f"{r['module']} {r['phase']} {r['tensor']}, {r['n_rows']} rows, "
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
