"""Faithful Triton port of FlyDSL's gfx950 backward: the dQ kernel and the dK/dV kernel,
decision for decision as ``fa_lab.kernels.bwd.dq`` and ``.dkdv`` (docs/semantics.md §12).

dQ: one program per (batch, head, ``ROWS`` query rows of one ``block_m`` block); it walks
the block's KV tiles of 64 (causal: up to the block's band end). dK/dV: one program per
(batch, KV head, ``COLS`` KV rows of one ``block_kv`` block); it walks the query heads of
its group (outer) and the block's streamed q tiles of 64 rows (inner). Rows are
independent in both, so ``ROWS`` and ``COLS`` change nothing but the launch.

Numerics as the forward ports (``_triton.dots``, ``_triton.util``): dots through
``dot16`` (exact when interpreted), every other operation rounds once (compiled with
``enable_fp_fusion=False``), the one fused multiply-add of each kernel explicit
(``fma_f32``), exp2 correctly rounded, packs rounded to nearest even explicitly.
"""

from __future__ import annotations

import contextlib
import math

import torch
import triton
import triton.language as tl

from fa_lab.numerics import LOG2E, f32

from .._triton.dots import dot16, launch_dots, load16, program_scratch
from .._triton.util import (check_launch, exp2_ieee, fma_f32, fma_via_fp64, fmax, launch, round_bf16,
                            round_f16)
from .common import (DKDV_BLOCK_KV, DKDV_BLOCK_Q, DQ_BLOCK_M, DQ_BLOCK_N, LSE2_FLOOR, check_backward,
                     delta as row_delta, dropout_scale, scales)

__all__ = ["backward", "backward_dq", "backward_dkdv"]


@triton.jit
def _pack(x, IS_BF16: tl.constexpr):
    """``v_cvt_pk_bf16_f32`` / the f16 convert: round to nearest even."""
    if IS_BF16:
        r = round_bf16(x)
    else:
        r = round_f16(x)
    return r


@triton.jit(do_not_specialize=["H", "G", "Sq", "Skv"])
def _bwd_dq(
    Q, K, V, DO, DQ, Lse, Delta, Bias, Keep, Scratch,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ob, stride_os, stride_oh, stride_od,
    stride_bb, stride_bh, stride_bq, stride_bk,
    stride_xb, stride_xh, stride_xq, stride_xk,
    H, G, Sq, Skv, c, sm_scale, log2e, dscale,
    HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr,
    LSE_FLOOR: tl.constexpr, PRESCALE_Q: tl.constexpr, FLOOR: tl.constexpr,
    IS_BF16: tl.constexpr, FMA_VIA_FP64: tl.constexpr, DOT_MODE: tl.constexpr,
    SCRATCH_FLOATS: tl.constexpr,
):
    chunk = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    hkv = (h // G).to(tl.int64)
    h = h.to(tl.int64)
    scratch = program_scratch(Scratch, SCRATCH_FLOATS, DOT_MODE)
    rows = chunk * ROWS + tl.arange(0, ROWS)
    row_ok = rows < Sq
    rows64 = rows.to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)

    q = tl.load(Q + b * stride_qb + h * stride_qh + rows64[:, None] * stride_qs
                + offs_d[None, :] * stride_qd, mask=row_ok[:, None], other=0.0).to(tl.float32)
    if PRESCALE_Q:  # the fold upstream removed: Q * qk_scale rounded to the input type
        q = _pack(q * c, IS_BF16)
    do = tl.load(DO + b * stride_ob + h * stride_oh + rows64[:, None] * stride_os
                 + offs_d[None, :] * stride_od, mask=row_ok[:, None], other=0.0).to(tl.float32)
    lse = tl.load(Lse + (b * H + h) * Sq + rows64, mask=row_ok, other=0.0)
    dlt = tl.load(Delta + (b * H + h) * Sq + rows64, mask=row_ok, other=0.0)
    lse2 = lse * log2e
    if LSE_FLOOR:
        lse2 = fmax(lse2, tl.full([ROWS], FLOOR, tl.float32))
    log2e_tile = tl.full([ROWS, BLOCK_N], 0.0, tl.float32) + log2e

    # the block's walk: causal stops at its band's end, an empty band walks no tile
    n_kv = (Skv + BLOCK_N - 1) // BLOCK_N
    n_walk = n_kv
    if CAUSAL:
        q0 = (chunk * ROWS // BLOCK_M) * BLOCK_M
        end = tl.maximum(q0 + BLOCK_M + Skv - Sq, 0)
        n_walk = tl.minimum((end + BLOCK_N - 1) // BLOCK_N, n_kv)
    k_base = K + b * stride_kb + hkv * stride_kh
    v_base = V + b * stride_vb + hkv * stride_vh
    acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    for t in range(n_walk):
        cols = t * BLOCK_N + offs_n
        kv_ok = cols < Skv
        cols64 = cols.to(tl.int64)
        kt = load16(k_base + cols64[None, :] * stride_ks + offs_d[:, None] * stride_kd,
                    kv_ok[None, :], DOT_MODE)
        s = dot16(q, kt, scratch, DOT_MODE)
        if not PRESCALE_Q:
            s = s * c
        if HAS_BIAS:
            bt = tl.load(Bias + b * stride_bb + h * stride_bh + rows64[:, None] * stride_bq
                         + cols64[None, :] * stride_bk, mask=row_ok[:, None] & kv_ok[None, :],
                         other=0.0).to(tl.float32)
            s = fma_f32(bt, log2e_tile, s, FMA_VIA_FP64)
        s = tl.where(kv_ok[None, :], s, float("-inf"))
        if CAUSAL:
            s = tl.where(cols[None, :] > rows[:, None] + (Skv - Sq), float("-inf"), s)
        vt = load16(v_base + cols64[None, :] * stride_vs + offs_d[:, None] * stride_vd,
                    kv_ok[None, :], DOT_MODE)
        dp = dot16(do, vt, scratch, DOT_MODE)
        if DROPOUT:
            kp = tl.load(Keep + b * stride_xb + h * stride_xh + rows64[:, None] * stride_xq
                         + cols64[None, :] * stride_xk, mask=row_ok[:, None] & kv_ok[None, :],
                         other=0) != 0
            dp = tl.where(kp, dp * dscale, 0.0)
        p = exp2_ieee(s - lse2[:, None])
        ds = p * (dp - dlt[:, None])
        k_rows = load16(k_base + cols64[:, None] * stride_ks + offs_d[None, :] * stride_kd,
                        kv_ok[:, None], DOT_MODE)
        acc = acc + dot16(_pack(ds, IS_BF16), k_rows, scratch, DOT_MODE)
    out = _pack(acc * sm_scale, IS_BF16)
    tl.store(DQ + b * stride_ob + h * stride_oh + rows64[:, None] * stride_os
             + offs_d[None, :] * stride_od, out.to(DQ.dtype.element_ty), mask=row_ok[:, None])


@triton.jit(do_not_specialize=["H", "G", "Sq", "Skv"])
def _bwd_dkdv(
    Q, K, V, DO, DK, DV, Lse, Delta, Bias, Keep, Scratch,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ob, stride_os, stride_oh, stride_od,
    stride_bb, stride_bh, stride_bq, stride_bk,
    stride_xb, stride_xh, stride_xq, stride_xk,
    H, G, Sq, Skv, c, neg_log2e, sm_scale, log2e, dscale,
    HEAD_DIM: tl.constexpr, COLS: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_Q: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr,
    IS_BF16: tl.constexpr, FMA_VIA_FP64: tl.constexpr, DOT_MODE: tl.constexpr,
    SCRATCH_FLOATS: tl.constexpr,
):
    chunk = tl.program_id(0)
    bh = tl.program_id(1)
    Hkv = H // G
    b = (bh // Hkv).to(tl.int64)
    hkv = (bh % Hkv).to(tl.int64)
    scratch = program_scratch(Scratch, SCRATCH_FLOATS, DOT_MODE)
    cols = chunk * COLS + tl.arange(0, COLS)  # this program's KV rows
    kv_ok = cols < Skv
    cols64 = cols.to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_q = tl.arange(0, BLOCK_Q)
    kt = load16(K + b * stride_kb + hkv * stride_kh + cols64[None, :] * stride_ks
                + offs_d[:, None] * stride_kd, kv_ok[None, :], DOT_MODE)
    vt = load16(V + b * stride_vb + hkv * stride_vh + cols64[None, :] * stride_vs
                + offs_d[:, None] * stride_vd, kv_ok[None, :], DOT_MODE)
    c_tile = tl.full([BLOCK_Q, COLS], 0.0, tl.float32) + c

    # the streamed q tiles: all (rounded up to even, at least 2), or from the band's start
    n_q = (Sq + BLOCK_Q - 1) // BLOCK_Q
    t0 = n_q * 0
    t1 = tl.maximum((n_q + 1) // 2 * 2, 2)
    if CAUSAL:
        kv0 = (chunk * COLS // BLOCK_KV) * BLOCK_KV
        t0 = tl.maximum(kv0 - (Skv - Sq), 0) // BLOCK_Q
        t1 = t0 + (tl.maximum(n_q - t0, 0) + 1) // 2 * 2
    dk = tl.zeros([COLS, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([COLS, HEAD_DIM], dtype=tl.float32)
    for g in range(G):
        h = hkv * G + g
        for t in range(t0, t1):
            rows = t * BLOCK_Q + offs_q
            row_ok = rows < Sq
            rows64 = rows.to(tl.int64)
            qt = load16(Q + b * stride_qb + h * stride_qh + rows64[:, None] * stride_qs
                        + offs_d[None, :] * stride_qd, row_ok[:, None], DOT_MODE)
            dot_ = load16(DO + b * stride_ob + h * stride_oh + rows64[:, None] * stride_os
                          + offs_d[None, :] * stride_od, row_ok[:, None], DOT_MODE)
            nl = tl.load(Lse + (b * H + h) * Sq + rows64, mask=row_ok, other=0.0) * neg_log2e
            dlt = tl.load(Delta + (b * H + h) * Sq + rows64, mask=row_ok, other=0.0)
            s = dot16(qt, kt, scratch, DOT_MODE)      # [BLOCK_Q, COLS]
            dp = dot16(dot_, vt, scratch, DOT_MODE)
            nl_tile = tl.broadcast_to(nl[:, None], [BLOCK_Q, COLS])
            if HAS_BIAS:
                bt = tl.load(Bias + b * stride_bb + h * stride_bh + rows64[:, None] * stride_bq
                             + cols64[None, :] * stride_bk, mask=row_ok[:, None] & kv_ok[None, :],
                             other=0.0).to(tl.float32)
                x = fma_f32(s, c_tile, bt * log2e, FMA_VIA_FP64) + nl_tile
            else:
                x = fma_f32(s, c_tile, nl_tile, FMA_VIA_FP64)
            p = exp2_ieee(x)
            if CAUSAL:
                p = tl.where(cols[None, :] <= rows[:, None] + (Skv - Sq), p, 0.0)
            if DROPOUT:
                kp = tl.load(Keep + b * stride_xb + h * stride_xh + rows64[:, None] * stride_xq
                             + cols64[None, :] * stride_xk, mask=row_ok[:, None] & kv_ok[None, :],
                             other=0) != 0
                dp = tl.where(kp, dp * dscale, 0.0)
            ds = p * (dp - dlt[:, None])
            if DROPOUT:
                p = tl.where(kp, p, 0.0)
            dv = dv + dot16(tl.trans(_pack(p, IS_BF16)), dot_, scratch, DOT_MODE)
            dk = dk + dot16(tl.trans(_pack(ds, IS_BF16)), qt, scratch, DOT_MODE)
    dk = _pack(dk * sm_scale, IS_BF16)
    if DROPOUT:
        dv = _pack(dv * dscale, IS_BF16)
    else:
        dv = _pack(dv, IS_BF16)
    ok = kv_ok[:, None]
    tl.store(DK + b * stride_kb + hkv * stride_kh + cols64[:, None] * stride_ks
             + offs_d[None, :] * stride_kd, dk.to(DK.dtype.element_ty), mask=ok)
    tl.store(DV + b * stride_vb + hkv * stride_vh + cols64[:, None] * stride_vs
             + offs_d[None, :] * stride_vd, dv.to(DV.dtype.element_ty), mask=ok)


def _mods(bias, keep, B, H, Sq, Skv, dev):
    """(bias view, its strides, keep as int8, its strides): expanded to [B, H, Sq, Skv]."""
    dummy = torch.zeros(1, device=dev)
    if bias is not None:
        bias_t = bias.expand(B, H, Sq, Skv)
        bias_st = bias_t.stride()
    else:
        bias_t, bias_st = dummy, (0, 0, 0, 0)
    if keep is not None:
        keep_t = keep.to(torch.int8)
        keep_st = keep_t.stride()
    else:
        keep_t, keep_st = dummy, (0, 0, 0, 0)
    return bias_t, bias_st, keep_t, keep_st


def _check_port(q, k, v, causal, interpret, block):
    B, _, H, _ = q.shape
    check_launch((q, k, v), ("q", "k", "v"), batch_heads=B * H, causal=causal, recorder=None,
                 interpret=interpret)
    if isinstance(block, bool) or not isinstance(block, int) or block < 64 or block % 64:
        raise ValueError(f"the block size must be a positive multiple of 64, got {block!r}")


def backward_dq(q, k, v, dout, lse, delta, *, causal: bool, bias=None, dropout_p: float = 0.0,
                keep=None, lse_floor: bool = True, prescale_q: bool = False,
                block_m: int = DQ_BLOCK_M, softmax_scale: float | None = None,
                interpret: bool = False) -> torch.Tensor:
    """As ``fa_lab.kernels.bwd.dq.backward_dq``, on the port (``interpret``: Triton's CPU
    interpreter on CPU tensors; else compiled on CUDA/ROCm tensors)."""
    B, Sq, H, D, Skv, Hkv = check_backward(q, k, v, None, dout, lse, causal=causal, bias=bias,
                                           dropout_p=dropout_p, keep=keep, delta_=delta)
    for name, x in (("lse_floor", lse_floor), ("prescale_q", prescale_q)):
        if not isinstance(x, bool):
            raise TypeError(f"{name} must be a bool, got {type(x).__name__}")
    _check_port(q, k, v, causal, interpret, block_m)
    dev = q.device
    sm, c = scales(D, softmax_scale)
    rows = 64
    dq = torch.empty_like(q)
    bias_t, bias_st, keep_t, keep_st = _mods(bias, keep, B, H, Sq, Skv, dev)
    grid = (math.ceil(Sq / block_m) * block_m // rows, B * H)
    scratch, dot_meta = launch_dots(_bwd_dq, interpret, grid, rows, D, DQ_BLOCK_N, dev)
    ctx = torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()
    with ctx:
        launch(_bwd_dq, grid, interpret,
               q, k, v, dout, dq, lse.contiguous(), delta.contiguous(), bias_t, keep_t, scratch,
               *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *bias_st, *keep_st,
               H, H // Hkv, Sq, Skv, c, sm, f32(LOG2E),
               dropout_scale(dropout_p) if dropout_p > 0 else 1.0,
               HEAD_DIM=D, ROWS=rows, BLOCK_M=block_m, BLOCK_N=DQ_BLOCK_N, CAUSAL=causal,
               HAS_BIAS=bias is not None, DROPOUT=dropout_p > 0, LSE_FLOOR=lse_floor,
               PRESCALE_Q=prescale_q, FLOOR=LSE2_FLOOR, IS_BF16=q.dtype == torch.bfloat16,
               FMA_VIA_FP64=fma_via_fp64(_bwd_dq, interpret), **dot_meta,
               enable_fp_fusion=False)
    return dq


def backward_dkdv(q, k, v, dout, lse, delta, *, causal: bool, bias=None, dropout_p: float = 0.0,
                  keep=None, block_kv: int = DKDV_BLOCK_KV, softmax_scale: float | None = None,
                  interpret: bool = False):
    """As ``fa_lab.kernels.bwd.dkdv.backward_dkdv``, on the port."""
    B, Sq, H, D, Skv, Hkv = check_backward(q, k, v, None, dout, lse, causal=causal, bias=bias,
                                           dropout_p=dropout_p, keep=keep, delta_=delta)
    _check_port(q, k, v, causal, interpret, block_kv)
    dev = q.device
    sm, c = scales(D, softmax_scale)
    cols = 64
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    bias_t, bias_st, keep_t, keep_st = _mods(bias, keep, B, H, Sq, Skv, dev)
    grid = (math.ceil(Skv / cols), B * Hkv)
    scratch, dot_meta = launch_dots(_bwd_dkdv, interpret, grid, max(cols, DKDV_BLOCK_Q), D,
                                    max(cols, DKDV_BLOCK_Q), dev)
    ctx = torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()
    with ctx:
        launch(_bwd_dkdv, grid, interpret,
               q, k, v, dout, dk, dv, lse.contiguous(), delta.contiguous(), bias_t, keep_t, scratch,
               *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *bias_st, *keep_st,
               H, H // Hkv, Sq, Skv, c, f32(-LOG2E), sm, f32(LOG2E),
               dropout_scale(dropout_p) if dropout_p > 0 else 1.0,
               HEAD_DIM=D, COLS=cols, BLOCK_KV=block_kv, BLOCK_Q=DKDV_BLOCK_Q, CAUSAL=causal,
               HAS_BIAS=bias is not None, DROPOUT=dropout_p > 0, IS_BF16=q.dtype == torch.bfloat16,
               FMA_VIA_FP64=fma_via_fp64(_bwd_dkdv, interpret), **dot_meta,
               enable_fp_fusion=False)
    return dk, dv


def backward(q, k, v, out, dout, lse, *, causal: bool, bias=None, dropout_p: float = 0.0,
             keep=None, lse_floor: bool = True, interpret: bool = False):
    """As ``fa_lab.kernels.bwd.model.backward`` (delta on the host, then both kernels)."""
    check_backward(q, k, v, out, dout, lse, causal=causal, bias=bias, dropout_p=dropout_p,
                   keep=keep)
    d = row_delta(out, dout)
    kw = dict(causal=causal, bias=bias, dropout_p=dropout_p, keep=keep, interpret=interpret)
    dq = backward_dq(q, k, v, dout, lse, d, lse_floor=lse_floor, **kw)
    dk, dv = backward_dkdv(q, k, v, dout, lse, d, **kw)
    return dq, dk, dv
