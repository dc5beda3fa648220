"""Faithful Triton port of the gfx950 DUALWAVE_SWP bf16/f16 forward.

Same semantics as ``fa_lab.kernels.swp_bf16.model`` (docs/semantics.md §2), decision for
decision. One program per (batch, head, run of whole 32-row waves inside one 256-row
block): one wave when compiled, the whole block in the interpreter. Either is exact
because the lazy ballot is a vote of a wave's own 32 rows (padding rows past Sq read
Q = 0 and vote too). Each program walks its block's N KV tiles of 64 columns in the
kernel's order:

  prologue (tile 0)  m = rowmax(S_0) (causal: floored at -3e38); Pf = exp2(S_0 - m)
  loop (1..N-4)      l += sum(Pf); Pb = round(Pf); O += Pb[:, :16] @ V[:16]
                     rescale decision (eager, or the wave's ballot for lazy policies)
                     O += round(Pb[:, 16:] * corr) @ V[16:]; Pf = exp2(S_t - m)
  epilogue (N-3..)   always eager; the tail PV step folds into the last tile

The policy arrives as its fields (``fa_lab.Policy.codes``, docs/semantics.md §9): the vote
("tile", "wave" or "row") and the rebase ("max", "tile" or "capped") are compile-time
switches, the threshold and rebase bound run-time arguments.

The DUALWAVE_SWP extras, as the model's ``ScoreMods`` (natural-log units in, log2 inside):
``bias`` [Sq, Skv] and ALiBi slopes [H] or [B, H] add bias * log2 e + (-slope * log2 e) *
|i + Skv - Sq - j| to the scores before masking (padding rows read a bias of 0 and get
ALiBi's term, since they vote); ``sink`` [H] is one more logit in the denominator, folded
in after the last tile. ``num_kv_splits`` > 1 adds a split dimension to the grid: each
split walks its own tiles with the whole schedule and a combine pass merges them
(``combine``). ``forward_varlen`` runs packed sequences in one launch: each program
reads its sequence's offsets from cu_seqlens, and blocks and waves count from the
sequence's first row, as a dense run per sequence would.

Numerics: every dot is ``_triton.dots.dot16``: interpreted, the model's
``numerics.exact_dot`` bit for bit (exact products, fp64 sum, one rounding); compiled, a
16-bit tensor-core dot with fp32 accumulation in the hardware's order (a few ulps off the
exact sum), or, inside ``fa_lab.kernels.exact_dots()``, the exact sum again (slow; see
``_triton.dots``). The P split (columns 0..15, then 16..63) zeroes the other part of both
P and V, so an inf in one part never meets a zero. Roundings to bf16 are done by
bit manipulation (round to nearest even) because the interpreter's conversion truncates;
maxima use maxNum; compiled, no a * b + c is fused (the extras' fp32 products and sums
round one by one, in the model's order). Inputs are assumed finite (the model's amax
propagates a NaN score, the kernel's row max skips it).

``forward(..., recorder=...)`` also writes, for the traced rows only, the same per-tile
record as the model (``fa_lab.trace``), split-K included.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from fa_lab.checks import check_mod, check_qkv
from fa_lab.kernels._common.geometry import BLOCK_M, BLOCK_N, PV_SPLIT, WAVE_ROWS, padded_rows, tiles_for_block
from fa_lab.kernels.swp_bf16.model import softmax_scale_log2, split_ranges
from fa_lab.numerics import CAUSAL_FLOOR, LN2, LOG2E, f32
from fa_lab.paged import PagedKV
from fa_lab.capabilities import check_policy
from fa_lab.policies import Policy
from fa_lab.trace import TraceRecorder

from . import FAMILY
from .._triton.dots import dot16, launch_dots, load16, program_scratch
from .._triton.faithful import pv_part, record_step, wave_ballot
from .._triton.trace_plan import N_FIELDS as _N_FIELDS
from .._triton.trace_plan import TracePlan
from .._triton.util import (GRID_Y_MAX, check_launch, exp2_ieee, fmax, launch, round_bf16, round_f16,
                            rows_per_program as _rows_per_program)
from . import combine
from .combine import split_range

KERNEL = "swp_bf16"
_DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _round_pack(x, IS_BF16: tl.constexpr):
    """The 16-bit rounding of a P pack or of Q (the kernel's input dtype)."""
    if IS_BF16:
        r = round_bf16(x)
    else:
        r = round_f16(x)
    return r


@triton.jit
def _alibi(alibi_log2, rows, cols, Sq, Skv):
    """ALiBi's term (-slope * log2 e) * |i + Skv - Sq - j| [ROWS, TILE_N]: one fp32 product
    of the slope's log2 and the integer distance (exact in fp32)."""
    dist = tl.abs(rows[:, None] + (Skv - Sq) - cols[None, :]).to(tl.float32)
    return alibi_log2 * dist


@triton.jit
def _page(BlockTable, bt_row, t, n_pages, TILE_N: tl.constexpr, PAGED: tl.constexpr):
    """(page, row0, load bound) of KV tile t: paged, the page the kernel's LDS cache holds
    (the block table's entry below ceil(Skv/64), page 0 past it), its first row t * 64
    and no bound (the whole page is read); dense, page 0 of the batch's rows, row 0 and
    the bound Skv (rows past it read 0)."""
    page = tl.zeros([], tl.int64)
    row0 = 0
    unbounded = 0
    if PAGED:
        page = tl.load(BlockTable + bt_row + t, mask=t < n_pages, other=0).to(tl.int64)
        row0 = t * TILE_N
        unbounded = 1 << 30
    return page, row0, unbounded


@triton.jit
def _tile_scores(qs, k_base, row0, unbounded, stride_ks, stride_kd, rows, t, Sq, Skv,
                 bias_base, stride_bias_q, stride_bias_k, alibi_log2, scratch,
                 HEAD_DIM: tl.constexpr, TILE_N: tl.constexpr, CAUSAL: tl.constexpr,
                 HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, LOG2E_F32: tl.constexpr,
                 DOT_MODE: tl.constexpr):
    """S_t = Qs @ K_t^T in log2 units [ROWS, TILE_N], plus the bias and ALiBi terms as the
    model adds them (S + (bias * log2 e + alibi)), masked columns -inf (padding columns
    >= Skv read K = 0, or, paged, what the page holds; causal is bottom-right aligned)."""
    cols = t * TILE_N + tl.arange(0, TILE_N)
    offs_d = tl.arange(0, HEAD_DIM)
    kt = load16(k_base + (cols - row0).to(tl.int64)[None, :] * stride_ks + offs_d[:, None] * stride_kd,
                (cols < Skv + unbounded)[None, :], DOT_MODE)
    s = dot16(qs, kt, scratch, DOT_MODE)
    if HAS_BIAS:
        # padding rows and columns read 0 (the columns are masked below anyway); a 16-bit
        # bias is widened at load (the interpreter's bf16 arithmetic is wrong)
        ok = (rows < Sq)[:, None] & (cols < Skv)[None, :]
        b_ptrs = (bias_base + rows.to(tl.int64)[:, None] * stride_bias_q
                  + cols.to(tl.int64)[None, :] * stride_bias_k)
        extra = tl.load(b_ptrs, mask=ok, other=0.0).to(tl.float32) * LOG2E_F32
        if HAS_ALIBI:
            extra = extra + _alibi(alibi_log2, rows, cols, Sq, Skv)
        s = s + extra
    elif HAS_ALIBI:
        s = s + _alibi(alibi_log2, rows, cols, Sq, Skv)
    masked = (cols >= Skv)[None, :] & (rows >= 0)[:, None]  # (the & only broadcasts)
    if CAUSAL:
        masked = masked | (cols[None, :] > rows[:, None] + (Skv - Sq))
    return tl.where(masked, float("-inf"), s)


@triton.jit
def _v_tile(v_base, row0, unbounded, stride_vs, stride_vd, t, Skv, HEAD_DIM: tl.constexpr,
            TILE_N: tl.constexpr, DOT_MODE: tl.constexpr):
    """V_t [TILE_N, HEAD_DIM] (see ``_triton.dots.load16``); padding rows >= Skv read 0
    (dense) or what the page holds (paged: ``unbounded``)."""
    cols = t * TILE_N + tl.arange(0, TILE_N)
    offs_d = tl.arange(0, HEAD_DIM)
    return load16(v_base + (cols - row0).to(tl.int64)[:, None] * stride_vs + offs_d[None, :] * stride_vd,
                  (cols < Skv + unbounded)[:, None], DOT_MODE)


# Lengths and head counts vary from call to call: one compiled kernel serves them all.
# The policy's codes are run-time values, not specialised: one compiled kernel serves
# every policy (Triton would build one per value, and one per argument equal to 1).
@triton.jit(do_not_specialize=["H", "G", "Sq", "Skv", "n_trace_steps", "num_splits", "vote_code",
                               "rebase_code"])
def _swp_bf16_fwd(
    Q, K, V, Out, Lse, PartL, TraceSlot, TraceBuf, Bias, Alibi, Sink, CuSeqQ, CuSeqKv, Scratch,
    BlockTable, stride_bt,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_o_split, stride_ob, stride_os, stride_oh, stride_od,
    stride_l_split, stride_lb, stride_lh,
    stride_bias_q, stride_bias_k, stride_alibi_b, stride_alibi_h,
    H, G, Sq, Skv, n_trace_steps, num_splits,
    scale_log2, threshold, rebase_bound, vote_code, rebase_code,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
    IS_BF16: tl.constexpr,
    TRACE: tl.constexpr, ROWS: tl.constexpr, WAVE: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    TILE_N: tl.constexpr,
    PV_LO: tl.constexpr, N_FIELDS: tl.constexpr, FLOOR: tl.constexpr, LN2_F32: tl.constexpr,
    LOG2E_F32: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_SINK: tl.constexpr, SPLIT: tl.constexpr, VARLEN: tl.constexpr, PAGED: tl.constexpr,
    DOT_MODE: tl.constexpr, SCRATCH_FLOATS: tl.constexpr,
):
    """Out/Lse: the output and LSE; with SPLIT, the split's partial output (normalised by
    its own l) and its running max m, with its l in PartL. VARLEN: the batch index is the
    sequence's, Sq and Skv and the row offsets come from CuSeqQ/CuSeqKv (the batch
    strides of q, k, v, out are 0). PAGED: K and V are the page cache [NumBlocks, 64, Hkv,
    D] (the batch stride is the page stride) and tile t reads page ``_page``."""
    chunk = tl.program_id(0)  # ROWS consecutive query rows: whole waves of one block
    bh = tl.program_id(1)
    split = tl.program_id(2)
    b = (bh // H).to(tl.int64)
    h = bh % H
    hkv = (h // G).to(tl.int64)
    h = h.to(tl.int64)
    q_start = 0
    kv_start = 0
    if VARLEN:
        q_start = tl.load(CuSeqQ + b)
        Sq = tl.load(CuSeqQ + b + 1) - q_start
        kv_start = tl.load(CuSeqKv + b)
        Skv = tl.load(CuSeqKv + b + 1) - kv_start
        q_start = q_start.to(tl.int64)  # (offsets into packed tensors)
        kv_start = kv_start.to(tl.int64)
        # rows past this sequence, or a sequence without keys: out stays 0, lse -inf
        if (chunk * ROWS >= Sq) | (Skv == 0):
            return
    scratch = program_scratch(Scratch, SCRATCH_FLOATS, DOT_MODE)
    rows = chunk * ROWS + tl.arange(0, ROWS)  # query rows of the sequence, padding included
    row_ok = rows < Sq
    rows64 = rows.to(tl.int64)
    qrows64 = rows64 + q_start  # rows of the (packed) tensors
    offs_d = tl.arange(0, HEAD_DIM)

    # The block's tile count N: ceil(Skv/64), cut at the causal diagonal, even, >= 4.
    q0 = (chunk * ROWS // BLOCK_ROWS) * BLOCK_ROWS
    n_tiles = (Skv + TILE_N - 1) // TILE_N
    if CAUSAL:
        reach = tl.maximum(q0 + BLOCK_ROWS + Skv - Sq, 0)
        n_tiles = tl.minimum(n_tiles, (reach + TILE_N - 1) // TILE_N)
    N = tl.maximum(n_tiles + n_tiles % 2, 4)
    t0 = 0  # the first tile this program walks (a split's own range)
    if SPLIT:
        t0, t_end = split_range(N, split, num_splits)
        if t_end == t0:  # an empty split: its buffers already hold m = -1e30, l = 0, O = 0
            return
        N = t_end - t0

    # Q pre-scaled into log2 units and rounded once; padding rows read Q = 0.
    q_ptrs = Q + b * stride_qb + h * stride_qh + qrows64[:, None] * stride_qs + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0).to(tl.float32)
    qs = _round_pack(q * scale_log2, IS_BF16)
    k_base = K + b * stride_kb + kv_start * stride_ks + hkv * stride_kh
    v_base = V + b * stride_vb + kv_start * stride_vs + hkv * stride_vh
    bt_row = b * stride_bt
    n_pages = (Skv + TILE_N - 1) // TILE_N  # block-table entries the kernel reads
    if PAGED:  # the pages are global: tile t adds its page's offset
        k_base = K + hkv * stride_kh
        v_base = V + hkv * stride_vh
    bias_base = Bias + q_start * stride_bias_q
    alibi_log2 = 0.0
    if HAS_ALIBI:
        alibi_log2 = -(tl.load(Alibi + b * stride_alibi_b + h * stride_alibi_h) * LOG2E_F32)

    if TRACE:
        slot = tl.load(TraceSlot + (b * H + h) * Sq + rows64, mask=row_ok, other=-1)
    no = rows < 0  # all False: vote/fire/swept outside the lazy loop
    yes = rows >= 0

    # Prologue: tile 0 sets the first base.
    pg, row0, unb = _page(BlockTable, bt_row, t0, n_pages, TILE_N, PAGED)
    s = _tile_scores(qs, k_base + pg * stride_kb, row0, unb, stride_ks, stride_kd, rows, t0, Sq, Skv, bias_base, stride_bias_q,
                     stride_bias_k, alibi_log2, scratch, HEAD_DIM, TILE_N, CAUSAL, HAS_BIAS,
                     HAS_ALIBI, LOG2E_F32, DOT_MODE)
    m = tl.max(s, axis=1)
    if CAUSAL:
        m = fmax(m, tl.full([ROWS], FLOOR, tl.float32))
    pf = exp2_ieee(s - m[:, None])
    l = tl.zeros([ROWS], dtype=tl.float32)
    O = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    ones = l + 1.0
    if TRACE:
        record_step(TraceBuf, slot, t0, n_trace_steps, yes, m, m, no, no, no, ones, l, O, N_FIELDS)

    # Main loop: the only place a lazy policy decides, by a ballot of each 32-row wave.
    for t in range(1, N - 3):
        l = l + tl.sum(pf, axis=1)
        pb = _round_pack(pf, IS_BF16)
        pg, row0, unb = _page(BlockTable, bt_row, t0 + t - 1, n_pages, TILE_N, PAGED)
        v = _v_tile(v_base + pg * stride_vb, row0, unb, stride_vs, stride_vd, t0 + t - 1, Skv,
                    HEAD_DIM, TILE_N, DOT_MODE)
        O = O + pv_part(pb, v, 0, PV_LO, scratch, TILE_N, DOT_MODE)  # first PV step, before the rescale
        pg, row0, unb = _page(BlockTable, bt_row, t0 + t, n_pages, TILE_N, PAGED)
        s = _tile_scores(qs, k_base + pg * stride_kb, row0, unb, stride_ks, stride_kd, rows, t0 + t,
                         Sq, Skv, bias_base, stride_bias_q, stride_bias_k, alibi_log2, scratch,
                         HEAD_DIM, TILE_N, CAUSAL, HAS_BIAS, HAS_ALIBI, LOG2E_F32, DOT_MODE)
        mt = tl.max(s, axis=1)  # masked, not floored: may be -inf
        if vote_code == 0:  # vote "tile" (eager): every row to fmax(m, mt)
            target = fmax(m, mt)
            corr = exp2_ieee(m - target)
            vote = no
            fire = no
        else:
            vote_i = tl.where(mt - m <= threshold, 0, 1)  # NaN difference votes
            fire = wave_ballot(vote_i, ROWS, WAVE)
            vote = vote_i > 0
            if vote_code == 2:  # vote "row" (FlashAttention-4): each row decides for itself
                apply = vote
            else:  # vote "wave" (FlyDSL): the wave's ballot moves every row of the wave
                apply = fire
            if rebase_code == 2:  # "capped": own tile max unless more than the bound below m
                d = mt - m
                safe = d >= -rebase_bound  # NaN: not safe
                target = tl.where(safe, mt, m)
                moved = exp2_ieee(-tl.where(safe, d, 0.0))
            else:
                if rebase_code == 1:  # "tile": the row's own tile max (the unfixed body)
                    target = mt
                else:  # "max": fmax(m, mt), never down (PR #1033)
                    target = fmax(m, mt)
                moved = exp2_ieee(m - target)
            corr = tl.where(apply, moved, 1.0)
            target = tl.where(apply, target, m)
        swept = fire & (mt < m)
        O = O * corr[:, None]
        pb = _round_pack(pb * corr[:, None], IS_BF16)  # the packs not yet consumed
        l = l * corr
        m = target
        O = O + pv_part(pb, v, PV_LO, TILE_N, scratch, TILE_N, DOT_MODE)
        pf = exp2_ieee(s - m[:, None])
        if TRACE:
            record_step(TraceBuf, slot, t0 + t, n_trace_steps, yes, m, mt, vote, fire, swept, corr,
                        l, O, N_FIELDS)

    # Epilogue: the last three tiles, always eager.
    mt = m
    corr = ones
    for t in range(N - 3, N):
        l = l + tl.sum(pf, axis=1)
        pg, row0, unb = _page(BlockTable, bt_row, t0 + t - 1, n_pages, TILE_N, PAGED)
        v = _v_tile(v_base + pg * stride_vb, row0, unb, stride_vs, stride_vd, t0 + t - 1, Skv,
                    HEAD_DIM, TILE_N, DOT_MODE)
        O = O + dot16(_round_pack(pf, IS_BF16), v, scratch, DOT_MODE)
        pg, row0, unb = _page(BlockTable, bt_row, t0 + t, n_pages, TILE_N, PAGED)
        s = _tile_scores(qs, k_base + pg * stride_kb, row0, unb, stride_ks, stride_kd, rows, t0 + t,
                         Sq, Skv, bias_base, stride_bias_q, stride_bias_k, alibi_log2, scratch,
                         HEAD_DIM, TILE_N, CAUSAL, HAS_BIAS, HAS_ALIBI, LOG2E_F32, DOT_MODE)
        mt = tl.max(s, axis=1)
        mn = fmax(m, mt)
        corr = exp2_ieee(m - mn)
        m = mn
        pf = exp2_ieee(s - m[:, None])
        O = O * corr[:, None]
        l = l * corr
        if TRACE:  # the last tile is recorded after the tail below
            record_step(TraceBuf, slot, t0 + t, n_trace_steps, rows * 0 + t < N - 1, m, mt, no, no, no,
                        corr, l, O, N_FIELDS)
    l = l + tl.sum(pf, axis=1)
    pg, row0, unb = _page(BlockTable, bt_row, t0 + N - 1, n_pages, TILE_N, PAGED)
    v = _v_tile(v_base + pg * stride_vb, row0, unb, stride_vs, stride_vd, t0 + N - 1, Skv, HEAD_DIM,
                TILE_N, DOT_MODE)
    O = O + dot16(_round_pack(pf, IS_BF16), v, scratch, DOT_MODE)
    if HAS_SINK:
        if not SPLIT:  # (split-K folds the sink in once, in the combine)
            # the sink is one more logit in the denominator, with no value row
            sk = tl.where(yes, tl.load(Sink + h) * LOG2E_F32, 0.0)
            mn = fmax(m, sk)
            corr = exp2_ieee(m - mn)
            O = O * corr[:, None]
            l = l * corr + exp2_ieee(sk - mn)
            m = mn
    if TRACE:
        record_step(TraceBuf, slot, t0 + N - 1, n_trace_steps, yes, m, mt, no, no, no, corr, l, O,
                    N_FIELDS)

    # Guarded rcp (0 when l <= 0 or NaN); LSE in natural log, -inf when l == 0.
    rcp = tl.where(l > 0, tl.math.div_rn(tl.full([ROWS], 1.0, tl.float32), l), 0.0)
    out = _round_pack(O * rcp[:, None], IS_BF16)
    o_ptrs = (Out + split * stride_o_split + b * stride_ob + h * stride_oh
              + qrows64[:, None] * stride_os + offs_d[None, :] * stride_od)
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    ml_off = split * stride_l_split + b * stride_lb + h * stride_lh + rows64
    if SPLIT:
        tl.store(Lse + ml_off, m, mask=row_ok)
        tl.store(PartL + ml_off, l, mask=row_ok)
    else:
        lse = tl.where(l == 0, float("-inf"), m * LN2_F32 + tl.log(l))
        tl.store(Lse + ml_off, lse, mask=row_ok)


def _check_mods(q, bias, alibi_slopes, sink, num_kv_splits, *, bias_shape, batch):
    """bias ``bias_shape`` in q's dtype, ALiBi slopes [H] or [batch, H] and sink [H] fp32,
    the split count: what a direct caller could get wrong (the api checks the same before
    dispatch)."""
    H = q.shape[-2]
    if bias is not None:
        check_mod("bias", bias, [bias_shape], q.dtype, q.device)
        if any(st < 0 for st in bias.stride()):
            raise ValueError(f"bias has a negative stride {bias.stride()}")
    if alibi_slopes is not None:
        check_mod("alibi_slopes", alibi_slopes, [(H,), (batch, H)], torch.float32, q.device)
    if sink is not None:
        check_mod("sink", sink, [(H,)], torch.float32, q.device)
    if isinstance(num_kv_splits, bool) or not isinstance(num_kv_splits, int):
        raise TypeError(f"num_kv_splits must be an int, got {type(num_kv_splits).__name__}")
    if not 1 <= num_kv_splits <= GRID_Y_MAX:
        raise ValueError(f"num_kv_splits must be >= 1 (and at most {GRID_Y_MAX}), got {num_kv_splits}")


def _check_inputs(q, k, v, causal, policy, recorder, interpret, batch_heads=None):
    """What a direct caller could get wrong (the api checks the rest before dispatch)."""
    B, Sq, H, D, Skv, Hkv = check_qkv(q, k, v, dtypes=_DTYPES, head_dims=(64, 128),
                                      kernel="the swp_bf16 kernel")
    check_launch((q, k, v), ("q", "k", "v"), batch_heads=batch_heads or B * H, causal=causal,
                 recorder=recorder, interpret=interpret)
    check_policy(policy, FAMILY, "faithful")


def _launch_forward(q, k, v, out, lse, *, grid, rows, causal, policy, interpret, Sq, Skv,
                    varlen=None, bias=None, alibi_slopes=None, sink=None, split=None, trace=None,
                    block_table=None):
    """One launch of ``_swp_bf16_fwd``. q, k, v, out are [B, S, H, D] (varlen: [1, total, H,
    D] views whose batch index the kernel ignores); lse [B, H, Sq]. ``varlen``: (cu_q,
    cu_kv) int32; ``split``: (num_splits, part_l) with out/lse the partial O and m."""
    H, D = q.shape[2], q.shape[3]
    Hkv = k.shape[2]
    dev = q.device
    dummy_f = torch.empty(1, dtype=torch.float32, device=dev)
    dummy_i = torch.empty(1, dtype=torch.int32, device=dev)
    qkvo_strides = [list(x.stride()) for x in (q, k, v)]
    o_strides = list(out.stride())
    if split is None:
        o_strides = [0, *o_strides]  # no split dimension
        l_strides = [0, *lse.stride()[:2]]
        n_splits, part_l = 1, dummy_f
    else:
        n_splits, part_l = split
        l_strides = list(lse.stride()[:3])
    if varlen is not None:  # the program's sequence offsets replace the batch strides
        for st in qkvo_strides:
            st[0] = 0
        o_strides[1] = 0
    cu_q, cu_kv = varlen if varlen is not None else (dummy_i, dummy_i)
    if alibi_slopes is not None:
        alibi_strides = (alibi_slopes.stride(0), alibi_slopes.stride(1)) if alibi_slopes.dim() == 2 \
            else (0, alibi_slopes.stride(0))
    else:
        alibi_strides = (0, 0)
    bias_strides = bias.stride() if bias is not None else (0, 0)
    slots = trace.slots if trace else dummy_i
    buf = trace.buf if trace else dummy_f
    codes = policy.codes
    scratch, dot_meta = launch_dots(_swp_bf16_fwd, interpret, grid, rows, D, BLOCK_N, dev)
    device_ctx = torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()
    with device_ctx:
        launch(
            _swp_bf16_fwd, grid, interpret,
            q, k, v, out, lse, part_l, slots, buf,
            bias if bias is not None else dummy_f,
            alibi_slopes if alibi_slopes is not None else dummy_f,
            sink.contiguous() if sink is not None else dummy_f,
            cu_q, cu_kv, scratch,
            block_table if block_table is not None else dummy_i,
            block_table.stride(0) if block_table is not None else 0,
            *qkvo_strides[0], *qkvo_strides[1], *qkvo_strides[2], *o_strides, *l_strides,
            *bias_strides, *alibi_strides,
            H, H // Hkv, Sq, Skv, trace.n_steps if trace else 1, n_splits,
            softmax_scale_log2(D), f32(codes.threshold), f32(codes.bound), codes.vote, codes.rebase,
            HEAD_DIM=D, CAUSAL=causal,
            IS_BF16=q.dtype == torch.bfloat16, TRACE=trace is not None, ROWS=rows, WAVE=WAVE_ROWS,
            BLOCK_ROWS=BLOCK_M, TILE_N=BLOCK_N, PV_LO=PV_SPLIT, N_FIELDS=_N_FIELDS,
            FLOOR=CAUSAL_FLOOR, LN2_F32=f32(LN2), LOG2E_F32=f32(LOG2E),
            HAS_BIAS=bias is not None, HAS_ALIBI=alibi_slopes is not None,
            HAS_SINK=sink is not None, SPLIT=split is not None, VARLEN=varlen is not None,
            PAGED=block_table is not None,
            **dot_meta,
            # every fp32 operation rounds once, as in the model (Triton fuses a * b + c)
            enable_fp_fusion=False,
        )


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
            policy: Policy, recorder: TraceRecorder | None = None, interpret: bool = False,
            rows_per_program: int | None = None, bias: torch.Tensor | None = None,
            alibi_slopes: torch.Tensor | None = None, sink: torch.Tensor | None = None,
            num_kv_splits: int = 1, paged=None):
    """q [B, Sq, H, D], k and v [B, Skv, Hkv, D], bf16 or f16, any strides; or, with
    ``paged`` (a ``fa_lab.paged.PagedKV``, checked by ``fa_lab.paged.check``), k and v the
    page cache, each KV tile read through the block table in the kernel (a vectorized
    cache is relaid out as linear first: the same elements).

    Returns (out [B, Sq, H, D] in q's dtype, lse [B, H, Sq] fp32, natural log), as
    ``fa_lab.kernels.swp_bf16.model.forward``, with the same optional ``bias`` [Sq, Skv] (q's
    dtype), ``alibi_slopes`` [H] or [B, H] and ``sink`` [H] (fp32), natural-log units, and
    ``num_kv_splits`` (split-K with its combine pass). ``interpret=True`` runs Triton's
    interpreter on CPU tensors; otherwise the compiled kernel runs on CUDA/ROCm tensors.
    ``rows_per_program``: query rows per Triton program, whole waves inside one 256-row
    block (32, 64, 128 or 256); the default is 256 in the interpreter (fewer, larger steps
    run faster there) and 64 compiled. Results do not depend on it:
    the ballot only reads a wave's own rows.
    """
    if paged is not None:
        if not isinstance(paged, PagedKV):
            raise TypeError(f"paged must be a fa_lab.paged.PagedKV, got {type(paged).__name__}")
        k, v = paged.linear(k, v)
        Skv = paged.seqlen_kv
        # (q, k, v checked as a dense call would see them: one page per batch entry)
        nb = q.shape[0] if isinstance(q, torch.Tensor) and q.dim() == 4 else 1
        _check_inputs(q, k[:1].expand(nb, *k.shape[1:]), v[:1].expand(nb, *v.shape[1:]), causal,
                      policy, recorder, interpret)
    else:
        _check_inputs(q, k, v, causal, policy, recorder, interpret)
        Skv = k.shape[1]
    B, Sq, H, D = q.shape
    _check_mods(q, bias, alibi_slopes, sink, num_kv_splits, bias_shape=(Sq, Skv), batch=B)
    rows = _rows_per_program(interpret, rows_per_program)
    dev = q.device
    out = torch.empty(B, Sq, H, D, dtype=q.dtype, device=dev)
    lse = torch.empty(B, H, Sq, dtype=torch.float32, device=dev)

    traced = None
    if recorder is not None:
        traced = TracePlan(recorder, (B, H, Sq), _trace_schedule(Sq, Skv, causal, num_kv_splits), dev)
    grid = (padded_rows(Sq) // rows, B * H, num_kv_splits)
    kw = dict(grid=grid, rows=rows, causal=causal, policy=policy, interpret=interpret, Sq=Sq,
              Skv=Skv, bias=bias, alibi_slopes=alibi_slopes, trace=traced,
              block_table=None if paged is None else paged.block_table)
    if num_kv_splits == 1:
        _launch_forward(q, k, v, out, lse, sink=sink, **kw)
    else:
        part_o, part_m, part_l = combine.partials(num_kv_splits, B, Sq, H, D, q.dtype, dev)
        _launch_forward(q, k, v, part_o, part_m, split=(num_kv_splits, part_l), **kw)
        combine.combine(part_o, part_m, part_l, sink, out, lse, rows=rows, interpret=interpret)
    if traced is not None:
        traced.emit(out, lse)
    return out, lse


def forward_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   cu_seqlens_kv: torch.Tensor, max_seqlen_q: int, max_seqlen_kv: int | None = None,
                   *, causal: bool, policy: Policy, interpret: bool = False,
                   rows_per_program: int | None = None, bias: torch.Tensor | None = None,
                   alibi_slopes: torch.Tensor | None = None, sink: torch.Tensor | None = None):
    """Packed sequences in one launch: q [total_q, H, D], k and v [total_kv, Hkv, D];
    sequence b owns q rows cu_seqlens_q[b]:cu_seqlens_q[b+1] and the matching kv rows
    (``fa_lab.varlen``). Each sequence runs exactly as a dense call of its own: its own
    256-row blocks and waves, causal diagonal and ALiBi distances. ``bias`` is
    [total_q, max_seqlen_kv] (global q rows, the sequence's own key columns); ALiBi slopes
    [H] or [B, H]; ``sink`` [H]. Returns (out [total_q, H, D], lse [B, H, max_seqlen_q]),
    out 0 and lse -inf past each sequence and for sequences without keys.
    """
    from fa_lab import varlen

    if not isinstance(v, torch.Tensor) or v.dim() != 3:  # (varlen.check checks q and k)
        shape = list(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
        raise ValueError(f"varlen v must be packed [total, H, D], got {shape}")
    packing = varlen.check(q, k, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv)
    if packing is None:
        raise ValueError("forward_varlen needs cu_seqlens_q and cu_seqlens_kv")
    nseq, H = packing.batch, q.shape[1]
    _check_inputs(q[None], k[None], v[None], causal, policy, None, interpret, batch_heads=nseq * H)
    _check_mods(q, bias, alibi_slopes, sink, 1, bias_shape=(q.shape[0], packing.max_seqlen_kv),
                batch=nseq)
    rows = _rows_per_program(interpret, rows_per_program)
    dev = q.device
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    lse = torch.full((nseq, H, packing.max_seqlen_q), float("-inf"), dtype=torch.float32, device=dev)
    grid = (padded_rows(packing.max_seqlen_q) // rows, nseq * H, 1)
    if grid[0] > 0:
        _launch_forward(q[None], k[None], v[None], out[None], lse, grid=grid, rows=rows,
                        causal=causal, policy=policy, interpret=interpret,
                        Sq=packing.max_seqlen_q, Skv=packing.max_seqlen_kv,
                        varlen=(cu_seqlens_q, cu_seqlens_kv), bias=bias,
                        alibi_slopes=alibi_slopes, sink=sink)
    return out, lse


def _trace_schedule(Sq, Skv, causal, num_kv_splits):
    """A traced row's steps, (first column, phase), as the model records them: its block's
    N tiles, each split (split-K) with its own prologue, loop and eager epilogue."""

    def schedule(key):
        n = tiles_for_block(key[2] // BLOCK_M * BLOCK_M, Sq, Skv, causal)
        ranges = [(0, n)] if num_kv_splits == 1 else split_ranges(n, num_kv_splits)
        steps = []
        for t0, t_end in ranges:
            for t in range(t_end - t0):
                phase = "prologue" if t == 0 else ("loop" if t <= t_end - t0 - 4 else "epilogue")
                steps.append(((t0 + t) * BLOCK_N, phase))
        return steps

    return schedule
