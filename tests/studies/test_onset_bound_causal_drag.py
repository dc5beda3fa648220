"""onset.bound on a causal call under a dragging FlyDSL policy (issue 39): the DUALWAVE_SWP
kernel floors a causal row's max in the prologue only, so a vote's drag, which rebases a row
to a later tile's raw max, takes a row with nothing visible there to -inf and the next
exponent to NaN. The region must not count on the floor there; a non-dragging policy keeps
it. Each case is one 32-row wave, 8 tiles of 64 keys, bottom-right causal (row r sees keys
up to r + 480): row 0 (the trigger) jumps by 20 at tile 2 and fires the wave; row 1 (the
victim) sees one key a tile (inside), nothing (the empty row), or keys from tile 4 on only
(hollow in its first tiles)."""

import math
import warnings

import pytest
import torch

from fa_lab import api, reference
from fa_lab.studies import onset
from fa_lab.studies.onset.edge_builders import _swp

N = 512


def _case(victim):
    """(q, k, v, bias): the victim's visible columns ``victim``; every other row sees every
    key the causal mask leaves it."""
    trigger = [0.0] * 128 + [20.0] * (N - 128)
    case = _swp([trigger, [1.0] * N])
    mask = torch.ones(32, N, dtype=torch.bool)
    mask[1] = False
    mask[1, list(victim)] = True
    bias = torch.where(mask, 0.0, -math.inf).to(torch.bfloat16)
    return case.q, case.k, case.v, bias


def _run(policy, victim):
    """(inside the region, the hazards violated, the rows whose output is non-finite or,
    for a row that sees nothing, not 0; the reference is fp64)."""
    q, k, v, bias = _case(victim)
    region = onset.bound(policy, dtype="bf16")
    m = onset.measure(q, k, v, policy=policy, causal=True, bias=bias)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = api.flash_attn_func(q, k, v, causal=True, rescale=policy, backend="emulator",
                                  kernel="swp_bf16", bias=bias).double()
    ref, lse = reference.attention(q, k, v, causal=True, dtype=torch.float64, bias=bias)
    defined = torch.isfinite(lse)[0, 0]
    fin = torch.isfinite(out).all(-1)[0, :, 0]
    zero = (out == 0).all(-1)[0, :, 0]
    err = (out - ref).abs().amax(-1)[0, :, 0]
    bad = torch.where(defined, ~fin | (err > 0.25), ~zero)
    return region.contains(m), region.violated(m), bad.nonzero().flatten().tolist()


ONE_A_TILE = range(0, N, 64)


@pytest.mark.parametrize("policy", ["lazy_unfixed", "lazy_capped"])
def test_empty_row_under_a_drag_leaves_the_region_and_fails(policy):
    """+eps: the victim sees one key a tile (no tile shows it nothing): inside, nothing
    fails. -eps: it sees nothing: outside (the empty row's hazard), and its output is NaN,
    where the causal floor alone would have kept it at 0."""
    inside, violated, bad = _run(policy, ONE_A_TILE)
    assert inside and violated == [] and bad == []
    inside, violated, bad = _run(policy, [])
    assert not inside and "a row that sees nothing gives 0" in violated
    assert bad == [1] if policy == "lazy_unfixed" else bad == []


def test_lazy_capped_keeps_its_max_and_is_only_conservative():
    """lazy_capped's rebase skips a drop past its bound, so its empty row stays at 0: its
    region excludes the row (the formula is sufficient, not exact, on a causal call)."""
    h = next(h for h in onset.bound("lazy_capped").hazards
             if h.name == "a row that sees nothing gives 0")
    assert not h.exact and "prologue's max only" in h.formula


def test_hollow_first_tiles_under_a_drag_leave_the_region_and_fail():
    """The victim's first four tiles show it nothing; the trigger's wave fires at tile 2 and
    drags it to that tile's -inf: NaN. The first-tile hazard no longer trusts the floor."""
    inside, violated, bad = _run("lazy_unfixed", range(256, N, 64))
    assert not inside and "NaN from a first tile with nothing visible" in violated
    assert bad == [1]


@pytest.mark.parametrize("victim", [[], range(256, N, 64)])
def test_the_floor_still_holds_without_a_drag(victim):
    """lazy (no drag) keeps the prologue's floor: the same inputs are inside its region and
    nothing fails (an empty row gives 0)."""
    inside, violated, bad = _run("lazy", victim)
    assert inside and violated == [] and bad == []
    for name in ("NaN from a first tile with nothing visible", "a row that sees nothing gives 0"):
        h = next(h for h in onset.bound("lazy").hazards if h.name == name)
        assert h.exact and "prologue" not in h.formula
