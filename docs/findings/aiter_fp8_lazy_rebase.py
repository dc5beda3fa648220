"""Repro for aiter_fp8_lazy_rebase.md: aiter PR #4676's vendored fp8 body rebases a firing
wave to each row's own tile max (pre-#1033), whatever dualwave_swp_lazy_rescale says.

Run: python docs/findings/aiter_fp8_lazy_rebase.py
"""

import fa_lab
from fa_lab.studies.experiments import fp8_inputs


def repro() -> dict:
    """The bug report's fp8 inputs (q = 0.1 N(0,1), k = 0.1 x 20000 N(0,1), V = ones,
    per-tensor e4m3), one head pair of 1024 rows, non-causal."""
    (q8, k8, v8), (qd, kd, vd) = fp8_inputs(1, 1024, 2, 20000.0, seed=0)
    res = {}
    for up in ("aiter-4676", "fixed"):
        for flag in (True, False):
            out = fa_lab.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                         causal=False, upstream=up, backend="emulator",
                                         dualwave_swp_lazy_rescale=flag)
            res[(up, flag)] = float(out.float().isnan().float().mean())
    return res


if __name__ == "__main__":
    for (up, flag), frac in repro().items():
        print(f"{up:>11}, dualwave_swp_lazy_rescale={flag!s:5}: NaN share of the output {frac:.4f}")
