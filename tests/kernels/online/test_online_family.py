"""The online-softmax family through fa_lab's call path: a policy with semantics of its own
routes there, ``kernel="online"`` forces it, dispatch hands it what it hands every family
(causal, the policy, a recorder, the bias as an additive mask, fp8 descales), and what it
cannot do is refused by name."""

import math

import pytest
import torch

import fa_lab
from fa_lab import api, dispatch, policies, reference
from fa_lab.counters import RescaleCounter
from fa_lab.kernels import FAMILIES
from fa_lab.kernels.online import model
from fa_lab.numerics import e4m3
from fa_lab.zoo import ENTRIES

BF = torch.bfloat16


def qkv(Sq=96, Skv=320, H=2, Hkv=1, D=64, seed=0, dtype=BF, k_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, Sq, H, D, generator=g).to(dtype)
    k = (torch.randn(1, Skv, Hkv, D, generator=g) * k_scale).to(dtype)
    v = torch.randn(1, Skv, Hkv, D, generator=g).to(dtype)
    return q, k, v


def test_the_family_is_registered_with_every_semantics_field():
    fam = FAMILIES["online"]
    caps = fam.caps("model")
    assert fam.routed and not fam.upstream and list(fam.implementations) == ["model"]
    assert caps.semantics == frozenset(f for f in fa_lab.semantics.Semantics.__dataclass_fields__)
    assert caps.headroom_any_dtype and not caps.rules
    assert {"bias", "varlen", "trace"} == set(caps.features)
    assert ("online", "emulator") in dispatch.TABLE and "online" in dispatch.ROUTED
    assert not any(FAMILIES[f].caps(k).semantics for f in ("swp_bf16", "swp_fp8", "generic", "swa")
                   for k in FAMILIES[f].implementations)


@pytest.mark.parametrize("name", ["trtllm_neg_inf:before", "fa4_fp8_saturation:after",
                                  "ffpa_vote_nan:before"])
def test_a_policy_with_semantics_routes_to_the_online_family(name):
    q, k, v = qkv()
    for causal in (False, True):
        p = api.plan(q, k, v, rescale=name, causal=causal)
        assert p.family == "online" and p.backend == "emulator"
        assert p.call.policy == policies.get(name)  # resolved as it is: numbers already
    # the built-ins keep upstream's routing; kernel="online" runs them there
    assert api.plan(q, k, v, rescale="lazy").family == "swp_bf16"
    assert api.plan(q[:, :32], k, v, rescale=None).family == "generic"
    assert api.plan(q, k, v, rescale="lazy", kernel="online").family == "online"
    assert api.plan(q, k, v, kernel="online").call.policy == policies.get("lazy")


def test_the_call_path_runs_the_model_bit_for_bit():
    """flash_attn_func with a preset equals the model called directly; a bias is the
    model's additive mask (-inf = masked), and a masked column takes the policy's
    mask_value (the TensorRT-LLM preset's -FLT_MAX), not the bias's -inf."""
    q, k, v = qkv(Sq=70, Skv=200)
    bias = torch.zeros(70, 200)
    bias[:, 150:] = -math.inf
    bias[3, :] = -math.inf                                  # row 3 sees nothing
    bias[5] = torch.linspace(-2, 2, 200)
    bias = bias.to(BF)
    for name in ("trtllm_neg_inf:before", "trtllm_neg_inf:after", "fa4_fp8_saturation:before"):
        pol = policies.get(name)
        out, lse = fa_lab.flash_attn_func(q, k, v, causal=False, bias=bias, rescale=name,
                                          return_lse=True)
        mo, ml = model.forward(q, k, v, policy=pol, causal=False, mask=bias)
        assert torch.equal(out, mo) and torch.equal(lse, ml)
    kw = dict(causal=False, bias=bias)
    before = fa_lab.flash_attn_func(q, k, v, rescale="trtllm_neg_inf:before", **kw)
    after = fa_lab.flash_attn_func(q, k, v, rescale="trtllm_neg_inf:after", **kw)
    # row 3: every column masked at -FLT_MAX weighs 1 before the fix: its output is the
    # mean over the 256 columns of its four 64-column tiles, 200 real V rows and 56
    # zero-filled ones past Skv; 0 after
    mean_v = v[0, :, 0].double().sum(0) / 256
    assert torch.allclose(before[0, 3, 0].double(), mean_v, atol=4e-3)
    assert torch.equal(after[0, 3], torch.zeros_like(after[0, 3]))
    ref, _ = reference.attention(q, k, v, causal=False, bias=bias)
    ok = [r for r in range(70) if r != 3]
    assert (after[0, ok].float() - ref[0, ok].float()).abs().max() < 1e-2


def test_fp8_inputs_fold_their_descales():
    """e4m3 inputs with descales give the model's answer on the dequantised values up to
    the roundings of c; the preset's own e4m3 P cast applies."""
    g = torch.Generator().manual_seed(3)
    x = [torch.randn(1, 140, 1, 128, generator=g) * s for s in (0.5, 2.0, 1.0)]
    ds = [float(t.abs().max()) / 448 for t in x]
    q8, k8, v8 = (e4m3(t / d).to(torch.float8_e4m3fn) for t, d in zip(x, ds))
    name = "fa4_fp8_saturation:after"
    out = fa_lab.flash_attn_func(q8, k8, v8, q_descale=ds[0], k_descale=ds[1], v_descale=ds[2],
                                 causal=False, rescale=name)
    assert out.dtype == BF and api.plan(q8, k8, v8, q_descale=1.0, k_descale=1.0, v_descale=1.0,
                                        rescale=name).family == "online"
    deq = [t.float() * d for t, d in zip((q8, k8, v8), ds)]
    ref, _ = reference.attention(*deq, causal=False, dtype=torch.float64)
    assert (out.double() - ref).abs().max() < 0.05 * ref.abs().max()
    # FA4's stale max, in e4m3 inputs: the first visited tile (columns 128..139) peaks at
    # 0, tile 0 then peaks 24 * c = 3.06 log2 units higher, within the threshold 4, so its
    # P is 2^11.06 > 448. The preset's cast saturates it; fp8_saturate=False turns the
    # clamp off and e4m3 has no inf: NaN.
    q8 = torch.zeros(1, 1, 1, 128)
    q8[..., 0] = 1.0
    k8 = torch.zeros(1, 140, 1, 128)
    k8[0, 5, 0, 0] = 24.0
    v8 = torch.ones(1, 140, 1, 128)
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q8, k8, v8))
    kw = dict(q_descale=1.0, k_descale=1.0, v_descale=1.0, causal=False,
              rescale="fa4_fp8_saturation:before")
    recs: list = []
    model.forward(q8, k8, v8, policy=policies.get(kw["rescale"]), q_descale=1.0, k_descale=1.0,
                  v_descale=1.0, record=recs)
    assert [int(r.saturated[0, 0, 0]) for r in recs] == [0, 1]
    jump = 24 / math.sqrt(128) * math.log2(math.e)
    assert float(recs[1].p_max[0, 0, 0]) == pytest.approx(2.0 ** (8 + jump), rel=1e-6)
    sat = fa_lab.flash_attn_func(q8, k8, v8, **kw)
    nosat = fa_lab.flash_attn_func(q8, k8, v8, fp8_saturate=False, **kw)
    assert torch.isfinite(sat.float()).all() and torch.isnan(nosat.float()).all()


def test_what_the_family_lacks_is_refused_by_name():
    q, k, v = qkv()
    name = "sdpa_masked_row:before"
    with pytest.raises(ValueError, match="has no online kernel"):
        fa_lab.flash_attn_func(q, k, v, rescale=name, backend="interpret")
    with pytest.raises(ValueError, match="sink not supported by the online kernel"):
        fa_lab.flash_attn_func(q, k, v, rescale=name, sink=torch.zeros(2))
    with pytest.raises(ValueError, match="alibi_slopes not supported by the online kernel"):
        fa_lab.flash_attn_func(q, k, v, rescale=name, alibi_slopes=torch.zeros(2))
    with pytest.raises(ValueError, match="num_kv_splits not supported by the online kernel"):
        fa_lab.flash_attn_func(torch.cat([q] * 4, 1), k, v, rescale=name, num_kv_splits=2)
    # a FlyDSL kernel asked for by name refuses a preset, naming its fields
    with pytest.raises(ValueError, match=r"kernel='swp_bf16' has no rescale='sdpa_masked_row:"
                                         r"before'.*tile_max_floor, epilogue_guard.*'online'"):
        fa_lab.flash_attn_func(q, k, v, rescale=name, kernel="swp_bf16")
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in qkv(D=128))
    with pytest.raises(ValueError, match="tile_max_floor, epilogue_guard"):
        fa_lab.flash_attn_func(q8, k8, v8, q_descale=1.0, k_descale=1.0, v_descale=1.0,
                               rescale=name, kernel="swp_fp8")
    with pytest.raises(ValueError, match="Python rule"):
        fa_lab.flash_attn_func(q, k, v, kernel="online",
                               rescale=fa_lab.Policy.from_rule(lambda m, mt, t: m, name="r"))
    # PR #1020's lift (p_headroom=True) stays fp8's; a number lifts P on any dtype here
    with pytest.raises(ValueError, match="p_headroom applies to fp8"):
        fa_lab.flash_attn_func(q, k, v, kernel="online", rescale="lazy", p_headroom=True)
    p = api.plan(q, k, v, kernel="online", rescale="lazy", p_headroom=3.0)
    assert p.call.policy.p_headroom == 3.0
    with pytest.raises(ValueError, match="p_headroom applies to fp8"):
        api.plan(q, k, v, kernel="swp_bf16", rescale="lazy", p_headroom=3.0)


def test_varlen_runs_an_empty_sequence_under_the_policy():
    """aiter #5364's trigger through the varlen call: a sequence with no keys is NaN under
    the causal-only floor and 0 with the floor always (the varlen path no longer writes
    0 for it on the kernel's behalf)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(6, 1, 64, generator=g).to(BF)
    k = torch.randn(5, 1, 64, generator=g).to(BF)
    cu_q = torch.tensor([0, 3, 6], dtype=torch.int32)
    cu_k = torch.tensor([0, 0, 5], dtype=torch.int32)
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k, max_seqlen_q=3, max_seqlen_kv=5,
              causal=False, return_lse=True)
    bo, bl = fa_lab.flash_attn_func(q, k, k, rescale="flydsl_fp8_empty_tile:before", **kw)
    ao, al = fa_lab.flash_attn_func(q, k, k, rescale="flydsl_fp8_empty_tile:after", **kw)
    assert torch.isnan(bo[:3].float()).all() and torch.isnan(bl[0]).all()
    assert torch.equal(ao[:3], torch.zeros_like(ao[:3])) and (al[0] == -math.inf).all()
    # the second sequence is the same under both
    assert torch.equal(bo[3:], ao[3:]) and torch.equal(bl[1], al[1])
    ref, _ = reference.attention(q[None, 3:], k[None], k[None], causal=False)
    assert (ao[3:].float() - ref[0].float()).abs().max() < 0.05


def test_trace_and_counts_follow_the_online_model():
    """fa_lab.trace of a preset records the model's per-tile state: the FA4 row keeps its
    max (moved False, corr 1) while a tile beats it by less than the threshold, and the
    traced m and l are the model's TileRecords."""
    q, k, v = qkv(Sq=4, Skv=256, H=1, D=64, seed=2)
    name = "fa4_fp8_saturation:before"
    tr = fa_lab.trace(q, k, v, rows=[0, 1, 2, 3], rescale=name, causal=False)
    recs: list = []
    out, lse = model.forward(q, k, v, policy=policies.get(name), causal=False, record=recs)
    assert tr.kernel == "online" and tr.n_steps == len(recs) == 2
    for r in recs:
        steps = tr.steps[tr.steps.step == r.step].sort_values("lane")
        assert steps["m"].tolist() == r.m[0, 0].tolist()
        assert steps["mt"].tolist() == r.mt[0, 0].tolist()
        assert steps["l"].tolist() == r.l[0, 0].tolist()
        assert steps["corr"].tolist() == r.factor[0, 0].tolist()
        assert steps["fire"].tolist() == r.moved[0, 0].tolist()
    assert torch.equal(tr.out, out[0, :, 0].float())
    assert tr.lanes.lse.tolist() == lse[0, 0].tolist()
    # the counter reads the same steps; eager presets multiply O at every step
    counts = fa_lab.count_rescales(q, k, v, rescale="sdpa_masked_row:after", causal=False)
    assert counts["loop_wave_steps"] == 4 and counts["o_multiplies"] == 4  # 64-column tiles
    lazy = fa_lab.count_rescales(q, k, v, rescale=name, causal=False)
    c = RescaleCounter(policies.get(name))
    assert lazy["row_steps"] == 2 * 32 and c.eager is False


def test_every_preset_runs_through_flash_attn_func():
    q, k, v = qkv(Sq=40, Skv=300)
    for e in ENTRIES.values():
        for pol in e.policies().values():
            out = fa_lab.flash_attn_func(q, k, v, rescale=pol.name, causal=True)
            assert out.shape == q.shape and out.dtype == BF
