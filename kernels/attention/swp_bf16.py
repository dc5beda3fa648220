"""Faithful Triton port of the gfx950 DUALWAVE_SWP bf16/f16 forward.

Same semantics as ``fa_lab.models.swp_bf16`` (semantics doc, section 2), decision for
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

Policies (``POLICY_CODES``): eager, lazy (PR #1033), lazy_unfixed (upstream main before
it), fa4_row (FlashAttention-4's per-row decision); the threshold is a run-time argument.

Numerics: products of 16-bit inputs are exact in fp32, so every dot is exact products
summed in fp32 in the dot's own order: compiled, a 16-bit tensor-core dot with fp32
accumulation; interpreted, fp32 operands holding 16-bit values with input_precision="ieee"
(TF32 would round them). The P split (columns 0..15, then 16..63) zeroes the other part
of both P and V, so an inf in one part never meets a zero. Roundings to bf16 are done by
bit manipulation (round to nearest even) because the interpreter's conversion truncates;
maxima use maxNum; compiled, no a * b + c is fused. Inputs are assumed finite (the
model's amax propagates a NaN score, the kernel's row max skips it).

``forward(..., recorder=...)`` also writes, for the traced rows only, the same per-tile
record as the model (``fa_lab.trace``).
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import triton
import triton.language as tl

from fa_lab.models.geometry import BLOCK_M, BLOCK_N, PV_SPLIT, WAVE_ROWS, padded_rows, tiles_for_block
from fa_lab.models.swp_bf16 import softmax_scale_log2
from fa_lab.numerics import CAUSAL_FLOOR, LN2, f32
from fa_lab.policies import RescalePolicy
from fa_lab.trace import STEP_FIELDS, TraceRecorder

from fa_lab.checks import check_qkv

from ._triton_util import (check_launch, exp2_ieee, fmax, launch, round_bf16, round_f16,
                           rows_per_program as _rows_per_program)

KERNEL = "swp_bf16"
#: The policy as the kernel's compile-time switch.
POLICY_CODES = {"eager": 0, "lazy": 1, "lazy_unfixed": 2, "fa4_row": 3}
_DTYPES = (torch.bfloat16, torch.float16)
# Per-step trace fields, in STEP_FIELDS order (m, mt, vote, fire, dragged, corr, l,
# o_finite, l_finite), stored as fp32.
_N_FIELDS = len(STEP_FIELDS)


@triton.jit
def _round_pack(x, IS_BF16: tl.constexpr):
    """The 16-bit rounding of a P pack or of Q (the kernel's input dtype)."""
    if IS_BF16:
        r = round_bf16(x)
    else:
        r = round_f16(x)
    return r


@triton.jit
def _dot16(a, b, NATIVE_DOT: tl.constexpr):
    """a @ b for fp32 operands that hold 16-bit values (bf16 or f16 in ``b``'s dtype when
    NATIVE_DOT): every product is exact in fp32 either way, the sum is fp32 in the
    hardware's order. Compiled, the 16-bit tensor-core product is that same computation
    at full speed; the interpreter takes fp32 operands (its bf16 dot is wrong)."""
    if NATIVE_DOT:
        r = tl.dot(a.to(b.dtype), b, out_dtype=tl.float32)
    else:
        r = tl.dot(a, b, input_precision="ieee")
    return r


@triton.jit
def _load16(ptrs, mask, NATIVE_DOT: tl.constexpr):
    """A K or V tile: kept 16-bit for the tensor cores, widened at once for the
    interpreter (whose bf16 arithmetic is wrong). Masked entries read 0."""
    x = tl.load(ptrs, mask=mask, other=0.0)
    if not NATIVE_DOT:
        x = x.to(tl.float32)
    return x


@triton.jit
def _tile_scores(qs, k_base, stride_ks, stride_kd, rows, t, Sq, Skv,
                 HEAD_DIM: tl.constexpr, TILE_N: tl.constexpr, CAUSAL: tl.constexpr,
                 NATIVE_DOT: tl.constexpr):
    """S_t = Qs @ K_t^T in log2 units [ROWS, TILE_N], masked columns -inf (padding
    columns >= Skv read K = 0; causal is bottom-right aligned)."""
    cols = t * TILE_N + tl.arange(0, TILE_N)
    offs_d = tl.arange(0, HEAD_DIM)
    kt = _load16(k_base + cols.to(tl.int64)[None, :] * stride_ks + offs_d[:, None] * stride_kd,
                 (cols < Skv)[None, :], NATIVE_DOT)
    s = _dot16(qs, kt, NATIVE_DOT)
    masked = (cols >= Skv)[None, :] & (rows >= 0)[:, None]  # (the & only broadcasts)
    if CAUSAL:
        masked = masked | (cols[None, :] > rows[:, None] + (Skv - Sq))
    return tl.where(masked, float("-inf"), s)


@triton.jit
def _v_tile(v_base, stride_vs, stride_vd, t, Skv, HEAD_DIM: tl.constexpr, TILE_N: tl.constexpr,
            NATIVE_DOT: tl.constexpr):
    """V_t [TILE_N, HEAD_DIM] (see ``_load16``); padding rows >= Skv read 0."""
    cols = t * TILE_N + tl.arange(0, TILE_N)
    offs_d = tl.arange(0, HEAD_DIM)
    return _load16(v_base + cols.to(tl.int64)[:, None] * stride_vs + offs_d[None, :] * stride_vd,
                   (cols < Skv)[:, None], NATIVE_DOT)


@triton.jit
def _pv_part(pb, v, lo, hi, TILE_N: tl.constexpr, NATIVE_DOT: tl.constexpr):
    """Pb[:, lo:hi] @ V[lo:hi] as a full-width dot with the other columns of P and rows of
    V zeroed: a P that is inf or NaN outside the part becomes 0, not inf * 0 = NaN."""
    k = tl.arange(0, TILE_N)
    p_in = (k >= lo) & (k < hi)
    p_part = tl.where(p_in[None, :], pb, 0.0)
    v_part = tl.where(p_in[:, None], v, tl.zeros_like(v))
    return _dot16(p_part, v_part, NATIVE_DOT)


@triton.jit
def _wave_any(flags, ROWS: tl.constexpr, WAVE: tl.constexpr):
    """The ballot: True for every row of a 32-row wave where any row's flag is nonzero."""
    waves = tl.reshape(flags, [ROWS // WAVE, WAVE])
    fired = tl.max(waves, axis=1)
    return tl.reshape(tl.broadcast_to(fired[:, None], [ROWS // WAVE, WAVE]), [ROWS]) > 0


@triton.jit
def _record(buf, slot, step, n_steps, keep, m, mt, vote, fire, dragged, corr, l, O,
            N_FIELDS: tl.constexpr):
    """Store one step of the per-row trace for the traced rows (slot >= 0)."""
    ptr = buf + (slot * n_steps + step) * N_FIELDS
    ok = (slot >= 0) & keep
    o_finite = tl.min(tl.where(tl.abs(O) < float("inf"), 1.0, 0.0), axis=1)
    l_finite = tl.where(tl.abs(l) < float("inf"), 1.0, 0.0)
    tl.store(ptr + 0, m, mask=ok)
    tl.store(ptr + 1, mt, mask=ok)
    tl.store(ptr + 2, vote.to(tl.float32), mask=ok)
    tl.store(ptr + 3, fire.to(tl.float32), mask=ok)
    tl.store(ptr + 4, dragged.to(tl.float32), mask=ok)
    tl.store(ptr + 5, corr, mask=ok)
    tl.store(ptr + 6, l, mask=ok)
    tl.store(ptr + 7, o_finite, mask=ok)
    tl.store(ptr + 8, l_finite, mask=ok)


# Lengths and head counts vary from call to call: one compiled kernel serves them all.
@triton.jit(do_not_specialize=["H", "G", "Sq", "Skv", "n_trace_steps"])
def _swp_bf16_fwd(
    Q, K, V, Out, Lse, TraceSlot, TraceBuf,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ob, stride_os, stride_oh, stride_od,
    H, G, Sq, Skv, n_trace_steps,
    scale_log2, threshold,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, POLICY: tl.constexpr, IS_BF16: tl.constexpr,
    TRACE: tl.constexpr, ROWS: tl.constexpr, WAVE: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    TILE_N: tl.constexpr,
    PV_LO: tl.constexpr, N_FIELDS: tl.constexpr, FLOOR: tl.constexpr, LN2_F32: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
):
    chunk = tl.program_id(0)  # ROWS consecutive query rows: whole waves of one block
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    hkv = (h // G).to(tl.int64)
    h = h.to(tl.int64)
    rows = chunk * ROWS + tl.arange(0, ROWS)  # global query rows, padding rows included
    row_ok = rows < Sq
    rows64 = rows.to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)

    # The block's tile count N: ceil(Skv/64), cut at the causal diagonal, even, >= 4.
    q0 = (chunk * ROWS // BLOCK_ROWS) * BLOCK_ROWS
    n_tiles = (Skv + TILE_N - 1) // TILE_N
    if CAUSAL:
        reach = tl.maximum(q0 + BLOCK_ROWS + Skv - Sq, 0)
        n_tiles = tl.minimum(n_tiles, (reach + TILE_N - 1) // TILE_N)
    N = tl.maximum(n_tiles + n_tiles % 2, 4)

    # Q pre-scaled into log2 units and rounded once; padding rows read Q = 0.
    q_ptrs = Q + b * stride_qb + h * stride_qh + rows64[:, None] * stride_qs + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0).to(tl.float32)
    qs = _round_pack(q * scale_log2, IS_BF16)
    k_base = K + b * stride_kb + hkv * stride_kh
    v_base = V + b * stride_vb + hkv * stride_vh

    if TRACE:
        slot = tl.load(TraceSlot + (b * H + h) * Sq + rows64, mask=row_ok, other=-1)
    no = rows < 0  # all False: vote/fire/dragged outside the lazy loop
    yes = rows >= 0

    # Prologue: tile 0 sets the first base.
    s = _tile_scores(qs, k_base, stride_ks, stride_kd, rows, 0, Sq, Skv, HEAD_DIM, TILE_N, CAUSAL, NATIVE_DOT)
    m = tl.max(s, axis=1)
    if CAUSAL:
        m = fmax(m, tl.full([ROWS], FLOOR, tl.float32))
    pf = exp2_ieee(s - m[:, None])
    l = tl.zeros([ROWS], dtype=tl.float32)
    O = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    ones = l + 1.0
    if TRACE:
        _record(TraceBuf, slot, 0, n_trace_steps, yes, m, m, no, no, no, ones, l, O, N_FIELDS)

    # Main loop: the only place a lazy policy decides, by a ballot of each 32-row wave.
    for t in range(1, N - 3):
        l = l + tl.sum(pf, axis=1)
        pb = _round_pack(pf, IS_BF16)
        v = _v_tile(v_base, stride_vs, stride_vd, t - 1, Skv, HEAD_DIM, TILE_N, NATIVE_DOT)
        O = O + _pv_part(pb, v, 0, PV_LO, TILE_N, NATIVE_DOT)  # first PV step, before the rescale
        s = _tile_scores(qs, k_base, stride_ks, stride_kd, rows, t, Sq, Skv, HEAD_DIM, TILE_N, CAUSAL, NATIVE_DOT)
        mt = tl.max(s, axis=1)  # masked, not floored: may be -inf
        if POLICY == 0:  # eager: every row to fmax(m, mt)
            target = fmax(m, mt)
            corr = exp2_ieee(m - target)
            vote = no
            fire = no
        else:
            vote_i = tl.where(mt - m <= threshold, 0, 1)  # NaN difference votes
            fire = _wave_any(vote_i, ROWS, WAVE)
            vote = vote_i > 0
            if POLICY == 2:  # lazy_unfixed: rebase to the row's own tile max
                target = mt
            else:  # lazy (PR #1033) and fa4_row: monotonic
                target = fmax(m, mt)
            if POLICY == 3:  # fa4_row: each row decides for itself
                apply = vote
            else:  # FlyDSL: the wave's ballot moves every row of the wave
                apply = fire
            corr = tl.where(apply, exp2_ieee(m - target), 1.0)
            target = tl.where(apply, target, m)
        dragged = fire & (mt < m)
        O = O * corr[:, None]
        pb = _round_pack(pb * corr[:, None], IS_BF16)  # the packs not yet consumed
        l = l * corr
        m = target
        O = O + _pv_part(pb, v, PV_LO, TILE_N, TILE_N, NATIVE_DOT)
        pf = exp2_ieee(s - m[:, None])
        if TRACE:
            _record(TraceBuf, slot, t, n_trace_steps, yes, m, mt, vote, fire, dragged, corr, l, O,
                    N_FIELDS)

    # Epilogue: the last three tiles, always eager.
    mt = m
    corr = ones
    for t in range(N - 3, N):
        l = l + tl.sum(pf, axis=1)
        v = _v_tile(v_base, stride_vs, stride_vd, t - 1, Skv, HEAD_DIM, TILE_N, NATIVE_DOT)
        O = O + _dot16(_round_pack(pf, IS_BF16), v, NATIVE_DOT)
        s = _tile_scores(qs, k_base, stride_ks, stride_kd, rows, t, Sq, Skv, HEAD_DIM, TILE_N, CAUSAL, NATIVE_DOT)
        mt = tl.max(s, axis=1)
        mn = fmax(m, mt)
        corr = exp2_ieee(m - mn)
        m = mn
        pf = exp2_ieee(s - m[:, None])
        O = O * corr[:, None]
        l = l * corr
        if TRACE:  # the last tile is recorded after the tail below
            _record(TraceBuf, slot, t, n_trace_steps, rows * 0 + t < N - 1, m, mt, no, no, no, corr,
                    l, O, N_FIELDS)
    l = l + tl.sum(pf, axis=1)
    v = _v_tile(v_base, stride_vs, stride_vd, N - 1, Skv, HEAD_DIM, TILE_N, NATIVE_DOT)
    O = O + _dot16(_round_pack(pf, IS_BF16), v, NATIVE_DOT)
    if TRACE:
        _record(TraceBuf, slot, N - 1, n_trace_steps, yes, m, mt, no, no, no, corr, l, O, N_FIELDS)

    # Guarded rcp (0 when l <= 0 or NaN); LSE in natural log, -inf when l == 0.
    rcp = tl.where(l > 0, tl.math.div_rn(tl.full([ROWS], 1.0, tl.float32), l), 0.0)
    out = _round_pack(O * rcp[:, None], IS_BF16)
    o_ptrs = Out + b * stride_ob + h * stride_oh + rows64[:, None] * stride_os + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    lse = tl.where(l == 0, float("-inf"), m * LN2_F32 + tl.log(l))
    tl.store(Lse + (b * H + h) * Sq + rows64, lse, mask=row_ok)


def _check_inputs(q, k, v, causal, policy, recorder, interpret):
    """What a direct caller could get wrong (the api checks the rest before dispatch)."""
    B, Sq, H, D, Skv, Hkv = check_qkv(q, k, v, dtypes=_DTYPES, head_dims=(64, 128),
                                      kernel="the swp_bf16 kernel")
    check_launch((q, k, v), ("q", "k", "v"), batch_heads=B * H, causal=causal, policy=policy,
                 policy_codes=POLICY_CODES, recorder=recorder, interpret=interpret)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
            policy: RescalePolicy, recorder: TraceRecorder | None = None, interpret: bool = False,
            rows_per_program: int | None = None):
    """q [B, Sq, H, D], k and v [B, Skv, Hkv, D], bf16 or f16, any strides.

    Returns (out [B, Sq, H, D] in q's dtype, lse [B, H, Sq] fp32, natural log), as
    ``fa_lab.models.swp_bf16.forward``. ``interpret=True`` runs Triton's interpreter on
    CPU tensors; otherwise the compiled kernel runs on CUDA/ROCm tensors.
    ``rows_per_program``: query rows per Triton program, whole waves inside one 256-row
    block (32, 64, 128 or 256); the default is 256 in the interpreter (fewer, larger steps
    run faster there) and 32 compiled. Results do not depend on it: the ballot only reads
    a wave's own rows.
    """
    _check_inputs(q, k, v, causal, policy, recorder, interpret)
    B, Sq, H, D = q.shape
    Skv, Hkv = k.shape[1], k.shape[2]
    dev = q.device
    out = torch.empty(B, Sq, H, D, dtype=q.dtype, device=dev)
    lse = torch.empty(B, H, Sq, dtype=torch.float32, device=dev)

    traced = _TracePlan(recorder, B, H, Sq, Skv, causal, dev) if recorder is not None else None
    slots = traced.slots if traced else torch.empty(1, dtype=torch.int32, device=dev)
    buf = traced.buf if traced else torch.empty(1, dtype=torch.float32, device=dev)
    n_steps = traced.n_steps if traced else 1

    rows = _rows_per_program(interpret, rows_per_program)
    grid = (padded_rows(Sq) // rows, B * H)
    device_ctx = torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()
    with device_ctx:
        launch(
            _swp_bf16_fwd, grid, interpret,
            q, k, v, out, lse, slots, buf,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(),
            H, H // Hkv, Sq, Skv, n_steps,
            softmax_scale_log2(D), f32(policy.threshold),
            HEAD_DIM=D, CAUSAL=causal, POLICY=POLICY_CODES[policy.name],
            IS_BF16=q.dtype == torch.bfloat16, TRACE=traced is not None, ROWS=rows, WAVE=WAVE_ROWS,
            BLOCK_ROWS=BLOCK_M, TILE_N=BLOCK_N, PV_LO=PV_SPLIT, N_FIELDS=_N_FIELDS,
            FLOOR=CAUSAL_FLOOR, LN2_F32=f32(LN2), NATIVE_DOT=not interpret,
            # every fp32 operation rounds once, as in the model (Triton fuses a * b + c)
            enable_fp_fusion=False,
        )
    if traced is not None:
        traced.emit(out, lse)
    return out, lse


class _TracePlan:
    """Which rows the kernel traces (a slot per distinct traced row, -1 elsewhere) and how
    its per-step buffer turns back into the recorder's records."""

    def __init__(self, recorder: TraceRecorder, B, H, Sq, Skv, causal, dev):
        self.recorder = recorder
        keys = sorted(set(recorder.triples))
        self.slot_of = {key: i for i, key in enumerate(keys)}
        for (b, h, s) in keys:
            if not (0 <= b < B and 0 <= h < H and 0 <= s < Sq):
                raise ValueError(f"recorder: traced row (batch {b}, head {h}, row {s}) is out of range")
        # Each row's tile count is its 256-row block's (causal blocks stop at the diagonal).
        self.n_tiles = {key: tiles_for_block(key[2] // BLOCK_M * BLOCK_M, Sq, Skv, causal)
                        for key in keys}
        self.n_steps = max(self.n_tiles.values())
        slots = torch.full((B, H, Sq), -1, dtype=torch.int32)
        for key, i in self.slot_of.items():
            slots[key] = i
        self.slots = slots.to(dev)
        self.buf = torch.full((len(keys), self.n_steps, _N_FIELDS), float("nan"),
                              dtype=torch.float32, device=dev)

    def emit(self, out, lse):
        """Hand the kernel's record to the recorder, step by step, as the model does."""
        rec = self.recorder
        buf = self.buf.cpu().numpy()
        lanes_by_n: dict[int, list[int]] = {}
        for lane, key in enumerate(rec.triples):
            lanes_by_n.setdefault(self.n_tiles[key], []).append(lane)
        for n, lanes in sorted(lanes_by_n.items()):
            idx = np.array([self.slot_of[rec.triples[lane]] for lane in lanes])
            for step in range(n):
                phase = "prologue" if step == 0 else ("loop" if step <= n - 4 else "epilogue")
                values = {name: buf[idx, step, f] for f, name in enumerate(STEP_FIELDS)}
                rec.add_steps(lanes, step, step * BLOCK_N, phase, values)
        out_cpu = out.float().cpu()
        lse_cpu = lse.cpu()
        for lane, (b, h, s) in enumerate(rec.triples):
            rec.set_final(lane, out_cpu[b, s, h].numpy(), float(lse_cpu[b, h, s]))
