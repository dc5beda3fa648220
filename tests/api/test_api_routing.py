"""flash_attn_func routes as upstream does; a policy the routed kernel cannot run is not
applied, with a warning (once) that says which kernel= applies it."""

import re
import warnings

import pytest
import torch

import fa_lab
from fa_lab.studies.experiments import bf16_inputs
from fa_lab.kernels.generic import model as generic
from fa_lab.kernels.swp_bf16 import model as swp_bf16
from fa_lab.policies import get as get_policy


@pytest.fixture(scope="module")
def short():
    return bf16_inputs(1, 128, 2, 64, 8.0, seed=0)  # B < 8 and Sq < 256: the generic route


def test_short_sequences_run_the_generic_kernel(short):
    q, k, v = short
    out, lse = fa_lab.flash_attn_func(q, k, v, causal=True, return_lse=True)
    g_out, g_lse = generic.forward(q, k, v, causal=True)
    assert torch.equal(out, g_out) and torch.equal(lse, g_lse)
    tr = fa_lab.trace(q, k, v, rows=[5], causal=True)
    assert tr.kernel == "generic" and tr.policy.name == "eager"


def test_a_lazy_request_upstream_would_drop_runs_on_dualwave_and_says_so(short, monkeypatch):
    """Upstream runs a short call on the eager generic kernel, which cannot apply a lazy
    request: fa_lab runs it on DUALWAVE_SWP, where it applies, and warns once per policy,
    naming the request and kernel="swp_bf16", which asks for it without a warning."""
    q, k, v = short
    want = swp_bf16.forward(q, k, v, causal=True, policy=get_policy("lazy"))[0]
    for kw in ({"rescale": "lazy"}, {"dualwave_swp_lazy_rescale": True}, {"rescale_threshold": 8.0}):
        monkeypatch.setattr(fa_lab.dispatch, "_WARNED", set())
        given = ", ".join(f"{a}={b!r}" for a, b in kw.items())
        with pytest.warns(UserWarning, match=rf"{re.escape(given)}: upstream runs this call .*"
                                             r"generic kernel.*kernel='swp_bf16'"):
            assert torch.equal(fa_lab.flash_attn_func(q, k, v, causal=True, **kw), want), kw
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*upstream runs this call")
            fa_lab.flash_attn_func(q, k, v, causal=True, **kw)  # once: the second is silent
            # asked for explicitly: no warning of a departure from upstream
            assert torch.equal(fa_lab.flash_attn_func(q, k, v, causal=True, kernel="swp_bf16", **kw), want)
    assert fa_lab.trace(q, k, v, rows=[5], rescale="lazy").kernel == "swp_bf16"



def test_a_refused_call_gives_no_routing_warning(short, monkeypatch):
    """A call that would be rerouted, but whose threshold is bad, is refused with the error
    alone: the reroute warning is not given, and the next valid call still gives it (it was
    not spent on the refused one)."""
    q, k, v = short
    monkeypatch.setattr(fa_lab.dispatch, "_WARNED", set())
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="rescale_threshold"):
            fa_lab.flash_attn_func(q, k, v, causal=True, rescale="lazy", rescale_threshold=-8)
    assert [str(w.message) for w in said] == []
    with pytest.warns(UserWarning, match="upstream runs this call"):
        fa_lab.flash_attn_func(q, k, v, causal=True, rescale="lazy")


def test_routing_warnings_have_their_own_category_and_a_quiet_context(short, monkeypatch):
    """The reroute warning is a ``fa_lab.RoutingWarning`` (a UserWarning a user can filter by
    category). Inside ``dispatch.routing_quiet`` it is not given and stays unspent: the next
    call outside still gives it."""
    q, k, v = short
    monkeypatch.setattr(fa_lab.dispatch, "_WARNED", set())
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with fa_lab.dispatch.routing_quiet():
            fa_lab.flash_attn_func(q, k, v, causal=True, rescale="lazy")
    assert said == []
    with pytest.warns(fa_lab.RoutingWarning, match="upstream runs this call"):
        fa_lab.flash_attn_func(q, k, v, causal=True, rescale="lazy")
    assert issubclass(fa_lab.RoutingWarning, UserWarning)

def test_a_policy_with_no_lazy_step_to_decide_warns(monkeypatch):
    """DUALWAVE_SWP decides lazily on KV tiles 1 .. N-4 only: at Skv <= 256 a policy is
    never consulted (a rule is never called), and the call says so; from Skv = 320 it is."""
    from fa_lab.numerics import fmax

    monkeypatch.setattr(fa_lab.dispatch, "_WARNED", set())
    calls = []

    def rule(m, mt, threshold):
        calls.append(1)
        return fmax(m, mt)
    mine = fa_lab.Policy.from_rule(rule, name="counting_rule")
    for S, consulted in ((256, False), (320, True)):
        q, k, v = bf16_inputs(1, S, 1, 64, 8.0)
        calls.clear()
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            fa_lab.flash_attn_func(q, k, v, causal=False, rescale=mine)
        never = [w for w in said if "never consulted" in str(w.message)]
        assert bool(calls) == consulted and bool(never) == (not consulted), S
        if never:
            assert "Skv=256 gives N = 4" in str(never[0].message)


def test_long_sequences_run_dualwave():
    q, k, v = bf16_inputs(1, 256, 1, 64, 8.0)
    want = swp_bf16.forward(q, k, v, causal=True, policy=get_policy("lazy"))[0]
    assert torch.equal(fa_lab.flash_attn_func(q, k, v), want)
    # B >= 8: 192 rows are enough
    q, k, v = bf16_inputs(8, 192, 1, 64, 8.0)
    assert fa_lab.trace(q, k, v, rows=[0]).kernel == "swp_bf16"


def test_features_and_split_k_force_dualwave(short):
    q, k, v = short
    assert fa_lab.trace(q, k, v, rows=[0], sink=torch.zeros(2)).kernel == "swp_bf16"
    q, k, v = bf16_inputs(1, 384, 1, 64, 8.0)
    assert fa_lab.trace(q, k, v, rows=[0], kernel="swp_bf16", num_kv_splits=2).kernel == "swp_bf16"


@pytest.mark.parametrize("kw, words", [
    (dict(kernel="generic", rescale="lazy"), "kernel='generic' has no rescale='lazy'"),
    (dict(kernel="generic", sink=torch.zeros(2)), "kernel='generic' folds in no sink"),
    (dict(kernel="swp_fp8"), "float8_e4m3fn inputs only"),
    (dict(kernel="fast"), "kernel='fast' is not a kernel"),
])
def test_explicit_kernel_that_cannot_do_it_raises(short, kw, words):
    q, k, v = short
    with pytest.raises(ValueError, match=words):
        fa_lab.flash_attn_func(q, k, v, **kw)


def test_generic_split_k_raises():
    q, k, v = bf16_inputs(1, 384, 1, 64, 8.0)
    with pytest.raises(ValueError, match="generic' has no split-K"):
        fa_lab.flash_attn_func(q, k, v, kernel="generic", num_kv_splits=2)


def test_triton_backends_route_short_sequences_to_the_generic_port(short):
    # the generic kernel has a faithful Triton port: the Triton backends route as the model
    q, k, v = short
    for kw in ({}, {"kernel": "generic"}):
        plan = fa_lab.api.plan(q, k, v, backend="interpret", **kw)
        assert plan.family == "generic" and plan.call.policy.name == "eager"
        assert plan.entry is fa_lab.dispatch.TABLE[("generic", "interpret")]


def test_swa_entry_point():
    q, k, v = bf16_inputs(1, 512, 2, 128, 64.0, seed=0)
    out, lse = fa_lab.swa_attn_func(q, k, v, window_left=128, return_lse=True)
    assert torch.isfinite(out).all() and lse.shape == (1, 2, 512)
    with pytest.raises(TypeError, match="return_lse"):
        fa_lab.swa_attn_func(q, k, v, window_left=128, return_lse=1)
    with pytest.raises((ValueError, TypeError), match="window_left"):
        fa_lab.swa_attn_func(q, k, v, window_left=-1)
