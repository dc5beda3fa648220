"""A search that walks random inputs to a safe region's edge (``onset.bound``) and judges
the policy there: the region must hold at its own boundary (docs/semantics.md §11.8)."""

from __future__ import annotations

import math
import time

import torch

from .bound import bound
from .boundcheck import judged_classes
from .measure import measure


#: The directions ``boundary_search`` walks: a Candidate field and the far end of its walk.
WALKS = (("v_log2", 126.0), ("v_log2", -140.0), ("k_scale", 256.0))


def boundary_search(policy, *, budget_s: float = 10.0, seed: int = 0,
                    max_starts: int | None = None, steps: int = 14) -> dict:
    """Draw random inputs from the attack's space (``"zoo"`` for a policy with semantics of
    its own, ``"values"`` with bias masks for a FlyDSL policy), and walk each along
    ``WALKS`` (V's scale up and down, K's scale up) to the last point inside
    ``bound(policy)`` (bisection, ``steps`` halvings, on ``region.contains``); judge the
    policy there with the attack's judge (every class for a zoo preset). Returns the runs
    judged (all inside the region), the failures among them (each a repro), and the
    closest margin reached: no failure means the region held at its own edge."""
    import dataclasses as dc

    import numpy as np

    from fa_lab import policies
    from fa_lab.studies import adversary as A
    from fa_lab.studies.adversary.optimize import random_candidate

    pol = policies.as_policy(policy)
    zoo = A.kernel_for(pol) != A.KERNEL
    sp = A.SPACES["zoo"] if zoo else A.SPACES["values"].with_mods("bias")
    classes = judged_classes(pol) if zoo else None
    regions: dict = {}
    rng = np.random.default_rng(seed)

    def inside(c):
        q, k, v = A.build(c)
        dt = {torch.bfloat16: "bf16", torch.float16: "f16"}.get(q.dtype, "fp32")
        region = regions.get(dt) or regions.setdefault(dt, bound(pol, dtype=dt))
        m = measure(q, k, v, policy=pol, causal=c.causal, bias=A.build_mods(c).get("bias"),
                    seqlen_kv=c.kv_used)
        return region.contains(m), region, m

    t0 = time.perf_counter()
    runs, starts, fails, closest = 0, 0, [], math.inf
    while time.perf_counter() - t0 < budget_s and (max_starts is None or starts < max_starts):
        c = random_candidate(sp, rng)
        starts += 1
        ok, _, _ = inside(c)
        if not ok:
            continue
        for f, end in WALKS:
            lo, hi = float(getattr(c, f)), end
            if inside(dc.replace(c, **{f: hi}))[0]:
                lo = hi
            else:
                for _ in range(steps):
                    mid = (lo + hi) / 2
                    if inside(dc.replace(c, **{f: mid}))[0]:
                        lo = mid
                    else:
                        hi = mid
            edge = dc.replace(c, **{f: lo})
            _, region, m = inside(edge)
            margins = [x for x in region.margins(m).values() if x is not None]
            if margins:
                closest = min(closest, min(margins))
            v = A.judge(edge, pol, classes=classes)
            runs += 1
            if v.failed:
                fails.append({"walk": f, "candidate": edge.to_dict(), "classes": v.classes,
                              "bad_rows": v.bad_rows[:8]})
    return {"policy": pol.name, "space": sp.name, "seed": seed, "budget_s": budget_s,
            "starts": starts, "runs_at_edge": runs, "failures_inside": len(fails),
            "failures": fails[:5], "closest_margin": None if closest == math.inf else closest,
            "wall_s": time.perf_counter() - t0}
