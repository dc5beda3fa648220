"""The faithful Triton port of the backward against its models: bit for bit in Triton's
interpreter on CPU (identical NaN/inf masks included), and compiled on a GPU."""

import math

import pytest
import torch

from fa_lab.kernels.bwd import faithful, model

from _grads import attention64, inputs


def both(q, k, v, out, do, lse, **kw):
    return (faithful.backward(q, k, v, out, do, lse, interpret=True, **kw),
            model.backward(q, k, v, out, do, lse, **kw))


def assert_identical(got, want):
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert torch.equal(torch.isnan(a), torch.isnan(b)), name
        assert torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0)), name


@pytest.mark.parametrize("causal", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_port_equals_model_bit_for_bit(causal):
    q, k, v, do = inputs(1, 40, 70, 2, 1, 64, seed=1)  # ragged tiles, GQA 2
    out = inputs(1, 40, 70, 2, 1, 64, seed=2)[3]
    lse = torch.randn(1, 2, 40) * 2 + 4
    assert_identical(*both(q, k, v, out, do, lse, causal=causal))


@pytest.mark.slow
def test_port_equals_model_f16_head_dim_128_bias_and_dropout():
    q, k, v, do = inputs(1, 40, 70, 2, 2, 128, dtype=torch.float16, seed=3)
    o64, lse64, *_ = attention64(q, k, v, do, causal=False)
    g = torch.Generator().manual_seed(4)
    bias = (torch.randn(40, 70, generator=g) * 3).half()
    keep = torch.rand(1, 2, 40, 70, generator=g) > 0.3
    assert_identical(*both(q, k, v, o64.half(), do, lse64.float(), causal=False, bias=bias,
                           dropout_p=0.3, keep=keep))


def test_port_keeps_the_models_non_finite_masks():
    """Empty causal rows (LSE -inf), with and without the LSE floor, a NaN row of O (delta
    NaN) and a huge key (P overflows): the port's NaN and inf land where the model's do."""
    q, k, v, do = inputs(1, 72, 40, 1, 1, 64, seed=5)  # rows 0..31 see no key
    k[0, 3, 0, :] = 1e4
    o64, lse64, *_ = attention64(q, k, v, do, causal=True)
    out = o64.bfloat16()
    out[0, 50] = math.nan
    lse = lse64.float()
    lse[0, 0, 60] = 0.0  # an LSE far below the row's scores: P saturates to inf
    for floor in (True, False):
        got, want = both(q, k, v, out, do, lse, causal=True, lse_floor=floor)
        assert_identical(got, want)
        assert not torch.isfinite(want[0]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_compiled_port_matches_the_model(causal):
    from fa_lab.kernels import exact_dots

    q, k, v, do = (x.cuda() for x in inputs(2, 200, 300, 4, 2, 128, seed=6))
    o64, lse64, *_ = attention64(*(x.cpu() for x in (q, k, v, do)), causal=causal)
    out, lse = o64.bfloat16().cuda(), lse64.float().cuda()
    want = model.backward(q, k, v, out, do, lse, causal=causal)
    with exact_dots():
        exact = faithful.backward(q, k, v, out, do, lse, causal=causal)
    assert_identical(exact, want)
    fast = faithful.backward(q, k, v, out, do, lse, causal=causal)  # tensor-core dots
    for a, b in zip(fast, want):
        assert torch.isfinite(a).all()
        assert (a.float() - b.float()).abs().max() <= 2.0 ** -6 * b.float().abs().max()


def test_port_refuses_what_a_direct_caller_gets_wrong():
    q, k, v, do = inputs(1, 8, 8, 1, 1, 64)
    lse = torch.zeros(1, 1, 8)
    with pytest.raises(ValueError, match="CUDA/ROCm"):
        faithful.backward(q, k, v, do, do, lse, causal=False)
    with pytest.raises(ValueError, match="multiple of 64"):
        faithful.backward_dq(q, k, v, do, lse, lse, causal=False, interpret=True, block_m=96)
