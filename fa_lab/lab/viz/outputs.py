"""What became of each output row: finite, NaN (with the LSE that says why) or inf
(``row_fates``, ``nonfinite_map``, ``lse_rows``), and outputs against a reference."""

from __future__ import annotations

import math

import numpy as np
import plotly.graph_objects as go
import torch

from .tracedata import _check_index, _check_tensor, _finite_or_none, fmt_number
from .heatmap import _labels_unchecked
from .style import policy_color, policy_symbol


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
                + ("" if lse_v is None else f"<br>LSE = {fmt_number(float(lse_v[r, h]), 6)}")
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
            text=[fmt_number(v, 6) for v in y[mask]],
            hovertemplate="query row %{x}<br>LSE = %{text}<extra></extra>"))
    fig.update_layout(
        title=title or f"LSE per query row (batch {batch}, head {head})",
        xaxis=dict(title="query row"),
        yaxis=dict(title="LSE (natural log)", range=[bottom - 0.5 * pad, top + 0.5 * pad]),
        legend=dict(orientation="h", yanchor="top", y=-0.18, xanchor="left", x=0),
        height=440, margin=dict(b=110))
    return fig


def output_difference_rows(outputs: dict, reference: torch.Tensor, batch: int = 0, head: int = 0,
                           title: str | None = None, policies: dict | None = None) -> go.Figure:
    """Per query row of (batch, head): max |o - reference| over the head dim, one marker
    series per named output (log y). Rows with a non-finite output are drawn as x at the
    top edge, rows exactly equal to the reference at the bottom edge. ``policies``: the
    Policy behind a name, where the name alone does not give its colour (a variant)."""
    policies = policies or {}
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
        color = policy_color(policies.get(name, name))
        worst = np.nanmax(d) if np.isfinite(d).any() else math.nan
        fig.add_trace(go.Scatter(
            x=rows, y=_finite_or_none(np.where(d > 0, d, np.where(d == 0, floor, np.nan))),
            mode="markers",
            name=f"{name}: max {fmt_number(float(worst), 3)} over finite rows",
            marker=dict(color=color, size=5, opacity=0.7, symbol=policy_symbol(name, hollow=True)),
            legendgroup=name,
            hovertemplate=f"{name}<br>query row %{{x}}<br>max |o - ref| = %{{y:.3g}}<extra></extra>"))
    for name, b in bad.items():
        color = policy_color(policies.get(name, name))
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
