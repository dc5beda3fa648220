"""On a GPU: the faithful bf16 port's speed per rows_per_program at the seed's full size,
and where its NaN/inf masks differ from the model's on the GPU test's inputs.

    pip install --no-deps -e . && python3 benchmarks/probe_faithful_gpu.py --out result.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import triton

import fa_lab
from fa_lab.studies.experiments import atomic_write_json, bf16_inputs, provenance
from fa_lab.kernels.swp_bf16 import faithful as swp_bf16
from fa_lab.policies import get as get_policy


def masks(out):
    o = out.float()
    return {"nan": torch.isnan(o), "posinf": o == float("inf"), "neginf": o == float("-inf")}


def mask_diff(a, b) -> dict:
    ma, mb = masks(a), masks(b.to(a.device))
    return {k: {"a": int(ma[k].sum()), "b": int(mb[k].sum()), "differ": int((ma[k] ^ mb[k]).sum())}
            for k in ma}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = "cuda"
    res = {"speed": [], "agreement": []}

    # speed: the seed's full shape, lazy_unfixed at K x32
    q, k, v = bf16_inputs(B=2, S=8192, H=32, D=128, k_scale=32, seed=0, device=dev)
    pol = get_policy("lazy_unfixed")
    flops = 4.0 * 2 * 32 * 8192 * 8192 * 128
    ref_nan = None
    for rows in (32, 64, 128):
        t0 = time.time()
        run = lambda: swp_bf16.forward(q, k, v, causal=False, policy=pol,  # noqa: E731
                                       rows_per_program=rows)
        out, _ = run()
        torch.cuda.synchronize()
        first = time.time() - t0
        ms = triton.testing.do_bench(run, warmup=2, rep=20)
        nan = torch.isnan(out)
        same = ref_nan is None or torch.equal(nan, ref_nan)
        ref_nan = nan if ref_nan is None else ref_nan
        row = {"rows_per_program": rows, "ms": ms, "tflops": flops / ms / 1e9,
               "first_call_s": first, "nan_pct": 100 * nan.float().mean().item(),
               "nan_mask_same_as_first": bool(same)}
        print(row, flush=True)
        res["speed"].append(row)
    del q, k, v, out
    torch.cuda.empty_cache()

    # agreement: the shape where the GPU test failed, every policy, causal and not
    for causal in (False, True):
        # the failing GPU test's inputs (tests/kernels/swp_bf16/test_swp_bf16_faithful.py make_inputs): Sq != Skv, GQA
        g = torch.Generator(device=dev).manual_seed(12)
        q = torch.randn(2, 2000, 8, 128, generator=g, device=dev).bfloat16()
        k = (torch.randn(2, 2300, 2, 128, generator=g, device=dev) * 48).bfloat16()
        v = torch.randn(2, 2300, 2, 128, generator=g, device=dev).bfloat16()
        for policy in ("lazy_unfixed", "lazy"):
            kw = dict(causal=causal, rescale=policy, kernel="swp_bf16", return_lse=True)
            om, _ = fa_lab.flash_attn_func(q, k, v, backend="emulator", **kw)
            row = {"causal": causal, "policy": policy}
            ok, _ = swp_bf16.forward(q, k, v, causal=causal, policy=get_policy(policy))
            row["kernel_vs_model"] = mask_diff(ok, om)
            print(row, flush=True)
            res["agreement"].append(row)
    atomic_write_json(Path(args.out), {
        "name": "probe_faithful_gpu",
        "provenance": provenance(dev, command="python3 benchmarks/probe_faithful_gpu.py"),
        **res})


if __name__ == "__main__":
    main()
