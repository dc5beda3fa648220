"""fa_lab.upstream's copies in other repositories: each names its repository, commit and the
lines read; a bare call runs the policy the copy's body is, and a dtype no FlyDSL family
runs is refused by name, pointing at the policy that runs it."""

import pytest
import torch

import fa_lab
from fa_lab import api, policies, upstream
from fa_lab.studies.experiments import bf16_inputs, fp8_inputs

COPIES = ("mslk-2a3c897", "aiter-4676", "primus-a6a16cdc")


def test_every_copy_names_where_it_was_read():
    for name in COPIES:
        ver = upstream.VERSIONS[name]
        assert ver.repository != "ROCm/FlyDSL" and ver.commit and ver.commit in ver.description
        assert ver.read and all(" l." in r for r in ver.read)
        assert ver.approximates
    assert upstream.VERSIONS["fixed"].refusal(fp8=False) is None


def test_bare_calls_run_the_copies_bodies():
    q, k, v = bf16_inputs(1, 512, 1, 64, 1.0)
    p = api.plan(q, k, v, upstream="mslk-2a3c897", backend="emulator")
    assert (p.family, p.call.policy.name, p.call.policy.threshold) == ("swp_bf16", "lazy_unfixed", 8.0)
    (q8, k8, v8), ds = fp8_inputs(1, 512, 1, 1.0)
    kw = dict(q_descale=ds[0], k_descale=ds[1], v_descale=ds[2], backend="emulator")
    for flag in (True, False):   # aiter's fp8 call site never reads the flag
        p = api.plan(q8, k8, v8, upstream="aiter-4676", dualwave_swp_lazy_rescale=flag, **kw)
        pol = p.call.policy
        assert (p.family, pol.vote, pol.rebase, pol.threshold, pol.p_headroom) == (
            "swp_fp8", "wave", "tile", 8.0, 0.0)


@pytest.mark.parametrize("name, fp8, words", [
    ("mslk-2a3c897", True, "rescale='mslk-2a3c897:fp8'"),
    ("aiter-4676", False, "fp8 kernels only"),
    ("primus-a6a16cdc", False, "rescale='primus-a6a16cdc'"),
    ("primus-a6a16cdc", True, "bf16 only")])
def test_a_dtype_without_a_flydsl_body_is_refused_by_name(name, fp8, words):
    if fp8:
        (q, k, v), ds = fp8_inputs(1, 256, 1, 1.0)
        kw = dict(q_descale=ds[0], k_descale=ds[1], v_descale=ds[2])
    else:
        q, k, v = bf16_inputs(1, 256, 1, 64, 1.0)
        kw = {}
    with pytest.raises(ValueError, match=f"upstream='{name}'.*{words}"):
        fa_lab.flash_attn_func(q, k, v, upstream=name, backend="emulator", **kw)


def test_the_copies_policies_run_on_the_online_model():
    q, k, v = bf16_inputs(1, 256, 1, 64, 1.0)
    p = api.plan(q, k, v, rescale="primus-a6a16cdc", causal=True)
    assert p.family == "online" and p.call.policy.semantics.fixed_max == 0.0
    assert policies.get("mslk-2a3c897:fp8").semantics.p_cast == "bf16"
    out = fa_lab.flash_attn_func(q, k, v, rescale="primus-a6a16cdc", causal=True)
    ref = fa_lab.reference.attention(q, k, v, causal=True)[0]
    assert torch.isfinite(out).all() and fa_lab.metrics.rel_l2(out, ref) < 1e-2
