"""The fast fp8 forward on Hopper: the host side of the Gluon kernel (``_gluon.hopper``:
FlashAttention-3's schedule with the semantics of ``swp_fp8.fast``, see its docstring),
for dense batches at head dim 128.

``swp_fp8.fast.forward`` checks the inputs, transposes V and calls ``run`` here on a
Hopper GPU when no Triton ``Config`` is pinned; with no config, the first call at a new
shape times ``CONFIGS`` and keeps the fastest.
"""

from __future__ import annotations

import torch

from fa_lab.models.swp_fp8 import log2_scale
from fa_lab.policies import Policy

from .._gluon import hopper as gluon_hopper
from .._gluon.hopper import BLOCK_M, HopperConfig, available

__all__ = ["HopperConfig", "available", "launch_args", "run", "best_config", "last_timings"]

KERNEL = "hopper_fp8"
FAMILY = "swp_fp8"
#: fp8 votes once per 128 columns (the model's pair of 64-column tiles).
BLOCK_N = 128


def launch_args(q8, k8, vt, causal: bool, policy: Policy, config: HopperConfig, *,
                q_descale: float, k_descale: float, v_descale: float, saturate: bool,
                num_sms: int = 0):
    """(grid, args, meta, out, lse) for ``_gluon.hopper._attn_fwd`` on contiguous fp8
    q8 [B, Sq, H, 128], k8 [B, Skv, Hkv, 128] and the transposed, padded V
    vt [B, Hkv, 128, Skv_pad] (``swp_fp8.fast.transpose_v``), all starting on 16 bytes."""
    D = q8.shape[-1]
    config.check(D, elem_bytes=1)
    if config.block_n != BLOCK_N:
        raise ValueError(f"the fp8 kernel votes every {BLOCK_N} columns: HopperConfig.block_n "
                         f"must be {BLOCK_N}, got {config.block_n}")
    B, Sq, H, _ = q8.shape
    Hkv = k8.shape[2]
    items = -(-Sq // BLOCK_M) * B * H
    grid = gluon_hopper.grid(items, config, num_sms)
    out = torch.empty(B, Sq, H, D, device=q8.device, dtype=torch.bfloat16)
    lse = torch.empty(B, H, Sq, device=q8.device, dtype=torch.float32)
    q_desc, k_desc = gluon_hopper.qkv_descriptors(q8, k8, BLOCK_N)
    v_desc = gluon_hopper.descriptor(vt.view(B * Hkv * D, vt.shape[-1]), [D, BLOCK_N])
    codes = policy.codes
    # scale_log2 is bf16's (Q is not pre-scaled here) and the output goes through `out`
    args = (q_desc, k_desc, v_desc, None, out, lse, B * H, H, H // Hkv, Sq, k8.shape[1], 1.0,
            codes.threshold, codes.rebase, codes.bound, log2_scale(q_descale, k_descale, D),
            codes.headroom, v_descale)
    meta = dict(D=D, BLOCK_N=BLOCK_N, STAGES=config.stages, CAUSAL=causal, LAZY=policy.lazy,
                PINGPONG=config.pingpong, FP8=True, SATURATE=saturate)
    return grid, args, meta, out, lse


def _key(q8, k8, causal, lazy, saturate):
    B, Sq, H, D = q8.shape
    return (FAMILY, B, Sq, k8.shape[1], H, H // k8.shape[2], D, causal, lazy, saturate, q8.device)


def run(q8, k8, vt, *, q_descale: float, k_descale: float, v_descale: float, causal: bool,
        policy: Policy, saturate: bool, config: HopperConfig | None = None):
    """The kernel on inputs ``swp_fp8.fast.forward`` has checked (descales as floats),
    with V transposed; ``config`` pins a launch (default: tuned per shape).
    Returns (out [B, Sq, H, D] bf16, lse [B, H, Sq] fp32, natural log)."""
    if config is not None:
        config.check(q8.shape[-1], elem_bytes=1)
    q8, k8, vt = (gluon_hopper.tma_ready(x) for x in (q8, k8, vt))
    sms = gluon_hopper.num_sms(q8.device)

    def launch(c):
        grid, args, meta, out, lse = launch_args(
            q8, k8, vt, causal, policy, c, q_descale=q_descale, k_descale=k_descale,
            v_descale=v_descale, saturate=saturate, num_sms=sms)
        gluon_hopper.launch(grid, args, meta, q8.device)
        return out, lse
    if config is None:
        config = gluon_hopper.pick(_key(q8, k8, causal, policy.lazy, saturate), FAMILY,
                                   policy.lazy, launch)
    return launch(config)


def best_config(q8, k8, causal: bool, lazy: bool, saturate: bool = True):
    """The tuned pick for these shapes (after a forward ran), or None."""
    return gluon_hopper.tuned(_key(q8, k8, causal, lazy, saturate))


def last_timings(lazy: bool) -> list[dict]:
    """The timings (ms per config) of the last shape tuned with this lazy flag; [] if none."""
    return gluon_hopper.last_timings(FAMILY, lazy)
