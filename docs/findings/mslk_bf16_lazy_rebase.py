"""Repro for mslk_bf16_lazy_rebase.md: MSLK 2a3c897's bf16 lazy body rebases a dragged row
down to its own tile max, so one wave's ballot overflows another row to NaN.

Run: python docs/findings/mslk_bf16_lazy_rebase.py
"""

import torch

import fa_lab
from fa_lab.studies.experiments import drag_case


def repro() -> dict:
    """One 32-row wave, 8 KV tiles, V = ones (every finite output is exactly 1): row 0's tile
    max rises 10 log2 units a tile, row 1's falls 40. Under MSLK's body row 1 is rebased down
    each time row 0 fires; under FlyDSL with #1033 nothing overflows."""
    q, k, v = drag_case()
    res = {}
    for up in ("mslk-2a3c897", "fixed"):
        out, lse = fa_lab.flash_attn_func(q, k, v, causal=False, upstream=up, kernel="swp_bf16",
                                          backend="emulator", return_lse=True)
        res[up] = {"nan_rows": int(out.isnan().any(-1).sum()),
                   "row1": float(out[0, 1, 0, 0]), "row1_lse": float(lse[0, 0, 1]),
                   "others_exact": bool((torch.cat([out[0, :1], out[0, 2:]]).float() == 1).all())}
    return res


if __name__ == "__main__":
    for version, r in repro().items():
        print(f"{version:>14}: NaN rows {r['nan_rows']}, row 1 -> {r['row1']} (LSE {r['row1_lse']}), "
              f"other rows exactly 1: {r['others_exact']}")
