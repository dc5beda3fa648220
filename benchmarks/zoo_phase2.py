"""Record the failure zoo's attack and bound checks: data/results/zoo_attack.json and
data/results/zoo_bounds.json (the lab's reference results for issue 33, with provenance).

``attack``: per entry, ``fa-lab attack``'s search on its preset before the fix (the entry's
own class of failure, budget 60 s, seeds 0-2, from the zoo's starting points and from
random starts only), the shrunk input's symptom, and the search against the fix (budget
30 s): what it found, or "nothing in N runs found a failure".

``bounds``: every built-in policy's and preset's region (``onset.bound``), checked four ways:
an attack inside the region (``boundcheck.attack_inside``: every class, ``--budget`` s); a
search that walks random inputs to the region's edge and judges them there
(``edge_search.boundary_search``, ``--budget`` s); each hazard's edge built from its
mechanism, +eps inside and -eps outside (``onset.edges.edge``); and the built-in policies'
measured boundary against its formula (``boundcheck.builtin_sweep`` / ``fp8_floor_sweep``,
and the atlas data/atlas/bf16_seed_h200 for their overflow over K scale; the presets'
one-binade sweeps, ``boundcheck.sweep``, are left to the edges, which are stricter).

    OMP_NUM_THREADS=1 python benchmarks/zoo_phase2.py attack
    OMP_NUM_THREADS=1 python benchmarks/zoo_phase2.py bounds [--budget 4]
    OMP_NUM_THREADS=1 python benchmarks/zoo_phase2.py bounds --budget 2 --policies a,b
        # rerun two policies' rows and merge them into data/results/zoo_bounds.json
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
import warnings

import torch

from fa_lab import policies, results
from fa_lab.studies import adversary as A
from fa_lab.studies import onset
from fa_lab.studies.onset import boundcheck as BC, edge_search
from fa_lab.studies.onset import edges
from fa_lab.zoo import ENTRIES


def _symptom(entry, cand, policy, classes) -> dict:
    """The shrunk input's numbers: which rows show which class, the error against the fp64
    reference (as a fraction of max|V|), and the output and reference of the first bad row."""
    v = A.judge(cand, policy, classes=classes)
    out = {"classes": v.classes, "bad_rows": v.bad_rows[:8], "max_err_over_vmax": v.max_err,
           "undefined_rows": len(v.undefined_rows)}
    if A.kernel_for(policy) != A.KERNEL and v.bad_rows:
        o, lse, rec, pol, (q, k, vv, mods) = A.run_online(cand, policy)
        ref, rl = A.reference_of(cand, q, k, vv, mods, softcap=pol.semantics.softcap)
        r = v.bad_rows[0]
        out.update(row=r, out=o[0, r, 0, :4].float().tolist(), ref=ref[0, r, 0, :4].tolist(),
                   lse=float(lse[0, 0, r]), ref_lse=float(rl[0, 0, r]),
                   p_max=max(float(x.p_max[0, 0, r].nan_to_num(0)) for x in rec),
                   saturated=sum(int(x.saturated[0, 0, r]) for x in rec))
    return out


def _run(entry, policy, *, fix: bool, seed: int, structured: bool, **search) -> dict:
    """One search, as a record: what it found, how fast, the shrunk input and its symptom."""
    t0 = time.perf_counter()
    res = A.search(policy, seed=seed, structured=structured, **search)
    rec = {"entry": entry.name, "policy": policy.name, "fix": fix, "seed": seed,
           "starts": "structured" if structured else "random only",
           "classes": list(res.classes), "found": res.found, "found_classes": res.found_classes,
           "time_to_first_s": res.time_to_first_s, "evals_to_first": res.evals_to_first,
           "evals": res.evals, "wall_s": time.perf_counter() - t0, "summary": A.summary(res),
           "repro": res.repro if res.found else None,
           "shrunk": None if res.shrunk is None else {**res.shrunk.to_dict(),
                                                       "size": res.shrunk.size}}
    if res.found:
        rec["symptom"] = _symptom(entry, res.shrunk, policy, res.classes)
    print(rec["summary"], flush=True)
    return rec


def attack(budget: float, after_budget: float, seeds) -> dict:
    runs = []
    for e in ENTRIES.values():
        for structured in (True, False):
            for seed in seeds:
                runs.append(_run(e, e.before, fix=False, seed=seed, structured=structured,
                                 budget_s=budget))
        runs.append(_run(e, e.after, fix=True, seed=0, structured=True, budget_s=after_budget,
                         classes=e.failure))
    table = [{k: r[k] for k in ("entry", "policy", "fix", "seed", "starts", "found",
                                "found_classes", "time_to_first_s", "evals_to_first", "evals")}
             for r in runs]
    return {"budget_s": budget, "after_budget_s": after_budget, "seeds": list(seeds),
            "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "table": table, "runs": runs}


def bounds(budget: float, only=None) -> dict:
    """The bound checks of every policy, or of the policies in ``only`` (``merge`` puts
    them into the stored record)."""
    names = list(policies.BUILTIN_NAMES) + [n for n in policies.names()
                                             if n not in policies.BUILTIN_NAMES]
    if only is not None:
        names = [n for n in names if n in only]
    regions = {}
    for n in list(names):
        try:
            regions[n] = onset.bound(n).to_dict()
        except ValueError as err:  # a field the bound has no formula for (onset.UNBOUNDED)
            regions[n] = {"refused": str(err)}
            names.remove(n)
    regions_fp8 = {n: onset.bound(n, dtype="fp8").to_dict() for n in policies.BUILTIN_NAMES
                   if n in names}
    inside = []
    for n in names:
        r = BC.attack_inside(n, budget_s=budget)
        print(r["summary"], flush=True)
        inside.append(r)
    walks = []
    for n in names:
        r = edge_search.boundary_search(n, budget_s=budget)
        print(n, "edge walk:", r["runs_at_edge"], "runs,", r["failures_inside"], "failures",
              flush=True)
        walks.append(r)
    edge_rows = []
    for n in names:
        dt = "bf16" if n in policies.BUILTIN_NAMES else "fp32"
        for h in onset.bound(n, dtype=dt).hazards:
            if h.never:
                continue
            e = edges.edge(n, h.name)
            if e is None:
                edge_rows.append({"policy": n, "hazard": h.name,
                                  "skipped": edges.skipped(n, h.name)})
                continue
            row = dataclasses.asdict(e)
            row["held"] = (not e.inside_fails and not e.inside_violates and bool(
                e.outside_fails if e.exact else (e.outside_fails or e.beyond_fails)))
            print(n, h.name, "edge held" if row["held"] else "EDGE FAILED", flush=True)
            edge_rows.append(row)
    sweeps = []   # the built-ins' (the presets' edges above check every hazard at +-eps)
    for n in [n for n in names if n in policies.BUILTIN_NAMES]:
        for hz in BC.SWEPT:
            r = BC.builtin_sweep(n, hz)
            if r is not None:
                print(n, hz, r["formula_boundary"], r["measured_onset"], r["sound"],
                      r["within_one_binade_or_tile"], flush=True)
                sweeps.append(r)
    fp8 = [BC.fp8_floor_sweep(n) for n in policies.BUILTIN_NAMES if n in names]
    atlas = []
    for n in [n for n in ("lazy_unfixed", "lazy_capped", "lazy", "fa4_row") if n in names]:
        r = BC.atlas_onset(n)
        print(n, "atlas", r["k_formula"], r["first_failing_k"], r["sound"], r["within_one_binade"],
              flush=True)
        atlas.append(r)
    checked = [r for r in edge_rows if "skipped" not in r]
    return {"tolerance": onset.bound("eager").tolerance, "regions": regions,
            "regions_fp8": regions_fp8, "attack_inside": inside, "boundary_search": walks,
            "edges": edge_rows, "sweeps": sweeps, "fp8_floor": fp8, "atlas": atlas,
            "summary": {
                "policies": len(names), "edges_checked": len(checked),
                "edges_held": sum(r["held"] for r in checked),
                "edges_skipped": len(edge_rows) - len(checked),
                "edge_inputs_failing_inside": sum(bool(r["inside_fails"]) for r in checked),
                "attack_runs_inside": sum(r["runs_inside"] for r in inside),
                "attack_failures_inside": sum(bool(r["found"]) for r in inside),
                "walk_runs_at_edge": sum(r["runs_at_edge"] for r in walks),
                "walk_failures_inside": sum(r["failures_inside"] for r in walks),
                "sweeps_sound": all(r["sound"] for r in sweeps)}}


def merge(old: dict, new: dict, only) -> dict:
    """``old`` (a stored bounds record) with every row of the policies in ``only`` replaced
    by ``new``'s, and the summary counted again over the merged rows."""
    out = dict(old)
    for key in ("regions", "regions_fp8"):
        out[key] = {**old[key], **new[key]}
    for key in ("attack_inside", "boundary_search", "edges", "sweeps", "fp8_floor", "atlas"):
        out[key] = [r for r in old[key] if r["policy"] not in only] + new[key]
    edge_rows, inside, walks = out["edges"], out["attack_inside"], out["boundary_search"]
    checked = [r for r in edge_rows if "skipped" not in r]
    out["summary"] = {
        "policies": len(out["regions"]) - sum("refused" in r for r in out["regions"].values()),
        "edges_checked": len(checked), "edges_held": sum(r["held"] for r in checked),
        "edges_skipped": len(edge_rows) - len(checked),
        "edge_inputs_failing_inside": sum(bool(r["inside_fails"]) for r in checked),
        "attack_runs_inside": sum(r["runs_inside"] for r in inside),
        "attack_failures_inside": sum(bool(r["found"]) for r in inside),
        "walk_runs_at_edge": sum(r["runs_at_edge"] for r in walks),
        "walk_failures_inside": sum(r["failures_inside"] for r in walks),
        "sweeps_sound": all(r["sound"] for r in out["sweeps"])}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("attack", "bounds"))
    p.add_argument("--budget", type=float, default=None)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--name", default=None, help="result name (default zoo_<what>)")
    p.add_argument("--policies", default=None,
                   help="bounds: rerun only these (comma-separated) and merge them into the "
                        "lab's stored record, whose provenance keeps the rerun's")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")
    t0 = time.perf_counter()
    if args.what == "attack":
        rec = attack(args.budget or 60.0, 30.0, [int(s) for s in args.seeds.split(",")])
    elif args.policies:
        only = [x.strip() for x in args.policies.split(",") if x.strip()]
        old = results.read_json(results.REFERENCE_DIR / f"{args.name or 'zoo_bounds'}.json")
        rec = merge(old, bounds(args.budget or 4.0, only), only)
        rerun = results.provenance(policies=only, wall_s=time.perf_counter() - t0)
        rec["provenance"] = {**old["provenance"],
                             "reruns": [*old["provenance"].get("reruns", []), rerun]}
        path = results.save(args.name or "zoo_bounds", rec, params=old.get("params"))
        print(f"saved {path}")
        return 0
    else:
        rec = bounds(args.budget or 4.0)
    rec["wall_s"] = time.perf_counter() - t0
    path = results.save(args.name or f"zoo_{args.what}", rec,
                        params={"what": args.what, "budget": args.budget, "seeds": args.seeds})
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
