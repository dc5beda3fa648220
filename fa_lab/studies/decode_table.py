"""The decode kernels over their own axes (``fa-lab table --which decode``): the paged decode
(``kernels`` ``"pa_decode"``) over page size, partition count, query length (MTP), scale mode,
sliding window, context length and score spread, per upstream version, and the MLA decode
(``"mla_decode"``) over context length, KV splits, score spread and P headroom; each call
against the fp64 reference (the window applied), beside what the kernel's safe region
(``onset.bound("pa_decode:<v>")``, ``onset.bound("mla_decode")``) predicts for the same call.

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

An MLA row (``kernel`` ``"mla_decode"``) is the decode sweep's point of the same axes
(``fa_lab.studies.sweep.compute_decode_point``: ``fa_lab.mla.mla_decode`` on the emulator,
version ``main-11c4174d``): one sequence of ``context`` keys decoding one token over 128
heads, its keys cut into ``num_partitions`` KV splits that the reduce merges, P lifted by
2^``p_headroom`` before its e4m3 cast (0: upstream's cast; ``p_headrooms``). Its scores are
N(0, spread^2) natural-log logits and V = 1 (``fa_lab.studies.mla_mass_loss.gaussian_inputs``),
so its ``max_err`` is the largest head's deficit (in units of max|V| = 1) and ``mass_loss``
the mean over heads of 1 - <out, ref> / <ref, ref> (with V = 1, 1 - mean(out)); its region
is ``kernels/mla_decode/bound.py``'s, per work item. The paged decode's other axes (query lengths, page sizes, scales, windows, versions,
``group``, ``head_dim``) do not apply to it: asked for alone (``kernels=("mla_decode",)``),
they are refused; ``p_headrooms`` applies to it alone. A paged decode row's ``p_headroom``
and ``mass_loss`` are NaN.
"""

from __future__ import annotations

import itertools

import pandas as pd
import torch

from fa_lab import decode
from fa_lab.kernels import pa_decode
from fa_lab.upstream import DECODE_VERSIONS

AXES = ("kernel", "upstream", "page_size", "num_partitions", "query_length", "scales", "window",
        "context", "spread", "p_headroom")
SCALES = ("per_tensor", "per_token")
KERNELS = ("pa_decode", "mla_decode")
DEFAULTS = dict(contexts=(257, 700), query_lengths=(1, 4), partitions=(1, 2), page_sizes=(16,),
                scales=SCALES, versions=tuple(DECODE_VERSIONS), windows=(0,), spreads=(1.0,),
                kernels=KERNELS, p_headrooms=(0.0, 8.0), group=2, head_dim=64)
#: The paged decode's own arguments, which an MLA-only table refuses.
PA_ONLY = ("query_lengths", "page_sizes", "scales", "versions", "windows", "group", "head_dim")
MLA_VERSION = "main-11c4174d"
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


def table(contexts=DEFAULTS["contexts"], query_lengths=None, partitions=DEFAULTS["partitions"],
          page_sizes=None, scales=None, versions=None, windows=None,
          spreads=DEFAULTS["spreads"], *, group: int | None = None, head_dim: int | None = None,
          seed: int = 0, kernels=DEFAULTS["kernels"], p_headrooms=None) -> pd.DataFrame:
    """One row per combination of the axes (``AXES``) that applies to each of ``kernels``
    (None for an axis of the paged decode: its default, ``DEFAULTS``); every argument is
    checked before any work (ValueError/TypeError naming it)."""
    kernels = tuple(kernels) if not isinstance(kernels, str) else (kernels,)
    if not kernels or any(k not in KERNELS for k in kernels):
        raise ValueError(f"kernels: {kernels!r}; choose from {KERNELS}")
    given = dict(query_lengths=query_lengths, page_sizes=page_sizes, scales=scales,
                 versions=versions, windows=windows, group=group, head_dim=head_dim)
    if "pa_decode" not in kernels:
        off = [k for k in PA_ONLY if given[k] is not None]
        if off:
            raise ValueError(f"{off[0]} is an axis of the paged decode and does not apply to "
                             "mla_decode (one token, one kv head of 576, pages of one token, "
                             "no descales, one version)")
    if "mla_decode" not in kernels and p_headrooms is not None:
        raise ValueError("p_headrooms is an axis of mla_decode alone; add it to kernels")
    query_lengths, page_sizes, scales, versions, windows, group, head_dim = (
        DEFAULTS[k] if given[k] is None else given[k] for k in PA_ONLY)
    p_headrooms = DEFAULTS["p_headrooms"] if p_headrooms is None else tuple(p_headrooms)
    from fa_lab.mla import MAX_HEADROOM

    if not p_headrooms:
        raise ValueError("p_headrooms is empty")
    for h in p_headrooms:
        if isinstance(h, bool) or not isinstance(h, (int, float)):
            raise TypeError(f"p_headrooms must hold numbers, got {h!r}")
        if not 0 <= h <= MAX_HEADROOM:
            raise ValueError(f"p_headrooms: {h} is not in 0 .. log2(448) = {MAX_HEADROOM:.3f}")
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
    if "pa_decode" not in kernels:
        versions = ()
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
        rows.append({"kernel": "pa_decode", "upstream": v, "page_size": bs,
                     "num_partitions": npart,
                     "query_length": ql, "scales": sc, "window": w, "context": ctx,
                     "spread": float(sp), "p_headroom": float("nan"),
                     "rows": int(seen.numel()), "undefined": int((~seen).sum()),
                     "nan_rows": int(bad.sum()), "max_err": err, "mass_loss": float("nan"),
                     "violated": violated})
    if "mla_decode" in kernels:
        rows += _mla_rows(contexts, partitions, spreads, p_headrooms, seed)
    return pd.DataFrame(rows)


def _mla_rows(contexts, partitions, spreads, headrooms, seed) -> list[dict]:
    """The MLA rows (module docstring): the decode sweep's points of ``mla_decode``
    (``fa_lab.studies.sweep.compute_decode_point``, the emulator on the CPU), one per
    combination, with the table's columns."""
    from fa_lab.studies.sweep import DecodeGrid, compute_decode_point

    pts = DecodeGrid({"kernel": ["mla_decode"], "num_partitions": list(partitions),
                      "context": list(contexts), "spread": [float(x) for x in spreads],
                      "p_headroom": [float(h) for h in headrooms], "seed": [seed]}).points()
    order = {k: i for i, k in enumerate(itertools.product(
        partitions, contexts, map(float, spreads), map(float, headrooms)))}
    pts.sort(key=lambda p: order[(p["num_partitions"], p["context"], p["spread"],
                                  p["p_headroom"])])
    cols = ("kernel", "upstream", "page_size", "num_partitions", "query_length", "scales",
            "window", "context", "spread", "p_headroom", "rows", "undefined", "nan_rows",
            "max_err", "mass_loss", "violated")
    return [{c: r[c] for c in cols} for r in map(compute_decode_point, pts)]


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
    head = (f"{'kernel':>10} {'upstream':>17} {'page':>4} {'NP':>3} {'QL':>3} {'scales':>10} "
            f"{'window':>6} {'ctx':>6} {'spread':>6} {'H':>4} {'NaN rows':>9} {'max err':>9} "
            f"{'mass loss':>9}  region")
    lines = [head]
    for _, r in t.iterrows():
        err = "—" if pd.isna(r.max_err) else f"{r.max_err:.2e}"
        loss = "—" if pd.isna(r.mass_loss) else f"{r.mass_loss:.2e}"
        h = "—" if pd.isna(r.p_headroom) else f"{r.p_headroom:g}"
        lines.append(f"{r.kernel:>10} {r.upstream:>17} {r.page_size:>4} {r.num_partitions:>3} "
                     f"{r.query_length:>3} {r.scales:>10} {r.window:>6} {r.context:>6} "
                     f"{r.spread:>6g} {h:>4} {f'{r.nan_rows}/{r.rows}':>9} {err:>9} "
                     f"{loss:>9}  {r.violated or 'inside'}")
    return "\n".join(lines)
