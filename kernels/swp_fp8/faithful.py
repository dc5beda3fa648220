"""Faithful Triton port of the gfx950 fp8 BN128 forward, ``DualwaveFp8SoftmaxHelper``.

Same decisions as the model ``fa_lab.kernels.swp_fp8.model`` (docs/semantics.md §3), row for
row: scores and the running max stay in the raw fp8-product domain, 64-column tiles are
taken in pairs, the lazy policies vote per 32-row wave, P = exp2(fma(S, ls, -ls*m + H)),
l sums P in fp32 before P is rounded to e4m3, and O accumulates e4m3(P) @ V8.

Compiled, one program owns one (batch, head, 32-row wave): the vote only involves the
wave's own rows, so 32 rows per program are exact. The interpreter runs whole 256-row
blocks per program (each wave still votes alone) because its cost is per operation. The
tile count N is the model's, per 256-row block (``geometry.tiles_for_block``).

Exactness, and where the GPU and the interpreter would otherwise part ways:
- fp32 -> e4m3 (P) and fp32 -> bf16 (out) are rounded explicitly on the bit patterns
  (the interpreter's ``.to()`` neither saturates nor rounds bf16 to nearest);
- fp8 loads set NaN from the bits (the interpreter decodes 0x7F/0xFF as +-480);
- dots widen fp8 to fp32 with ``input_precision="ieee"``: fp8 x fp8 products are exact
  in fp32, so only the fp32 summation order differs from the model;
- P's fma is ``fma_f32``: ``tl.fma`` (one rounding, as the model's fp64 emulation); an
  interpreter whose tl.fma rounds twice (Triton 3.6) gets the model's emulation instead;
- exp2 keeps subnormal results (the GPU's ex2.approx.ftz flushes them), the epilogue
  divides with IEEE ``div_rn``, fp32 mul+add contraction is off, and tile maxima are
  maxNum (a NaN score loses) on both, as upstream's ``reduce_max``.
What remains approximate on the GPU: ex2 and log are a few ulp from torch's.

``forward(..., interpret=True)`` runs the same kernel source through Triton's interpreter
on CPU tensors, with or without ``TRITON_INTERPRET=1`` in the environment.
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from fa_lab.kernels._common.geometry import BLOCK_M as ROWS_PER_BLOCK
from fa_lab.kernels._common.geometry import BLOCK_N, WAVE_ROWS, tiles_for_block
from fa_lab.kernels.swp_fp8.model import HEAD_DIM, log2_scale
from fa_lab.numerics import CAUSAL_FLOOR, LN2, f32
from fa_lab.capabilities import check_policy
from fa_lab.policies import Policy
from fa_lab.trace import TraceRecorder

from fa_lab.checks import check_descale, check_qkv

from . import FAMILY
from .._triton.faithful import record_step
from .._triton.trace_plan import N_FIELDS as _N_FIELDS
from .._triton.trace_plan import TracePlan
from .._triton.util import fmax as _fmax
from .._triton.util import check_launch, exp2_ieee, fma_f32, fma_via_fp64, launch, round_bf16
from .._triton.util import rows_per_program as _rows_per_program

KERNEL = "swp_fp8"
_FP8 = torch.float8_e4m3fn


# ---- explicit roundings (bit manipulation on fp32) -------------------------------------
# Integer adds here wrap on purpose; sanitize_overflow=False also spares the interpreter
# an overflow check per operation.

@triton.jit
def _round_e4m3(x, saturate):
    """fp32 -> the nearest-even float8_e4m3fn value, as fp32 (subnormals down to 2**-9).

    ``saturate`` (a run-time flag: one compiled kernel serves both casts) clamps to +-448
    (infinities included); otherwise |x| > 464 becomes NaN (464 ties to the even 448).
    NaN stays NaN.
    """
    a = tl.abs(x)
    # saturating: inf and NaN -> 448 here; otherwise the NaN results are put back below
    a = tl.where(saturate != 0, tl.where(a < 448.0, a, 448.0), tl.where(a <= 464.0, a, 0.0))
    bits = a.to(tl.int32, bitcast=True)
    # Normal e4m3 (a >= 2**-6): keep 3 of fp32's 23 mantissa bits, ties to even; a carry
    # into the exponent is the right answer.
    half = tl.add(0x7FFFF, (bits >> 20) & 1, sanitize_overflow=False)
    normal = (tl.add(bits, half, sanitize_overflow=False) >> 20) << 20
    # Subnormal e4m3 (a < 2**-6): a multiple of 2**-9. With a = mant * 2**(e - 23) that
    # multiple is mant >> (14 - e), rounded to nearest even (shifts capped at 31 give 0).
    sh = tl.minimum(tl.sub(141, bits >> 23, sanitize_overflow=False), 31)  # 14 - e
    mant = (bits & 0x7FFFFF) | 0x800000
    half = tl.add((1 << tl.sub(sh, 1, sanitize_overflow=False)) - 1, (mant >> sh) & 1,
                  sanitize_overflow=False)
    sub = (tl.add(mant, half, sanitize_overflow=False) >> sh).to(tl.float32) * 0.001953125
    r = tl.where(bits >= 0x3C800000, normal.to(tl.float32, bitcast=True), sub)
    sign = (x.to(tl.int32, bitcast=True) >> 31) << 31
    r = (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    r = tl.where((saturate == 0) & (tl.abs(x) > 464.0), float("nan"), r)
    return tl.where(x != x, x, r)


@triton.jit
def _load_e4m3(ptrs, mask):
    """Load float8_e4m3fn values as fp32 (masked-off elements read 0). The conversion is
    exact; the interpreter's decodes the NaN codes 0x7F/0xFF as +-480, so NaN is set
    from the bits (a no-op on the GPU)."""
    raw = tl.load(ptrs, mask=mask, other=0.0)
    nan = (raw.to(tl.uint8, bitcast=True) & 0x7F) == 0x7F
    return tl.where(nan, float("nan"), raw.to(tl.float32))


@triton.jit(do_not_specialize=["saturate"])
def _round_kernel(X, Y, n, saturate, BLOCK: tl.constexpr):
    """The P rounding elementwise (for tests and notebooks)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n, other=0.0)
    tl.store(Y + offs, _round_e4m3(x, saturate), mask=offs < n)


# ---- the forward kernel ------------------------------------------------------------------

@triton.jit
def _row_max(s):
    """A tile's row max as ``reduce_max`` folds it (``walk.tile_max``): maxNum, so a NaN
    score loses and a row of NaN and -inf gives -inf. NaN is replaced first because
    ``tl.max`` differs there between the GPU (maxNum) and the interpreter (nanmax, NaN
    for an all-NaN row)."""
    return tl.max(tl.where(s != s, float("-inf"), s), axis=1)


@triton.jit
def _masked_scores(q, k, cols, rows, Sq, Skv, CAUSAL: tl.constexpr):
    """Raw scores q k^T of one tile (k [BLOCK_N, D] fp32, its key positions ``cols``) and
    their maxNum row max (``_row_max``); -inf where the model masks (columns past Skv,
    past the causal diagonal)."""
    s = tl.dot(q, tl.trans(k), input_precision="ieee")
    masked = (cols >= Skv)[None, :]
    if CAUSAL:
        masked = masked | (cols[None, :] > rows[:, None] + (Skv - Sq))
    s = tl.where(masked, float("-inf"), s)
    return s, _row_max(s)


@triton.jit
def _scores(q, k_base, stride_ks, stride_kd, col0, rows, Sq, Skv, CAUSAL: tl.constexpr,
            BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Raw scores of one 64-column tile and its row max (``_masked_scores``); K rows past
    Skv read 0."""
    cols = col0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k = _load_e4m3(k_base + cols.to(tl.int64)[:, None] * stride_ks + offs_d[None, :] * stride_kd,
                   (cols < Skv)[:, None])
    return _masked_scores(q, k, cols, rows, Sq, Skv, CAUSAL)


@triton.jit
def _p_fp8(s, ls, bias, saturate, FMA_VIA_FP64: tl.constexpr, BLOCK_M: tl.constexpr,
           BLOCK_N: tl.constexpr):
    """P = exp2(fma(S, ls, bias)) of one tile: (sum(P) in fp32, e4m3(P) as fp32)."""
    bias_b = tl.broadcast_to(bias[:, None], (BLOCK_M, BLOCK_N))
    ls_b = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32) + ls  # ls > 0: the sum is ls exactly
    p = exp2_ieee(fma_f32(s, ls_b, bias_b, FMA_VIA_FP64))
    return tl.sum(p, axis=1), _round_e4m3(p, saturate)


@triton.jit
def _p_tile(s, ls, bias, v_base, stride_vs, stride_vd, col0, Skv, saturate,
            FMA_VIA_FP64: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            HEAD_DIM: tl.constexpr):
    """One tile's contribution: P = exp2(fma(S, ls, bias)); returns (sum(P) in fp32,
    e4m3(P) @ V8 with fp32 sums). V rows past Skv read 0."""
    p_sum, p8 = _p_fp8(s, ls, bias, saturate, FMA_VIA_FP64, BLOCK_M, BLOCK_N)
    cols = col0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    v = _load_e4m3(v_base + cols.to(tl.int64)[:, None] * stride_vs + offs_d[None, :] * stride_vd,
                   (cols < Skv)[:, None])
    return p_sum, tl.dot(p8, v, input_precision="ieee")


@triton.jit
def _decide_pair(m, mt, ls, threshold, neg_bound, vote_code, rebase_code,
                 BLOCK_M: tl.constexpr, WAVE: tl.constexpr):
    """One tile pair's rescale decision per row, from the running max m and the pair's
    max mt (raw units): (new m, corr, vote, fire, swept). The policy's codes are run-time
    values (uniform over the launch): one compiled kernel serves every policy."""
    if vote_code == 0:  # vote "tile" (eager)
        mn = _fmax(m, mt)
        corr = exp2_ieee((m - mn) * ls)
        vote = tl.full((BLOCK_M,), 0, tl.int1)
        fire = vote
        swept = vote
    else:
        d = (mt - m) * ls  # +inf on the first pair
        vote = ~(d <= threshold)  # NaN votes: an ordered compare fails
        # The wave ballot: any vote among each wave's 32 rows, for all of them.
        NW: tl.constexpr = BLOCK_M // WAVE
        votes = tl.reshape(vote.to(tl.int32), (NW, WAVE))
        any_vote = tl.max(votes, axis=1) > 0
        fire = tl.reshape(tl.broadcast_to(any_vote[:, None], (NW, WAVE)), (BLOCK_M,))
        swept = fire & (mt < m)
        if rebase_code == 1:  # "tile": every moving row rebases to its own tile max
            corr = exp2_ieee(-d)
            mn = mt
        elif rebase_code == 2:  # "capped": skip downward rebases past the bound
            safe = d >= neg_bound  # NaN -> False
            corr = exp2_ieee(-tl.where(safe, d, 0.0))
            mn = tl.where(safe, mt, m)
        else:  # "max": monotonic
            mn = _fmax(m, mt)
            corr = exp2_ieee((m - mn) * ls)
        if vote_code == 2:  # vote "row": each row for itself
            apply = vote
        else:  # vote "wave": the ballot moves every row of the wave
            apply = fire
        corr = tl.where(apply, corr, 1.0)
        mn = tl.where(apply, mn, m)
    return mn, corr, vote, fire, swept


# The policy's codes and the cast are not specialised (Triton would compile a kernel for
# each value equal to 1): one compile serves every policy.
@triton.jit(do_not_specialize=["vote_code", "rebase_code", "saturate"])
def _fwd_kernel(
    Q, K, V, Out, Lse, NTiles, Slot, Trace,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ob, stride_os, stride_oh, stride_od,
    H, GROUP, Sq, Skv, max_steps,
    ls, threshold, neg_bound, headroom, v_descale, ln2, causal_floor, vote_code, rebase_code,
    saturate, CAUSAL: tl.constexpr,
    TRACE: tl.constexpr, FMA_VIA_FP64: tl.constexpr, N_FIELDS: tl.constexpr,
    BLOCK_M: tl.constexpr, WAVE: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, ROWS_PER_BLOCK: tl.constexpr,
):
    # BLOCK_M rows = BLOCK_M // WAVE whole waves of one 256-row block.
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUP

    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)  # global (padded) query rows
    row_ok = rows < Sq
    offs_d = tl.arange(0, HEAD_DIM)
    rows64 = rows.to(tl.int64)
    q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    # Rows past Sq read Q = 0 and still vote, as in the kernel's last block.
    q = _load_e4m3(q_base + rows64[:, None] * stride_qs + offs_d[None, :] * stride_qd,
                   row_ok[:, None])
    k_base = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh

    n_pairs = tl.load(NTiles + (pid * BLOCK_M) // ROWS_PER_BLOCK) // 2
    if TRACE:
        # an int64 slot keeps record_step's buffer offsets in int64
        slot = tl.load(Slot + bh.to(tl.int64) * Sq + rows64, mask=row_ok, other=-1).to(tl.int64)
        yes = rows >= 0

    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.full((BLOCK_M,), 0.0, tl.float32)
    O = tl.full((BLOCK_M, HEAD_DIM), 0.0, tl.float32)
    for p in range(0, n_pairs):
        col_a = 2 * p * BLOCK_N
        col_b = col_a + BLOCK_N
        s_a, max_a = _scores(q, k_base, stride_ks, stride_kd, col_a, rows, Sq, Skv, CAUSAL,
                             BLOCK_N, HEAD_DIM)
        s_b, max_b = _scores(q, k_base, stride_ks, stride_kd, col_b, rows, Sq, Skv, CAUSAL,
                             BLOCK_N, HEAD_DIM)
        mt = _fmax(max_a, max_b)
        if CAUSAL:
            mt = _fmax(mt, causal_floor)
        mn, corr, vote, fire, swept = _decide_pair(m, mt, ls, threshold, neg_bound, vote_code,
                                                   rebase_code, BLOCK_M, WAVE)
        O = O * corr[:, None]
        l = l * corr
        m = mn
        bias = (0.0 - ls * m) + headroom  # the fma's addend, fp32
        sum_a, pv_a = _p_tile(s_a, ls, bias, v_base, stride_vs, stride_vd, col_a, Skv,
                              saturate, FMA_VIA_FP64, BLOCK_M, BLOCK_N, HEAD_DIM)
        l = l + sum_a
        O = O + pv_a
        sum_b, pv_b = _p_tile(s_b, ls, bias, v_base, stride_vs, stride_vd, col_b, Skv,
                              saturate, FMA_VIA_FP64, BLOCK_M, BLOCK_N, HEAD_DIM)
        l = l + sum_b
        O = O + pv_b
        if TRACE:  # one step per tile pair
            record_step(Trace, slot, p, max_steps, yes, m, mt, vote, fire, swept, corr, l, O,
                        N_FIELDS)

    # Epilogue: O * (rcp(l) if l > 0 else 0, times the V descale) (IEEE division;
    # rcp(inf) = 0, NaN l gives 0).
    rcp = tl.where(l > 0, tl.math.div_rn(tl.full((BLOCK_M,), 1.0, tl.float32), l), 0.0)
    o = O * (rcp * v_descale)[:, None]
    o_base = Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    # Round explicitly (the interpreter's fp32 -> bf16 .to() truncates); the cast is exact.
    tl.store(o_base + rows64[:, None] * stride_os + offs_d[None, :] * stride_od,
             round_bf16(o).to(tl.bfloat16), mask=row_ok[:, None])
    # The model's LSE read-out: ln l + (ls*m - H) * ln 2, -inf where l = 0.
    lse = tl.where(l == 0, float("-inf"), (m * ls - headroom) * ln2 + tl.log(l))
    tl.store(Lse + bh.to(tl.int64) * Sq + rows64, lse, mask=row_ok)


# ---- running the kernels: compiled, or through the interpreter ---------------------------

def round_e4m3(x: torch.Tensor, saturate: bool = True, *, interpret: bool | None = None):
    """The kernel's fp32 -> e4m3 rounding of P, applied to an fp32 tensor; returns fp32
    holding e4m3 values. ``interpret`` defaults to True for CPU tensors."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        raise TypeError("x must be a float32 torch.Tensor")
    if not isinstance(saturate, bool):
        raise TypeError(f"saturate must be a bool, got {type(saturate).__name__}")
    if interpret is None:
        interpret = x.device.type == "cpu"
    src = x.contiguous().reshape(-1)
    out = torch.empty_like(src)
    n, block = src.numel(), 1024
    if n:
        launch(_round_kernel, (triton.cdiv(n, block),), interpret,
               src, out, n, int(saturate), BLOCK=block)
    return out.reshape(x.shape)


# ---- host side ---------------------------------------------------------------------------

def _check_inputs(q8, k8, v8, causal, policy, saturate, recorder, interpret):
    """What a direct caller could get wrong (the api checks the rest before dispatch)."""
    B, Sq, H, D, Skv, Hkv = check_qkv(q8, k8, v8, dtypes=(_FP8,), head_dims=(HEAD_DIM,),
                                      kernel="the fp8 kernel", names=("q8", "k8", "v8"))
    check_launch((q8, k8, v8), ("q8", "k8", "v8"), batch_heads=B * H, causal=causal,
                 recorder=recorder, interpret=interpret)
    check_policy(policy, FAMILY, "faithful")
    if not isinstance(saturate, bool):
        raise TypeError(f"saturate must be a bool, got {type(saturate).__name__}")


def forward(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, *, q_descale: float,
            k_descale: float, v_descale: float, causal: bool, policy: Policy,
            saturate: bool = True, recorder: TraceRecorder | None = None,
            interpret: bool = False, rows_per_program: int | None = None):
    """q8 [B, Sq, H, 128], k8 and v8 [B, Skv, Hkv, 128], float8_e4m3fn, any strides.

    Same contract as ``fa_lab.kernels.swp_fp8.model.forward``: returns (out [B, Sq, H, 128] bf16,
    lse [B, H, Sq] fp32, the model's LSE read-out). ``interpret=True`` runs Triton's
    interpreter on CPU tensors; otherwise the compiled kernel runs on CUDA tensors.
    ``rows_per_program``: query rows per program, whole waves of one 256-row block (32,
    64, 128 or 256); default 256 interpreted (fewer, larger steps run faster there), 32
    compiled. Results do not depend on it: the ballot only reads a wave's own rows.
    """
    _check_inputs(q8, k8, v8, causal, policy, saturate, recorder, interpret)
    qd, kd, vd = (check_descale(n, x) for n, x in
                  (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)))
    rows = _rows_per_program(interpret, rows_per_program)
    codes = policy.codes
    B, Sq, H, D = q8.shape
    Skv, Hkv = k8.shape[1], k8.shape[2]
    dev = q8.device
    plan = None
    if recorder is not None:
        plan = TracePlan(recorder, (B, H, Sq), _trace_schedule(Sq, Skv, causal), dev)

    out = torch.empty(B, Sq, H, D, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(B, H, Sq, dtype=torch.float32, device=dev)
    n_tiles = torch.tensor([tiles_for_block(q0, Sq, Skv, causal)
                            for q0 in range(0, Sq, ROWS_PER_BLOCK)], dtype=torch.int32, device=dev)
    slots = plan.slots if plan else torch.empty(1, dtype=torch.int32, device=dev)
    buf = plan.buf if plan else torch.empty(1, dtype=torch.float32, device=dev)
    args = (q8, k8, v8, out, lse, n_tiles, slots, buf,
            *q8.stride(), *k8.stride(), *v8.stride(), *out.stride(),
            H, H // Hkv, Sq, Skv, plan.n_steps if plan else 1,
            log2_scale(qd, kd, D), f32(codes.threshold) if codes.lazy else 0.0,
            -f32(codes.bound), f32(codes.headroom), f32(vd), f32(LN2), f32(CAUSAL_FLOOR),
            codes.vote, codes.rebase, int(saturate))
    meta = dict(CAUSAL=causal,
                TRACE=plan is not None,
                FMA_VIA_FP64=fma_via_fp64(_fwd_kernel, interpret),
                N_FIELDS=_N_FIELDS, BLOCK_M=rows, WAVE=WAVE_ROWS, BLOCK_N=BLOCK_N,
                HEAD_DIM=HEAD_DIM, ROWS_PER_BLOCK=ROWS_PER_BLOCK)
    grid = (triton.cdiv(Sq, rows), B * H)
    if interpret:
        with warnings.catch_warnings():  # numpy on all-NaN rows (NaN inputs): expected
            warnings.filterwarnings("ignore", "All-NaN slice", RuntimeWarning)
            launch(_fwd_kernel, grid, True, *args, **meta)
    else:
        with torch.cuda.device(dev):
            launch(_fwd_kernel, grid, False, *args, **meta, num_warps=4, num_stages=1,
                   enable_fp_fusion=False)
    if plan is not None:
        plan.emit(out, lse)
    return out, lse


def _trace_schedule(Sq, Skv, causal):
    """A traced row's steps, (first column, phase), as the model records them: one per tile
    pair of its 256-row block (causal blocks stop early), phase 'pair'."""

    def schedule(key):
        n_pairs = tiles_for_block(key[2] // ROWS_PER_BLOCK * ROWS_PER_BLOCK, Sq, Skv, causal) // 2
        return [(2 * p * BLOCK_N, "pair") for p in range(n_pairs)]

    return schedule
