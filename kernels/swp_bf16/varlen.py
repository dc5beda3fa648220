"""Varlen (packed) batches for the fast bf16/f16 kernel, in one launch.

q is ``[total_q, H, D]``, k and v ``[total_kv, Hkv, D]``; sequence b owns q rows
``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and the matching kv rows (int32 offsets, as upstream
and ``fa_lab.varlen`` take them). The grid is (query blocks of the longest sequence,
B x H); each program reads its sequence's offsets and lengths from the two offset tensors
and runs the dense kernel's ``walk`` (``_triton.fast``) on that sequence alone, so blocks,
the causal diagonal (bottom-right, within the sequence) and the 32-row waves all start at
the sequence's first row: a varlen call computes exactly what one dense call per sequence
would, with the same tiling. The LSE comes back as ``[B, H, max_seqlen_q]``, -inf past
each sequence's end (``fa_lab.varlen``'s layout); a sequence without keys gives out 0 and
lse -inf.

TMA descriptors view K and V as [total_kv, Hkv * D]: a ragged last tile reads the next
sequence's rows, masked as the dense kernel masks the next batch's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fa_lab import varlen
from fa_lab.capabilities import check_policy
from fa_lab.policies import Policy

from . import FAMILY
from .._triton import fast as common
from .._triton.fast import (BF16_CONFIGS, BF16_DTYPES, BF16_HEAD_DIMS, BF16_INTERPRET_CONFIG,
                            Config, load_q, lse, normalise, walk)
from .._triton.util import GRID_Y_MAX


@triton.jit(do_not_specialize=["H", "GROUP", "max_seqlen_q", "max_seqlen_kv", "rebase"])
def _attn_fwd_varlen(Q, K, V, Out, Lse, CuQ, CuKV, desc_k, desc_v,
                     stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_ot, stride_oh, H, GROUP, max_seqlen_q, max_seqlen_kv,
                     scale_log2, threshold, vote_limit, rebase,
                     D: tl.constexpr, CAUSAL: tl.constexpr, LAZY: tl.constexpr,
                     INTERPRET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     USE_TMA: tl.constexpr, ROW_SUM_FILTER: tl.constexpr):
    # max_seqlen_kv is only the tuner's key
    DTYPE: tl.constexpr = Q.dtype.element_ty
    b, h, hk, m0, rows = common.program_rows(H, GROUP, BLOCK_M, CAUSAL)  # b: the sequence
    q_start = tl.load(CuQ + b)
    seqlen_q = tl.load(CuQ + b + 1) - q_start
    kv_start = tl.load(CuKV + b)
    seqlen_kv = tl.load(CuKV + b + 1) - kv_start
    row_ok = rows < seqlen_q
    # A block past its sequence's end, or of a sequence without keys, walks one fully masked
    # tile and stores LSE padding (-inf) only (no early return: that would cost registers).
    kv_hi = tl.where(m0 < seqlen_q, seqlen_kv, 0)
    qs = load_q(Q + q_start.to(tl.int64) * stride_qt + h * stride_qh, stride_qt, rows, row_ok,
                scale_log2, D, DTYPE, INTERPRET)
    acc, l, m = walk(qs, desc_k, desc_v, K + kv_start.to(tl.int64) * stride_kt + hk * stride_kh,
                     V + kv_start.to(tl.int64) * stride_vt + hk * stride_vh, stride_kt, stride_vt,
                     kv_start, hk * D, 0, kv_hi, m0, rows, seqlen_kv - seqlen_q,
                     threshold, vote_limit, rebase, DTYPE, D, BLOCK_M, BLOCK_N, CAUSAL, LAZY,
                     USE_TMA, INTERPRET, ROW_SUM_FILTER, CAUSAL)
    keys = kv_hi > 0  # else (non-causal) that masked tile left m = -inf and NaN in O and l
    acc = tl.where(keys, acc, 0.0)
    l = tl.where(keys, l, 0.0)
    out = normalise(acc, l, DTYPE, INTERPRET)
    o_ptrs = (Out + (q_start + rows).to(tl.int64)[:, None] * stride_ot + h * stride_oh
              + tl.arange(0, D)[None, :])
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    tl.store(Lse + (b * H + h).to(tl.int64) * max_seqlen_q + rows,
             tl.where(row_ok, lse(l, m), float("-inf")), mask=rows < max_seqlen_q)


_TUNED = common.autotuners(_attn_fwd_varlen, BF16_CONFIGS,
                           ["max_seqlen_q", "max_seqlen_kv", "H", "GROUP", "D", "CAUSAL"],
                           common.set_block_shapes, row_sum_filters=(True,))


def _check_packed(q, k, v) -> None:
    """q [total_q, H, D], k and v [total_kv, Hkv, D]: the dense check on [1, total, H, D]
    views, after the rank (so that its messages name the right shapes)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"varlen {name} must be packed [total, H, D], got shape {tuple(t.shape)}")
    common.check_qkv(q[None], k[None], v[None], BF16_DTYPES, BF16_HEAD_DIMS)


def forward_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   cu_seqlens_q: torch.Tensor, cu_seqlens_kv: torch.Tensor, max_seqlen_q: int,
                   max_seqlen_kv: int | None = None, *, causal: bool, policy: Policy,
                   interpret: bool = False, config: Config | None = None):
    """Packed q [total_q, H, D], k and v [total_kv, Hkv, D] (bf16 or f16, D 64 or 128);
    ``cu_seqlens_q`` / ``cu_seqlens_kv`` int32 [B+1] on q's device; ``max_seqlen_q`` (and
    ``max_seqlen_kv``, required when a sequence's q and kv lengths differ) at least the
    longest sequence. The offsets are checked on the host (one copy back from the GPU).
    Returns (out [total_q, H, D] in q's dtype, lse [B, H, max_seqlen_q] fp32, natural log,
    -inf past each sequence).
    """
    _check_packed(q, k, v)
    if cu_seqlens_q is None or cu_seqlens_kv is None:
        missing = "cu_seqlens_q" if cu_seqlens_q is None else "cu_seqlens_kv"
        raise ValueError(f"{missing} is required (int32 [B+1] sequence offsets)")
    packing = varlen.check(q, k, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    check_policy(policy, FAMILY, "fast")
    common.check_device(q, interpret)
    config = common.check_config(config, fp8=False)
    if config is None and interpret:
        config = BF16_INTERPRET_CONFIG
    B, (_, H, D), (total_kv, Hkv, _) = packing.batch, q.shape, k.shape
    if B * H > GRID_Y_MAX:
        raise ValueError(f"B * H = {B * H} exceeds the launch grid's limit {GRID_Y_MAX}")

    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    cu_q, cu_kv = cu_seqlens_q.contiguous(), cu_seqlens_kv.contiguous()
    max_q, max_kv = packing.max_seqlen_q, packing.max_seqlen_kv
    out = torch.empty_like(q)
    lse = torch.empty(B, H, max_q, device=q.device, dtype=torch.float32)
    desc_k, desc_v = common.descriptors(k.view(total_kv, Hkv * D), v.view(total_kv, Hkv * D), D, config)
    args = (q, k, v, out, lse, cu_q, cu_kv, desc_k, desc_v,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), H, H // Hkv, max_q, max_kv, *common.policy_args(policy, D))
    meta = dict(D=D, CAUSAL=causal, LAZY=policy.lazy, INTERPRET=interpret)
    common.launch_fast(_attn_fwd_varlen, _TUNED, lambda bm: (triton.cdiv(max_q, bm), B * H), args,
                       meta, config, interpret)
    return out, lse


def best_config(q, k, max_seqlen_q: int, max_seqlen_kv: int, causal: bool, lazy: bool):
    """The tuner's pick for these packed shapes (after a forward ran), or None."""
    H, D = q.shape[1], q.shape[2]
    return common.tuned_config(_TUNED[lazy], (max_seqlen_q, max_seqlen_kv, H, H // k.shape[1], D,
                                              causal))


def tuning_timings(lazy: bool) -> list[dict]:
    """The tuner's measurements at its last new key (for the benchmark's record)."""
    return common.tuning_timings(_TUNED[lazy])
