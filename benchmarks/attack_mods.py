"""Attack every built-in policy with score modifiers; save attack_mods_<policy>.json in the
results folder (``--out-dir``; the lab's copies are data/results/attack_mods_<policy>.json).

Per policy, ``fa_lab.studies.adversary.search`` over the ``"scores"`` space with the modifiers
``--mods`` (default bias, alibi, sink) and ``--budget`` seconds of search, seed ``--seed``:
once counting every failure, and (for every policy but eager) once counting only the
policy's own failures, where eager stays finite (``baseline="eager"``). The record is
``adversary.record``'s, as every ``attack_<policy>.json`` (``summary``: one row per run;
``runs``: ``Attack.to_dict()`` of each, with its wall time), with this run's provenance.
``--regressions DIR`` also writes each run's shrunk input (or its near miss) as
``DIR/<policy>_mods.npz`` and ``DIR/<policy>_mods_vs_eager.npz``.

    OMP_NUM_THREADS=1 python benchmarks/attack_mods.py --policies lazy,eager --budget 60
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

from fa_lab import policies, results
from fa_lab.studies import adversary

BUILT_IN = ("eager", "lazy", "lazy_unfixed", "lazy_capped", "fa4_row")


def run_policy(policy: str, *, mods, budget_s: float, seed: int, regressions: Path | None):
    """[(Attack, wall seconds)] of the policy's runs (without and against eager)."""
    runs = []
    for baseline in (None, "eager"):
        if baseline == policy:
            continue
        t0 = time.perf_counter()
        res = adversary.search(policy, mods=mods, budget_s=budget_s, seed=seed, baseline=baseline)
        wall = time.perf_counter() - t0
        print(adversary.summary(res), flush=True)
        if regressions is not None:
            name = f"{policy}_mods" + ("" if baseline is None else f"_vs_{baseline}")
            adversary.save_regression(res, regressions / f"{name}.npz")
        runs.append((res, wall))
    return runs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policies", default=",".join(BUILT_IN))
    p.add_argument("--mods", default="bias,alibi,sink")
    p.add_argument("--budget", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--regressions", type=Path, default=None)
    p.add_argument("--out-dir", default=None,
                   help="results folder (default $FA_LAB_RESULTS or ./fa_lab_results)")
    args = p.parse_args(argv)
    names = [x.strip() for x in args.policies.split(",") if x.strip()]
    unknown = [n for n in names if n not in policies.names()]
    if unknown:
        p.error(f"--policies: unknown {unknown}; registered: {policies.names()}")
    mods = adversary.check_mods("eager", args.mods)       # refused before any work
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "fa_lab"], cwd=results.ROOT,
                           capture_output=True, text=True, check=False).stdout.strip() != ""
    for name in names:
        runs = run_policy(name, mods=mods, budget_s=args.budget, seed=args.seed,
                          regressions=args.regressions)
        rec = adversary.record(
            name, runs,
            params={"seed": args.seed, "budget_s": args.budget, "mods": list(mods),
                    "baselines": [res.baseline for res, _ in runs],
                    "machine": f"CPU, {torch.get_num_threads()} torch thread(s)",
                    "command": "fa_lab.studies.adversary.search(policy, mods=..., budget_s=..., "
                               "seed=..., baseline=None or 'eager')"},
            provenance=results.provenance(
                "cpu", command=" ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
                fa_lab_uncommitted_changes=dirty))
        print(results.save(f"attack_mods_{name}", rec, root=args.out_dir), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
