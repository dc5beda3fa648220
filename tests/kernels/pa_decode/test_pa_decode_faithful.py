"""The faithful Triton port of the paged decode against its model: in Triton's interpreter
on CPU at small sizes, and compiled on a GPU (``gpu``). Identical NaN/inf masks; finite
values within one bf16 step of the model's (the two sum in different fp32 orders, which
may move a value across a rounding boundary)."""

import pytest
import torch

from fa_lab import decode
from fa_lab.kernels.pa_decode import cases

MAIN, BEFORE = "main-11c4174d", "flydsl-985c653a^"


def assert_matches(port, ref):
    assert torch.equal(port.isnan(), ref.isnan())
    assert torch.equal(port.isinf(), ref.isinf())
    fin = ref.isfinite()
    diff = (port.float() - ref.float()).abs()[fin]
    assert bool((diff <= 2.0 ** -7 * ref.float().abs()[fin] + 1e-6).all())


CASES = [  # (context_lengths, query_length, q heads, page size, per_token, NP, version)
    pytest.param([300], 1, 2, 16, False, 2, MAIN, marks=pytest.mark.slow),
    ([257], 4, 2, 16, True, 2, BEFORE),   # the 985c653a NaN
    ([257], 4, 2, 16, True, 2, MAIN),
    ([130], 2, 16, 64, True, 1, MAIN),    # two M-tiles: the -inf path
    pytest.param([260], 2, 16, 64, False, 2, BEFORE, marks=pytest.mark.slow),
    ([0, 40], 1, 2, 16, False, 2, MAIN),  # an empty context: NaN from the reduce
]


@pytest.mark.parametrize("ctx,ql,hq,bs,per_token,npart,version", CASES)
def test_interpreter_matches_model(ctx, ql, hq, bs, per_token, npart, version):
    case = cases.make(ctx, query_length=ql, num_q_heads=hq, block_size=bs, per_token=per_token,
                      seed=ql + hq, trans_v=bs == 16)
    ref = decode.pa_decode_tile(*case.args(), num_partitions=npart, upstream=version)
    port = decode.pa_decode_tile(*case.args(), num_partitions=npart, upstream=version,
                                 backend="interpret")
    assert_matches(port, ref)
    if version == BEFORE and per_token:
        assert port.isnan().any()


@pytest.mark.gpu
@pytest.mark.parametrize("version", [MAIN, BEFORE])
@pytest.mark.parametrize("per_token", [False, True])
def test_compiled_matches_model(version, per_token):
    case = cases.make([257, 1500, 40], query_length=4, num_q_heads=8, num_kv_heads=2,
                      block_size=16, per_token=per_token, seed=1)
    ref = decode.pa_decode_tile(*case.args(), num_partitions=3, upstream=version)
    dev = [t.cuda() for t in case.args()]
    port = decode.pa_decode_tile(*dev, num_partitions=3, upstream=version, backend="triton")
    assert_matches(port.cpu(), ref)
    if version == BEFORE and per_token:
        assert port.isnan().any()
