"""Policies as data: the Policy value, resolution against a call, the registry, rules
written in Python (bit-identical to the built-ins they spell out), and upstream versions."""

import dataclasses
import math
from pathlib import Path

import pytest
import torch

import fa_lab
from fa_lab import Policy, policies as P, upstream
from fa_lab.studies.experiments import bf16_inputs, fp8_inputs


def r(**kw):
    base = dict(fp8=False, seqlen_kv=8192)
    base.update(kw)
    return P.resolve(**base)


def test_builtins_are_registered_values():
    assert P.BUILTIN_NAMES == ("eager", "lazy", "lazy_unfixed", "lazy_capped", "fa4_row")
    fields = {p.name: (p.vote, p.rebase) for p in P.registered() if p.name in P.BUILTIN_NAMES}
    assert fields == {"eager": ("tile", "max"), "lazy": ("wave", "max"),
                      "lazy_unfixed": ("wave", "tile"), "lazy_capped": ("wave", "capped"),
                      "fa4_row": ("row", "max")}
    assert P.get("lazy_capped").rebase_bound == 16.0
    colors = [p.color for p in P.registered()]
    assert all(colors) and len(set(colors)) == len(colors)
    # the one encoding the kernels read: indices into VOTES and REBASES
    assert P.get("lazy_unfixed").codes == P.Codes(1, 1, 8.0, 0.0, 0.0)
    assert P.get("fa4_row").codes.vote == 2 and not P.get("eager").codes.lazy


def test_defaults_follow_upstream_flag():
    assert r() == P.get("lazy")
    assert r(dualwave_swp_lazy_rescale=False) == P.get("eager")
    assert r(rescale="lazy_unfixed", rescale_threshold=4).threshold == 4.0
    assert r(rescale=Policy(vote="wave", rebase="max", threshold=6, name="lazy6")).threshold == 6.0


def test_fp8_options():
    assert r(fp8=True, rescale="lazy_capped").rebase_bound == 16.0
    assert r(fp8=True, rescale="lazy_capped", rebase_bound=32).rebase_bound == 32.0
    assert r(fp8=True, rescale_threshold="by_kv_len", seqlen_kv=4096).threshold == 6.0
    assert r(fp8=True, rescale_threshold="by_kv_len", seqlen_kv=4097).threshold == 4.0
    lazy = r(fp8=True, p_headroom=True)
    assert lazy.p_headroom == pytest.approx(math.log2(448) - 8)
    eager = r(fp8=True, rescale="eager", p_headroom=True)
    assert eager.p_headroom == pytest.approx(math.log2(448))
    assert r(fp8=True, p_headroom=False).p_headroom == 0.0
    assert r(fp8=True, p_headroom=2.5).p_headroom == 2.5
    # bf16 models run a capped rebase too now that it is a field
    assert r(rescale="lazy_capped").rebase == "capped"


@pytest.mark.parametrize("kw, exc, words", [
    (dict(rescale="sometimes"), ValueError, "rescale"),
    (dict(rescale=3), TypeError, "rescale"),
    (dict(rescale="lazy", dualwave_swp_lazy_rescale=False), ValueError, "dualwave_swp_lazy_rescale"),
    (dict(dualwave_swp_lazy_rescale="yes"), TypeError, "dualwave_swp_lazy_rescale"),
    (dict(rescale_threshold=-1.0), ValueError, "rescale_threshold"),
    (dict(rescale_threshold=math.nan), ValueError, "rescale_threshold"),
    (dict(rescale_threshold="8"), ValueError, "rescale_threshold"),
    (dict(rescale_threshold="by_kv_len"), ValueError, "rescale_threshold"),  # fp8 rule only
    (dict(rescale="eager", rescale_threshold=8.0), ValueError, "rescale_threshold"),
    (dict(rebase_bound=16), ValueError, "rebase_bound"),
    (dict(fp8=True, rescale="lazy_capped", rebase_bound=-2), ValueError, "rebase_bound"),
    (dict(fp8=True, rescale="lazy", rebase_bound=16), ValueError, "rebase_bound"),
    (dict(p_headroom=True), ValueError, "p_headroom"),
    (dict(fp8=True, p_headroom=-1.0), ValueError, "p_headroom"),
    (dict(fp8=True, p_headroom="on"), TypeError, "p_headroom"),
])
def test_bad_policy_arguments(kw, exc, words):
    with pytest.raises(exc, match=words):
        r(**kw)


def test_a_headroom_past_e4m3s_range_warns():
    with pytest.warns(UserWarning, match="p_headroom=100.0 exceeds log2"):
        r(fp8=True, p_headroom=100.0)


@pytest.mark.parametrize("kw, exc, words", [
    (dict(vote="ballot"), ValueError, "vote"),
    (dict(rebase="min"), ValueError, "rebase"),
    (dict(rebase="capped"), TypeError, "rebase_bound"),
    (dict(rebase="capped", rebase_bound=-1.0), ValueError, "rebase_bound"),
    (dict(rebase_bound=4.0), ValueError, "rebase_bound"),
    (dict(threshold=-1), ValueError, "threshold"),
    (dict(threshold="8"), TypeError, "threshold"),
    (dict(name=""), ValueError, "name"),
    (dict(name="a,b"), ValueError, "name"),
    (dict(color="red"), ValueError, "color"),
    (dict(rule=3, vote=None, rebase=None), TypeError, "rule"),
    (dict(rule=lambda m, mt, t: m), ValueError, "vote"),
])
def test_bad_policy_fields(kw, exc, words):
    with pytest.raises(exc, match=words):
        Policy(**kw)


def test_register_gives_a_colour_and_refuses_clashes():
    mine = Policy(vote="wave", rebase="max", threshold=6, name="test_lazy6")
    try:
        got = P.register(mine)
        assert got.color is not None and got.color not in {P.get(n).color for n in P.BUILTIN_NAMES}
        assert "test_lazy6" in P.names() and P.color("test_lazy6") == got.color
        with pytest.raises(ValueError, match="already registered"):
            P.register(mine)
        with pytest.raises(ValueError, match="built-in"):
            P.register(dataclasses.replace(mine, name="lazy"), replace=True)
        with pytest.raises(TypeError, match="policy"):
            P.register("lazy6")
        with pytest.raises(ValueError, match="built-in"):
            P.unregister("eager")
    finally:
        P.unregister("test_lazy6")
    assert "test_lazy6" not in P.names()


# The built-ins spelled out as Python rules over one wave's rows [..., 32]: docs/semantics.md
# §9's own ``make_rule`` (this also holds the document's example to the models).
def _doc_make_rule():
    text = (Path(__file__).resolve().parents[2] / "docs" / "semantics.md").read_text()
    block = text.split("that reproduces the declarative fields:")[1].split("```python")[1].split("```")[0]
    ns = {}
    exec(compile(block, "docs/semantics.md §9", "exec"), ns)
    return ns["make_rule"]


make_rule = _doc_make_rule()
RULES = {name: make_rule(P.get(name).vote, P.get(name).rebase, P.get(name).rebase_bound)
         for name in ("eager", "lazy", "lazy_unfixed", "fa4_row", "lazy_capped")}
# A rule records the rows that moved as its vote; eager's built-in records no vote at all.
NUMERIC = ["m", "mt", "corr", "l", "o_finite", "l_finite"]


def _same(a, b):
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(
        torch.nan_to_num(a.float(), 7.0), torch.nan_to_num(b.float(), 7.0))


@pytest.mark.parametrize("name", ["eager", "lazy", "lazy_unfixed", "fa4_row", "lazy_capped"])
def test_builtins_as_rules_are_bit_identical_bf16(name):
    q, k, v = bf16_inputs(1, 1024, 2, 64, 32.0, seed=1)
    rule = Policy.from_rule(RULES[name], name=f"rule_{name}")
    kw = dict(causal=False, backend="emulator")
    a = fa_lab.flash_attn_func(q, k, v, rescale=name, return_lse=True, **kw)
    b = fa_lab.flash_attn_func(q, k, v, rescale=rule, return_lse=True, **kw)
    assert _same(a[0], b[0]) and _same(a[1], b[1])
    if name == "lazy_unfixed":
        assert torch.isnan(a[0]).any()  # the comparison covers the failure itself
    rows = list(range(0, 1024, 37))
    ta = fa_lab.trace(q, k, v, rows=rows, head=1, rescale=name, **kw)
    tb = fa_lab.trace(q, k, v, rows=rows, head=1, rescale=rule, **kw)
    cols = NUMERIC + ([] if name == "eager" else ["fire", "swept"])
    for c in cols:
        x, y = ta.steps[c].to_numpy(), tb.steps[c].to_numpy()
        assert ((x == y) | ((x != x) & (y != y))).all(), c


@pytest.mark.parametrize("name", ["eager", "lazy", "lazy_unfixed", "lazy_capped"])
def test_builtins_as_rules_are_bit_identical_fp8(name):
    (q8, k8, v8), (qd, kd, vd) = fp8_inputs(1, 1024, 2, 2000.0, seed=0)
    rule = Policy.from_rule(RULES[name], name=f"rule_{name}")
    kw = dict(q_descale=qd, k_descale=kd, v_descale=vd, causal=False, backend="emulator",
              return_lse=True)
    a = fa_lab.flash_attn_func(q8, k8, v8, rescale=name, **kw)
    b = fa_lab.flash_attn_func(q8, k8, v8, rescale=rule, **kw)
    assert _same(a[0], b[0]) and _same(a[1], b[1])


def _planted():
    """bf16 q, k, v [1, 512, 2, 64] whose scores are all 0 but one: query row 300 of head 1
    against key 197 (KV tile 3, inside the lazy loop of tiles 1 .. 4), 4 * 4 * 64 / 8 =
    128 natural units, 128 * log2(e) ~ 185 log2 units."""
    q = torch.zeros(1, 512, 2, 64, dtype=torch.bfloat16)
    k = torch.zeros_like(q)
    v = torch.randn(1, 512, 2, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    q[0, 300, 1] = 4.0
    k[0, 3 * 64 + 5, 1] = 4.0
    return q, k, v


def _run(rule, name="mine", fp8=False):
    pol = Policy.from_rule(rule, name=name)
    if fp8:
        (q8, k8, v8), (qd, kd, vd) = fp8_inputs(1, 512, 1, 2000.0, seed=0)
        return fa_lab.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                      causal=False, rescale=pol, backend="emulator")
    return fa_lab.flash_attn_func(*_planted(), causal=False, rescale=pol, backend="emulator")


def test_a_rule_that_raises_is_named_with_where_it_raised():
    from fa_lab import RuleError

    def far(m, mt, thr):        # raises on the one planted score only
        if (mt - m > 100).any():
            raise KeyError("too far")
        return torch.maximum(m, mt)

    with pytest.raises(RuleError) as e:
        _run(far, "far")
    assert isinstance(e.value, RuntimeError) and isinstance(e.value.__cause__, KeyError)
    assert str(e.value) == ("policy 'far': its rule raised KeyError at KV tile 3, on query rows "
                            "288-319 of batch 0, head 1 (called again on each 32-row wave alone, "
                            "it raised first there): 'too far'")
    # a rule that fails on the whole step only: the step and the rows it saw at once
    with pytest.raises(RuleError, match=r"^policy 'whole': its rule raised ZeroDivisionError at "
                       r"KV tile 1, on query rows 0-511 of every batch and head at once \(m "
                       r"shaped \(1, 2, 1, 16, 32\); on no one wave alone\)") as e:
        _run(lambda m, mt, thr: m if m.numel() == 32 else 1 / 0, "whole")
    assert isinstance(e.value.__cause__, ZeroDivisionError)

    def boom(m, mt, thr):
        raise ValueError("boom")

    with pytest.raises(RuleError, match=r"^policy 'boom': its rule raised ValueError at KV tiles "
                       r"0-1 \(step 0\), on query rows 0-31 of batch 0, head 0 .*: boom$"):
        _run(boom, "boom", fp8=True)


def test_a_rule_that_makes_m_non_finite_is_refused():
    nan, inf = math.nan, math.inf
    where = "for query row 300 of batch 0, head 1 at KV tile 3, where m = 0.0 and mt = 185.0"
    for rule, got in ((lambda m, mt, thr: torch.where(mt > 100, torch.full_like(m, nan), m), nan),
                      (lambda m, mt, thr: torch.where(mt > 100, m - inf, m), -inf),
                      (lambda m, mt, thr: torch.where(mt > 100, mt + inf, m), inf)):
        with pytest.raises(ValueError) as e:
            _run(rule, "nonfinite")
        assert str(e.value).startswith(f"policy 'nonfinite': its rule returned m_new = {got} "
                                       f"{where}; a rule's m_new must be finite")
    # fp8: every row starts at m = -inf. Arithmetic on it that makes NaN is the rule's, and
    # keeping -inf past a tile pair with a finite max makes every P of the row infinite
    with pytest.raises(ValueError, match=r"^policy 'nan_from_inf': its rule returned m_new = nan "
                       r"for query row 0 of batch 0, head 0 at KV tiles 0-1 \(step 0\), where "
                       r"m = -inf and mt = [0-9.]+, and 511 more"):
        _run(lambda m, mt, thr: m + (mt - m) * 0, "nan_from_inf", fp8=True)
    with pytest.raises(ValueError, match=r"^policy 'keep_inf': its rule returned m_new = -inf"):
        _run(lambda m, mt, thr: m, "keep_inf", fp8=True)


def test_a_rule_may_pass_its_inputs_own_nan_through():
    q, k, v = _planted()
    kw = dict(causal=False, backend="emulator")
    to_tile = Policy.from_rule(lambda m, mt, thr: mt, name="to_tile")   # returns mt's NaN
    clean = ~torch.isfinite(fa_lab.flash_attn_func(q, k, v, rescale=to_tile, **kw)).all(-1)
    q[0, 100, 0, 7] = math.nan                   # row 100 of head 0: NaN scores, NaN m and mt
    bad = ~torch.isfinite(fa_lab.flash_attn_func(q, k, v, rescale=to_tile, **kw)).all(-1)
    assert not clean[0, 100, 0]
    clean[0, 100, 0] = True                      # that row, as its input made it, and no other
    assert torch.equal(bad, clean)


@pytest.mark.parametrize("rule, words", [
    (lambda m, mt, thr: m[..., 0], "shape (1, 2, 1, 16)"),
    (lambda m, mt, thr: m.double(), "dtype torch.float64"),
    (lambda m, mt, thr: m.to(torch.bfloat16), "dtype torch.bfloat16"),
    (lambda m, mt, thr: 3.0, "a float"),
    (lambda m, mt, thr: m.numpy(), "a ndarray"),
])
def test_rule_must_return_a_tensor_like_m(rule, words):
    with pytest.raises(ValueError) as e:
        _run(rule, "bad_rule")
    assert str(e.value).startswith(f"policy 'bad_rule': its rule returned {words} at KV tile 1; "
                                   "expected a torch.float32 tensor shaped like m, "
                                   "(1, 2, 1, 16, 32), on cpu")


def test_a_user_rule_changes_what_it_should():
    # "wave vote, but never rebase down by more than 16": the seed's proposal in bf16
    def capped16(m, mt, thr):
        fire = (~((mt - m) <= thr)).any(-1, keepdim=True)
        return torch.where(fire & (mt >= m - 16), mt, m)

    q, k, v = bf16_inputs(1, 2048, 2, 128, 32.0, seed=0)
    mine = Policy.from_rule(capped16, name="capped16")
    out = {p: fa_lab.flash_attn_func(q, k, v, causal=False, rescale=p, backend="emulator")
           for p in ("lazy_unfixed", mine)}
    assert torch.isnan(out["lazy_unfixed"]).any()
    assert torch.isfinite(out[mine]).all()


# Upstream versions (issue 16)
def test_upstream_versions_are_data():
    assert set(upstream.VERSIONS) >= {"main-11c4174d", "fixed"}
    assert upstream.current() == "fixed"
    with fa_lab.using_upstream("main-11c4174d") as v:
        assert upstream.current() == "main-11c4174d" and v.bf16_lazy == "lazy_unfixed"
    assert upstream.current() == "fixed"
    with pytest.raises(ValueError, match="upstream"):
        fa_lab.set_upstream("v0.1")
    with pytest.raises(TypeError, match="upstream"):
        fa_lab.set_upstream(3)


def _eq(a, b):
    return all(_same(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("backend", ["emulator", "interpret"])
def test_fixed_fp8_defaults_are_pr1020(backend):
    (q8, k8, v8), (qd, kd, vd) = fp8_inputs(1, 512, 1, 2000.0, seed=0)
    kw = dict(q_descale=qd, k_descale=kd, v_descale=vd, causal=False, backend=backend,
              return_lse=True)
    bare = fa_lab.flash_attn_func(q8, k8, v8, **kw)
    spelled = fa_lab.flash_attn_func(q8, k8, v8, rescale="lazy", rescale_threshold="by_kv_len",
                                     p_headroom=True, **kw)
    assert _eq(bare, spelled)
    assert fa_lab.trace(q8, k8, v8, rows=[0], **{k: x for k, x in kw.items() if k != "return_lse"}
                        ).meta["upstream"] == "fixed"


@pytest.mark.slow
def test_pr1020_normalisation_holds_with_defaults():
    # upstream's own #1020 test: V = ones, S 12288, K x200; eager max |o - 1| < 0.05.
    # One head of it here (the criterion is per element).
    torch.manual_seed(0)
    S, D = 12288, 128
    q = torch.randn(1, S, 1, D)
    k = torch.randn(1, S, 1, D) * 200
    v = torch.ones(1, S, 1, D)
    from fa_lab.studies.experiments import quantize_e4m3
    (q8, qd), (k8, kd), (v8, vd) = (quantize_e4m3(t) for t in (q, k, v))
    out = fa_lab.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                 causal=False, dualwave_swp_lazy_rescale=False, backend="emulator")
    assert (out.float() - 1).abs().max() < 0.05


@pytest.mark.parametrize("backend", ["emulator", "interpret"])
def test_main_11c4174d_defaults(backend):
    q, k, v = bf16_inputs(1, 512, 1, 64, 64.0, seed=0)
    kw = dict(causal=False, backend=backend, return_lse=True)
    bare = fa_lab.flash_attn_func(q, k, v, upstream="main-11c4174d", **kw)
    assert _eq(bare, fa_lab.flash_attn_func(q, k, v, rescale="lazy_unfixed", **kw))
    assert not _eq(bare, fa_lab.flash_attn_func(q, k, v, **kw))  # "fixed" differs here
    (q8, k8, v8), (qd, kd, vd) = fp8_inputs(1, 512, 1, 5000.0, seed=0)
    kw8 = dict(kw, q_descale=qd, k_descale=kd, v_descale=vd)
    with fa_lab.using_upstream("main-11c4174d"):
        flag_off = fa_lab.flash_attn_func(q8, k8, v8, dualwave_swp_lazy_rescale=False, **kw8)
        assert _eq(flag_off, fa_lab.flash_attn_func(q8, k8, v8, rescale="lazy_unfixed", **kw8))
    # explicit arguments still override the version's defaults
    assert _eq(fa_lab.flash_attn_func(q, k, v, upstream="main-11c4174d", rescale="lazy", **kw),
               fa_lab.flash_attn_func(q, k, v, rescale="lazy", **kw))


def test_a_calls_resolution_is_cached_by_what_it_depends_on():
    """Request.resolve gives what resolve() gives, from a cache keyed by type as well as value
    (a headroom of True, PR #1020's lift, and of 1, one log2 unit, are equal in Python) and
    by the Policy object (a name registered anew resolves anew)."""
    from fa_lab import policies
    from fa_lab.policies import Request, resolve

    lazy = policies.get("lazy")
    for kw in (dict(p_headroom=True), dict(p_headroom=1), dict(rescale_threshold=6),
               dict(rescale_threshold="by_kv_len")):
        got = Request(rescale="lazy", **kw).resolve(fp8=True, seqlen_kv=8192, default=lazy)
        want = resolve(fp8=True, seqlen_kv=8192, rescale="lazy", **kw)
        assert got == want, kw
    lift = Request(rescale="lazy", p_headroom=True).resolve(fp8=True, seqlen_kv=64, default=lazy)
    one = Request(rescale="lazy", p_headroom=1).resolve(fp8=True, seqlen_kv=64, default=lazy)
    assert lift.p_headroom != one.p_headroom == 1.0
    policies.register(Policy("wave", "max", threshold=5.0, name="cache_probe"))
    try:
        first = Request(rescale="cache_probe").resolve(fp8=False, seqlen_kv=64, default=lazy)
        policies.register(Policy("wave", "max", threshold=7.0, name="cache_probe"), replace=True)
        again = Request(rescale="cache_probe").resolve(fp8=False, seqlen_kv=64, default=lazy)
        assert (first.threshold, again.threshold) == (5.0, 7.0)
    finally:
        policies.unregister("cache_probe")
