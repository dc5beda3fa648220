"""Every (family, implementation, policy value, feature) the capabilities claim runs the
value as ``fa_lab.values`` declares it, against an fp64 reference (``_conformance``).

The claims are enumerated from ``fa_lab.kernels.FAMILIES``: a new family, value or feature
is picked up with no edit here. Split-K, paged KV (in the call form the implementation's
``Caps.paged_call`` names) and the SWA kernel's window are checked against fp64
attention on the logical inputs. Each value of each fixed-set
``Semantics`` field an implementation runs (``Caps.semantics``) is a claim too, against
the reference of ``_semantic_conformance`` on an input that tells the field's values
apart; each numeric field it runs, and each numeric policy parameter (threshold, rebase
bound), is run at a value whose input tells it from the default, so an implementation
that ignores it fails, naming the family and the field. The models run
on the CPU; the Triton ports through Triton's interpreter (slow) and, compiled, on a GPU.
A value claimed but run as another fails, naming the family, the implementation and the
value (the injection tests below); a decision site that meets a value it has no code for
raises, naming it.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import _conformance as C  # noqa: E402
import _mode_conformance as MODES  # noqa: E402
import _semantic_conformance as SEM  # noqa: E402

from fa_lab import Policy, dispatch, values  # noqa: E402
from fa_lab.capabilities import FEATURES, PAGED_CALLS, Caps, Family, Implementation  # noqa: E402
from fa_lab.paged import LAYOUTS, PagedFp8, PagedKV  # noqa: E402
from fa_lab.kernels import FAMILIES, module  # noqa: E402
from fa_lab.semantics import Semantics  # noqa: E402

CLAIMS = C.claims()
MODELS = [c for c in CLAIMS if c.impl == "model"]
PORTS = [c for c in CLAIMS if c.impl != "model"]
#: The compiled ports' claims: the modes' (decode, MLA, backward) are left to those
#: families' own gpu tests, which hold each compiled port to its model.
COMPILED = [c for c in PORTS if not MODES.is_mode(c)]


def _id(c):
    return f"{c.family}-{c.impl}-{c.field}={c.value}-{c.feature or 'plain'}"


@pytest.mark.parametrize("claim", MODELS, ids=_id)
def test_every_claimed_value_runs_as_declared_on_the_models(claim):
    C.check(claim)


@pytest.mark.slow
@pytest.mark.parametrize("claim", PORTS, ids=_id)
def test_every_claimed_value_runs_as_declared_on_the_interpreted_ports(claim):
    C.check(claim)


@pytest.mark.gpu
@pytest.mark.parametrize("claim", COMPILED, ids=_id)
def test_every_claimed_value_runs_as_declared_on_the_compiled_ports(claim):
    C.check(claim, device="cuda")


def test_the_claims_cover_every_family_implementation_and_value():
    """Each implementation of each family contributes one claim per vote and rebase value
    its Caps lists, plain and per feature, and one per declared value of each fixed-set
    Semantics field it runs; every feature a family claims is either run against the
    reference or listed, with why, as not run."""
    seen = {(c.family, c.impl, c.field, c.value) for c in CLAIMS}
    ran = {(c.family, c.impl, c.feature) for c in CLAIMS}
    for name, fam in FAMILIES.items():
        for impl, im in fam.implementations.items():
            for v in im.caps.votes:
                assert (name, impl, "vote", v) in seen
            for r in im.caps.rebases:
                assert (name, impl, "rebase", r) in seen
            for f in im.caps.features:
                assert f in C.FEATURES or f in C.UNCOVERED, (name, impl, f)
                if im.caps.votes or im.caps.rebases:  # each claimed feature is run
                    assert (name, impl, f) in ran, (name, impl, f)
            for field in set(im.caps.semantics) & set(values.DECLARED):
                for v in values.names(field):
                    assert (name, impl, field, v) in seen
            for field in set(im.caps.semantics) & set(SEM.NUMERIC_FIELDS):
                assert (name, impl, field, SEM.NUMERIC[field]) in seen
            if im.caps.rules:
                for r in C.RULES:
                    assert (name, impl, "rule", r) in seen
            for field, value in im.caps.modes:
                assert (name, impl, field, value) in seen
            if "fp8" in im.caps.dtypes and "tile" in im.caps.votes:
                for param, value in C.FP8_PARAMETERS.items():
                    assert (name, impl, param, value) in seen
            for param in C.PARAMETERS:
                if any(param in values.get(f, v).uses for f, vs in
                       (("vote", im.caps.votes), ("rebase", im.caps.rebases)) for v in vs):
                    assert (name, impl, param, C.PARAMETERS[param]) in seen
    assert set(C.UNCOVERED) <= set(FEATURES)
    assert set(SEM.FIELDS) == set(values.DECLARED) - set(values.POLICY_FIELDS)
    assert set(SEM.NUMERIC_FIELDS) == {f.name for f in dataclasses.fields(Semantics)} - set(SEM.FIELDS)


def test_a_new_family_is_picked_up_without_a_test_edit():
    caps = Caps(frozenset({"bf16"}), (64,), frozenset({"trace"}), frozenset({"tile", "row"}),
                frozenset({"max", "capped"}))
    toy = Family("toy", "a toy", {"model": Implementation("model", caps)})
    got = {(c.field, c.value, c.feature) for c in C.claims({"toy": toy})}
    assert got == {(f, v, feat) for f, vs in (("vote", ("tile", "row")), ("rebase", ("max", "capped")))
                   for v in vs for feat in (None, "trace")} | {
        (p, v, None) for p, v in C.PARAMETERS.items()}
    semantic = dataclasses.replace(caps, semantics=frozenset({"o_gate", "block_n"}))
    toy = Family("toy", "a toy", {"model": Implementation("model", semantic)})
    got = {(c.field, c.value) for c in C.claims({"toy": toy}) if c.field not in values.POLICY_FIELDS}
    assert got == {("o_gate", v) for v in values.names("o_gate")} | {
        ("block_n", SEM.NUMERIC["block_n"]), ("threshold", C.PARAMETERS["threshold"]),
        ("rebase_bound", C.PARAMETERS["rebase_bound"])}


@pytest.mark.parametrize("field", SEM.FIELDS)
def test_the_semantic_case_tells_every_value_apart(field):
    """On each Semantics field's conformance input the reference's outputs differ, for any
    two of the field's values, in their NaN or inf rows or by more than the check's
    tolerance, so a value run as another cannot pass."""
    the_case = SEM.case(field, torch.bfloat16, 64)
    outs = {v: torch.cat([SEM.reference(call, SEM.policy_for(field, v, the_case))
                          for call in the_case.calls]) for v in values.names(field)}
    names = list(outs)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            x, y = outs[a], outs[b]
            if torch.equal(x.isnan().any(-1), y.isnan().any(-1)) and torch.equal(
                    x.isinf().any(-1), y.isinf().any(-1)):
                fin = x.isfinite() & y.isfinite()
                err = ((x - y).abs() / y.abs().clamp(min=1.0)).where(fin, torch.zeros_like(x))
                assert float(err.max()) > 0.1, (field, a, b, float(err.max()))


@pytest.mark.parametrize("field", SEM.NUMERIC_FIELDS)
def test_the_numeric_case_tells_the_value_from_the_default(field):
    """On each numeric Semantics field's case the reference at the claimed value differs
    from the reference at the field's default (NaN or inf rows, or past the tolerance), so
    an implementation that ignores the field fails its claim."""
    the_case = SEM.case(field, torch.bfloat16, 64)
    default = {f.name: f.default for f in dataclasses.fields(Semantics)}[field]
    x, y = (torch.cat([SEM.reference(call, SEM.policy_for(field, v, the_case))
                       for call in the_case.calls]) for v in (SEM.NUMERIC[field], default))
    if torch.equal(x.isnan().any(-1), y.isnan().any(-1)) and torch.equal(
            x.isinf().any(-1), y.isinf().any(-1)):
        fin = x.isfinite() & y.isfinite()
        err = ((x - y).abs() / y.abs().clamp(min=1.0)).where(fin, torch.zeros_like(x))
        assert float(err.max()) > 0.1, (field, float(err.max()))


@pytest.mark.parametrize("param", C.PARAMETERS)
def test_the_case_tells_each_parameter_value_apart(param):
    """The policy's threshold and rebase bound: at ``PARAMETERS``'s value and at the one
    every other claim runs (THRESHOLD, BOUND) the reference breaks different rows."""
    full = Caps(frozenset({"bf16"}), (64,), frozenset(), frozenset(values.names("vote")),
                frozenset(values.names("rebase")))
    q, k, v, c = C.make_case("bf16", 64, C.ROWS, C.COLS)
    s2 = (q.double()[0, :, 0] @ k.double()[0, :, 0].T) * c
    pol = C.policy_for(C.Claim("x", "model", param, C.PARAMETERS[param], None), full)
    base = dataclasses.replace(pol, **{param: {"threshold": C.THRESHOLD, "rebase_bound": C.BOUND}[param]})
    broken = [tuple((~torch.isfinite(C.reference(s2[None], v.double()[0, :, 0], p, fp8=False)[0])
                     ).any(-1).nonzero().flatten().tolist()) for p in (pol, base)]
    assert broken[0] != broken[1], broken


@pytest.mark.parametrize("causal", [False, True], ids=["plain", "causal"])
@pytest.mark.parametrize("dtype, D", [("bf16", 64), ("fp8", 128)])
@pytest.mark.parametrize("field", values.POLICY_FIELDS)
def test_the_case_tells_every_value_apart(field, dtype, D, causal):
    """On the conformance input the reference's broken rows (NaN, inf or zero) differ
    between any two values of a field, so a value run as another cannot pass; so too on
    the fp8 input (P cast saturating) and under the bottom-right causal mask a paged call
    form may take (``PAGED_CALLS``)."""
    full = Caps(frozenset({"bf16"}), (64,), frozenset(), frozenset(values.names("vote")),
                frozenset(values.names("rebase")))
    q, k, v, c = C.make_case(dtype, D, C.ROWS, C.COLS)
    s2 = (q.double()[0, :, 0] @ k.double()[0, :, 0].T) * c
    if causal:
        s2 = s2 + C.causal_mask(C.ROWS, C.COLS)
    patterns = {}
    for value in values.names(field):
        pol = C.policy_for(C.Claim("x", "model", field, value, None), full)
        out = C.reference(s2[None], v.double()[0, :, 0], pol, fp8=dtype == "fp8")[0]
        broken = ~torch.isfinite(out).all(-1) | (out == 0).all(-1)
        patterns[value] = tuple(broken.nonzero().flatten().tolist())
    assert len(set(patterns.values())) == len(patterns), patterns


def _declare_clamped(monkeypatch):
    """Declare a rebase value ``clamped`` (a new value, as a contributor would)."""
    clamped = values.Value("rebase", "clamped", "a test value: rebases as 'max' does",
                           lowers=False)
    monkeypatch.setitem(values.DECLARED, "rebase", (*values.DECLARED["rebase"], clamped))
    return Policy("wave", "clamped", threshold=C.THRESHOLD, name="clamped_pol")


def test_a_value_claimed_but_mis_run_fails_naming_family_and_value(monkeypatch):
    """``clamped`` declared, defined in the reference as "max", claimed by the swp_bf16
    model, which runs it as "tile" (the review's mis-run): the new claims are picked up,
    and their check fails naming the family, the implementation and the value."""
    import fa_lab.kernels._common.models as models

    _declare_clamped(monkeypatch)
    monkeypatch.setitem(C.REFERENCE_REBASES, "clamped", C.REFERENCE_REBASES["max"])
    fam = FAMILIES["swp_bf16"]
    caps = fam.caps("model")
    monkeypatch.setitem(fam.implementations, "model", dataclasses.replace(
        fam.implementations["model"], caps=dataclasses.replace(caps, rebases=caps.rebases | {"clamped"})))
    monkeypatch.setattr(dispatch, "TABLE", dispatch._entries())
    choose = models.choose

    def mis_run(policy, *a, **kw):
        if policy.rebase == "clamped":
            policy = dataclasses.replace(policy, rebase="tile")
        return choose(policy, *a, **kw)

    monkeypatch.setattr(models, "choose", mis_run)
    new = [c for c in C.claims() if c.value == "clamped"]
    assert {(c.family, c.impl) for c in new} == {("swp_bf16", "model")}
    plain = next(c for c in new if c.feature is None)
    with pytest.raises(AssertionError, match=r"family 'swp_bf16', implementation 'model', "
                                             r"rebase='clamped'.*NaN rows \[1, 33, 64\]"):
        C.check(plain)
    def as_declared(policy, *a, **kw):  # an implementation of clamped as the reference's
        if policy.rebase == "clamped":
            policy = dataclasses.replace(policy, rebase="max")
        return choose(policy, *a, **kw)

    monkeypatch.setattr(models, "choose", as_declared)
    C.check(plain)


def _decode_as_main(monkeypatch):
    """The decode entry point running every version as main (the fix applied to all)."""
    from fa_lab import decode

    check = decode.check_decode
    monkeypatch.setattr(decode, "check_decode", lambda name: check(None))


def _mla_without_headroom(monkeypatch):
    """The MLA model casting P unlifted, whatever p_headroom it is handed."""
    from fa_lab.kernels.mla_decode import model as mla_model

    forward = mla_model.forward
    monkeypatch.setattr(mla_model, "forward", lambda *a, p_headroom: forward(*a, p_headroom=0.0))


def _mla_one_split(monkeypatch):
    """MLA decode running one split whatever num_kv_splits it is asked for."""
    from fa_lab import mla

    run = mla.mla_decode
    monkeypatch.setattr(mla, "mla_decode", lambda *a, num_kv_splits, **kw: run(*a, **kw))


def _decode_one_partition(monkeypatch):
    """The paged decode running one partition whatever num_partitions it is asked for."""
    from fa_lab import decode

    run = decode.pa_decode_tile
    monkeypatch.setattr(decode, "pa_decode_tile",
                        lambda *a, num_partitions, **kw: run(*a, num_partitions=1, **kw))


def _bwd_unfloored(monkeypatch):
    """The backward model without dQ's LSE floor."""
    from fa_lab.kernels.bwd import model as bwd_model

    backward = bwd_model.backward
    monkeypatch.setattr(bwd_model, "backward",
                        lambda *a, **kw: backward(*a, lse_floor=False, **kw))


@pytest.mark.parametrize("family, field, value, inject, symptom", [
    ("pa_decode", "upstream", "flydsl-985c653a^", _decode_as_main,
     "NaN rows [], the reference's [0, 1, 2"),
    ("pa_decode", "num_partitions", 2, _decode_one_partition, "partials (1, 1, 1, 4)"),
    ("mla_decode", "p_headroom", 4.0, _mla_without_headroom, "row 0 differs by 1 "),
    ("mla_decode", "num_kv_splits", 2, _mla_one_split, "1 LSE partials for 2 splits"),
    ("bwd", "lse", "floored", _bwd_unfloored, "NaN rows [0, 1, 2"),
], ids=["decode-version", "decode-partitions", "mla-headroom", "mla-splits", "bwd-lse"])
def test_a_mode_claimed_but_mis_run_fails_naming_family_and_value(monkeypatch, family, field,
                                                                   value, inject, symptom):
    """A family's own choice (``Caps.modes``) run as another value, or its split not
    made: its model's claim fails, naming the family, the implementation and the value;
    unpatched it passes."""
    claim = C.Claim(family, "model", field, value, None)
    assert claim in CLAIMS
    C.check(claim)
    inject(monkeypatch)
    said = re.escape(f"family {family!r}, implementation 'model', {field}={value!r}")
    with pytest.raises(AssertionError, match=rf"{said}.* does not run the value as declared: "
                                             rf".*{re.escape(symptom)}"):
        C.check(claim)


def test_a_family_with_modes_and_no_runner_fails_naming_it():
    caps = Caps(frozenset({"fp8"}), (64,), frozenset(), frozenset(), frozenset(),
                modes=frozenset({("scale", "per_token")}))
    toy = Family("toy", "a toy", {"model": Implementation("model", caps)}, routed=False)
    with pytest.raises(AssertionError, match=r"family 'toy' claims modes .* has no runner"):
        C.claims({"toy": toy})


def test_every_family_has_claims():
    """No registered family goes unchecked: each has at least one claim per implementation."""
    assert {(c.family, c.impl) for c in CLAIMS} == {
        (name, impl) for name, fam in FAMILIES.items() for impl in fam.implementations}


@pytest.mark.parametrize("dtype, D", [("bf16", 64), ("fp8", 128)])
@pytest.mark.parametrize("field, value", [("vote", "wave"), ("vote", "row"), ("rebase", "tile"),
                                          ("rebase", "capped"), ("rebase", "max")])
def test_the_split_case_tells_split_from_unsplit(field, value, dtype, D):
    """On split-K's input the reference split at ``SPLIT_AT`` and the reference unsplit
    differ, for every lazy value, in their non-finite or zero rows: a kernel that does not
    split (or does not merge the splits) fails the claim."""
    full = Caps(frozenset({"bf16"}), (64,), frozenset(), frozenset(values.names("vote")),
                frozenset(values.names("rebase")))
    cols, at = C.SPLIT_COLS.get(dtype, 640), C.SPLIT_AT.get(dtype, 384)
    q, k, v, c = C.make_case(dtype, D, C.SPLIT_ROWS, cols, C.THIRD, at)
    s2 = (q.double()[0, :, 0] @ k.double()[0, :, 0].T)[None] * c
    pol = C.policy_for(C.Claim("x", "model", field, value, None), full)
    fp8 = dtype == "fp8"
    outs = [C.reference(s2, v.double()[0, :, 0], pol, fp8=fp8)[0],
            C.split_reference(s2, v.double()[0, :, 0], pol, fp8=fp8, at=at)[0]]
    broken = [tuple((~o.isfinite().all(-1) | (o == 0).all(-1)).nonzero().flatten().tolist())
              for o in outs]
    assert broken[0] != broken[1], broken
    assert C.JUMP_ROW in broken[0] and C.JUMP_ROW not in broken[1]


@pytest.mark.parametrize("family", sorted(n for n, f in FAMILIES.items()
                                          if "num_kv_splits" in f.caps("model").features))
def test_a_split_claim_fails_when_the_kernel_does_not_split(monkeypatch, family):
    """The model handed ``num_kv_splits`` but walking every key in one pass: its split-K
    claim fails on the row that only a split keeps finite, naming the family, the value
    and the feature; unpatched it passes."""
    claim = C.Claim(family, "model", "vote", "wave", "num_kv_splits")
    assert claim in CLAIMS
    C.check(claim)
    model = module(family)
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, num_kv_splits=1, **kw: forward(*a, **kw))
    with pytest.raises(AssertionError, match=rf"family {family!r}, implementation 'model', "
                                             r"vote='wave', feature num_kv_splits does not run"):
        C.check(claim)


#: Each paged model's page lookup, patched to ignore the block table: tile t reads
#: physical page t, so the unused (NaN) pages 4 and 6 are read.
_LOGICAL_PAGES = {
    "swp_bf16": (PagedKV, lambda self, n: torch.arange(n).expand(self.block_table.shape[0], n)),
    "swp_fp8": (PagedFp8, lambda self, b, n: torch.arange(n)),
}


@pytest.mark.parametrize("family", _LOGICAL_PAGES)
def test_a_paged_claim_fails_when_the_gather_is_wrong(monkeypatch, family):
    """The paged model reading its pages in logical order, past the block table: the
    unused pages of the conformance cache hold NaN, so its paged claim fails, naming the
    family and the feature, in the call form its Caps name."""
    claim = C.Claim(family, "model", "vote", "wave", "paged")
    assert claim in CLAIMS
    cls, logical = _LOGICAL_PAGES[family]
    monkeypatch.setattr(cls, "page_ids", logical)
    with pytest.raises(AssertionError, match=rf"family '{family}', implementation 'model', "
                                             r"vote='wave', feature paged.*NaN rows \[0, 1, 2"):
        C.check(claim)


def test_a_value_mis_run_on_the_fp8_paged_call_fails_naming_it(monkeypatch):
    """The fp8 paged model (packed, causal, vectorized: its ``Caps.paged_call``) running
    rebase "capped" as "tile": its paged claim fails on row 1 (whose drop "capped" skips),
    naming the family, the value and the feature; unpatched it passes."""
    import fa_lab.kernels._common.models as models

    claim = C.Claim("swp_fp8", "model", "rebase", "capped", "paged")
    assert claim in CLAIMS and FAMILIES["swp_fp8"].caps("model").paged_call == "packed_causal"
    choose = models.choose

    def mis_run(policy, *a, **kw):
        if policy.rebase == "capped":
            policy = dataclasses.replace(policy, rebase="tile", rebase_bound=None)
        return choose(policy, *a, **kw)

    monkeypatch.setattr(models, "choose", mis_run)
    with pytest.raises(AssertionError, match=r"family 'swp_fp8', implementation 'model', "
                                             r"rebase='capped', feature paged.*NaN rows \[1, 33\]"):
        C.check(claim)
    monkeypatch.setattr(models, "choose", choose)
    C.check(claim)


def test_the_paged_call_forms():
    """Each form's layouts are ones ``fa_lab.paged`` takes; the fp8 family names the packed
    causal form, the bf16 one takes the default; a form unknown, or named without the
    paged feature, is refused."""
    for form in PAGED_CALLS.values():
        assert set(form.layouts) <= set(LAYOUTS) and form.layouts and form.causal
    assert PAGED_CALLS["packed_causal"].causal == (True,) and PAGED_CALLS["packed_causal"].packed
    assert FAMILIES["swp_bf16"].caps("model").paged_call == "dense"
    for impl in ("model", "faithful"):
        assert FAMILIES["swp_fp8"].caps(impl).paged_call == "packed_causal"
    args = (frozenset({"fp8"}), (128,), frozenset({"paged"}), frozenset({"tile"}), frozenset({"max"}))
    with pytest.raises(ValueError, match=r"Caps.paged_call='ragged' is not a paged call form"):
        Caps(*args, paged_call="ragged")
    with pytest.raises(ValueError, match=r"features do not claim 'paged'"):
        Caps(*args[:2], frozenset(), *args[3:], paged_call="packed_causal")


def test_a_semantics_value_mis_run_fails_naming_family_and_value(monkeypatch):
    """The online model's epilogue run with guard "zero" where "one" is asked (the
    injected mis-run): its claim fails, naming the family, the implementation and the
    value; the same patch running "one" as declared passes."""
    model = module("online")
    scale = model.epilogue_scale
    monkeypatch.setattr(model, "epilogue_scale",
                        lambda l, guard: scale(l, "zero" if guard == "one" else guard))
    claim = C.Claim("online", "model", "epilogue_guard", "one", None)
    assert claim in CLAIMS
    with pytest.raises(AssertionError, match=r"family 'online', implementation 'model', "
                                             r"epilogue_guard='one'.* does not run the value"):
        C.check(claim)
    monkeypatch.setattr(model, "epilogue_scale", scale)
    C.check(claim)


def test_a_numeric_field_ignored_fails_naming_family_and_field(monkeypatch):
    """The online model run with ``block_n`` reset to its default whatever the policy
    asks (a family that claims a numeric field but ignores it): its claim fails, naming
    the family and the field; unpatched it passes."""
    model = module("online")
    forward = model.forward

    def ignoring(*a, policy, **kw):
        sem = dataclasses.replace(policy.semantics, block_n=None)
        return forward(*a, policy=dataclasses.replace(policy, semantics=sem), **kw)

    claim = C.Claim("online", "model", "block_n", SEM.NUMERIC["block_n"], None)
    assert claim in CLAIMS
    monkeypatch.setattr(model, "forward", ignoring)
    with pytest.raises(AssertionError, match=r"family 'online', implementation 'model', "
                                             r"block_n=32.* does not run the value"):
        C.check(claim)
    monkeypatch.setattr(model, "forward", forward)
    C.check(claim)


def test_a_parameter_ignored_fails_naming_family_and_parameter(monkeypatch):
    """The swp_bf16 model deciding with threshold 200 whatever the policy says: its
    threshold claim (150) fails, naming the family and the parameter."""
    import fa_lab.kernels._common.models as models

    choose = models.choose

    def deaf(policy, *a, **kw):
        if policy.lazy:
            policy = dataclasses.replace(policy, threshold=C.THRESHOLD)
        return choose(policy, *a, **kw)

    claim = C.Claim("swp_bf16", "model", "threshold", C.PARAMETERS["threshold"], None)
    assert claim in CLAIMS
    monkeypatch.setattr(models, "choose", deaf)
    with pytest.raises(AssertionError, match=r"family 'swp_bf16', implementation 'model', "
                                             r"threshold=150.0.* does not run the value"):
        C.check(claim)
    monkeypatch.setattr(models, "choose", choose)
    C.check(claim)


def test_the_p_headroom_ignored_fails_naming_family_and_value(monkeypatch):
    """The fp8 model lifting P by nothing whatever ``p_headroom`` says: its headroom claim
    (10: P of 1 saturates at 448 while l keeps 1024) fails, naming the family and value."""
    from fa_lab.kernels.swp_fp8 import walk

    claim = C.Claim("swp_fp8", "model", "p_headroom", C.FP8_PARAMETERS["p_headroom"], None)
    assert claim in CLAIMS
    C.check(claim)
    run = walk.walk
    monkeypatch.setattr(walk, "walk", lambda *a, headroom, **kw: run(*a, headroom=0.0, **kw))
    with pytest.raises(AssertionError, match=r"family 'swp_fp8', implementation 'model', "
                                             r"p_headroom=10.0.* does not run the value"):
        C.check(claim)


def test_a_rule_run_as_another_fails_naming_family_and_rule(monkeypatch):
    """The swp_bf16 model handed the "max" rule where the claim's reference is the "tile"
    rebase (a rule mis-run): the check fails, naming the family and the rule."""
    claim = C.Claim("swp_bf16", "model", "rule", "wave_tile", None)
    assert claim in CLAIMS
    monkeypatch.setitem(C.RULES, "wave_tile", (C.RULES["wave_max"][0], C.RULES["wave_tile"][1]))
    with pytest.raises(AssertionError, match=r"family 'swp_bf16', implementation 'model', "
                                             r"rule='wave_tile'.*NaN rows"):
        C.check(claim)


def test_a_new_numeric_field_is_claimed_and_fails_without_a_value(monkeypatch):
    """A numeric Semantics field the online model runs but ``NUMERIC`` gives no value:
    enumerating the claims fails, naming the field."""
    monkeypatch.setattr(SEM, "NUMERIC_FIELDS", (*SEM.NUMERIC_FIELDS, "new_knob"))
    fam = FAMILIES["online"]
    im = fam.implementations["model"]
    caps = dataclasses.replace(im.caps, semantics=im.caps.semantics | {"new_knob"})
    toy = Family("online", fam.description, {"model": dataclasses.replace(im, caps=caps)})
    with pytest.raises(AssertionError, match=r"numeric semantics field 'new_knob'"):
        C.claims({"online": toy})


def test_a_new_semantics_value_is_claimed_and_refused_until_implemented(monkeypatch):
    """A value declared for a field the online model runs is claimed with no test edit;
    until the model has code for it, its check fails naming the value and the model, and
    the reference, without a rule for it, names it too."""
    never = values.Value("o_gate", "never", "a test value: O is never rescaled")
    monkeypatch.setitem(values.DECLARED, "o_gate", (*values.DECLARED["o_gate"], never))
    new = [c for c in C.claims() if (c.field, c.value) == ("o_gate", "never")]
    assert [(c.family, c.impl) for c in new] == [("online", "model")]
    with pytest.raises(ValueError, match=r"the online model has no code for o_gate='never'"):
        C.check(new[0])
    the_case = SEM.case("o_gate", torch.bfloat16, 64)
    with pytest.raises(AssertionError, match=r"no rule for o_gate='never'"):
        SEM.reference(the_case.calls[0], SEM.policy_for("o_gate", "never", the_case))


def test_a_claim_the_reference_cannot_define_fails_naming_the_value(monkeypatch):
    _declare_clamped(monkeypatch)
    with pytest.raises(AssertionError, match=r"no rule for rebase='clamped'"):
        C.reference(torch.zeros(1, 32, 64, dtype=torch.float64),
                    torch.zeros(64, 4, dtype=torch.float64),
                    Policy("wave", "clamped", name="c"), fp8=False)


def _qkv(D=64, dtype=torch.bfloat16, S=512):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, S, 1, D, generator=g).to(dtype) for _ in range(3))
    return q, k, v


@pytest.mark.parametrize("family", ["swp_bf16", "online"])
def test_a_model_given_an_unknown_value_raises_naming_it(monkeypatch, family):
    """A value declared but implemented nowhere: the models' decision raises, naming the
    value and the model; no model runs it as another value."""
    pol = _declare_clamped(monkeypatch)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=rf"the {family} model has no code for rebase='clamped'"):
        module(family).forward(q, k, v, causal=False, policy=pol)


def test_the_fp8_model_given_an_unknown_vote_raises_naming_it(monkeypatch):
    odd = values.Value("vote", "odd", "a test vote", ("threshold", "rebase"))
    monkeypatch.setitem(values.DECLARED, "vote", (*values.DECLARED["vote"], odd))
    pol = Policy("odd", "max", name="odd_pol")
    q, k, v = (t.to(torch.float8_e4m3fn) for t in _qkv(D=128, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"the swp_fp8 model has no code for vote='odd'"):
        module("swp_fp8").forward(q, k, v, q_descale=1.0, k_descale=1.0, v_descale=1.0,
                                  causal=False, policy=pol)


def test_every_implementation_refuses_an_unclaimed_value_by_name(monkeypatch):
    """Declared but claimed by no Caps: every (family, backend) refuses it, naming the
    value and the implementation; the ports' codes are never reached."""
    pol = _declare_clamped(monkeypatch)
    for (family, backend), e in dispatch.TABLE.items():
        why = dispatch.policy_refusal(e, pol)
        assert why is not None, (family, backend)
        if "wave" in e.caps.votes:
            assert f"rebase='clamped', which the {family} kernel on backend={backend!r} lacks" in why
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"rebase='clamped', which the faithful swp_bf16 kernel lacks"):
        module("swp_bf16", "faithful").forward(q, k, v, causal=False, policy=pol, interpret=True)
    with pytest.raises(ValueError, match=r"rebase='clamped'.*the SWA kernel lacks"):
        import fa_lab
        fa_lab.swa_attn_func(*_qkv(D=128), window_left=64, rescale=pol, backend="emulator")


def test_a_parameter_no_value_reads_is_refused():
    with pytest.raises(ValueError, match=r"threshold has no effect with vote='tile'"):
        Policy(vote="tile", threshold=3)
    with pytest.raises(ValueError, match=r"rebase has no effect with vote='tile'"):
        Policy(vote="tile", rebase="tile")
    with pytest.raises(ValueError, match=r"rebase_bound has no effect with rebase='max': "
                                         r"only rebase='capped' read it"):
        Policy(vote="wave", rebase="max", rebase_bound=4.0)
    assert Policy(vote="wave", rebase="capped", rebase_bound=4.0).parameters == {
        "threshold", "rebase", "rebase_bound"}


def test_the_codes_the_triton_kernels_branch_on_stay_put():
    """A value's kernel code is its position in its field (``Policy.codes``); the Triton
    kernels branch on these, so a new value is appended, never inserted."""
    assert values.names("vote")[:3] == ("tile", "wave", "row")
    assert values.names("rebase")[:3] == ("max", "tile", "capped")
    codes = Policy("wave", "capped", rebase_bound=4.0, name="c").codes
    assert (codes.vote, codes.rebase, codes.bound) == (1, 2, 4.0)
