"""Every registered policy on every backend this machine has: it runs with the model's
semantics, or it is refused with an error naming the field and the backend.

The probe is ``experiments.drag_case``: one wave whose row 0 jumps every tile (so the wave
fires) while row 1's tile max falls by 40 per tile. A rebase to the row's own tile max
drags row 1 down until its O and l overflow (NaN); every other rebase keeps it at 1 (to
bf16 rounding), like all other rows (V is all ones). So the outcome tells which rebase really ran:
the silent substitution this guards against (fast fa4_row running as lazy) changes it.
"""

import pytest
import torch

import fa_lab
from fa_lab.kernels import FAMILIES
from fa_lab import Policy, capabilities, dispatch, policies
from fa_lab.studies.experiments import drag_case, fp8_inputs
from fa_lab.numerics import fmax

USER = {
    "test_lazy6": Policy(vote="wave", rebase="max", threshold=6, name="test_lazy6"),
    "test_tile6": Policy(vote="wave", rebase="tile", threshold=6, name="test_tile6"),
    "test_rule_unfixed": Policy.from_rule(
        lambda m, mt, thr: torch.where((~((mt - m) <= thr)).any(-1, keepdim=True), mt, m),
        name="test_rule_unfixed"),
    "test_rule_row": Policy.from_rule(
        lambda m, mt, thr: torch.where(~((mt - m) <= thr), fmax(m, mt), m), name="test_rule_row"),
}
DRAGS = {"lazy_unfixed", "test_tile6", "test_rule_unfixed"}  # rows rebase to their own tile max
IMPL = {"emulator": "model", "interpret": "faithful", "fast": "fast"}


@pytest.fixture(scope="module", autouse=True)
def user_policies():
    for p in USER.values():
        policies.register(p)
    yield
    for name in USER:
        policies.unregister(name)


def _names():
    return [*policies.BUILTIN_NAMES, *USER]


@pytest.mark.parametrize("backend", ["emulator", "interpret", "fast"])
@pytest.mark.parametrize("name", _names())
def test_bf16_policy_runs_with_its_semantics_or_is_refused(name, backend):
    q, k, v = drag_case(n_tiles=8)
    pol = policies.get(name)
    why = capabilities.policy_refusal(FAMILIES["swp_bf16"].caps(IMPL[backend]), pol, "x")
    if why is not None:
        field = "rule" if pol.rule is not None else ("vote" if "vote=" in why else "rebase")
        with pytest.raises(ValueError, match=rf"{field}.*backend='{backend}'|"
                                             rf"backend='{backend}'.*{field}|Python rule"):
            fa_lab.flash_attn_func(q, k, v, causal=False, rescale=name, backend=backend)
        return
    out = fa_lab.flash_attn_func(q, k, v, causal=False, rescale=name, backend=backend)[0, :, 0]
    victim_nan = bool(torch.isnan(out[1]).any())
    assert victim_nan == (name in DRAGS), (name, backend)
    others = torch.cat([out[:1], out[2:]]).float()
    assert (others - 1).abs().max() < 0.01
    if not victim_nan:
        assert (out[1].float() - 1).abs().max() < 0.01
    if backend == "interpret":  # the faithful port: the model's output bit for bit
        model = fa_lab.flash_attn_func(q, k, v, causal=False, rescale=name, backend="emulator")
        assert torch.equal(torch.isnan(model[0, :, 0]), torch.isnan(out))


def test_fast_fa4_row_is_refused_not_substituted():
    q, k, v = drag_case(n_tiles=8)
    with pytest.raises(ValueError, match="vote='row'.*backend='fast'"):
        fa_lab.flash_attn_func(q, k, v, causal=False, rescale="fa4_row", backend="fast")
    from fa_lab.kernels.swp_bf16 import fast
    with pytest.raises(ValueError, match="vote='row'"):
        fast.forward(q, k, v, causal=False, interpret=True,
                     policy=policies.resolve(fp8=False, seqlen_kv=512, rescale="fa4_row"))


@pytest.mark.parametrize("backend", ["emulator", "interpret", "fast"])
@pytest.mark.parametrize("name", _names())
def test_fp8_policy_runs_or_is_refused(name, backend):
    (q8, k8, v8), (qd, kd, vd) = fp8_inputs(1, 256, 1, 3000.0, seed=0)
    kw = dict(q_descale=qd, k_descale=kd, v_descale=vd, causal=False, rescale=name)
    pol = policies.get(name)
    why = capabilities.policy_refusal(FAMILIES["swp_fp8"].caps(IMPL[backend]), pol, "x")
    if why is not None:
        with pytest.raises(ValueError, match=f"backend='{backend}'|Python rule"):
            fa_lab.flash_attn_func(q8, k8, v8, backend=backend, **kw)
        return
    out = fa_lab.flash_attn_func(q8, k8, v8, backend=backend, **kw)
    model = fa_lab.flash_attn_func(q8, k8, v8, backend="emulator", **kw)
    if backend == "interpret":
        assert torch.equal(torch.isnan(model), torch.isnan(out))
    finite = torch.isfinite(out) & torch.isfinite(model)
    # V is all ones: every finite output is 1 up to the e4m3 rounding of P, whatever the tiling
    assert (out[finite].float() - 1).abs().max() < 0.1


def test_every_table_entry_has_its_capabilities():
    for (family, backend), e in dispatch.TABLE.items():
        assert e.caps is FAMILIES[family].caps(dispatch.IMPLEMENTATION[backend])
    # every family's every implementation has its entries, and nothing else does
    want = {(f, b) for f, fam in FAMILIES.items() for b, i in dispatch.IMPLEMENTATION.items()
            if i in fam.implementations}
    assert set(dispatch.TABLE) == want
