"""Repro for flex_masked_rows.md: FlyDSL flex attention (#931) masks with a finite -1e9 and
divides by max(l, 1e-12). A fully masked row still gives 0 (its running max starts at a
finite -60 that the mask never beats); rows whose every visible logit lies below about -87.6
are silently scaled down instead.

Run: python docs/findings/flex_masked_rows.py
"""

import math

import torch

import fa_lab
from fa_lab.numerics import LOG2E, f32
from fa_lab.semantics import Semantics

#: FlyDSL #931's flex kernel as the online model runs it: masked scores -1e9 (natural units
#: after the softmax scale), running max from -60 (the same units), no tile-max floor, and
#: 1 / max(l, 1e-12) at the end.
FLEX = fa_lab.Policy("tile", "max", name="flex-931", semantics=Semantics(
    mask_value=f32(-1e9 * f32(LOG2E)), m_init=f32(-60.0 * LOG2E), tile_max_floor="never",
    l_floor=1e-12, epilogue_guard="none"))
#: The counterfactual the TensorRT-LLM #17477 class describes: the same finite mask, a max
#: that starts at -inf.
FINITE_MASK_ONLY = fa_lab.Policy("tile", "max", name="finite-mask-inf-start",
                                 semantics=Semantics(mask_value=FLEX.semantics.mask_value,
                                                     tile_max_floor="never", l_floor=1e-12,
                                                     epilogue_guard="none"))


def masked_row() -> dict:
    """Row 5 of 64 masked entirely: what each policy returns there, and mean(V)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 64, 1, 64, generator=g).bfloat16() for _ in range(3))
    bias = torch.zeros(64, 64)
    bias[5] = -math.inf
    res = {"mean_v": v[0, :, 0].float().mean(0)[:3].tolist()}
    for pol in (FLEX, FINITE_MASK_ONLY):
        out = fa_lab.flash_attn_func(q, k, v, causal=False, rescale=pol, bias=bias.bfloat16(),
                                     backend="emulator")
        res[pol.name] = out[0, 5, 0, :3].float().tolist()
    return res


def low_logit_row(logit: float) -> float:
    """Causal row 0 sees one key; its scaled logit is ``logit`` (D = 64, scale 1/8). The
    softmax of one key is 1, so the output must equal V = 1."""
    q = torch.zeros(1, 64, 1, 64)
    q[0, :, 0, 0] = 8.0
    k = torch.zeros(1, 64, 1, 64)
    k[0, :, 0, 0] = logit
    v = torch.ones(1, 64, 1, 64)
    out = fa_lab.flash_attn_func(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True,
                                 rescale=FLEX, backend="emulator")
    return float(out[0, 0, 0, 0])


def repro() -> dict:
    return {"masked_row": masked_row(),
            "row0_output_by_logit": {s: low_logit_row(s) for s in (-80.0, -87.0, -88.0, -90.0,
                                                                  -100.0, -170.0)}}


if __name__ == "__main__":
    r = repro()
    print("fully masked row:", r["masked_row"])
    for s, o in r["row0_output_by_logit"].items():
        print(f"one visible key at logit {s}: output {o:.4g} (should be 1)")
