"""Faithful Triton port of FlyDSL #1066's per-tile paged fp8 kernel (the model:
``paged_tile``; docs/semantics.md §17.3).

One launch over the packed batch: a program owns one (sequence, head, group of waves of
one 256-row block), reads its sequence's bounds from ``cu_seqlens_q`` and its key count
from ``seqlen_k``, and walks the dense tile count of its 256-row block. Tile t's page is
looked up in the block table inside the kernel: entry t of the sequence's row while t is
one of its pages, else ``block_table[0, 0]``. K element (row r, dim d) of page p sits at
``[p, hk, d // 16, r, d % 16]``, V at ``[p, hk, r // 16, d, r % 16]``; nothing is zeroed on
load, so what the rows past seqlen_k hold in V meets P = 0.

Per row, as the model: a prologue tile (max floored), one decision per loop tile with the
previous tile's P V split around it (its first 32 columns, 64 for Dv = 192, before; the
rest after, with P rescaled and repacked to bf16), an eager epilogue over the last three
tiles. P = exp2(fma(S, ls, 0 - ls*m)), l sums it in fp32, P V takes e4m3(bf16(P)) @ V8.
Head dims 192 run on tiles padded to 256 columns (the padding reads 0). The pieces shared
with the BN128 ports (the decision, the masks, the roundings) are theirs, so the ports
cannot drift apart; the exactness notes of ``faithful`` hold here too.
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
from .faithful import _decide_pair, _load_e4m3, _masked_scores, _round_e4m3
from .paged_tile import first_step_cols
from fa_lab.numerics import log2_scale
from .._triton.util import fmax as _fmax
from .._triton.util import check_launch, exp2_ieee, fma_f32, fma_via_fp64, launch, round_bf16
from .._triton.util import rows_per_program as _rows_per_program

_FP8 = torch.float8_e4m3fn


@triton.jit
def _tile_scores(q, k_head, page, stride_k0, k_offs, k_ok, t, rows, Sq, Skv,
                 BLOCK_N: tl.constexpr):
    """One tile's masked raw scores (page ``page`` read whole) and their row max as
    ``reduce_max`` folds it: maxNum, so NaN loses and a row of NaN and -inf gives -inf."""
    k = _load_e4m3(k_head + page.to(tl.int64) * stride_k0 + k_offs, k_ok)
    return _masked_scores(q, k, t * BLOCK_N + tl.arange(0, BLOCK_N), rows, Sq, Skv, True)


@triton.jit
def _p(s, ls, m, headroom, FMA_VIA_FP64: tl.constexpr, BLOCK_M: tl.constexpr,
       BLOCK_N: tl.constexpr):
    """P = exp2(fma(S, ls, (0 - ls*m) + H)) of one tile, fp32."""
    bias = tl.broadcast_to(((0.0 - ls * m) + headroom)[:, None], (BLOCK_M, BLOCK_N))
    ls_b = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32) + ls
    return exp2_ieee(fma_f32(s, ls_b, bias, FMA_VIA_FP64))


@triton.jit
def _page(BlockTable, row_entry, t, n_kv):
    """Tile t's page: the row's entry t while t < n_kv, else the flat table's entry 0."""
    own = tl.load(row_entry + tl.where(t < n_kv, t, 0))
    return tl.where(t < n_kv, own, tl.load(BlockTable))


@triton.jit(do_not_specialize=["vote_code", "rebase_code", "saturate"])
def _paged_tile_kernel(
    Q, K, V, Out, Lse, CuQ, SeqK, BlockTable,
    stride_qt, stride_qh, stride_qd,
    stride_k0, stride_k1, stride_k2, stride_k3, stride_k4,
    stride_v0, stride_v1, stride_v2, stride_v3, stride_v4,
    stride_ot, stride_oh, stride_od, stride_bt,
    H, GROUP, max_seqlen_q, D, DV, C0,
    ls, threshold, neg_bound, headroom, v_descale, ln2, causal_floor, vote_code, rebase_code,
    saturate, FMA_VIA_FP64: tl.constexpr,
    BLOCK_M: tl.constexpr, WAVE: tl.constexpr, BLOCK_N: tl.constexpr,
    D_PAD: tl.constexpr, DV_PAD: tl.constexpr, ROWS_PER_BLOCK: tl.constexpr, VEC: tl.constexpr,
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
    offs_d = tl.arange(0, D_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    offs_r = tl.arange(0, BLOCK_N)
    tok = (q_start + rows).to(tl.int64)
    q = _load_e4m3(Q + tok[:, None] * stride_qt + h.to(tl.int64) * stride_qh
                   + offs_d[None, :] * stride_qd, row_ok[:, None] & (offs_d < D)[None, :])

    # the tile count of this 256-row block, as the dense kernel's (geometry.tiles_for_block)
    blk0 = (pid * BLOCK_M) // ROWS_PER_BLOCK * ROWS_PER_BLOCK
    n_kv = (Skv + BLOCK_N - 1) // BLOCK_N
    end = tl.maximum(blk0 + ROWS_PER_BLOCK + Skv - Sq, 0)
    tt = tl.minimum(n_kv, (end + BLOCK_N - 1) // BLOCK_N)
    n_tiles = tl.where(blk0 < Sq, tl.maximum(tt + tt % 2, 4), 0)

    k_head = K + hk.to(tl.int64) * stride_k1
    v_head = V + hk.to(tl.int64) * stride_v1
    k_offs = ((offs_d // VEC)[None, :] * stride_k2 + offs_r[:, None] * stride_k3
              + (offs_d % VEC)[None, :] * stride_k4)
    k_ok = (offs_r[:, None] >= 0) & (offs_d < D)[None, :]  # a page is read whole
    v_offs = ((offs_r // VEC)[:, None] * stride_v2 + offs_dv[None, :] * stride_v3
              + (offs_r % VEC)[:, None] * stride_v4)
    v_ok = (offs_r[:, None] >= 0) & (offs_dv < DV)[None, :]
    row_entry = BlockTable + b.to(tl.int64) * stride_bt
    first = (offs_dv < C0)[None, :]  # the columns of a tile's P V step before the decision

    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.full((BLOCK_M,), 0.0, tl.float32)
    O = tl.full((BLOCK_M, DV_PAD), 0.0, tl.float32)
    pf = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    if n_tiles > 0:
        # prologue: tile 0, its max floored
        page = _page(BlockTable, row_entry, 0, n_kv)
        s, mt = _tile_scores(q, k_head, page, stride_k0, k_offs, k_ok, 0, rows, Sq, Skv, BLOCK_N)
        m = _fmax(mt, causal_floor)
        pf = _p(s, ls, m, headroom, FMA_VIA_FP64, BLOCK_M, BLOCK_N)
    for t in range(1, n_tiles):
        l = l + tl.sum(pf, axis=1)
        pb = round_bf16(pf)  # cast_p
        prev = _page(BlockTable, row_entry, t - 1, n_kv)
        v = _load_e4m3(v_head + prev.to(tl.int64) * stride_v0 + v_offs, v_ok)
        page = _page(BlockTable, row_entry, t, n_kv)
        s, mt = _tile_scores(q, k_head, page, stride_k0, k_offs, k_ok, t, rows, Sq, Skv, BLOCK_N)
        if t <= n_tiles - 4:  # the loop: the policy decides, between P V's steps
            pv_pre = tl.dot(_round_e4m3(pb, saturate), v, input_precision="ieee")
            mn, corr, vote, fire, swept = _decide_pair(m, mt, ls, threshold, neg_bound, vote_code,
                                                       rebase_code, BLOCK_M, WAVE)
            pb = round_bf16(pb * corr[:, None])  # scale_v_p
            pv_post = tl.dot(_round_e4m3(pb, saturate), v, input_precision="ieee")
            O = tl.where(first, (O + pv_pre) * corr[:, None], O * corr[:, None] + pv_post)
            l = l * corr
            m = mn
        else:  # the epilogue: the previous tile's P V whole, then an eager rebase
            O = O + tl.dot(_round_e4m3(pb, saturate), v, input_precision="ieee")
            mn = _fmax(m, mt)
            corr = exp2_ieee((m - mn) * ls)
            m = mn
            O = O * corr[:, None]
            l = l * corr
        pf = _p(s, ls, m, headroom, FMA_VIA_FP64, BLOCK_M, BLOCK_N)
    if n_tiles > 0:
        l = l + tl.sum(pf, axis=1)
        last = _page(BlockTable, row_entry, n_tiles - 1, n_kv)
        v = _load_e4m3(v_head + last.to(tl.int64) * stride_v0 + v_offs, v_ok)
        O = O + tl.dot(_round_e4m3(round_bf16(pf), saturate), v, input_precision="ieee")

    # Epilogue: O * (rcp(l) if l > 0 else 0, times the V descale); bf16 rounding explicit.
    rcp = tl.where(l > 0, tl.math.div_rn(tl.full((BLOCK_M,), 1.0, tl.float32), l), 0.0)
    o = O * (rcp * v_descale)[:, None]
    tl.store(Out + tok[:, None] * stride_ot + h.to(tl.int64) * stride_oh + offs_dv[None, :] * stride_od,
             round_bf16(o).to(tl.bfloat16), mask=row_ok[:, None] & (offs_dv < DV)[None, :])
    lse = tl.where(l == 0, float("-inf"), (m * ls - headroom) * ln2 + tl.log(l))
    tl.store(Lse + bh.to(tl.int64) * max_seqlen_q + rows, lse, mask=row_ok)


def forward(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, *, q_descale: float,
            k_descale: float, v_descale: float, policy, paged: PagedFp8, saturate: bool = True,
            interpret: bool = False, rows_per_program: int | None = None):
    """The model's contract (``paged_tile.forward``): q8 packed [total_q, H, D], k8 and v8
    the vectorized page-64 cache, ``paged`` a checked call on the per-tile schedule.
    Returns (out [total_q, H, Dv] bf16, lse [B, H, max_seqlen_q] fp32). ``interpret=True``
    runs Triton's interpreter on CPU tensors."""
    if not isinstance(paged, PagedFp8) or paged.schedule != "tile":
        raise ValueError("the per-tile port takes a PagedFp8 call on the per-tile schedule")
    for name, t in (("q8", q8), ("k8", k8), ("v8", v8)):
        if not isinstance(t, torch.Tensor) or t.dtype != _FP8:
            raise TypeError(f"{name} must be a float8_e4m3fn tensor")
    total_q, H, D = q8.shape
    dv = paged.head_dim_v
    c0 = first_step_cols(dv)
    check_launch((q8, k8, v8), ("q8", "k8", "v8"), batch_heads=paged.batch * H, causal=True,
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
    out = torch.zeros(total_q, H, dv, dtype=torch.bfloat16, device=dev)
    lse = torch.full((B, H, Sqm), float("-inf"), dtype=torch.float32, device=dev)
    cu_q = torch.tensor(paged.cu_q, dtype=torch.int32, device=dev)
    seq_k = torch.tensor(paged.seqlen_k, dtype=torch.int32, device=dev)
    bt = paged.block_table
    args = (q8, k8, v8, out, lse, cu_q, seq_k, bt, *q8.stride(), *k8.stride(), *v8.stride(),
            *out.stride(), bt.stride(0), H, H // paged.num_kv_heads, Sqm, D, dv, c0,
            log2_scale(qd, kd, D), f32(codes.threshold) if codes.lazy else 0.0,
            -f32(codes.bound), f32(codes.headroom), f32(vd), f32(LN2), f32(CAUSAL_FLOOR),
            codes.vote, codes.rebase, int(saturate))
    meta = dict(FMA_VIA_FP64=fma_via_fp64(_paged_tile_kernel, interpret), BLOCK_M=rows,
                WAVE=WAVE_ROWS, BLOCK_N=BLOCK_N, D_PAD=triton.next_power_of_2(D),
                DV_PAD=triton.next_power_of_2(dv), ROWS_PER_BLOCK=ROWS_PER_BLOCK,
                VEC=k8.shape[-1])
    grid = (triton.cdiv(Sqm, rows), B * H)
    if interpret:
        with warnings.catch_warnings():  # numpy on all-NaN rows (NaN inputs): expected
            warnings.filterwarnings("ignore", "All-NaN slice", RuntimeWarning)
            launch(_paged_tile_kernel, grid, True, *args, **meta)
    else:
        with torch.cuda.device(dev):
            launch(_paged_tile_kernel, grid, False, *args, **meta, num_warps=4, num_stages=1,
                   enable_fp_fusion=False)
    return out, lse
