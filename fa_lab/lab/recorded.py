"""The lessons' heavy computations, recorded once and read back.

A few lesson cells sweep the kernel model over dozens of calls (lesson 02's threshold grid,
lesson 03's fp8 table). On a busy CPU those cells alone took most of a lesson's time, while
their numbers change only when the model does. Each such computation is a plain function
here (its inputs are the lesson's sizes); ``benchmarks/lesson_records.py`` runs each one
at the lesson's CPU sizes and stores its tables in the lab's reference data
(``data/results/<name>.json``, with provenance); ``recorded(name, **params)`` returns the
stored tables when the record was made with exactly these ``params`` and computes them now
otherwise (another size, ``FULL = True`` on a GPU, or ``live=True``).

``tests/lab/test_lesson_records.py`` recomputes part of every record (a few of its grid
points, which the functions compute independently) and checks that they equal the stored
numbers, so a change to the model that makes a record stale fails there.

A record's tables are ``pandas.DataFrame``s stored as ``{"index": [names], "rows":
[records]}``; NaN is stored as ``null`` and read back as NaN.
"""

from __future__ import annotations

import pandas as pd

from fa_lab import results


# ---- the computations ----------------------------------------------------------------------

def bf16_threshold_sweep(*, k_grid, thr_grid, rows, skv, heads, kv_grid, trace_k) -> dict:
    """Lesson 02, section 3. ``grid``: NaN % of the output for every K scale of ``k_grid``,
    threshold of ``thr_grid`` and policy (``lazy_unfixed``, ``lazy``), on the first ``rows``
    query rows of ``heads`` heads against ``skv`` keys. ``by_kv``: the unfixed NaN % at K
    ``trace_k``, one head, against the first ``kv`` keys of the bug report's 8192 for each
    ``kv`` of ``kv_grid``. ``rates``: at K ``trace_k`` (one head, ``skv`` keys) the share of
    loop row-steps whose row voted, whose wave fired and which were swept, per threshold."""
    import fa_lab
    from fa_lab.studies import experiments

    def block(k_scale, h, s):
        q, k, v = experiments.bf16_inputs(1, s, h, 128, k_scale)
        return tuple(t.contiguous() for t in (q[:, :rows], k, v))

    grid = []
    for K in k_grid:
        qg, kg, vg = block(K, heads, skv)
        for thr in thr_grid:
            for pol in ("lazy_unfixed", "lazy"):
                out = fa_lab.flash_attn_func(qg, kg, vg, causal=False, rescale=pol,
                                             rescale_threshold=thr)
                grid.append({"K": K, "threshold": thr, "policy": pol,
                             "nan_pct": 100 * out.isnan().float().mean().item()})
    qk, kk, vk = block(trace_k, 1, max(kv_grid))
    by_kv = [{"KV length": s, "unfixed NaN %": 100 * fa_lab.flash_attn_func(
        qk, kk[:, :s].contiguous(), vk[:, :s].contiguous(), causal=False,
        rescale="lazy_unfixed").isnan().float().mean().item()} for s in kv_grid]
    rates = []
    qr, kr, vr = block(trace_k, 1, skv)
    for thr in thr_grid:
        s = fa_lab.trace(qr, kr, vr, rows=range(rows), causal=False, rescale="lazy_unfixed",
                         rescale_threshold=thr).steps
        s = s[s.phase == "loop"]
        rates.append({"threshold": thr, "rows voting %": 100 * s.vote.mean(),
                      "waves firing %": 100 * s.fire.mean(), "rows swept %": 100 * s.swept.mean()})
    return {"grid": pd.DataFrame(grid).set_index(["K", "threshold", "policy"]),
            "by_kv": pd.DataFrame(by_kv).set_index("KV length"),
            "rates": pd.DataFrame(rates).set_index("threshold")}


def bf16_fates(*, k_scale, rows, skv, heads) -> dict:
    """Lesson 02, section 2's fates: ``lessons.row_fate_table`` of the unfixed rule on the
    first ``rows`` query rows of ``heads`` heads against ``skv`` keys at K ``k_scale``."""
    import fa_lab
    from fa_lab.lab import lessons
    from fa_lab.studies import experiments

    q, k, v = experiments.bf16_inputs(1, skv, heads, 128, k_scale)
    out, lse = fa_lab.flash_attn_func(q[:, :rows].contiguous(), k, v, causal=False,
                                      rescale="lazy_unfixed", return_lse=True)
    return {"fates": lessons.row_fate_table(out, lse).set_index(["batch", "row", "head"])}


def fp8_table(*, k_scales, rows, heads) -> dict:
    """Lesson 03, section 3: one line per (k scale, variant of ``experiments.FP8_VARIANTS``)
    with its mean |o - 1| and ``metrics.finiteness``, on ``lessons.Fp8Lesson(rows=rows,
    heads=heads)``'s inputs."""
    from fa_lab import metrics
    from fa_lab.lab import lessons
    from fa_lab.studies import experiments

    fp8 = lessons.Fp8Lesson("cpu", rows=rows, heads=heads)
    table = []
    for K in k_scales:
        for label, pol, bound in experiments.FP8_VARIANTS:
            out = fp8.run(K, rescale=pol, rebase_bound=bound)
            table.append({"k_scale": K, "variant": label, "policy": pol, "bound": bound,
                          "mean_abs_dev": lessons.mean_abs_dev(out), **metrics.finiteness(out)})
    return {"table": pd.DataFrame(table).set_index(["variant", "k_scale"])}


def fp8_casts(*, k_scale, settings, rows) -> dict:
    """Lesson 03, section 7: for each ``(threshold, headroom)`` of ``settings``, the
    monotonic rule's NaN rows and mean |o - 1| at k ``k_scale`` under the saturating and the
    non-saturating cast of P (one head, ``rows`` query rows)."""
    from fa_lab.lab import lessons

    fp8 = lessons.Fp8Lesson("cpu", rows=rows)
    table = []
    for thr, head in settings:
        row = {"threshold": float(thr), "headroom": float(head)}
        for sat in (True, False):
            out = fp8.run(k_scale, rescale="lazy", rescale_threshold=thr, p_headroom=head,
                          fp8_saturate=sat)
            cast = "saturating" if sat else "non-saturating"
            row[f"NaN rows, {cast}"] = int(out.isnan().any(-1).sum())
            row[f"mean |o - 1|, {cast}"] = lessons.mean_abs_dev(out)
        table.append(row)
    return {"casts": pd.DataFrame(table).set_index(["threshold", "headroom"])}


#: Record name -> the function that computes it.
RECORDS = {"lesson02_sweep": bf16_threshold_sweep, "lesson02_fates": bf16_fates,
           "lesson03_table": fp8_table, "lesson03_casts": fp8_casts}

#: The lessons' CPU sizes, as their cells pass them (notebooks/02_lazy_rescale.ipynb,
#: notebooks/03_fp8.ipynb).
LESSON_PARAMS = {
    "lesson02_sweep": dict(k_grid=(24, 32, 48, 64), thr_grid=(8, 16, 32, 64, 96), rows=256,
                           skv=4096, heads=1, kv_grid=(1024, 2048, 4096, 8192), trace_k=32),
    "lesson02_fates": dict(k_scale=32, rows=256, skv=8192, heads=16),
    "lesson03_table": dict(k_scales=(1000, 5000, 20000), rows=256, heads=1),
    "lesson03_casts": dict(k_scale=1000, rows=256,
                           settings=((8.0, 0.0), (8.84, 0.0), (9.0, 0.0), (12.0, 0.0),
                                     (16.0, 0.0), (8.0, 1.0))),
}


# ---- storing and reading -------------------------------------------------------------------

def _plain(params: dict) -> dict:
    """``params`` as JSON gives them back: tuples become lists."""
    def one(x):
        return [one(y) for y in x] if isinstance(x, (list, tuple)) else x
    return {k: one(x) for k, x in params.items()}


def _check_name(name):
    if name not in RECORDS:
        raise ValueError(f"name must be one of {sorted(RECORDS)}, got {name!r}")


def compute(name: str, **params) -> dict:
    """The tables of record ``name`` computed now with ``params``."""
    _check_name(name)
    return RECORDS[name](**params)


def to_json(tables: dict) -> dict:
    """``{key: DataFrame}`` as the record stores it."""
    return {key: {"index": list(df.index.names), "rows": df.reset_index().to_dict("records")}
            for key, df in tables.items()}


def from_json(stored: dict) -> dict:
    """``to_json``'s inverse (``null`` read back as NaN)."""
    return {key: pd.DataFrame(t["rows"]).set_index(t["index"]) for key, t in stored.items()}


def save(name: str, **params):
    """Compute record ``name`` with ``params`` and store it in the lab's reference data."""
    tables = compute(name, **params)
    return results.save(name, {"tables": to_json(tables)}, params=_plain(params),
                        root=results.REFERENCE_DIR)


def recorded(name: str, *, live: bool = False, **params) -> tuple[dict, str]:
    """``(tables, source)``: record ``name``'s tables as the lab's reference data holds them
    when they were made with exactly ``params`` and ``live`` is False; otherwise computed
    now. ``source`` says which: the record's device, date and commit, or "computed now"."""
    _check_name(name)
    if not live:
        try:
            rec = results.reference(name)
        except FileNotFoundError:
            rec = None
        if rec is not None and rec["params"] == _plain(params):
            p = rec["provenance"]
            return from_json(rec["tables"]), (f"recorded on {p['device']}, {p['date'][:10]}, "
                                              f"commit {str(p['git_commit'])[:7]}")
    return compute(name, **params), "computed now"
