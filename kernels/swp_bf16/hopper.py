"""The fast bf16/f16 forward on Hopper: the host side of the Gluon kernel
(``_gluon.hopper``: FlashAttention-3's schedule with the semantics of ``fast``, see its
docstring), for dense batches at head dim 64 or 128.

``forward`` checks its inputs, lays them out for TMA and launches; with no config, the
first call at a new shape times ``CONFIGS`` and keeps the fastest.
"""

from __future__ import annotations

import torch

from fa_lab.capabilities import check_policy
from fa_lab.policies import Policy

from .._gluon import hopper as gluon_hopper
from .._gluon.hopper import BLOCK_M, CONFIGS, WAVE_BARRIER, HopperConfig, available
from .._triton import fast as common

__all__ = ["BLOCK_M", "CONFIGS", "WAVE_BARRIER", "HopperConfig", "available", "launch_args",
           "forward", "best_config", "last_timings"]

KERNEL = "hopper_bf16"
FAMILY = "swp_bf16"
HEAD_DIMS = common.BF16_HEAD_DIMS
DTYPES = common.BF16_DTYPES


def launch_args(q, k, v, causal: bool, policy: Policy, config: HopperConfig, num_sms: int = 0):
    """(grid, args, meta, out, lse) for ``_gluon.hopper._attn_fwd`` on contiguous
    [B, S, H, D] tensors whose data start on 16 bytes (TMA); ``num_sms``: the persistent
    grid's size."""
    config.check(q.shape[-1])
    B, Sq, H, D = q.shape
    Skv, Hkv = k.shape[1], k.shape[2]
    items = -(-Sq // BLOCK_M) * B * H
    grid = gluon_hopper.grid(items, config, num_sms)
    out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, H, Sq, device=q.device, dtype=torch.float32)
    q_desc, k_desc = gluon_hopper.qkv_descriptors(q, k, config.block_n)
    v_desc = gluon_hopper.descriptor(v.view(B, Skv, Hkv * D), [1, config.block_n, D])
    o_desc = gluon_hopper.descriptor(out.view(B, Sq, H * D), [1, gluon_hopper.WG_ROWS, D])
    scale_log2, threshold, _, rebase = common.policy_args(policy, D)
    # bound, ls, headroom and v_descale are fp8's: here 0, 1, 0 and 1
    args = (q_desc, k_desc, v_desc, o_desc, out, lse, B * H, H, H // Hkv, Sq, Skv, scale_log2,
            threshold, rebase, 0.0, 1.0, 0.0, 1.0)
    meta = dict(D=D, BLOCK_N=config.block_n, STAGES=config.stages, CAUSAL=causal,
                LAZY=policy.lazy, PINGPONG=config.pingpong, FP8=False, SATURATE=True)
    return grid, args, meta, out, lse


def _launch(q, k, v, causal, policy, config):
    grid, args, meta, out, lse = launch_args(q, k, v, causal, policy, config,
                                             gluon_hopper.num_sms(q.device))
    gluon_hopper.launch(grid, args, meta, q.device)
    return out, lse


def _key(q, k, causal, lazy):
    """What the pick depends on: the shapes (B too: the work items against the GPU's
    multiprocessors decide whether a persistent grid pays), the flags and the device."""
    B, Sq, H, D = q.shape
    return (FAMILY, B, Sq, k.shape[1], H, H // k.shape[2], D, causal, lazy, q.dtype, q.device)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, policy: Policy,
            config: HopperConfig | None = None):
    """q [B, Sq, H, D], k and v [B, Skv, Hkv, D], bf16 or f16, D 64 or 128, on a Hopper GPU.
    ``config`` pins a launch; by default the first call at a new shape times ``CONFIGS``
    and keeps the fastest. Returns (out [B, Sq, H, D], lse [B, H, Sq] fp32, natural log)."""
    common.check_qkv(q, k, v, DTYPES, HEAD_DIMS)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    check_policy(policy, FAMILY, "fast")
    if config is not None:
        if not isinstance(config, HopperConfig):
            raise TypeError(f"config must be a HopperConfig, got {type(config).__name__}")
        config.check(q.shape[-1])
    if q.device.type != "cuda" or not available(q.device):
        raise ValueError("the Gluon kernel runs on a Hopper GPU (sm_90) with CUDA tensors; "
                         f"got tensors on {q.device}" + ("" if gluon_hopper.gluon is not None else
                                                         ", and this triton has no Gluon"))
    q, k, v = (gluon_hopper.tma_ready(x) for x in (q, k, v))
    if config is None:
        config = gluon_hopper.pick(_key(q, k, causal, policy.lazy), FAMILY, policy.lazy,
                                   lambda c: _launch(q, k, v, causal, policy, c))
    return _launch(q, k, v, causal, policy, config)


def best_config(q, k, causal: bool, lazy: bool):
    """The tuned pick for these shapes (after a forward ran), or None."""
    return gluon_hopper.tuned(_key(q, k, causal, lazy))


def last_timings(lazy: bool) -> list[dict]:
    """The timings (ms per config) of the last shape tuned with this lazy flag; [] if none."""
    return gluon_hopper.last_timings(FAMILY, lazy)
