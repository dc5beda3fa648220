"""Exact model of FlyDSL's paged-attention fp8 decode, ``pa_decode_tile`` (docs/semantics.md
§13), with the split reduce it launches (``pa_decode_swa.compile_pa_decode_sw_reduce``,
modelled in ``reduce.py``).

References are to ROCm/FlyDSL ``kernels/attention/pa_decode_tile.py``: main 11c4174d
(``"main-11c4174d"``) and 20faaa4d, the parent of 985c653a (``"flydsl-985c653a^"``); the
differences are the flags of ``fa_lab.upstream.DecodeVersion``.

Layouts (11c4174d l.16-22, l.1021-1047). ``query`` [num_seqs * QL, Hq, D] bf16/f16 (row
``seq * QL + qi``, QL = query_length 1..16, the MTP positions); ``key_cache`` [num_blocks,
Hkv, D // 16, bs, 16] and ``value_cache`` [num_blocks, Hkv, bs // 16, D, 16] (``trans_v``)
or [num_blocks, Hkv, D, bs], float8_e4m3fn; ``block_tables`` [num_seqs, max_blocks] int32;
``context_lengths`` [num_seqs] int32; scales [1] (per tensor) or [num_blocks, Hkv, bs]
(per token). bs (page size) is 16 or 64, D a multiple of 64.

Geometry (l.248-252, l.553-561). One CTA per (seq, kv head, partition). The context is cut
into 256-token tiles, ``num_tiles = ceil(ctx / 256)``; partition p owns tiles
``[p * tpp, min((p + 1) * tpp, num_tiles))`` with ``tpp = ceil(num_tiles / NP)`` (a
partition past the tiles is empty). A CTA's query rows are the flattened (MTP position,
GQA head) pairs ``r = qi * G + g`` (G = Hq / Hkv), in M-tiles of 16 rows. Row r sees tokens
``t < bound(r)``, ``bound = ctx`` when QL = 1, else ``ctx - (QL - 1) + qi``. Token t's page is
``block_tables`` entry ``seq * max_blocks + t // bs``, read flat through a buffer bounded
by the whole table: an index past its end reads page 0 (l.228-235). (20faaa4d's table
read is unbounded, l.315: past the end it reads whatever memory follows; the model reads
page 0 there in both versions.)

Per row and tile (l.616-902; 20faaa4d l.725-962):
  q8 = e4m3(q / qs), qs = absmax(q) * f32(1/448) (rcp of max(qs, 1e-20); l.454-475)
  scale = scale_qk * qs, scale_qk = f32(softmax_scale * log2 e) (* key_scale per tensor)
  S = q8 . k8 (fp32; * k_scale[t] per token); masked = S where t < bound(r), else SENT
  tile max = max over the 4 waves of (wave's max of masked) * scale; m_new = fmax(m, it)
  P = exp2(masked * scale - m_new); l = l * exp2(m - m_new) + sum(P)
  P8 = e4m3(P * 448) per tensor, e4m3(P * v_scale[t] * norm) per token, where
       norm = rcp(vmax / 448 + 1e-8 / 448) and vmax the tile's largest V scale (and 0)
  O = O * exp2(m - m_new) + P8 . v8 (* vmax / 448 per token)
SENT is -1e30 (a finite sentinel): a row whose tile is fully masked, first in its
partition, gets m_new = -1e30 * scale and P = exp2(0) = 1 for every masked token. The
main version zeroes those P again (``remask_p``, 985c653a: ``masked > -1e29``); it also
masks with -inf on calls of several M-tiles (more than 16 rows), where the base is
guarded (``safe_max`` = 0 while m is -inf). Before the fix, per-token mode took vmax over
the tokens valid for one row only, so a fully masked tile has vmax = 0, norm = 4.48e10 and
P8 = e4m3(1 * v_scale * 4.48e10), NaN (the cast does not saturate), which the PV product
spreads over the tile's rows. Which row: every lane stores its own maximum to one LDS
word (20faaa4d l.801-810), a race; the model takes the M-tile's first row
(``VMAX_RACE_ROW``), the write that matches the failure upstream reports.

Epilogue (l.906-951; 20faaa4d l.1033-1079): ``inv_l = rcp(l)`` if l > 0 else 1;
out = round(O * inv_l * v_scale / 448) per tensor (per token without the factor), into the
query's dtype. One partition writes the output; several write ``pout`` (rounded the same
way), ``psum = l`` and ``pmax = m``: natural-log units in main (m / log2 e), log2 units
before, which the reduce multiplies by log2 e in both.

Every operation is one IEEE fp32 operation (no contraction: upstream's fastmath
``contract`` may fuse ``masked * scale - m_new`` into an fma, under which the cancellation
leaves the product's rounding error instead of 0; not modelled). Dots are exact sums
rounded once (``numerics.exact_dot``), rcp is correctly rounded, exp2 is ``numerics.exp2``;
fp32 sums keep the kernel's order (per lane over 4 chunks of 4, across the 4 quarter-waves,
across the 4 waves). Maxima are maxNum (NaN scores are dropped, as ``v_max`` does).
"""

from __future__ import annotations

import math

import torch

from fa_lab.numerics import E4M3_MAX, e4m3, exact_dot, exp2, f32, fmax, round_to
from fa_lab.upstream import DecodeVersion

from .reduce import MAX_PARTITIONS, split_reduce  # noqa: F401 -- MAX_PARTITIONS for fa_lab.decode

LOG2E = 1.4426950408889634  # upstream's constant (l.52)
TILE_TOK = 256              # tokens per compute tile (4 waves x 64)
MTILE_ROWS = 16             # query rows per M-tile (the MFMA's M)
MAX_QUERY_LENGTH = 16
BLOCK_SIZES = (16, 64)
MASK_SENTINEL = -1e30       # the masked score (a finite sentinel)
REMASK_BELOW = -1e29        # main's re-mask: P kept where masked > this
Q_SCALE_FLOOR = 1e-20
V_SCALE_EPS = 1e-8          # added (over 448) to the tile's largest V scale
VMAX_RACE_ROW = 0           # the row (within its M-tile) whose V-scale max wins the race


def partition_tiles(context_len: int, num_partitions: int) -> list[tuple[int, int]]:
    """Each partition's tile range [start, end) for one sequence (empty ranges included)."""
    num_tiles = -(-context_len // TILE_TOK)
    tpp = -(-num_tiles // num_partitions)
    return [(min(p * tpp, num_tiles), min(p * tpp + tpp, num_tiles)) for p in range(num_partitions)]


def row_bounds(context_len: int, query_length: int, group: int) -> list[int]:
    """bound(r) for the rows r = qi * group + g: row r sees tokens t < bound(r)."""
    if query_length == 1:
        return [context_len] * group
    return [context_len - (query_length - 1) + r // group for r in range(query_length * group)]


def logical_kv(key_cache: torch.Tensor, value_cache: torch.Tensor):
    """K and V as fp32 [num_blocks, Hkv, bs, D] from upstream's blocked layouts."""
    nb, hkv, hg, bs, w = key_cache.shape
    k = key_cache.float().permute(0, 1, 3, 2, 4).reshape(nb, hkv, bs, hg * w)
    if value_cache.dim() == 5:  # trans_v: [nb, hkv, bs // 16, D, 16], token = step * 16 + e
        v = value_cache.float().permute(0, 1, 2, 4, 3).reshape(nb, hkv, bs, -1)
    else:                       # [nb, hkv, D, bs]
        v = value_cache.float().permute(0, 1, 3, 2)
    return k, v


def tile_pages(block_tables: torch.Tensor, seq: int, tile: int, block_size: int) -> torch.Tensor:
    """Physical page of each of tile ``tile``'s 256 tokens: the flat table entry
    ``seq * max_blocks + page``, page 0 past the table's end."""
    flat = block_tables.reshape(-1).long()
    idx = seq * block_tables.shape[1] + (tile * TILE_TOK + torch.arange(TILE_TOK)) // block_size
    inside = idx < flat.numel()
    return torch.where(inside, flat[idx.clamp(max=flat.numel() - 1)], torch.zeros_like(idx))


def quantize_q(q: torch.Tensor):
    """Per-row fp8 quantization of Q (l.446-475): (q8, qs), q [R, D] fp32."""
    a = q.abs()
    absmax = torch.where(a.isnan(), float("-inf"), a).amax(dim=1)
    absmax = torch.where(a.isnan().all(dim=1), float("nan"), absmax)
    qs = absmax * f32(1.0 / E4M3_MAX)
    inv = 1.0 / fmax(qs, Q_SCALE_FLOOR)
    return e4m3(q * inv[:, None], saturate=False), qs


def _maxnum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """maxNum over ``dim``: NaN entries dropped, NaN only where all are NaN."""
    m = torch.where(x.isnan(), float("-inf"), x).amax(dim=dim)
    return torch.where(x.isnan().all(dim=dim), float("nan"), m)


def wave_sums(p: torch.Tensor, *, far_first: bool = False) -> torch.Tensor:
    """Each wave's fp32 sum of a tile's P [R, 256] (token = w*64 + a*16 + r*4 + j), [R, 4]:
    each lane (w, r) adds its 4-token chunks a in order (each chunk summed in order), then
    the 4 quarter-wave lanes r combine by a butterfly: (r0 + r1) + (r2 + r3) when the lane
    shuffle xor 16 comes first (``pa_decode_tile``), (r0 + r2) + (r1 + r3) when xor 32
    does (``far_first``, ``pa_decode_swa``)."""
    x = p.reshape(p.shape[0], 4, 4, 4, 4)  # [R, w, a, r, j]
    chunk = ((x[..., 0] + x[..., 1]) + x[..., 2]) + x[..., 3]  # [R, w, a, r]
    ls = torch.zeros_like(chunk[:, :, 0])
    for a in range(4):
        ls = ls + chunk[:, :, a]
    if far_first:
        return (ls[..., 0] + ls[..., 2]) + (ls[..., 1] + ls[..., 3])
    return (ls[..., 0] + ls[..., 1]) + (ls[..., 2] + ls[..., 3])  # [R, w]


def lane_sum(p: torch.Tensor) -> torch.Tensor:
    """The tile kernel's fp32 sum of a tile's P [R, 256]: ``wave_sums``, then the waves in
    order w0..w3."""
    ls = wave_sums(p)
    return ((ls[:, 0] + ls[:, 1]) + ls[:, 2]) + ls[:, 3]


def _tile_step(state, s_raw, valid, ks_tok, vs_tok, v8, scale, *, ver: DecodeVersion,
               multi: bool, per_token: bool, args: list | None = None):
    """One 256-token tile for all rows of a CTA; ``state`` = (m, l, o), updated in place
    order; returns the new state and the tile's packed P. ``args``, a list, receives the
    largest finite argument per row of the step's exp2 calls (P's and the correction's)."""
    m_prev, l_prev, o_prev = state
    s = s_raw * ks_tok[None, :] if per_token else s_raw
    inf_path = multi and ver.split_mtile_inf
    masked = torch.where(valid, s, float("-inf") if inf_path else MASK_SENTINEL)
    wave_max = _maxnum(masked.reshape(-1, 4, 64), 2) * scale[:, None]  # [R, 4 waves]
    m_new = fmax(m_prev, _maxnum(wave_max, 1))
    if inf_path:
        base = torch.where(m_new > float("-inf"), m_new, 0.0)
        p_arg = masked * scale[:, None] - base[:, None]
        c_arg = torch.where(m_prev > float("-inf"), m_prev, 0.0) - base
    else:
        p_arg = masked * scale[:, None] - m_new[:, None]
        c_arg = m_prev - m_new
    p = exp2(p_arg)
    if not inf_path and ver.remask_p and not multi:
        p = torch.where(masked > REMASK_BELOW, p, 0.0)
    corr = exp2(c_arg)
    if args is not None:
        low = torch.full_like(c_arg, float("-inf"))
        fin = torch.where(torch.isfinite(p_arg), p_arg, float("-inf")).amax(-1)
        args.append(torch.maximum(fin, torch.where(torch.isfinite(c_arg), c_arg, low)))
    gsum = lane_sum(p)
    if per_token:
        vmax = _vmax(vs_tok, valid, ver)  # [R]
        vmax_scaled = vmax * f32(1.0 / E4M3_MAX)
        norm = 1.0 / (vmax_scaled + f32(V_SCALE_EPS / E4M3_MAX))
        p8 = e4m3((p * vs_tok[None, :]) * norm[:, None], saturate=False)
        op = exact_dot(p8, v8) * vmax_scaled[:, None]
    else:
        p8 = e4m3(p * E4M3_MAX, saturate=False)
        op = exact_dot(p8, v8)
    l_new = l_prev * corr + gsum
    o_new = o_prev * corr[:, None] + op
    return (m_new, l_new, o_new), p8


def p_cast_gap(m_new, s_raw, valid, ks_tok, vs_tok, scale, *, ver: DecodeVersion) -> torch.Tensor:
    """Per row, the largest -log2(P w) over the tile's valid tokens, in closed form: ``(m_new
    - x) - log2 w`` with x the token's score in log2 units (fp32, as the kernel scales it)
    and w the factor P meets before its e4m3 cast (448 per tensor; ``v_scale[t] * norm``
    per token). The cast rounds P w to 0 from a gap of 10 (2^-10, the tie, goes to the even
    0) and to a subnormal above 6; -inf for a row with no valid token. A token whose V
    scale is 0 carries no value and is left out (``fa_lab.kernels.pa_decode.bound``)."""
    per_token = ks_tok is not None
    s = s_raw * ks_tok[None, :] if per_token else s_raw
    x = (s * scale[:, None]).double()
    d = m_new.double()[:, None] - x
    if per_token:
        vmax = _vmax(vs_tok, valid, ver)
        norm = 1.0 / (vmax * f32(1.0 / E4M3_MAX) + f32(V_SCALE_EPS / E4M3_MAX))
        w = (vs_tok[None, :] * norm[:, None]).double()
        keep = valid & (w > 0)
        gap = d - torch.log2(torch.where(w > 0, w, 1.0))
    else:
        keep, gap = valid, d - math.log2(E4M3_MAX)
    return torch.where(keep, gap, float("-inf")).amax(dim=1)


def _vmax(vs_tok: torch.Tensor, valid: torch.Tensor, ver: DecodeVersion) -> torch.Tensor:
    """The tile's largest V scale (and 0), per row: over all 256 tokens (main), or over
    the tokens valid for the M-tile's race row (before 985c653a)."""
    rows = valid.shape[0]
    zero = torch.zeros((), dtype=torch.float32)
    if not ver.vmax_valid_only:
        return fmax(_maxnum(vs_tok, 0), zero).expand(rows)
    race = (torch.arange(rows) // MTILE_ROWS) * MTILE_ROWS + VMAX_RACE_ROW
    sel = torch.where(valid[race], vs_tok[None, :], 0.0)
    return fmax(_maxnum(sel, 1), zero)


def forward(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
            value_scale, *, softmax_scale: float, num_partitions: int, version: DecodeVersion,
            out_dtype: torch.dtype, recorder: dict | None = None) -> torch.Tensor:
    """The decode on checked inputs (``fa_lab.decode`` checks them): returns the output
    [num_seqs * QL, Hq, D] in ``out_dtype``. ``recorder``, a dict, receives per
    partition ``pmax``, ``psum`` [num_seqs, Hkv, NP, rows] and ``pout`` [..., D] as the
    kernel stores them, ``first_max`` (the running max, log2 units, after the first tile
    of the partition in which the row sees a token; -inf where it sees none),
    ``exp2_arg`` (the largest finite argument of the partition's exp2 calls, P's and the
    correction's, per row: fp32's exp2 overflows from 128 on), the tile
    ranges (``tiles``), and the reduce's ``global_max``,
    ``part_scale``, ``weights`` (``reduce.split_reduce``) when NP > 1; ``p_cast_gap`` (per
    partition and row, float64: ``p_cast_gap``'s largest over the partition's tiles)."""
    num_seqs = context_lengths.shape[0]
    ql = query.shape[0] // num_seqs
    hq, d = query.shape[1], query.shape[2]
    hkv, bs = key_cache.shape[1], key_cache.shape[3]
    group = hq // hkv
    rows = ql * group
    multi = rows > MTILE_ROWS
    per_token = key_scale.dim() > 1
    k_all, v_all = logical_kv(key_cache, value_cache)
    rnd = round_to(out_dtype) if out_dtype != torch.float32 else (lambda x: x)
    scale_qk = f32(softmax_scale * LOG2E)
    if not per_token:
        scale_qk = f32(scale_qk * f32(float(key_scale.reshape(-1)[0])))
        v_scale = f32(float(value_scale.reshape(-1)[0]))
    npart = num_partitions
    out = torch.empty(num_seqs * ql, hq, d, dtype=torch.float32)
    pmax = torch.empty(num_seqs, hkv, npart, rows)
    psum = torch.empty_like(pmax)
    first_max = torch.empty_like(pmax)
    gap = torch.full_like(pmax, float("-inf"), dtype=torch.float64)
    exp2_arg = torch.full_like(pmax, float("-inf"))
    pout = torch.empty(num_seqs, hkv, npart, rows, d)
    tiles = []
    for seq in range(num_seqs):
        ctx = int(context_lengths[seq])
        bounds = torch.tensor(row_bounds(ctx, ql, group))
        ranges = partition_tiles(ctx, npart)
        tiles.append(ranges)
        for h in range(hkv):
            q = query[seq * ql:(seq + 1) * ql, h * group:(h + 1) * group].float().reshape(rows, d)
            q8, qs = quantize_q(q)
            scale = scale_qk * qs
            for p, (t0, t1) in enumerate(ranges):
                state = (torch.full((rows,), float("-inf")), torch.zeros(rows), torch.zeros(rows, d))
                first = torch.full((rows,), float("-inf"))
                args: list | None = [] if recorder is not None else None
                for tt in range(t0, t1):
                    pages = tile_pages(block_tables, seq, tt, bs)
                    slot = torch.arange(TILE_TOK) % bs
                    k8, v8 = k_all[pages, h, slot], v_all[pages, h, slot]
                    tok = tt * TILE_TOK + torch.arange(TILE_TOK)
                    valid = tok[None, :] < bounds[:, None]
                    ks = key_scale[pages, h, slot] if per_token else None
                    vs = value_scale[pages, h, slot] if per_token else None
                    s_raw = exact_dot(q8, k8.T)
                    state, _ = _tile_step(state, s_raw, valid, ks, vs, v8, scale,
                                          ver=version, multi=multi, per_token=per_token,
                                          args=args)
                    if recorder is not None:
                        gap[seq, h, p] = torch.maximum(gap[seq, h, p], p_cast_gap(
                            state[0], s_raw, valid, ks, vs, scale, ver=version))
                    seen = valid.any(dim=1) & (first == float("-inf"))
                    first = torch.where(seen, state[0], first)
                m, l, o = state
                inv_l = 1.0 / torch.where(l > 0, l, 1.0)
                if version.epilogue_l_first:
                    o_scale = inv_l if per_token else inv_l * f32(v_scale * f32(1.0 / E4M3_MAX))
                    o_norm = rnd(o * o_scale[:, None])
                else:
                    o_v = o if per_token else o * f32(v_scale * f32(1.0 / E4M3_MAX))
                    o_norm = rnd(o_v * inv_l[:, None])
                pout[seq, h, p] = o_norm
                first_max[seq, h, p] = first
                if args:
                    exp2_arg[seq, h, p] = torch.stack(args).amax(0)
                pmax[seq, h, p] = m * f32(1.0 / LOG2E) if version.pmax_natural else m
                psum[seq, h, p] = l
            if npart == 1:
                res = pout[seq, h, 0]
            else:
                red = {} if recorder is not None else None
                res = rnd(split_reduce(pmax[seq, h], psum[seq, h], pout[seq, h], recorder=red))
                if red is not None:
                    for key, val in red.items():
                        recorder.setdefault(key, torch.empty(num_seqs, hkv, *val.shape))[seq, h] = val
            out[seq * ql:(seq + 1) * ql, h * group:(h + 1) * group] = res.reshape(ql, group, d)
    if recorder is not None:
        recorder.update(pmax=pmax, psum=psum, pout=pout, tiles=tiles, first_max=first_max,
                        p_cast_gap=gap, exp2_arg=exp2_arg,
                        pmax_units="natural" if version.pmax_natural else "log2")
    return out.to(out_dtype)


def head_dim_ok(d: int) -> bool:
    """Upstream's head-dim rule (l.81-89): a multiple of 64."""
    return d >= 64 and d % 64 == 0


