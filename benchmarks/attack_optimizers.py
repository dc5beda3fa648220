"""CMA-ES against the (1 + lambda) ES behind fa_lab.studies.adversary.search; save
attack_optimizers.json in the results folder (the lab's copy: data/results/).

Every run is ``adversary.search(...)`` with the same budget and seed under each optimiser
(``optimizer="cma"`` and ``"es"``), one after the other, on one torch thread:

* ``lazy_unfixed`` (structured starts, and random starts only): time and model runs to the
  first failure, the first failing input's size and the shrunk one's;
* ``lazy_capped``, random starts only (the optimiser alone: the structured starts break it
  at once): time and model runs to the first failure, the seeds it broke;
* ``lazy`` against eager (``baseline="eager"``), without and with the score modifiers
  bias, alibi, sink: nothing breaks it, so the best fitness reached (log2 units; 128 is a
  predicted overflow), the same at a fixed number of model runs (from the history, which
  load on the machine does not move), and model runs per second.

    OMP_NUM_THREADS=1 python benchmarks/attack_optimizers.py --budget 30 --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from fa_lab import results
from fa_lab.studies import adversary

OPTIMIZERS = ("cma", "es")


def best_at(history: list, evals: int) -> float | None:
    """The best fitness a run had reached after ``evals`` model runs (its history)."""
    seen = [h["fitness"] for h in history if h["evals"] <= evals]
    return max(seen) if seen else None


def run(case: str, policy: str, opt: str, seed: int, budget: float, **kw) -> dict:
    t0 = time.perf_counter()
    res = adversary.search(policy, budget_s=budget, seed=seed, optimizer=opt, **kw)
    wall = time.perf_counter() - t0
    d = res.to_dict()
    row = {"case": case, "policy": policy, "optimizer": opt, "seed": seed, "budget_s": budget,
           "structured": res.structured, "baseline": res.baseline, "mods": res.mods,
           "found": res.found, "evals": res.evals, "search_s": res.search_s,
           "evals_per_s": res.evals / res.search_s if res.search_s else None,
           "time_to_first_s": res.time_to_first_s, "evals_to_first": res.evals_to_first,
           "first_size": d["first"]["size"] if res.found else None,
           "shrink": kw.get("shrink", True),
           "shrunk_size": d["shrunk"]["size"] if res.found and kw.get("shrink", True) else None,
           "shrink_evals": res.shrink_evals, "best_fitness": res.best_fitness,
           "history": res.history, "repro": res.repro, "wall_s": wall}
    print(f"{case:24s} {opt:3s} seed {seed}: found={res.found} evals={res.evals} "
          f"({row['evals_per_s']:.1f}/s) first after {res.evals_to_first} runs / "
          f"{res.time_to_first_s} s, first {row['first_size']}, shrunk {row['shrunk_size']}, best fitness "
          f"{res.best_fitness:.2f}", flush=True)
    return row


def summarise(rows: list, fixed_evals: int) -> dict:
    out = {}
    for case in dict.fromkeys(r["case"] for r in rows):
        out[case] = {}
        for opt in OPTIMIZERS:
            rs = [r for r in rows if r["case"] == case and r["optimizer"] == opt]
            found = [r for r in rs if r["found"]]
            s = {"runs": len(rs), "found": len(found),
                 "evals_per_s_mean": statistics.mean(r["evals_per_s"] for r in rs)}
            if found:
                s["evals_to_first"] = [r["evals_to_first"] if r["found"] else None for r in rs]
                s["time_to_first_s"] = [r["time_to_first_s"] if r["found"] else None
                                        for r in rs]
                s["time_to_first_s_mean_found"] = statistics.mean(
                    r["time_to_first_s"] for r in found)
                s["evals_to_first_mean_found"] = statistics.mean(
                    r["evals_to_first"] for r in found)
                s["smallest_first_Skv"] = min(r["first_size"]["Skv"] for r in found)
                if all(r["shrunk_size"] for r in found):
                    s["smallest_shrunk_Skv"] = min(r["shrunk_size"]["Skv"] for r in found)
                    s["shrunk_sizes"] = [r["shrunk_size"] for r in found]
            else:
                s["best_fitness"] = [r["best_fitness"] for r in rs]
                s["best_fitness_mean"] = statistics.mean(r["best_fitness"] for r in rs)
                s[f"best_fitness_at_{fixed_evals}_evals"] = [best_at(r["history"], fixed_evals)
                                                            for r in rs]
            out[case][opt] = s
    return out


def conclusion(summary: dict) -> list:
    """The comparison in a few lines, from the summary's numbers."""
    out = []
    for case, by in summary.items():
        c, e = by["cma"], by["es"]
        if "evals_to_first_mean_found" in c and "evals_to_first_mean_found" in e:
            line = (f"{case}: found {c['found']}/{c['runs']} (cma) vs {e['found']}/{e['runs']} "
                    f"(es); mean model runs to the first failure {c['evals_to_first_mean_found']:.1f}"
                    f" vs {e['evals_to_first_mean_found']:.1f}, mean seconds "
                    f"{c['time_to_first_s_mean_found']:.2f} vs {e['time_to_first_s_mean_found']:.2f}")
            if "smallest_shrunk_Skv" in c and "smallest_shrunk_Skv" in e:
                line += (f"; smallest shrunk Skv {c['smallest_shrunk_Skv']} vs "
                         f"{e['smallest_shrunk_Skv']}")
        else:
            key = next(k for k in c if k.startswith("best_fitness_at_"))
            line = (f"{case}: nothing found; mean best fitness {c.get('best_fitness_mean', 0):.2f}"
                    f" (cma) vs {e.get('best_fitness_mean', 0):.2f} (es) (128: overflow), at "
                    f"{key.split('_')[-2]} model runs {c[key]} vs {e[key]}")
        out.append(line + f"; model runs per second {c['evals_per_s_mean']:.1f} vs "
                   f"{e['evals_per_s_mean']:.1f}")
    return out


def resummarise(name: str = "attack_optimizers") -> dict:
    """Recompute a saved comparison's summary from its runs (and save it again)."""
    rec = results.load(name)
    for r in rec["runs"]:
        r.setdefault("shrink", not r["case"].startswith("lazy_capped"))
        if not r["shrink"]:
            r["shrunk_size"] = None
    rec["summary"] = summarise(rec["runs"], rec["params"]["fixed_evals"])
    rec["conclusion"] = conclusion(rec["summary"])
    results.save(name, rec)
    return rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", type=float, default=30.0, help="seconds of search per run")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--capped-seeds", default="0,1,2,3,4,5,6,7,8,9",
                   help="seeds of the lazy_capped random-start runs")
    p.add_argument("--fixed-evals", type=int, default=200,
                   help="compare the fixed policy's best fitness after this many model runs")
    p.add_argument("--name", default="attack_optimizers")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    seeds = [int(x) for x in args.seeds.split(",")]
    capped = [int(x) for x in args.capped_seeds.split(",") if x.strip()]
    rows = []
    for seed in seeds:
        for opt in OPTIMIZERS:
            rows.append(run("lazy_unfixed", "lazy_unfixed", opt, seed, args.budget))
            rows.append(run("lazy_unfixed_random", "lazy_unfixed", opt, seed, args.budget,
                            structured=False))
    for seed in capped:
        for opt in OPTIMIZERS:
            rows.append(run("lazy_capped_random", "lazy_capped", opt, seed, args.budget,
                            structured=False, shrink=False))
    for seed in seeds:
        for opt in OPTIMIZERS:
            rows.append(run("lazy_vs_eager", "lazy", opt, seed, args.budget, baseline="eager"))
            rows.append(run("lazy_vs_eager_mods", "lazy", opt, seed, args.budget,
                            baseline="eager", mods="bias,alibi,sink"))
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "fa_lab"], cwd=results.ROOT,
                           capture_output=True, text=True, check=False).stdout.strip() != ""
    import cma

    summary = summarise(rows, args.fixed_evals)
    rec = {"summary": summary, "conclusion": conclusion(summary), "runs": rows,
           "params": {"budget_s": args.budget, "seeds": seeds, "capped_seeds": capped,
                      "fixed_evals": args.fixed_evals, "optimizers": list(OPTIMIZERS),
                      "space": "scores", "cma": cma.__version__,
                      "machine": f"CPU, {torch.get_num_threads()} torch thread, 2 cores "
                                 "shared with other jobs (evals/s is noisy; the per-eval "
                                 "numbers are not)",
                      "command": "fa_lab.studies.adversary.search(policy, budget_s=..., seed=..., "
                                 "optimizer=..., structured=..., baseline=..., mods=...)"},
           "provenance": results.provenance(
               "cpu", command=" ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
               fa_lab_uncommitted_changes=dirty)}
    print(results.save(args.name, rec), flush=True)
    print("\n".join(rec["conclusion"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
