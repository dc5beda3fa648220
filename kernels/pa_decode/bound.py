"""When the paged decode's output is NaN on finite inputs, in closed form (docs/semantics.md
§13.4): which rows of one (sequence, kv head) come out NaN, from the context length c, the
query length QL, the GQA group G (rows r = qi * G + g, M-tiles of 16 rows), the partition
count NP, the scale mode and the version. Assumes finite Q, K, V and positive V scales
above 1.04e-8 (so that a P of 1 times the 4.48e10 normalization overflows e4m3).

Let T = ceil(c / 256) tiles, the last holding k = c - 256 (T - 1) tokens, tpp =
ceil(T / NP), and s = tpp * floor((T - 1) / tpp) the first tile of the last tile's
partition. Row r sees tokens below b(r) = c - (QL - 1) + qi (c when QL = 1), so tile T - 1
is fully masked for it exactly when k <= QL - 1 - qi; no earlier tile ever is (b >= c - 15).

``flydsl-985c653a^`` (20faaa4d), per-token scales: M-tile m's V-scale maximum is taken for
its first row (qi_m = 16 m // G) alone; when k <= QL - 1 - qi_m it is 0 on the last tile,
the normalization is 4.48e10, and every row of the M-tile whose P there is not 0 packs NaN:
the rows with a valid token in it (qi > QL - 1 - k), and the rows for which it is fully
masked but also the first tile of their partition (s = T - 1: the -1e30 sentinel cancels,
P = exp2(0) = 1). NaN reaches the output through the PV product, and across partitions
through the reduce's 0 * NaN. Per-tensor scales make no NaN there (P * 448 = 448).
That race also makes NaN possible, depending on the data, for any row that sees more
tokens than its M-tile's first row (qi > qi_m): a token t only it sees is left out of the
maximum, and P * v_scale[t] * 448 / (vmax + 1e-8) passes 464 when v_scale[t] P exceeds
1.036 vmax. ``nan_rows`` gives the certain rows, ``possible_nan_rows`` the certain and
these.

Both versions: c = 0 with NP > 1 leaves every partition empty, its maximum -inf, and the
reduce's (-inf) - (-inf) = NaN (with NP = 1 the output is 0).

``main-11c4174d``: the sentinel never yields P = 1 (re-masked on one M-tile, -inf on
several). NaN comes only from the reduce (NP > 1) when every partition reports -inf:
c = 0, or, with more than 16 rows (the -inf path), a row that sees no token (b(r) <= 0).

Both forms also assume scores that stay above -128 log2 units somewhere in the first
tile each row sees in each partition. On main's -inf path (more than 16 rows) a row
whose first visible tile in a partition has its maximum m <= -128 (log2 units, after
the scale) gets the correction exp2(0 - m) = inf while its m is still -inf
(pa_decode_tile.py l.747-748: ``safe_prev`` is 0 there), and l = 0 * inf = NaN: a NaN
that depends on the data, which the decode attack found (``fa_lab.studies.adversary.
decode``) and ``nan_rows`` does not give. The -1e30 path starts from exp2(-inf) = 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._common.hazard import Hazard, HazardChecks
from .model import MTILE_ROWS, TILE_TOK, logical_kv


def nan_rows(context_len: int, query_length: int, group: int, num_partitions: int, *,
             upstream: str = "main-11c4174d", per_token: bool = True) -> list[bool]:
    """For each row r = qi * group + g of one (sequence, kv head): is its output NaN?"""
    c, ql, npart = context_len, query_length, num_partitions
    rows = ql * group
    qi = [r // group for r in range(rows)]
    if upstream == "main-11c4174d":
        if npart == 1:
            return [False] * rows
        if c == 0:
            return [True] * rows
        multi = rows > MTILE_ROWS
        return [multi and c - (ql - 1) + q <= 0 for q in qi] if ql > 1 else [False] * rows
    if upstream != "flydsl-985c653a^":
        raise ValueError(f"upstream={upstream!r} has no closed form here")
    if c == 0:
        return [npart > 1] * rows
    if not per_token or ql == 1:
        return [False] * rows
    t = -(-c // TILE_TOK)
    k = c - TILE_TOK * (t - 1)
    tpp = -(-t // npart)
    first = tpp * ((t - 1) // tpp) == t - 1
    out = []
    for r in range(rows):
        race_qi = (r // MTILE_ROWS) * MTILE_ROWS // group
        vmax_zero = k <= ql - 1 - race_qi
        sees = qi[r] > ql - 1 - k
        out.append(vmax_zero and (sees or first))
    return out


def possible_nan_rows(context_len: int, query_length: int, group: int, num_partitions: int, *,
                      upstream: str = "main-11c4174d", per_token: bool = True) -> list[bool]:
    """``nan_rows`` plus, before 985c653a with per-token scales, the rows that see tokens
    their M-tile's first row does not (NaN there depends on the V scales)."""
    certain = nan_rows(context_len, query_length, group, num_partitions, upstream=upstream,
                       per_token=per_token)
    if upstream == "main-11c4174d" or not per_token or context_len == 0:
        return certain
    return [c or r // group > (r // MTILE_ROWS) * MTILE_ROWS // group
            for r, c in enumerate(certain)]


def fully_masked_first_tile(context_len: int, query_length: int, group: int,
                            num_partitions: int) -> list[bool]:
    """Rows for which some partition's first tile is fully masked (the sentinel's
    cancellation, P = 1 on a -1e30 path): the rows with qi <= QL - 1 - k when the last
    tile starts its partition, every row when it sees no token at all."""
    c, ql = context_len, query_length
    rows = ql * group
    if c == 0:
        return [False] * rows
    t = -(-c // TILE_TOK)
    k = c - TILE_TOK * (t - 1)
    tpp = -(-t // num_partitions)
    first = tpp * ((t - 1) // tpp) == t - 1
    return [(first and k <= ql - 1 - r // group) or c - (ql - 1) + r // group <= 0
            for r in range(rows)]


# ---- the safe region (``fa_lab.studies.onset.bound("pa_decode:<version>")``) -------------

#: Log2 of the fp32 overflow boundary: exp2(x) is inf from x = 128.
OVERFLOW = 128.0


@dataclass
class DecodeMeasure:
    """What the region's formulas read off one decode call (``measure``): per sequence its
    context, the call's sizes and scale mode, ``first_max`` (per (seq, kv head, partition,
    row): the running max, log2 units, after the first tile of the partition in which the
    row sees a token; -inf where it sees none) and whether the cache holds a non-finite V
    or V scale past a context inside its last tile (``tail_nonfinite``); ``p_cast_gap``
    (per (seq, kv head, partition, row): ``model.p_cast_gap``, the largest -log2 of a valid
    token's P times its cast factor; -inf where the row sees none)."""

    contexts: list
    query_length: int
    group: int
    num_partitions: int
    per_token: bool
    first_max: torch.Tensor
    tail_nonfinite: bool
    p_cast_gap: torch.Tensor | None = None


@dataclass(frozen=True)
class DecodeRegion(HazardChecks):
    """The decode's safe region for one version: a call is inside when no hazard applies."""

    upstream: str
    hazards: tuple
    kernel: str = "pa_decode"


    def describe(self) -> str:
        return self._described(f"{self.kernel} at {self.upstream}: safe where")

    def to_dict(self) -> dict:
        return {"policy": self.upstream, "kernel": self.kernel,
                "hazards": [h.to_dict() for h in self.hazards]}


def measure(case, *, num_partitions: int, upstream: str = "main-11c4174d",
            softmax_scale: float | None = None) -> DecodeMeasure:
    """``DecodeMeasure`` of a checked decode call (``cases.Case``, or anything with its
    fields; ``softmax_scale`` None: 1 / sqrt(D)), from one run of the model (its
    recorder's ``first_max`` and ``p_cast_gap``) and the cache's tail."""
    from fa_lab.upstream import check_decode

    from .model import forward

    rec: dict = {}
    d = case.query.shape[2]
    sm = d ** -0.5 if softmax_scale is None else float(softmax_scale)
    forward(*case.args()[1:], softmax_scale=sm, num_partitions=num_partitions,
            version=check_decode(upstream), out_dtype=case.query.dtype, recorder=rec)
    ctx = [int(c) for c in case.context_lengths]
    ql = case.query.shape[0] // len(ctx)
    group = case.query.shape[1] // case.key_cache.shape[1]
    bs = case.key_cache.shape[3]
    _, v = logical_kv(case.key_cache, case.value_cache)
    per_token = case.value_scale.dim() > 1
    tail = False
    for seq, c in enumerate(ctx):
        end = -(-c // TILE_TOK) * TILE_TOK
        t = torch.arange(c, end)
        flat = case.block_tables.reshape(-1).long()
        idx = seq * case.block_tables.shape[1] + t // bs
        pages = torch.where(idx < flat.numel(), flat[idx.clamp(max=flat.numel() - 1)], 0)
        vals = v[pages, :, t % bs]
        bad = ~torch.isfinite(vals).all()
        if per_token:
            bad = bad | ~torch.isfinite(case.value_scale[pages, :, t % bs]).all()
        tail = tail or bool(bad)
    return DecodeMeasure(ctx, ql, group, num_partitions, per_token, rec["first_max"], tail,
                         rec["p_cast_gap"])


def _sentinel(version: str):
    def check(m: DecodeMeasure):
        bad = any(c > 0 and any(possible_nan_rows(c, m.query_length, m.group, m.num_partitions,
                                                  upstream=version, per_token=m.per_token))
                  for c in m.contexts)
        return not bad, None
    return check


def _empty(version: str):
    def check(m: DecodeMeasure):
        if m.num_partitions == 1:
            return True, None
        rows = m.query_length * m.group
        multi = version == "main-11c4174d" and rows > MTILE_ROWS
        bad = any(c == 0 or (multi and m.query_length > 1 and c - (m.query_length - 1) <= 0)
                  for c in m.contexts)
        return not bad, None
    return check


def _first_max(m: DecodeMeasure):
    rows = m.query_length * m.group
    fm = m.first_max[m.first_max > float("-inf")]
    if rows <= MTILE_ROWS or fm.numel() == 0:
        return True, None
    margin = float(fm.min()) + OVERFLOW
    return margin > 0, margin


#: The P cast's gaps (``model.p_cast_gap``) from which a valid token's P w is an e4m3
#: subnormal (fewer than 4 significant bits) and from which it rounds to 0 (its mass
#: stays in l and leaves O). Per tensor w = 448: a token more than 6 + log2(448) = 14.807
#: and 10 + log2(448) = 18.807 log2 units below the running max; per token, less by
#: log2(vmax / v_scale[t]): a V-scale outlier in the tile flushes the other tokens sooner.
#: Exact up to the fp32 rounding of the kernel's exponent (a few 2^-24 relative).
CAST_SUBNORMAL_AT = 6.0
CAST_FLUSH_AT = 10.0


def _gap_below(at: float):
    def check(m: DecodeMeasure):
        if m.p_cast_gap is None:
            raise ValueError("this DecodeMeasure has no p_cast_gap; take it with measure()")
        g = m.p_cast_gap[m.p_cast_gap > float("-inf")]
        margin = at - float(g.max()) if g.numel() else float("inf")
        return margin > 0, margin
    return check


def region(upstream: str | None = None) -> DecodeRegion:
    """The safe region of the paged decode at ``upstream`` (``fa_lab.upstream``; default
    main-11c4174d): the sentinel's NaN (``nan_rows``), the reduce's NaN on a context that
    sees nothing, main's -inf-path correction overflow, NaN in the cache's tail, and the P
    cast's subnormal and flushed tokens (silent precision and mass loss)."""
    from fa_lab.upstream import check_decode

    name = check_decode(upstream).name
    main = name == "main-11c4174d"
    return DecodeRegion(name, (
        Hazard("sentinel_pack_nan", "nan",
                     "no row has possible_nan_rows(c, QL, G, NP) (per-token scales: the last "
                     "tile holds k > QL - 1 - qi_m tokens for each M-tile's first row, and no "
                     "row sees more than its M-tile's first)", _sentinel(name),
                     exact=False, never=main,
                     note="985c653a re-masks P and takes the V-scale max over all 256 tokens"
                     if main else "sufficient: the V-scale race makes some of these rows NaN "
                     "only for some scales"),
        Hazard("empty_context", "nan",
                     "NP = 1, or every context > 0 (main, > 16 rows: c > QL - 1)", _empty(name),
                     note="every partition -inf: the reduce's (-inf) - (-inf)"),
        Hazard("inf_path_correction", "overflow",
                     "rows <= 16, or first_max > -128 (log2) for every row and partition",
                     _first_max, never=not main,
                     note="exp2(0 - m) = inf times l = 0 (l.747-748)" if main
                     else "the -1e30 path starts from exp2(-inf) = 0"),
        Hazard("stale_v_tail", "nan", "V and its scales finite past c in the last tile",
                     lambda m: (not m.tail_nonfinite, None),
                     note="P = 0 times NaN in the PV product, both versions"),
        Hazard("p_cast_subnormal", "precision",
               f"every valid token's gap (m - x) - log2 w < {CAST_SUBNORMAL_AT:g} (w = 448 per "
               "tensor, v_scale[t] 448 / (vmax + 1e-8) per token)",
               _gap_below(CAST_SUBNORMAL_AT),
               note="P is in (0, 1] (the max is eager per 256-token tile, so no lazy "
                    "overflow) and its only headroom is w: below, P w keeps fewer than 4 bits"),
        Hazard("p_cast_flush", "mass",
               f"every valid token's gap (m - x) - log2 w < {CAST_FLUSH_AT:g}",
               _gap_below(CAST_FLUSH_AT),
               note="from there e4m3(P w) is 0: the token's P stays in l and leaves O, a "
                    "silent mass loss; per token, one large V scale in a tile lowers w for "
                    "every other token of it"),
    ))
