"""Attack the paged-attention decode's two versions over the decode spaces; save
attack_decode_before.json (``flydsl-985c653a^``, the parent of the sentinel fix, space
``decode``), attack_decode_main.json (``main-11c4174d``, space ``decode``) and
attack_decode_main_v_outliers.json (``main-11c4174d``, space ``decode_v_outliers``) in the
results folder (``--out-dir``; the lab's copies are in data/results).

Each version gets ``--seeds`` runs of ``adversary.decode_search.search`` (random starts and
an evolution strategy, nothing of the failure given) of ``--budget`` seconds each, counting
non-finite rows on calls whose cache is finite where it is read. Each run's wall time,
CPU time and model runs to the first failure are kept (``timing``: on a shared machine the
wall time includes waiting for a core). The record is
``decode_search.record``'s (``summary``: one row per run, with its time to the first failure
and model runs; ``runs``: each run with its wall time), with this run's provenance.

    OMP_NUM_THREADS=1 python benchmarks/attack_decode.py --seeds 6 --main-seeds 3 --budget 60
    OMP_NUM_THREADS=1 python benchmarks/attack_decode.py --versions main,main_v_outliers \
        --main-seeds 2 --max-evals 800 --budget 600 --suffix _long     # the longer runs on main
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from fa_lab import results
from fa_lab.studies.adversary import decode_search

#: key: (decode version, space)
VERSIONS = {"before": ("flydsl-985c653a^", "decode"), "main": ("main-11c4174d", "decode"),
            "main_v_outliers": ("main-11c4174d", "decode_v_outliers")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--versions", default=",".join(VERSIONS))
    p.add_argument("--seeds", type=int, default=10, help="runs per version (seeds 0..N-1)")
    p.add_argument("--main-seeds", type=int, default=None,
                   help="runs for main (default --seeds): each spends its whole budget")
    p.add_argument("--budget", type=float, default=60.0)
    p.add_argument("--max-evals", dest="max_evals", type=int, default=None,
                   help="also stop each run after this many model runs")
    p.add_argument("--suffix", default="", help="appended to each file name (e.g. _long)")
    p.add_argument("--out-dir", default=None,
                   help="results folder (default $FA_LAB_RESULTS or ./fa_lab_results)")
    args = p.parse_args(argv)
    for key in [x.strip() for x in args.versions.split(",") if x.strip()]:
        if key not in VERSIONS:
            p.error(f"--versions: unknown {key!r}; choose from {', '.join(VERSIONS)}")
        version, space = VERSIONS[key]
        main = key.startswith("main")
        seeds = args.main_seeds if main and args.main_seeds is not None else args.seeds
        runs = []
        cpu = []
        for seed in range(seeds):
            t0, c0 = time.perf_counter(), time.process_time()
            res = decode_search.search(version, space=space, budget_s=args.budget, seed=seed,
                                       max_evals=args.max_evals)
            runs.append((res, time.perf_counter() - t0))
            cpu.append(time.process_time() - c0)
            print(decode_search.summary(res), flush=True)
        params = {"budget_s": args.budget, "max_evals": args.max_evals, "seeds": seeds,
                  "space": space,
                  "classes": ["nonfinite"], "upstream": version,
                  "machine": f"CPU, {torch.get_num_threads()} torch thread(s)",
                  "command": "benchmarks/attack_decode.py"}
        rec = decode_search.record(version, runs, params=params)
        found = [r for r, _ in runs if r.found]
        rec["timing"] = {
            "runs": len(runs), "found": len(found),
            "time_to_first_s": [r.time_to_first_s for r in found],
            "max_time_to_first_s": max((r.time_to_first_s for r in found), default=None),
            "evals": [r.evals for r, _ in runs],
            "evals_to_first": [r.evals_to_first for r, _ in runs],
            "cpu_s": cpu, "load_average": list(os.getloadavg()),
            "note": "wall times include the wait for a CPU on a shared 2-core machine; "
                    "cpu_s is this process's CPU time per run (search and shrink)"}
        print(results.save(f"attack_decode_{key}{args.suffix}", rec, root=args.out_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
