"""Repro for fp8_paged_threshold.md: an fp8 lazy body at threshold 8 lifts P by only
log2(448) - 8 = 0.807 before its e4m3 cast, so keys 10.8 to 12.8 log2 units below the row max
flush to 0 where the dense builder's threshold 6 (lift 2.807) keeps them.

Run: python docs/findings/fp8_paged_threshold.py
"""

import math

import torch

import fa_lab
from fa_lab.numerics import LOG2E, f32

D = 128
#: k_descale making the fp8 kernel's log2 scale ls = 1: a raw score is then log2 units.
K_DESCALE = 1.0 / f32(f32(1 / math.sqrt(D)) * f32(LOG2E))


def row(gap: float, n: int = 4095):
    """32 query rows (one wave) over one key at score 0 and ``n`` keys ``gap`` log2 units
    below it, V = 1: the exact output is 1."""
    q = torch.zeros(1, 32, 1, D)
    q[..., 0] = 1.0
    k = torch.zeros(1, n + 1, 1, D)
    k[0, 1:, 0, 0] = -gap
    v = torch.ones(1, n + 1, 1, D)
    return tuple(t.to(torch.float8_e4m3fn) for t in (q, k, v))


def repro() -> dict:
    """The output of row 0 under the monotonic lazy rescale (#1033) with #1020's lift at
    threshold 8 (the paged builder's default) and 6 (the dense builder's up to 4096 keys)."""
    res = {}
    for gap in (10.0, 11.0, 12.0, 13.0):
        q8, k8, v8 = row(gap)
        res[gap] = {thr: float(fa_lab.flash_attn_func(
            q8, k8, v8, q_descale=1.0, k_descale=K_DESCALE, v_descale=1.0, causal=False,
            rescale="lazy", rescale_threshold=thr, p_headroom=True, backend="emulator")[0, 0, 0, 0])
            for thr in (8.0, 6.0)}
    return res


if __name__ == "__main__":
    for gap, r in repro().items():
        print(f"4095 keys {gap:g} below the max (exact 1): threshold 8 -> {r[8.0]:.4g}, "
              f"threshold 6 -> {r[6.0]:.4g}")
