"""Exact model of FlyDSL's gfx950 dK/dV kernel (``flash_attn_gfx950_dkdv.py``, ROCm/FlyDSL
0c57de98; the 32-row body ``BwdDkDvTileBody``, which serves head dims 64 and 128).

The forward transposed: a program holds ``block_kv`` K and V rows and streams Q and dO
past in tiles of 64 rows. Per KV row and streamed tile, in the kernel's order
(docs/semantics.md §12.3):

  S, dP  = Q K^T, dO V^T                        exact dots, one fp32 rounding each
  x      = fma(S, qk_scale, lse * f32(-log2 e)) ``probabilities``: mul and add carry the
                                                contract flag, so LLVM fuses them (inferred)
  bias:  x = fma(S, qk_scale, bias * log2 e) + lse * (-log2 e)
  P      = exp2(x)                              no LSE floor here
  causal: P = 0 where col > row + Skv - Sq     a select on P (``mask_if_clipped``)
  dropout: dP = keep ? dP * 1/(1-p) : 0;  P_v = keep ? P : 0
  dS     = P * (dP - delta)                     P undropped
  dV    += pack(P_v)^T dO;  dK += pack(dS)^T Q  packs: RNE to the input type
  dK     = round(dK * sm_scale);  dV = round(dV [* 1/(1-p)])

No mask touches S: columns past Skv are rows of this kernel that the store drops, and
streamed rows past Sq read Q = dO = 0, LSE = delta = 0 (P = 1, dS = 0: they add zeros,
unless K holds inf or NaN). Under GQA a KV head sums its query heads in fp32, head by
head (heads outer, tiles inner). The walk: every tile, rounded up to an even count (at
least 2); under causal from the first tile a row of the block reaches to the last one,
rounded up to even (``common.decompose_causal_regions``, ROCm/FlyDSL
``kernels/attention/common.py`` 4cce1e4f, with the axes swapped), so tiles wholly above
the band are skipped.
"""

from __future__ import annotations

import torch

from fa_lab.numerics import LOG2E, exact_dot, exp2, f32, fma_f32, ieee_fp32_matmul, round_to

from .common import (DKDV_BLOCK_KV, DKDV_BLOCK_Q, bias_full, causal_keep, check_backward,
                     dropout_scale, scales, to_heads)


def q_tiles_walked(seqlen_q: int, seqlen_kv: int, causal: bool, block_kv: int):
    """[Skv, n_tiles] bool: which streamed q tiles each KV row's block visits."""
    n_q = -(-seqlen_q // DKDV_BLOCK_Q)
    n_even = max(2, (n_q + 1) // 2 * 2)
    kv0 = torch.arange(seqlen_kv) // block_kv * block_kv
    tiles = torch.arange(n_even)
    if not causal:
        return torch.ones(seqlen_kv, n_even, dtype=torch.bool)
    first_row = (kv0 - (seqlen_kv - seqlen_q)).clamp(min=0)
    first = first_row // DKDV_BLOCK_Q
    count = (n_q - first).clamp(min=0)
    count = (count + 1) // 2 * 2
    return (tiles[None, :] >= first[:, None]) & (tiles[None, :] < (first + count)[:, None])


def backward_dkdv(q, k, v, dout, lse, delta, *, causal: bool, bias=None, dropout_p: float = 0.0,
                  keep=None, block_kv: int = DKDV_BLOCK_KV, softmax_scale: float | None = None):
    """(dK, dV), each [B, Skv, Hkv, D] in q's dtype; arguments as ``dq.backward_dq``."""
    B, Sq, H, D, Skv, Hkv = check_backward(q, k, v, None, dout, lse, causal=causal, bias=bias,
                                           dropout_p=dropout_p, keep=keep, delta_=delta)
    if isinstance(block_kv, bool) or not isinstance(block_kv, int) or block_kv < 32 or block_kv % 32:
        raise ValueError(f"block_kv must be a positive multiple of 32 (whole waves), got {block_kv!r}")
    rnd = round_to(q.dtype)
    sm, c = scales(D, softmax_scale)
    log2e = f32(LOG2E)
    dev = q.device
    G = H // Hkv
    walk = q_tiles_walked(Sq, Skv, causal, block_kv).to(dev)
    n_rows = walk.shape[1] * DKDV_BLOCK_Q
    pad = n_rows - Sq

    def padded(x):  # [B, H, Sq, ...] -> streamed rows past Sq read 0
        return torch.nn.functional.pad(x, (0, 0) * (x.dim() - 3) + (0, pad))

    qf = padded(to_heads(q, H))
    dof = padded(to_heads(dout, H))
    kf = k.float().permute(0, 2, 1, 3)  # [B, Hkv, Skv, D]
    vf = v.float().permute(0, 2, 1, 3)
    neg_lse2 = torch.nn.functional.pad(lse * f32(-LOG2E), (0, pad))
    dlt = torch.nn.functional.pad(delta, (0, pad))
    bias_f = bias_full(bias, B, H, Sq, Skv, dev)
    if bias_f is not None:
        bias_f = torch.nn.functional.pad(bias_f * log2e, (0, 0, 0, pad))
    if dropout_p > 0:
        keep_f = torch.nn.functional.pad(keep, (0, 0, 0, pad))
        dscale = dropout_scale(dropout_p)
    rows_all = torch.arange(n_rows, device=dev)
    cols = torch.arange(Skv, device=dev)
    dk = torch.zeros(B, Hkv, Skv, D, device=dev)
    dv = torch.zeros(B, Hkv, Skv, D, device=dev)
    with ieee_fp32_matmul():
        for g in range(G):
            heads = torch.arange(Hkv, device=dev) * G + g
            for t in range(walk.shape[1]):
                r = slice(t * DKDV_BLOCK_Q, (t + 1) * DKDV_BLOCK_Q)
                qt, dot_ = qf[:, heads, r], dof[:, heads, r]  # [B, Hkv, 64, D]
                s = exact_dot(qt, kf.transpose(-1, -2))       # [B, Hkv, 64, Skv]
                dp = exact_dot(dot_, vf.transpose(-1, -2))
                nl = neg_lse2[:, heads, r][..., None].expand_as(s)
                if bias_f is None:
                    x = fma_f32(s, c, nl)
                else:
                    x = fma_f32(s, c, bias_f[:, heads, r]) + nl
                p = exp2(x)
                if causal:
                    live = causal_keep(rows_all[r], cols, Sq, Skv)
                    p = torch.where(live, p, torch.zeros_like(p))
                if dropout_p > 0:
                    kp = keep_f[:, heads, r]
                    dp = torch.where(kp, dp * dscale, torch.zeros_like(dp))
                ds = p * (dp - dlt[:, heads, r][..., None])
                if dropout_p > 0:
                    p = torch.where(kp, p, torch.zeros_like(p))
                walked = walk[:, t][:, None]  # [Skv, 1]
                dv = torch.where(walked, dv + exact_dot(rnd(p).transpose(-1, -2), dot_), dv)
                dk = torch.where(walked, dk + exact_dot(rnd(ds).transpose(-1, -2), qt), dk)
    dk = rnd(dk * sm)
    if dropout_p > 0:
        dv = rnd(dv * dscale)
    else:
        dv = rnd(dv)
    back = lambda x: x.to(q.dtype).permute(0, 2, 1, 3).contiguous()  # noqa: E731
    return back(dk), back(dv)
