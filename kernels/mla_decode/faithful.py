"""Faithful Triton port of the gfx950 MLA decode forward (fp8 Q and KV, 128 heads).

Same decisions as the model ``fa_lab.kernels.mla_decode.model`` (docs/semantics.md §14),
tile for tile: 64-key tiles of the item's positions, eager rebase to maxNum(tile max, m),
P = exp2(fma(x - m, log2e, H)) summed in fp32 in the kernel's lane order before its e4m3
cast, ``l = fma(r, l, sum)``, O = O * r + e4m3(P) . V, and the split epilogue
``O * rcp(l)`` and ``fma(log2 l - H, 1/log2e, m)``.

One program owns one (work item, group of heads): heads are independent (a warp's max and
sum reduce only over its own head's lanes). Compiled, a group is 16 heads (one upstream
warp); interpreted, all 128 (the interpreter's cost is per operation).

Exactness, and where the GPU and the interpreter would otherwise part ways:
- the dots (``_triton.dots.dot8``) sum fp8 x fp8 products, which are exact, in fp64,
  where their sums here are exact in any order, so S and e4m3(P) . V are the model's
  exactly rounded dots: interpreted with an fp64 ``tl.dot``, compiled inside
  ``fa_lab.kernels.exact_dots()`` through the scratch loop (Triton cannot compile an fp64
  ``tl.dot`` at these sizes); compiled by default, on the tensor cores, a few ulps off;
- P's e4m3 rounding and the fp8 loads (NaN codes) go through the fp8 family's explicit
  bit-level helpers (the interpreter's ``.to()`` neither saturates nor rounds);
- exp2 and log2 are taken in fp64 and rounded once, 1/l is IEEE ``div_rn``, fp32 mul+add
  contraction is off, and the fmas are ``fma_f32`` (one rounding; the model's emulation on
  an interpreter whose tl.fma rounds twice);
- the tile sum is formed in the kernel's lane order, one key at a time (each masked
  ``tl.sum`` adds one value to zeros, which is exact).
``forward(..., interpret=True)`` runs the same source through Triton's interpreter on CPU
tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fa_lab.kernels.mla_decode.model import (BLOCK_N, INV_LOG2E, KV_LORA_RANK, LOG2E, NUM_HEADS,
                                             QK_HEAD_DIM, QK_ROPE_HEAD_DIM, TILE_M, work_items)
from fa_lab.kernels.swp_fp8.faithful import _load_e4m3, _round_e4m3
from fa_lab.numerics import f32

from .._triton.dots import dot8, launch_dots, program_scratch
from .._triton.util import exp2_ieee, fma_f32, fma_via_fp64, launch
from .._triton.util import fmax as _fmax


@triton.jit
def _lane_sum(p, BLOCK_N: tl.constexpr):
    """One tile's fp32 sum per row in the kernel's order: lane group j adds its 16 keys
    16 h + 4 j + i (h, i < 4) in register order, then (g0 + g2) + (g1 + g3)."""
    cols = tl.arange(0, BLOCK_N)[None, :]
    g0 = tl.sum(tl.where(cols < 0, p, 0.0), axis=1)  # zeros of the row shape
    g1 = g0
    g2 = g0
    g3 = g0
    for i in tl.static_range(16):
        base = 16 * (i // 4) + (i % 4)
        g0 = g0 + tl.sum(tl.where(cols == base, p, 0.0), axis=1)
        g1 = g1 + tl.sum(tl.where(cols == base + 4, p, 0.0), axis=1)
        g2 = g2 + tl.sum(tl.where(cols == base + 8, p, 0.0), axis=1)
        g3 = g3 + tl.sum(tl.where(cols == base + 12, p, 0.0), axis=1)
    return (g0 + g2) + (g1 + g3)


@triton.jit
def _mla_kernel(Q, KV, Pages, Items, SplitO, SplitLse, Scratch, softmax_scale, headroom, log2e,
                inv_log2e, FMA_VIA_FP64: tl.constexpr, HB: tl.constexpr,
                BLOCK_N: tl.constexpr, DL: tl.constexpr, DR: tl.constexpr,
                D: tl.constexpr, NH: tl.constexpr, DOT_MODE: tl.constexpr,
                SCRATCH_FLOATS: tl.constexpr):
    item = tl.program_id(0)
    scratch = program_scratch(Scratch, SCRATCH_FLOATS, DOT_MODE)
    heads = tl.program_id(1) * HB + tl.arange(0, HB)
    loc = tl.load(Items + item * 4).to(tl.int64)
    qo = tl.load(Items + item * 4 + 1).to(tl.int64)
    k0 = tl.load(Items + item * 4 + 2)
    n = tl.load(Items + item * 4 + 3) - k0
    offs_l = tl.arange(0, DL)
    offs_r = tl.arange(0, DR)
    q_rows = (qo * NH + heads.to(tl.int64)) * D
    all_rows = (heads >= 0)[:, None]
    qn = _load_e4m3(Q + q_rows[:, None] + offs_l[None, :], all_rows)
    qr = _load_e4m3(Q + q_rows[:, None] + DL + offs_r[None, :], all_rows)

    zero = tl.zeros((HB, BLOCK_N), tl.float32)
    log2e_b = zero + log2e
    headroom_b = zero + headroom
    m = tl.full((HB,), float("-inf"), tl.float32)
    l = tl.zeros((HB,), tl.float32)
    O = tl.zeros((HB, DL), tl.float32)
    num_tiles = tl.maximum((n + BLOCK_N - 1) // BLOCK_N, 1)  # an empty item runs one tile
    for t in range(0, num_tiles):
        pos = t * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = pos < n
        page = tl.load(Pages + k0 + pos, mask=valid, other=0).to(tl.int64) * D
        kn = _load_e4m3(KV + page[:, None] + offs_l[None, :], valid[:, None])  # zero-filled
        kr = _load_e4m3(KV + page[:, None] + DL + offs_r[None, :], valid[:, None])
        s = dot8(qn, tl.trans(kn), scratch, DOT_MODE)
        s = s + dot8(qr, tl.trans(kr), scratch, DOT_MODE)
        x = tl.where(valid[None, :], s.to(tl.float32) * softmax_scale, float("-inf"))
        nan = x != x
        mt = tl.max(tl.where(nan, float("-inf"), x), axis=1)  # maxNum: NaN only if all are
        mt = tl.where(tl.min(nan.to(tl.int32), axis=1) > 0, float("nan"), mt)
        first = t == 0
        m_new = tl.where(first, mt, _fmax(mt, m))
        r = tl.where(first, 1.0, exp2_ieee((m - m_new) * log2e))
        p = exp2_ieee(fma_f32(x - m_new[:, None], log2e_b, headroom_b, FMA_VIA_FP64))
        s_t = _lane_sum(p, BLOCK_N)
        # First tile: l = 0 and O = 0 with r = 1 make both updates exact copies.
        l = fma_f32(r, l, s_t, FMA_VIA_FP64)
        p8 = _round_e4m3(p, 1)
        pv = dot8(p8, kn, scratch, DOT_MODE).to(tl.float32)
        O = O * r[:, None] + pv
        m = m_new
    rcp = tl.math.div_rn(tl.full((HB,), 1.0, tl.float32), l)
    out = O * rcp[:, None]
    log2l = tl.log2(l.to(tl.float64)).to(tl.float32)
    lse = fma_f32(log2l - headroom, tl.zeros((HB,), tl.float32) + inv_log2e, m, FMA_VIA_FP64)
    rows = loc * NH + heads.to(tl.int64)
    tl.store(SplitO + rows[:, None] * DL + offs_l[None, :], out)
    tl.store(SplitLse + rows, lse)


def forward(query: torch.Tensor, kv_buffer: torch.Tensor, kv_page_indices: torch.Tensor,
            work_indptr: torch.Tensor, work_info_set: torch.Tensor,
            split_output: torch.Tensor, split_lse: torch.Tensor, softmax_scale: float, *,
            p_headroom: float = 0.0, interpret: bool = False,
            heads_per_program: int | None = None) -> None:
    """The model's contract (``model.forward``; the arguments are checked by ``fa_lab.mla``):
    writes every work item's partial output and LSE into the contiguous ``split_output``
    and ``split_lse``. ``interpret=True`` runs Triton's interpreter on CPU tensors;
    ``heads_per_program`` (16, 32, 64 or 128) defaults to 128 interpreted, 16 compiled."""
    if heads_per_program is None:
        heads_per_program = NUM_HEADS if interpret else TILE_M
    if heads_per_program not in (16, 32, 64, 128):
        raise ValueError(f"heads_per_program must be 16, 32, 64 or 128, got {heads_per_program!r}")
    items = work_items(work_indptr, work_info_set)
    if not items:
        return
    dev = query.device
    table = torch.tensor([[loc, qo, k0, k1] for loc, qo, k0, k1 in items], dtype=torch.int32,
                         device=dev)
    grid = (len(items), NUM_HEADS // heads_per_program)
    scratch, dots = launch_dots(_mla_kernel, interpret, grid, heads_per_program, KV_LORA_RANK,
                                BLOCK_N, dev)
    args = (query.contiguous(), kv_buffer.contiguous(), kv_page_indices.contiguous(), table,
            split_output, split_lse, scratch, f32(softmax_scale), f32(p_headroom), LOG2E,
            INV_LOG2E)
    meta = dict(FMA_VIA_FP64=fma_via_fp64(_mla_kernel, interpret), HB=heads_per_program,
                BLOCK_N=BLOCK_N, DL=KV_LORA_RANK, DR=QK_ROPE_HEAD_DIM, D=QK_HEAD_DIM,
                NH=NUM_HEADS, **dots)
    if interpret:
        launch(_mla_kernel, grid, True, *args, **meta)
    else:
        with torch.cuda.device(dev):
            launch(_mla_kernel, grid, False, *args, **meta, num_warps=8, num_stages=1,
                   enable_fp_fusion=False)
