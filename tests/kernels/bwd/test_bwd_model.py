"""The dQ and dK/dV models (FlyDSL's gfx950 backward) against fp64 autograd, their LSE
floor, the pre-scaled-Q variant, and every bad argument."""

import math

import pytest
import torch

from fa_lab.kernels.bwd import common, model
from fa_lab.kernels.bwd.dkdv import backward_dkdv, q_tiles_walked
from fa_lab.kernels.bwd.dq import backward_dq, tiles_walked

from _grads import attention64, inputs

# Max error over max |gradient|: bf16 packs of P and dS (2**-9 relative each), O and the
# outputs rounded to the input type. f16 has 3 more mantissa bits.
TOL = {torch.bfloat16: 2.0 ** -6, torch.float16: 2.0 ** -9}


def run_both(q, k, v, do, **kw):
    o64, lse64, dq64, dk64, dv64 = attention64(q, k, v, do, **kw)
    causal = kw.get("causal")
    mk = {n: kw[n] for n in ("bias", "keep", "dropout_p") if n in kw and kw[n] is not None}
    if "bias" in mk:
        mk["bias"] = mk["bias"].to(q.dtype)
    got = model.backward(q, k, v, o64.to(q.dtype), do, lse64.float(), causal=causal, **mk)
    return got, (dq64, dk64, dv64)


def assert_close(got, ref, dtype):
    for name, a, r in zip(("dq", "dk", "dv"), got, ref):
        assert torch.isfinite(a).all(), name
        err = (a.double() - r).abs().max().item()
        assert err <= TOL[dtype] * r.abs().max().item(), (name, err, r.abs().max().item())


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gradients_match_fp64_autograd(causal, dtype):
    q, k, v, do = inputs(1, 70, 90, 4, 2, 64, dtype=dtype)  # ragged tiles, GQA 2
    got, ref = run_both(q, k, v, do, causal=causal)
    assert_close(got, ref, dtype)


def test_gradients_match_fp64_head_dim_128_and_more_queries_than_keys():
    q, k, v, do = inputs(2, 96, 40, 2, 1, 128, seed=1)
    got, ref = run_both(q, k, v, do, causal=True)  # rows 0..55 see no key
    assert_close(got, ref, torch.bfloat16)
    assert (got[0][:, :56] == 0).all()  # the LSE floor: an empty row's dQ is exactly 0


def test_bias_and_dropout_follow_the_chain_rule():
    q, k, v, do = inputs(1, 64, 80, 2, 2, 64, seed=2)
    g = torch.Generator().manual_seed(3)
    bias = (torch.randn(64, 80, generator=g) * 2).bfloat16().float()
    keep = torch.rand(1, 2, 64, 80, generator=g) > 0.25
    got, ref = run_both(q, k, v, do, causal=False, bias=bias, keep=keep, dropout_p=0.25)
    assert_close(got, ref, torch.bfloat16)


def test_a_minus_inf_bias_masks_a_key():
    q, k, v, do = inputs(1, 32, 64, 1, 1, 64, seed=4)
    bias = torch.zeros(32, 64)
    bias[:, 5] = -math.inf
    got, ref = run_both(q, k, v, do, causal=False, bias=bias)
    assert_close(got, ref, torch.bfloat16)
    assert (got[1][:, 5] == 0).all() and (got[2][:, 5] == 0).all()


def test_the_lse_floor_is_what_keeps_an_empty_causal_row_finite():
    """TransformerEngine #3528's shape: causal, Sq > Skv, so the first Sq - Skv rows see no
    key and the forward writes LSE = -inf. dQ floors it at -3e38 (masked -inf minus it stays
    -inf, P = 0): zeros. Without the floor -inf - -inf is NaN, on exactly those rows."""
    q, k, v, do = inputs(1, 80, 48, 2, 2, 64, seed=5)
    o64, lse64, *_ = attention64(q, k, v, do, causal=True)
    lse = lse64.float()
    assert torch.isneginf(lse[..., :32]).all() and torch.isfinite(lse[..., 32:]).all()
    d = common.delta(o64.bfloat16(), do)
    with_floor = backward_dq(q, k, v, do, lse, d, causal=True)
    without = backward_dq(q, k, v, do, lse, d, causal=True, lse_floor=False)
    assert torch.isfinite(with_floor).all() and (with_floor[:, :32] == 0).all()
    assert torch.isnan(without[:, :32]).all() and torch.equal(without[:, 32:], with_floor[:, 32:])
    # dK/dV have no floor and need none: the causal select zeroes P after exp2(+inf)
    dk, dv = backward_dkdv(q, k, v, do, lse, d, causal=True)
    assert torch.isfinite(dk).all() and torch.isfinite(dv).all()


def test_a_block_whose_band_is_empty_walks_no_tile():
    # Sq - Skv = 200 empty rows: block 0 (rows 0..127) has end 0 + 128 - 200 < 0
    n = tiles_walked(328, 128, True, 128)
    assert (n[:128] == 0).all() and n[128] == 1 and n[-1] == 2
    assert (tiles_walked(100, 130, False, 128) == 3).all()
    q, k, v, do = inputs(1, 328, 128, 1, 1, 64, seed=6)
    lse = torch.full((1, 1, 328), -math.inf)
    d = torch.full((1, 1, 328), math.nan)  # even a NaN delta cannot reach an unwalked row
    dq = backward_dq(q, k, v, do, lse, d, causal=True, lse_floor=False)
    assert (dq[:, :128] == 0).all() and torch.isnan(dq[:, 128:200]).all()


def test_dkdv_walks_the_band_of_its_block_rounded_to_even_tiles():
    walk = q_tiles_walked(300, 300, True, 128)  # 5 q tiles of 64
    assert walk[0].tolist() == [True] * 6  # tiles 0..4, rounded up to 6 (a padding tile)
    assert walk[128].tolist() == [False, False, True, True, True, True]
    assert walk[256].tolist() == [False] * 4 + [True] * 2
    assert q_tiles_walked(10, 10, False, 128).shape == (10, 2)  # at least two tiles


def test_prescaled_q_costs_accuracy_at_a_large_scale():
    """The fold upstream removed: at sm_scale 1 it puts |S| * 2**-9 into the exponent."""
    q, k, v, do = inputs(1, 128, 128, 2, 2, 64, seed=7)
    o64, lse64, dq64, _, _ = attention64(q, k, v, do, causal=False, scale=1.0)
    d = common.delta(o64.bfloat16(), do)
    errs = [(backward_dq(q, k, v, do, lse64.float(), d, causal=False, softmax_scale=1.0,
                         prescale_q=fold).double() - dq64).abs().max().item() for fold in (True, False)]
    assert errs[0] > 3 * errs[1]


@pytest.mark.parametrize("bad, match", [
    (dict(dropout_p=1.0), "dropout_p must be in"),
    (dict(dropout_p=-0.1), "dropout_p must be in"),
    (dict(dropout_p=float("nan")), "dropout_p must be in"),
    (dict(dropout_p=True), "dropout_p must be a float"),
    (dict(dropout_p=0.1), "needs keep"),
    (dict(keep=torch.ones(1, 1, 8, 8, dtype=torch.bool)), "applies only with dropout_p"),
    (dict(bias=torch.zeros(3, 8).bfloat16()), "does not broadcast"),
    (dict(bias=torch.zeros(8, 8)), "bias must be torch.bfloat16"),
    (dict(causal=True, bias=torch.zeros(8, 8).bfloat16()), "bias together with causal"),
    (dict(causal=1), "causal must be a bool"),
    (dict(lse=torch.zeros(1, 1, 7)), "lse must be fp32"),
    (dict(out=torch.zeros(1, 8, 1, 64)), "out must match q"),
    (dict(softmax_scale=-1.0), "softmax_scale must be"),
])
def test_bad_arguments_are_refused_by_name(bad, match):
    q, k, v, do = inputs(1, 8, 8, 1, 1, 64)
    kw = dict(q=q, k=k, v=v, out=do, dout=do, lse=torch.zeros(1, 1, 8), causal=False)
    kw.update(bad)
    scale = kw.pop("softmax_scale", None)
    with pytest.raises((ValueError, TypeError), match=match):
        if scale is not None:
            common.scales(64, scale)
        model.backward(**kw)


def test_fp32_inputs_are_refused_as_upstream_refuses_them():
    q, k, v, do = (x.float() for x in inputs(1, 8, 8, 1, 1, 64))
    with pytest.raises(TypeError, match="bf16/f16 only"):
        model.backward(q, k, v, do, do, torch.zeros(1, 1, 8), causal=False)


def test_block_sizes_are_checked():
    q, k, v, do = inputs(1, 8, 8, 1, 1, 64)
    lse, d = torch.zeros(1, 1, 8), torch.zeros(1, 1, 8)
    with pytest.raises(ValueError, match="block_m"):
        backward_dq(q, k, v, do, lse, d, causal=False, block_m=48)
    with pytest.raises(ValueError, match="block_kv"):
        backward_dkdv(q, k, v, do, lse, d, causal=False, block_kv=0)
