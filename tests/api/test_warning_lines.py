"""Where fa_lab's warnings point: at the user's line, however deep in fa_lab they are given
(a call, a sweep's planning), so that a user can filter them by their own module."""

import re
import warnings

import pytest

import fa_lab
from fa_lab.studies import sweep
from fa_lab.studies.experiments import bf16_inputs


def _routing(said):
    return [w for w in said if issubclass(w.category, fa_lab.RoutingWarning)]


def test_a_routing_warning_names_the_callers_line(monkeypatch):
    """A short call with a lazy policy is rerouted (upstream would run the eager generic
    kernel): the RoutingWarning names this file, not fa_lab/api.py."""
    monkeypatch.setattr(fa_lab.dispatch, "_WARNED", set())
    q, k, v = bf16_inputs(1, 128, 1, 64, 8.0)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        fa_lab.flash_attn_func(q, k, v, causal=True, rescale="lazy")
    routed = _routing(said)
    assert routed and [w.filename for w in routed] == [__file__] * len(routed)


def test_a_routing_warning_filters_by_the_users_module(monkeypatch):
    monkeypatch.setattr(fa_lab.dispatch, "_WARNED", set())
    q, k, v = bf16_inputs(1, 128, 1, 64, 8.0)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", category=fa_lab.RoutingWarning,
                                module=re.escape(__name__))
        with pytest.raises(fa_lab.RoutingWarning, match="upstream runs this call"):
            fa_lab.trace(q, k, v, rows=[3], rescale="lazy")


def test_a_sweeps_routing_warning_names_the_line_that_planned_it(monkeypatch):
    """A sweep plans each point as a call; the point's warning names the user's line that
    asked for the points, not fa_lab/studies/sweep/grid.py or fa_lab/api.py."""
    monkeypatch.setattr(fa_lab.dispatch, "_WARNED", set())
    grid = sweep.Grid({"policy": ["lazy"], "k_scale": [8], "S": [128], "D": [64],
                       "causal": [True]})
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        grid.points()
    routed = _routing(said)
    assert routed and [w.filename for w in routed] == [__file__] * len(routed)
