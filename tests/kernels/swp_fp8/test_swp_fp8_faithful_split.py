"""The faithful port of FlyDSL #1097's fp8 path (``faithful_split``) against its model
(``split``): head dims (D, Dv), split-K and the combine, both unit contracts, the LSE;
interpreted on the CPU, compiled on a GPU."""

import sys
from pathlib import Path

import pytest
import torch

import fa_lab
from fa_lab.kernels.swp_fp8 import faithful_split, split

sys.path.insert(0, str(Path(__file__).parent))
from test_swp_fp8_faithful import assert_matches_model  # noqa: E402
from test_swp_fp8_split import fp8_case, policy  # noqa: E402


def pair(inputs, ds, *, device="cpu", causal=False, name="lazy", **kw):
    """(port out, port lse), (model out, model lse)."""
    inputs = tuple(t.to(device) for t in inputs)
    pol = policy(name, inputs[1].shape[1])
    port = faithful_split.forward_split(*inputs, **ds, causal=causal, policy=pol,
                                        interpret=device == "cpu", **kw)
    model = split.forward(*(t.cpu() for t in inputs), **ds, causal=causal, policy=pol, **kw)
    return tuple(t.cpu() for t in port), model


@pytest.mark.slow
def test_interpreted_d192_dv128_two_splits_matches_the_model():
    inputs, ds = fp8_case(32, 768, 192, 128, k_scale=4.0)  # 12 tiles: (0, 6), (6, 12)
    assert_matches_model(*pair(inputs, ds, num_kv_splits=2, causal=True))


@pytest.mark.slow
@pytest.mark.parametrize("D, Dv, splits, causal, name", [
    (192, 128, 1, False, "lazy"), (192, 128, 3, True, "eager"), (128, 64, 2, False, "lazy"),
    (192, 96, 2, True, "lazy_capped"), (128, 160, 3, False, "lazy_unfixed")])
def test_interpreted_matches_the_model(D, Dv, splits, causal, name):
    inputs, ds = fp8_case(64, 768, D, Dv, H=2, k_scale=4.0)
    assert_matches_model(*pair(inputs, ds, num_kv_splits=splits, causal=causal, name=name))


@pytest.mark.slow
def test_interpreted_raw_units_and_lse_without_headroom_match_the_model():
    inputs, ds = fp8_case(32, 1024, 128, 128, seed=3)
    assert_matches_model(*pair(inputs, ds, num_kv_splits=4, upstream="aiter-4676-raw-m"))
    assert_matches_model(*pair(inputs, ds, num_kv_splits=3, lse_headroom=False))


@pytest.mark.slow
def test_interpreted_nan_keys_give_the_models_masks():
    """A NaN key: NaN rows dense; under split-K the combine skips the NaN split (its l is
    not > 0), and the port does the same."""
    (q, k, v), ds = fp8_case(32, 1024, 192, 128, seed=4)
    k = k.clone()
    k[0, 700, 0, 5] = float("nan")  # a key of the second split (tiles 6-11)
    dense = pair((q, k, v), ds)
    assert torch.isnan(dense[1][0]).all()
    assert_matches_model(*dense)
    port, model = pair((q, k, v), ds, num_kv_splits=3)
    assert torch.isfinite(model[0]).all()
    assert_matches_model(port, model)


@pytest.mark.slow
def test_flash_attn_func_interpret_runs_the_port():
    inputs, ds = fp8_case(384, 512, 192, 128)
    kw = dict(**ds, num_kv_splits=2, causal=True, return_lse=True)
    assert fa_lab.api.plan(*inputs, **ds, num_kv_splits=2, backend="interpret").backend == "interpret"
    assert_matches_model(fa_lab.flash_attn_func(*inputs, backend="interpret", **kw),
                         fa_lab.flash_attn_func(*inputs, backend="emulator", **kw))


def test_the_port_refuses_a_trace_and_bad_dims_by_name():
    inputs, ds = fp8_case(32, 256, 192, 128)
    from fa_lab.trace import TraceRecorder
    with pytest.raises(ValueError, match="records no trace"):
        faithful_split.forward_split(*inputs, **ds, causal=False, policy=policy(), interpret=True,
                                     recorder=TraceRecorder.__new__(TraceRecorder))
    q, k, _ = inputs
    with pytest.raises(ValueError, match="v8 head dim Dv=100 is not supported"):
        faithful_split.forward_split(q, k, torch.zeros(1, 256, 1, 100).to(torch.float8_e4m3fn),
                                     **ds, causal=False, policy=policy(), interpret=True)
    with pytest.raises(ValueError, match="num_kv_splits must be >= 1"):
        faithful_split.forward_split(*inputs, **ds, causal=False, policy=policy(), interpret=True,
                                     num_kv_splits=0)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_compiled_matches_the_model(causal):
    for D, Dv, splits in ((192, 128, 1), (192, 128, 4), (128, 64, 3), (192, 192, 2)):
        for name in ("eager", "lazy", "lazy_unfixed"):
            inputs, ds = fp8_case(700, 3000, D, Dv, H=4, Hkv=2, k_scale=4.0, seed=D + splits)
            assert_matches_model(*pair(inputs, ds, device="cuda", causal=causal, name=name,
                                       num_kv_splits=splits))
    inputs, ds = fp8_case(64, 4096, 128, 128, seed=11)
    assert_matches_model(*pair(inputs, ds, device="cuda", num_kv_splits=4,
                               upstream="aiter-4676-raw-m"))
