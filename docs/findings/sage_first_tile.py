"""Repro for sage_first_tile.md: FlyDSL SageAttention (#869) starts its max at -inf and masks
with -inf without a floor, so a row whose first KV tile is masked entirely gives
(-inf) - (-inf) = NaN; its fp8 P cast has no scale, so keys more than 10 log2 units below
the row max vanish from the numerator while l keeps them.

Run: python docs/findings/sage_first_tile.py
"""

import math

import torch

import fa_lab
from fa_lab.kernels.online import model
from fa_lab.semantics import Semantics
from fa_lab.studies.experiments import quantize_e4m3

#: #869's sage_attn_cdna as the online model runs it: -inf start and masks, no tile-max
#: floor, 1/l at the end, P cast to e4m3 with no scale.
SAGE = fa_lab.Policy("tile", "max", name="sage-869", semantics=Semantics(
    tile_max_floor="never", epilogue_guard="none", p_cast="e4m3"))
#: The fix for the cast: P lifted by 448 before it (FA3's fp8 scale), divided out after.
SAGE_LIFTED = fa_lab.Policy("tile", "max", name="sage-869-P-x448", p_headroom=math.log2(448),
                            semantics=SAGE.semantics)


def first_tile_masked() -> dict:
    """64 rows (one Q block), 256 keys (fp8, per-tensor descales); the additive bias, which
    #869 holds per Q block and key, hides keys 0-63 (every row's first tile), then, in a
    second call, keys 64-127 instead."""
    g = torch.Generator().manual_seed(0)
    q8, qd = quantize_e4m3(torch.randn(1, 64, 1, 128, generator=g))
    k8, kd = quantize_e4m3(torch.randn(1, 256, 1, 128, generator=g))
    v8, vd = quantize_e4m3(torch.randn(1, 256, 1, 128, generator=g))
    res = {}
    for name, cols in (("first tile masked", slice(0, 64)), ("second tile masked", slice(64, 128))):
        mask = torch.zeros(64, 256)
        mask[:, cols] = -math.inf
        out, _ = model.forward(q8, k8, v8, policy=SAGE, mask=mask, q_descale=qd, k_descale=kd,
                               v_descale=vd)
        rows_nan = out.float().isnan().all(-1)
        res[name] = {"nan_rows": int(rows_nan.sum()), "rows": int(rows_nan.numel()),
                     "finite": bool(out.float().isfinite().all())}
    return res


def flushed_tail(n: int = 4095, gap: float = 11.0) -> dict:
    """One row: a key at score 0 and ``n`` keys ``gap`` log2 units below, V = 1 (the exact
    output is 1)."""
    q = torch.ones(1, 1, 1, 1)
    k = torch.cat([torch.zeros(1), torch.full((n,), -gap)]).reshape(1, n + 1, 1, 1)
    v = torch.ones(1, n + 1, 1, 1)
    return {pol.name: float(model.forward(q, k, v, policy=pol, softmax_scale=model.LOG2_UNITS)[0])
            for pol in (SAGE, SAGE_LIFTED)}


def repro() -> dict:
    return {"first_tile": first_tile_masked(), "flushed_tail": flushed_tail()}


if __name__ == "__main__":
    r = repro()
    for name, x in r["first_tile"].items():
        print(f"{name}: {x['nan_rows']} of {x['rows']} rows NaN, all finite: {x['finite']}")
    print("1 key at 0 and 4095 keys 11 below, V = 1 (exact output 1):", r["flushed_tail"])
