"""Faithful Triton port of the generic bf16/f16 forward (``flash_attn_generic.py``,
gfx942 and gfx950).

Same semantics as ``fa_lab.kernels.generic.model`` (docs/semantics.md §4), step for step.
Eager only, no ballot, so every query row is independent: one program per (batch, head,
run of rows inside one q-block of BLOCK_M rows); the q-block only decides how many
64-column subtiles the rows visit and which padding rows exist. Per subtile, with
c = f32(sm_scale * log2 e) and S the raw fp32 scores Q K^T:

  m_new = fmax(m, rowmax(S))                 causal: fmax(., -3e38)
  corr  = exp2((m - m_new) * c)
  P     = exp2(fma(S, c, -(m_new * c)))      one rounding (tl.fma)
  l     = corr * l + sum(P)
  O     = O * corr + pack(P) @ V             bf16: low 16 bits dropped; f16: RNE
  out   = round(O * rcp(l)) (rcp guarded by l > 0 when causal); LSE = m * sm_scale + ln l

Geometry, from the model: BLOCK_M and the outer KV step from ``launch_tile`` (``num_cus``
moves them), causal q-blocks stop at ``kv_upper`` rounded up to whole outer steps, and
the padding-column mask is skipped by upstream's rule (``skips_kv_pad_mask``: non-causal
with Sq % 64 == 0) unless ``skip_kv_pad_mask`` forces the build. K/V rows past Skv are
clamped to row Skv - 1 on the 64-column step and read as zeros on the 128-column step.

Numerics: every dot is ``_triton.dots.dot16``: interpreted, the model's exact sum (fp64,
rounded once); compiled, 16-bit tensor-core dots (fp32 accumulation in the hardware's
order, from a run-time zero so that Triton cannot fold O into it), or the exact sum
again inside ``fa_lab.kernels.exact_dots()`` (slow); the packed P is exactly
representable in the input dtype. Compiled, no other a * b + c is fused
(enable_fp_fusion=False); the exp2 argument is an explicit fma (``fma_f32``; through fp64
on interpreters whose tl.fma rounds twice, as the model emulates it). The row max
propagates NaN, as the model's torch.amax. exp2 is ``exp2_ieee`` (subnormals kept).

``forward(..., recorder=...)`` also writes, for the traced rows only, the model's
per-subtile record (phase "tile"; m and mt in log2 units, m * c).
"""

from __future__ import annotations

import contextlib
import math
import warnings

import torch
import triton
import triton.language as tl

from fa_lab.checks import check_qkv
from fa_lab.kernels.generic.model import (KERNEL, MI355X_CUS, kv_upper, launch_tile, scale_constants,
                                   skips_kv_pad_mask)
from fa_lab.kernels._common.geometry import BLOCK_N
from fa_lab.numerics import CAUSAL_FLOOR
from fa_lab.trace import TraceRecorder

from .._triton.dots import dot16, launch_dots, load16, program_scratch
from .._triton.faithful import record_step
from .._triton.trace_plan import N_FIELDS, TracePlan
from .._triton.util import (check_launch, exp2_ieee, fma_f32, fma_via_fp64, fmax, launch,
                           round_bf16, round_f16, rows_per_program as _rows_per_program)

__all__ = ["KERNEL", "forward"]
_DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _pack_p(p, IS_BF16: tl.constexpr):
    """The P pack: bf16 by truncation (v_perm_b32 keeps the high halves), f16 RNE."""
    if IS_BF16:
        r = ((p.to(tl.uint32, bitcast=True) >> 16) << 16).to(tl.float32, bitcast=True)
    else:
        r = round_f16(p)
    return r


@triton.jit
def _round_out(x, IS_BF16: tl.constexpr):
    """The output conversion, round to nearest even (cvt_pk_bf16_f32 / f16 convert)."""
    if IS_BF16:
        r = round_bf16(x)
    else:
        r = round_f16(x)
    return r


# Lengths and head counts vary from call to call: one compiled kernel serves them all.
@triton.jit(do_not_specialize=["H", "G", "Sq", "Skv", "n_trace_steps"])
def _generic_fwd(
    Q, K, V, Out, Lse, TraceSlot, TraceBuf, Scratch,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ob, stride_os, stride_oh, stride_od,
    H, G, Sq, Skv, n_trace_steps,
    c, sm_scale,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, SKIP_PAD_MASK: tl.constexpr,
    CLAMP_KV: tl.constexpr, IS_BF16: tl.constexpr, TRACE: tl.constexpr,
    FMA_VIA_FP64: tl.constexpr, ROWS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    KV_STEP: tl.constexpr, TILE_N: tl.constexpr, N_FIELDS: tl.constexpr, FLOOR: tl.constexpr,
    DOT_MODE: tl.constexpr, SCRATCH_FLOATS: tl.constexpr,
):
    chunk = tl.program_id(0)  # ROWS consecutive query rows of one BLOCK_ROWS q-block
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    hkv = (h // G).to(tl.int64)
    h = h.to(tl.int64)
    scratch = program_scratch(Scratch, SCRATCH_FLOATS, DOT_MODE)
    rows = chunk * ROWS + tl.arange(0, ROWS)  # global query rows, padding rows included
    row_ok = rows < Sq
    rows64 = rows.to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, TILE_N)

    # Subtiles visited: causal q-blocks stop at kv_upper, rounded up to whole outer steps.
    q0 = (chunk * ROWS // BLOCK_ROWS) * BLOCK_ROWS
    upper = Skv
    if CAUSAL:
        upper = tl.minimum(tl.maximum(q0 + BLOCK_ROWS + Skv - Sq, 0), Skv)
    n_sub = (upper + KV_STEP - 1) // KV_STEP * (KV_STEP // TILE_N)

    # Raw Q (not pre-scaled); padding rows read Q = 0.
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows64[:, None] * stride_qs
                + offs_d[None, :] * stride_qd, mask=row_ok[:, None], other=0.0).to(tl.float32)
    k_base = K + b * stride_kb + hkv * stride_kh
    v_base = V + b * stride_vb + hkv * stride_vh
    c_tile = tl.full([ROWS, TILE_N], 0.0, tl.float32) + c  # the fma's multiplier, full shape

    if TRACE:
        slot = tl.load(TraceSlot + (b * H + h) * Sq + rows64, mask=row_ok, other=-1)
    no = rows < 0  # vote, fire, swept: always False (no ballot)
    yes = rows >= 0

    m = tl.full([ROWS], float("-inf"), tl.float32)
    l = tl.zeros([ROWS], dtype=tl.float32)
    O = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    for t in range(n_sub):
        cols = t * TILE_N + offs_n
        if CLAMP_KV:  # 64-column step: rows past Skv read row Skv - 1 (kv_row_clamp)
            kv_rows = tl.minimum(cols, Skv - 1).to(tl.int64)
            kv_ok = cols >= 0
        else:  # 128-column step (DMA): rows past Skv read 0
            kv_rows = cols.to(tl.int64)
            kv_ok = cols < Skv
        kt = load16(k_base + kv_rows[None, :] * stride_ks + offs_d[:, None] * stride_kd,
                    kv_ok[None, :], DOT_MODE)
        s = dot16(q, kt, scratch, DOT_MODE)
        if CAUSAL:  # bottom-right aligned; covers every padding column of a real row
            s = tl.where(cols[None, :] > rows[:, None] + (Skv - Sq), float("-inf"), s)
        elif not SKIP_PAD_MASK:
            s = tl.where((cols >= Skv)[None, :] & yes[:, None], float("-inf"), s)
        # tl.max skips NaN (maxNum compiled, nanmax-like interpreted); torch.amax does not.
        has_nan = tl.max((s != s).to(tl.int32), axis=1) > 0
        mt = tl.where(has_nan, float("nan"), tl.max(s, axis=1))
        m_new = fmax(m, mt)
        if CAUSAL:
            m_new = fmax(m_new, tl.full([ROWS], FLOOR, tl.float32))
        corr = exp2_ieee((m - m_new) * c)
        addend = tl.broadcast_to((-(m_new * c))[:, None], [ROWS, TILE_N])
        p = exp2_ieee(fma_f32(s, c_tile, addend, FMA_VIA_FP64))
        l = corr * l + tl.sum(p, axis=1)
        v = load16(v_base + kv_rows[:, None] * stride_vs + offs_d[None, :] * stride_vd,
                   kv_ok[:, None], DOT_MODE)
        O = O * corr[:, None] + dot16(_pack_p(p, IS_BF16), v, scratch, DOT_MODE)
        m = m_new
        if TRACE:
            record_step(TraceBuf, slot, t, n_trace_steps, yes, m * c, mt * c, no, no, no, corr, l, O,
                        N_FIELDS)

    # rcp(l) is guarded by l > 0 in causal builds only; LSE has no guard (-inf at l = 0).
    one = tl.full([ROWS], 1.0, tl.float32)
    if CAUSAL:
        rcp = tl.where(l > 0, tl.math.div_rn(one, l), 0.0)
    else:
        rcp = tl.math.div_rn(one, l)
    out = _round_out(O * rcp[:, None], IS_BF16)
    tl.store(Out + b * stride_ob + h * stride_oh + rows64[:, None] * stride_os
             + offs_d[None, :] * stride_od, out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    tl.store(Lse + (b * H + h) * Sq + rows64, m * sm_scale + tl.log(l), mask=row_ok)


def _check_inputs(q, k, v, causal, skip_kv_pad_mask, num_cus, recorder, interpret):
    """What a direct caller could get wrong (the api checks the rest before dispatch)."""
    B, Sq, H, D, Skv, Hkv = check_qkv(q, k, v, dtypes=_DTYPES, head_dims=(64, 128),
                                      kernel="the generic kernel")
    check_launch((q, k, v), ("q", "k", "v"), batch_heads=B * H, causal=causal,
                 recorder=recorder, interpret=interpret)
    if skip_kv_pad_mask is not None and not isinstance(skip_kv_pad_mask, bool):
        raise TypeError(f"skip_kv_pad_mask must be a bool or None, got {type(skip_kv_pad_mask).__name__}")
    if isinstance(num_cus, bool) or not isinstance(num_cus, int) or num_cus < 1:
        raise ValueError(f"num_cus must be a positive int, got {num_cus!r}")


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
            recorder: TraceRecorder | None = None, skip_kv_pad_mask: bool | None = None,
            num_cus: int = MI355X_CUS, interpret: bool = False,
            rows_per_program: int | None = None):
    """q [B, Sq, H, D], k and v [B, Skv, Hkv, D], bf16 or f16, D 64 or 128, any strides.

    Returns (out [B, Sq, H, D] in q's dtype, lse [B, H, Sq] fp32, natural log), as
    ``fa_lab.kernels.generic.model.forward`` with the same ``skip_kv_pad_mask`` (None: upstream's
    dispatch) and ``num_cus`` (moves the tile choice). ``interpret=True`` runs Triton's
    interpreter on CPU tensors; otherwise the compiled kernel runs on CUDA/ROCm tensors.
    ``rows_per_program``: query rows per program (32, 64, 128 or 256, capped at the
    q-block's BLOCK_M); default the whole q-block interpreted, 32 compiled. Results do not
    depend on it: rows are independent.
    """
    _check_inputs(q, k, v, causal, skip_kv_pad_mask, num_cus, recorder, interpret)
    B, Sq, H, D = q.shape
    Skv, Hkv = k.shape[1], k.shape[2]
    dev = q.device
    tile = launch_tile(B, Sq, H, D, causal, num_cus)
    skip = skips_kv_pad_mask(Sq, causal) if skip_kv_pad_mask is None else skip_kv_pad_mask
    skip = skip and not causal  # causal builds never take the pad-mask branch
    sm_scale, c = scale_constants(D)
    out = torch.empty(B, Sq, H, D, dtype=q.dtype, device=dev)
    lse = torch.empty(B, H, Sq, dtype=torch.float32, device=dev)

    plan = None
    if recorder is not None:
        per_step = tile.kv_step // BLOCK_N

        def schedule(key):
            q0 = key[2] // tile.block_m * tile.block_m
            upper = kv_upper(q0, tile.block_m, Sq, Skv, causal)
            n_sub = math.ceil(upper / tile.kv_step) * per_step
            return [(t * BLOCK_N, "tile") for t in range(n_sub)]

        plan = TracePlan(recorder, (B, H, Sq), schedule, dev)
    slots = plan.slots if plan else torch.empty(1, dtype=torch.int32, device=dev)
    buf = plan.buf if plan else torch.empty(1, dtype=torch.float32, device=dev)

    rows = min(_rows_per_program(interpret, rows_per_program), tile.block_m)
    grid = (math.ceil(Sq / tile.block_m) * tile.block_m // rows, B * H)
    scratch, dot_meta = launch_dots(_generic_fwd, interpret, grid, rows, D, BLOCK_N, dev)
    device_ctx = torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()
    with device_ctx, warnings.catch_warnings():
        warnings.filterwarnings("ignore", "All-NaN slice", RuntimeWarning)  # NaN rows, numpy
        launch(
            _generic_fwd, grid, interpret,
            q, k, v, out, lse, slots, buf, scratch,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(),
            H, H // Hkv, Sq, Skv, plan.n_steps if plan else 1,
            c, sm_scale,
            HEAD_DIM=D, CAUSAL=causal, SKIP_PAD_MASK=skip, CLAMP_KV=tile.kv_step == BLOCK_N,
            IS_BF16=q.dtype == torch.bfloat16, TRACE=plan is not None,
            FMA_VIA_FP64=fma_via_fp64(_generic_fwd, interpret), ROWS=rows,
            BLOCK_ROWS=tile.block_m, KV_STEP=tile.kv_step, TILE_N=BLOCK_N, N_FIELDS=N_FIELDS,
            FLOOR=CAUSAL_FLOOR, **dot_meta,
            # every fp32 operation rounds once, as in the model (Triton fuses a * b + c)
            enable_fp_fusion=False,
        )
    if plan is not None:
        plan.emit(out, lse)
    return out, lse
