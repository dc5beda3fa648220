"""Repro for mslk_fp8_lazy_rebase.md: MSLK 2a3c897's fp8 kernel (bf16 P, "HIPREC") keeps the
pre-#1033 downward rebase; modelled as policy "mslk-2a3c897:fp8" on the online model.

Run: python docs/findings/mslk_fp8_lazy_rebase.py
"""

import dataclasses

import fa_lab
from fa_lab.studies.experiments import fp8_inputs


def repro() -> dict:
    """The bug report's fp8 inputs at 512 rows, one head, V = ones: the copy's policy, and the
    same policy with #1033's monotonic rebase."""
    (q8, k8, v8), (qd, kd, vd) = fp8_inputs(1, 512, 1, 20000.0, seed=0)
    copy = fa_lab.policies.get("mslk-2a3c897:fp8")
    fixed = dataclasses.replace(copy, rebase="max", name="mslk-2a3c897:fp8 with #1033")
    res = {}
    for pol in (copy, fixed):
        out = fa_lab.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                     causal=False, rescale=pol, backend="emulator")
        out = out.float()
        res[pol.name] = {"nan_share": float(out.isnan().float().mean()),
                         "max_err_where_finite": float((out[out.isfinite()] - 1).abs().max())
                         if out.isfinite().any() else float("nan")}
    return res


if __name__ == "__main__":
    for name, r in repro().items():
        print(f"{name:>28}: NaN share {r['nan_share']:.4f}, max |out - 1| where finite "
              f"{r['max_err_where_finite']:.3g}")
