"""What FlyDSL's gfx950 dQ and dK/dV kernels share: the two scales, the delta
preprocessing, the bottom-right causal test, and the checks of a backward call.

Upstream: ROCm/FlyDSL ``kernels/attention/flash_attn_gfx950_dq.py`` (1fa54fa3) and
``flash_attn_gfx950_dkdv.py`` (0c57de98). Both take ``sm_scale`` on the wire (fa_lab's
forward fixes it at 1/sqrt(D)) and form ``qk_scale = f32(sm_scale) * f32(log2 e)`` in fp32
(``ParityKernelContext.init_types_and_constants``). ``delta = rowsum(dO * O)`` is a host
argument of both kernels, computed once from the forward's O (fp32 rows).
"""

from __future__ import annotations

import math

import torch

from fa_lab.checks import check_qkv
from fa_lab.numerics import LOG2E, f32

#: The LSE floor of the dQ kernel (``load_row_scalars``): a -inf LSE becomes this after
#: the log2 e conversion, so that a masked -inf score minus it stays -inf.
LSE2_FLOOR = -3e38
#: dQ walks KV tiles of 64 columns (the 32-row family keeps the forward's score pair).
DQ_BLOCK_N = 64
#: dK/dV streams Q and dO in tiles of 64 rows (``contract_q``: four 16-row substeps).
DKDV_BLOCK_Q = 64
#: Rows per dQ program and KV rows per dK/dV program. Upstream's tuning table picks them;
#: they decide only which fully masked tiles a block visits under causal (a visited,
#: fully masked tile adds 0 * (dP - delta), which is NaN where delta is).
DQ_BLOCK_M = 128
DKDV_BLOCK_KV = 128
_DTYPES = (torch.bfloat16, torch.float16)


def scales(head_dim: int, softmax_scale: float | None = None) -> tuple[float, float]:
    """(sm_scale, qk_scale): f32(softmax_scale) (default 1/sqrt(D), fa_lab's forward's) and
    its fp32 product with f32(log2 e)."""
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    elif isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) \
            or not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be a positive finite float, got {softmax_scale!r}")
    sm = f32(float(softmax_scale))
    return sm, f32(sm * f32(LOG2E))


def delta(out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """rowsum(dO * O) [B, H, Sq] fp32 from [B, Sq, H, D]: the exact sum of the products
    (each exact in fp64), rounded once; the host's fp32 sum differs only in its order."""
    return (out.double() * dout.double()).sum(-1).float().permute(0, 2, 1).contiguous()


def causal_keep(rows: torch.Tensor, cols: torch.Tensor, seqlen_q: int, seqlen_kv: int):
    """[len(rows), len(cols)] bool: key ``col`` is live for query ``row`` (bottom-right:
    col <= row + Skv - Sq, the forward's convention)."""
    return cols[None, :] <= rows[:, None] + (seqlen_kv - seqlen_q)


def check_backward(q, k, v, out, dout, lse, *, causal, bias=None, dropout_p=0.0, keep=None,
                   delta_=None):
    """Check a backward call; returns (B, Sq, H, D, Skv, Hkv). Errors name the argument."""
    B, Sq, H, D, Skv, Hkv = check_qkv(q, k, v, dtypes=_DTYPES, head_dims=(64, 128),
                                      kernel="the gfx950 backward (bf16/f16 only, as upstream)")
    for name, t in (("out", out), ("dout", dout)):
        if name == "out" and t is None:
            continue  # the kernels read delta, not O
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.shape != q.shape or t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} must match q: shape {list(q.shape)}, {q.dtype} on {q.device}; "
                             f"got {list(t.shape)}, {t.dtype} on {t.device}")
    rows = [("lse", lse)] + ([("delta", delta_)] if delta_ is not None else [])
    for name, t in rows:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != (B, H, Sq) or t.dtype != torch.float32 or t.device != q.device:
            raise ValueError(f"{name} must be fp32 [B, H, Sq] = {[B, H, Sq]} on {q.device}, got "
                             f"{t.dtype} {list(t.shape)} on {t.device}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor, got {type(bias).__name__}")
        if bias.dtype != q.dtype or bias.device != q.device:
            raise ValueError(f"bias must be {q.dtype} on {q.device} (upstream reads it in q's "
                             f"dtype), got {bias.dtype} on {bias.device}")
        try:
            torch.broadcast_shapes(bias.shape, (B, H, Sq, Skv))
        except RuntimeError:
            raise ValueError(f"bias of shape {list(bias.shape)} does not broadcast to "
                             f"[B, H, Sq, Skv] = {[B, H, Sq, Skv]}") from None
        if causal:
            raise ValueError("bias together with causal is refused, as upstream refuses it "
                             "(a bias is a mask: which one wins is undefined)")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if dropout_p > 0:
        if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool:
            raise TypeError("dropout_p > 0 needs keep: the forward's bool mask [B, H, Sq, Skv] "
                            "(upstream regenerates it from the forward's Philox seed)")
        if tuple(keep.shape) != (B, H, Sq, Skv) or keep.device != q.device:
            raise ValueError(f"keep must be bool [B, H, Sq, Skv] = {[B, H, Sq, Skv]} on {q.device}, "
                             f"got {list(keep.shape)} on {keep.device}")
    elif keep is not None:
        raise ValueError("keep is the dropout mask; it applies only with dropout_p > 0")
    return B, Sq, H, D, Skv, Hkv


def dropout_scale(dropout_p: float) -> float:
    """The survivor scale 1/(1-p) as the fp32 kernel argument."""
    return f32(1.0 / (1.0 - dropout_p))


def to_heads(x: torch.Tensor, H: int) -> torch.Tensor:
    """[B, S, Hx, D] -> fp32 [B, H, S, D], a KV head repeated for its H/Hx query heads."""
    xf = x.float().permute(0, 2, 1, 3)
    return xf.repeat_interleave(H // x.shape[2], dim=1) if x.shape[2] != H else xf


def bias_full(bias, B, H, Sq, Skv, device) -> torch.Tensor | None:
    """The bias read as fp32 [B, H, Sq, Skv] (natural-log units), or None."""
    if bias is None:
        return None
    return bias.float().expand(B, H, Sq, Skv)
