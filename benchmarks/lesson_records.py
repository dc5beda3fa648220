"""Record the lessons' heavy computations (``fa_lab.lab.recorded``) at the lessons' CPU
sizes in the lab's reference data, data/results/<name>.json, so that the lessons read them
back instead of computing them for a minute on a busy CPU. A lesson computes a record live
whenever its sizes differ from ``recorded.LESSON_PARAMS`` (``FULL = True`` on
a GPU). Rerun this after a change to the model, on one torch thread (tests/lab/test_lesson_records.py fails on a stale
record):

    OMP_NUM_THREADS=1 python benchmarks/lesson_records.py [NAME ...]
"""

from __future__ import annotations

import sys
import time

import torch

from fa_lab.lab import recorded


def main(names):
    torch.set_num_threads(1)
    for name in names or recorded.LESSON_PARAMS:
        t0 = time.perf_counter()
        path = recorded.save(name, **recorded.LESSON_PARAMS[name])
        print(f"{name}: {time.perf_counter() - t0:.1f} s -> {path}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
