"""The paged decode over its own axes (``fa-lab table --which decode``): page size, partition
count, query length (MTP), scale mode, sliding window, context length and score spread, per
upstream version, against the fp64 reference (the window applied), beside what the decode's safe
region (``onset.bound("pa_decode:<v>")``) predicts for the same call.

A window of 0 runs ``pa_decode_tile`` (pages of 16 or 64 tokens); a window W > 0 runs the
sliding-window kernel (``pa_decode_swa``), which addresses 1024-token pages only, with the
``num_partitions`` value as its ``max_context_partition_num`` (fewer than the window's
visible tiles drop the newest: ``max_err`` shows it). Each window runs with the page sizes
of its kernel among those given; a window none of them fits is refused. The safe region
models the tile kernel: a sliding-window row's ``violated`` is ``"no region"``.

    from fa_lab.studies import decode_table
    t = decode_table.table(contexts=(257, 700), query_lengths=(1, 4), partitions=(1, 2))

Each row is one call (one sequence, ``group`` query heads on one kv head, q, K, V ~ N(0, 1)
with K times the spread, so the logits' standard deviation is about the spread; a shuffled
page table: ``fa_lab.kernels.pa_decode.cases``): ``nan_rows`` of its ``rows``
that see a token come out NaN or inf (``undefined``: rows that see none), ``max_err`` the
largest |out - fp64| over the finite rows that see a token, in units of max |V|, and
``violated`` the region's hazards for the call (empty: inside the region).
"""

from __future__ import annotations

import itertools

import pandas as pd
import torch

from fa_lab import decode
from fa_lab.kernels import pa_decode
from fa_lab.upstream import DECODE_VERSIONS

AXES = ("upstream", "page_size", "num_partitions", "query_length", "scales", "window", "context",
        "spread")
SCALES = ("per_tensor", "per_token")
DEFAULTS = dict(contexts=(257, 700), query_lengths=(1, 4), partitions=(1, 2), page_sizes=(16,),
                scales=SCALES, versions=tuple(DECODE_VERSIONS), windows=(0,), spreads=(1.0,))
PAGE_SIZES = (*pa_decode.model.BLOCK_SIZES, pa_decode.swa.PAGE)
MAX_WINDOW = 64 * 1024


def _pages_for(window: int, page_sizes: tuple) -> tuple:
    """The page sizes among ``page_sizes`` that the kernel of ``window`` addresses."""
    fits = (pa_decode.swa.PAGE,) if window else pa_decode.model.BLOCK_SIZES
    return tuple(bs for bs in page_sizes if bs in fits)


def _ints(name, xs, lo, hi, allowed=None):
    xs = tuple(xs)
    if not xs:
        raise ValueError(f"{name} is empty")
    for x in xs:
        if isinstance(x, bool) or not isinstance(x, int):
            raise TypeError(f"{name} must hold ints, got {x!r}")
        if not lo <= x <= hi or (allowed is not None and x not in allowed):
            want = f"one of {allowed}" if allowed is not None else f"in {lo}..{hi}"
            raise ValueError(f"{name}: {x} is not {want}")
    return xs


def table(contexts=DEFAULTS["contexts"], query_lengths=DEFAULTS["query_lengths"],
          partitions=DEFAULTS["partitions"], page_sizes=DEFAULTS["page_sizes"],
          scales=DEFAULTS["scales"], versions=DEFAULTS["versions"],
          windows=DEFAULTS["windows"], spreads=DEFAULTS["spreads"], *, group: int = 2,
          head_dim: int = 64, seed: int = 0) -> pd.DataFrame:
    """One row per combination of the axes (``AXES``); every argument is checked before any
    work (ValueError/TypeError naming it)."""
    contexts = _ints("contexts", contexts, 0, 64 * 1024)
    query_lengths = _ints("query_lengths", query_lengths, 1, pa_decode.model.MAX_QUERY_LENGTH)
    partitions = _ints("partitions", partitions, 1, pa_decode.model.MAX_PARTITIONS)
    page_sizes = _ints("page_sizes", page_sizes, 1, 1024, PAGE_SIZES)
    windows = _ints("windows", windows, 0, MAX_WINDOW)
    for w in windows:
        if not _pages_for(w, page_sizes):
            kernel = "pa_decode_swa (1024-token pages)" if w else "pa_decode_tile (pages of 16 or 64)"
            raise ValueError(f"windows: {w} runs {kernel}, and page_sizes {page_sizes} holds none "
                             f"of its page sizes")
    _ints("group", (group,), 1, 16)
    _ints("head_dim", (head_dim,), 64, 256, decode.HEAD_DIMS)
    if any(windows) and head_dim not in pa_decode.swa.HEAD_DIMS:
        raise ValueError(f"head_dim: {head_dim} is not one the sliding-window kernel runs "
                         f"{pa_decode.swa.HEAD_DIMS}")
    spreads = tuple(spreads)
    if not spreads:
        raise ValueError("spreads is empty")
    for x in spreads:
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise TypeError(f"spreads must hold numbers, got {x!r}")
        if not 0 <= x < float("inf"):
            raise ValueError(f"spreads: {x} is not a finite number >= 0")
    scales = tuple(scales)
    for s in scales:
        if s not in SCALES:
            raise ValueError(f"scales: {s!r} is not one of {SCALES}")
    versions = tuple(versions)
    for v in versions:
        if v not in DECODE_VERSIONS:
            raise ValueError(f"versions: {v!r} is not one of {tuple(DECODE_VERSIONS)}")
    rows = []
    combos = [(v, bs, npart, ql, sc, w, ctx, sp)
              for v, w, npart, ql, sc, ctx, sp in itertools.product(
                  versions, windows, partitions, query_lengths, scales, contexts, spreads)
              for bs in _pages_for(w, page_sizes)]
    for v, bs, npart, ql, sc, w, ctx, sp in combos:
        case = pa_decode.cases.make([ctx], query_length=ql, num_q_heads=group,
                                    head_dim=head_dim, block_size=bs,
                                    per_token=sc == "per_token", k_mult=float(sp), seed=seed,
                                    spare_pages=1 if w else 2)
        out = _run(case, v, npart, w).double()
        ref = pa_decode.cases.reference(case, sliding_window=w)
        seen = torch.isfinite(ref).all(-1)
        bad = seen & ~torch.isfinite(out).all(-1)
        ok = seen & ~bad
        vmax = float(case.value_scale.max()) * pa_decode.model.E4M3_MAX
        err = float((out[ok] - ref[ok]).abs().max()) / vmax if ok.any() else float("nan")
        if w:
            violated = "no region"
        else:
            m = pa_decode.bound.measure(case, num_partitions=npart, upstream=v)
            violated = ",".join(pa_decode.bound.region(v).violated(m))
        rows.append({"upstream": v, "page_size": bs, "num_partitions": npart,
                     "query_length": ql, "scales": sc, "window": w, "context": ctx,
                     "spread": float(sp),
                     "rows": int(seen.numel()), "undefined": int((~seen).sum()),
                     "nan_rows": int(bad.sum()), "max_err": err, "violated": violated})
    return pd.DataFrame(rows)


def _run(case, version: str, npart: int, window: int) -> torch.Tensor:
    """One call: ``pa_decode_tile``, or with a window the sliding-window launcher path."""
    if not window:
        return decode.pa_decode_tile(*case.args(), num_partitions=npart, upstream=version)
    out, q, kc, vc, bt, ctx, ks, vs = case.args()
    decode.pa_decode_ps_launch(out, q, kc, vc, ctx, None, None, None, ks, vs,
                               sliding_window=window, block_tables=bt,
                               max_context_partition_num=npart, upstream=version)
    return out


def format_table(t: pd.DataFrame) -> str:
    """The table as text, one line per call."""
    head = (f"{'upstream':>17} {'page':>4} {'NP':>3} {'QL':>3} {'scales':>10} {'window':>6} {'ctx':>6} "
            f"{'spread':>6} {'NaN rows':>9} {'max err':>9}  region")
    lines = [head]
    for _, r in t.iterrows():
        err = "—" if pd.isna(r.max_err) else f"{r.max_err:.2e}"
        lines.append(f"{r.upstream:>17} {r.page_size:>4} {r.num_partitions:>3} "
                     f"{r.query_length:>3} {r.scales:>10} {r.window:>6} {r.context:>6} {r.spread:>6g} "
                     f"{f'{r.nan_rows}/{r.rows}':>9} {err:>9}  {r.violated or 'inside'}")
    return "\n".join(lines)
