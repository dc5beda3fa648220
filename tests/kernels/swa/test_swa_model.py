"""The SWA kernel model (swa_gfx950.py): window masks against an fp64 reference with the
same band folded in, bit-for-bit agreement with the DUALWAVE_SWP model where the two
kernels coincide, corrections <= 1 on wide scores, the -30 floor, and bad arguments."""

import functools
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import fa_lab
from fa_lab import reference
from fa_lab.studies.experiments import bf16_inputs
from fa_lab.metrics import rel_l2
from fa_lab.kernels.swa import model as swa
from fa_lab.kernels.swp_bf16 import model as swp_bf16
from fa_lab.policies import Policy, get as get_policy
from fa_lab.trace import TraceRecorder

U = 2.0**-8  # bf16 unit roundoff


def band_reference(q, k, v, left, right):
    """fp64 softmax attention where row i sees keys i - left ... i + right (left=None: all)."""
    B, S, H, D = q.shape
    G = H // k.shape[2]
    qf = q.double().permute(0, 2, 1, 3)
    kf = k.double().permute(0, 2, 1, 3).repeat_interleave(G, dim=1)
    vf = v.double().permute(0, 2, 1, 3).repeat_interleave(G, dim=1)
    s = qf @ kf.transpose(-1, -2) / math.sqrt(D)
    if left is not None:
        i = torch.arange(S)[:, None]
        j = torch.arange(S)[None, :]
        s = s.masked_fill(~((j >= i - left) & (j <= i + right)), -math.inf)
    lse = torch.logsumexp(s, -1)
    out = torch.softmax(s, -1) @ vf
    return out.permute(0, 2, 1, 3), lse


def check_against_band(q, k, v, left, right, out, lse):
    """The bounds of the DUALWAVE_SWP model test: Q*c and P rounded to bf16 (u each), the
    output once more; LSE off by at most u * max|score| from the rounded Q."""
    ref, ref_lse = band_reference(q, k, v, left, right)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    vmax = v.double().abs().max().item()
    assert (out.double() - ref).abs().max().item() <= 6 * U * vmax + 1e-6
    G = q.shape[2] // k.shape[2]
    kk = k.double().repeat_interleave(G, dim=2)
    smax = torch.einsum("bshd,bthd->bhst", q.double().abs(), kk.abs()).amax(-1) / math.sqrt(q.shape[-1])
    assert ((lse.double() - ref_lse).abs() <= 2 * U * smax + 1e-4).all()
    return ref


def inputs(S, H=4, Hkv=2, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, S, H, 128, generator=g).bfloat16()
    k = (torch.randn(1, S, Hkv, 128, generator=g) * scale).bfloat16()
    v = torch.randn(1, S, Hkv, 128, generator=g).bfloat16()
    return q, k, v


@pytest.mark.parametrize("left,right", [(0, 0), (1, 0), (63, 0), (64, 0), (100, 37), (256, 256),
                                        (700, 5)])
def test_window_matches_band_reference(left, right):
    q, k, v = inputs(512, scale=2.0, seed=left + right)
    out, lse = swa.forward(q, k, v, window_left=left, window_right=right, causal=right == 0)
    ref = check_against_band(q, k, v, left, right, out, lse)
    # the window is not a no-op: full attention is far from the answer
    full = reference.attention(q, k, v, causal=False, dtype=torch.float64)[0]
    assert (full - ref).abs().max().item() > 0.1


@settings(max_examples=6, deadline=None)
@given(S=st.sampled_from([256, 512]), left=st.integers(0, 600), right=st.integers(0, 300),
       hkv=st.sampled_from([1, 2]), seed=st.integers(0, 1000))
def test_random_windows_match_band_reference(S, left, right, hkv, seed):
    q, k, v = inputs(S, H=2 * hkv, Hkv=hkv, seed=seed)
    out, lse = swa.forward(q, k, v, window_left=left, window_right=right, causal=False)
    check_against_band(q, k, v, left, right, out, lse)


def test_unwindowed_and_causal_limits_match_fa_lab_reference():
    q, k, v = inputs(512, H=2, Hkv=1, scale=4.0, seed=3)
    for kw, causal in ((dict(window_left=None, causal=False), False),
                       (dict(window_left=511, causal=True), True)):
        out, lse = swa.forward(q, k, v, **kw)
        ref, ref_lse = reference.attention(q, k, v, causal=causal, dtype=torch.float64)
        assert (out.double() - ref).abs().max().item() <= 6 * U * v.double().abs().max().item()
        assert (lse.double() - ref_lse).abs().max().item() < 0.05


@pytest.fixture(scope="module")
def wide():
    """K x64 scores (the seed's worst column) and the DUALWAVE_SWP model's two lazy runs."""
    q, k, v = bf16_inputs(1, 1024, 1, 128, 64.0, seed=0)
    runs = {p: swp_bf16.forward(q, k, v, causal=False, policy=get_policy(p))
            for p in ("lazy", "lazy_unfixed")}
    return q, k, v, runs


@pytest.mark.parametrize("scale", [1.0, 64.0])
def test_equals_dualwave_swp_lazy_where_the_kernels_coincide(scale, wide):
    # Unwindowed, the SWA schedule, rounding and ballot are those of the DUALWAVE_SWP lazy
    # (fixed) kernel: same tiles, same first 16-column PV slice, same pack rescale.
    if scale == 64.0:
        q, k, v, runs = wide
        swp = runs["lazy"]
    else:
        q, k, v = bf16_inputs(1, 1024, 1, 128, scale, seed=0)
        swp = swp_bf16.forward(q, k, v, causal=False, policy=get_policy("lazy"))
    for window in (dict(window_left=None, causal=False),
                   dict(window_left=1024, window_right=1024, causal=False)):
        out, lse = swa.forward(q, k, v, **window)
        assert torch.equal(out, swp[0]) and torch.equal(lse, swp[1])


def test_causal_window_equals_dualwave_swp_causal_lazy():
    # window_left >= S, causal: each CTA walks the tiles up to its diagonal, as the causal
    # DUALWAVE_SWP blocks do (N = 4 + q0/64); with narrow scores no tile max falls below
    # the -30 floor, so the two agree bit for bit.
    q, k, v = bf16_inputs(1, 1024, 1, 128, 1.0, seed=5)
    out, lse = swa.forward(q, k, v, window_left=1024, causal=True)
    swp = swp_bf16.forward(q, k, v, causal=True, policy=get_policy("lazy"))
    assert torch.equal(out, swp[0]) and torch.equal(lse, swp[1])


def test_unfixed_counterfactual_unwindowed_is_upstream_mains_dualwave_swp(wide):
    q, k, v, runs = wide
    out, lse = swa.forward(q, k, v, window_left=None, causal=False, rescale="lazy_unfixed")
    swp = runs["lazy_unfixed"]
    assert torch.isnan(out).float().mean() > 0.05
    # identical wherever l survived; where l is NaN the SWA kernel's unguarded rcp gives
    # NaN, the DUALWAVE_SWP guard gives 0 * O
    ok = ~torch.isnan(swp[1]).permute(0, 2, 1)[..., None].expand_as(out)
    torch.testing.assert_close(out[ok], swp[0][ok], rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(out[~ok]).all()


def trace(q, k, v, triples, **kw):
    rec = TraceRecorder(triples, group_size=q.shape[2] // k.shape[2])
    out, lse = swa.forward(q, k, v, recorder=rec, **kw)
    tr = rec.build(kernel=swa.KERNEL, policy=kw.get("rescale", "lazy"), log2_per_unit=1.0,
                   threshold_units=kw.get("threshold", swa.DEFAULT_THRESHOLD))
    return tr, out, lse


def test_wide_scores_corrections_never_exceed_one(wide):
    # K x64: the DUALWAVE_SWP unfixed rebase turns > 5 % of the outputs NaN; the SWA
    # kernel's rescale_defer takes fmax(m_cur, m) first, so no correction exceeds 1.
    q, k, v, runs = wide
    assert torch.isnan(runs["lazy_unfixed"][0]).float().mean() > 0.05
    rows = [(0, 0, r) for r in range(1024)]
    ref = reference.attention(q, k, v, causal=False)[0]
    for window in (dict(window_left=1024, window_right=1024, causal=False),
                   dict(window_left=256, causal=True)):
        tr, out, lse = trace(q, k, v, rows, **window)
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        assert (tr.steps["corr"] <= 1).all() and tr.steps.fire.any()
        assert (tr.steps.o_finite & tr.steps.l_finite).all()
        if window["causal"] is False:
            assert rel_l2(out, ref) < 2e-2
    # the counterfactual own-tile-max rebase: the -30 floor does not save it
    tr, out, _ = trace(q, k, v, rows, window_left=256, causal=True, rescale="lazy_unfixed")
    assert torch.isnan(out).any() and (tr.steps["corr"] > 1).any()
    assert tr.steps[tr.steps["corr"] > 1].swept.all()


def test_band_geometry_by_hand():
    # S = 1024, window (128, 0): NT_BAND = roundup4(ceil((128 + 255 + 64) / 64)) = 8
    assert swa.nt_band(128, 0) == 8
    assert [swa.cta_band(q0, 1024, 128, 0) for q0 in (0, 256, 512, 768)] == [
        (0, 4), (128, 8), (384, 8), (512, 8)]  # the last band is clamped to end at Skv
    assert swa.cta_band(0, 512, None, 0) == (0, 8)
    q, k, v = inputs(1024, H=2, Hkv=1, seed=1)
    tr, out, _ = trace(q, k, v, [(0, 0, 800), (0, 1, 10)], window_left=128, causal=True)
    assert tr.lane(0).col0.tolist() == [512 + 64 * t for t in range(8)]
    assert tr.lane(0).phase.tolist() == ["prologue", "loop", "loop", "loop", "loop"] + ["epilogue"] * 3
    assert tr.lane(1).phase.tolist() == ["prologue"] + ["epilogue"] * 3  # nt = 4: no loop
    # row 10 sees keys 0..10 only: tiles 1..3 are fully masked, mt floored at -30
    assert (tr.lane(1).mt.iloc[1:] == swa.NEG_FLOOR).all() and (tr.lane(1)["corr"] == 1).all()


def test_threshold_changes_the_ballot():
    q, k, v = bf16_inputs(1, 512, 2, 128, 8.0, seed=2)
    rows = [(0, 0, r) for r in range(512)]
    fires = {thr: trace(q, k, v, rows, window_left=None, causal=False, threshold=thr)[0].steps.fire.sum()
             for thr in (0.0, 8.0)}
    assert fires[0.0] > fires[8.0]


@pytest.mark.slow
def test_a_policys_threshold_reaches_the_ballot_unless_one_is_passed(monkeypatch):
    """The SWA kernel runs the policy's threshold, as every other kernel does; a
    ``threshold`` (``swa_attn_func``'s ``rescale_threshold``) replaces it. The model and
    its Triton port (interpreted) fire alike."""
    from fa_lab.kernels.swa import faithful as port

    q, k, v = bf16_inputs(1, 512, 2, 128, 8.0, seed=2)
    rows = [(0, 0, r) for r in range(512)]
    kw = dict(window_left=None, causal=False)
    at0 = Policy(vote="wave", rebase="max", threshold=0.0, name="lazy_thr0")
    for forward in (swa.forward, functools.partial(port.forward, interpret=True)):
        def fires(**more):
            rec = TraceRecorder(rows, group_size=1)
            forward(q, k, v, recorder=rec, **kw, **more)
            return int(rec.build(kernel=swa.KERNEL, policy="x", log2_per_unit=1.0,
                                 threshold_units=0.0).steps.fire.sum())
        assert fires(rescale=at0) == fires(threshold=0.0) > fires() == fires(threshold=8.0)
        assert fires(rescale=at0, threshold=8.0) == fires()
    # the api hands the model the policy with its threshold, or rescale_threshold's
    ran = []
    monkeypatch.setattr(swa, "forward", lambda *a, rescale, **k: ran.append(rescale.threshold) or (q, None))
    fa_lab.swa_attn_func(q, k, v, rescale=at0, backend="emulator", **kw)
    fa_lab.swa_attn_func(q, k, v, rescale=at0, rescale_threshold=5.0, backend="emulator", **kw)
    fa_lab.swa_attn_func(q, k, v, backend="emulator", **kw)
    assert ran == [0.0, 5.0, 8.0]
    with pytest.raises(ValueError, match="threshold 'by_kv_len', the fp8 kernel's rule"):
        fa_lab.swa_attn_func(q, k, v, rescale=Policy(threshold="by_kv_len", name="x"), **kw)


@pytest.mark.parametrize("headroom", [True, 3.0])
def test_a_p_headroom_is_refused_not_ignored(headroom):
    """The P headroom is the fp8 kernel's; the SWA model and its port refuse it alike
    (before, the model ran True and both ignored a number)."""
    from fa_lab.kernels.swa import faithful as port

    q, k, v = bf16_inputs(1, 256, 2, 128, 8.0, seed=0)
    pol = Policy(p_headroom=headroom, name="lifted")
    for forward in (swa.forward, functools.partial(port.forward, interpret=True),
                    functools.partial(fa_lab.swa_attn_func, backend="interpret")):
        with pytest.raises(ValueError, match=r"p_headroom=.* applies to the fp8 kernel only"):
            forward(q, k, v, window_left=64, rescale=pol)


def test_floor_zeroes_rows_whose_scores_all_sit_far_below_it():
    # Window (0, 0): row i sees key i alone, softmax gives out = v_i. The kernel floors the
    # running max at -30 (log2 units): a score near -255 gives P = exp2(-225) = 0, l = 0,
    # and the guarded rcp returns 0; a score near -64 still works (P about 2**-34).
    S = 256
    a = torch.tensor([1.0, -2000.0, -500.0, 3.0]).repeat(S // 4)
    q = torch.zeros(1, S, 1, 128)
    q[0, :, 0, 0] = a
    k = torch.zeros(1, S, 1, 128)
    k[..., 0] = 1.0
    v = torch.randn(1, S, 1, 128, generator=torch.Generator().manual_seed(0))
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    out, lse = swa.forward(q, k, v, window_left=0, causal=True)
    ref = band_reference(q, k, v, 0, 0)[0]
    assert torch.equal(ref.bfloat16(), v.expand_as(ref).bfloat16())  # softmax: out = v_i
    far, mid, near = (a == -2000), (a == -500), (a > 0)
    assert (out[0, far].float() == 0).all() and (lse[0, 0, far] == -math.inf).all()
    assert torch.equal(out[0, near], v[0, near])
    rel = (out[0, mid].float() - v[0, mid].float()).abs() / v[0, mid].float().abs()
    assert rel.max().item() <= 2 * U  # only the rounding of P = 2**-34 and of the output


@pytest.mark.parametrize("change,exc,match", [
    (dict(dtype=torch.float16), TypeError, "bfloat16"),
    (dict(D=64), ValueError, "head dim"),
    (dict(Skv=512), ValueError, "seq_len_q == seq_len_kv"),
    (dict(S=300), ValueError, "multiple of 256"),
    (dict(Hkv=3), ValueError, "multiple of the kv heads"),
    (dict(window_right=5), ValueError, "window_right"),
    (dict(window_left=None), ValueError, "causal=False"),
    (dict(window_left=-1), ValueError, "window_left"),
    (dict(window_left=True), TypeError, "window_left"),
    (dict(window_left=3.0), TypeError, "window_left"),
    (dict(window_left=None, causal=False, window_right=4), ValueError, "window_right"),
    (dict(causal=1), TypeError, "causal"),
    (dict(threshold=-1.0), ValueError, "threshold"),
    (dict(threshold=math.nan), ValueError, "threshold"),
    (dict(threshold="8"), TypeError, "threshold"),
    (dict(rescale="eager"), ValueError, "rescale"),
])
def test_bad_arguments(change, exc, match):
    S, Skv, D = change.pop("S", 256), change.pop("Skv", None), change.pop("D", 128)
    dtype, Hkv = change.pop("dtype", torch.bfloat16), change.pop("Hkv", 1)
    q = torch.zeros(1, S, 4, D, dtype=dtype)
    k = torch.zeros(1, Skv or S, Hkv, D, dtype=dtype)
    kw = dict(window_left=16, window_right=0, causal=True) | change
    with pytest.raises(exc, match=match):
        swa.forward(q, k, k.clone(), **kw)
