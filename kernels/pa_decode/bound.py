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
"""

from __future__ import annotations

from .model import MTILE_ROWS, TILE_TOK


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
