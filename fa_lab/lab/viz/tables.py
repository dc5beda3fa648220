"""The bug report's bf16 and fp8 tables as curves against the K scale, beside the
report's own numbers."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from fa_lab import policies
from .style import _FP8_SEED_LABEL, _policy_line, policy_color, policy_symbol
from .tracedata import _finite_or_none, fmt_number


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
    colour per policy; ``seed`` (experiments.seed_table("bf16")) adds the bug report's
    MI355X figures as hollow markers. A missing rel-L2 point means that output had NaN."""
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
        where = f"the bug report: {setup.get('device', 'upstream')}, S={setup.get('S', '?')}"
        for pol in ("lazy_unfixed", "lazy", "eager"):
            style = dict(mode="markers", legendgroup=pol, marker=dict(
                symbol=policy_symbol(pol, hollow=True), size=15, color=policy_color(pol),
                line=dict(width=2)))
            if any(pol in r for r in rows):
                fig.add_trace(go.Scatter(
                    x=[r["k_scale"] for r in rows], y=[r.get(pol) for r in rows],
                    name=f"{pol} ({where})", **style,
                    hovertemplate=f"{pol}, the bug report<br>K x%{{x}}<br>rel-L2 %{{y:.4g}}<extra></extra>"),
                    row=1, col=1)
            key = f"{pol}_nan_pct"
            if any(key in r for r in rows):
                fig.add_trace(go.Scatter(
                    x=[r["k_scale"] for r in rows], y=[r.get(key) for r in rows],
                    name=f"{pol} NaN ({where})", showlegend=False, **style,
                    hovertemplate=f"{pol}, the bug report<br>K x%{{x}}<br>NaN %{{y:.3g}} %<extra></extra>"),
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
    (experiments.seed_table("fp8")) adds the bug report's figures as hollow markers, its
    NaN counts as a share of its own output size. Both y axes are logarithmic, so a leak of a
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
        text = [f"{int(n)} NaN elements of {fmt_number(e)}" for n, e in zip(n_nan, elements)]
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
        where = f"the bug report: {setup.get('device', 'upstream')}, S={setup.get('S', '?')}"
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
            # The bug report prints 0.0000 for means below 5e-5: on the bottom edge, like ours.
            style["marker"]["symbol"] = [("triangle-down-open" if v == 0 else
                                          policy_symbol(label, hollow=True)) for v in ys]
            fig.add_trace(go.Scatter(
                x=kx, y=[floor if v == 0 else v for v in ys],
                name=f"{label} ({where})", **style,
                hovertemplate=f"{label}, the bug report<br>k x%{{x}}<br>mean |o-1| %{{y:.3g}}<extra></extra>"),
                row=1, col=1)
            style["marker"]["symbol"] = policy_symbol(label, hollow=True)
            if n_seed:
                pct = [math.nan if r.get("nan") is None else 100 * r["nan"] / n_seed for r in rs]
                style["marker"]["symbol"] = zero_symbols(pct, policy_symbol(label, hollow=True))
                fig.add_trace(go.Scatter(
                    x=kx, y=[None if not math.isfinite(p) else float(y_) for p, y_ in
                             zip(pct, on_log(pct))],
                    name=f"{label} NaN ({where})", showlegend=False, **style,
                    text=[f"{fmt_number(r.get('nan'))} NaN elements of {n_seed}" for r in rs],
                    hovertemplate=f"{label}, the bug report<br>k x%{{x}}<br>%{{text}}<extra></extra>"),
                    row=1, col=2)
            ks = sorted(set(ks) | set(kx))
    for col in (1, 2):
        fig.update_xaxes(type="log", tickvals=ks, title_text="k scale (k = 0.1 N(0,1) x k scale)",
                         row=1, col=col)
    fig.update_yaxes(type="log", exponentformat="power", dtick=1, title_text="mean |o - 1| (V = ones)",
                     row=1, col=1)
    fig.update_yaxes(type="log", exponentformat="power", dtick=1, row=1, col=2,
                     title_text=f"NaN elements (% of output; none: at {fmt_number(nan_floor, 2)})",
                     range=[math.log10(nan_floor) - 0.3, math.log10(100) + 0.3])
    fig.update_layout(title="fp8: accuracy and NaN against k scale, per rebase rule",
                      height=460, width=1150, legend=dict(x=1.02, y=1, font=dict(size=11)))
    return fig
