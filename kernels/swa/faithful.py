"""Faithful Triton port of the gfx950 GQA sliding-window kernel (``swa_gfx950.py``).

Same semantics as ``fa_lab.kernels.swa.model`` (docs/semantics.md §5), decision for
decision. One program per (batch, head, run of whole 32-row waves inside one 256-row
CTA): one wave compiled, the whole CTA in the interpreter; either is exact because the
ballot is a vote of a wave's own 32 rows. Each program walks its CTA's band of nt KV
tiles of 64 columns from column ``base`` (the model's ``cta_band``, computed here in the
kernel), in the DUALWAVE_SWP order:

  prologue (tile 0)  m = rowmax(S_0), floored at -30 with a window; Pf = exp2(S_0 - m)
  loop (1..nt-4)     l += sum(Pf); Pb = bf16(Pf); O += Pb[:, :16] @ V[:16]
                     rescale_defer: mt = rowmax(S_t) (floored); the wave fires if any row
                     votes (lazy: fmax(mt, m) - m > THR; lazy_unfixed: mt - m > THR), and
                     its rows move to fmax(mt, m) (lazy) or mt (lazy_unfixed)
                     O *= corr; O += bf16(Pb[:, 16:] * corr) @ V[16:]; l *= corr
                     Pf = exp2(S_t - m)
  epilogue (nt-3..)  always eager (rescale_uncond); the tail PV step folds into the last tile

Scores are in log2 units: Q is pre-scaled by the kernel's temperature constant and
rounded to bf16 (RNE) once. Masked scores (outside i - LEFT <= j <= i + RIGHT) are -inf.
Out = bf16(O * rcp(l)), rcp guarded by l > 0 with a window only; LSE (the model's
read-out) = m ln 2 + ln l, -inf where l = 0.

Numerics: every dot is ``_triton.dots.dot16``: interpreted, the model's exact sum (fp64,
rounded once); compiled, 16-bit tensor-core dots (fp32 accumulation in the hardware's
order, from a run-time zero so that Triton cannot fold O into it), or the exact sum
again inside ``fa_lab.kernels.exact_dots()`` (slow);
roundings to bf16 are explicit (the interpreter's conversion truncates); maxima are maxNum
and the row max propagates NaN as the model's torch.amax; compiled, no a * b + c is fused.

``forward(..., recorder=...)`` also writes, for the traced rows only, the model's per-tile
record (col0 = the tile's first global column, mt = the floored tile max).
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import triton
import triton.language as tl

from fa_lab.capabilities import check_policy
from fa_lab.kernels._common.geometry import BLOCK_N, PV_SPLIT, WAVE_ROWS
from fa_lab.kernels.swa import FAMILY
from fa_lab.kernels.swa.model import (CTA_ROWS, KERNEL, NEG_FLOOR, check_args,
                               cta_band, nt_band, temperature_scale)
from fa_lab.numerics import LN2, f32
from fa_lab.trace import TraceRecorder

from .._triton.dots import dot16, launch_dots, load16, program_scratch
from .._triton.faithful import pv_part, record_step, wave_ballot
from .._triton.trace_plan import N_FIELDS, TracePlan
from .._triton.util import (check_launch, exp2_ieee, fmax, launch, round_bf16,
                           rows_per_program as _rows_per_program)

__all__ = ["KERNEL", "forward"]


@triton.jit
def _scores(qs, k_base, stride_ks, stride_kd, rows, col0, S, left, right, scratch,
            HEAD_DIM: tl.constexpr, TILE_N: tl.constexpr, WINDOWED: tl.constexpr,
            FLOOR: tl.constexpr, DOT_MODE: tl.constexpr):
    """S_t = Qs @ K_t^T [ROWS, TILE_N] (log2 units), -inf outside the window, and its row
    max: NaN-propagating (torch.amax), floored at FLOOR with a window (maxNum: a NaN max
    becomes the floor, as in the model)."""
    cols = col0 + tl.arange(0, TILE_N)
    offs_d = tl.arange(0, HEAD_DIM)
    # The band lies inside [0, S); the mask only guards against reading past it.
    kt = load16(k_base + cols.to(tl.int64)[None, :] * stride_ks + offs_d[:, None] * stride_kd,
                (cols < S)[None, :], DOT_MODE)
    s = dot16(qs, kt, scratch, DOT_MODE)
    if WINDOWED:
        rel = cols[None, :] - rows[:, None]
        s = tl.where((rel < -left) | (rel > right), float("-inf"), s)
    has_nan = tl.max((s != s).to(tl.int32), axis=1) > 0
    mt = tl.where(has_nan, float("nan"), tl.max(s, axis=1))
    if WINDOWED:
        mt = fmax(mt, tl.zeros_like(mt) + FLOOR)
    return s, mt


@triton.jit
def _v_tile(v_base, stride_vs, stride_vd, col0, S, HEAD_DIM: tl.constexpr, TILE_N: tl.constexpr,
            DOT_MODE: tl.constexpr):
    """V rows col0 ... col0 + 63 [TILE_N, HEAD_DIM] (see ``_triton.dots.load16``)."""
    cols = col0 + tl.arange(0, TILE_N)
    offs_d = tl.arange(0, HEAD_DIM)
    return load16(v_base + cols.to(tl.int64)[:, None] * stride_vs + offs_d[None, :] * stride_vd,
                  (cols < S)[:, None], DOT_MODE)


# Lengths and head counts vary from call to call: one compiled kernel serves them all.
@triton.jit(do_not_specialize=["H", "G", "S", "left", "right", "nt_max", "n_trace_steps"])
def _swa_fwd(
    Q, K, V, Out, Lse, TraceSlot, TraceBuf, Scratch,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ob, stride_os, stride_oh, stride_od,
    H, G, S, left, right, nt_max, n_trace_steps,
    temp_scale, threshold,
    HEAD_DIM: tl.constexpr, WINDOWED: tl.constexpr, REBASE: tl.constexpr, TRACE: tl.constexpr,
    ROWS: tl.constexpr, WAVE: tl.constexpr, CTA: tl.constexpr, TILE_N: tl.constexpr,
    PV_LO: tl.constexpr, N_FIELDS: tl.constexpr, FLOOR: tl.constexpr, LN2_F32: tl.constexpr,
    DOT_MODE: tl.constexpr, SCRATCH_FLOATS: tl.constexpr,
):
    chunk = tl.program_id(0)  # ROWS consecutive query rows: whole waves of one CTA
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    hkv = (h // G).to(tl.int64)
    h = h.to(tl.int64)
    scratch = program_scratch(Scratch, SCRATCH_FLOATS, DOT_MODE)
    rows = chunk * ROWS + tl.arange(0, ROWS)  # S is a multiple of 256: every row is real
    rows64 = rows.to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)

    # The CTA's band (swa_gfx950.py l.443-464): base column and tile count nt.
    q0 = (chunk * ROWS // CTA) * CTA
    if WINDOWED:
        left_edge = tl.maximum(q0 - left, 0)
        right_edge = tl.minimum(q0 + (CTA - 1) + right, S - 1)
        base0 = left_edge // TILE_N * TILE_N
        span = (right_edge - base0 + TILE_N) // TILE_N
        nt = tl.minimum(tl.maximum((span + 3) // 4 * 4, 4), nt_max)
        base = tl.maximum(tl.minimum(base0, S - nt * TILE_N), 0)
    else:
        base = q0 * 0
        nt = S // TILE_N

    # Q pre-scaled into log2 units and rounded to bf16 once.
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows64[:, None] * stride_qs
                + offs_d[None, :] * stride_qd).to(tl.float32)
    qs = round_bf16(q * temp_scale)
    k_base = K + b * stride_kb + hkv * stride_kh
    v_base = V + b * stride_vb + hkv * stride_vh

    if TRACE:
        slot = tl.load(TraceSlot + (b * H + h) * S + rows64)
    no = rows < 0  # all False: vote/fire/swept outside the loop
    yes = rows >= 0

    # Prologue: tile 0 sets the first base.
    s, m = _scores(qs, k_base, stride_ks, stride_kd, rows, base, S, left, right, scratch,
                   HEAD_DIM, TILE_N, WINDOWED, FLOOR, DOT_MODE)
    pf = exp2_ieee(s - m[:, None])
    l = tl.zeros([ROWS], dtype=tl.float32)
    O = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    ones = l + 1.0
    if TRACE:
        record_step(TraceBuf, slot, 0, n_trace_steps, yes, m, m, no, no, no, ones, l, O, N_FIELDS)

    # Main loop: rescale_defer, one 32-row wave ballot per tile.
    for t in range(1, nt - 3):
        l = l + tl.sum(pf, axis=1)
        pb = round_bf16(pf)
        v = _v_tile(v_base, stride_vs, stride_vd, base + (t - 1) * TILE_N, S, HEAD_DIM, TILE_N,
                    DOT_MODE)
        O = O + pv_part(pb, v, 0, PV_LO, scratch, TILE_N, DOT_MODE)  # first PV slice, before the rescale
        s, mt = _scores(qs, k_base, stride_ks, stride_kd, rows, base + t * TILE_N, S, left,
                        right, scratch, HEAD_DIM, TILE_N, WINDOWED, FLOOR, DOT_MODE)
        if REBASE == 0:  # "max", upstream's rescale_defer: the ballot reads the monotonic target
            target = fmax(mt, m)
            vote = (target - m) > threshold  # ordered: NaN does not vote
        else:  # 1, "tile" (lazy_unfixed, the counterfactual): check_policy admits no other
            target = mt
            vote = (mt - m) > threshold
        fire = wave_ballot(vote.to(tl.int32), ROWS, WAVE)
        swept = fire & (mt < m)
        corr = tl.where(fire, exp2_ieee(m - target), 1.0)
        O = O * corr[:, None]
        pb = round_bf16(pb * corr[:, None])  # the packs not yet consumed
        l = l * corr
        m = tl.where(fire, target, m)
        O = O + pv_part(pb, v, PV_LO, TILE_N, scratch, TILE_N, DOT_MODE)
        pf = exp2_ieee(s - m[:, None])
        if TRACE:
            record_step(TraceBuf, slot, t, n_trace_steps, yes, m, mt, vote, fire, swept, corr, l, O,
                        N_FIELDS)

    # Epilogue: rescale_uncond on the last three tiles (nt >= 4: at least one).
    mt = m
    corr = ones
    for t in range(nt - 3, nt):
        l = l + tl.sum(pf, axis=1)
        v = _v_tile(v_base, stride_vs, stride_vd, base + (t - 1) * TILE_N, S, HEAD_DIM, TILE_N,
                    DOT_MODE)
        O = O + dot16(round_bf16(pf), v, scratch, DOT_MODE)
        s, mt = _scores(qs, k_base, stride_ks, stride_kd, rows, base + t * TILE_N, S, left,
                        right, scratch, HEAD_DIM, TILE_N, WINDOWED, FLOOR, DOT_MODE)
        mn = fmax(mt, m)
        corr = exp2_ieee(m - mn)
        m = mn
        pf = exp2_ieee(s - m[:, None])
        O = O * corr[:, None]
        l = l * corr
        if TRACE:  # the last tile is recorded after the tail below
            record_step(TraceBuf, slot, t, n_trace_steps, rows * 0 + t < nt - 1, m, mt, no, no, no,
                        corr, l, O, N_FIELDS)
    l = l + tl.sum(pf, axis=1)
    v = _v_tile(v_base, stride_vs, stride_vd, base + (nt - 1) * TILE_N, S, HEAD_DIM, TILE_N,
                DOT_MODE)
    O = O + dot16(round_bf16(pf), v, scratch, DOT_MODE)
    if TRACE:
        record_step(TraceBuf, slot, nt - 1, n_trace_steps, yes, m, mt, no, no, no, corr, l, O, N_FIELDS)

    # rcp guarded by l > 0 only with a window; LSE -inf where l == 0.
    one = tl.full([ROWS], 1.0, tl.float32)
    if WINDOWED:
        rcp = tl.where(l > 0, tl.math.div_rn(one, l), 0.0)
    else:
        rcp = tl.math.div_rn(one, l)
    out = round_bf16(O * rcp[:, None])
    tl.store(Out + b * stride_ob + h * stride_oh + rows64[:, None] * stride_os
             + offs_d[None, :] * stride_od, out.to(Out.dtype.element_ty))
    lse = tl.where(l == 0, float("-inf"), m * LN2_F32 + tl.log(l))
    tl.store(Lse + (b * H + h) * S + rows64, lse)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window_left: int | None,
            window_right: int = 0, causal: bool = True, threshold: float | None = None,
            rescale="lazy", recorder: TraceRecorder | None = None,
            interpret: bool = False, rows_per_program: int | None = None):
    """q [B, S, H, 128], k and v [B, S, Hkv, 128], bf16, S a multiple of 256, any strides.

    Arguments and results as ``fa_lab.kernels.swa.model.forward``: returns (out [B, S, H, 128]
    bf16, lse [B, H, S] fp32, natural log). ``interpret=True`` runs Triton's interpreter on
    CPU tensors; otherwise the compiled kernel runs on CUDA/ROCm tensors.
    ``rows_per_program``: query rows per program, whole waves of one CTA (32, 64, 128 or
    256); default 256 interpreted, 32 compiled. Results do not depend on it.
    """
    policy = check_args(q, k, v, window_left, window_right, causal, threshold, rescale)
    check_policy(policy, FAMILY, "faithful")  # the rebase codes this kernel has: its Caps
    B, S, H, D = q.shape
    Hkv = k.shape[2]
    check_launch((q, k, v), ("q", "k", "v"), batch_heads=B * H, causal=causal,
                 recorder=recorder, interpret=interpret)
    rows = _rows_per_program(interpret, rows_per_program)
    dev = q.device
    windowed = window_left is not None
    out = torch.empty(B, S, H, D, dtype=q.dtype, device=dev)
    lse = torch.empty(B, H, S, dtype=torch.float32, device=dev)

    plan = None
    if recorder is not None:
        def schedule(key):
            base, nt = cta_band(key[2] // CTA_ROWS * CTA_ROWS, S, window_left, window_right)
            return [(base + t * BLOCK_N,
                     "prologue" if t == 0 else ("loop" if t <= nt - 4 else "epilogue"))
                    for t in range(nt)]

        plan = TracePlan(recorder, (B, H, S), schedule, dev)
    slots = plan.slots if plan else torch.empty(1, dtype=torch.int32, device=dev)
    buf = plan.buf if plan else torch.empty(1, dtype=torch.float32, device=dev)

    grid = (S // rows, B * H)
    scratch, dot_meta = launch_dots(_swa_fwd, interpret, grid, rows, D, BLOCK_N, dev)
    device_ctx = torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()
    with device_ctx, warnings.catch_warnings():
        warnings.filterwarnings("ignore", "All-NaN slice", RuntimeWarning)  # NaN rows, numpy
        launch(
            _swa_fwd, grid, interpret,
            q, k, v, out, lse, slots, buf, scratch,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(),
            H, H // Hkv, S, window_left if windowed else 0, window_right,
            nt_band(window_left, window_right) if windowed else S // BLOCK_N,
            plan.n_steps if plan else 1,
            temperature_scale(D), f32(policy.threshold),
            HEAD_DIM=D, WINDOWED=windowed, REBASE=policy.codes.rebase, TRACE=plan is not None,
            ROWS=rows, WAVE=WAVE_ROWS, CTA=CTA_ROWS, TILE_N=BLOCK_N, PV_LO=PV_SPLIT,
            N_FIELDS=N_FIELDS, FLOOR=NEG_FLOOR, LN2_F32=f32(LN2),
            **dot_meta,
            # every fp32 operation rounds once, as in the model (Triton fuses a * b + c)
            enable_fp_fusion=False,
        )
    if plan is not None:
        plan.emit(out, lse)
    return out, lse
