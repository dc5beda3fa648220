"""The benchmark's table as text, ratios and a figure, and its JSON with provenance."""

from __future__ import annotations

import math

import pandas as pd

from fa_lab.studies.experiments import save_result
from .suites import ALL_IMPLS, SUITE_NOTES, headline


def ratios(table: pd.DataFrame, impl=None) -> pd.DataFrame:
    """Per shape: ``impl``'s (median) TFLOP/s over each other implementation's. The
    per-round ratios (``table.attrs["ratios"]``, ``ratio_table``) are the ones to trust;
    this serves tables without rounds (older results)."""
    wide = table.pivot_table(index="shape", columns="impl", values="tflops", sort=False)
    impl = headline(wide.columns) if impl is None else impl
    if impl not in wide:
        raise ValueError(f"{impl!r} has no timings in this table")
    out = wide.rdiv(wide[impl], axis=0).drop(columns=[impl])
    return out.add_prefix(f"{impl} / ")


def ratio_table(table_or_ratios) -> pd.DataFrame:
    """The per-round ratios as a table: suite, shape, ratio, a, b, median, min, max, n,
    rounds; from a ``run`` table (its ``attrs``), a loaded result (``{"ratios": ...}``)
    or the list itself."""
    if isinstance(table_or_ratios, pd.DataFrame):
        items = table_or_ratios.attrs.get("ratios", [])
    elif isinstance(table_or_ratios, dict):
        items = table_or_ratios.get("ratios", [])
    else:
        items = table_or_ratios
    cols = ["suite", "shape", "ratio", "a", "b", "median", "min", "max", "n", "rounds"]
    return pd.DataFrame(list(items), columns=cols)


def _fmt(x, spec=".1f", none="—"):
    return none if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _clock_text(c: dict | None) -> str:
    if not c or c.get("source") is None:
        return f"no reading ({(c or {}).get('note', 'none')})"
    parts = [f"SM {_fmt(c.get('sm_mhz'), 'd')}/{_fmt(c.get('max_sm_mhz'), 'd')} MHz"]
    if c.get("mem_mhz") is not None:
        parts.append(f"mem {c['mem_mhz']} MHz")
    if c.get("temp_c") is not None:
        parts.append(f"{c['temp_c']} C")
    if c.get("power_w") is not None:
        parts.append(f"{c['power_w']:.0f} W")
    if c.get("reasons"):
        parts.append("reasons " + "+".join(c["reasons"]))
    return ", ".join(parts)


def _shape_lines(sub: pd.DataFrame, info: dict | None, rats: list[dict],
                 paired: list[dict] = ()) -> list[str]:
    """One shape's block: clocks, autotune picks, per implementation the median TFLOP/s
    with its min-max over rounds, the per-round ratios and the call-alternated ones."""
    shape = sub["shape"].iloc[0]
    n = int(sub["rounds"].max()) if sub["rounds"].notna().any() else 0
    head = f"== {sub['suite'].iloc[0]} · {shape}" if "suite" in sub else f"== {shape}"
    if info and info.get("seconds") is not None:
        head += f" · {n} rounds · {info['seconds']:.0f} s"
    lines = [head]
    if info:
        c = info.get("clocks") or {}
        src = (c.get("start") or {}).get("source") or (c.get("end") or {}).get("source")
        if src:
            lines.append(f"   clocks ({src}): start {_clock_text(c.get('start'))}; "
                         f"end {_clock_text(c.get('end'))}")
        else:
            lines.append(f"   clocks: {_clock_text(c.get('start'))}")
        per_round = c.get("rounds_sm_mhz")
        if per_round:
            lines.append("   SM MHz per round (median [min..max]): " + "  ".join(
                f"{_fmt(p.get('median'), '.0f')} [{_fmt(p.get('min'), 'd')}..{_fmt(p.get('max'), 'd')}]"
                if p and p.get("n") else "—" for p in per_round))
        if info.get("autotune"):
            lines.append("   autotune: " + " · ".join(f"{i} {c}" for i, c in info["autotune"].items()))
        if info.get("reference_heads") is not None and len(info["reference_heads"]) < info.get("reference_of", 0):
            lines.append(f"   rel-L2 on heads {info['reference_heads']} of {info['reference_of']}")
        if info.get("note"):
            lines.append(f"   note: {info['note']}")
    lines.append(f"   {'impl':<20}{'TFLOP/s':>9}  {'[min .. max]':<17}{'ms':>9}{'spread':>8}"
                 f"{'host ms':>9}{'rel-L2 fp32':>13}  per round TFLOP/s")
    for _, r in sub.iterrows():
        if r.get("ms") is None or pd.isna(r.get("ms")):
            continue
        per = r.get("tflops_rounds")
        per_txt = " ".join(_fmt(x, ".0f") for x in per) if isinstance(per, (list, tuple)) else ""
        lines.append(f"   {r['impl']:<20}{_fmt(r['tflops']):>9}  "
                     f"{'[' + _fmt(r.get('tflops_min')) + ' .. ' + _fmt(r.get('tflops_max')) + ']':<17}"
                     f"{_fmt(r['ms'], '.3f'):>9}{_fmt(r.get('spread_pct'), '.1f') + '%':>8}"
                     f"{_fmt(r.get('host_ms'), '.3f'):>9}{_fmt(r.get('rel_l2'), '.2e'):>13}  {per_txt}")
    if rats:
        lines.append(f"   {'ratio (A / B = B ms / A ms, per round)':<40}{'median':>8}  [min .. max]")
        for q in rats:
            lines.append(f"   {q['ratio']:<40}{q['median']:>8.3f}  [{q['min']:.3f} .. {q['max']:.3f}]")
    if paired:
        lines.append(f"   {'call-alternated (A B A B ..., per round)':<40}{'median':>8}  [min .. max]")
        for q in paired:
            if q["n"]:
                lines.append(f"   {q['ratio']:<40}{q['median']:>8.3f}  [{q['min']:.3f} .. {q['max']:.3f}]")
            if q.get("error"):
                lines.append(f"   {q['ratio']:<40}  failed: {q['error']}")
    return lines


def format_table(table: pd.DataFrame) -> str:
    """Per shape (when the table has rounds): clocks, autotune picks, median TFLOP/s with
    min-max and per-round values, the per-round ratios. Then TFLOP/s medians, shapes down,
    implementations across, and fast_lazy's ratios (one block per suite when the table has
    several); then the rel-L2 checks, configs and notes."""
    lines = []
    rats = table.attrs.get("ratios") or []
    paired = table.attrs.get("paired_ratios") or []
    infos = {i["shape"]: i for i in table.attrs.get("shapes") or []}
    if "ms_rounds" in table.columns:
        for shape, sub in table.groupby("shape", sort=False):
            lines += _shape_lines(sub, infos.get(shape), [q for q in rats if q["shape"] == shape],
                                  [q for q in paired if q["shape"] == shape])
            lines.append("")
    blocks = table.groupby("suite", sort=False) if "suite" in table.columns else [(None, table)]
    width = max(28, 2 + max(len(str(s)) for s in table["shape"]))
    first = True
    for suite, sub in blocks:
        if not first:
            lines.append("")
        first = False
        lines += _tflops_lines(sub, width, suite, rats)
    checks = table.dropna(subset=["rel_l2"])
    if len(checks):
        worst = checks.groupby("impl", sort=False)["rel_l2"].max()
        lines.append("")
        lines.append("max rel-L2 vs fp32 attention: " + ", ".join(f"{i} {x:.2e}" for i, x in worst.items()))
    for _, r in table[table["config"].notna()].iterrows():
        lines.append(f"autotuned {r['impl']} @ {r['shape']}: {r['config']}")
    for _, r in table[table["note"].notna()].iterrows():
        lines.append(f"note: {r['impl']} @ {r['shape']}: {r['note']}")
    return "\n".join(lines)


def _tflops_lines(table: pd.DataFrame, width: int, suite=None, rats=()) -> list[str]:
    wide = table.pivot_table(index="shape", columns="impl", values="tflops", sort=False)
    cols = [i for i in ALL_IMPLS if i in wide.columns]
    wide = wide[cols]
    n = int(table["rounds"].max()) if "rounds" in table and table["rounds"].notna().any() else 0
    title = (f"TFLOP/s (median over {n} interleaved rounds)" if n else "TFLOP/s") + (f": {suite}" if suite else "")
    if suite in SUITE_NOTES:
        title += f" ({SUITE_NOTES[suite]})"
    lines = [title, f"{'shape':<{width}}" + "".join(f"{c:>18}" for c in cols)]
    for shape, r in wide.iterrows():
        lines.append(f"{shape:<{width}}" + "".join(
            f"{'—' if pd.isna(r[c]) else f'{r[c]:.1f}':>18}" for c in cols))
    base = headline(cols)
    if base and len(cols) > 1:
        lines.append("")
        shapes = set(wide.index)
        mine = {(q["shape"], q["b"]): q["median"] for q in rats
                if q["a"] == base and q["shape"] in shapes}
        rat = ratios(table, base)
        if mine:  # the medians of the per-round ratios
            lines.append(f"{base} / other (median of per-round ratios)")
            rat = pd.DataFrame({c: [mine.get((s, c.split(" / ")[1]), math.nan) for s in rat.index]
                                for c in rat.columns}, index=rat.index)
        else:
            lines.append(f"{base} / other")
        lines.append(f"{'shape':<{width}}" + "".join(f"{c.split(' / ')[1]:>18}" for c in rat.columns))
        for shape, r in rat.iterrows():
            lines.append(f"{shape:<{width}}" + "".join(
                f"{'—' if pd.isna(x) else f'{x:.3f}':>18}" for x in r))
    return lines


def save(table: pd.DataFrame, name="bench_h200", *, directory=None, device="cuda", params=None,
         tuning=None):
    """<results folder>/<name>.json (or ``directory``), with provenance (atomic write): ``rows``
    (one per (shape, impl), with the per-round values), ``ratios`` (per round, with median
    and min-max), ``paired_ratios`` (call-alternated, likewise), ``shapes`` (round
    orders, clocks, autotune picks, seconds), ``timing`` (the method),
    ``autotune_timings`` (``tuning``) and ``params``."""
    if "timing" not in table.attrs:  # a table without rounds (config_sweep's): rows alone
        return save_result(name, table, params=dict(params or {}), device=device, directory=directory)
    payload = {"params": dict(params or {}), "timing": table.attrs.get("timing"),
               "shapes": table.attrs.get("shapes", []), "ratios": table.attrs.get("ratios", []),
               "paired_ratios": table.attrs.get("paired_ratios", []),
               "autotune_timings": list(tuning or []), "rows": table.to_dict("records")}
    return save_result(name, payload, params=payload["params"], device=device, directory=directory)


def figure(table: pd.DataFrame, title="Forward TFLOP/s"):
    """Grouped bars: TFLOP/s per shape (x) and implementation (colour)."""
    import plotly.graph_objects as go  # not on every GPU machine: imported on use

    fig = go.Figure()
    shapes = list(dict.fromkeys(table["shape"]))
    for impl in [i for i in ALL_IMPLS if i in set(table["impl"])]:
        sub = table[table["impl"] == impl].set_index("shape")
        y = [sub["tflops"].get(s) if s in sub.index else None for s in shapes]
        fig.add_bar(name=impl, x=shapes, y=y)
    fig.update_layout(barmode="group", title=title, yaxis_title="TFLOP/s",
                      xaxis_title="shape", legend_title="implementation")
    return fig
