"""FlyDSL #1097 on the fp8 model (``fa_lab.kernels.swp_fp8.split``): head dims (D, Dv),
split-K and its combine, the LSE without the P headroom, varlen through
``flash_attn_func``; the raw-unit split maxima of aiter #4676's docstring; bad inputs."""

import math

import pytest
import torch

import fa_lab
from fa_lab import metrics, reference, upstream
from fa_lab.kernels.swp_fp8 import model, split
from fa_lab.numerics import LN2, bf16, f32
from fa_lab.policies import resolve
from fa_lab.studies.experiments import quantize_e4m3

FP8 = torch.float8_e4m3fn
H_LAZY = math.log2(448) - 6  # a lazy headroom (threshold 6), for the hand-computed combine


def fp8_case(Sq, Skv, D, Dv, H=1, Hkv=1, k_scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q8, qd = quantize_e4m3(torch.randn(1, Sq, H, D, generator=g))
    k8, kd = quantize_e4m3(k_scale * torch.randn(1, Skv, Hkv, D, generator=g))
    v8, vd = quantize_e4m3(torch.randn(1, Skv, Hkv, Dv, generator=g))
    return (q8, k8, v8), dict(q_descale=qd, k_descale=kd, v_descale=vd)


def policy(name="lazy", skv=512):
    return resolve(fp8=True, seqlen_kv=skv, rescale=name, p_headroom=True)


def run_split(inputs, ds, *, causal=False, name="lazy", **kw):
    return split.forward(*inputs, **ds, causal=causal, policy=policy(name, inputs[1].shape[1]), **kw)


def ref64(inputs, ds, causal):
    return reference.attention(*inputs, causal=causal, dtype=torch.float64, **ds)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D, Dv, splits", [(192, 128, 1), (192, 128, 3), (128, 128, 2),
                                           (128, 64, 1)])
@pytest.mark.parametrize("name", ["eager", "lazy"])
def test_matches_an_fp64_reference(causal, D, Dv, splits, name):
    inputs, ds = fp8_case(64, 1024, D, Dv, H=2, k_scale=4.0)
    # 16 tiles: every split holds tiles ((0, 8), (8, 16) or (0, 6), (6, 12), (12, 16))
    assert sum(t1 > t0 for t0, t1 in split.split_ranges(16, splits)) == splits
    out, lse = run_split(inputs, ds, causal=causal, name=name, num_kv_splits=splits)
    ref, ref_lse = ref64(inputs, ds, causal)
    assert out.shape == (1, 64, 2, Dv) and out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    # P is e4m3 (3 mantissa bits) and a split's partial O is bf16: a row's error averages out
    assert metrics.rel_l2(out, ref) < 3e-2
    assert (lse.double() - ref_lse).abs().max() < 2e-2


def test_one_split_at_d128_is_the_dense_model():
    """D = Dv = 128, one split: the dense model's outputs, bit for bit (the same walk, ls
    and epilogue); the LSEs differ only in where H leaves the sum (fp32 rounding)."""
    inputs, ds = fp8_case(64, 512, 128, 128, k_scale=4.0)
    pol = policy()
    a, la = split.forward(*inputs, **ds, causal=True, policy=pol)
    b, lb = model.forward(*inputs, **ds, causal=True, policy=pol)
    assert torch.equal(a, b)
    assert (la - lb).abs().max() < 1e-5


def test_the_model_hands_d192_and_splits_to_split():
    inputs, ds = fp8_case(32, 256, 192, 128)
    pol = policy()
    a = model.forward(*inputs, **ds, causal=False, policy=pol, num_kv_splits=2)
    b = split.forward(*inputs, **ds, causal=False, policy=pol, num_kv_splits=2)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ---- the combine, by hand ----------------------------------------------------------------

def _part(o, m, l):
    return (torch.tensor([[o, -o]]), torch.tensor([m]), torch.tensor([l]))


def test_combine_by_hand():
    """m (1, 3), l (2, 1), O (1, 5): w = (2**-2, 1), wl = (0.5, 1), den 1.5,
    out = (0.5 * 1 + 1 * 5) / 1.5 = 11/3, rounded to bf16; LSE = 3 ln 2 + ln 1.5 - H ln 2."""
    out, lse = split.combine([_part(1.0, 1.0, 2.0), _part(5.0, 3.0, 1.0)], headroom=H_LAZY)
    want = float(bf16(torch.tensor(11.0 / 3.0)))
    assert out.tolist() == [[want, -want]]
    assert want == 3.671875
    assert abs(float(lse) - (3 * math.log(2) + math.log(1.5) - H_LAZY * math.log(2))) < 1e-6


def test_combine_skips_empty_and_nan_splits():
    """An empty split (m -1e30, l 0) and a NaN l add nothing: the other split alone."""
    empty = split.empty_partial((1,), 2, "cpu")
    nan_l = _part(9.0, 0.0, float("nan"))
    out, lse = split.combine([empty, _part(2.0, 0.5, 4.0), nan_l], headroom=0.0)
    assert out.tolist() == [[2.0, -2.0]]
    assert abs(float(lse) - (0.5 * math.log(2) + math.log(4.0))) < 1e-6


def test_combine_of_nothing_is_zero_with_lse_minus_inf():
    e = split.empty_partial((1,), 2, "cpu")
    out, lse = split.combine([e, e], headroom=H_LAZY)
    assert out.tolist() == [[0.0, 0.0]] and float(lse) == -math.inf


def test_partial_stores_scaled_or_raw_maxima_and_a_bf16_o():
    m, l, O = torch.tensor([1000.0]), torch.tensor([3.0]), torch.tensor([[1.0, 2.0]])
    o, ms, ls_ = split.partial(m, l, O, ls=0.01, v_descale=0.7)
    assert float(ms) == float(torch.tensor(1000.0) * 0.01) and float(ls_) == 3.0
    assert torch.equal(o, bf16(O * (1 / 3.0) * f32(0.7)))
    assert float(split.partial(m, l, O, ls=0.01, v_descale=0.7, m_units="raw")[1]) == 1000.0


def test_a_nan_split_is_dropped_by_the_combine():
    """A NaN key makes its split's m, l and O NaN. Dense, every row is NaN; under split-K
    the combine takes only splits with l > 0, so the NaN split is skipped: the rows come
    out as the other splits' softmax (finite), and with no other split, 0 with LSE -inf."""
    (q, k, v), ds = fp8_case(32, 1024, 128, 128, seed=4)
    k = k.clone()
    k[0, 700, 0, 5] = float("nan")  # tiles 6-11: the second of splits (0, 6), (6, 12), (12, 16)
    dense, _ = run_split((q, k, v), ds)
    assert torch.isnan(dense.float()).all()
    out, lse = run_split((q, k, v), ds, num_kv_splits=4)
    assert torch.isfinite(out.float()).all() and torch.isfinite(lse).all()
    keep = torch.cat([torch.arange(0, 384), torch.arange(768, 1024)])
    ref, ref_lse = ref64((q, k[:, keep], v[:, keep]), ds, False)
    assert metrics.rel_l2(out, ref) < 3e-2  # the softmax over the two finite splits only
    (q, k, v), ds = fp8_case(32, 512, 128, 128, seed=4)
    k = k.clone()
    k[0, 100, 0, 5] = float("nan")  # 8 tiles, 2 splits: one split of all 8, one empty
    out, lse = run_split((q, k, v), ds, num_kv_splits=2)
    assert (out == 0).all() and (lse == -math.inf).all()


# ---- the unit contracts: aiter #4676's raw maxima, the LSE's headroom --------------------

def _spread_case():
    """Unit-variance q and k quantised to e4m3 (descales ~1e-2, ls ~1e-5) over 1024 keys
    (16 tiles; 4 splits cut them 6 + 6 + 4 + empty): every split holds keys of similar
    log2-unit scores, while the raw maxima of different splits are ~1e4-1e5 raw units apart."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 32, 1, 128, generator=g)
    k = torch.randn(1, 1024, 1, 128, generator=g)
    v = torch.randn(1, 1024, 1, 128, generator=g)
    (q8, qd), (k8, kd), (v8, vd) = (quantize_e4m3(x) for x in (q, k, v))
    return (q8, k8, v8), dict(q_descale=qd, k_descale=kd, v_descale=vd)


def test_raw_unit_maxima_drop_every_split_but_the_largest():
    inputs, ds = _spread_case()
    ref, _ = ref64(inputs, ds, False)
    good, _ = run_split(inputs, ds, num_kv_splits=4)
    bad, _ = run_split(inputs, ds, num_kv_splits=4, upstream="aiter-4676-raw-m")
    assert metrics.rel_l2(good, ref) < 3e-2
    assert metrics.rel_l2(bad, ref) > 0.3


def test_raw_unit_run_is_the_largest_splits_partial():
    """Every weight but the largest split's is exp2(-gap) = 0: the raw run's row is the
    bf16 partial of the split with the largest raw maximum, alone. (Eager, so that a
    split's stored m is its true maximum; a lazy split keeps a stale base up to THR / ls
    raw units below it.)"""
    inputs, ds = _spread_case()
    pol = policy("eager", skv=1024)
    q8, k8, v8 = inputs
    bad, _ = split.forward(*inputs, **ds, causal=False, policy=pol, num_kv_splits=4,
                           m_units="raw")
    ranges = [r for r in split.split_ranges(16, 4) if r[1] > r[0]]
    assert ranges == [(0, 6), (6, 12), (12, 16)]
    raw = q8.float()[0, :, 0] @ k8.float()[0, :, 0].T
    raw_max = torch.stack([raw[:, t0 * 64:t1 * 64].amax(-1) for t0, t1 in ranges])
    gaps = raw_max.amax(0) - raw_max
    assert float(gaps.sort(0).values[1].min()) > 200  # exp2(-200) is 0 in fp32
    ls = model.log2_scale(ds["q_descale"], ds["k_descale"], 128)
    # in log2 units the same gaps are under 4: each split's true weight is at least 1/16
    assert float(gaps.max()) * ls < 4
    best = raw_max.argmax(0)
    for s, (t0, t1) in enumerate(ranges):
        part, _ = split.forward(q8, k8[:, t0 * 64:t1 * 64], v8[:, t0 * 64:t1 * 64], **ds,
                                causal=False, policy=pol)
        rows = best == s
        assert rows.any()
        assert torch.equal(bad[0, rows], part[0, rows])


def test_lse_without_headroom_removal_is_h_ln2_higher():
    inputs, ds = fp8_case(32, 512, 192, 128, k_scale=4.0)
    ref_lse = ref64(inputs, ds, False)[1]
    for splits in (1, 2):
        _, with_h = run_split(inputs, ds, num_kv_splits=splits)
        _, without = run_split(inputs, ds, num_kv_splits=splits, lse_headroom=False)
        assert (with_h.double() - ref_lse).abs().max() < 2e-2
        h = policy(skv=512).p_headroom  # log2 448 - THR
        assert 0 < h < 3
        assert ((without - with_h).double() - h * math.log(2)).abs().max() < 1e-4


def test_versions_name_their_units():
    v = upstream.FP8_SPLIT_VERSIONS
    assert (v["flydsl-20a76439"].m_units, v["aiter-4676-raw-m"].m_units) == ("scaled", "raw")
    assert upstream.check_fp8_split(None).name == upstream.FP8_SPLIT_DEFAULT == "flydsl-20a76439"
    with pytest.raises(ValueError, match="upstream='nope' is not a known fp8 split-K version"):
        upstream.check_fp8_split("nope")
    with pytest.raises(TypeError, match="upstream must be"):
        upstream.check_fp8_split(3)


# ---- through flash_attn_func --------------------------------------------------------------

def test_flash_attn_func_routes_d192_dv128_splits_to_the_model():
    inputs, ds = fp8_case(384, 1024, 192, 128, H=2)
    p = fa_lab.api.plan(*inputs, **ds, num_kv_splits=3, causal=True)
    assert (p.family, p.backend) == ("swp_fp8", "emulator")
    out, lse = fa_lab.flash_attn_func(*inputs, **ds, num_kv_splits=3, causal=True, return_lse=True)
    want, want_lse = split.forward(*inputs, **ds, causal=True, policy=p.call.policy,
                                   num_kv_splits=3)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


def test_varlen_is_one_dense_call_per_sequence():
    (q1, k1, v1), ds = fp8_case(40, 300, 192, 128, seed=1)
    (q2, k2, v2), _ = fp8_case(70, 200, 192, 128, seed=2)
    cq = torch.tensor([0, 40, 110], dtype=torch.int32)
    ck = torch.tensor([0, 300, 500], dtype=torch.int32)
    out, lse = fa_lab.flash_attn_func(torch.cat([q1, q2], 1)[0], torch.cat([k1, k2], 1)[0],
                                      torch.cat([v1, v2], 1)[0], cu_seqlens_q=cq, cu_seqlens_kv=ck,
                                      max_seqlen_q=70, max_seqlen_kv=300, causal=True,
                                      return_lse=True, **ds)
    assert out.shape == (110, 1, 128) and out.dtype == torch.bfloat16
    for (q, k, v), r in (((q1, k1, v1), slice(0, 40)), ((q2, k2, v2), slice(40, 110))):
        o, l_ = fa_lab.flash_attn_func(q, k, v, causal=True, return_lse=True, **ds)
        assert torch.equal(out[r], o[0])
        b = 0 if r.start == 0 else 1
        assert torch.equal(lse[b, :, : r.stop - r.start], l_[0])


def test_the_fast_kernel_refuses_what_it_lacks_by_name():
    """The fast kernel runs the dense D = 128 body only: (D, Dv) and split-K are refused by
    name, never run as something else."""
    inputs, ds = fp8_case(384, 512, 192, 128)
    with pytest.raises(ValueError, match=r"backend='fast': the swp_fp8 kernel takes head dims"):
        fa_lab.flash_attn_func(*inputs, **ds, backend="fast")
    (q, k, v), ds = fp8_case(384, 512, 128, 64)
    with pytest.raises(ValueError, match=r"backend='fast': the swp_fp8 kernel takes v's head dim "
                                         r"equal to q's \(Dv = D\), got v head dim Dv=64"):
        fa_lab.flash_attn_func(q, k, v, **ds, backend="fast")
    (q, k, v), ds = fp8_case(384, 512, 128, 128)
    with pytest.raises(ValueError, match=r"num_kv_splits not supported by the swp_fp8 kernel on "
                                         r"backend='fast'"):
        fa_lab.flash_attn_func(q, k, v, **ds, backend="fast", num_kv_splits=2)


# ---- bad inputs ---------------------------------------------------------------------------

@pytest.fixture
def no_work(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("the model ran before the arguments were checked")
    monkeypatch.setattr(split, "walk", fail)


@pytest.mark.parametrize("kw, err, match", [
    (dict(num_kv_splits=0), ValueError, "num_kv_splits must be >= 1"),
    (dict(num_kv_splits=2.0), TypeError, "num_kv_splits must be an int"),
    (dict(num_kv_splits=5), ValueError, "num_kv_splits=5 exceeds the 4 KV tiles"),
    (dict(num_kv_splits=2, cu_seqlens_q=torch.tensor([0, 32], dtype=torch.int32)),
     ValueError, "cu_seqlens"),
])
def test_bad_split_arguments_are_refused_by_name(no_work, kw, err, match):
    inputs, ds = fp8_case(384, 256, 192, 128)
    with pytest.raises(err, match=match):
        fa_lab.flash_attn_func(*inputs, **ds, **kw)


def test_an_unsupported_dv_is_refused_by_name(no_work):
    (q, k, _), ds = fp8_case(32, 256, 192, 128)
    v = torch.zeros(1, 256, 1, 100).to(FP8)
    with pytest.raises(ValueError, match=r"v head dim Dv=100 is not supported"):
        fa_lab.flash_attn_func(q, k, v, **ds)
    with pytest.raises(ValueError, match=r"v head dim Dv=100 is not supported"):
        split.forward(q, k, v, **ds, causal=False, policy=policy())
    with pytest.raises(ValueError, match=r"head dim D=64 is not supported"):
        split.forward(q[..., :64], k[..., :64], v, **ds, causal=False, policy=policy())


@pytest.mark.parametrize("cu_q, cu_kv, match", [
    ([1, 32, 64], [0, 128, 256], "cu_seqlens_q must start at 0"),
    ([0, 40, 32, 64], [0, 128, 200, 256], "cu_seqlens_q must be non-decreasing"),
    ([0, 32, 64], [0, 128, 250], "cu_seqlens_kv ends at 250"),
    ([0, 32, 64], [0, 128], "cu_seqlens"),
])
def test_malformed_cu_seqlens_are_refused_by_name(no_work, cu_q, cu_kv, match):
    (q, k, v), ds = fp8_case(64, 256, 192, 128)
    args = (q[0], k[0], v[0])
    kw = dict(cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32),
              cu_seqlens_kv=torch.tensor(cu_kv, dtype=torch.int32), max_seqlen_q=64,
              max_seqlen_kv=256, **ds)
    with pytest.raises(ValueError, match=match):
        fa_lab.flash_attn_func(*args, **kw)


def test_int64_cu_seqlens_are_refused(no_work):
    (q, k, v), ds = fp8_case(64, 256, 192, 128)
    with pytest.raises(ValueError, match="cu_seqlens_q must be an int32"):
        fa_lab.flash_attn_func(q[0], k[0], v[0], cu_seqlens_q=torch.tensor([0, 64]),
                               cu_seqlens_kv=torch.tensor([0, 256], dtype=torch.int32),
                               max_seqlen_q=64, max_seqlen_kv=256, **ds)


@pytest.mark.parametrize("kw, err, match", [
    (dict(m_units="log2"), ValueError, "m_units='log2'"),
    (dict(lse_headroom=1), TypeError, "lse_headroom must be a bool"),
    (dict(upstream="flydsl-11c4174d"), ValueError, "not a known fp8 split-K version"),
    (dict(num_kv_splits=0), ValueError, "num_kv_splits must be >= 1"),
])
def test_the_models_own_arguments_are_checked_first(no_work, kw, err, match):
    inputs, ds = fp8_case(32, 256, 192, 128)
    with pytest.raises(err, match=match):
        split.forward(*inputs, **ds, causal=False, policy=policy(), **kw)


def test_a_split_trace_is_refused():
    inputs, ds = fp8_case(32, 256, 192, 128)
    from fa_lab.trace import TraceRecorder
    with pytest.raises(ValueError, match="trace records the dense walk"):
        split.forward(*inputs, **ds, causal=False, policy=policy(), num_kv_splits=2,
                      recorder=TraceRecorder.__new__(TraceRecorder))


def test_ln2_constant_is_the_kernels():
    assert abs(f32(LN2) - math.log(2)) < 1e-7


def test_a_d192_trace_records_the_walk_and_its_output():
    (q, k, v), ds = fp8_case(64, 512, 192, 128)
    tr = fa_lab.trace(q, k, v, rows=[(0, 0, 3), (0, 0, 40)], causal=True, **ds)
    out = fa_lab.flash_attn_func(q, k, v, causal=True, **ds)
    assert tr.out.shape == (2, 128)
    assert torch.equal(tr.out, out[0, [3, 40], 0])
