"""``fa_lab.decode``'s entry points: upstream's names and arguments, every bad input refused
by name before any work, the unmodelled paths refused."""

import pytest
import torch

from fa_lab import decode
from fa_lab.kernels.pa_decode import cases


@pytest.fixture
def case():
    return cases.make([100, 40], query_length=2, num_q_heads=4, num_kv_heads=2, block_size=16)


def test_ps_launch_runs_the_tile_path(case):
    out, q, kc, vc, bt, ctx, ks, vs = case.args()
    es = torch.empty(2, 2, 2, 4)
    ml, to = torch.empty_like(es), torch.empty(2, 2, 2, 4, 64, dtype=torch.bfloat16)
    path = decode.pa_decode_ps_launch(out, q, kc, vc, ctx, None, None, 0.125, ks, vs,
                                      block_tables=bt, max_context_partition_num=2,
                                      exp_sums=es, max_logits=ml, temporary_output=to)
    assert path == "ps_small_block"
    ref = decode.pa_decode_tile(torch.empty_like(out), q, kc, vc, bt, ctx, ks, vs, 0.125,
                                num_partitions=2)
    assert torch.equal(out, ref)
    assert es.isfinite().all() and (es[0] > 0).any()


def test_default_partitions_follow_upstream():
    assert decode.recommended_splits(1, 1, 16) == 8
    assert decode.recommended_splits(64, 8, 64) == 4


def _bad(case, **change):
    args = dict(zip(["output", "query", "key_cache", "value_cache", "block_tables",
                     "context_lengths", "key_scale", "value_scale"], case.args()))
    kw = {k: change.pop(k) for k in list(change) if k not in args}
    args.update(change)
    return lambda: decode.pa_decode_tile(*args.values(), **kw)


@pytest.mark.parametrize("change,exc,word", [
    (lambda c: dict(block_tables=c.block_tables[:, :5]), ValueError, "block_tables"),
    (lambda c: dict(block_tables=c.block_tables.clone().fill_(10 ** 6)), ValueError, "block_tables"),
    (lambda c: dict(block_tables=c.block_tables.clone().fill_(-1)), ValueError, "block_tables"),
    (lambda c: dict(block_tables=c.block_tables.long()), TypeError, "block_tables"),
    (lambda c: dict(key_cache=c.key_cache.reshape(c.key_cache.shape[0], 2, 4, 32, 8)),
     ValueError, "key_cache"),
    (lambda c: dict(query=c.query[:, :, :32].contiguous(), output=c.query[:, :, :32].clone()),
     ValueError, "head_dim"),
    (lambda c: dict(query=torch.zeros(34, 4, 64, dtype=torch.bfloat16),
                    output=torch.zeros(34, 4, 64, dtype=torch.bfloat16)), ValueError, "query_length"),
    (lambda c: dict(query=torch.zeros(4, 3, 64, dtype=torch.bfloat16),
                    output=torch.zeros(4, 3, 64, dtype=torch.bfloat16)), ValueError, "num_kv_heads"),
    (lambda c: dict(key_scale=torch.ones(2)), ValueError, "key_scale"),
    (lambda c: dict(key_scale=torch.ones(3, 2, 16), value_scale=torch.ones(3, 2, 16)),
     ValueError, "key_scale"),
    (lambda c: dict(key_scale=torch.ones(c.key_cache.shape[0], 2, 16)), ValueError, "value_scale"),
    (lambda c: dict(key_scale=torch.ones(1, dtype=torch.float64)), TypeError, "key_scale"),
    (lambda c: dict(context_lengths=c.context_lengths.long()), TypeError, "context_lengths"),
    (lambda c: dict(context_lengths=torch.tensor([100, -1], dtype=torch.int32)), ValueError,
     "context_lengths"),
    (lambda c: dict(output=c.query.float()), ValueError, "output"),
    (lambda c: dict(query=c.query.float(), output=c.query.float()), TypeError, "query"),
    (lambda c: dict(num_partitions=65), ValueError, "num_partitions"),
    (lambda c: dict(backend="cuda"), ValueError, "backend"),
    (lambda c: dict(upstream="fixed"), ValueError, "upstream"),
    (lambda c: dict(softmax_scale=float("nan")), TypeError, "softmax_scale"),
    (lambda c: dict(recorder=[]), TypeError, "recorder"),
    (lambda c: dict(pmax=torch.empty(3)), ValueError, "pmax"),
])
def test_bad_input_is_refused_by_name(case, change, exc, word):
    with pytest.raises(exc, match=word):
        _bad(case, **change(case))()


def test_page_size_and_unmodelled_paths(case):
    out, q, kc, vc, bt, ctx, ks, vs = case.args()
    k32 = torch.zeros(4, 2, 4, 32, 16, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="page size 32"):
        decode.pa_decode_tile(out, q, k32, vc, bt, ctx, ks, vs)
    with pytest.raises(ValueError, match="page size 32"):
        decode.pa_decode_ps_launch(out, q, k32, vc, ctx, None, None, 0.1, ks, vs,
                                   block_tables=bt, max_context_partition_num=2)
    k1024 = torch.zeros(1, 2, 4, 1024, 16, dtype=torch.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match="1024"):
        decode.pa_decode_ps_launch(out, q, k1024, vc, ctx, None, None, 0.1, ks, vs,
                                   block_tables=bt, max_context_partition_num=2)
    with pytest.raises(ValueError, match="page size 16 .*pa_decode_swa"):  # it addresses 1024
        decode.pa_decode_ps_launch(out, q, kc, vc, ctx, None, None, 0.1, ks, vs, sliding_window=64,
                                   block_tables=bt, max_context_partition_num=2)
    with pytest.raises(ValueError, match="max_context_partition_num"):
        decode.pa_decode_ps_launch(out, q, kc, vc, ctx, None, None, 0.1, ks, vs, block_tables=bt)
    with pytest.raises(ValueError, match="block_tables"):
        decode.pa_decode_ps_launch(out, q, kc, vc, ctx, None, None, 0.1, ks, vs,
                                   max_context_partition_num=2)
    with pytest.raises(ValueError, match="interpret"):  # CPU tensors cannot run compiled
        decode.pa_decode_tile(out, q, kc, vc, bt, ctx, ks, vs, backend="triton")


def test_partitions_view(case):
    out, q, kc, vc, bt, ctx, ks, vs = case.args()
    view = decode.partitions(q, kc, vc, bt, ctx, ks, vs, num_partitions=2,
                             upstream="flydsl-985c653a^")
    assert view["pmax_units"] == "log2"
    assert view["pmax"].shape == (2, 2, 2, 4) and view["weights"].shape == (2, 2, 2, 4)
    assert torch.equal(view["output"], decode.pa_decode_tile(out, q, kc, vc, bt, ctx, ks, vs,
                                                             num_partitions=2,
                                                             upstream="flydsl-985c653a^"))
