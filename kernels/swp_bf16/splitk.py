"""Split-K for the fast bf16/f16 kernel: ``swp_bf16.fast.forward(..., num_kv_splits=S)``.

The KV walk of each query block is cut where the model cuts it
(``fa_lab.kernels.swp_bf16.model.split_ranges`` on the N 64-column tiles of the 256-row block that
holds the rows; causal blocks have their own N), so the splits hold whole 128-column
multiples and may be empty. One program per (query block, batch x head, split) walks its
split's columns with the dense kernel's ``walk`` (``_triton.fast``): the split's first
tile sets the base (a prologue of its own), and the lazy vote (per 32-row wave, the same
threshold) runs from there. Each split stores, as the model does, its O normalised by its
own l and rounded to the input dtype, with fp32 m and l; an empty split stores O = 0,
m = -1e30, l = 0. A second small kernel combines them: ``m_max = fmax_s m_s``,
``w_s = exp2(m_s - m_max)`` where ``l_s > 0`` (else 0),
``out = round(sum w_s l_s O_s / sum w_s l_s)``, ``lse = m_max ln 2 + ln(sum w_s l_s)``
(-inf when the sum is 0).

Not the model's either (as the dense kernel): its own tiling inside a split, no always-eager
last three tiles per split, the tensor cores' summation order.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from fa_lab.kernels._common.geometry import BLOCK_N as MODEL_BLOCK_N
from fa_lab.kernels._common.geometry import tiles_for_block
from fa_lab.kernels.swp_bf16.model import split_ranges

from .._triton import fast as common
from .._triton.fast import BF16_CONFIGS, SPLIT_ROW_BLOCK, load_q, lse, normalise, walk
from .._triton.util import fmax

#: The combine's rows per program: a memory-bound pass over S partial outputs (16 rows x
#: D 128 keep 4 warps far from spilling; 64 rows would not).
COMBINE_BLOCK_M = 16
_ROW_BLOCK = tl.constexpr(SPLIT_ROW_BLOCK)


@triton.jit(do_not_specialize=["H", "GROUP", "seqlen_q", "seqlen_kv", "num_splits", "rebase"])
def _attn_fwd_split(Q, K, V, Opart, Mpart, Lpart, Ranges, desc_k, desc_v,
                    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                    stride_vb, stride_vs, stride_vh, stride_pp, stride_pb, stride_ps, stride_ph,
                    H, GROUP, seqlen_q, seqlen_kv, num_splits, scale_log2, threshold,
                    vote_limit, rebase,
                    D: tl.constexpr, CAUSAL: tl.constexpr, LAZY: tl.constexpr,
                    INTERPRET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    USE_TMA: tl.constexpr, ROW_SUM_FILTER: tl.constexpr):
    DTYPE: tl.constexpr = Q.dtype.element_ty
    b, h, hk, m0, rows = common.program_rows(H, GROUP, BLOCK_M, CAUSAL)
    split = tl.program_id(2)
    row_ok = rows < seqlen_q

    # [c0, c1): this split's columns in the model's 256-row block holding these rows
    r = Ranges + ((m0 // _ROW_BLOCK) * num_splits + split) * 2
    c0 = tl.load(r)
    c1 = tl.load(r + 1)
    # An empty split walks one fully masked tile (no branch around the walk: it would cost
    # registers); the floored base then gives l = 0 and O = 0, and m is set as the model's.
    qs = load_q(Q + b.to(tl.int64) * stride_qb + h * stride_qh, stride_qs, rows, row_ok,
                scale_log2, D, DTYPE, INTERPRET)
    acc, l, m = walk(qs, desc_k, desc_v, K + b.to(tl.int64) * stride_kb + hk * stride_kh,
                     V + b.to(tl.int64) * stride_vb + hk * stride_vh, stride_ks, stride_vs,
                     b * seqlen_kv, hk * D, c0, tl.minimum(c1, seqlen_kv), m0, rows,
                     seqlen_kv - seqlen_q, threshold, vote_limit, rebase, DTYPE, D,
                     BLOCK_M, BLOCK_N, CAUSAL, LAZY, USE_TMA, INTERPRET, ROW_SUM_FILTER, True)
    m = tl.where(c1 > c0, m, -1e30)
    out = normalise(acc, l, DTYPE, INTERPRET)
    o_ptrs = (Opart + split.to(tl.int64) * stride_pp + b.to(tl.int64) * stride_pb + h * stride_ph
              + rows.to(tl.int64)[:, None] * stride_ps + tl.arange(0, D)[None, :])
    tl.store(o_ptrs, out.to(Opart.dtype.element_ty), mask=row_ok[:, None])
    ml = (split * tl.num_programs(1) + b * H + h).to(tl.int64) * seqlen_q + rows
    tl.store(Mpart + ml, m, mask=row_ok)
    tl.store(Lpart + ml, l, mask=row_ok)


@triton.jit(do_not_specialize=["H", "seqlen_q", "num_splits"])
def _combine(Opart, Mpart, Lpart, Out, Lse, stride_pp, stride_pb, stride_ps, stride_ph,
             stride_ob, stride_os, stride_oh, H, seqlen_q, num_splits,
             D: tl.constexpr, BLOCK_M: tl.constexpr, INTERPRET: tl.constexpr):
    DTYPE: tl.constexpr = Out.dtype.element_ty
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < seqlen_q
    ml = bh.to(tl.int64) * seqlen_q + rows
    ml_step = tl.num_programs(1).to(tl.int64) * seqlen_q  # one split further
    m_max = tl.load(Mpart + ml, mask=row_ok, other=0.0)
    for s in range(1, num_splits):
        m_max = fmax(m_max, tl.load(Mpart + s * ml_step + ml, mask=row_ok, other=0.0))
    o_ptrs = (Opart + b.to(tl.int64) * stride_pb + h * stride_ph
              + rows.to(tl.int64)[:, None] * stride_ps + tl.arange(0, D)[None, :])
    den = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    for s in range(num_splits):
        m_s = tl.load(Mpart + s * ml_step + ml, mask=row_ok, other=0.0)
        l_s = tl.load(Lpart + s * ml_step + ml, mask=row_ok, other=0.0)
        o_s = tl.load(o_ptrs + s * stride_pp, mask=row_ok[:, None], other=0.0).to(tl.float32)
        wl = tl.where(l_s > 0, tl.math.exp2(m_s - m_max) * l_s, 0.0)
        den += wl
        acc += wl[:, None] * o_s
    out = normalise(acc, den, DTYPE, INTERPRET)
    out_ptrs = (Out + b.to(tl.int64) * stride_ob + h * stride_oh
                + rows.to(tl.int64)[:, None] * stride_os + tl.arange(0, D)[None, :])
    tl.store(out_ptrs, out.to(DTYPE), mask=row_ok[:, None])
    tl.store(Lse + bh.to(tl.int64) * seqlen_q + rows, lse(den, m_max), mask=row_ok)


_TUNED = common.autotuners(_attn_fwd_split, BF16_CONFIGS,
                           ["seqlen_q", "seqlen_kv", "H", "GROUP", "num_splits", "D", "CAUSAL"],
                           common.set_block_shapes, row_sum_filters=(True,))


def split_columns(seqlen_q: int, seqlen_kv: int, causal: bool, num_splits: int) -> list:
    """Per 256-row query block, each split's KV columns [c0, c1): the model's
    ``split_ranges`` on that block's tile count, in columns (c1 may pass Skv: padding)."""
    n_blocks = triton.cdiv(seqlen_q, SPLIT_ROW_BLOCK)
    return [[(t0 * MODEL_BLOCK_N, t1 * MODEL_BLOCK_N)
             for t0, t1 in split_ranges(tiles_for_block(i * SPLIT_ROW_BLOCK, seqlen_q, seqlen_kv,
                                                        causal), num_splits)]
            for i in range(n_blocks)]


@functools.lru_cache(maxsize=64)
def _ranges(seqlen_q: int, seqlen_kv: int, causal: bool, num_splits: int, device: str):
    """``split_columns`` as an int32 [blocks, S, 2] tensor on ``device`` (cached: a launch
    should not pay a host-to-device copy each time)."""
    cols = split_columns(seqlen_q, seqlen_kv, causal, num_splits)
    return torch.tensor(cols, dtype=torch.int32, device=device)


def run(q, k, v, *, causal: bool, policy, interpret: bool, config, num_splits: int):
    """Split-K on checked, contiguous inputs (``swp_bf16.fast.forward`` checks them)."""
    B, Sq, H, D = q.shape
    Skv, Hkv = k.shape[1], k.shape[2]
    ranges = _ranges(Sq, Skv, causal, num_splits, str(q.device))
    o_part = torch.empty((num_splits, B, Sq, H, D), device=q.device, dtype=q.dtype)
    m_part = torch.empty((num_splits, B * H, Sq), device=q.device, dtype=torch.float32)
    l_part = torch.empty_like(m_part)
    desc_k, desc_v = common.descriptors(k.view(B * Skv, Hkv * D), v.view(B * Skv, Hkv * D), D, config)
    part_strides = (o_part.stride(0), o_part.stride(1), o_part.stride(2), o_part.stride(3))
    args = (q, k, v, o_part, m_part, l_part, ranges, desc_k, desc_v,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), *part_strides,
            H, H // Hkv, Sq, Skv, num_splits, *common.policy_args(policy, D))
    meta = dict(D=D, CAUSAL=causal, LAZY=policy.lazy, INTERPRET=interpret)
    common.launch_fast(_attn_fwd_split, _TUNED,
                       lambda bm: (triton.cdiv(Sq, bm), B * H, num_splits), args, meta,
                       config, interpret)

    out = torch.empty_like(q)
    lse = torch.empty(B, H, Sq, device=q.device, dtype=torch.float32)
    grid = (triton.cdiv(Sq, COMBINE_BLOCK_M), B * H)
    args = (o_part, m_part, l_part, out, lse, *part_strides,
            out.stride(0), out.stride(1), out.stride(2), H, Sq, num_splits)
    meta = dict(D=D, BLOCK_M=COMBINE_BLOCK_M, INTERPRET=interpret)
    if interpret:
        common.run_interpreted(_combine, grid, *args, **meta)
    else:
        _combine[grid](*args, **meta, num_warps=4)
    return out, lse


def best_config(q, k, causal: bool, lazy: bool, num_splits: int):
    """The tuner's pick for these shapes (after a forward ran), or None."""
    B, Sq, H, D = q.shape
    return common.tuned_config(_TUNED[lazy], (Sq, k.shape[1], H, H // k.shape[2], num_splits, D,
                                              causal))


def tuning_timings(lazy: bool) -> list[dict]:
    """The tuner's measurements at its last new key (for the benchmark's record)."""
    return common.tuning_timings(_TUNED[lazy])
