"""The faithful Triton port of the gfx950 SWA sliding-window kernel against its model.

The kernel runs through Triton's interpreter on CPU tensors and must agree with the model
(``fa_lab.kernels.swa.model``): identical NaN, +inf and -inf masks on out and LSE, finite values
equal up to fp32 summation order, and traces equal tile for tile (every ballot exact).
Covered: causal and two-sided windows, no window, GQA, bands clamped at both ends, the
-30 floor (rows whose P all underflow: out 0, LSE -inf), the upstream "lazy" rescale
(finite on wide scores) and the "lazy_unfixed" counterfactual (non-finite on them).
GPU tests (marked ``gpu``) compare the compiled kernel with the model.
"""

import math

import pytest
import torch
from _shared import assert_lse_close

import fa_lab
from fa_lab.kernels.swa import faithful as swa
from fa_lab.kernels.swa import model as model
from fa_lab.trace import TraceRecorder
from _ports import assert_same_masks, assert_traces_match

INF = math.inf
U = 2.0**-8  # bf16 unit roundoff


def inputs(S, H, Hkv, k_scale, seed=0, device="cpu", B=1):
    """q, v ~ N(0,1), k ~ N(0,1) * k_scale (the seed's recipe), bf16, D = 128."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, S, H, 128, generator=g, device=device).bfloat16()
    k = (torch.randn(B, S, Hkv, 128, generator=g, device=device) * k_scale).bfloat16()
    v = torch.randn(B, S, Hkv, 128, generator=g, device=device).bfloat16()
    return q, k, v


def assert_matches_model(kernel, ref, v):
    """Identical NaN/+inf/-inf masks on out and LSE. Finite outputs within 1e-3 of the
    model's largest |output| plus what the two fp32 summation orders may change after
    rounding (a P or the output next to a bf16 rounding boundary: 2u of |V|max and of the
    element); LSE within 1e-5 of the largest finite |LSE|."""
    (out_k, lse_k), (out_m, lse_m) = kernel, ref
    assert out_k.dtype == out_m.dtype == torch.bfloat16 and out_k.shape == out_m.shape
    assert lse_k.dtype == torch.float32 and lse_k.shape == lse_m.shape
    assert_same_masks("out", out_k, out_m)
    assert_same_masks("lse", lse_k, lse_m)
    fin = torch.isfinite(out_m)
    if fin.any():
        b = out_m.double()
        tol = 1e-3 * b[fin].abs().max() + 2 * U * (v.double().abs().max() + b.abs())
        ratio = ((out_k.double() - b).abs() / tol)[fin].max().item()
        assert ratio <= 1, f"out: |kernel - model| up to {ratio:.2f} x the tolerance"
    assert_lse_close(lse_k, lse_m)


def both(q, k, v, **kw):
    return swa.forward(q, k, v, interpret=True, **kw), model.forward(q, k, v, **kw)


def traces(q, k, v, rows, interpret=True, **kw):
    """The kernel's and the model's traces of the same rows."""
    out = []
    for run in (lambda rec: swa.forward(q, k, v, recorder=rec, interpret=interpret, **kw),
                lambda rec: model.forward(q, k, v, recorder=rec, **kw)):
        rec = TraceRecorder(rows, group_size=q.shape[2] // k.shape[2])
        run(rec)
        out.append(rec.build(kernel=model.KERNEL, policy=kw.get("rescale", "lazy"),
                             log2_per_unit=1.0, threshold_units=model.DEFAULT_THRESHOLD))
    return out


@pytest.fixture(scope="module")
def wide():
    """S = 512, GQA 2:1, K x64: the scores the seed's worst column has."""
    return inputs(512, 2, 1, 64.0, seed=0)


# ----------------------------------------------------------------------------------
# The kernel against the model, interpreted on CPU
# ----------------------------------------------------------------------------------

@pytest.mark.parametrize("window", [dict(window_left=128),  # causal band, CTA 1: 8 tiles
                                    dict(window_left=100, window_right=37, causal=False),
                                    dict(window_left=None, causal=False)])
@pytest.mark.parametrize("rescale", ["lazy", "lazy_unfixed"])
def test_kernel_matches_model_on_wide_scores(wide, window, rescale):
    # upstream's rescale_defer stays finite; the own-tile-max rebase drags rows into
    # overflow (NaN, inf) in every window shape, the -30 floor notwithstanding
    q, k, v = wide
    kernel, ref = both(q, k, v, rescale=rescale, **window)
    assert_matches_model(kernel, ref, v)
    if rescale == "lazy":
        assert torch.isfinite(kernel[0]).all() and torch.isfinite(kernel[1]).all()
    else:
        assert not torch.isfinite(kernel[0]).all() and torch.isfinite(kernel[0]).any()


def test_kernel_matches_model_threshold():
    # a threshold of 0 (every loop tile fires) and 30 (none does)
    q, k, v = inputs(512, 2, 1, 8.0, seed=1)
    outs = []
    for thr in (0.0, 30.0):
        kernel, ref = both(q, k, v, window_left=200, threshold=thr)
        assert_matches_model(kernel, ref, v)
        outs.append(kernel[0])
    assert not torch.equal(outs[0], outs[1])


def test_kernel_matches_model_without_a_loop_tile():
    # S = 256: one CTA, nt = 4, no ballot; the two policies are then the same schedule.
    # GQA 4:2 (heads 2 and 3 read kv head 1). Row 0 of head 3 sees one key, whose score
    # sits ~90 below the -30 floor: l is subnormal, its P packs to bf16 0, and
    # O * rcp(l) = 0 * inf = NaN, in the model and the kernel alike.
    q, k, v = inputs(256, 4, 2, 64.0, seed=2)
    runs = [both(q, k, v, window_left=64, rescale=r) for r in ("lazy", "lazy_unfixed")]
    for kernel, ref in runs:
        assert_matches_model(kernel, ref, v)
    (a, _), (b, _) = runs[0][0], runs[1][0]
    assert_same_masks("lazy vs lazy_unfixed", a, b)
    assert torch.equal(a.nan_to_num(), b.nan_to_num())
    assert torch.isnan(a[0, 0, 3]).all() and torch.isfinite(a[0, 1:]).all()


def test_kernel_floor_zeroes_rows_as_the_model():
    # Window (0, 0): row i sees key i alone. A score near -2000 (log2 units) sits far
    # below the -30 floor: P = 0, l = 0, out 0, LSE -inf; -500 gives P ~ 2**-34, still
    # v_i after rounding; +1 and +3 are v_i exactly.
    S = 256
    a = torch.tensor([1.0, -2000.0, -500.0, 3.0]).repeat(S // 4)
    q = torch.zeros(1, S, 1, 128)
    q[0, :, 0, 0] = a
    k = torch.zeros(1, S, 1, 128)
    k[..., 0] = 1.0
    v = torch.randn(1, S, 1, 128, generator=torch.Generator().manual_seed(3))
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    kernel, ref = both(q, k, v, window_left=0)
    assert_matches_model(kernel, ref, v)
    out, lse = kernel
    far = a == -2000
    assert (out[0, far].float() == 0).all() and (lse[0, 0, far] == -INF).all()
    assert torch.isfinite(lse[0, 0, ~far]).all() and torch.equal(out[0, a > 0], v[0, a > 0])


def test_kernel_against_band_reference():
    # Independent of the model: fp64 softmax over the band, with the model test's bounds
    # (Q*c and P rounded to bf16, the output once more; LSE off by u * max|score|).
    q, k, v = inputs(512, 2, 1, 2.0, seed=4)
    left, right = 150, 20
    out, lse = swa.forward(q, k, v, window_left=left, window_right=right, causal=False,
                           interpret=True)
    qf = q.double().permute(0, 2, 1, 3)
    kf = k.double().permute(0, 2, 1, 3).repeat_interleave(2, dim=1)
    vf = v.double().permute(0, 2, 1, 3).repeat_interleave(2, dim=1)
    s = qf @ kf.transpose(-1, -2) / math.sqrt(128)
    i, j = torch.arange(512)[:, None], torch.arange(512)[None, :]
    s = s.masked_fill(~((j >= i - left) & (j <= i + right)), -INF)
    ref = (torch.softmax(s, -1) @ vf).permute(0, 2, 1, 3)
    assert (out.double() - ref).abs().max().item() <= 6 * U * v.double().abs().max().item()
    smax = (qf.abs() @ kf.abs().transpose(-1, -2)).amax(-1) / math.sqrt(128)
    assert ((lse.double() - torch.logsumexp(s, -1)).abs() <= 2 * U * smax + 1e-4).all()


def test_rows_per_program_and_strides_do_not_change_results(wide):
    # One wave per program (the compiled default) equals the whole CTA: a ballot reads
    # only its own wave. Strided views equal their contiguous copies bit for bit.
    q, k, v = wide
    q_view = q[:, :, 1:2]  # one head of two: row stride 256
    q = q_view.contiguous()
    kw = dict(window_left=128, rescale="lazy_unfixed", interpret=True)
    a = swa.forward(q, k, v, **kw)
    assert not torch.isfinite(a[0]).all()
    b = swa.forward(q, k, v, rows_per_program=64, **kw)
    assert_same_masks("out", a[0], b[0])
    assert torch.equal(a[0].nan_to_num().view(torch.int16), b[0].nan_to_num().view(torch.int16))
    k_view = torch.stack([k, -k], -1).flatten(-2)[..., ::2]  # k itself, head-dim stride 2
    assert not (q_view.is_contiguous() or k_view.is_contiguous())
    c = swa.forward(q_view, k_view, v, **kw)
    assert torch.equal(a[0].nan_to_num().view(torch.int16), c[0].nan_to_num().view(torch.int16))
    assert torch.equal(a[1].nan_to_num().view(torch.int32), c[1].nan_to_num().view(torch.int32))


# ----------------------------------------------------------------------------------
# Traced mode
# ----------------------------------------------------------------------------------

@pytest.mark.parametrize("rescale", ["lazy", "lazy_unfixed"])
def test_trace_matches_model_tile_for_tile(wide, rescale):
    q, k, v = wide
    rows = [(0, h, r) for h in (0, 1) for r in range(0, 512, 5)] + [(0, 1, 300), (0, 1, 300)]
    tk, tm = traces(q, k, v, rows, window_left=128, rescale=rescale)
    assert_traces_match(tk, tm)
    st = tm.steps
    assert st.fire.any() and st.swept.any()
    # CTA 0 walks 4 tiles from column 0, CTA 1 eight from column 0 (its band is clamped)
    assert st[st.row < 256].step.max() == 3 and st[st.row >= 256].step.max() == 7
    if rescale == "lazy":
        assert (st["corr"] <= 1).all() and tk.lanes.out_finite.all()
    else:
        assert (st["corr"] > 1).any() and not tk.lanes.out_finite.all()


def test_trace_of_a_band_that_starts_inside_the_sequence():
    # S = 1024, window 128: CTA 1 walks columns 128..639, CTA 3 is clamped to 512..1023
    q, k, v = inputs(1024, 1, 1, 16.0, seed=5)
    rows = [(0, 0, r) for r in (10, 300, 800, 1023)]
    tk, tm = traces(q, k, v, rows, window_left=128, rescale="lazy_unfixed")
    assert_traces_match(tk, tm)
    assert tk.lane(1).col0.tolist() == [128 + 64 * t for t in range(8)]
    assert tk.lane(2).col0.tolist() == [512 + 64 * t for t in range(8)]


# ----------------------------------------------------------------------------------
# The api: swa_attn_func(backend=...)
# ----------------------------------------------------------------------------------

def test_swa_attn_func_backends():
    q, k, v = inputs(256, 2, 1, 8.0, seed=6)
    kw = dict(window_left=100, rescale="lazy_unfixed", return_lse=True)
    auto = fa_lab.swa_attn_func(q, k, v, **kw)  # CPU tensors: the model
    ref = model.forward(q, k, v, window_left=100, rescale="lazy_unfixed")
    assert torch.equal(auto[0], ref[0]) and torch.equal(auto[1], ref[1])
    assert all(torch.equal(a, b) for a, b in
               zip(fa_lab.swa_attn_func(q, k, v, backend="emulator", **kw), ref))
    kernel = fa_lab.swa_attn_func(q, k, v, backend="interpret", **kw)
    direct = swa.forward(q, k, v, window_left=100, rescale="lazy_unfixed", interpret=True)
    assert torch.equal(kernel[0], direct[0]) and torch.equal(kernel[1], direct[1])
    assert_matches_model(kernel, ref, v)


@pytest.mark.parametrize("kw, exc, words", [
    (dict(backend="cuda"), ValueError, "backend='cuda'"),
    (dict(backend=None), ValueError, "backend=None"),
    (dict(backend="triton"), ValueError, "backend='triton' needs CUDA"),
    (dict(backend="interpret", window_left=-1), ValueError, "window_left"),
    (dict(backend="interpret", rescale="eager"), ValueError, "rescale"),
    (dict(backend="interpret", rescale_threshold=math.nan), ValueError, "threshold"),
])
def test_swa_attn_func_bad_arguments(kw, exc, words):
    q, k, v = inputs(256, 2, 1, 1.0)
    with pytest.raises(exc) as e:
        fa_lab.swa_attn_func(q, k, v, **{"window_left": 16, **kw})
    assert words in str(e.value)


def _t(S=256, H=2, Hkv=1, D=128, dtype=torch.bfloat16):
    return torch.zeros(1, S, H, D, dtype=dtype), torch.zeros(1, S, Hkv, D, dtype=dtype)


@pytest.mark.parametrize("change, kw, exc, words", [
    (dict(dtype=torch.float16), {}, TypeError, "bfloat16"),
    (dict(D=64), {}, ValueError, "head dim"),
    (dict(S=300), {}, ValueError, "multiple of 256"),
    (dict(Hkv=3), {}, ValueError, "multiple of the kv heads"),
    ({}, dict(window_right=5), ValueError, "window_right"),
    ({}, dict(window_left=None), ValueError, "causal=False"),
    ({}, dict(window_left=2.0), TypeError, "window_left"),
    ({}, dict(causal=1), TypeError, "causal"),
    ({}, dict(threshold=-1.0), ValueError, "threshold"),
    ({}, dict(rescale="fa4_row"), ValueError, "rescale"),
    ({}, dict(recorder=object()), TypeError, "recorder must be"),
    ({}, dict(recorder=TraceRecorder([(0, 2, 0)], 2)), ValueError, "out of range"),
    ({}, dict(interpret="yes"), TypeError, "interpret must be a bool"),
    ({}, dict(interpret=False), ValueError, "needs CUDA/ROCm tensors"),
    ({}, dict(rows_per_program=48), ValueError, "rows_per_program"),
])
def test_bad_input_raises_before_launch(change, kw, exc, words):
    q, k = _t(**change)
    kw = {"window_left": 16, "interpret": True, **kw}
    with pytest.raises(exc) as e:
        swa.forward(q, k, k.clone(), **kw)
    assert words in str(e.value)


def test_skv_must_equal_sq():
    q, _ = _t()
    _, k = _t(S=512)
    with pytest.raises(ValueError, match="seq_len_q == seq_len_kv"):
        swa.forward(q, k, k, window_left=16, interpret=True)


# ----------------------------------------------------------------------------------
# GPU: the compiled kernel (skipped without CUDA/ROCm)
# ----------------------------------------------------------------------------------

GPU_WINDOWS = {"causal_256": dict(window_left=256),
               "two_sided": dict(window_left=300, window_right=100, causal=False),
               "none": dict(window_left=None, causal=False)}


@pytest.fixture(scope="module")
def gpu_inputs():
    return inputs(2048, 8, 2, 64.0, seed=7, device="cuda")  # GQA 8:2, K x64


@pytest.mark.gpu
@pytest.mark.usefixtures("exact_dots")
@pytest.mark.parametrize("window", sorted(GPU_WINDOWS))
@pytest.mark.parametrize("rescale", ["lazy", "lazy_unfixed"])
def test_gpu_kernel_matches_model(gpu_inputs, window, rescale):
    q, k, v = gpu_inputs
    kw = dict(rescale=rescale, **GPU_WINDOWS[window])
    kernel = swa.forward(q, k, v, **kw)
    assert_matches_model(kernel, model.forward(q, k, v, **kw), v)
    if rescale == "lazy":  # only rows whose l underflows (few visible keys) are NaN
        assert torch.isfinite(kernel[0]).float().mean() > 0.99
    else:
        assert torch.isnan(kernel[0]).any()


@pytest.mark.gpu
def test_gpu_swa_attn_func_auto_runs_the_kernel(gpu_inputs):
    q, k, v = gpu_inputs
    kw = dict(window_left=256, rescale="lazy_unfixed")
    auto = fa_lab.swa_attn_func(q, k, v, return_lse=True, **kw)
    direct = swa.forward(q, k, v, **kw)
    assert torch.equal(auto[0].nan_to_num(), direct[0].nan_to_num())
    assert_same_masks("out", auto[0], direct[0])


@pytest.mark.gpu
@pytest.mark.usefixtures("exact_dots")
def test_gpu_trace_matches_model():
    q, k, v = inputs(1024, 2, 1, 64.0, seed=8, device="cuda")
    rows = [(0, h, r) for h in (0, 1) for r in range(0, 1024, 3)]
    for rescale in ("lazy", "lazy_unfixed"):
        assert_traces_match(*traces(q, k, v, rows, interpret=False, window_left=256,
                                    rescale=rescale))

