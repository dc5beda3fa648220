"""The Gluon kernel of this tree against the one at an earlier commit (``--against``, whose
``kernels/swp_bf16/hopper.py`` is read with ``git show`` and must be self-contained; or
``--source``, a copy of that file, with ``--against`` naming it), at
the dense suite's D128 shapes, for eager and lazy: each kernel at every launch of its own
``CONFIGS`` (turn-taking or not, one program per item or persistent), all pinned,
interleaved rounds. Writes $OUT/hopper_against.json: ms per round, and per shape and
policy each kernel's fastest launch with the earlier one's median time over this tree's
(> 1: this tree is faster)."""
import argparse
import json
import os

import hopper_variants
import torch
from triton.testing import do_bench

from fa_lab import policies
from fa_lab.studies import bench
from fa_lab.kernels.swp_bf16 import hopper

parser = argparse.ArgumentParser()
parser.add_argument("--against", required=True)
parser.add_argument("--source", help="the earlier hopper.py, where git cannot show it")
parser.add_argument("--rounds", type=int, default=3)
cli = parser.parse_args()

earlier = hopper_variants.at_commit(cli.against, cli.source)
kernels = {"this": hopper, cli.against: earlier}
sms = torch.cuda.get_device_properties(0).multi_processor_count


def runner(mod, cfg, inp, shp, pol):
    grid, args, meta, _, _ = mod.launch_args(inp.q, inp.k, inp.v, shp.causal, pol, cfg, sms)
    return lambda: mod._attn_fwd[grid](*args, **meta, num_warps=4)


out = {"against": cli.against, "rounds": cli.rounds, "rows": []}
for shp in (s for s in bench.SHAPES if s.D == 128):
    inp = bench.impls._inputs(shp, "cuda", 0)
    for rescale in ("eager", "lazy"):
        pol = policies.resolve(fp8=False, seqlen_kv=shp.seqlen_kv, rescale=rescale)
        fns = {}
        for name, mod in kernels.items():
            for cfg in mod.CONFIGS:
                fns[f"{name} {cfg.describe()}"] = runner(mod, cfg, inp, shp, pol)
        for f in fns.values():
            f()
        times = {n: [] for n in fns}
        for rnd in range(cli.rounds):
            names = list(fns)[rnd % len(fns):] + list(fns)[:rnd % len(fns)]
            for n in names:
                times[n].append(do_bench(fns[n], warmup=10, rep=50, return_mode="median"))
        med = {n: sorted(v)[cli.rounds // 2] for n, v in times.items()}
        best = {k: min((n for n in med if n.startswith(k + " ")), key=med.get) for k in kernels}
        ratio = med[best[cli.against]] / med[best["this"]]
        print(f"{shp.name:32s} {rescale:5s} earlier/this {ratio:.3f}  ({best['this']}: "
              f"{med[best['this']]:.4f} ms; {best[cli.against]}: {med[best[cli.against]]:.4f} ms)", flush=True)
        print("    " + "; ".join(f"{n}: {med[n]:.4f} [{min(times[n]):.4f}..{max(times[n]):.4f}]"
                                 for n in fns), flush=True)
        out["rows"].append({"shape": shp.name, "policy": rescale, "ms": times, "best": best,
                            "earlier_over_this": ratio})
        tmp = os.path.join(os.environ["OUT"], "hopper_against.json.tmp")
        with open(tmp, "w") as f:
            json.dump(out, f, indent=1)
        os.replace(tmp, os.path.join(os.environ["OUT"], "hopper_against.json"))
