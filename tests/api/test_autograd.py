"""Gradients through fa_lab.flash_attn_func (fa_lab.autograd): against fp64 autograd on
every backend that has them, the refusals, and the non-finite report."""

import math
import warnings

import pytest
import torch

import fa_lab
from fa_lab.autograd import nonfinite_report

from _grads import attention64, inputs


def grads(q, k, v, do, **kw):
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    out = fa_lab.flash_attn_func(qq, kk, vv, **kw)
    out.backward(do)
    return out, (qq.grad, kk.grad, vv.grad)


@pytest.mark.parametrize("backend", ["emulator", pytest.param("interpret", marks=pytest.mark.slow)])
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_agree_with_fp64_autograd(backend, causal):
    q, k, v, do = inputs(1, 40, 70, 2, 1, 64, seed=11)
    out, got = grads(q, k, v, do, causal=causal, backend=backend)
    o64, _, *ref = attention64(q, k, v, do, causal=causal)
    assert (out.double() - o64).abs().max() <= 2.0 ** -7 * o64.abs().max()
    for name, a, r in zip(("dq", "dk", "dv"), got, ref):
        assert a.dtype == torch.bfloat16 and a.shape == r.shape
        # the forward's own O and LSE (P packed, O rounded) plus the backward's packs
        assert (a.double() - r).abs().max() <= 2.0 ** -6 * r.abs().max(), name


@pytest.mark.slow
def test_the_interpreter_gives_the_models_gradients_bit_for_bit():
    q, k, v, do = inputs(1, 40, 70, 2, 2, 64, seed=12)
    _, a = grads(q, k, v, do, causal=True, backend="emulator", kernel="swp_bf16")
    _, b = grads(q, k, v, do, causal=True, backend="interpret", kernel="swp_bf16")
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_only_out_carries_a_gradient_and_no_grad_mode_is_plain():
    q, k, v, _ = inputs(1, 16, 16, 1, 1, 64)
    qq = q.clone().requires_grad_()
    out, lse = fa_lab.flash_attn_func(qq, k, v, return_lse=True, backend="emulator")
    assert out.requires_grad and not lse.requires_grad
    out.float().sum().backward()
    assert qq.grad is not None and torch.isfinite(qq.grad).all()
    with torch.no_grad():
        assert not fa_lab.flash_attn_func(qq, k, v, backend="emulator").requires_grad
    assert torch.equal(fa_lab.flash_attn_func(q, k, v, backend="emulator"), out.detach())


@pytest.mark.parametrize("kw, match", [
    (dict(backend="fast"), "gradients run on"),
    (dict(alibi_slopes=torch.zeros(1)), "alibi_slopes"),
    (dict(sink=torch.zeros(1)), "sink"),
    (dict(bias=torch.zeros(16, 16).bfloat16(), causal=True), "bias and causal"),
])
def test_what_upstreams_backward_lacks_is_refused_by_name(kw, match):
    q, k, v, _ = inputs(1, 16, 16, 1, 1, 64)
    with pytest.raises(ValueError, match=match):
        fa_lab.flash_attn_func(q.requires_grad_(), k, v, **{"backend": "emulator", **kw})


def test_fp8_varlen_and_a_bias_requiring_grad_are_refused():
    q, k, v, _ = inputs(1, 16, 16, 1, 1, 128)
    q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fa_lab.flash_attn_func(q8.requires_grad_(), k8, v8, q_descale=1.0, k_descale=1.0,
                               v_descale=1.0, backend="emulator")
    cu = torch.tensor([0, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match="varlen"):
        fa_lab.flash_attn_func(q[0].requires_grad_(), k[0], v[0], cu_seqlens_q=cu, cu_seqlens_kv=cu,
                               max_seqlen_q=16, backend="emulator")
    bias = torch.zeros(16, 16).bfloat16().requires_grad_()
    with pytest.raises(ValueError, match="bias requires grad"):
        fa_lab.flash_attn_func(q, k, v, bias=bias, causal=False, backend="emulator")


def test_a_bias_reaches_the_gradients():
    q, k, v, do = inputs(1, 32, 48, 1, 1, 64, seed=13)
    bias = (torch.randn(32, 48, generator=torch.Generator().manual_seed(1)) * 2).bfloat16()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, got = grads(q, k, v, do, causal=False, bias=bias, backend="emulator")
    _, _, *ref = attention64(q, k, v, do, causal=False, bias=bias.float())
    for a, r in zip(got, ref):
        assert (a.double() - r).abs().max() <= 2.0 ** -6 * r.abs().max()


def test_nonfinite_report_names_tensor_and_rows():
    g = torch.zeros(1, 4, 2, 8)
    g[0, 1, 1, 3] = math.nan
    g[0, 3, 0, 0] = math.inf
    rep = nonfinite_report(dq=g, dk=torch.zeros(1, 2, 1, 8))
    assert rep["dq"] == {"rows": [(0, 0, 3), (0, 1, 1)], "nan": 1, "inf": 1}
    assert rep["dk"] == {"rows": [], "nan": 0, "inf": 0}
    with pytest.raises(ValueError, match="dv must be"):
        nonfinite_report(dv=torch.zeros(3))


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_triton_backend_gradients_agree_with_fp64_autograd(causal):
    q, k, v, do = inputs(2, 300, 400, 4, 2, 128, seed=14)
    out, got = grads(*(x.cuda() for x in (q, k, v)), do.cuda(), causal=causal, backend="triton")
    _, _, *ref = attention64(q, k, v, do, causal=causal)
    for a, r in zip(got, ref):
        assert a.is_cuda and torch.isfinite(a).all()
        assert (a.double().cpu() - r).abs().max() <= 2.0 ** -6 * r.abs().max()


@pytest.mark.parametrize("which", ["k", "v"])
def test_requires_grad_on_any_fp8_input_is_refused(which):
    """Upstream has no fp8 backward: k or v alone requiring grad is refused as q is."""
    q, k, v, _ = inputs(1, 16, 16, 1, 1, 128)
    t = {n: x.to(torch.float8_e4m3fn) for n, x in zip("qkv", (q, k, v))}
    t[which].requires_grad_()
    with pytest.raises(ValueError, match="requires_grad on float8_e4m3fn"):
        fa_lab.flash_attn_func(t["q"], t["k"], t["v"], q_descale=1.0, k_descale=1.0,
                               v_descale=1.0, backend="emulator")


def test_dropout_p_is_not_an_argument_of_flash_attn_func():
    """flash_attn_func has no dropout (upstream's forward takes none): a caller coming from
    flash-attn who passes dropout_p gets a TypeError that names it."""
    q, k, v, _ = inputs(1, 16, 16, 1, 1, 64)
    with pytest.raises(TypeError, match="dropout_p"):
        fa_lab.flash_attn_func(q.requires_grad_(), k, v, dropout_p=0.1, backend="emulator")
