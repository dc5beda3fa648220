"""onset.bound at each hazard's edge: for every built-in policy and zoo preset, every hazard
its region lists (discovered from the code, so a new hazard or preset is picked up), an
input built from the hazard's mechanism a margin of +eps inside never fails, and one of
-eps outside fails (an exact hazard) or fails by the builder's stated slack (a sufficient
one). A live hazard without a builder is one of ``UNBUILT`` below, each with its reason
checked here, or this file fails.

The default run checks one pair per (hazard, kernel, split, drag) class; the full sweep
over every pair is marked slow."""

import dataclasses
import math

import numpy as np
import pytest
import torch

from fa_lab import policies
from fa_lab.studies import onset
from fa_lab.studies.adversary import KERNEL, kernel_for
from fa_lab.studies.onset import edges
from fa_lab.studies.onset.bound import _drags

NAMES = list(policies.BUILTIN_NAMES) + [n for n in policies.names()
                                        if n not in policies.BUILTIN_NAMES]


def _dtype(name):
    return "bf16" if kernel_for(policies.as_policy(name)) == KERNEL else "fp32"


PAIRS = [(n, h.name) for n in NAMES for h in onset.bound(n, dtype=_dtype(n)).hazards
         if not h.never]

#: The live pairs with no builder: (policy, hazard) -> the check of its reason below.
UNBUILT = {
    ("ttmetal_exp_clamp:before", "exp floor keeps masked and flushed weight"): "floor",
    ("vllm_sparse_mla_leading_chunk:after", "finite sentinel"): "sentinel",
}
BUILT = [p for p in PAIRS if p not in UNBUILT]


def _class(pair):
    pol = policies.as_policy(pair[0])
    return (pair[1], kernel_for(pol) == KERNEL, pol.semantics.kv_split is not None,
            _drags(pol))


FAST = list({_class(p): p for p in reversed(BUILT)}.values())
SLOW = [p for p in BUILT if p not in FAST]


def check_edge(name, hazard):
    e = edges.edge(name, hazard)
    assert e is not None, f"{name}: {hazard}: no edge ({edges.skipped(name, hazard)})"
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


@pytest.mark.parametrize("name,hazard", FAST, ids=[f"{n}|{h}" for n, h in FAST])
def test_plus_eps_holds_and_minus_eps_fails(name, hazard):
    check_edge(name, hazard)


@pytest.mark.slow
@pytest.mark.parametrize("name,hazard", SLOW, ids=[f"{n}|{h}" for n, h in SLOW])
def test_plus_eps_holds_and_minus_eps_fails_every_pair(name, hazard):
    check_edge(name, hazard)


def test_every_live_pair_has_a_builder_but_the_stated_few():
    """260 live pairs, 258 built; the 2 others lie out of any input's reach (checked
    below); every listed pair is live and really has no builder (a builder added removes
    it here)."""
    assert len(PAIRS) >= 260 and len(BUILT) >= 258 and len(UNBUILT) <= 2
    assert set(UNBUILT) <= set(PAIRS)
    for pair in UNBUILT:
        assert edges.edge(*pair) is None and edges.skipped(*pair), pair


def test_an_exp_floor_needs_more_keys_than_a_kernel_indexes():
    """ttmetal's exp floor 2^-127.7 weighs each masked or flushed key; even 2^31 keys (an
    int32 index's reach) stay inside the hazard, so no input can cross its edge."""
    pol = policies.as_policy("ttmetal_exp_clamp:before")
    h = next(h for h in onset.bound(pol, dtype="fp32").hazards
             if h.name == "exp floor keeps masked and flushed weight")
    from fa_lab.kernels.online.model import LOG2_UNITS
    m = onset.measure(torch.ones(1, 1, 1, 1), torch.zeros(1, 64, 1, 1), torch.ones(1, 64, 1, 1),
                      policy=pol, softmax_scale=LOG2_UNITS, dtype="fp32")
    big = dataclasses.replace(m, n=np.full_like(m.n, 2 ** 31), n_masked=np.full_like(
        m.n_masked, 2 ** 31))
    ok, margin = h.check(big)
    assert ok and margin > 90


def test_a_sentinel_at_minus_1e30_has_no_score_near_it():
    """The finite-sentinel hazard's edge lies within 160 binades of the sentinel; at -1e30
    fp32's grid is 2^76 wide, so every score is the sentinel itself or beyond the edge."""
    pol = policies.as_policy("vllm_sparse_mla_leading_chunk:after")
    sig = pol.semantics.m_init if math.isfinite(pol.semantics.m_init) else \
        pol.semantics.mask_value
    assert sig == pytest.approx(-1e30, rel=1e-6)
    assert abs(float(np.spacing(np.float32(sig)))) >= 2.0 ** 76


def test_a_drag_saturates_the_carried_f16_pack_and_the_fix_does_not():
    """DUALWAVE_SWP scales the previous tile's carried P pack by the drag's correction: the
    victim's P = 1 becomes 2^t, inf in f16 from log2 65520 on. The same inputs under #1033's
    fix (rebase to fmax(m, mt): no drag) stay finite past the edge."""
    for name in ("lazy_unfixed", "lazy_capped"):
        e = edges.edge(name, "P saturation")
        assert 15.998 < e.t_inside < 15.99930 < e.t_outside < 16.0
        assert e.inside_fails == [] and e.beyond_fails == ["nonfinite"]
    case = edges.BUILDERS["P saturation"](policies.as_policy("lazy_unfixed"), "swp")[1]
    assert edges.fails("lazy_unfixed", case(16.5)) == ["nonfinite"]
    assert edges.fails("lazy", case(16.5)) == []
    assert onset.bound("lazy", dtype="f16").hazards[1].never


def test_a_bf16_pack_saturates_only_outside_the_accumulator_bound():
    """A bf16 pack saturates past 2^127.99, but a deficit R > 0 needs two visible keys, and
    the accumulator hazard's H + R + log2 n < 128 then keeps R below 127: along the drag's
    family every input inside the overflow hazard is inside saturation by about 1."""
    from fa_lab.studies.onset.edge_builders import _swp_fine
    for name in ("lazy_unfixed", "lazy_capped"):
        pol = policies.as_policy(name)
        region = onset.bound(pol, dtype="bf16")
        over, sat = (next(h for h in region.hazards if h.name == n)
                     for n in ("accumulator overflow", "P saturation"))
        seen = 0
        for t in (100.0, 118.0, 119.5, 126.0, 126.9, 127.2, 127.995):
            case = _swp_fine([[0.0] * 64 + [10.0] * 256, [0.0] * 64 + [-t] * 256],
                             torch.bfloat16)
            m = edges.region_and_measure(pol, case)[1]
            if over.check(m)[0]:
                seen += 1
                assert sat.check(m)[1] > 0.99, t
        assert seen >= 2


def _dragged_wave(falls, rises, bn, seed):
    """An online wave of 32 rows (D 32), 6 tiles of ``bn`` keys, every key visible: row 0
    jumps by 9 at tiles 1-3 and fires the wave each time; row r >= 1 falls by
    ``falls[r - 1]`` a tile there (dragged down a staircase), then rises ``rises[r - 1]``
    (<= THR: no vote) above the base it was dragged to for tiles 4-5. Each tile's first key
    holds its max, the others lie randomly within 2 below it."""
    from fa_lab.studies.onset.edge_builders import _online_wave

    g = torch.Generator().manual_seed(seed)
    maxima = [[0.0, 9.0, 18.0, 27.0, 27.0, 27.0]]
    maxima += [[0.0, -f, -2 * f, -3 * f, -3 * f + r, -3 * f + r] for f, r in zip(falls, rises)]
    rows = [[mx[j // bn] - (2 * float(torch.rand(1, generator=g)) if j % bn else 0.0)
             for j in range(6 * bn)] for mx in maxima]
    return _online_wave(rows, [[True] * (6 * bn)] * 32)


@pytest.mark.parametrize("name", ["mslk-2a3c897:fp8", "flydsl_fp8_empty_tile:before",
                                  "flydsl_fp8_empty_tile:after"])
def test_a_drag_on_the_online_model_never_saturates_p(name):
    """The online model takes P after its step's decision: a wave that did not fire has
    every row within THR of its base, a fired row sits at its own tile max, so P <=
    2^(H + THR) = 256 < 448 however deep the drag (which scales O and l, not P). The
    region says never; dragged waves whose deficit R passes log2 448 (and 60) keep every P
    at most 256, and none saturates."""
    from fa_lab.kernels.online.model import LOG2_UNITS, forward

    pol = policies.as_policy(name)
    h = next(h for h in onset.bound(pol, dtype="fp32").hazards if h.name == "P saturation")
    assert h.never and "never P" in h.note and _drags(pol)
    lim = 2.0 ** (float(pol.p_headroom) + float(pol.threshold))
    bn = pol.semantics.block_n or 64
    for seed, (falls, rises) in enumerate((([20.0, 3.0, 40.0], [8.0, 8.0, 5.0]),
                                           ([9.0, 12.0, 0.5, 6.0], [7.9, 8.0, 2.0, 8.0]))):
        case = _dragged_wave(falls, rises, bn, seed)
        m = edges.region_and_measure(pol, case)[1]
        assert float(m.R.max()) >= 3 * max(falls) - 1 > math.log2(448)
        rec: list = []
        forward(case.q, case.k, case.v, policy=pol, mask=case.mask, softmax_scale=LOG2_UNITS,
                record=rec)
        victims = slice(1, len(falls) + 1)
        assert all(bool(r.moved[0, 0, victims].all()) for r in rec[1:4])   # dragged thrice
        assert float(rec[3].m[0, 0, 1]) == -3 * falls[0]
        p_max = max(float(r.p_max[0, 0, :32].nan_to_num(0).max()) for r in rec)
        assert p_max == lim and sum(int(r.saturated.sum()) for r in rec) == 0


def test_output_overflow_of_a_split_counts_its_merge():
    """A split's merge sums its partials' outputs (weights up to 1) in fp32 before dividing:
    two partials at v_descale 2^127.5 overflow although each output is below bf16's largest
    value, and the region says so (before the fix it called this input safe)."""
    e = edges.edge("lse_base2_merge:before", "output overflow")
    assert e.t_inside < 127.0 and e.beyond < 127.01 and e.beyond_fails == ["nonfinite"]
    pol = policies.as_policy("lse_base2_merge:before")
    case = edges.BUILDERS["output overflow"](pol, "online")[1](127.5)
    assert not edges.margin_of(pol, "output overflow", case)[0]
    assert edges.fails(pol, case) == ["nonfinite"]


def test_a_bf16_cast_rounds_up_by_2_to_the_minus_8():
    """bf16 keeps 8 significant bits: 1 + 2^-8 + 2^-20 rounds to 1 + 2^-7, up by almost
    2^-8 (the unit roundoff ``bound`` uses); and the cast of a P <= 1 never passes 1."""
    from fa_lab.studies.onset.bound import FORMATS, _cast_log2

    x = torch.tensor(1 + 2.0 ** -8 + 2.0 ** -20)
    assert float(x.to(torch.bfloat16)) / float(x) - 1 > 2.0 ** -9
    assert FORMATS["bf16"][2] == 2.0 ** -8
    assert _cast_log2(np.array([0.0]), "bf16")[0] == 0.0
    assert _cast_log2(np.array([math.log2(1 + 2.0 ** -8 + 2.0 ** -20)]), "bf16")[0] == \
        pytest.approx(math.log2(1 + 2.0 ** -7))


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
