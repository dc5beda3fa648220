"""Repro for primus_fixed_max.md: Primus-Turbo a6a16cdc trains with a fixed zero reference
max, so P = exp2(score) overflows once a row's scores reach 128 log2 units and flushes to a
zero row below -126.

Run: python docs/findings/primus_fixed_max.py
"""

import math

import numpy as np
import torch

import fa_lab
from fa_lab import reference
from fa_lab.kernels.online import model
from fa_lab.studies import onset
from fa_lab.studies.experiments import bf16_inputs

#: The first score whose bf16 P rounds to inf: 2^128 (1 - 2^-9), in log2 units.
EDGE = 128 + math.log2(1 - 2.0 ** -9)


def one_key(score: float, n: int = 1, v: float = 1.0):
    """A row whose n visible keys all score ``score`` (log2 units), V = v: (output, bound's
    verdict)."""
    pol = fa_lab.policies.get("primus-a6a16cdc")
    q = torch.ones(1, 1, 1, 1)
    k = torch.full((1, n, 1, 1), score)
    vv = torch.full((1, n, 1, 1), v)
    out, _ = model.forward(q, k, vv, policy=pol, softmax_scale=model.LOG2_UNITS)
    m = onset.measure(q, k, vv, policy=pol, softmax_scale=model.LOG2_UNITS, dtype="fp32")
    return float(out.flatten()[0]), onset.bound(pol).violated(m)


def bug_report_rows(k_scale: float, S: int = 1024, H: int = 2) -> dict:
    """The bug report's inputs (q, v ~ N(0,1), k = N(0,1) x k_scale, D = 128), causal, under
    the copy's policy: the share of rows that are NaN, inf or silently zero."""
    q, k, v = bf16_inputs(1, S, H, 128, k_scale, seed=0)
    out = fa_lab.flash_attn_func(q, k, v, causal=True, rescale="primus-a6a16cdc",
                                 backend="emulator").float()
    ref, _ = reference.attention(q, k, v, causal=True)
    nan = out.isnan().any(-1)
    return {"nan_rows": float(nan.float().mean()),
            "inf_rows": float((out.isinf().any(-1) & ~nan).float().mean()),
            "zero_rows": float(((out == 0).all(-1) & (ref != 0).any(-1)).float().mean())}


def repro() -> dict:
    below = float(np.nextafter(np.float32(EDGE), np.float32(0)))
    above = float(np.nextafter(np.float32(EDGE), np.float32(200)))
    under = float(np.nextafter(np.float32(-126.0), np.float32(-200)))
    return {"edge": EDGE,
            "just_below_edge": (below, *one_key(below)), "just_above_edge": (above, *one_key(above)),
            "two_keys_at_127": one_key(127.0, n=2), "v2_at_127.5": one_key(127.5, v=2.0),
            "at_-126": one_key(-126.0), "just_below_-126": (under, *one_key(under)),
            "k_x16": bug_report_rows(16.0), "k_x32": bug_report_rows(32.0)}


if __name__ == "__main__":
    for name, r in repro().items():
        print(f"{name}: {r}")
