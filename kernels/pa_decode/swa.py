"""Exact model of FlyDSL's sliding-window paged-attention fp8 decode, ``compile_pa_decode_sw``
(docs/semantics.md §13), with the split reduce it launches (``reduce.py``).

References are to ROCm/FlyDSL ``kernels/attention/pa_decode_swa.py`` at main 11c4174d
(l.24-56 constants, l.134-170 the MTP rows, l.173-242 the Q quantization, l.289-636 one
tile's phases, l.1024-1447 the kernel) and its launcher ``pa_decode_fp8.pa_decode_ps_launch``
(l.235-262, l.333-455). The parent of 985c653a (20faaa4d, ``"flydsl-985c653a^"``) computes
the same (its ``needs_mask`` and ``per_token_q`` are both on for this kernel, l.1309-1311);
its launcher takes ``max_context_partition_num=0`` as "the recommended count" where main
refuses it (``DecodeVersion.sw_partitions_default``).

Geometry. Pages are 1024 tokens (``KV_BLOCK_SIZE``, fixed whatever the cache's shape says),
K [num_blocks, Hkv, D // 16, 1024, 16], V [num_blocks, Hkv, 64, D, 16] (``trans_v``) or
[num_blocks, Hkv, D, 1024]; D is 64 or 128. With W = ``sliding_window`` and QL query
positions, row r = qi * G + g sees tokens t with ``lo(r) <= t < hi(r)``:
  hi = ctx + 1 - QL + qi,  lo = ctx - QL - W + qi      (W + 1 tokens: itself and W before)
The visible tiles start at ``tail = max(ctx - QL - W, 0) // 256`` and end at
``ceil(ctx / 256)``. CTA (seq, kv head, partition p) runs ONE 256-token tile,
``tail + p``, when ``p < visible`` (page ``block_tables[seq, tile // 4]``, tokens
``(tile % 4) * 256 ..`` of it); otherwise it writes an empty partition (sum 0, max -inf,
output 0) without reading anything. Tiles past ``tail + NP - 1`` are never computed: a
caller's ``max_context_partition_num`` below the visible count drops the window's newest
tiles. With NP = 1 (the fused path) the CTA runs tile ``tail`` only and writes the output
itself; with no visible tile (ctx = 0) it runs tile 0 of page ``block_tables[seq, 0]`` with
the context taken as 0, so ``hi = 1 - QL + qi <= 0``: every token masked, the output 0
(where the partitioned path's reduce gives NaN: every partition's max is -inf).

Per tile (l.466-627), all in natural-log units:
  q8 = e4m3(q * rcp(qs)), qs = absmax(q) * f32(1/240) if absmax > 0 else 1
  S = q8 . k8 * f32(f32(qs * sm) * k_scale) (per tensor) or * f32(k_scale[t] * f32(qs * sm))
  masked = S inside the window, else -inf (no finite sentinel)
  wave max m_w over its 64 tokens; P = exp2((masked - (m_w if m_w > -inf else 0)) * f32(log2 e))
  wave sums s_w (lane order, then a butterfly xor 32 before xor 16)
  M = max_w m_w; f_w = exp2(((m_w - M) if M > -inf else 0) * f32(log2 e))
  sum = s_0 f_0 + s_1 f_1 + s_2 f_2 + s_3 f_3 (from 0, in order); c = 1 if M > -inf else 0
  per tensor: P8 = e4m3(P * f32(f_w * c)), PV scaled by v_scale: P enters the cast in
      (0, 1], with no headroom scale (subnormals below 2**-6, zero below 2**-10);
  per token: P8 = e4m3(P * f32(v_scale[t] * f32(f_w * norm))), norm = rcp(vmax * f32(1/240)
      + f32(1e-8/240)), vmax = max(0, v_scale[t] for t < ctx) over the tile (not the
      window: tokens before the window's start count), PV scaled by vmax/240 * c;
  out = bf16((PV * scale) * rcp(sum if sum > 0 else 1)); stored max = M, sum = sum * c.
The partial outputs are bf16 whatever the output's dtype (l.1136-1137, l.1270); the fused
path writes bf16 into the output too. Maxima are IEEE ``maximum`` (``arith.maximumf``:
NaN propagates). Every P8 multiplies its V in the PV product, masked tokens too: a NaN V
(or a NaN per-token V scale) anywhere in a visible tile's 256 tokens is NaN in every row.

Conventions as ``model.py``: one IEEE fp32 operation each (the ``contract`` flags of the
cross-wave sums are not applied), dots exact then rounded once, exp2 and rcp correctly
rounded (upstream's are the fast ``v_exp_f32``/``v_rcp_f32``).
"""

from __future__ import annotations

import torch

from fa_lab.numerics import e4m3, exact_dot, exp2, f32, round_to
from fa_lab.upstream import DecodeVersion

from .model import LOG2E, TILE_TOK, logical_kv, row_bounds, wave_sums
from .reduce import split_reduce

PAGE = 1024                 # KV_BLOCK_SIZE: the only page size the kernel addresses
TILES_PER_PAGE = PAGE // TILE_TOK
FP8_RANGE = 240.0           # FP8_MAX: Q's and per-token P's target range
HEAD_DIMS = (64, 128)
NEG_INF = float("-inf")


def visible_tiles(context_len: int, query_length: int, window: int) -> tuple[int, int]:
    """(first visible tile, number of visible tiles) of one sequence (l.1188-1193)."""
    start = max(context_len - query_length - window, 0)
    tail = start // TILE_TOK
    return tail, -(-context_len // TILE_TOK) - tail


def recommended_partitions(window: int, query_length: int) -> int:
    """``get_recommended_splits`` with a window (``pa_decode_fp8.py`` l.252-254): the
    most tiles a span of W + QL tokens can touch."""
    return -(-(window + query_length - 1) // TILE_TOK) + 1


def partition_tiles(context_len: int, query_length: int, window: int,
                    num_partitions: int) -> list[int | None]:
    """The tile each partition runs (None: an empty partition, nothing read). NP = 1 is
    the fused path: tile ``tail``, or tile 0 with the context taken as 0 when none is
    visible (``fused_context``)."""
    tail, vis = visible_tiles(context_len, query_length, window)
    if num_partitions == 1:
        return [tail if vis > 0 else 0]
    return [tail + p if p < vis else None for p in range(num_partitions)]


def fused_context(context_len: int, query_length: int, window: int) -> int:
    """The context length the fused path masks with: 0 when no tile is visible."""
    return context_len if visible_tiles(context_len, query_length, window)[1] > 0 else 0


def dropped_tiles(context_len: int, query_length: int, window: int, num_partitions: int) -> int:
    """Visible tiles that no partition runs (the window's newest)."""
    return max(0, visible_tiles(context_len, query_length, window)[1] - num_partitions)


def quantize_q(q: torch.Tensor):
    """Per-row fp8 quantization of Q (l.186-216): (q8, qs), q [R, D] fp32; NaN rows stay
    NaN (their scale falls back to 1, the max's compare being false)."""
    absmax = q.abs().amax(dim=1)
    qs = torch.where(absmax > 0, absmax * f32(1.0 / FP8_RANGE), 1.0)
    return e4m3(q * (1.0 / qs)[:, None], saturate=False), qs


def _maximum(x: torch.Tensor, dim: int, start: float) -> torch.Tensor:
    """IEEE maximum over ``dim`` from ``start``: NaN wherever an entry is NaN."""
    m = x.amax(dim=dim).clamp_min(start)
    return torch.where(x.isnan().any(dim=dim), float("nan"), m)


def tile(q8, qk_scale, k8, v8, ks, vs, tok, lo, hi, seq_end, *, per_token: bool,
         k_scale: float, v_scale: float):
    """One CTA's tile for the rows [R]: returns (out [R, D] before its bf16 store, max, sum),
    out normalized by the sum. ``qk_scale`` [R] = f32(qs * sm); ``tok`` [256] the tile's
    token indices, ``lo``/``hi`` [R] the window, ``seq_end`` the context the V-scale max
    reads up to; ``ks``/``vs`` [256] per-token scales (None per tensor)."""
    rows = q8.shape[0]
    acc = exact_dot(q8, k8.T)
    if per_token:
        s = acc * (ks[None, :] * qk_scale[:, None])
    else:
        s = acc * (qk_scale * f32(k_scale))[:, None]
    inside = (tok[None, :] < hi[:, None]) & (tok[None, :] >= lo[:, None])
    masked = torch.where(inside, s, NEG_INF)
    wave_max = _maximum(masked.reshape(rows, 4, 64), 2, NEG_INF)  # [R, w]
    safe = torch.where(wave_max > NEG_INF, wave_max, 0.0)
    p = exp2((masked - safe.repeat_interleave(64, dim=1)) * f32(LOG2E))
    wsum = wave_sums(p, far_first=True)
    pmax = _maximum(wave_max, 1, NEG_INF)
    diff = torch.where(pmax[:, None] > NEG_INF, wave_max - pmax[:, None], 0.0)
    wf = exp2(diff * f32(LOG2E))
    psum = torch.zeros(rows)
    for w in range(4):
        psum = psum + wsum[:, w] * wf[:, w]
    alive = pmax > NEG_INF
    part_to_new = torch.where(alive, exp2((pmax - pmax) * f32(LOG2E)), 0.0)
    rsum = 0.0 * 0.0 + psum * part_to_new  # the running sum from (max -inf, sum 0)
    wf_tok = wf.repeat_interleave(64, dim=1)  # [R, 256]: each token's wave factor
    if per_token:
        vmax = _maximum(torch.where(tok < seq_end, vs, 0.0), 0, 0.0)
        vmax_scaled = vmax * f32(1.0 / FP8_RANGE)
        norm = 1.0 / (vmax_scaled + f32(1e-8 / FP8_RANGE))
        p8 = e4m3(p * (vs[None, :] * (wf_tok * norm)), saturate=False)
        correction = (vmax_scaled * part_to_new)[:, None]
    else:
        p8 = e4m3(p * (wf_tok * part_to_new[:, None]), saturate=False)
        correction = f32(v_scale)
    out = exact_dot(p8, v8) * correction + 0.0 * 0.0
    inv = 1.0 / torch.where(rsum > 0, rsum, 1.0)
    return out * inv[:, None], pmax, rsum


def p_cast_gap(q8, qk_scale, k8, ks, vs, tok, lo, hi, seq_end, *, per_token: bool,
               k_scale: float) -> torch.Tensor:
    """Per row [R] of one tile, the largest -log2 of a windowed token's P times the factor
    it meets before its e4m3 cast, in closed form: P f_w = 2^((x - M) log2 e) per tensor
    (the wave's own max cancels), times v_scale[t] norm per token; so the gap is
    (M - x) log2 e, less log2(v_scale[t] norm) per token. The cast rounds to 0 from a gap
    of 10 and to a subnormal above 6 (no headroom: P f_w is in (0, 1]); -inf for a row
    with no token in the window; a token whose V scale is 0 carries no value and is left
    out (``bound.swa_region``)."""
    acc = exact_dot(q8, k8.T)
    if per_token:
        s = acc * (ks[None, :] * qk_scale[:, None])
    else:
        s = acc * (qk_scale * f32(k_scale))[:, None]
    inside = (tok[None, :] < hi[:, None]) & (tok[None, :] >= lo[:, None])
    big = torch.where(inside, s, NEG_INF).amax(dim=1)
    gap = (big.double()[:, None] - s.double()) * float(f32(LOG2E))
    keep = inside
    if per_token:
        vmax = _maximum(torch.where(tok < seq_end, vs, 0.0), 0, 0.0)
        norm = 1.0 / (vmax * f32(1.0 / FP8_RANGE) + f32(1e-8 / FP8_RANGE))
        w = (vs * norm).double()
        keep = inside & (w > 0)[None, :]
        gap = gap - torch.log2(torch.where(w > 0, w, 1.0))[None, :]
    return torch.where(keep, gap, NEG_INF).amax(dim=1)


def forward(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
            value_scale, *, softmax_scale: float, sliding_window: int, num_partitions: int,
            version: DecodeVersion, out_dtype: torch.dtype,
            recorder: dict | None = None) -> torch.Tensor:
    """The sliding-window decode on checked inputs (``fa_lab.decode`` checks them): the
    output [num_seqs * QL, Hq, D] in ``out_dtype``. ``recorder`` receives ``pmax`` (natural
    log units), ``psum`` [num_seqs, Hkv, NP, rows], ``pout`` [..., D] (bf16 values), the
    tile of each partition (``tiles``, None for an empty one), ``dropped`` (visible tiles
    no partition runs, per sequence), ``p_cast_gap`` (float64 [num_seqs, Hkv, NP, rows]:
    ``p_cast_gap`` of the partition's tile, -inf for an empty one) and, with NP > 1, the
    reduce's record."""
    del version  # main and the parent compute the same; only their launchers differ
    num_seqs = context_lengths.shape[0]
    ql = query.shape[0] // num_seqs
    hq, d = query.shape[1], query.shape[2]
    hkv = key_cache.shape[1]
    group = hq // hkv
    rows = ql * group
    per_token = key_scale.dim() > 1
    k_all, v_all = logical_kv(key_cache, value_cache)
    bf16 = round_to(torch.bfloat16)
    ksc = None if per_token else float(key_scale.reshape(-1)[0])
    vsc = None if per_token else float(value_scale.reshape(-1)[0])
    npart, w = num_partitions, sliding_window
    pmax = torch.full((num_seqs, hkv, npart, rows), NEG_INF)
    psum = torch.zeros(num_seqs, hkv, npart, rows)
    pout = torch.zeros(num_seqs, hkv, npart, rows, d)
    gap = torch.full((num_seqs, hkv, npart, rows), NEG_INF, dtype=torch.float64)
    out = torch.empty(num_seqs * ql, hq, d, dtype=torch.float32)
    qi = torch.arange(rows) // group
    tiles, dropped = [], []
    for seq in range(num_seqs):
        ctx = int(context_lengths[seq])
        ctx_m = fused_context(ctx, ql, w) if npart == 1 else ctx
        ranges = partition_tiles(ctx, ql, w, npart)
        tiles.append(ranges)
        dropped.append(dropped_tiles(ctx, ql, w, npart))
        hi = ctx_m + 1 - ql + qi
        lo = ctx_m - ql - w + qi
        for h in range(hkv):
            q = query[seq * ql:(seq + 1) * ql, h * group:(h + 1) * group].float().reshape(rows, d)
            q8, qs = quantize_q(q)
            qk_scale = qs * f32(softmax_scale)
            for p, tt in enumerate(ranges):
                if tt is None:
                    continue
                page = int(block_tables[seq, tt // TILES_PER_PAGE])
                slot = (tt % TILES_PER_PAGE) * TILE_TOK + torch.arange(TILE_TOK)
                tok = tt * TILE_TOK + torch.arange(TILE_TOK)
                ks = key_scale[page, h, slot] if per_token else None
                vs = value_scale[page, h, slot] if per_token else None
                o, m, l = tile(q8, qk_scale, k_all[page, h, slot], v_all[page, h, slot], ks, vs,
                               tok, lo, hi, ctx_m, per_token=per_token, k_scale=ksc, v_scale=vsc)
                pout[seq, h, p], pmax[seq, h, p], psum[seq, h, p] = bf16(o), m, l
                if recorder is not None:
                    gap[seq, h, p] = p_cast_gap(q8, qk_scale, k_all[page, h, slot], ks, vs, tok,
                                                lo, hi, ctx_m, per_token=per_token, k_scale=ksc)
            if npart == 1:
                res = pout[seq, h, 0]
            else:
                red = {} if recorder is not None else None
                res = split_reduce(pmax[seq, h], psum[seq, h], pout[seq, h], recorder=red)
                if red is not None:
                    for key, val in red.items():
                        recorder.setdefault(key, torch.empty(num_seqs, hkv, *val.shape))[seq, h] = val
            out[seq * ql:(seq + 1) * ql, h * group:(h + 1) * group] = res.reshape(ql, group, d)
    if recorder is not None:
        recorder.update(pmax=pmax, psum=psum, pout=pout, tiles=tiles, dropped=dropped,
                        pmax_units="natural", p_cast_gap=gap)
    rnd = round_to(out_dtype) if out_dtype != torch.float32 else (lambda x: x)
    return rnd(out).to(out_dtype)


def window_bounds(context_len: int, query_length: int, group: int, window: int):
    """(lo, hi) per row r = qi * group + g: the tokens lo <= t < hi it sees (the partitioned
    path; ``row_bounds`` gives hi)."""
    hi = row_bounds(context_len, query_length, group)
    return [b - 1 - window for b in hi], hi
