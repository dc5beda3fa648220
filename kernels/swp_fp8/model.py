"""Exact model of the gfx950 fp8 BN128 forward, ``DualwaveFp8SoftmaxHelper``
(docs/semantics.md §3).

Inputs are float8_e4m3fn with fp32 per-tensor descales. Scores stay in the raw fp8-product
domain (the running max m too); ``ls`` converts a raw difference to log2 units. KV tiles
of 64 columns are taken in pairs; the rescale is decided once per pair:

  mt = maxNum over the pair, a NaN score losing (causal: floored at -3e38)
  eager:  rebase every row to fmax(m, mt)
  lazy*:  d = (mt - m) * ls; the 32-row wave rescales if any row has d > THR, then every
          row of it rebases by the policy's rule (own tile max / capped / monotonic)
  per tile: P = exp2(fma(S, ls, -ls*m + H)); l += sum(P); O += e4m3(P) @ V8
  out = bf16(O * (rcp(l) * v_descale)), ls = c * (q_descale * k_descale) (§3.6)
"""

from __future__ import annotations


import torch

from fa_lab.numerics import f32
from fa_lab.capabilities import check_semantics
from fa_lab.policies import Policy
from fa_lab.trace import TraceRecorder
from . import FAMILY, split
from fa_lab.numerics import log2_scale
from .walk import run_group
from .._common.models import check_decidable, heads, run_groups
from .._common.geometry import block_groups, padded_rows
from ..swp_bf16.model import _pad_kv

KERNEL = "swp_fp8"
HEAD_DIM = 128


def forward(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, *, q_descale: float,
            k_descale: float, v_descale: float, causal: bool, policy: Policy,
            saturate: bool = True, recorder: TraceRecorder | None = None,
            num_kv_splits: int = 1, paged=None):
    """q8 [B, Sq, H, 128], k8 and v8 [B, Skv, Hkv, 128], float8_e4m3fn.

    ``saturate`` picks the P cast: clamp to 448 (True) or NaN past it (False).
    Other head dims (D, Dv) and ``num_kv_splits`` > 1 run FlyDSL #1097's path, ``split``.
    ``paged`` (a checked ``fa_lab.paged.PagedFp8``): FlyDSL #1066's paged prefill, packed
    q and a page cache (``fa_lab.kernels.swp_fp8.paged``).
    Returns (out [B, Sq, H, D] bf16, lse [B, H, Sq] fp32, natural log of the scaled softmax
    denominator; the fp8 kernel itself returns no LSE, this is the model's read-out).
    """
    if paged is not None:
        from . import paged as paged_model
        return paged_model.forward(q8, k8, v8, q_descale=q_descale, k_descale=k_descale,
                                   v_descale=v_descale, causal=causal, policy=policy,
                                   paged=paged, saturate=saturate, recorder=recorder)
    if num_kv_splits != 1 or q8.shape[-1] != HEAD_DIM or v8.shape[-1] != HEAD_DIM:
        return split.forward(q8, k8, v8, q_descale=q_descale, k_descale=k_descale,
                             v_descale=v_descale, causal=causal, policy=policy,
                             num_kv_splits=num_kv_splits, saturate=saturate, recorder=recorder)
    check_semantics(policy, FAMILY, "model")
    check_decidable(policy, f"the {FAMILY.name} model")
    Sq, D = q8.shape[1], q8.shape[3]
    Skv = k8.shape[1]
    ls = log2_scale(q_descale, k_descale, D)
    qf, kf, vf = heads(q8, k8, v8, padded_rows(Sq))

    def run(q_rows, rows, n_tiles):
        kp, vp = _pad_kv(kf, vf, n_tiles)
        return run_group(q_rows, kp, vp, rows, n_tiles, Sq, Skv, causal, policy, ls,
                          f32(v_descale), saturate, recorder)

    groups = ((g.rows, g.n_tiles) for g in block_groups(Sq, Skv, causal, q8.device))
    return run_groups(qf, groups, run, recorder, torch.bfloat16, Sq)
