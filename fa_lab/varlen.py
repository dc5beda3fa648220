"""Variable-length (packed) batches: ``cu_seqlens_q`` / ``cu_seqlens_kv`` as upstream takes them.

q is ``[total_q, H, D]``, k and v ``[total_kv, Hkv, D]``; sequence b owns q rows
``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and the matching kv rows. The kernel gives each
sequence its own 256-row blocks, so waves never mix sequences and a varlen run is exactly
one dense run per sequence: that is how the models (and kernels) execute it. Positions
(causal diagonal, ALiBi distance) are measured within the sequence; a bias is
``[total_q, max_seqlen_kv]`` with global q rows and sequence-local key columns.
The LSE comes back as ``[B, H, max_seqlen_q]``, padded with -inf past each sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fa_lab.checks import check_int


@dataclass(frozen=True)
class Packing:
    """Checked sequence boundaries (host-side lists)."""

    cu_q: list[int]
    cu_kv: list[int]
    max_seqlen_q: int
    max_seqlen_kv: int
    #: the caller's int32 cu_seqlens_q / cu_seqlens_kv tensors (on q's device)
    cu_q_tensor: torch.Tensor | None = None
    cu_kv_tensor: torch.Tensor | None = None

    @property
    def batch(self) -> int:
        return len(self.cu_q) - 1

    def spans(self):
        """(b, q0, q1, k0, k1) per sequence."""
        for b in range(self.batch):
            yield b, self.cu_q[b], self.cu_q[b + 1], self.cu_kv[b], self.cu_kv[b + 1]


def cu_seqlens(name, x, total, device) -> list[int]:
    """``x`` as a list of sequence boundaries after checking it: an int32 [B+1] tensor on
    ``device`` from 0, non-decreasing, ending at ``total`` (None: any end). TypeError or
    ValueError naming ``name``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.int32 or x.dim() != 1 or x.numel() < 2:
        raise ValueError(f"{name} must be an int32 [B+1] tensor, got {x.dtype} of shape {list(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but q is on {device}")
    vals = x.tolist()
    if vals[0] != 0:
        raise ValueError(f"{name} must start at 0, got {vals[0]}")
    if any(b < a for a, b in zip(vals, vals[1:])):
        raise ValueError(f"{name} must be non-decreasing (monotonic), got {vals}")
    if total is not None and vals[-1] != total:
        raise ValueError(f"{name} ends at {vals[-1]} but the packed tensor has {total} rows")
    return vals


def check(q, k, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv) -> Packing | None:
    """None for a dense call; a Packing for a varlen one, after checking every argument."""
    if cu_seqlens_q is None and cu_seqlens_kv is None:
        for name, x in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_kv", max_seqlen_kv)):
            if x is not None:
                raise ValueError(f"{name} applies to varlen calls (with cu_seqlens_q/kv) only")
        return None
    if cu_seqlens_q is None or cu_seqlens_kv is None:
        given = "cu_seqlens_q" if cu_seqlens_kv is None else "cu_seqlens_kv"
        missing = "cu_seqlens_kv" if cu_seqlens_kv is None else "cu_seqlens_q"
        raise ValueError(f"{missing} is required when {given} is given")
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            shape = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"varlen {name} must be packed [total, H, D], got {shape}")
    cu_q = cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device)
    cu_kv = cu_seqlens("cu_seqlens_kv", cu_seqlens_kv, k.shape[0], q.device)
    if len(cu_q) != len(cu_kv):
        raise ValueError(f"cu_seqlens_q has {len(cu_q) - 1} sequences but cu_seqlens_kv has {len(cu_kv) - 1}")
    lq = [b - a for a, b in zip(cu_q, cu_q[1:])]
    lk = [b - a for a, b in zip(cu_kv, cu_kv[1:])]
    if max_seqlen_q is None:
        raise ValueError("max_seqlen_q is required in varlen mode")
    checked = {}
    for name, x, longest in (("max_seqlen_q", max_seqlen_q, max(lq)),
                             ("max_seqlen_kv", max_seqlen_kv, max(lk))):
        if x is not None:
            x = check_int(name, x)
            if x < longest:
                raise ValueError(f"{name}={x} is shorter than the longest sequence ({longest})")
        checked[name] = x
    max_seqlen_q, max_seqlen_kv = checked["max_seqlen_q"], checked["max_seqlen_kv"]
    cross = lq != lk
    if cross and max_seqlen_kv is None:
        raise ValueError("max_seqlen_kv is required when a sequence's q and kv lengths differ")
    return Packing(cu_q, cu_kv, max_seqlen_q,
                   max_seqlen_kv if max_seqlen_kv is not None else max_seqlen_q,
                   cu_seqlens_q, cu_seqlens_kv)


def run(packing: Packing, q, k, v, dense_fn, *, bias=None, alibi_slopes=None,
        run_empty: bool = False, **kw):
    """Run ``dense_fn(q_b, k_b, v_b, bias=..., alibi_slopes=..., **kw) -> (out, lse)`` once
    per sequence and pack the results. A sequence with no keys gets out 0 and LSE -inf
    without a call, unless ``run_empty``: then ``dense_fn`` runs it with Skv = 0 too (for
    a kernel whose semantics decide what such a row gives)."""
    H = q.shape[1]
    # the output has v's head dim; fp8 inputs give bf16
    out = torch.zeros(q.shape[0], H, v.shape[-1], device=q.device,
                      dtype=torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype)
    lse = torch.full((packing.batch, H, packing.max_seqlen_q), float("-inf"),
                     dtype=torch.float32, device=q.device)
    for b, q0, q1, k0, k1 in packing.spans():
        if q1 == q0:
            continue
        if k1 == k0 and not run_empty:  # no keys: nothing to attend to (out 0, lse -inf)
            continue
        extra = {}
        if bias is not None:
            extra["bias"] = bias[q0:q1, : k1 - k0].contiguous()
        if alibi_slopes is not None:
            extra["alibi_slopes"] = alibi_slopes[b] if alibi_slopes.dim() == 2 else alibi_slopes
        o, l = dense_fn(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], **extra, **kw)
        out[q0:q1] = o[0]
        lse[b, :, : q1 - q0] = l[0]
    return out, lse
