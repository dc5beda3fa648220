"""Paged fp8 prefill (FlyDSL #1066 at 6aeb4321) on the fp8 family: ``fa_lab.kernels.swp_fp8.paged``.

Packed varlen fp8 q over a vectorized page-64 cache, causal, through ``flash_attn_func``.
A shuffled page table gives the per-sequence dense calls' result bit for bit (the pair loop
is the dense kernel's), and both match an fp64 reference. What is read past ``seqlen_k``:
block-table entries past a sequence's own pages never (NaN pages, out-of-range ids change
nothing); the tail of its last page yes, where a NaN in K is masked away and a NaN in V
meets P = 0 and comes out NaN, as on the bf16 paged path. A bare call runs the paged
builder's threshold 8 (P headroom log2(448) - 8), which loses more of the softmax mass
than the dense builder's 6 on spread scores. Every bad argument is refused by name
before any work. The faithful port, interpreted (``slow``) and compiled (``gpu``),
agrees with the model.
"""

import math

import pytest
import torch

import fa_lab
from fa_lab import metrics, reference
from fa_lab.kernels.swp_fp8 import paged as paged_model
from fa_lab.paged import PagedFp8, check_fp8
from fa_lab.studies.experiments import quantize_e4m3

FP8 = torch.float8_e4m3fn
PAGE = 64
D = 128
LAZY8 = dict(rescale="lazy", rescale_threshold=8.0, p_headroom=True)


def vectorized(kc, vc):
    """A linear fp8 cache [NB, 64, Hkv, D] in the vectorized 5-D layout (kVS = 16)."""
    nb, ps, hkv, d = kc.shape
    k5 = kc.reshape(nb, ps, hkv, d // 16, 16).permute(0, 2, 3, 1, 4).contiguous()
    v5 = vc.reshape(nb, ps // 16, 16, hkv, d).permute(0, 3, 1, 4, 2).contiguous()
    return k5, v5


def make_case(lens_q, lens_k, *, H=2, Hkv=1, k_scale=2.0, n_blocks=None, seed=0, spare=1):
    """Packed q, the dense per-sequence k and v (fp8), a shuffled vectorized cache holding
    them (the rest random), and the call's metadata: dict of what ``flash_attn_func``
    takes plus ``dense`` [(k_b, v_b)] and ``descales``."""
    g = torch.Generator().manual_seed(seed)
    n = [math.ceil(s / PAGE) for s in lens_k]
    width = max(2 * math.ceil(max(n) / 2), 2) + spare
    n_blocks = n_blocks or 1 + len(lens_k) * width
    q8, qd = quantize_e4m3(torch.randn(sum(lens_q), H, D, generator=g))
    ks = [k_scale * torch.randn(s, Hkv, D, generator=g) for s in lens_k]
    vs = [torch.randn(s, Hkv, D, generator=g) for s in lens_k]
    kd = max(float(x.abs().max()) for x in ks) / 448.0
    vd = max(float(x.abs().max()) for x in vs) / 448.0
    dense = [((x / kd).to(FP8)[None], (y / vd).to(FP8)[None]) for x, y in zip(ks, vs)]
    kc = torch.randn(n_blocks, PAGE, Hkv, D, generator=g).to(FP8)
    vc = torch.randn(n_blocks, PAGE, Hkv, D, generator=g).to(FP8)
    order = 1 + torch.randperm(n_blocks - 1, generator=g)  # (page 0 holds no key)
    bt = order[: len(lens_k) * width].reshape(len(lens_k), width).to(torch.int32)
    for b, (kb, vb) in enumerate(dense):
        for t in range(n[b]):
            rows = kb[0, t * PAGE:(t + 1) * PAGE]
            kc[bt[b, t], : rows.shape[0]] = rows
            vc[bt[b, t], : rows.shape[0]] = vb[0, t * PAGE:(t + 1) * PAGE]
    k5, v5 = vectorized(kc, vc)
    cq = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    ck = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    call = dict(cu_seqlens_q=cq, cu_seqlens_kv=ck, max_seqlen_q=max(lens_q), block_table=bt,
                seqlen_k=torch.tensor(lens_k, dtype=torch.int32), kv_cache_layout="vectorized",
                q_descale=qd, k_descale=kd, v_descale=vd)
    return q8, k5, v5, call, dense, kc, vc


def run(q8, k5, v5, call, **kw):
    kw.setdefault("backend", "emulator")
    return fa_lab.flash_attn_func(q8, k5, v5, **call, **kw)


def per_sequence(q8, call, dense, fn):
    cq = call["cu_seqlens_q"].tolist()
    return [fn(q8[cq[b]:cq[b + 1]][None], kb, vb) for b, (kb, vb) in enumerate(dense)]


LENS = [([100, 300], [200, 250]), ([256, 64, 7], [384, 64, 129])]


@pytest.mark.parametrize("rescale", ["eager", "lazy"])
@pytest.mark.parametrize("lens_q, lens_k", LENS)
def test_shuffled_pages_equal_the_dense_calls_bit_for_bit(lens_q, lens_k, rescale):
    q8, k5, v5, call, dense, _, _ = make_case(lens_q, lens_k)
    pol = dict(rescale=rescale, p_headroom=True)
    if rescale == "lazy":
        pol["rescale_threshold"] = 8.0
    out = run(q8, k5, v5, call, **pol)
    ds = dict(q_descale=call["q_descale"], k_descale=call["k_descale"], v_descale=call["v_descale"])
    want = per_sequence(q8, call, dense, lambda q, k, v: fa_lab.flash_attn_func(
        q, k, v, causal=True, backend="emulator", **ds, **pol)[0])
    assert torch.equal(out.view(torch.int16), torch.cat(want).view(torch.int16))


@pytest.mark.parametrize("H, Hkv", [(2, 1), (4, 2)])
def test_matches_an_fp64_reference(H, Hkv):
    q8, k5, v5, call, dense, _, _ = make_case([200, 90], [384, 128], H=H, Hkv=Hkv, k_scale=4.0)
    out, lse = run(q8, k5, v5, call, return_lse=True)
    ds = dict(q_descale=call["q_descale"], k_descale=call["k_descale"], v_descale=call["v_descale"])
    refs = per_sequence(q8, call, dense, lambda q, k, v: reference.attention(
        q, k, v, causal=True, dtype=torch.float64, **ds))
    ref = torch.cat([r[0][0] for r in refs])
    assert torch.isfinite(out).all()
    assert metrics.rel_l2(out.double(), ref) < 3e-2
    cq = call["cu_seqlens_q"].tolist()
    for b, (_, ref_lse) in enumerate(refs):
        n = cq[b + 1] - cq[b]
        assert (lse[b, :, :n].double() - ref_lse[0]).abs().max() < 2e-2
        assert torch.isinf(lse[b, :, n:]).all()


def test_nan_in_pages_past_seqlen_k_changes_nothing():
    """Unused pages all NaN (page 0 too: the fp8 kernel's padding pairs read entries 0 and
    1, not page 0), block-table entries past each sequence's (even) page count NaN pages
    or out-of-range ids, NaN K in the last page's tail."""
    lens_q, lens_k = [150, 60], [200, 100]
    q8, k5, v5, call, dense, kc, vc = make_case(lens_q, lens_k, spare=3)
    clean = run(q8, k5, v5, call)
    bt = call["block_table"].clone()
    used = {int(bt[b, t]) for b, s in enumerate(lens_k) for t in range(math.ceil(s / PAGE))}
    nan = torch.tensor(float("nan")).to(FP8)
    kp, vp = kc.clone(), vc.clone()
    for blk in range(kc.shape[0]):
        if blk not in used:
            kp[blk], vp[blk] = nan, nan
    for b, s in enumerate(lens_k):
        kp[int(bt[b, s // PAGE]), s % PAGE:] = nan  # the last page's tail, K only
    bt[0, 4:] = 10**6
    bt[1, 2:] = -1
    k5p, v5p = vectorized(kp, vp)
    poisoned = run(q8, k5p, v5p, {**call, "block_table": bt})
    assert torch.equal(poisoned.view(torch.int16), clean.view(torch.int16))


def test_nan_in_v_of_the_last_page_tail_reaches_the_output():
    lens_q, lens_k = [64], [100]
    q8, k5, v5, call, dense, kc, vc = make_case(lens_q, lens_k)
    vp = vc.clone()
    vp[int(call["block_table"][0, 1]), 100 - PAGE:] = torch.tensor(float("nan")).to(FP8)
    out = run(q8, *vectorized(kc, vp), call)
    assert torch.isnan(out).all()  # every row's P V meets 0 * NaN


def test_the_partner_of_an_odd_last_page_and_padding_pairs_are_read():
    """Sequence 1 has 3 pages: its last pair (2, 3) loads entry 3 too; sequence 2 has one
    page and 256 query rows, so its block walks 4 tiles and the padding pair (2, 3) loads
    entries 0 and 1. A NaN V in the pages those entries name comes out NaN in every row of
    that sequence; the same NaN in a page no entry read names changes nothing."""
    lens_q, lens_k = [40, 40, 256], [256, 150, 30]
    q8, k5, v5, call, dense, kc, vc = make_case(lens_q, lens_k, spare=2)
    bt = call["block_table"]
    clean = run(q8, k5, v5, call)
    nan = torch.tensor(float("nan")).to(FP8)
    for b, entry, rows in ((1, 3, slice(40, 80)), (2, 1, slice(80, 336))):
        vp = vc.clone()
        vp[int(bt[b, entry])] = nan
        out = run(q8, *vectorized(kc, vp), call)
        assert torch.isnan(out[rows]).all()
        assert torch.equal(out[:40].view(torch.int16), clean[:40].view(torch.int16))
    vp = vc.clone()
    vp[int(bt[1, 4])] = nan  # past the pair: never read
    out = run(q8, *vectorized(kc, vp), call)
    assert torch.equal(out.view(torch.int16), clean.view(torch.int16))
    bad = bt.clone()
    bad[1, 3] = 10**6
    with pytest.raises(ValueError, match="block_table row 1 holds block ids"):
        run(q8, k5, v5, {**call, "block_table": bad})


def test_a_bare_call_runs_threshold_8():
    q8, k5, v5, call, _, _, _ = make_case([64], [128])
    planned = fa_lab.api.plan(q8, k5, v5, **call, backend="emulator")
    pol = planned.call.policy
    assert planned.family == "swp_fp8"
    assert (pol.vote, pol.rebase, pol.threshold) == ("wave", "max", 8.0)
    assert pol.p_headroom == pytest.approx(math.log2(448) - 8)
    eager = fa_lab.api.plan(q8, k5, v5, **call, dualwave_swp_lazy_rescale=False).call.policy
    assert eager.vote == "tile" and eager.p_headroom == pytest.approx(math.log2(448))
    with pytest.raises(ValueError, match="no paged fp8 kernel"):
        fa_lab.api.plan(q8, k5, v5, **call, upstream="main-11c4174d")


def test_threshold_8_loses_more_mass_than_6():
    """V = 1: the output is sum(e4m3(P)) / sum(P) where the fp64 reference gives 1. On
    spread scores THR 8 (headroom 0.807) flushes more small P than THR 6 (2.807)."""
    q8, k5, v5, call, dense, kc, vc = make_case([256], [1024], k_scale=6.0 / math.log2(math.e))
    ones = torch.ones_like(vc, dtype=torch.float32).to(FP8)
    k5, v5 = vectorized(kc, ones)
    call = {**call, "v_descale": 1.0}
    loss = {}
    for thr in (6.0, 8.0):
        out = run(q8, k5, v5, call, rescale="lazy", rescale_threshold=thr, p_headroom=True)
        loss[thr] = float((1.0 - out.double()).mean())
    bare = run(q8, k5, v5, call)
    assert float((1.0 - bare.double()).mean()) == loss[8.0]
    assert loss[8.0] > 1.5 * loss[6.0] > 0


def _bad(q8, k5, v5, call, **change):
    args = {**call, **change}
    return lambda: run(q8, k5, v5, args)


def test_bad_arguments_are_refused_by_name_before_any_work(monkeypatch):
    q8, k5, v5, call, dense, kc, vc = make_case([100, 30], [200, 100])

    def no_work(*a, **k):
        raise AssertionError("the model ran")

    monkeypatch.setattr(paged_model, "forward", no_work)
    bt = call["block_table"]
    cases = [
        (_bad(q8, k5, v5, call, block_table=bt[:, :3]), ValueError, "block_table has 3 pages"),
        (_bad(q8, k5, v5, call, block_table=torch.where(bt == bt[1, 1], 999, bt)), ValueError,
         "block_table row 1 holds block ids"),
        (_bad(q8, k5, v5, call, block_table=bt.float()), TypeError, "block_table must be an int32"),
        (_bad(q8, k5, v5, call, q_descale=torch.ones(2)), ValueError, "q_descale must be a per-tensor"),
        (_bad(q8, k5, v5, call, v_descale="1"), TypeError, "v_descale"),
        (_bad(q8, k5, v5, call, kv_cache_layout="linear"), ValueError, "kv_cache_layout='linear'"),
        (_bad(q8, k5, v5, call, causal=False), ValueError, "causal=False"),
        (_bad(q8, k5, v5, call, cu_seqlens_kv=None), ValueError, "needs cu_seqlens_kv"),
        (_bad(q8, k5, v5, call, max_seqlen_q=None), ValueError, "needs max_seqlen_q"),
        (_bad(q8, k5, v5, call, max_seqlen_q=50), ValueError, "max_seqlen_q=50"),
        (_bad(q8, k5, v5, call, seqlen_k=torch.tensor([200, 99], dtype=torch.int32)), ValueError,
         "seqlen_k \\[200, 99\\] differs"),
        (_bad(q8, k5, v5, call, seqlen_k=torch.tensor([200, 100])), ValueError, "seqlen_k must be int32"),
        (_bad(q8, k5, v5, call, seqlen_k=None), ValueError, "seqlen_k is missing"),
    ]
    k16, v16 = vectorized(kc.reshape(-1, 16, *kc.shape[2:]), vc.reshape(-1, 16, *vc.shape[2:]))
    cases.append((lambda: run(q8, k16, v16, call), ValueError, "page size 16"))
    q96 = torch.zeros(q8.shape[0], q8.shape[1], 96).to(FP8)
    k96, v96 = vectorized(torch.zeros(*kc.shape[:3], 96).to(FP8), torch.zeros(*vc.shape[:3], 96).to(FP8))
    cases.append((lambda: run(q96, k96, v96, call), ValueError, "head dims \\(D, Dv\\) = \\(96, 96\\)"))
    k4 = k5.reshape(-1, *k5.shape[2:])
    cases.append((lambda: run(q8, k4, v5, call), ValueError, "paged fp8 k must be the vectorized"))
    for fn, exc, match in cases:
        with pytest.raises(exc, match=match):
            fn()


def test_the_model_refuses_a_direct_call_it_cannot_run():
    q8, k5, v5, call, _, _, _ = make_case([64], [128])
    pk = check_fp8(q8, k5, v5, causal=True, max_seqlen_kv=None,
                   **{k: call[k] for k in ("cu_seqlens_q", "cu_seqlens_kv", "max_seqlen_q",
                                           "block_table", "seqlen_k", "kv_cache_layout")})
    assert isinstance(pk, PagedFp8) and pk.seqlen_k == (128,)
    pol = fa_lab.policies.resolve(fp8=True, seqlen_kv=128, rescale="eager", p_headroom=True)
    kw = dict(q_descale=1.0, k_descale=1.0, v_descale=1.0, policy=pol)
    with pytest.raises(TypeError, match="PagedFp8"):
        paged_model.forward(q8, k5, v5, causal=True, paged=object(), **kw)
    with pytest.raises(ValueError, match="causal only"):
        paged_model.forward(q8, k5, v5, causal=False, paged=pk, **kw)


# ---- the faithful port -----------------------------------------------------------------

def assert_port_matches_model(kernel, model):
    """Identical NaN/+inf/-inf masks on out and LSE; finite outputs within 1e-3 of the
    largest |output| plus one bf16 step at their magnitude (fp32 sums in another order can
    flip the final rounding); LSE within 1e-5 of the largest finite |LSE|."""
    (out_k, lse_k), (out_m, lse_m) = kernel, model
    assert out_k.shape == out_m.shape and out_k.dtype == out_m.dtype == torch.bfloat16
    assert lse_k.shape == lse_m.shape
    for what, fn in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        assert torch.equal(fn(out_k.float()), fn(out_m.float())), f"out {what} masks differ"
        assert torch.equal(fn(lse_k), fn(lse_m)), f"lse {what} masks differ"
    a, b = out_k.double(), out_m.double()
    fin = torch.isfinite(b)
    if fin.any():
        a, b = a[fin], b[fin]
        big = torch.maximum(a.abs(), b.abs())
        step = torch.where(big > 0, torch.exp2(torch.floor(torch.log2(big))), big) * 2.0**-7
        assert ((a - b).abs() <= 1e-3 * b.abs().max() + step).all()
    fin = torch.isfinite(lse_m)
    if fin.any():
        err = (lse_k.double() - lse_m.double())[fin].abs().max()
        assert err <= 1e-5 * lse_m[fin].abs().max() + 1e-6


def both(q8, k5, v5, call, backend, **kw):
    return (run(q8, k5, v5, call, backend=backend, return_lse=True, **kw),
            run(q8, k5, v5, call, backend="emulator", return_lse=True, **kw))


@pytest.mark.slow
@pytest.mark.parametrize("kw", [{}, dict(rescale="eager", p_headroom=True)], ids=["bare", "eager"])
def test_interpreted_port_matches_the_model(kw):
    q8, k5, v5, call, _, _, _ = make_case([100, 40], [200, 128], H=2, Hkv=1, k_scale=6.0)
    assert_port_matches_model(*both(q8, k5, v5, call, "interpret", **kw))


@pytest.mark.slow
def test_interpreted_port_matches_the_model_on_nan_tails_and_partner_pages():
    """V NaN in the last page's tail in sequence 0 (its rows all NaN), and in the page of
    entry 1 of sequence 1, whose one page's pair reads entry 1 as its partner (its rows
    all NaN too); sequence 2 stays finite."""
    q8, k5, v5, call, _, kc, vc = make_case([70, 30, 20], [100, 30, 128], H=2, Hkv=1)
    vp = vc.clone()
    nan = torch.tensor(float("nan")).to(FP8)
    vp[int(call["block_table"][0, 1]), 100 - PAGE:] = nan
    vp[int(call["block_table"][1, 1])] = nan
    k5, v5 = vectorized(kc, vp)
    kernel, model = both(q8, k5, v5, call, "interpret")
    assert torch.isnan(model[0][:100]).all() and torch.isfinite(model[0][100:]).all()
    assert_port_matches_model(kernel, model)


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [{}, dict(rescale="eager", p_headroom=True),
                                dict(rescale="lazy", rescale_threshold=6.0, p_headroom=True)],
                         ids=["bare", "eager", "thr6"])
def test_compiled_port_matches_the_model(kw):
    q8, k5, v5, call, _, _, _ = make_case([700, 300, 1], [1024, 700, 1000], H=4, Hkv=2,
                                          k_scale=6.0)
    dev = torch.device("cuda")
    q8, k5, v5 = q8.to(dev), k5.to(dev), v5.to(dev)
    call = {k: (x.to(dev) if isinstance(x, torch.Tensor) else x) for k, x in call.items()}
    kernel = run(q8, k5, v5, call, backend="triton", return_lse=True, **kw)
    model = run(q8, k5, v5, call, backend="emulator", return_lse=True, **kw)
    assert_port_matches_model(tuple(x.cpu() for x in kernel), tuple(x.cpu() for x in model))


def test_no_empty_row_warning_where_every_row_sees_a_key():
    """The causal-floor warning reads the call's key count, not the cache's second
    dimension (k's head count in the vectorized layout)."""
    import warnings

    q8, k5, v5, call, _, _, _ = make_case([64, 128], [128, 200])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        run(q8, k5, v5, {**call, "q_descale": 3.0, "k_descale": 3.0})  # ls = 1.15
