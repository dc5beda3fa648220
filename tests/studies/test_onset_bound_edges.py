"""onset.bound at each hazard's edge: for every built-in policy and zoo preset, every hazard
its region lists (discovered from the code, so a new hazard or preset is picked up), an
input built from the hazard's mechanism a margin of +eps inside never fails, and one of
-eps outside fails (an exact hazard) or fails by the builder's stated slack (a sufficient
one). A live hazard with neither a builder nor a stated reason fails here."""

import math

import pytest

from fa_lab import policies
from fa_lab.studies import onset
from fa_lab.studies.adversary import KERNEL, kernel_for
from fa_lab.studies.onset import edges

NAMES = list(policies.BUILTIN_NAMES) + [n for n in policies.names()
                                        if n not in policies.BUILTIN_NAMES]


def _dtype(name):
    return "bf16" if kernel_for(policies.as_policy(name)) == KERNEL else "fp32"


PAIRS = [(n, h.name) for n in NAMES for h in onset.bound(n, dtype=_dtype(n)).hazards
         if not h.never]


@pytest.mark.parametrize("name,hazard", PAIRS, ids=[f"{n}|{h}" for n, h in PAIRS])
def test_plus_eps_holds_and_minus_eps_fails(name, hazard):
    e = edges.edge(name, hazard)
    if e is None:
        why = edges.skipped(name, hazard)
        assert why, f"{name}: live hazard {hazard!r} has no edge builder and no stated reason"
        return
    assert e.inside_violates == [], f"the inside input leaves the region by {e.inside_violates}"
    assert e.margin_inside is None or e.margin_inside >= 0
    assert e.margin_outside is None or e.margin_outside <= 0   # a strict check fails at 0
    assert abs(e.t_outside - e.t_inside) <= max(edges.EPS, 1.0)
    assert e.inside_fails == [], f"{e.parameter} = {e.t_inside}: fails inside the region"
    if e.exact:
        assert e.outside_fails, f"{e.parameter} = {e.t_outside}: exact edge, nothing fails"
    else:
        assert e.outside_fails or (e.beyond is not None and e.beyond_fails), (
            f"{e.parameter} = {e.beyond}: nothing fails within the stated slack")


def test_the_pairs_cover_every_preset_and_the_new_hazards():
    assert len(NAMES) >= 45 and {n for n, _ in PAIRS} == set(NAMES)
    names = {h for _, h in PAIRS}
    assert {"softcap's exp ratio overflows", "late mask lifts the max",
            "late mask over a non-finite score", "P before the vote drops a kept jump",
            "base-2 LSE merged as natural", "an empty partial poisons the merge"} <= names


def test_the_edges_of_three_reported_unsound_regions():
    """Issue 39's three: the swp_bf16 lazy edge reads the kernel's rounded Q (bf16(q c) . k)
    and fails at -eps; small V is a hazard of every preset (the flashinfer sentinel's too);
    and P's cast rounding up is in the overflow formula (FA4's e4m3 P at 443 rounds to 448)."""
    e = edges.edge("lazy", "accumulator overflow")
    assert e.inside_fails == [] and e.outside_fails == ["nonfinite"]
    e = edges.edge("flashinfer_sentinel:before", "silent mass loss (rounding and flushed tails)")
    assert e.inside_fails == [] and e.beyond == -149.0 and e.beyond_fails == ["silent"]
    e = edges.edge("fa4_fp8_saturation:before", "accumulator overflow")
    assert e.inside_fails == [] and e.beyond_fails == ["nonfinite"]
    assert e.beyond - e.t_outside < 0.03 + math.log2(1 + 2 ** -4) + 1e-9


def test_the_softcap_edge_is_fp32_exp():
    import torch

    from fa_lab.studies.onset.semantic_hazards import softcap_edge

    u = softcap_edge()
    assert 88.72 < u < 88.73
    t = torch.tensor(u, dtype=torch.float32)
    assert math.isfinite(torch.exp(t).item())
    assert math.isinf(torch.exp(torch.nextafter(t, torch.tensor(100.0))).item())
