"""A sweep plans each point once: routing and policy resolution run when the grid is
expanded, once per distinct call, and ``compute_point`` runs that decision on the point's
tensors (``api.plan_decided``) without routing or resolving again. The Dask workers' side
is counted in ``test_sweep.py`` (a real cluster)."""

from __future__ import annotations

import pytest
import torch

from fa_lab import dispatch
from fa_lab.studies import sweep


@pytest.fixture
def counted(monkeypatch):
    """Counts of dispatch.route and dispatch.resolve_policy calls in this process."""
    n = {"route": 0, "resolve_policy": 0}
    for name in n:
        real = getattr(dispatch, name)

        def counting(*a, _real=real, _name=name, **kw):
            n[_name] += 1
            return _real(*a, **kw)
        monkeypatch.setattr(dispatch, name, counting)
    return n


@pytest.mark.parametrize("counts", ["auto", "never", "always"])
def test_each_point_is_planned_once(counted, counts):
    grid = sweep.Grid({"policy": ["lazy_unfixed"], "k_scale": [4, 8], "seed": [0, 1],
                       "S": [512], "H": [1], "threshold": [4]})
    points = grid.points()
    assert len(points) == 4
    assert counted == {"route": 1, "resolve_policy": 1}  # one distinct call
    rows = [sweep.compute_point(p, counts=counts) for p in points]
    assert counted == {"route": 1, "resolve_policy": 1}, "compute_point planned again"
    assert {r["kernel"] for r in rows} == {"swp_bf16"}
    if counts == "never":
        assert all(r["loop_wave_steps"] is None for r in rows)
    else:
        assert all(r["loop_wave_steps"] is not None for r in rows)


def test_the_decided_point_computes_what_the_public_call_does(counted):
    """The decided path's row equals the row of the same point planned afresh (the point
    without its decision takes ``flash_attn_func`` / ``count_rescales``)."""
    torch.set_num_threads(1)
    (p,) = sweep.Grid({"policy": ["lazy_unfixed"], "k_scale": [16], "S": [256], "H": [1],
                       "threshold": [4]}).points()
    fresh = {k: v for k, v in p.items() if k != "policy_planned"}
    for counts in ("auto", "never"):
        a, b = sweep.compute_point(p, counts=counts), sweep.compute_point(fresh, counts=counts)
        for key in ("nan_rows", "inf", "rel_l2", "bad_rows", "loop_wave_steps", "o_multiplies",
                    "kernel", "policy_resolved"):
            assert a[key] == b[key] or (a[key] != a[key] and b[key] != b[key]), key
    assert counted["route"] == 1 + 2  # the expansion, then the two fresh computations


def test_a_decision_names_a_family_and_takes_a_resolved_policy():
    q = torch.zeros(1, 64, 1, 64, dtype=torch.bfloat16)
    from fa_lab import api
    with pytest.raises(ValueError, match=r"no kernel family 'nope'"):
        api.plan_decided("nope", None, q, q, q)
    with pytest.raises(TypeError, match=r"policy must be a resolved fa_lab.Policy, got str"):
        api.plan_decided("swp_bf16", "lazy", q, q, q)
