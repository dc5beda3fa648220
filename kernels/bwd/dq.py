"""Exact model of FlyDSL's gfx950 dQ kernel (``flash_attn_gfx950_dq.py``, ROCm/FlyDSL
1fa54fa3; the 32-row body ``main_body``, which serves head dims 64 and 128).

P is recomputed from the forward's LSE, never from a running max. Per query row and KV
tile of 64 columns, in the kernel's order (docs/semantics.md §12.2):

  S    = Q K^T                                  exact dot, one fp32 rounding; Q not scaled
  s    = S * qk_scale                           fp32 (``scale_scores``; no fma with the next)
  s    = fma(bias, f32(log2 e), s)              bias builds (the add keeps the contract flag)
  s    = -inf past Skv, and (causal) past row + Skv - Sq
  lse2 = fmax(lse * f32(log2 e), -3e38)         ``load_row_scalars``: the LSE floor
  P    = exp2(s - lse2)                         the subtract rounds once (no fast-math)
  dP   = dO V^T;  dropout: dP = keep ? dP * 1/(1-p) : 0
  dS   = P * (dP - delta)                       fp32, two roundings
  dQ  += pack(dS) K                             pack: RNE to the input type
  dQ   = round(dQ * sm_scale)                   after the last tile

Under causal a block of ``block_m`` rows walks ceil((q0 + block_m + Skv - Sq) / 64) tiles
(``init_tile_bounds``); a block whose band is empty walks none and stores zeros.

``lse_floor=False`` is a variant without the floor (the TransformerEngine #3528 case: an
empty causal row's -inf LSE gives -inf - -inf = NaN). ``prescale_q=True`` is the fold
upstream removed: Q * qk_scale rounded to the input type before the dot, the forward's
arithmetic at 11c4174d (``fa_lab.kernels.swp_bf16.model``).
"""

from __future__ import annotations

import torch

from fa_lab.numerics import LOG2E, exact_dot, exp2, f32, fma_f32, fmax, ieee_fp32_matmul, round_to

from .common import (DQ_BLOCK_M, DQ_BLOCK_N, LSE2_FLOOR, bias_full, causal_keep, check_backward,
                     dropout_scale, scales, to_heads)


def tiles_walked(seqlen_q: int, seqlen_kv: int, causal: bool, block_m: int) -> torch.Tensor:
    """[Sq] int: the KV tiles each row's block walks (causal: up to its band's end)."""
    n_kv = -(-seqlen_kv // DQ_BLOCK_N)
    q0 = torch.arange(seqlen_q) // block_m * block_m
    if not causal:
        return torch.full((seqlen_q,), n_kv)
    end = (q0 + block_m + seqlen_kv - seqlen_q).clamp(min=0)
    return ((end + DQ_BLOCK_N - 1) // DQ_BLOCK_N).clamp(max=n_kv)


def backward_dq(q, k, v, dout, lse, delta, *, causal: bool, bias=None, dropout_p: float = 0.0,
                keep=None, lse_floor: bool = True, prescale_q: bool = False,
                block_m: int = DQ_BLOCK_M, softmax_scale: float | None = None) -> torch.Tensor:
    """dQ [B, Sq, H, D] in q's dtype. q, dout [B, Sq, H, D]; k, v [B, Skv, Hkv, D]; lse,
    delta [B, H, Sq] fp32 (the forward's natural-log LSE and ``common.delta``); ``bias``
    broadcastable to [B, H, Sq, Skv] (q's dtype, natural-log units; not with causal);
    ``keep`` the forward's dropout mask [B, H, Sq, Skv] when ``dropout_p`` > 0;
    ``softmax_scale`` upstream's ``sm_scale`` argument (default 1/sqrt(D)); ``block_m`` the
    rows of a program (``common.DQ_BLOCK_M``)."""
    B, Sq, H, D, Skv, _ = check_backward(q, k, v, None, dout, lse, causal=causal, bias=bias,
                                         dropout_p=dropout_p, keep=keep, delta_=delta)
    for name, x in (("lse_floor", lse_floor), ("prescale_q", prescale_q)):
        if not isinstance(x, bool):
            raise TypeError(f"{name} must be a bool, got {type(x).__name__}")
    if isinstance(block_m, bool) or not isinstance(block_m, int) or block_m < 32 or block_m % 32:
        raise ValueError(f"block_m must be a positive multiple of 32 (whole waves), got {block_m!r}")
    rnd = round_to(q.dtype)
    sm, c = scales(D, softmax_scale)
    log2e = f32(LOG2E)
    dev = q.device
    qf = to_heads(q, H)
    if prescale_q:
        qf = rnd(qf * c)
    kf, vf, dof = to_heads(k, H), to_heads(v, H), to_heads(dout, H)
    bias_f = bias_full(bias, B, H, Sq, Skv, dev)
    lse2 = (lse * log2e)[..., None]
    if lse_floor:
        lse2 = fmax(lse2, LSE2_FLOOR)
    dlt = delta[..., None]
    dscale = dropout_scale(dropout_p) if dropout_p > 0 else 1.0
    n_walk = tiles_walked(Sq, Skv, causal, block_m).to(dev)
    rows = torch.arange(Sq, device=dev)
    acc = torch.zeros(B, H, Sq, D, device=dev)
    with ieee_fp32_matmul():
        for t in range(int(n_walk.max()) if Sq else 0):
            c0, c1 = t * DQ_BLOCK_N, min((t + 1) * DQ_BLOCK_N, Skv)
            cols = torch.arange(c0, c0 + DQ_BLOCK_N, device=dev)
            kt = torch.nn.functional.pad(kf[..., c0:c1, :], (0, 0, 0, c0 + DQ_BLOCK_N - c1))
            vt = torch.nn.functional.pad(vf[..., c0:c1, :], (0, 0, 0, c0 + DQ_BLOCK_N - c1))
            s = exact_dot(qf, kt.transpose(-1, -2))
            if not prescale_q:
                s = s * c
            if bias_f is not None:
                bt = torch.nn.functional.pad(bias_f[..., c0:c1], (0, c0 + DQ_BLOCK_N - c1))
                s = fma_f32(bt, log2e, s)
            dead = (cols >= Skv)[None, :]
            if causal:
                dead = dead | ~causal_keep(rows, cols, Sq, Skv)
            s = s.masked_fill(dead, float("-inf"))
            dp = exact_dot(dof, vt.transpose(-1, -2))
            if dropout_p > 0:
                kp = torch.nn.functional.pad(keep[..., c0:c1], (0, c0 + DQ_BLOCK_N - c1))
                dp = torch.where(kp, dp * dscale, torch.zeros_like(dp))
            p = exp2(s - lse2)
            ds = p * (dp - dlt)
            contrib = exact_dot(rnd(ds), kt)
            walked = (t < n_walk)[:, None]
            acc = torch.where(walked, acc + contrib, acc)
    return rnd(acc * sm).to(q.dtype).permute(0, 2, 1, 3).contiguous()
