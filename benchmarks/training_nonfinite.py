"""Train fa_lab's small transformer (``fa_lab.studies.training``) under each policy with a
growing logit scale, and record when and where each first produces a non-finite value.

Writes the runs' first events, losses and per-step score statistics as JSON with
provenance, and two figures: the first non-finite step per policy against the logit scale
(``--png``) and the largest log2 score each run meets, step by step, against the fixed
max's overflow edge (``--png-scores``)::

    OMP_NUM_THREADS=1 python benchmarks/training_nonfinite.py \\
        --out data/results/training_nonfinite.json --png docs/img/training_nonfinite.png \\
        --png-scores docs/img/training_scores.png

``--replot`` redraws the figures from an existing ``--out`` without training. To use
several processes, run one per policy (``--policies lazy --out part-lazy.json``, ...) and
join the parts with ``--merge part-*.json --out ...`` (each part keeps its provenance);
a part may also hold one policy at one scale (``--scales 64``).
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import torch

from fa_lab.results import atomic_write_json, provenance
from fa_lab.studies import training

POLICIES = ["lazy", "lazy_unfixed", "primus-a6a16cdc"]


def plot(doc: dict, png: str | None, png_scores: str | None) -> None:
    from fa_lab.lab.viz.export import to_png
    from fa_lab.lab.viz.training import first_nonfinite_steps, score_growth
    if png:
        to_png(first_nonfinite_steps(doc["table"]), png)
    if png_scores:
        to_png(score_growth(doc["runs"], scale=doc["params"]["scores_at_scale"]), png_scores)


def merge(args) -> None:
    parts = []
    for path in args.merge:
        with open(path) as f:
            parts.append(json.load(f))
    runs = [r for p in parts for r in p["runs"]]
    params = dict(parts[0]["params"])
    params["policies"] = [pol for p in parts for pol in p["params"]["policies"]]
    params["policies"] = list(dict.fromkeys(params["policies"]))
    params["scales"] = sorted({x for p in parts for x in p["params"]["scales"]})
    params["kernels"] = {k: v for p in parts for k, v in p["params"]["kernels"].items()}
    for key in ("steps", "seed", "scores_at_scale"):
        if any(p["params"][key] != params[key] for p in parts):
            raise ValueError(f"the parts differ in {key}")
    doc = {"name": "training_nonfinite",
           "provenance": {**provenance(threads=1), "parts": [p["provenance"] for p in parts]},
           "params": params, "seconds": max(p["seconds"] for p in parts),
           "table": [row for p in parts for row in p["table"]], "runs": runs}
    atomic_write_json(args.out, doc)
    plot(doc, args.png, args.png_scores)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--png", default=None)
    ap.add_argument("--png-scores", default=None)
    ap.add_argument("--policies", nargs="+", default=POLICIES)
    ap.add_argument("--scales", nargs="+", type=float, default=[8, 16, 32, 64, 128, 256])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scores-at-scale", type=float, default=256,
                    help="the scale whose runs the score figure draws")
    ap.add_argument("--replot", action="store_true")
    ap.add_argument("--merge", nargs="+", default=None, metavar="PART",
                    help="join these parts' runs into --out (and draw the figures)")
    args = ap.parse_args()
    if args.merge:
        merge(args)
        return
    if args.replot:
        with open(args.out) as f:
            plot(json.load(f), args.png, args.png_scores)
        return
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
    doc = {
        "name": "training_nonfinite", "provenance": provenance(threads=1),
        "params": {**params, "policies": args.policies, "scales": args.scales,
                   "kernels": {p: training.kernel_for(p) for p in args.policies},
                   "backend": "emulator", "scores_at_scale": args.scores_at_scale,
                   "scores_note": "per step and layer: score_stats of the step's forward "
                                  "(log2 units, fp32 from the bf16 q and k)"},
        "seconds": time.perf_counter() - t0, "table": table,
        "runs": [{**{k: r[k] for k in ("config", "kernel", "steps_run", "step_s", "losses",
                                       "first", "first_forward", "first_backward")},
                  "scores": [[{k: round(v, 4) for k, v in d.items()} for d in step]
                             for step in r["scores"]]} for r in runs]}
    atomic_write_json(args.out, doc)
    plot(doc, args.png, args.png_scores)


if __name__ == "__main__":
    main()
