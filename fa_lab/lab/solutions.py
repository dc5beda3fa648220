"""The lessons' exercise answers, and the switch that lets CI run a lesson past its
exercise.

An exercise cell defines a stub that raises ``NotImplementedError`` naming what to write;
its check cell calls ``pick(name, stub)``, which returns the stub, or, when the environment
sets ``FA_LAB_SOLUTIONS=1`` (the lessons' nbval run), the reference answer ``name`` below.
Read an answer after your own.
"""

from __future__ import annotations

import math
import os

import torch

#: dQ's LSE floor (FlyDSL's flash_attn_gfx950_dq.py at 1fa54fa3, docs/semantics.md §12.2).
LSE_FLOOR = -3e38


def lse_floor(lse: torch.Tensor) -> torch.Tensor:
    """Lesson 09: the LSE in log2 units, floored as the dQ kernel does it: convert first
    (fp32 multiply by log2 e), then maxNum with -3e38, so -inf and NaN become the floor."""
    return torch.fmax(lse.float() * math.log2(math.e), torch.tensor(LSE_FLOOR))


ANSWERS = {"09.lse_floor": lse_floor}


def enabled() -> bool:
    """Whether the reference answers replace the learner's (``FA_LAB_SOLUTIONS=1``)."""
    return os.environ.get("FA_LAB_SOLUTIONS", "") == "1"


def pick(name: str, mine):
    """The learner's ``mine``, or the reference answer ``name`` when ``enabled()``."""
    if name not in ANSWERS:
        raise ValueError(f"no answer named {name!r}; choose one of {sorted(ANSWERS)}")
    return ANSWERS[name] if enabled() else mine
