"""Every launch configuration of the fast kernels, pinned one by one at a shape
(``config_sweep``): what the autotuner chooses from."""

from __future__ import annotations


import pandas as pd
from tqdm.auto import tqdm

from fa_lab import policies
from .suites import SHAPES, Shape
from .impls import _fast_module, _inputs


def config_sweep(shape: Shape = SHAPES[0], *, configs=None, bf16_policies=("eager", "lazy"),
                 fp8_policies=("eager", "lazy"), fp8_configs=None, device="cuda", seed=0,
                 warmup=25, rep=100, progress=True) -> pd.DataFrame:
    """Time the fast kernels at one shape with each launch configuration pinned (no
    autotune): the data behind the kernels' CONFIGS lists."""
    from triton.testing import do_bench

    bf16_mod, fp8_mod = _fast_module("swp_bf16.fast"), _fast_module("swp_fp8.fast")
    configs = bf16_mod.CANDIDATE_CONFIGS if configs is None else configs
    fp8_configs = fp8_mod.CANDIDATE_CONFIGS if fp8_configs is None else fp8_configs
    if shape.varlen:
        raise ValueError(f"config_sweep times the dense kernels; {shape.name} is a packed batch")
    inp = _inputs(shape, device, seed, fp8=True)
    q, k, v = inp.q, inp.k, inp.v
    (q8, k8, v8), (qd, kd, vd) = inp.fp8
    jobs = [("bf16", p, c) for c in configs for p in bf16_policies]
    jobs += [("fp8", p, c) for c in fp8_configs for p in fp8_policies]
    # eager ignores the row-sum filter: time it once per tile configuration
    jobs = [j for j in jobs if j[1] != "eager" or j[2].row_sum_filter]
    rows = []
    for kind, pol, cfg in tqdm(jobs, desc=f"sweep {shape.name}", disable=not progress):
        row = {"shape": shape.name, "kernel": kind, "policy": pol, "config": cfg.describe(pol != "eager"),
               "ms": None, "tflops": None, "note": None}
        try:
            if kind == "bf16":
                p = policies.resolve(fp8=False, seqlen_kv=shape.seqlen_kv, rescale=pol)
                fn = lambda: bf16_mod.forward(q, k, v, causal=shape.causal, policy=p, config=cfg)  # noqa: E731
            else:
                p = policies.resolve(fp8=True, seqlen_kv=shape.seqlen_kv, rescale=pol)
                fn = lambda: fp8_mod.forward(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,  # noqa: E731
                                             causal=shape.causal, policy=p, config=cfg)
            fn()
            ms = do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
            row.update(ms=ms, tflops=shape.flops() / (ms * 1e-3) / 1e12)
        except Exception as e:  # out of shared memory, a config the compiler rejects ...
            row["note"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        rows.append(row)
    return pd.DataFrame(rows)
