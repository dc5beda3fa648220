"""B16 S1024 H16 D128 causal, lazy: the Gluon kernel launched bare on arguments built once,
against ``hopper.forward`` with the same launch pinned (per call: the checks, the TMA
descriptors, the persistent counters' zeros and the launch), and the zeros alone, in
interleaved rounds. Writes $OUT/forward_overhead.json: ms per call and round."""
import json
import os

import torch
from triton.testing import do_bench

from fa_lab import policies
from fa_lab.studies import bench
from fa_lab.kernels.swp_bf16 import hopper

shp = next(s for s in bench.SHAPES if s.B == 16)
inp = bench.impls._inputs(shp, "cuda", 0)
pol = policies.resolve(fp8=False, seqlen_kv=shp.seqlen_kv, rescale="lazy")
cfg = hopper.HopperConfig(128, 2, False, True)
sms = torch.cuda.get_device_properties(0).multi_processor_count  # as forward's grid
grid, args, meta, _, _ = hopper.launch_args(inp.q, inp.k, inp.v, True, pol, cfg, sms)
fns = {"launch": lambda: hopper._attn_fwd[grid](*args, **meta, num_warps=4),
       "forward": lambda: hopper.forward(inp.q, inp.k, inp.v, causal=True, policy=pol, config=cfg),
       "zeros": lambda: torch.zeros(2, device="cuda", dtype=torch.int32)}
for f in fns.values():
    f()
times = {n: [] for n in fns}
for _ in range(5):
    for n in fns:
        times[n].append(do_bench(fns[n], warmup=10, rep=100, return_mode="median"))
print({n: [round(x * 1000, 1) for x in v] for n, v in times.items()}, "us")
tmp = os.path.join(os.environ["OUT"], "forward_overhead.json.tmp")
with open(tmp, "w") as f:
    json.dump(times, f)
os.replace(tmp, os.path.join(os.environ["OUT"], "forward_overhead.json"))
