"""What the O rescale and the lazy vote cost in the Gluon Hopper kernel: eager, lazy,
lazy with a vote that never fires (threshold 1e6: the vote's cost alone) and a bound
that neither votes nor rescales (the kernel's source with eager's rescale switched off:
wrong numbers, the fastest any lazy policy could be), at the same pinned launch,
interleaved rounds, at the D128 shapes of the dense suite. With ``--against COMMIT``,
also lazy as the kernel at that commit builds it (``lazy_at_COMMIT``: an earlier vote,
read with ``git show``). Writes $OUT/hopper_rescale_cost.json
(data/results/hopper_rescale_cost_h200.json)."""
import argparse
import json
import os

import hopper_variants
import torch
from triton.testing import do_bench

from fa_lab import policies
from fa_lab.studies import bench
from fa_lab.kernels.swp_bf16 import hopper
from fa_lab.kernels.swp_bf16.hopper import HopperConfig


def bound_module():
    """hopper.py with eager's O and l rescale removed (a timing bound only)."""
    src = open(hopper.__file__).read()
    marker = ("    acc = acc * gl.convert_layout(corr, gl.SliceLayout(1, o_layout))[:, None]\n"
              "    l = l * corr + gl.sum(p, 1)\n")
    if src.count(marker) != 1:
        raise RuntimeError("hopper.py changed: the O and l rescale is not where expected")
    return hopper_variants.load(src.replace(marker, "    l = l + gl.sum(p, 1)\n"), "hopper_bound")


def run_module(mod, inp, shp, policy, cfg):
    grid, args, meta, o, lse = mod.launch_args(inp.q, inp.k, inp.v, shp.causal, policy,
                                               mod.HopperConfig(**vars(cfg)), sms)
    mod._attn_fwd[grid](*args, **meta, num_warps=4)


parser = argparse.ArgumentParser()
parser.add_argument("--against", help="a commit whose hopper.py lazy is timed too")
cli = parser.parse_args()
ROUNDS = 5
bound = bound_module()
earlier = None
if cli.against:
    earlier = hopper_variants.at_commit(cli.against)
sms = torch.cuda.get_device_properties(0).multi_processor_count
out = {"rounds": ROUNDS, "rows": []}
for shp in (s for s in bench.SHAPES if s.D == 128):
    inp = bench.impls._inputs(shp, "cuda", 0)
    pol = {n: policies.resolve(fp8=False, seqlen_kv=shp.seqlen_kv, rescale=r, **kw) for n, r, kw in
           (("eager", "eager", {}), ("lazy", "lazy", {}), ("lazy_never", "lazy", {"rescale_threshold": 1e6}))}
    for cfg in (HopperConfig(128, 2, True, True), HopperConfig(128, 2, False, False)):
        fns = {n: (lambda p=p, cfg=cfg: hopper.forward(inp.q, inp.k, inp.v, causal=shp.causal,
                                                       policy=p, config=cfg)) for n, p in pol.items()}
        fns["no_rescale_bound"] = lambda cfg=cfg: run_module(bound, inp, shp, pol["eager"], cfg)
        if earlier is not None:
            fns[f"lazy_at_{cli.against}"] = lambda cfg=cfg: run_module(earlier, inp, shp, pol["lazy"], cfg)
        for f in fns.values():
            f()
        times = {n: [] for n in fns}
        for rnd in range(ROUNDS):
            names = list(fns)[rnd % len(fns):] + list(fns)[:rnd % len(fns)]  # rotate the order
            for n in names:
                times[n].append(do_bench(fns[n], warmup=10, rep=60, return_mode="median"))
        r = {"shape": shp.name, "config": cfg.describe(), "ms": times,
             "eager_over": {n: [e / t for e, t in zip(times["eager"], times[n])] for n in times}}
        med = {n: sorted(v)[ROUNDS // 2] for n, v in r["eager_over"].items()}
        print(shp.name, r["config"], {n: round(x, 3) for n, x in med.items()}, flush=True)
        out["rows"].append(r)
        tmp = os.path.join(os.environ["OUT"], "hopper_rescale_cost.json.tmp")
        with open(tmp, "w") as f:
            json.dump(out, f, indent=1)
        os.replace(tmp, os.path.join(os.environ["OUT"], "hopper_rescale_cost.json"))
