"""Faithful Triton port of FlyDSL #1097's fp8 path: head dims (D, Dv), split-K and its
combine, the LSE without the P headroom (the model: ``fa_lab.kernels.swp_fp8.split``).

Two kernels, as upstream launches them:

* ``_walk_kernel``: one program per (32-row waves of one 256-row block, batch x head,
  split). It walks the split's tile pairs [t0, t_end) exactly as ``faithful._fwd_kernel``
  walks a block (the same vote, rebase, P, e4m3 cast and V product), with D and Dv padded
  to powers of two by masked loads (padding reads 0 and adds exact zeros). One split:
  it writes the bf16 output and the LSE. Several: it stores the split's partial, O
  normalised by its own l times the V descale and rounded to bf16, m scaled by ls (or raw,
  ``m_units="raw"``), and l; an empty split stores O = 0, m = -1e30, l = 0.
* ``_combine_kernel``: one program per (rows, batch x head): maxNum of the maxima, then
  each split with l > 0 weighted ``exp2(m_s - m_max) * l_s``, the bf16 output and the LSE.

Exactness as ``faithful`` (explicit e4m3 and bf16 roundings, fp8 NaN codes from the bits,
IEEE dots on fp8 values widened to fp32, correctly rounded exp2, no fp contraction).
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from fa_lab import upstream as upstream_versions
from fa_lab.capabilities import check_policy
from fa_lab.checks import check_descale, check_qkv
from fa_lab.numerics import log2_scale
from fa_lab.kernels._common.geometry import BLOCK_M as ROWS_PER_BLOCK
from fa_lab.kernels._common.geometry import BLOCK_N, WAVE_ROWS, tiles_for_block
from fa_lab.numerics import CAUSAL_FLOOR, LN2, f32
from fa_lab.policies import Policy

from . import FAMILY, faithful
from . import split as model_split
from .faithful import _load_e4m3, _round_e4m3, _row_max
from .._triton.util import fmax as _fmax
from .._triton.util import check_launch, exp2_ieee, fma_f32, fma_via_fp64, launch, round_bf16
from .._triton.util import rows_per_program as _rows_per_program
from ..swp_bf16.model import split_ranges

_FP8 = torch.float8_e4m3fn


@triton.jit
def _scores(q, k_base, stride_ks, stride_kd, col0, rows, Sq, Skv, D, CAUSAL: tl.constexpr,
            BLOCK_N: tl.constexpr, DPAD: tl.constexpr):
    """Raw scores of one 64-column tile (K's columns past D read 0) and its maxNum row max
    (``faithful._row_max``); -inf where the model masks."""
    cols = col0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, DPAD)
    k = _load_e4m3(k_base + cols.to(tl.int64)[:, None] * stride_ks + offs_d[None, :] * stride_kd,
                   (cols < Skv)[:, None] & (offs_d < D)[None, :])
    s = tl.dot(q, tl.trans(k), input_precision="ieee")
    masked = (cols >= Skv)[None, :]
    if CAUSAL:
        masked = masked | (cols[None, :] > rows[:, None] + (Skv - Sq))
    s = tl.where(masked, float("-inf"), s)
    return s, _row_max(s)


@triton.jit
def _p_tile(s, ls, bias, v_base, stride_vs, stride_vd, col0, Skv, DV, saturate,
            FMA_VIA_FP64: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            DVPAD: tl.constexpr):
    """sum(P) in fp32 and e4m3(P) @ V8 (V's columns past Dv and rows past Skv read 0)."""
    bias_b = tl.broadcast_to(bias[:, None], (BLOCK_M, BLOCK_N))
    ls_b = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32) + ls
    p = exp2_ieee(fma_f32(s, ls_b, bias_b, FMA_VIA_FP64))
    cols = col0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, DVPAD)
    v = _load_e4m3(v_base + cols.to(tl.int64)[:, None] * stride_vs + offs_d[None, :] * stride_vd,
                   (cols < Skv)[:, None] & (offs_d < DV)[None, :])
    return tl.sum(p, axis=1), tl.dot(_round_e4m3(p, saturate), v, input_precision="ieee")


@triton.jit(do_not_specialize=["vote_code", "rebase_code", "saturate", "m_raw", "lse_h"])
def _walk_kernel(
    Q, K, V, Out, Lse, Ranges, PartO, PartM, PartL,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ob, stride_os, stride_oh, stride_od,
    H, GROUP, Sq, Skv, n_splits, BH, D, DV,
    ls, threshold, neg_bound, headroom, v_descale, ln2, neg_h_ln2, causal_floor,
    vote_code, rebase_code, saturate, m_raw, lse_h,
    CAUSAL: tl.constexpr, SPLIT: tl.constexpr, FMA_VIA_FP64: tl.constexpr,
    BLOCK_M: tl.constexpr, WAVE: tl.constexpr, BLOCK_N: tl.constexpr, DPAD: tl.constexpr,
    DVPAD: tl.constexpr, ROWS_PER_BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    sp = tl.program_id(2)
    b = bh // H
    h = bh % H
    hk = h // GROUP
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < Sq
    rows64 = rows.to(tl.int64)
    offs_d = tl.arange(0, DPAD)
    q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    q = _load_e4m3(q_base + rows64[:, None] * stride_qs + offs_d[None, :] * stride_qd,
                   row_ok[:, None] & (offs_d < D)[None, :])
    k_base = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh

    rng = Ranges + (((pid * BLOCK_M) // ROWS_PER_BLOCK) * n_splits + sp) * 2
    t0 = tl.load(rng)
    t_end = tl.load(rng + 1)

    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.full((BLOCK_M,), 0.0, tl.float32)
    O = tl.full((BLOCK_M, DVPAD), 0.0, tl.float32)
    for p in range(t0 // 2, t_end // 2):
        col_a = 2 * p * BLOCK_N
        col_b = col_a + BLOCK_N
        s_a, max_a = _scores(q, k_base, stride_ks, stride_kd, col_a, rows, Sq, Skv, D, CAUSAL,
                             BLOCK_N, DPAD)
        s_b, max_b = _scores(q, k_base, stride_ks, stride_kd, col_b, rows, Sq, Skv, D, CAUSAL,
                             BLOCK_N, DPAD)
        mt = _fmax(max_a, max_b)
        if CAUSAL:
            mt = _fmax(mt, causal_floor)
        if vote_code == 0:  # vote "tile" (eager)
            mn = _fmax(m, mt)
            corr = exp2_ieee((m - mn) * ls)
        else:
            d = (mt - m) * ls
            vote = ~(d <= threshold)
            NW: tl.constexpr = BLOCK_M // WAVE
            any_vote = tl.max(tl.reshape(vote.to(tl.int32), (NW, WAVE)), axis=1) > 0
            fire = tl.reshape(tl.broadcast_to(any_vote[:, None], (NW, WAVE)), (BLOCK_M,))
            if rebase_code == 1:  # "tile"
                corr = exp2_ieee(-d)
                mn = mt
            elif rebase_code == 2:  # "capped"
                safe = d >= neg_bound
                corr = exp2_ieee(-tl.where(safe, d, 0.0))
                mn = tl.where(safe, mt, m)
            else:  # "max"
                mn = _fmax(m, mt)
                corr = exp2_ieee((m - mn) * ls)
            if vote_code == 2:  # "row": each row for itself
                apply = vote
            else:  # "wave": the ballot moves every row of the wave
                apply = fire
            corr = tl.where(apply, corr, 1.0)
            mn = tl.where(apply, mn, m)
        O = O * corr[:, None]
        l = l * corr
        m = mn
        bias = (0.0 - ls * m) + headroom
        sum_a, pv_a = _p_tile(s_a, ls, bias, v_base, stride_vs, stride_vd, col_a, Skv, DV,
                              saturate, FMA_VIA_FP64, BLOCK_M, BLOCK_N, DVPAD)
        l = l + sum_a
        O = O + pv_a
        sum_b, pv_b = _p_tile(s_b, ls, bias, v_base, stride_vs, stride_vd, col_b, Skv, DV,
                              saturate, FMA_VIA_FP64, BLOCK_M, BLOCK_N, DVPAD)
        l = l + sum_b
        O = O + pv_b

    # the epilogue: inv = (rcp(l) if l > 0 else 0) * v_descale, then O * inv
    inv = tl.where(l > 0, tl.math.div_rn(tl.full((BLOCK_M,), 1.0, tl.float32), l), 0.0) * v_descale
    o = round_bf16(O * inv[:, None])
    offs_v = tl.arange(0, DVPAD)
    omask = row_ok[:, None] & (offs_v < DV)[None, :]
    if SPLIT:
        base = (sp.to(tl.int64) * BH + bh) * Sq
        tl.store(PartO + (base + rows64)[:, None] * DV + offs_v[None, :], o, mask=omask)
        m_out = tl.where(m_raw != 0, m, m * ls)
        m_out = tl.where(t_end > t0, m_out, -1e30)  # an empty split
        tl.store(PartM + base + rows64, m_out, mask=row_ok)
        tl.store(PartL + base + rows64, l, mask=row_ok)
    else:
        o_base = Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
        tl.store(o_base + rows64[:, None] * stride_os + offs_v[None, :] * stride_od,
                 o.to(tl.bfloat16), mask=omask)
        lse = (m * ls) * ln2 + tl.log(l)
        lse = tl.where(lse_h != 0, lse + neg_h_ln2, lse)
        tl.store(Lse + bh.to(tl.int64) * Sq + rows64, lse, mask=row_ok)


@triton.jit(do_not_specialize=["lse_h"])
def _combine_kernel(PartO, PartM, PartL, Out, Lse,
                    stride_ob, stride_os, stride_oh, stride_od,
                    H, Sq, n_splits, BH, DV, ln2, neg_h_ln2, lse_h,
                    BLOCK_M: tl.constexpr, DVPAD: tl.constexpr):
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < Sq
    rows64 = rows.to(tl.int64)
    offs_v = tl.arange(0, DVPAD)
    omask = row_ok[:, None] & (offs_v < DV)[None, :]
    m_max = tl.load(PartM + bh.to(tl.int64) * Sq + rows64, mask=row_ok, other=0.0)
    for s in range(1, n_splits):
        m_s = tl.load(PartM + (s * BH + bh).to(tl.int64) * Sq + rows64, mask=row_ok, other=0.0)
        m_max = _fmax(m_max, m_s)
    den = tl.full((BLOCK_M,), 0.0, tl.float32)
    acc = tl.full((BLOCK_M, DVPAD), 0.0, tl.float32)
    for s in range(0, n_splits):
        base = (s * BH + bh).to(tl.int64) * Sq
        m_s = tl.load(PartM + base + rows64, mask=row_ok, other=0.0)
        l_s = tl.load(PartL + base + rows64, mask=row_ok, other=0.0)
        o_s = tl.load(PartO + (base + rows64)[:, None] * DV + offs_v[None, :], mask=omask,
                      other=0.0)
        take = l_s > 0  # NaN and zero l: skipped
        wl = exp2_ieee(m_s - m_max) * l_s
        den = tl.where(take, den + wl, den)
        acc = tl.where(take[:, None], acc + wl[:, None] * o_s, acc)
    rcp = tl.where(den > 0, tl.math.div_rn(tl.full((BLOCK_M,), 1.0, tl.float32), den), 0.0)
    out = round_bf16(acc * rcp[:, None])
    o_base = Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    tl.store(o_base + rows64[:, None] * stride_os + offs_v[None, :] * stride_od,
             out.to(tl.bfloat16), mask=omask)
    lse = m_max * ln2 + tl.log(den)
    lse = tl.where(lse_h != 0, lse + neg_h_ln2, lse)
    tl.store(Lse + bh.to(tl.int64) * Sq + rows64, lse, mask=row_ok)


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def forward(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, *, q_descale: float,
            k_descale: float, v_descale: float, causal: bool, policy: Policy,
            saturate: bool = True, recorder=None, interpret: bool = False,
            rows_per_program: int | None = None, num_kv_splits: int = 1, paged=None):
    """The family's faithful entry point, as ``model.forward`` is the model's: a dense
    call at D = Dv = 128 runs ``faithful.forward`` (the dense body, with its trace);
    other head dims and ``num_kv_splits`` > 1 run ``forward_split``; a paged call
    (``paged``, a checked ``fa_lab.paged.PagedFp8``) runs ``faithful_paged.forward``."""
    if paged is not None:
        from . import faithful_paged
        return faithful_paged.forward(q8, k8, v8, q_descale=q_descale, k_descale=k_descale,
                                      v_descale=v_descale, causal=causal, policy=policy,
                                      paged=paged, saturate=saturate, recorder=recorder,
                                      interpret=interpret, rows_per_program=rows_per_program)
    if num_kv_splits == 1 and q8.shape[-1] == v8.shape[-1] == faithful.HEAD_DIM:
        return faithful.forward(q8, k8, v8, q_descale=q_descale, k_descale=k_descale,
                                v_descale=v_descale, causal=causal, policy=policy,
                                saturate=saturate, recorder=recorder, interpret=interpret,
                                rows_per_program=rows_per_program)
    return forward_split(q8, k8, v8, q_descale=q_descale, k_descale=k_descale,
                         v_descale=v_descale, causal=causal, policy=policy,
                         num_kv_splits=num_kv_splits, saturate=saturate, recorder=recorder,
                         interpret=interpret, rows_per_program=rows_per_program)


def forward_split(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, *, q_descale: float,
                  k_descale: float, v_descale: float, causal: bool, policy: Policy,
                  num_kv_splits: int = 1, upstream: str | None = None,
                  m_units: str | None = None, lse_headroom: bool | None = None,
                  saturate: bool = True, recorder=None, interpret: bool = False,
                  rows_per_program: int | None = None):
    """The same contract as ``fa_lab.kernels.swp_fp8.split.forward``: q8 [B, Sq, H, D],
    k8 [B, Skv, Hkv, D], v8 [B, Skv, Hkv, Dv], float8_e4m3fn, any strides. Returns
    (out [B, Sq, H, Dv] bf16, lse [B, H, Sq] fp32). ``interpret=True`` runs Triton's
    interpreter on CPU tensors. It records no trace (``recorder`` must be None)."""
    B, Sq, H, D, Skv, Hkv = check_qkv(q8, k8, v8, dtypes=(_FP8,), head_dims=model_split.HEAD_DIMS,
                                      kernel="the fp8 kernel", names=("q8", "k8", "v8"),
                                      v_head_dims=model_split.HEAD_DIMS_V)
    version = upstream_versions.check_fp8_split(upstream)
    m_units = version.m_units if m_units is None else m_units
    lse_headroom = version.lse_headroom if lse_headroom is None else lse_headroom
    model_split.check_args(q8, v8, num_kv_splits, m_units, lse_headroom)
    if recorder is not None:
        raise ValueError("the faithful port of the fp8 #1097 path records no trace; trace the "
                         "model (backend='emulator')")
    check_launch((q8, k8, v8), ("q8", "k8", "v8"), batch_heads=B * H, causal=causal,
                 recorder=None, interpret=interpret)
    check_policy(policy, FAMILY, "faithful")
    if not isinstance(saturate, bool):
        raise TypeError(f"saturate must be a bool, got {type(saturate).__name__}")
    qd, kd, vd = (check_descale(n, x) for n, x in
                  (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)))
    Dv = v8.shape[-1]
    if rows_per_program is None and not interpret and max(D, Dv) > 128:
        rows_per_program = WAVE_ROWS  # one wave: fp32 operands padded to 256 columns
    rows = _rows_per_program(interpret, rows_per_program)
    codes = policy.codes
    dev = q8.device
    S = num_kv_splits
    ranges = []
    for q0 in range(0, Sq, ROWS_PER_BLOCK):
        n = tiles_for_block(q0, Sq, Skv, causal)
        ranges.extend(split_ranges(n, S) if S > 1 else [(0, n)])
    ranges = torch.tensor(ranges, dtype=torch.int32, device=dev)
    out = torch.empty(B, Sq, H, Dv, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(B, H, Sq, dtype=torch.float32, device=dev)
    ws = (S, B * H, Sq) if S > 1 else (1,)
    part_o = torch.empty(*ws, Dv if S > 1 else 1, dtype=torch.float32, device=dev)
    part_m = torch.empty(ws, dtype=torch.float32, device=dev)
    part_l = torch.empty(ws, dtype=torch.float32, device=dev)
    headroom = f32(codes.headroom)
    neg_h_ln2 = f32(-headroom * LN2)
    DVPAD = _pow2(Dv)
    args = (q8, k8, v8, out, lse, ranges, part_o, part_m, part_l,
            *q8.stride(), *k8.stride(), *v8.stride(), *out.stride(),
            H, H // Hkv, Sq, Skv, S, B * H, D, Dv,
            log2_scale(qd, kd, D), f32(codes.threshold) if codes.lazy else 0.0,
            -f32(codes.bound), headroom, f32(vd), f32(LN2), neg_h_ln2, f32(CAUSAL_FLOOR),
            codes.vote, codes.rebase, int(saturate), int(m_units == "raw"), int(lse_headroom))
    meta = dict(CAUSAL=causal, SPLIT=S > 1, FMA_VIA_FP64=fma_via_fp64(_walk_kernel, interpret),
                BLOCK_M=rows, WAVE=WAVE_ROWS, BLOCK_N=BLOCK_N, DPAD=_pow2(D), DVPAD=DVPAD,
                ROWS_PER_BLOCK=ROWS_PER_BLOCK)
    grid = (triton.cdiv(Sq, rows), B * H, S)
    cargs = (part_o, part_m, part_l, out, lse, *out.stride(), H, Sq, S, B * H, Dv, f32(LN2),
             neg_h_ln2, int(lse_headroom))
    cgrid = (triton.cdiv(Sq, rows), B * H)
    if interpret:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "All-NaN slice", RuntimeWarning)
            launch(_walk_kernel, grid, True, *args, **meta)
            if S > 1:
                launch(_combine_kernel, cgrid, True, *cargs, BLOCK_M=rows, DVPAD=DVPAD)
    else:
        with torch.cuda.device(dev):
            launch(_walk_kernel, grid, False, *args, **meta, num_warps=4, num_stages=1,
                   enable_fp_fusion=False)
            if S > 1:
                launch(_combine_kernel, cgrid, False, *cargs, BLOCK_M=rows, DVPAD=DVPAD,
                       num_warps=4, num_stages=1, enable_fp_fusion=False)
    return out, lse

