"""fp32 reference attention, chunked over query rows so that S = 8192 fits anywhere.

Independent of the models: a plain softmax(Q K^T / sqrt(D)) V in fp32 with the same
bottom-right-aligned causal mask and GQA mapping. Rows with no visible column give
out = 0 and lse = -inf. Non-finite inputs are flagged by ``input_flags``.
"""

from __future__ import annotations

import math

import torch

from fa_lab.numerics import ieee_fp32_matmul


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
              softmax_scale: float | None = None, chunk_rows: int = 1024,
              q_descale=None, k_descale=None, v_descale=None, dtype=torch.float32,
              bias=None, alibi_slopes=None, sink=None):
    """q [B, Sq, H, D], k [B, Skv, Hkv, D] and v [B, Skv, Hkv, Dv] of any float dtype (fp8
    inputs with their descales are dequantised first). Returns (out [B, Sq, H, Dv], lse
    [B, H, Sq]) in
    ``dtype`` (fp32 by default; fp64 for a tighter reference on small shapes).

    ``bias`` [Sq, Skv] and ALiBi (``alibi_slopes`` [H] or [B, H]: -slope * |i + Skv - Sq - j|)
    add to the scaled scores; ``sink`` [H] adds exp(sink) to each row's denominator."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be [B, S, H, D]")
    B, Sq, H, D = q.shape
    Skv, Hkv = k.shape[1], k.shape[2]
    if H % Hkv:
        raise ValueError(f"H={H} is not a multiple of the kv heads {Hkv}")
    if not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"chunk_rows must be a positive int, got {chunk_rows!r}")
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale

    def load(x, descale):
        x = x.to(dtype)
        return x * float(descale) if descale is not None else x

    qf = load(q, q_descale).permute(0, 2, 1, 3)  # [B, H, Sq, D]
    kv_index = torch.arange(H, device=q.device) // (H // Hkv)
    kf = load(k, k_descale).permute(0, 2, 1, 3)[:, kv_index]
    vf = load(v, v_descale).permute(0, 2, 1, 3)[:, kv_index]

    out = torch.empty(B, H, Sq, v.shape[-1], dtype=dtype, device=q.device)  # Dv may differ from D
    lse = torch.empty(B, H, Sq, dtype=dtype, device=q.device)
    cols = torch.arange(Skv, device=q.device)
    with ieee_fp32_matmul():
        for r0 in range(0, Sq, chunk_rows):
            r1 = min(Sq, r0 + chunk_rows)
            s = (qf[:, :, r0:r1] @ kf.transpose(-1, -2)) * scale
            rows = torch.arange(r0, r1, device=q.device)
            if bias is not None:
                s = s + bias.to(dtype)[r0:r1]
            if alibi_slopes is not None:
                dist = (rows[:, None] + (Skv - Sq) - cols[None, :]).abs().to(dtype)
                s = s - alibi_slopes.to(dtype).reshape(-1, H, 1, 1) * dist
            if causal:
                s = s.masked_fill(cols[None, :] > rows[:, None] + (Skv - Sq), float("-inf"))
            if sink is not None:
                # one extra logit per head with a zero value row
                sk = sink.to(dtype).reshape(1, H, 1, 1).expand(B, H, r1 - r0, 1)
                s_all = torch.cat([s, sk], dim=-1)
                row_lse = torch.logsumexp(s_all, dim=-1)
            else:
                row_lse = torch.logsumexp(s, dim=-1)
            p = torch.exp(s - torch.where(torch.isfinite(row_lse), row_lse, 0.0)[..., None])
            out[:, :, r0:r1] = p @ vf
            lse[:, :, r0:r1] = row_lse
    return out.permute(0, 2, 1, 3).contiguous(), lse


def input_flags(**tensors) -> dict[str, bool]:
    """Which named inputs hold NaN or inf (the reference cannot be trusted on those rows)."""
    return {name: bool((~torch.isfinite(t.float())).any()) for name, t in tensors.items()}
