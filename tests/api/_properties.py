"""What the property suites of fa_lab's entry points share (``test_api_valid_inputs``,
``test_api_invalid_inputs``, ``test_api_backend_masks``): a fixed, derandomized hypothesis
budget that ``FA_LAB_PROPERTY_SCALE=10`` multiplies, and a tally of the inputs each entry
point received and the time each property took, printed at the end of a module with ``-s``."""

from __future__ import annotations

import collections
import contextlib
import os
import time

import torch
from hypothesis import HealthCheck, settings

SCALE = float(os.environ.get("FA_LAB_PROPERTY_SCALE", "1"))
BF, F16, F8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn


def budget(n: int):
    """A fixed, reproducible budget: n examples (times FA_LAB_PROPERTY_SCALE), no deadline,
    derandomized, no example database (nothing written next to the tests)."""
    return settings(max_examples=max(1, round(n * SCALE)), deadline=None, derandomize=True,
                    database=None, print_blob=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])



class Tally:
    """Inputs tried per entry point and kind, wall seconds per property, and free-form
    counts (faults per kind, examples with NaN)."""

    def __init__(self, title: str):
        self.title = title
        self.tried: collections.Counter = collections.Counter()
        self.spent: collections.Counter = collections.Counter()
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    @contextlib.contextmanager
    def timed(self, name):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.spent[name] += time.perf_counter() - t0

    def report(self) -> str:
        lines = ["", f"{self.title}: inputs tried per entry point"]
        lines += [f"  {k:<34} {n:5d}" for k, n in sorted(self.tried.items())]
        lines += [f"  time {k:<29} {s:6.1f} s" for k, s in sorted(self.spent.items())]
        for name, c in sorted(self.counts.items()):
            lines.append(f"  {name} ({len(c)} kinds): " + ", ".join(f"{k} {n}" for k, n in sorted(c.items())))
        return "\n".join(lines)


def zeros(*shape, dtype=BF):
    return torch.zeros(shape, dtype=torch.float32).to(dtype)


def rel_l2(a, b) -> float:
    a, b = a.double(), b.double()
    n = float(torch.linalg.vector_norm(b))
    return float(torch.linalg.vector_norm(a - b)) / n if n > 0 else float(torch.linalg.vector_norm(a))

