"""Record the fixed max's bound (``onset.bound("primus-a6a16cdc")``) checked against the
atlas and the attack: data/results/fixed_max_bound.json.

* ``atlas``: ``boundcheck.fixed_max_atlas_onset`` over data/atlas/fixed_max_cpu (the seed's
  inputs, causal, over K scale, on the online model): per K the atlas's non-finite rows,
  the model's (reproduced), the rows outside the region and any failing row inside it.
* ``attack_outside``: the attack on the policy in the ``scores`` and ``zoo`` spaces (as
  ``tests/studies/test_onset_bound_fixed_max.py``): what it found and which of the
  region's hazards the shrunk input violates.
* ``attack_inside``: ``boundcheck.attack_inside``: the attack with the region as a filter,
  every class of failure; it should find nothing.

    OMP_NUM_THREADS=1 python benchmarks/fixed_max_bound.py --out data/results/fixed_max_bound.json
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

from fa_lab import results
from fa_lab.studies import adversary as A
from fa_lab.studies import onset
from fa_lab.studies.onset import boundcheck as BC

POLICY = "primus-a6a16cdc"


def attack_outside(space: str, budget_s: float, seed: int) -> dict:
    t0 = time.perf_counter()
    res = A.search(POLICY, budget_s=budget_s, seed=seed, space=space)
    rec = {"space": space, "seed": seed, "budget_s": budget_s, "found": res.found,
           "found_classes": res.found_classes, "time_to_first_s": res.time_to_first_s,
           "evals": res.evals, "wall_s": time.perf_counter() - t0, "summary": A.summary(res)}
    if res.found:
        c = res.shrunk
        q, k, v = A.space.build(c)
        m = onset.measure(q, k, v, policy=POLICY, causal=c.causal)
        rec.update(violated=onset.bound(POLICY).violated(m), repro=res.repro,
                   s_max=float(m.s_max[m.defined].max()), s_min_best=float(m.s_max[m.defined].min()))
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    t0 = time.perf_counter()
    atlas = BC.fixed_max_atlas_onset(POLICY)
    print("atlas: reproduced", atlas["reproduced"], "sound", atlas["sound"], "k_formula",
          atlas["k_formula"], "first failing K", atlas["first_failing_k"], flush=True)
    outside = [attack_outside(s, args.budget, args.seed) for s in ("scores", "zoo")]
    for r in outside:
        print("attack", r["space"], r["summary"], r.get("violated"), flush=True)
    inside = BC.attack_inside(POLICY, budget_s=args.budget, seed=args.seed)
    print("attack inside:", inside["summary"], flush=True)
    results.atomic_write_json(args.out, {
        "name": "fixed_max_bound", "provenance": results.provenance(threads=1),
        "params": {"policy": POLICY, "budget_s": args.budget, "seed": args.seed,
                   "atlas": "fixed_max_cpu", "backend": "emulator"},
        "region": onset.bound(POLICY).to_dict(), "atlas": atlas,
        "attack_outside": outside, "attack_inside": inside,
        "wall_s": time.perf_counter() - t0})


if __name__ == "__main__":
    main()
