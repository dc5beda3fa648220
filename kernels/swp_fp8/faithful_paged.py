"""Faithful Triton port of FlyDSL #1066's paged fp8 prefill (the model: ``paged``;
docs/semantics.md §17).

One launch over the packed batch: a program owns one (sequence, head, group of waves of
one 256-row block). It reads its sequence's bounds from ``cu_seqlens_q`` and its key
count from ``seqlen_k``, and walks the dense fp8 kernel's tile pairs (the count per
256-row block cut at the bottom-right diagonal, rounded up to even, at least 4). Each KV
tile is one whole page of the vectorized cache, found through the block table inside the
kernel, two ids per tile pair as ``PagedFp8.page_ids`` says: K element (row r, dim d) of page p at
``[p, hk, d // 16, r, d % 16]``, V at ``[p, hk, r // 16, d, r % 16]``. Nothing is zeroed
on load: rows past seqlen_k are masked in S only, so what they hold in V meets P = 0.

The scores, the pair's decision and P's cast are the dense port's own pieces
(``faithful._masked_scores``, ``_decide_pair``, ``_p_fp8``), so the two ports cannot drift
apart; the exactness notes of ``faithful`` hold here too.
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from fa_lab.capabilities import check_policy
from fa_lab.checks import check_descale
from fa_lab.kernels._common.geometry import BLOCK_M as ROWS_PER_BLOCK
from fa_lab.kernels._common.geometry import BLOCK_N, WAVE_ROWS
from fa_lab.numerics import CAUSAL_FLOOR, LN2, f32
from fa_lab.paged import PagedFp8

from . import FAMILY
from .faithful import _decide_pair, _load_e4m3, _masked_scores, _p_fp8
from fa_lab.numerics import log2_scale
from .._triton.util import fmax as _fmax
from .._triton.util import check_launch, fma_via_fp64, launch, round_bf16
from .._triton.util import rows_per_program as _rows_per_program

_FP8 = torch.float8_e4m3fn
HEAD_DIM = 128


@triton.jit(do_not_specialize=["vote_code", "rebase_code", "saturate"])
def _paged_fwd_kernel(
    Q, K, V, Out, Lse, CuQ, SeqK, BlockTable,
    stride_qt, stride_qh, stride_qd,
    stride_k0, stride_k1, stride_k2, stride_k3, stride_k4,
    stride_v0, stride_v1, stride_v2, stride_v3, stride_v4,
    stride_ot, stride_oh, stride_od, stride_bt,
    H, GROUP, max_seqlen_q,
    ls, threshold, neg_bound, headroom, v_descale, ln2, causal_floor, vote_code, rebase_code,
    saturate, CAUSAL: tl.constexpr, FMA_VIA_FP64: tl.constexpr,
    BLOCK_M: tl.constexpr, WAVE: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, ROWS_PER_BLOCK: tl.constexpr, VEC: tl.constexpr,
):
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUP
    q_start = tl.load(CuQ + b)
    Sq = tl.load(CuQ + b + 1) - q_start
    Skv = tl.load(SeqK + b)

    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)  # the sequence's own (padded) query rows
    row_ok = rows < Sq
    offs_d = tl.arange(0, HEAD_DIM)
    offs_r = tl.arange(0, BLOCK_N)
    tok = (q_start + rows).to(tl.int64)
    q = _load_e4m3(Q + tok[:, None] * stride_qt + h.to(tl.int64) * stride_qh
                   + offs_d[None, :] * stride_qd, row_ok[:, None])

    # the tile count of this 256-row block, as the dense kernel's (geometry.tiles_for_block)
    blk0 = (pid * BLOCK_M) // ROWS_PER_BLOCK * ROWS_PER_BLOCK
    n_kv = (Skv + BLOCK_N - 1) // BLOCK_N
    t = n_kv
    if CAUSAL:
        end = tl.maximum(blk0 + ROWS_PER_BLOCK + Skv - Sq, 0)
        t = tl.minimum(t, (end + BLOCK_N - 1) // BLOCK_N)
    n_tiles = tl.maximum(t + t % 2, 4)
    n_pairs = tl.where(blk0 < Sq, n_tiles // 2, 0)

    k_head = K + hk.to(tl.int64) * stride_k1
    v_head = V + hk.to(tl.int64) * stride_v1
    k_offs = ((offs_d // VEC)[None, :] * stride_k2 + offs_r[:, None] * stride_k3
              + (offs_d % VEC)[None, :] * stride_k4)
    v_offs = ((offs_r // VEC)[:, None] * stride_v2 + offs_d[None, :] * stride_v3
              + (offs_r % VEC)[:, None] * stride_v4)
    whole = offs_r[:, None] >= 0  # a page is read whole

    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.full((BLOCK_M,), 0.0, tl.float32)
    O = tl.full((BLOCK_M, HEAD_DIM), 0.0, tl.float32)
    for p in range(0, n_pairs):
        t_a = 2 * p
        t_b = t_a + 1
        # the pair's page ids, loaded together: entries t_a and t_a + 1 of the row while
        # t_a is one of the sequence's pages, else entries 0 and 1
        entry = BlockTable + b.to(tl.int64) * stride_bt + tl.where(t_a < n_kv, t_a, 0)
        page_a = tl.load(entry)
        page_b = tl.load(entry + 1)
        k_a = _load_e4m3(k_head + page_a.to(tl.int64) * stride_k0 + k_offs, whole)
        k_b = _load_e4m3(k_head + page_b.to(tl.int64) * stride_k0 + k_offs, whole)
        s_a, max_a = _masked_scores(q, k_a, t_a * BLOCK_N + offs_r, rows, Sq, Skv, CAUSAL)
        s_b, max_b = _masked_scores(q, k_b, t_b * BLOCK_N + offs_r, rows, Sq, Skv, CAUSAL)
        mt = _fmax(max_a, max_b)
        if CAUSAL:
            mt = _fmax(mt, causal_floor)
        mn, corr, vote, fire, swept = _decide_pair(m, mt, ls, threshold, neg_bound, vote_code,
                                                   rebase_code, BLOCK_M, WAVE)
        O = O * corr[:, None]
        l = l * corr
        m = mn
        bias = (0.0 - ls * m) + headroom  # the fma's addend, fp32
        sum_a, p8_a = _p_fp8(s_a, ls, bias, saturate, FMA_VIA_FP64, BLOCK_M, BLOCK_N)
        v_a = _load_e4m3(v_head + page_a.to(tl.int64) * stride_v0 + v_offs, whole)
        l = l + sum_a
        O = O + tl.dot(p8_a, v_a, input_precision="ieee")
        sum_b, p8_b = _p_fp8(s_b, ls, bias, saturate, FMA_VIA_FP64, BLOCK_M, BLOCK_N)
        v_b = _load_e4m3(v_head + page_b.to(tl.int64) * stride_v0 + v_offs, whole)
        l = l + sum_b
        O = O + tl.dot(p8_b, v_b, input_precision="ieee")

    # Epilogue: O * (rcp(l) if l > 0 else 0, times the V descale); bf16 rounding explicit.
    rcp = tl.where(l > 0, tl.math.div_rn(tl.full((BLOCK_M,), 1.0, tl.float32), l), 0.0)
    o = O * (rcp * v_descale)[:, None]
    tl.store(Out + tok[:, None] * stride_ot + h.to(tl.int64) * stride_oh + offs_d[None, :] * stride_od,
             round_bf16(o).to(tl.bfloat16), mask=row_ok[:, None])
    lse = tl.where(l == 0, float("-inf"), (m * ls - headroom) * ln2 + tl.log(l))
    tl.store(Lse + bh.to(tl.int64) * max_seqlen_q + rows, lse, mask=row_ok)


def forward(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, *, q_descale: float,
            k_descale: float, v_descale: float, causal: bool, policy, paged: PagedFp8,
            saturate: bool = True, recorder=None, interpret: bool = False,
            rows_per_program: int | None = None):
    """The model's contract (``paged.forward``): q8 packed [total_q, H, D], k8 and v8 the
    vectorized page-64 cache, ``paged`` the checked call (a per-tile one runs
    ``faithful_paged_tile``; BN128 takes D = Dv = 128). Returns (out [total_q, H, Dv] bf16,
    lse [B, H, max_seqlen_q] fp32). ``interpret=True`` runs Triton's interpreter on CPU
    tensors."""
    if not isinstance(paged, PagedFp8):
        raise TypeError(f"paged must be a fa_lab.paged.PagedFp8, got {type(paged).__name__}")
    if causal is not True:
        raise ValueError("the paged fp8 kernel is causal only (causal=True)")
    if recorder is not None:
        raise ValueError("the paged fp8 port records no trace; trace a dense fp8 call")
    if paged.schedule == "tile":
        from . import faithful_paged_tile
        return faithful_paged_tile.forward(q8, k8, v8, q_descale=q_descale, k_descale=k_descale,
                                           v_descale=v_descale, policy=policy, paged=paged,
                                           saturate=saturate, interpret=interpret,
                                           rows_per_program=rows_per_program)
    for name, t in (("q8", q8), ("k8", k8), ("v8", v8)):
        if not isinstance(t, torch.Tensor) or t.dtype != _FP8:
            raise TypeError(f"{name} must be a float8_e4m3fn tensor")
    if q8.dim() != 3 or q8.shape[-1] != HEAD_DIM or paged.head_dim_v != HEAD_DIM:
        raise ValueError(f"the paged fp8 port takes q8 [total_q, H, {HEAD_DIM}] and Dv = {HEAD_DIM}")
    total_q, H, D = q8.shape
    check_launch((q8, k8, v8), ("q8", "k8", "v8"), batch_heads=paged.batch * H, causal=causal,
                 recorder=None, interpret=interpret)
    check_policy(policy, FAMILY, "faithful")
    if not isinstance(saturate, bool):
        raise TypeError(f"saturate must be a bool, got {type(saturate).__name__}")
    qd, kd, vd = (check_descale(n, x) for n, x in
                  (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)))
    rows = _rows_per_program(interpret, rows_per_program)
    codes = policy.codes
    dev = q8.device
    B, Sqm = paged.batch, paged.max_seqlen_q
    out = torch.zeros(total_q, H, D, dtype=torch.bfloat16, device=dev)
    lse = torch.full((B, H, Sqm), float("-inf"), dtype=torch.float32, device=dev)
    cu_q = torch.tensor(paged.cu_q, dtype=torch.int32, device=dev)
    seq_k = torch.tensor(paged.seqlen_k, dtype=torch.int32, device=dev)
    bt = paged.block_table
    args = (q8, k8, v8, out, lse, cu_q, seq_k, bt, *q8.stride(), *k8.stride(), *v8.stride(),
            *out.stride(), bt.stride(0), H, H // paged.num_kv_heads, Sqm,
            log2_scale(qd, kd, D), f32(codes.threshold) if codes.lazy else 0.0,
            -f32(codes.bound), f32(codes.headroom), f32(vd), f32(LN2), f32(CAUSAL_FLOOR),
            codes.vote, codes.rebase, int(saturate))
    meta = dict(CAUSAL=True, FMA_VIA_FP64=fma_via_fp64(_paged_fwd_kernel, interpret),
                BLOCK_M=rows, WAVE=WAVE_ROWS, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM,
                ROWS_PER_BLOCK=ROWS_PER_BLOCK, VEC=k8.shape[-1])
    grid = (triton.cdiv(Sqm, rows), B * H)
    if interpret:
        with warnings.catch_warnings():  # numpy on all-NaN rows (NaN inputs): expected
            warnings.filterwarnings("ignore", "All-NaN slice", RuntimeWarning)
            launch(_paged_fwd_kernel, grid, True, *args, **meta)
    else:
        with torch.cuda.device(dev):
            launch(_paged_fwd_kernel, grid, False, *args, **meta, num_warps=4, num_stages=1,
                   enable_fp_fusion=False)
    return out, lse
