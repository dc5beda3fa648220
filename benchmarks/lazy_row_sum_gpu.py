"""Eager against lazy with and without the row-sum filter, at the same pinned tilings,
interleaved rounds, at the D128 shapes where lazy trails eager. Writes $OUT/probe3.json
(data/results/lazy_vote_cost_h200.json)."""
import json
import os
import sys

from fa_lab.kernels._triton.fast import Config
from fa_lab.kernels.swp_bf16 import fast as b16
from triton.testing import do_bench

from fa_lab import policies
from fa_lab.studies import bench

out = {"rows": []}
S = bench.SHAPES
for shp in (S[0], S[5], S[4]):
    inp = bench.impls._inputs(shp, "cuda", 0)
    lazy = policies.resolve(fp8=False, seqlen_kv=shp.seqlen_kv, rescale="lazy")
    eager = policies.resolve(fp8=False, seqlen_kv=shp.seqlen_kv, rescale="eager")
    for cfgs in ((Config(128,64,8,4,True), Config(128,64,8,4,True,False)), (Config(128,64,8,3,False), Config(128,64,8,3,False,False))):
        fns = {"eager": lambda c=cfgs[0]: b16.forward(inp.q, inp.k, inp.v, causal=shp.causal, policy=eager, config=c),
               "lazy_rowsum": lambda c=cfgs[0]: b16.forward(inp.q, inp.k, inp.v, causal=shp.causal, policy=lazy, config=c),
               "lazy_plain": lambda c=cfgs[1]: b16.forward(inp.q, inp.k, inp.v, causal=shp.causal, policy=lazy, config=c)}
        for f in fns.values(): f()
        times = {n: [] for n in fns}
        for rnd in range(5):
            for n, f in fns.items():
                times[n].append(do_bench(f, warmup=10, rep=60, return_mode="median"))
        r = {"shape": shp.name, "config": cfgs[0].describe(False), "ms": times,
             "eager_over": {n: [e / t for e, t in zip(times["eager"], times[n])] for n in times}}
        print(shp.name, r["config"], {n: round(sorted(v)[2], 4) for n, v in times.items()},
              {n: [round(x, 3) for x in v] for n, v in r["eager_over"].items() if n != "eager"})
        sys.stdout.flush(); out["rows"].append(r)
        json.dump(out, open(os.path.join(os.environ["OUT"], "probe3.json"), "w"), indent=1)
