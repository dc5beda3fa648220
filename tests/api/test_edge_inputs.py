"""Issue 15, findings 6 and 7: values that meant nothing and messages that were unclear.

Each test is one item of the issue, tried against the current code:

* a NaN or infinite ``sink`` is refused (it used to give that head an all-zero output);
* ``p_headroom`` past log2(448) is refused (100 used to collapse the output to ~1e-27);
* ``k_descale`` >= 1e10: the kernel's own fp32 arithmetic (see the test) gives all-zero
  rows with an infinite LSE; the model and the Triton port agree on it, and the call warns;
* varlen with a 4-D ``v`` names v and shows the caller's shape;
* meta tensors in varlen calls, in ``trace`` and as modifiers are refused naming them;
* ``swa_attn_func`` errors say ``rescale_threshold``, its argument's name;
* ``num_kv_splits`` past the KV tiles (5000 or 10**6 at Sq = Skv = 384) is refused at
  once, naming num_kv_splits, by one bound for every backend.
"""

import math
import re
import time
import warnings
from unittest import mock

import pytest
import torch

import fa_lab
from fa_lab import dispatch
from fa_lab.studies.experiments import bf16_inputs, quantize_e4m3
from fa_lab.kernels.swa import model as swa_model
from fa_lab.kernels.swp_fp8 import model as swp_fp8
from fa_lab.numerics import E4M3_MAX

BF, F8 = torch.bfloat16, torch.float8_e4m3fn
NAN, INF = float("nan"), float("inf")


def boom(*a, **k):
    raise AssertionError("the model ran before the bad argument was caught")


@pytest.fixture
def no_work():
    with mock.patch.object(dispatch, "run", boom), mock.patch.object(swa_model, "forward", boom):
        yield


def zeros(*shape, dtype=BF):
    return torch.zeros(shape, dtype=torch.float32).to(dtype)


@pytest.fixture(scope="module")
def fp8_normal():
    """N(0,1) q, k, v quantised per tensor, as a real fp8 call would be."""
    g = torch.Generator()
    g.manual_seed(0)
    out = [quantize_e4m3(torch.randn((1, 256, 1, 128), generator=g)) for _ in range(3)]
    return tuple(x for x, _ in out), tuple(d for _, d in out)


# --- sink -------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [[NAN, 0.0], [0.0, INF], [-INF, 0.0], [NAN, NAN]])
def test_non_finite_sink_is_refused(no_work, value):
    q, k, v = zeros(1, 64, 2, 64), zeros(1, 64, 1, 64), zeros(1, 64, 1, 64)
    with pytest.raises(ValueError, match=r"^sink must be finite"):
        fa_lab.flash_attn_func(q, k, v, sink=torch.tensor(value))
    cu = torch.tensor([0, 32, 64], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^sink must be finite"):
        fa_lab.flash_attn_func(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=32,
                               sink=torch.tensor(value))


def test_finite_sink_still_runs_and_matches_the_reference():
    q, k, v = bf16_inputs(1, 256, 2, 64, 1.0, seed=1)
    sink = torch.tensor([3.0, -2.0])
    out = fa_lab.flash_attn_func(q, k, v, sink=sink, backend="emulator")
    ref, _ = fa_lab.reference.attention(q, k, v, sink=sink)
    assert fa_lab.metrics.rel_l2(out, ref) < 1e-2


# --- p_headroom -------------------------------------------------------------------------

def refused_or_warned(fn, pattern):
    """``fn()`` raises a ValueError matching ``pattern``, or runs with a warning matching it:
    either way the caller hears about the value (the issue's complaint was silence)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            fn()
        except ValueError as e:
            assert re.search(pattern, str(e)), str(e)
            return "refused"
    hits = [w for w in seen if re.search(pattern, str(w.message))]
    assert hits, f"no error and no warning matching {pattern!r}: {[str(w.message) for w in seen]}"
    return "warned"


@pytest.mark.parametrize("value", [100, 9.0, math.log2(E4M3_MAX) + 1e-3, 1e30])
def test_p_headroom_past_log2_448_is_not_silent(fp8_normal, value):
    """p_headroom=100 used to collapse the output to ~1e-27 without a word. Past log2(448)
    the lift pushes even an eager row's largest P out of e4m3's range: the call is refused
    or warned about, naming p_headroom and log2(448) (the decision is policies.py's)."""
    (q8, k8, v8), (qd, kd, vd) = fp8_normal
    pattern = rf"p_headroom.*{re.escape(repr(value))}.*log2\(448\)|p_headroom must be <= log2\(448\)"
    refused_or_warned(lambda: fa_lab.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd,
                                                     v_descale=vd, p_headroom=value,
                                                     backend="emulator"), pattern)
    refused_or_warned(lambda: fa_lab.Policy("tile", "max", p_headroom=value, name="x"), pattern)


@pytest.mark.parametrize("value, exc", [(-1.0, ValueError), (NAN, ValueError), (INF, ValueError),
                                        ("1", TypeError)])
def test_p_headroom_meaningless_values_are_refused(no_work, value, exc):
    z = zeros(1, 256, 1, 128, dtype=F8)
    with pytest.raises(exc, match=r"^p_headroom"):
        fa_lab.flash_attn_func(z, z, z, q_descale=1.0, k_descale=1.0, v_descale=1.0,
                               p_headroom=value)


def test_p_headroom_at_the_bound_runs(fp8_normal):
    (q8, k8, v8), (qd, kd, vd) = fp8_normal
    out = fa_lab.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                 rescale="eager", p_headroom=math.log2(E4M3_MAX), backend="emulator")
    ref, _ = fa_lab.reference.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)
    assert torch.isfinite(out).all()
    assert fa_lab.metrics.rel_l2(out, ref) < 0.06


# --- k_descale >= 1e10 --------------------------------------------------------------------

def test_huge_k_descale_is_the_kernels_fp32_addend(fp8_normal):
    """Semantics, pinned: the fp8 kernel computes P = exp2(fma(S, ls, -ls*m)) with the
    addend -ls*m rounded to fp32 (ls = q_descale * k_descale * log2(e) / sqrt(D), m the raw
    row max). With k_descale = 1e10, |ls*m| ~ 6e12, whose fp32 ulp is 2**19: the row max's
    own P is exp2 of a rounding error of up to 2**18, i.e. 0 or inf. l is then 0 or inf,
    so every row is 0 (out = O * rcp(l), clamped P) with LSE -inf, +inf or NaN; with
    fp8_saturate=False the inf P casts to NaN. The faithful Triton port does exactly this."""
    (q8, k8, v8), (qd, _, vd) = fp8_normal
    kw = dict(q_descale=qd, k_descale=1e10, v_descale=vd, causal=False)
    out, lse = fa_lab.flash_attn_func(q8, k8, v8, backend="emulator", return_lse=True, **kw)
    assert bool((out == 0).all())
    assert not torch.isfinite(lse).any()
    ls = swp_fp8.log2_scale(qd, 1e10)
    m = (q8.float()[0, :, 0] @ k8.float()[0, :, 0].T).amax(-1)
    assert float((ls * m).abs().min()) > 2.0 ** 31  # the addend's ulp exceeds 2**8 everywhere
    # the reference (fp64-exact scores) is a finite one-hot softmax: the kernel's answer
    # is not the softmax's, it is the kernel's
    ref, ref_lse = fa_lab.reference.attention(q8, k8, v8, q_descale=qd, k_descale=1e10,
                                              v_descale=vd, causal=False, dtype=torch.float64)
    assert torch.isfinite(ref_lse).all() and float(ref.abs().amax()) > 0.5
    from fa_lab.kernels import available

    if available():
        for sat in (True, False):
            c = fa_lab.compare(q8, k8, v8, a="emulator", b="interpret", fp8_saturate=sat, **kw)
            assert c.same_masks, str(c)
            assert c.out.both_finite == 0 or c.out.max_abs == 0.0, str(c)


def test_moderate_k_descale_is_still_the_softmax(fp8_normal):
    """Below the breakdown (|ls*m| < 2**24: the addend's error is under one log2 unit and
    only weighs tile pairs against each other) the kernel is the softmax."""
    (q8, k8, v8), (qd, _, vd) = fp8_normal
    for kd in (1.0, 1e3):
        out = fa_lab.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                     rescale="eager", causal=False, backend="emulator")
        ref, _ = fa_lab.reference.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                            causal=False)
        assert fa_lab.metrics.rel_l2(out, ref) < 0.06, kd


def test_huge_k_descale_warns(fp8_normal):
    (q8, k8, v8), (qd, _, vd) = fp8_normal
    with pytest.warns(RuntimeWarning, match="k_descale"):
        fa_lab.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=1e10, v_descale=vd,
                               causal=False, backend="emulator")


def test_fp8_scale_warning_reads_the_descales_not_the_data(fp8_normal):
    """The warning's bound is e4m3's largest score (448 x 448 x D) under the descales: it
    takes no pass over q or k (no tensor operation at all between the call and the kernel,
    so no sync on a GPU), and it warns for zero inputs as for any."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fa_lab import api, dispatch

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ran = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ran.append(str(func))
            return func(*args, **(kwargs or {}))

    (q8, k8, v8), (qd, _, vd) = fp8_normal
    for kd, warns in ((1.0, False), (1e10, True)):
        with Ops() as ops, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call = api.check_call(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                  causal=False, backend="emulator")
            dispatch.plan(call)
            api.warn_fp8_scale(call)
        assert ops.ran == []
        assert any("2**32" in str(w.message) for w in caught) == warns, kd
    zeros = torch.zeros_like(q8)
    with pytest.warns(RuntimeWarning, match="largest values"):
        api.warn_fp8_scale(api.check_call(zeros, zeros, zeros, q_descale=1e5, k_descale=1e5,
                                          v_descale=1.0, causal=False, backend="emulator"))


def test_causal_rows_without_a_key_turn_nan_past_ls_1_13_and_warn():
    """Causal with Sq > Skv: the first Sq - Skv rows see no key and keep the floor (-3e38)
    as their base. The addend -ls * m is finite below ls = 1.1342746 (rows end 0, LSE
    -inf) and +inf from there, where fma(-inf, ls, +inf) makes those rows NaN, and only
    those; the call warns exactly then, naming the rows. Descale products either side of
    the boundary (8.895 at D 128) pin it."""
    g = torch.Generator().manual_seed(3)
    q8, k8, v8 = (torch.randn(1, n, 1, 128, generator=g).clamp(-4, 4).to(torch.float8_e4m3fn)
                  for n in (512, 300, 300))
    blind = 512 - 300
    for descale, nan in ((2.9, False), (2.98245, False), (2.98246, True), (3.1, True)):
        kw = dict(q_descale=descale, k_descale=descale, v_descale=1.0, causal=True,
                  rescale="eager", backend="emulator", return_lse=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out, lse = fa_lab.flash_attn_func(q8, k8, v8, **kw)
        said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert said == ([f"q_descale * k_descale = {descale * descale:.4g} (ls = "
                         f"{swp_fp8.log2_scale(descale, descale):.8g}, at least 1.1342746) with causal "
                         f"seq_len_q 512 > seq_len_kv 300: the first {blind} rows of each head "
                         "see no key, and the kernel's -ls*m overflows at their floored max, "
                         "so they come out NaN (docs/semantics.md §1.2)"] if nan else [])
        dead = out[0, :blind, 0].float()
        assert (torch.isnan(dead).all() and torch.isnan(lse[0, 0, :blind]).all()) if nan else (
            (dead == 0).all() and torch.isneginf(lse[0, 0, :blind]).all())
        assert torch.isfinite(out[0, blind:].float()).all() and torch.isfinite(lse[0, 0, blind:]).all()


# --- varlen 4-D v -------------------------------------------------------------------------

@pytest.mark.parametrize("v_shape", [(1, 128, 1, 64), (2, 64, 1, 64), (128, 1, 64, 1), (128, 64)])
def test_varlen_v_of_the_wrong_rank_names_v_and_its_shape(no_work, v_shape):
    q, k = zeros(128, 2, 64), zeros(128, 1, 64)
    cu = torch.tensor([0, 64, 128], dtype=torch.int32)
    with pytest.raises(ValueError) as info:
        fa_lab.flash_attn_func(q, k, zeros(*v_shape), cu_seqlens_q=cu, cu_seqlens_kv=cu,
                               max_seqlen_q=64)
    msg = str(info.value)
    assert msg.startswith("varlen v must be packed [total, H, D]"), msg
    assert str(list(v_shape)) in msg, msg
    assert not re.search(r"\[\d+, \d+, \d+, \d+, \d+\]", msg), msg  # no internal 5-D shape


# --- meta tensors -------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_kv"])
@pytest.mark.parametrize("entry", ["flash_attn_func", "count_rescales"])
def test_meta_tensors_in_varlen_are_refused_by_name(no_work, name, entry):
    cu = torch.tensor([0, 64, 128], dtype=torch.int32)
    args = dict(q=zeros(128, 2, 64), k=zeros(128, 1, 64), v=zeros(128, 1, 64),
                cu_seqlens_q=cu, cu_seqlens_kv=cu.clone())
    args[name] = args[name].to("meta")
    fn = getattr(fa_lab, entry)
    with pytest.raises(ValueError, match=rf"^{name} is a meta tensor"):
        fn(args.pop("q"), args.pop("k"), args.pop("v"), max_seqlen_q=64, **args)


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_meta_tensors_in_trace_are_refused_by_name(no_work, name):
    t = dict(q=zeros(1, 64, 2, 64), k=zeros(1, 64, 1, 64), v=zeros(1, 64, 1, 64))
    t[name] = t[name].to("meta")
    with pytest.raises(ValueError, match=rf"^{name} is a meta tensor"):
        fa_lab.trace(t["q"], t["k"], t["v"], rows=[0, 1])


@pytest.mark.parametrize("name, x", [("bias", zeros(64, 64)), ("alibi_slopes", torch.zeros(2)),
                                     ("sink", torch.zeros(2))])
def test_meta_modifiers_are_refused_by_name(no_work, name, x):
    q, k = zeros(1, 64, 2, 64), zeros(1, 64, 1, 64)
    with pytest.raises(ValueError, match=rf"^{name} is on meta"):
        fa_lab.flash_attn_func(q, k, k, **{name: x.to("meta")})


def test_meta_tensors_in_swa_are_refused_by_name(no_work):
    q, k = zeros(1, 256, 2, 128).to("meta"), zeros(1, 256, 1, 128)
    with pytest.raises(ValueError, match=r"\bq\b.*meta|meta.*\bq\b"):
        fa_lab.swa_attn_func(q, k, k, window_left=64)


# --- swa_attn_func: rescale_threshold -------------------------------------------------------

@pytest.mark.parametrize("value, exc", [(-1.0, ValueError), (NAN, ValueError), (INF, ValueError),
                                        ("8", TypeError), (True, TypeError),
                                        ([8.0], TypeError)])
def test_swa_errors_say_rescale_threshold(no_work, value, exc):
    q, k = zeros(1, 256, 2, 128), zeros(1, 256, 1, 128)
    with pytest.raises(exc) as info:
        fa_lab.swa_attn_func(q, k, k, window_left=64, rescale_threshold=value)
    msg = str(info.value)
    assert msg.startswith("rescale_threshold "), msg
    assert not re.search(r"(?<!rescale_)threshold", msg), msg


# --- num_kv_splits ----------------------------------------------------------------------

@pytest.mark.parametrize("splits", [7, 5000, 10**6, 2**31, 2**70])
@pytest.mark.parametrize("backend", ["emulator", "interpret", "auto", "fast"])
def test_num_kv_splits_past_the_tiles_is_refused_at_once(no_work, splits, backend):
    q = zeros(1, 384, 2, 64)
    k = zeros(1, 384, 1, 64)
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=rf"^num_kv_splits={splits} exceeds the 6 KV tiles"):
        fa_lab.flash_attn_func(q, k, k, num_kv_splits=splits, backend=backend)
    assert time.perf_counter() - t0 < 1.0


def test_num_kv_splits_at_the_tiles_runs():
    """The bound is exactly the tile count: 6 splits of 384 columns run and agree with 1."""
    q, k, v = bf16_inputs(1, 384, 2, 64, 1.0, seed=2)
    one = fa_lab.flash_attn_func(q, k, v, backend="emulator", rescale="eager")
    six = fa_lab.flash_attn_func(q, k, v, backend="emulator", rescale="eager", num_kv_splits=6)
    ref, _ = fa_lab.reference.attention(q, k, v)
    assert fa_lab.metrics.rel_l2(six, ref) < 1e-2
    assert fa_lab.metrics.rel_l2(six, one) < 1e-2


def test_ordinary_descales_are_far_from_the_breakdown(fp8_normal):
    """A sanity bound for the proposal: ordinary per-tensor descales (amax / 448) are far
    from the breakdown, so a warning keyed on |ls * m| >= 2**24 would not fire on them."""
    (q8, k8, _), (qd, kd, _) = fp8_normal
    ls = swp_fp8.log2_scale(qd, kd)
    m = (q8.float()[0, :, 0] @ k8.float()[0, :, 0].T).abs().amax()
    assert float(ls * m) < 2.0 ** 10
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        fa_lab.flash_attn_func(q8, k8, q8, q_descale=qd, k_descale=kd, v_descale=qd,
                               backend="emulator")
