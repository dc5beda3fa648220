"""The sliding-window decode's safe region in closed form (``fa_lab.studies.onset.bound(
"pa_decode_swa")``; the kernel: ``swa.py``, docs/semantics.md §13).

Each partition's CTA runs one 256-token tile, its max eager over the tile's four waves, so
no lazy rebase and no overflow: P f_w = 2^((x - M) log2 e) enters the e4m3 cast in (0, 1]
with no headroom scale per tensor (per token: times v_scale[t] 240 / vmax). What can go
wrong, each exact on the model:

* ``p_cast_subnormal`` / ``p_cast_flush``: a windowed token whose gap (``swa.p_cast_gap``:
  (M - x) log2 e, less log2(v_scale[t] norm) per token) passes 6 keeps fewer than 4 bits;
  from 10 it rounds to 0, its weight stays in the sum and its value leaves the output (a
  silent mass loss; one large V scale in the tile lowers every other token's factor);
* ``dropped_tiles``: fewer partitions than visible tiles leave the window's newest tiles
  out (``swa.dropped_tiles``), whose tokens the last query row always sees: silent;
* ``empty_row``: with NP > 1, a row that has no token in the tiles computed gets -inf from
  every partition and the reduce's (-inf) - (-inf) is NaN (NP = 1 writes 0);
* ``nonfinite_tile``: every V and per-token V scale of a computed tile's 256 tokens enters
  P V, masked ones with P = 0: a NaN or inf there is NaN in every row of that kv head.

The cast's edges are exact up to the fp32 rounding of the kernel's exponent (a few 2^-24
relative), which the closed form, taken in float64, does not carry. Assumes finite Q and
K inside the window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._common.hazard import Hazard
from .bound import CAST_FLUSH_AT, CAST_SUBNORMAL_AT, DecodeRegion
from .model import TILE_TOK, logical_kv
from . import swa


@dataclass
class SWAMeasure:
    """What the region reads off one sliding-window call: ``p_cast_gap`` (the recorder's,
    per (seq, kv head, partition, row)), ``dropped`` (per sequence), ``empty_rows``
    (NP > 1 and some row sees no token of the computed tiles) and ``tile_nonfinite``."""

    p_cast_gap: torch.Tensor
    dropped: list
    empty_rows: bool
    tile_nonfinite: bool


def measure(case, *, sliding_window: int, num_partitions: int | None = None,
            upstream: str = "main-11c4174d", softmax_scale: float | None = None) -> SWAMeasure:
    """``SWAMeasure`` of a sliding-window call (``cases.Case`` with 1024-token pages;
    ``num_partitions`` None: the recommended count; ``softmax_scale`` None: 1 / sqrt(D)),
    from one run of the model (its recorder) and the computed tiles' V."""
    from fa_lab.upstream import check_decode

    ctx = [int(c) for c in case.context_lengths]
    ql = case.query.shape[0] // len(ctx)
    group = case.query.shape[1] // case.key_cache.shape[1]
    w = sliding_window
    npart = swa.recommended_partitions(w, ql) if num_partitions is None else num_partitions
    d = case.query.shape[2]
    sm = d ** -0.5 if softmax_scale is None else float(softmax_scale)
    rec: dict = {}
    swa.forward(case.query, case.key_cache, case.value_cache, case.block_tables,
                case.context_lengths, case.key_scale, case.value_scale, softmax_scale=sm,
                sliding_window=w, num_partitions=npart, version=check_decode(upstream),
                out_dtype=case.query.dtype, recorder=rec)
    _, v = logical_kv(case.key_cache, case.value_cache)
    per_token = case.key_scale.dim() > 1
    empty, bad = False, False
    for seq, c in enumerate(ctx):
        tiles = rec["tiles"][seq]
        ran = [t for t in tiles if t is not None]
        lo, hi = swa.window_bounds(c, ql, group, w)
        if npart > 1:
            covered = [any(max(a, t * TILE_TOK) < min(b, (t + 1) * TILE_TOK) for t in ran)
                       for a, b in zip(lo, hi)]
            empty = empty or not all(covered)
        for t in ran:
            page = int(case.block_tables[seq, t // swa.TILES_PER_PAGE])
            slot = (t % swa.TILES_PER_PAGE) * TILE_TOK + torch.arange(TILE_TOK)
            vals = v[page, :, slot].float()
            ok = bool(torch.isfinite(vals).all())
            if per_token:
                ok = ok and bool(torch.isfinite(case.value_scale[page, :, slot]).all())
            bad = bad or not ok
    return SWAMeasure(rec["p_cast_gap"], list(rec["dropped"]), empty, bad)


def _gap_below(at: float):
    def check(m: SWAMeasure):
        g = m.p_cast_gap[m.p_cast_gap > float("-inf")]
        margin = at - float(g.max()) if g.numel() else float("inf")
        return margin > 0, margin
    return check


def region(upstream: str | None = None) -> DecodeRegion:
    """The sliding-window decode's safe region at ``upstream`` (``fa_lab.upstream``'s
    decode versions; default main-11c4174d: both compute the same, only their launchers
    differ)."""
    from fa_lab.upstream import check_decode

    name = check_decode(upstream).name
    return DecodeRegion(name, (
        Hazard("p_cast_subnormal", "precision",
               f"every windowed token's gap (M - x) log2 e - log2 w < {CAST_SUBNORMAL_AT:g} "
               "(w = 1 per tensor, v_scale[t] 240 / (vmax + 1e-8) per token)",
               _gap_below(CAST_SUBNORMAL_AT),
               note="P f_w is in (0, 1] with no headroom: below, fewer than 4 bits"),
        Hazard("p_cast_flush", "mass",
               f"every windowed token's gap < {CAST_FLUSH_AT:g}", _gap_below(CAST_FLUSH_AT),
               note="from there e4m3(P f_w) is 0: its weight stays in the sum, its value "
                    "leaves the output"),
        Hazard("dropped_tiles", "mass", "NP >= the visible tiles of every sequence",
               lambda m: (not any(m.dropped), None),
               note="the window's newest tiles are never computed; the last query row "
                    "sees tokens there: silent"),
        Hazard("empty_row", "nan", "NP = 1, or every row sees a token of a computed tile",
               lambda m: (not m.empty_rows, None),
               note="every partition -inf: the reduce's (-inf) - (-inf)"),
        Hazard("nonfinite_tile", "nan",
               "V and its per-token scales finite over each computed tile's 256 tokens",
               lambda m: (not m.tile_nonfinite, None),
               note="P = 0 times NaN in the PV product, masked tokens included"),
    ), kernel="pa_decode_swa")
