"""Record how fast the attack finds each finding whose copy is a policy the attack can
run (``fa-lab attack <copy>``): data/results/findings_attack.json, with provenance.

Per copy, ``adversary.search`` from random starts only (the optimiser alone), seeds 0-2,
60 s each, the copy's default space, for the finding's own class (``nonfinite``: the NaN
its page reports; the copies' other classes, a masked row's 0 and the like, are found at
once and are not the finding). The findings whose copy is not a policy
(an ``upstream=`` version, a decode or MLA kernel) name their attack record, or none, on
their page; ``fa_lab.zoo.closing`` reads both.

    OMP_NUM_THREADS=1 python benchmarks/findings_attack.py
"""

from __future__ import annotations

import os
import time

import torch

from fa_lab import results
from fa_lab.studies import adversary as A

#: finding page -> the policy the attack runs for its copy.
COPIES = {"primus_fixed_max": "primus-a6a16cdc", "mslk_fp8_lazy_rebase": "mslk-2a3c897:fp8"}


def main(budget: float = 60.0, seeds=(0, 1, 2)) -> dict:
    runs = []
    t0 = time.perf_counter()
    for page, policy in COPIES.items():
        for seed in seeds:
            res = A.search(policy, seed=seed, structured=False, budget_s=budget,
                           classes=("nonfinite",))
            runs.append({"finding": page, "policy": policy, "seed": seed,
                         "classes": ["nonfinite"], "found": res.found,
                         "found_classes": res.found_classes,
                         "time_to_first_s": res.time_to_first_s,
                         "evals_to_first": res.evals_to_first, "evals": res.evals,
                         "summary": A.summary(res)})
            print(runs[-1]["summary"], flush=True)
    return {"budget_s": budget, "seeds": list(seeds), "starts": "random only",
            "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "runs": runs,
            "wall_s": time.perf_counter() - t0}


if __name__ == "__main__":
    payload = main()
    print(results.save("findings_attack", payload, params={
        "command": "OMP_NUM_THREADS=1 python benchmarks/findings_attack.py"},
        root="data/results"))
