"""On a GPU: where the faithful bf16 port's non-finite masks differ from the model's, with
each of its compiled dot modes: the tensor cores (the default) and the exact sum
(``fa_lab.kernels.exact_dots()``), on the GPU tests' drag case (B2 Sq2000 Skv2300 H8 Hkv2,
K x48) and at the seed's full size (B2 S8192 H32, K x24 ... x64), lazy_unfixed; with the
time of one call in each mode.

    pip install --no-deps -e . && python3 benchmarks/agree_faithful_gpu.py --out result.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
from pathlib import Path

import torch

from fa_lab.compare import tensor_diff
from fa_lab.studies.experiments import atomic_write_json, bf16_inputs, provenance
from fa_lab.kernels import exact_dots
from fa_lab.kernels.swp_bf16 import faithful as swp_bf16
from fa_lab.kernels.swp_bf16 import model as model
from fa_lab.policies import get as get_policy

DOT_MODES = {"tensor_cores": contextlib.nullcontext, "exact": exact_dots}


def timed(fn, warm_up: bool):
    """(result, milliseconds) of one call, after a warm-up call (the compile) if asked."""
    if warm_up:
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    end.record()
    torch.cuda.synchronize()
    return out, start.elapsed_time(end)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--full-scales", default="32,48,24,64", help="K scales at the seed's size")
    args = ap.parse_args()
    dev = "cuda"
    rows = []
    g = torch.Generator(device=dev).manual_seed(12)
    mid = (torch.randn(2, 2000, 8, 128, generator=g, device=dev).bfloat16(),
           (torch.randn(2, 2300, 2, 128, generator=g, device=dev) * 48).bfloat16(),
           torch.randn(2, 2300, 2, 128, generator=g, device=dev).bfloat16())
    cases = [("B2 Sq2000 Skv2300 H8 Hkv2 K x48", lambda: mid, c) for c in (False, True)]
    for ks in (int(x) for x in args.full_scales.split(",") if x):
        cases.append((f"B2 S8192 H32 K x{ks}",
                      lambda ks=ks: bf16_inputs(B=2, S=8192, H=32, D=128, k_scale=ks, seed=0,
                                                device=dev), False))
    pol = get_policy("lazy_unfixed")
    compiled = set()  # one compile per (mode, causal) serves every size
    for name, make, causal in cases:
        q, k, v = make()
        om, lm = model.forward(q, k, v, causal=causal, policy=pol)
        for mode, ctx in DOT_MODES.items():
            with ctx():
                (ok, lk), ms = timed(functools.partial(swp_bf16.forward, q, k, v, causal=causal,
                                                       policy=pol),
                                     warm_up=(mode, causal) not in compiled)
            compiled.add((mode, causal))
            d_out, d_lse = tensor_diff("out", ok, om), tensor_diff("lse", lk, lm)
            row = {"case": name, "causal": causal, "dots": mode, "ms": ms,
                   "nan_pct": 100.0 * torch.isnan(ok).float().mean().item(),
                   "model_nan_pct": 100.0 * torch.isnan(om).float().mean().item(),
                   "out_masks": [m.__dict__ for m in d_out.masks],
                   "out_rel_l2_both_finite": d_out.rel_l2,
                   "lse_masks": [m.__dict__ for m in d_lse.masks],
                   "lse_rel_l2_both_finite": d_lse.rel_l2}
            print(row, flush=True)
            rows.append(row)
            del ok, lk
        del om, lm, q, k, v
        torch.cuda.empty_cache()
    atomic_write_json(Path(args.out), {
        "name": Path(args.out).stem,
        "provenance": provenance(dev, command="python3 benchmarks/agree_faithful_gpu.py"
                                 f" --out {Path(args.out).name}"),
        "rows": rows})


if __name__ == "__main__":
    main()
