"""fp8 lazy at the dense suite's D128 shapes: the Gluon kernel at each ring depth, with and
without turn-taking (and, non-causal, a persistent grid), beside the Triton kernel's two
autotuning candidates, all pinned, in interleaved rounds. Writes
$OUT/hopper_fp8_configs.json (data/results/hopper_fp8_configs_h200.json): ms per round
and, per shape, every launch's speed over the fastest Triton candidate's."""
import json
import os

import torch
from triton.testing import do_bench

from fa_lab import bench, policies
from fa_lab.kernels.swp_fp8 import fast as fast_fp8
from fa_lab.kernels.swp_fp8.hopper import HopperConfig

ROUNDS = 3
out = {"rounds": ROUNDS, "rows": []}
for shp in (s for s in bench.SHAPES if s.D == 128):
    inp = bench._inputs(shp, "cuda", 0, fp8=True)
    (q8, k8, v8), (qd, kd, vd) = inp.fp8
    pol = policies.resolve(fp8=True, seqlen_kv=shp.seqlen_kv, rescale="lazy")
    configs = {c.describe(): c for c in fast_fp8.CONFIGS}
    configs.update({c.describe(): c for c in (
        HopperConfig(128, st, pp, pers) for st in (2, 3, 4) for pp in (True, False)
        for pers in ((False,) if shp.causal else (False, True)))})
    fns = {n: (lambda c=c: fast_fp8.forward(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                            causal=shp.causal, policy=pol, config=c))
           for n, c in configs.items()}
    for f in fns.values():
        f()
    times = {n: [] for n in fns}
    for rnd in range(ROUNDS):
        names = list(fns)[rnd % len(fns):] + list(fns)[:rnd % len(fns)]
        for n in names:
            times[n].append(do_bench(fns[n], warmup=10, rep=50, return_mode="median"))
    med = {n: sorted(v)[ROUNDS // 2] for n, v in times.items()}
    triton_best = min(med[c.describe()] for c in fast_fp8.CONFIGS)
    over = {n: triton_best / t for n, t in med.items()}
    best = max(over, key=over.get)
    print(shp.name, "best", best, f"{over[best]:.3f}x the best Triton;",
          {n: round(x, 3) for n, x in sorted(over.items(), key=lambda kv: -kv[1])[:4]}, flush=True)
    out["rows"].append({"shape": shp.name, "ms": times, "over_best_triton": over})
    tmp = os.path.join(os.environ["OUT"], "hopper_fp8_configs.json.tmp")
    with open(tmp, "w") as f:
        json.dump(out, f, indent=1)
    os.replace(tmp, os.path.join(os.environ["OUT"], "hopper_fp8_configs.json"))
