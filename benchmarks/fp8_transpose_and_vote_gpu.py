"""The fp8 forward with its one-pass V transpose (autotuned, and the transpose alone) at
the short causal and the seed's shape; then eager, lazy and a lazy vote that never fires
(threshold 1e6) at the same pinned tiling, interleaved rounds. Writes $OUT/probe2.json
(data/results/bench_configs_h200.json, lazy_vote_cost_h200.json)."""
import dataclasses
import json
import os
import sys

import torch
from fa_lab.kernels._triton.fast import Config
from fa_lab.kernels.swp_bf16 import fast as b16
from fa_lab.kernels.swp_fp8 import fast as f8
from triton.testing import do_bench

from fa_lab import policies
from fa_lab.studies import bench

out = {"rows": []}
def save():
    json.dump(out, open(os.path.join(os.environ["OUT"], "probe2.json"), "w"), indent=1, default=str)
S = bench.SHAPES
for shp in (S[4], S[0]):
    inp = bench.impls._inputs(shp, "cuda", 0, fp8=True)
    (q8, k8, v8), (qd, kd, vd) = inp.fp8
    pol = policies.resolve(fp8=True, seqlen_kv=shp.seqlen_kv, rescale="lazy")
    fn = lambda: f8.forward(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=shp.causal, policy=pol)
    fn(); torch.cuda.synchronize()
    t_all = do_bench(fn, return_mode="median"); t_tr = do_bench(lambda: f8.transpose_v(v8), return_mode="median")
    r = {"shape": shp.name, "fp8_lazy_autotuned_ms": t_all, "transpose_ms": t_tr, "tflops": shp.flops()/t_all/1e9,
         "config": str(f8.best_config(q8, k8, shp.causal, True))}
    print(r); out["rows"].append(r); save()
for shp, cfgs in ((S[0], (Config(128,64,8,4,True), Config(128,64,8,3,True))), (S[3], (Config(128,64,4,3,True), Config(128,64,8,4,True)))):
    inp = bench.impls._inputs(shp, "cuda", 0)
    lazy = policies.resolve(fp8=False, seqlen_kv=shp.seqlen_kv, rescale="lazy")
    never = dataclasses.replace(lazy, threshold=1e6, name="lazy_never")
    eager = policies.resolve(fp8=False, seqlen_kv=shp.seqlen_kv, rescale="eager")
    for cfg in cfgs:
        fns = {p.name: (lambda p=p: b16.forward(inp.q, inp.k, inp.v, causal=shp.causal, policy=p, config=cfg)) for p in (eager, lazy, never)}
        for f in fns.values(): f()
        times = {n: [] for n in fns}
        for rnd in range(5):
            for n, f in fns.items():
                times[n].append(do_bench(f, warmup=10, rep=60, return_mode="median"))
        r = {"shape": shp.name, "config": cfg.describe(True), "ms": times,
             "eager_over": {n: [e / t for e, t in zip(times["eager"], times[n])] for n in times}}
        print(shp.name, cfg.describe(True), {n: round(sorted(v)[2], 4) for n, v in times.items()},
              {n: [round(x, 3) for x in v] for n, v in r["eager_over"].items()})
        sys.stdout.flush(); out["rows"].append(r); save()
