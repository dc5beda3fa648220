"""The faithful Triton port of the generic bf16/f16 forward against its model.

The kernel runs through Triton's interpreter on CPU tensors and must agree with the model
(``fa_lab.kernels.generic.model``): identical NaN, +inf and -inf masks on out and LSE, finite
values equal up to fp32 summation order (``assert_matches_model``), and traces equal
tile for tile. Covered: causal and not, GQA, ragged Sq != Skv, upstream's skipped
padding mask (Sq % 64 == 0: the last key counted again), the 128-column step with
zero-padded K/V, bf16 (P truncated) and f16 (P rounded), D 64 and 128, keys large enough
that the fma's residual or an overflowing score makes the model non-finite, NaN inputs.
GPU tests (marked ``gpu``) compare the compiled kernel with the model.
"""

import math

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import fa_lab
from fa_lab.kernels.generic import faithful as generic
from fa_lab.kernels._triton import util as _triton_util
from fa_lab.kernels.generic import model as model
from fa_lab.trace import TraceRecorder
from _ports import assert_matches_model, assert_same_masks, make_inputs
from _ports import check_generic_bounds

INF = math.inf


def assert_generic_traces_match(tk, tm):
    """Kernel trace == model trace tile for tile (``assert_traces_match``'s checks), with l
    compared relatively at every step: here l = corr * l + sum(P), where the row max's P
    is about 1, so a subnormal or zero corr (the first subtile's, m = -inf) leaves no
    tiny l behind as it does in the DUALWAVE_SWP schedule."""
    sk, sm = tk.steps, tm.steps
    assert list(sk.columns) == list(sm.columns) and len(sk) == len(sm) > 0
    for c in ("lane", "step", "col0", "phase", "batch", "head", "row",
              "vote", "fire", "swept", "o_finite", "l_finite"):
        assert (sk[c].values == sm[c].values).all(), f"trace column {c} differs"
    for c, rtol, atol in (("m", 1e-6, 1e-4), ("mt", 1e-6, 1e-4), ("corr", 2e-4, 2.0**-126),
                          ("l", 2e-4, 2.0**-126)):
        np.testing.assert_allclose(sk[c].values, sm[c].values, rtol=rtol, atol=atol,
                                   equal_nan=True, err_msg=f"trace column {c}")
    for c in ("batch", "head", "row", "first_nonfinite_step", "n_swept", "out_finite"):
        assert tk.lanes[c].equals(tm.lanes[c]), f"lanes column {c} differs"
    np.testing.assert_allclose(tk.lanes.lse.values, tm.lanes.lse.values, rtol=1e-5, equal_nan=True)
    assert_same_masks("trace out", tk.out, tm.out)


def both(q, k, v, **kw):
    """(kernel out, lse), (model out, lse) on the same inputs and arguments."""
    return generic.forward(q, k, v, interpret=True, **kw), model.forward(q, k, v, **kw)


def traces(q, k, v, rows, interpret=True, **kw):
    """The kernel's and the model's traces of the same rows."""
    out = []
    for run in (lambda rec: generic.forward(q, k, v, recorder=rec, interpret=interpret, **kw),
                lambda rec: model.forward(q, k, v, recorder=rec, **kw)):
        rec = TraceRecorder(rows, group_size=q.shape[2] // k.shape[2])
        run(rec)
        out.append(rec.build(kernel=model.KERNEL, policy=None, log2_per_unit=1.0,
                             threshold_units=math.nan))
    return out


# ----------------------------------------------------------------------------------
# The kernel against the model, interpreted on CPU
# ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, D", [(torch.bfloat16, 128), (torch.float16, 64)])
@pytest.mark.parametrize("causal", [False, True])
def test_kernel_matches_model_ragged_gqa(causal, dtype, D):
    # GQA 4:2, Sq = 200 and Skv = 300 (neither a multiple of 64: the padding mask is on),
    # K x48: wide scores, corrections far below 1; the eager kernel stays finite.
    q, k, v = make_inputs(1, 200, 300, 4, 2, D, 48.0, dtype=dtype, seed=1)
    kernel, ref = both(q, k, v, causal=causal)
    assert_matches_model(kernel, ref, q, k, v, causal)
    assert torch.isfinite(kernel[0]).all()


@pytest.mark.parametrize("dtype, D", [(torch.bfloat16, 64), (torch.float16, 128)])
def test_kernel_repeats_the_last_key_where_upstream_skips_the_pad_mask(dtype, D):
    # Non-causal with Sq % 64 == 0 and Skv % 64 != 0: upstream builds without the padding
    # mask and clamps K/V rows to Skv - 1, so the last key counts 28 more times. The port
    # does the same by default and masks with skip_kv_pad_mask=False, as the model.
    q, k, v = make_inputs(1, 128, 100, 2, 1, D, 2.0, dtype=dtype, seed=2)
    assert model.skips_kv_pad_mask(128, causal=False)
    upstream, ref = both(q, k, v, causal=False)
    assert_matches_model(upstream, ref, q, k, v, False)
    masked, ref_masked = both(q, k, v, causal=False, skip_kv_pad_mask=False)
    assert_matches_model(masked, ref_masked, q, k, v, False)
    gap = (upstream[0].float() - masked[0].float()).abs().max().item()
    assert gap > 0.05  # the two builds are told apart
    check_generic_bounds(q, k, v, False, *masked)  # the masked build is softmax
    # forcing the skip on a length upstream masks (Sq % 64 != 0) follows the model too
    q2 = q[:, :100]
    assert_matches_model(*both(q2, k, v, causal=False, skip_kv_pad_mask=True), q2, k, v, False)


def test_kernel_small_and_fully_masked_shapes():
    # Sq = Skv = 1; and causal Sq > Skv: rows 0..69 see no key (out 0, LSE -inf), and
    # their 64-row q-block visits no subtile at all (kv_upper = 0).
    q, k, v = make_inputs(2, 1, 1, 1, 1, 64, 1.0, dtype=torch.float16, seed=3)
    for causal in (False, True):
        assert_matches_model(*both(q, k, v, causal=causal), q, k, v, causal)
    q, k, v = make_inputs(1, 90, 20, 2, 2, 64, 1.0, seed=4)
    kernel, ref = both(q, k, v, causal=True)
    assert_matches_model(kernel, ref, q, k, v, True)
    assert (kernel[1][:, :, :70] == -INF).all() and (kernel[0][:, :70] == 0).all()


def test_kernel_wide_tile_and_zero_padded_kv():
    # num_cus = 1 leaves the light tile: 128-row programs and, causal with D = 128, the
    # 128-column step whose K/V rows past Skv read 0; non-causal D = 64 keeps the 64-step.
    q, k, v = make_inputs(1, 300, 300, 2, 1, 128, 8.0, seed=5)
    assert model.launch_tile(1, 300, 2, 128, True, 1) == model.LaunchTile(128, 128)
    kernel, ref = both(q, k, v, causal=True, num_cus=1)
    assert_matches_model(kernel, ref, q, k, v, True)
    # rows are independent: 32-row programs give bitwise the same result
    small = generic.forward(q, k, v, causal=True, num_cus=1, interpret=True, rows_per_program=32)
    assert torch.equal(small[0].view(torch.int16), kernel[0].view(torch.int16))
    assert torch.equal(small[1].view(torch.int32), kernel[1].view(torch.int32))
    q64, k64, v64 = (x[..., :64].contiguous() for x in (q, k, v))
    assert_matches_model(*both(q64, k64, v64, causal=False, num_cus=1), q64, k64, v64, False)


def huge_key_case(seed=6):
    """bf16 keys 3e38 on dimension 0 for columns 100..109; q's dimension 0 in [-4, 4]:
    those scores are +-inf (|q0| > 1.14) or finite near 3e38, whatever the summation
    order (the other 63 terms are below their ulp)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 96, 2, 64, generator=g).clamp(-2, 2)
    q[..., 0] = torch.linspace(-4, 4, 96)[:, None]
    k = torch.randn(1, 150, 1, 64, generator=g)
    k[:, 100:110] = 0
    k[:, 100:110, :, 0] = 3e38
    v = torch.randn(1, 150, 1, 64, generator=g)
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


@pytest.mark.parametrize("causal", [False, True])
def test_kernel_matches_model_where_huge_keys_make_it_non_finite(causal):
    # +inf scores give P = exp2(inf - inf) = NaN; a finite row max near 3e38 gives a
    # P = exp2(fma residual of m * c) that is 0 or inf, so l = 0 (LSE -inf) or NaN.
    # Only the exact fma reproduces which: the masks must be identical.
    q, k, v = huge_key_case()
    kernel, ref = both(q, k, v, causal=causal)
    assert_matches_model(kernel, ref, q, k, v, causal)
    out, lse = ref
    assert torch.isnan(out).any() and torch.isfinite(out).any()
    assert (lse == -INF).any() and (lse == INF).any() and torch.isnan(lse).any()


def test_kernel_propagates_nan_inputs_as_the_model():
    q, k, v = make_inputs(1, 100, 100, 2, 1, 64, 1.0, seed=7)
    v_nan = v.clone()
    v_nan[0, 3, 0, 0] = math.nan  # one V element: NaN in that output column only
    kernel, ref = both(q, k, v_nan, causal=False)
    assert_matches_model(kernel, ref, q, k, v_nan, False)
    assert torch.isnan(kernel[0][..., 0]).all() and torch.isfinite(kernel[0][..., 1:]).all()
    k_nan = k.clone()
    k_nan[0, 70, 0, 3] = math.nan  # one key: NaN for the rows that see it (causal: 70..)
    kernel, ref = both(q, k_nan, v, causal=True)
    assert_same_masks("out", kernel[0], ref[0])
    assert_same_masks("lse", kernel[1], ref[1])
    assert torch.isnan(kernel[0][:, 70:]).all() and torch.isfinite(kernel[0][:, :70]).all()


def test_kernel_against_fp64_reference():
    # Independent of the model: the masked build against softmax attention in fp64, with
    # the bounds of the model's own reference test (P truncation, output rounding, fp32).
    for dtype in (torch.bfloat16, torch.float16):
        q, k, v = make_inputs(1, 150, 190, 3, 1, 64, 3.0, dtype=dtype, seed=8)
        for causal in (False, True):
            out, lse = generic.forward(q, k, v, causal=causal, skip_kv_pad_mask=False,
                                       interpret=True)
            check_generic_bounds(q, k, v, causal, out, lse)


def test_strided_inputs_equal_contiguous_ones():
    g = torch.Generator().manual_seed(9)
    q = torch.randn(1, 2, 130, 64, generator=g).half().transpose(1, 2)
    k = (torch.randn(1, 200, 4, 64, generator=g) * 8).half()[:, 10:190, ::2]
    v = torch.randn(1, 200, 4, 64, generator=g).half()[:, 10:190, 1::2]
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    a = generic.forward(q, k, v, causal=True, interpret=True)
    b = generic.forward(q.contiguous(), k.contiguous(), v.contiguous(), causal=True, interpret=True)
    assert torch.equal(a[0].view(torch.int16), b[0].view(torch.int16))
    assert torch.equal(a[1].view(torch.int32), b[1].view(torch.int32))


def test_interpreter_fma_is_one_rounding():
    # The exp2 argument is one fma; on an interpreter whose tl.fma rounds twice the port
    # goes through fp64 (the model's emulation). Either way the probe's result is exact.
    a = torch.tensor([1.0 + 2.0**-12])
    out = torch.empty(1)
    via = _triton_util.fma_via_fp64(generic._generic_fwd, True)
    _triton_util.launch(_fma_kernel, (1,), True, a, a, -(a * a), out, 1, VIA_FP64=via)
    assert float(out) == 2.0**-24
    if not _triton_util.runs_interpreted(generic._generic_fwd, False):
        assert _triton_util.fma_via_fp64(generic._generic_fwd, False) is False  # compiled: tl.fma


@pytest.mark.parametrize("via_fp64", [True, False])
def test_interpreted_fma_rounds_the_exact_value_where_fp64_would_round_twice(via_fp64):
    """The kernels' fma through fp64 is the model's, bit for bit, on the sums that a plain
    fp64 sum rounds the wrong way, and on random operands; so is tl.fma where this
    interpreter rounds it once, and where it rounds twice it is not (why the kernels take
    the fp64 path there)."""
    from _fma import FMA_DOUBLE_ROUNDING, tie_hitting_triples

    g = torch.Generator().manual_seed(3)
    triples = FMA_DOUBLE_ROUNDING + tie_hitting_triples(30, seed=2)
    a, b, c = (torch.cat([torch.tensor(col, dtype=torch.float32), torch.randn(64 - len(triples), generator=g) * 2.0**k])
               for col, k in zip(zip(*triples), (10, -12, 0)))
    out = torch.empty_like(a)
    _triton_util.launch(_fma_kernel, (1,), True, a, b, c, out, len(a), VIA_FP64=via_fp64)
    if not via_fp64 and _triton_util.interpreter_fma_rounds_twice():
        assert not torch.equal(out, fa_lab.numerics.fma_f32(a, b, c))
        return
    assert torch.equal(out, fa_lab.numerics.fma_f32(a, b, c))
    k = len(FMA_DOUBLE_ROUNDING)
    assert (out[:k] != (a.double() * b.double() + c.double()).float()[:k]).all()


@triton.jit
def _fma_kernel(A, B, C, Out, N, VIA_FP64: tl.constexpr):
    i = tl.arange(0, 64)
    ok = i < N
    a = tl.load(A + i, mask=ok, other=0.0)
    b = tl.load(B + i, mask=ok, other=0.0)
    c = tl.load(C + i, mask=ok, other=0.0)
    tl.store(Out + i, _triton_util.fma_f32(a, b, c, VIA_FP64), mask=ok)


# ----------------------------------------------------------------------------------
# Traced mode
# ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(causal=True), dict(causal=False),
                                dict(causal=True, num_cus=1)])
def test_trace_matches_model_tile_for_tile(kw):
    q, k, v = make_inputs(1, 200, 300, 4, 2, 128, 32.0, seed=10)
    rows = [(0, h, r) for h in range(4) for r in (0, 1, 63, 64, 130, 199)] + [(0, 1, 3), (0, 1, 3)]
    tk, tm = traces(q, k, v, rows, **kw)
    assert_generic_traces_match(tk, tm)
    st = tm.steps
    assert (st.phase == "tile").all() and not (st.vote.any() or st.fire.any())
    assert (st["corr"] <= 1).all() and (st["corr"] < 1).any()


def test_trace_of_rows_that_visit_no_subtile():
    # causal Sq > Skv: rows 0..63 form a q-block with kv_upper = 0 (no step at all)
    q, k, v = make_inputs(1, 150, 40, 2, 1, 64, 1.0, seed=11)
    rows = [(0, 0, 5), (0, 1, 120), (0, 1, 149)]
    tk, tm = traces(q, k, v, rows, causal=True)
    assert_generic_traces_match(tk, tm)
    assert 0 not in set(tm.steps.lane) and tm.lanes.lse[0] == -INF


# ----------------------------------------------------------------------------------
# The api: short sequences route to the generic port under the Triton backends
# ----------------------------------------------------------------------------------

def test_api_runs_the_generic_port(monkeypatch):
    called = {}
    real = generic.forward

    def spy(*a, **kw):
        called.update(kw)
        return real(*a, **kw)

    monkeypatch.setattr(generic, "forward", spy)
    q, k, v = make_inputs(1, 100, 130, 2, 1, 64, 8.0, seed=12)
    out = fa_lab.flash_attn_func(q, k, v, causal=True, backend="interpret", return_lse=True)
    assert called["causal"] is True and called["interpret"] is True and called["recorder"] is None
    ref = fa_lab.flash_attn_func(q, k, v, causal=True, backend="emulator", return_lse=True)
    assert_matches_model(out, ref, q, k, v, True)
    kw = dict(rows=[3, 99], causal=True)
    tk = fa_lab.trace(q, k, v, backend="interpret", **kw)
    assert tk.kernel == "generic" and called["recorder"] is not None
    assert_generic_traces_match(tk, fa_lab.trace(q, k, v, backend="emulator", **kw))


# ----------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------

def _t(*shape, dtype=torch.bfloat16):
    return torch.zeros(*shape, dtype=dtype)


@pytest.mark.parametrize("args, kw, exc, words", [
    ((_t(1, 8, 2, 64), _t(1, 8, 2, 64), _t(1, 8, 2, 64).float()), {}, TypeError, "v has dtype"),
    ((_t(1, 8, 2, 64, dtype=torch.float8_e4m3fn),) * 3, {}, TypeError, "q has dtype"),
    ((_t(1, 8, 2), _t(1, 8, 2, 64), _t(1, 8, 2, 64)), {}, ValueError, "q must be 4-D"),
    ((_t(1, 8, 2, 32),) * 3, {}, ValueError, "head dim D=32"),
    ((_t(1, 8, 3, 64), _t(1, 8, 2, 64), _t(1, 8, 2, 64)), {}, ValueError, "multiple of the kv heads"),
    ((_t(1, 0, 2, 64), _t(1, 8, 2, 64), _t(1, 8, 2, 64)), {}, ValueError, "empty input"),
    ((_t(1, 8, 2, 64),) * 3, {"causal": 1}, TypeError, "causal must be a bool"),
    ((_t(1, 8, 2, 64),) * 3, {"skip_kv_pad_mask": 1}, TypeError, "skip_kv_pad_mask"),
    ((_t(1, 8, 2, 64),) * 3, {"num_cus": 0}, ValueError, "num_cus"),
    ((_t(1, 8, 2, 64),) * 3, {"num_cus": True}, ValueError, "num_cus"),
    ((_t(1, 8, 2, 64),) * 3, {"recorder": object()}, TypeError, "recorder must be"),
    ((_t(1, 8, 2, 64),) * 3, {"interpret": "yes"}, TypeError, "interpret must be a bool"),
    ((_t(1, 8, 2, 64),) * 3, {"interpret": False}, ValueError, "needs CUDA/ROCm tensors"),
    ((_t(1, 8, 2, 64),) * 3, {"rows_per_program": 48}, ValueError, "rows_per_program"),
    ((_t(1, 8, 2, 64),) * 3, {"recorder": TraceRecorder([(0, 2, 0)], 1)}, ValueError, "out of range"),
])
def test_bad_input_raises_before_launch(args, kw, exc, words):
    kw = {"causal": False, "interpret": True, **kw}
    with pytest.raises(exc) as e:
        generic.forward(*args, **kw)
    assert words in str(e.value)


# ----------------------------------------------------------------------------------
# GPU: the compiled kernel (skipped without CUDA/ROCm)
# ----------------------------------------------------------------------------------

# mid-size GQA shapes: (B, Sq, Skv, H, Hkv, D, forward kwargs)
GPU_CASES = {
    "light_tile_d128": (2, 1000, 1300, 8, 2, 128, {}),  # 64-row blocks, 64-column step
    "wide_tile_d128": (2, 1000, 1300, 8, 2, 128, {"num_cus": 1}),  # causal: 128-step, zero pad
    "light_tile_d64": (2, 1000, 1300, 8, 2, 64, {}),
    "sq_multiple_of_64": (2, 960, 1300, 8, 2, 128, {}),  # non-causal: the pad mask skipped
    "all_ones": (1, 1, 1, 1, 1, 64, {}),  # Triton specialises integers equal to 1 unless told
}


@pytest.mark.gpu
@pytest.mark.usefixtures("exact_dots")
@pytest.mark.parametrize("case", sorted(GPU_CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_kernel_matches_model(causal, dtype, case):
    B, Sq, Skv, H, Hkv, D, kw = GPU_CASES[case]
    q, k, v = make_inputs(B, Sq, Skv, H, Hkv, D, 48.0, dtype=dtype, seed=13, device="cuda")
    kernel = generic.forward(q, k, v, causal=causal, **kw)
    assert_matches_model(kernel, model.forward(q, k, v, causal=causal, **kw), q, k, v, causal)
    assert torch.isfinite(kernel[0]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_huge_keys_give_the_models_masks(causal):
    # the compiled tl.fma (and the tensor-core dot's handling of inf products) against the
    # model's fp64-emulated fma: the same NaN / +-inf pattern
    q, k, v = (x.cuda() for x in huge_key_case())
    kernel = generic.forward(q, k, v, causal=causal)
    ref = model.forward(q, k, v, causal=causal)
    assert_matches_model(kernel, ref, q, k, v, causal)
    assert torch.isnan(kernel[0]).any() and (kernel[1] == -INF).any()


@pytest.mark.gpu
@pytest.mark.usefixtures("exact_dots")
def test_gpu_trace_matches_model():
    q, k, v = make_inputs(1, 700, 900, 4, 2, 128, 32.0, seed=15, device="cuda")
    rows = [(0, h, r) for h in range(4) for r in range(0, 700, 9)]
    for kw in (dict(causal=True), dict(causal=True, num_cus=1), dict(causal=False)):
        assert_generic_traces_match(*traces(q, k, v, rows, interpret=False, **kw))
