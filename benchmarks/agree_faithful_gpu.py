"""On a GPU: where the faithful bf16 port's non-finite masks differ from the model's, on
the failing GPU test's inputs (B2 Sq2000 Skv2300 H8 Hkv2, K x48) and at the seed's full
size (B2 S8192 H32, K x32 and x48), lazy_unfixed, tensor-core dots.

    PYTHONPATH=$PWD python3 benchmarks/agree_faithful_gpu.py --out result.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from fa_lab.compare import tensor_diff
from fa_lab.experiments import atomic_write_json, bf16_inputs, provenance
from fa_lab.kernels.attention import swp_bf16
from fa_lab.models import swp_bf16 as model
from fa_lab.policies import RescalePolicy


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = "cuda"
    rows = []
    g = torch.Generator(device=dev).manual_seed(12)
    mid = (torch.randn(2, 2000, 8, 128, generator=g, device=dev).bfloat16(),
           (torch.randn(2, 2300, 2, 128, generator=g, device=dev) * 48).bfloat16(),
           torch.randn(2, 2300, 2, 128, generator=g, device=dev).bfloat16())
    cases = [("B2 Sq2000 Skv2300 H8 Hkv2 K x48", mid, c) for c in (False, True)]
    for ks in (32, 48):
        cases.append((f"B2 S8192 H32 K x{ks}", bf16_inputs(B=2, S=8192, H=32, D=128, k_scale=ks,
                                                           seed=0, device=dev), False))
    for name, (q, k, v), causal in cases:
        pol = RescalePolicy("lazy_unfixed")
        ok, lk = swp_bf16.forward(q, k, v, causal=causal, policy=pol)
        om, lm = model.forward(q, k, v, causal=causal, policy=pol)
        d_out, d_lse = tensor_diff("out", ok, om), tensor_diff("lse", lk, lm)
        row = {"case": name, "causal": causal,
               "out_masks": [m.__dict__ for m in d_out.masks], "out_rel_l2_both_finite": d_out.rel_l2,
               "lse_masks": [m.__dict__ for m in d_lse.masks], "lse_rel_l2_both_finite": d_lse.rel_l2}
        print(row, flush=True)
        rows.append(row)
        del ok, om, lk, lm
        torch.cuda.empty_cache()
    atomic_write_json(Path(args.out), {
        "name": "agree_faithful_gpu",
        "provenance": provenance(dev, command="PYTHONPATH=$PWD python3 benchmarks/agree_faithful_gpu.py"),
        "rows": rows})


if __name__ == "__main__":
    main()
