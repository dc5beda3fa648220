"""Train fa_lab's small transformer (``fa_lab.studies.training``) under each policy with a
growing logit scale, and record when and where each first produces a non-finite value.

Writes the runs' first events and losses as JSON with provenance, and the figure of the
first non-finite step per policy against the logit scale as a PNG::

    OMP_NUM_THREADS=1 python benchmarks/training_nonfinite.py \\
        --out data/results/training_nonfinite.json --png docs/img/training_nonfinite.png
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

from fa_lab.results import atomic_write_json, provenance
from fa_lab.studies import training


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--png", default=None)
    ap.add_argument("--policies", nargs="+", default=["lazy", "lazy_unfixed"])
    ap.add_argument("--scales", nargs="+", type=float, default=[16, 32, 64, 128, 256])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # the routing notes repeat on every call
    runs, t0 = [], time.perf_counter()
    for pol in args.policies:
        for scale in args.scales:
            cfg = training.Config(policy=pol, scale=scale, steps=args.steps, seed=args.seed)
            run = training.train(cfg)
            runs.append(run)
            f = run["first"]
            print(pol, scale, "steps run", run["steps_run"], f"{run['step_s']:.2f} s/step",
                  "first:", None if f is None else
                  (f["step"], f["module"], f["phase"], f["tensor"], f["kind"], f["n_rows"],
                   round(f["temperature"], 2)), flush=True)
    table = training.first_nonfinite_table(runs)
    cfg0 = training.Config(steps=args.steps, seed=args.seed)
    params = {k: v for k, v in cfg0.__dict__.items() if k not in ("policy", "scale")}
    atomic_write_json(args.out, {
        "name": "training_nonfinite", "provenance": provenance(threads=1),
        "params": {**params, "policies": args.policies, "scales": args.scales,
                   "kernel": "swp_bf16", "backend": "emulator",
                   "note": "fixed-max forward (primus-a6a16cdc) not run: no such policy on this branch"},
        "seconds": time.perf_counter() - t0, "table": table,
        "runs": [{k: r[k] for k in ("config", "steps_run", "step_s", "losses", "first",
                                    "first_forward", "first_backward")} for r in runs]})
    if args.png:
        from fa_lab.lab.viz.export import to_png
        from fa_lab.lab.viz.training import first_nonfinite_steps
        to_png(first_nonfinite_steps(table), args.png)


if __name__ == "__main__":
    main()
