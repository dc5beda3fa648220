"""Where a fast call's host time goes, and what the seed's full-size fp8 table spends.

1. Host time per call (the wall time of the Python call while a spin kernel holds the GPU,
   so the call never waits on the queue; a sync inside the call shows as the spin's
   length): ``flash_attn_func(..., backend="fast")`` against the kernel module's own
   ``forward``, bf16 and fp8, at the short bench shapes and one long one. A cProfile of
   the API calls names the functions behind the time.
2. The seed's fp8 table at full size (``experiments.fp8_table(**SEED_SIZES["fp8"])``) on
   the faithful port: each variant's first call (compile) and second call, and the kernel
   alone at several ``rows_per_program``.

    python3 benchmarks/api_host_gpu.py --out result.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time

import torch

import fa_lab
from fa_lab.studies import experiments as ex
from fa_lab import policies
from fa_lab.studies.bench import Shape
from fa_lab.studies.bench.impls import _inputs
from fa_lab.kernels.swp_bf16 import fast as fast_bf16
from fa_lab.kernels.swp_fp8 import fast as fast_fp8
from fa_lab.kernels.swp_fp8 import faithful as faithful_fp8

SHAPES = (Shape(16, 1024, 16, 128, True), Shape(32, 512, 32, 128, True), Shape(2, 8192, 32, 128, True))


def host_ms(fn, n=50, spin_ms=20.0):
    """Median wall ms of ``fn()`` with the GPU held busy by a spin kernel."""
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(n):
        torch.cuda._sleep(int(spin_ms * 2_000_000))
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    return {"median": statistics.median(out), "min": min(out), "max": max(out)}


def profile(fn, n=200, top=25):
    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    torch.cuda._sleep(int(400 * 2_000_000))
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


def host_part():
    rows, profiles = [], {}
    for shape in SHAPES:
        inp = _inputs(shape, "cuda", 0, fp8=True)
        q, k, v = inp.q, inp.k, inp.v
        (q8, k8, v8), (qd, kd, vd) = inp.fp8
        pol = policies.resolve(fp8=False, seqlen_kv=shape.S, rescale="lazy")
        pol8 = policies.resolve(fp8=True, seqlen_kv=shape.S, rescale="lazy")
        fns = {
            "api_bf16": lambda: fa_lab.flash_attn_func(q, k, v, causal=shape.causal, rescale="lazy",
                                                       backend="fast"),
            "kernel_bf16": lambda: fast_bf16.forward(q, k, v, causal=shape.causal, policy=pol),
            "api_fp8": lambda: fa_lab.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd,
                                                      v_descale=vd, causal=shape.causal,
                                                      rescale="lazy", backend="fast"),
            "kernel_fp8": lambda: fast_fp8.forward(q8, k8, v8, q_descale=qd, k_descale=kd,
                                                   v_descale=vd, causal=shape.causal, policy=pol8),
        }
        for name, fn in fns.items():
            rows.append({"shape": shape.name, "call": name, "host_ms": host_ms(fn)})
            print(rows[-1], flush=True)
        if shape.S == 512:
            profiles = {name: profile(fns[name]) for name in ("api_bf16", "api_fp8")}
        fns = inp = None  # the next shape's tensors replace these
        torch.cuda.empty_cache()
    return rows, profiles


def table_part():
    sizes = ex.SEED_SIZES["fp8"]
    rows = []
    for K in ex.FP8_K_SCALES[:1]:
        (q8, k8, v8), (qd, kd, vd) = ex.fp8_inputs(sizes["B"], sizes["S"], sizes["H"], K, device="cuda")
        for label, pol, bound in (ex.FP8_VARIANTS[0], ex.FP8_VARIANTS[-1]):
            p = policies.resolve(fp8=True, seqlen_kv=sizes["S"], rescale=pol, rebase_bound=bound)
            for rpp in (32, 128):
                times = []
                for _ in range(2):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    faithful_fp8.forward(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                         causal=False, policy=p, rows_per_program=rpp)
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
                rows.append({"k_scale": K, "variant": label, "rows_per_program": rpp,
                             "first_s": times[0], "second_s": times[1]})
                print(rows[-1], flush=True)
    t0 = time.perf_counter()
    ex.fp8_table(**sizes, device="cuda", progress=False)
    whole = time.perf_counter() - t0
    print({"fp8_table_full_s": whole}, flush=True)
    return rows, whole


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--part", choices=("host", "table", "both"), default="both")
    args = ap.parse_args()
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d")}
    import triton
    res["triton"] = triton.__version__
    if args.part in ("host", "both"):
        res["host"], res["profiles"] = host_part()
    if args.part in ("table", "both"):
        res["table_calls"], res["fp8_table_full_s"] = table_part()
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    for name, text in res.get("profiles", {}).items():
        print(f"==== {name}\n{text[:3000]}")


if __name__ == "__main__":
    main()
