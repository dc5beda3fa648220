"""Record lesson 06's two searches (notebooks/06_atlas_and_attack.ipynb, section 4) in the
lab's reference data, data/results/attack_lesson06.json, so that the lesson reads them back
(``fa_lab.lab.lessons.recorded_search``) instead of searching for a minute or two on a busy
CPU. Each call is ``adversary.search`` with the arguments the lesson passes; the record's
``params["calls"]`` lists them, and the lesson runs a search live whenever its arguments
differ from every recorded call. Rerun this after a change to the search, the judge or the
model, on one torch thread:

    OMP_NUM_THREADS=1 python benchmarks/lesson06_attack.py
"""

from __future__ import annotations

import time
import warnings

import torch

from fa_lab import results
from fa_lab.lab.lessons import LESSON06_RECORD
from fa_lab.studies import adversary

#: The lesson's searches, in its order: the cap from random starts, then the fix.
CALLS = ({"policy": "lazy_capped", "seed": 0, "structured": False, "optimizer": "cma",
          "budget_s": 120, "max_evals": 200},
         {"policy": "lazy", "seed": 0, "structured": False, "optimizer": "cma",
          "budget_s": 120, "max_evals": 80})


def main():
    torch.set_num_threads(1)
    runs = []
    for call in CALLS:
        kw = {k: x for k, x in call.items() if k != "policy"}
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")     # candidates too short for any lazy decision
            attack = adversary.search(call["policy"], **kw)
        runs.append((attack, time.perf_counter() - t0))
        print(adversary.summary(attack), flush=True)
    rec = adversary.record(CALLS[0]["policy"], runs, params={"calls": [dict(c) for c in CALLS]})
    print(results.save(LESSON06_RECORD, rec, root=results.REFERENCE_DIR))


if __name__ == "__main__":
    main()
