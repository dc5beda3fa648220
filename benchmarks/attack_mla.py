"""Attack the MLA decode (``adversary.mla``) with and without the P lift; save
attack_mla_decode.json (P cast as upstream casts it, ``p_headroom`` 0) and
attack_mla_decode_h8.json (P lifted by 2^8 before its cast) in the results folder
(``--out-dir``; the lab's copies are in data/results).

Each setting gets ``--seeds`` runs of ``adversary.mla.search`` (random draws and an evolution
strategy, nothing of the failure given) of ``--budget`` seconds each, counting ``silent``
rows (off the fp64 reference by more than 2^-3 of max|V|) and ``nonfinite`` ones. Each
run's wall time, CPU time and model runs to the first failure are kept (``timing``: on a
shared machine the wall time includes waiting for a core).

    OMP_NUM_THREADS=1 python benchmarks/attack_mla.py --seeds 3 --budget 60
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from fa_lab import results
from fa_lab.studies.adversary import mla

#: file suffix: p_headroom
SETTINGS = {"": 0.0, "_h8": 8.0}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3, help="runs per setting (seeds 0..N-1)")
    p.add_argument("--budget", type=float, default=60.0)
    p.add_argument("--out-dir", default=None,
                   help="results folder (default $FA_LAB_RESULTS or ./fa_lab_results)")
    args = p.parse_args(argv)
    for suffix, headroom in SETTINGS.items():
        runs, cpu = [], []
        for seed in range(args.seeds):
            t0, c0 = time.perf_counter(), time.process_time()
            res = mla.search(headroom, budget_s=args.budget, seed=seed)
            runs.append((res, time.perf_counter() - t0))
            cpu.append(time.process_time() - c0)
            print(mla.summary(res), flush=True)
        params = {"budget_s": args.budget, "seeds": args.seeds, "space": mla.MLA_SPACE_NAME,
                  "p_headroom": headroom, "classes": list(mla.check_classes(None)),
                  "machine": f"CPU, {torch.get_num_threads()} torch thread(s)",
                  "command": "benchmarks/attack_mla.py"}
        rec = mla.record(runs, params=params)
        found = [r for r, _ in runs if r.found]
        rec["timing"] = {
            "runs": len(runs), "found": len(found),
            "time_to_first_s": [r.time_to_first_s for r in found],
            "evals": [r.evals for r, _ in runs],
            "evals_to_first": [r.evals_to_first for r, _ in runs],
            "wall_s": [w for _, w in runs], "cpu_s": cpu,
            "load_average": list(os.getloadavg()),
            "note": "wall times include the wait for a CPU on a shared 2-core machine; "
                    "cpu_s is this process's CPU time per run (search and shrink)"}
        print(results.save(f"attack_mla_decode{suffix}", rec, root=args.out_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
