"""An fp64 autograd reference for the backward tests: plain softmax attention."""

import math

import torch


def attention64(q, k, v, dout, *, causal, bias=None, keep=None, dropout_p=0.0, scale=None):
    """fp64 (out [B, Sq, H, D], lse [B, H, Sq], dq, dk, dv) of softmax(scale * q k^T + bias)
    (dropped by ``keep`` with 1/(1-p)) @ v, bottom-right causal. Rows that see no key have
    out 0, lse -inf and zero gradients (the softmax is taken over live keys only)."""
    B, Sq, H, D = q.shape
    Skv, Hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    qq, kk, vv = (x.double().requires_grad_() for x in (q, k, v))
    qh = qq.permute(0, 2, 1, 3)
    kh = kk.permute(0, 2, 1, 3).repeat_interleave(H // Hkv, 1)
    vh = vv.permute(0, 2, 1, 3).repeat_interleave(H // Hkv, 1)
    s = qh @ kh.transpose(-1, -2) * scale
    if bias is not None:
        s = s + bias.double()
    live = torch.ones(Sq, Skv, dtype=torch.bool)
    if causal:
        live = torch.arange(Skv)[None, :] <= torch.arange(Sq)[:, None] + (Skv - Sq)
    s = s.masked_fill(~live, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None].clamp(min=-1e300)).masked_fill(~live, 0.0)
    if keep is not None:
        p = p * keep.double() / (1.0 - dropout_p)
    o = p @ vh
    o.backward(dout.double().permute(0, 2, 1, 3))
    return (o.detach().permute(0, 2, 1, 3), lse.detach(), qq.grad, kk.grad, vv.grad)


def inputs(B, Sq, Skv, H, Hkv, D, *, dtype=torch.bfloat16, seed=0, k_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Sq, H, D, generator=g).to(dtype)
    k = (torch.randn(B, Skv, Hkv, D, generator=g) * k_scale).to(dtype)
    v = torch.randn(B, Skv, Hkv, D, generator=g).to(dtype)
    do = torch.randn(B, Sq, H, D, generator=g).to(dtype)
    return q, k, v, do
