"""Kernel semantics as data (fa_lab.semantics): defaults that leave every existing policy as
it was, validation naming the field, and the refusal by name where a kernel lacks a field."""

import dataclasses
import math

import pytest

from fa_lab import Policy, policies as P
from fa_lab.semantics import DEFAULT, DEFAULT_FLOOR, FLT_MAX, Semantics, choices


def test_defaults_change_nothing_for_existing_policies():
    assert Semantics().changed() == () and DEFAULT == Semantics() and DEFAULT.describe() == ""
    for name in P.BUILTIN_NAMES:
        assert P.get(name).semantics == DEFAULT and P.get(name).semantic_fields == ()
    # equality and hashing still see only what a policy sets
    assert Policy("wave", "max", name="lazy") == dataclasses.replace(P.get("lazy"), color=None,
                                                                    description="")
    assert len({P.get("lazy"), P.get("lazy")}) == 1
    # the FlyDSL defaults, field by field (docs/semantics.md §1.2, §2)
    assert (DEFAULT.wave_rows, DEFAULT.tile_max_floor, DEFAULT.floor_value) == (32, "causal", -3e38)
    assert DEFAULT.mask_value == -math.inf and DEFAULT.m_init == -math.inf
    assert (DEFAULT.epilogue_guard, DEFAULT.p_cast, DEFAULT.p_saturate) == ("zero", "input", True)


def test_changed_lists_fields_in_order():
    s = Semantics(v_tail="cache", wave_rows=64, mask_value=-FLT_MAX, clamp_exp_diff=True)
    assert s.changed() == ("wave_rows", "mask_value", "clamp_exp_diff", "v_tail")
    assert s.describe() == ("wave_rows=64 mask_value=-3.4028234663852886e+38 "
                            "clamp_exp_diff=True v_tail='cache'")
    pol = Policy("row", "max", name="x", semantics=s)
    assert pol.semantic_fields == s.changed()
    # a floor value equal to the default is not a change; another one is
    assert Semantics(tile_max_floor="always").changed() == ("tile_max_floor",)
    assert Semantics(tile_max_floor="always", floor_value=-FLT_MAX).changed() == (
        "tile_max_floor", "floor_value")


@pytest.mark.parametrize("kw, exc, words", [
    (dict(wave_rows=48), ValueError, "wave_rows"),
    (dict(wave_rows=32.0), TypeError, "wave_rows"),
    (dict(wave_rows=True), TypeError, "wave_rows"),
    (dict(o_gate="warp"), ValueError, "o_gate"),
    (dict(o_gate=1), TypeError, "o_gate"),
    (dict(mask_value=math.nan), ValueError, "mask_value"),
    (dict(mask_value=0.0), ValueError, "mask_value"),
    (dict(mask_value=math.inf), ValueError, "mask_value"),
    (dict(mask_value="-inf"), TypeError, "mask_value"),
    (dict(m_init=5.0), ValueError, "m_init"),
    (dict(m_init=None), TypeError, "m_init"),
    (dict(mask_domain="log2"), ValueError, "mask_domain"),
    (dict(tile_max_floor="sometimes"), ValueError, "tile_max_floor"),
    (dict(tile_max_floor=True), TypeError, "tile_max_floor"),
    (dict(floor_value=-math.inf), ValueError, "floor_value"),
    (dict(floor_value=1.0), ValueError, "floor_value"),
    (dict(tile_max_floor="never", floor_value=-1e30), ValueError, "floor_value"),
    (dict(empty_row_guard="zero"), ValueError, "empty_row_guard"),
    (dict(epilogue_guard="nan"), ValueError, "epilogue_guard"),
    (dict(clamp_exp_diff=1), TypeError, "clamp_exp_diff"),
    (dict(p_cast="fp8"), ValueError, "p_cast"),
    (dict(p_saturate="yes"), TypeError, "p_saturate"),
    (dict(max_lag=0), TypeError, "max_lag"),
    (dict(block_n=0), ValueError, "block_n"),
    (dict(block_n=64.0), TypeError, "block_n"),
    (dict(kv_order="reverse"), ValueError, "kv_order"),
    (dict(v_tail="nan"), ValueError, "v_tail"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(softcap=50.0, q_prescale=True), ValueError, "softcap"),
    (dict(softcap_form="fast"), ValueError, "softcap_form"),
    (dict(exp_floor=0.0), ValueError, "exp_floor"),
    (dict(exp_floor="x"), TypeError, "exp_floor"),
    (dict(mask_stage="after"), ValueError, "mask_stage"),
    (dict(p_before_vote=1), TypeError, "p_before_vote"),
    (dict(kv_split=0), ValueError, "kv_split"),
    (dict(kv_split=2.0), TypeError, "kv_split"),
    (dict(merge_empty="zero"), ValueError, "merge_empty"),
    (dict(lse_base=2), TypeError, "lse_base"),
])
def test_bad_semantics_name_the_field(kw, exc, words):
    with pytest.raises(exc, match=words):
        Semantics(**kw)


def test_choices_list_every_fixed_field_with_its_default():
    c = choices()
    free = {"mask_value", "m_init", "floor_value", "block_n", "fixed_max", "l_floor",
            "softcap", "exp_floor", "kv_split"}
    assert list(c) == [f.name for f in dataclasses.fields(Semantics) if f.name not in free]
    assert c["o_gate"] == ("always", "row", "wave") and c["clamp_exp_diff"] == (False, True)
    assert c["wave_rows"] == (16, 32, 64) and "e4m3" in c["p_cast"]
    for name, values in c.items():
        assert getattr(DEFAULT, name) in values, name
        for value in values:                         # every listed choice is accepted
            assert getattr(Semantics(**{name: value}), name) == value
    c["o_gate"] = ()                                 # a fresh dict each call
    assert choices()["o_gate"] == ("always", "row", "wave")


def test_a_policy_takes_only_a_semantics_value():
    with pytest.raises(TypeError, match="semantics"):
        Policy("wave", "max", name="x", semantics={"o_gate": "row"})
    assert Semantics(floor_value=-1e30, tile_max_floor="always").floor_value == -1e30
    assert Semantics(floor_value=DEFAULT_FLOOR, tile_max_floor="never").changed() == (
        "tile_max_floor",)


def test_kernels_without_a_field_refuse_it_by_name():
    """Each family states the semantics fields it runs (Caps.semantics): the FlyDSL
    families run none, so each of their entry points refuses such a policy, naming every
    field; the online-softmax family runs them all."""
    from fa_lab import capabilities as C
    from fa_lab.kernels import FAMILIES

    zoo = Policy("row", "max", threshold=4.0, name="zoo_pol",
                 semantics=Semantics(o_gate="wave", p_cast="e4m3"))
    for fam in ("swp_bf16", "swp_fp8", "generic", "swa"):
        for kind in FAMILIES[fam].implementations:
            why = C.semantics_refusal(FAMILIES[fam].caps(kind), zoo, f"the {kind} {fam} kernel")
            assert why is not None and "field(s) o_gate, p_cast," in why, (fam, kind)
            assert f"the {kind} {fam} kernel cannot run policy 'zoo_pol'" in why
        with pytest.raises(ValueError, match=r"o_gate, p_cast.*kernel='online'"):
            C.check_semantics(zoo, FAMILIES[fam], "model")
    assert C.semantics_refusal(FAMILIES["online"].caps("model"), zoo, "x") is None
    # a family that runs some of the fields names only the rest
    part = C.Caps(frozenset(), (64,), frozenset(), frozenset({"row"}), frozenset({"max"}),
                  semantics=frozenset({"o_gate"}))
    assert "field(s) p_cast," in C.semantics_refusal(part, zoo, "k")
    # the Triton kernels' own guard (check_policy) refuses it by name too
    with pytest.raises(ValueError, match="faithful swp_bf16 kernel cannot run .*o_gate, p_cast"):
        C.check_policy(zoo, FAMILIES["swp_bf16"], "faithful")
    # resolving no longer refuses (routing does, by family); the defaults pass everywhere
    assert P.resolve(fp8=False, seqlen_kv=1024, rescale=zoo) == zoo
    assert P.resolve(fp8=False, seqlen_kv=1024, rescale="lazy") == P.get("lazy")
    assert P.get("lazy").codes == P.Codes(1, 0, 8.0, 0.0, 0.0)


def test_block_n_is_bounded_to_a_kernels_tile():
    """A huge block_n is refused naming the field and the bound, not run into an
    allocation of rows x block_n scores (issue 36's probe: 10**9)."""
    with pytest.raises(ValueError, match=r"^block_n must be in 1 \.\. \d+ .*got 1000000000"):
        Semantics(block_n=10**9)
    from fa_lab.semantics import MAX_BLOCK_N

    for n in (MAX_BLOCK_N + 1, 10**9):
        with pytest.raises(ValueError, match=rf"^block_n must be in 1 \.\. {MAX_BLOCK_N}.*got {n}"):
            Semantics(block_n=n)
    assert Semantics(block_n=MAX_BLOCK_N).block_n == MAX_BLOCK_N
    assert Semantics(block_n=512).block_n == 512     # CPU flash attention's (the zoo's)
