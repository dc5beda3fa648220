"""The paged-attention decode model (``fa_lab.kernels.pa_decode.model``) against an fp64
reference, hand-computed merges and sentinels, page-table invariances, and the 985c653a
failure before and after its fix."""

import math

import pytest
import torch

from fa_lab import decode
from fa_lab.kernels.pa_decode import cases, model
from fa_lab.kernels.pa_decode.reduce import butterfly_sum, split_reduce
from fa_lab.numerics import f32

MAIN, BEFORE = "main-11c4174d", "flydsl-985c653a^"


def run(case, **kw):
    return decode.pa_decode_tile(*case.args(), **kw)


def assert_close_to_reference(out, ref, case):
    """The model's only roundings past the inputs' casts are P's e4m3 pack (relative 2**-4,
    which moves the weighted mean by at most 2**-4 of max |V|) and the bf16 output
    (2**-8 relative); averaged over the context, their root mean square stays below 2**-8
    of max |V|."""
    vmax = float(case.value_scale.max()) * 448  # the largest |V| (absmax / 448 scales)
    err = (out.double() - ref).abs()
    assert torch.equal(out.isnan(), ref.isnan())
    fin = ~ref.isnan()
    assert float(err[fin].max()) <= 2.0 ** -4 * vmax + 2.0 ** -8 * float(ref[fin].abs().max())
    rms = float(err[fin].pow(2).mean().sqrt())
    assert rms < 2.0 ** -8 * vmax, (rms, vmax)


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("ql,hq,bs,ctx,npart,trans_v", [
    (1, 4, 16, [300, 700], 3, True), (4, 4, 64, [513, 1000], 2, False), (3, 2, 16, [40], 1, True),
    (2, 16, 16, [600], 4, True)])
def test_model_matches_fp64_reference(per_token, ql, hq, bs, ctx, npart, trans_v):
    case = cases.make(ctx, query_length=ql, num_q_heads=hq, num_kv_heads=2 if hq > 2 else 1,
                      block_size=bs, per_token=per_token, trans_v=trans_v, seed=len(ctx) + ql)
    out = run(case, num_partitions=npart, upstream=MAIN)
    assert_close_to_reference(out, cases.reference(case), case)


def test_merge_by_hand():
    # two partitions, natural-log maxima 0 and -1: weights 2 : 4 e^-1 (exp2 of f32(log2 e))
    pmax = torch.tensor([[0.0], [-1.0]])
    psum = torch.tensor([[2.0], [4.0]])
    pout = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])
    rec = {}
    acc = split_reduce(pmax, psum, pout, recorder=rec)
    e = 2.0 ** -f32(math.log2(math.e))
    w = torch.tensor([2.0, 4.0 * e], dtype=torch.float64) / (2.0 + 4.0 * e)
    assert torch.allclose(acc[0].double(), w, rtol=1e-6, atol=0)
    assert torch.allclose(rec["weights"][:, 0].double(), w, rtol=1e-6, atol=0)
    # every partition empty: (-inf) - (-inf) is NaN, and so is the output
    empty = split_reduce(torch.full((2, 1), -math.inf), torch.zeros(2, 1), torch.zeros(2, 1, 2))
    assert empty.isnan().all()
    # a NaN partial at weight 0 still poisons the sum (0 * NaN)
    nanout = pout.clone()
    nanout[1] = math.nan
    assert split_reduce(torch.tensor([[0.0], [-200.0]]), psum, nanout).isnan().all()


def test_butterfly_sum_order():
    # lane butterfly over 4 lanes: (x0 + x2) + (x1 + x3); in order it would round to 1
    x = torch.tensor([2.0 ** -24, 1.0, 2.0 ** -24])
    assert float(butterfly_sum(x)) == 1.0 + 2.0 ** -23
    assert float((x[0] + x[1]) + x[2]) == 1.0


def test_lane_sum_order_and_partition_geometry():
    p = torch.zeros(1, 256)
    p[0, 0], p[0, 1], p[0, 2] = 1.0, 2.0 ** -24, 2.0 ** -24  # one lane's chunk, in order
    assert float(model.lane_sum(p)) == 1.0
    assert model.partition_tiles(1000, 3) == [(0, 2), (2, 4), (4, 4)]
    assert model.partition_tiles(0, 2) == [(0, 0), (0, 0)]
    assert model.row_bounds(10, 3, 2) == [8, 8, 9, 9, 10, 10]


@pytest.mark.parametrize("version", [MAIN, BEFORE])
def test_sentinel_partition_by_hand(version):
    # c = 257, QL = 2, NP = 2: partition 1 is tile 1 alone, holding token 256, which row
    # qi = 0 (bound 256) does not see. Before the fix its 256 masked P are exp2(0) = 1.
    case = cases.make([257], query_length=2, num_q_heads=1, block_size=16, seed=3)
    rec = {}
    run(case, num_partitions=2, upstream=version, recorder=rec)
    q8, qs = model.quantize_q(case.query.float()[:, 0])
    scale = f32(f32(f32(1 / 8 * model.LOG2E) * float(case.key_scale)) * float(qs[0]))
    m = f32(-1e30 * scale)
    if version == BEFORE:
        assert float(rec["psum"][0, 0, 1, 0]) == 256.0
        assert float(rec["pmax"][0, 0, 1, 0]) == m  # log2 units
    else:
        assert float(rec["psum"][0, 0, 1, 0]) == 0.0
        assert float(rec["pmax"][0, 0, 1, 0]) == f32(m * f32(1 / model.LOG2E))
    assert 0 < float(rec["psum"][0, 0, 1, 1]) <= 1.0  # row qi = 1 sees its one token
    assert float(rec["weights"][0, 0, 1, 0]) == 0.0


def test_before_version_merges_log2_maxima_as_natural():
    case = cases.make([700], num_q_heads=2, block_size=16, k_mult=3.0, seed=5)
    rec = {}
    before = run(case, num_partitions=3, upstream=BEFORE, recorder=rec)
    main = run(case, num_partitions=3, upstream=MAIN)
    pm, ps, po = rec["pmax"][0, 0], rec["psum"][0, 0], rec["pout"][0, 0]
    # the reduce reads log2 maxima as natural ones: weights exp2(log2 e * dm), not exp2(dm)
    wrong = split_reduce(pm, ps, po)
    assert torch.equal(before[0].float(), wrong.bfloat16().float())
    ref = cases.reference(case)
    assert (before.double() - ref).abs().max() > 2 * (main.double() - ref).abs().max()


def permuted(case, seed=7):
    """The same logical cache with its physical pages moved (and the table with them)."""
    nb = case.key_cache.shape[0]
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(seed))
    inv = torch.argsort(perm)
    c = cases.Case(case.query, case.key_cache[inv], case.value_cache[inv],
                   perm[case.block_tables.long()].to(torch.int32), case.context_lengths,
                   case.key_scale[inv] if case.key_scale.dim() > 1 else case.key_scale,
                   case.value_scale[inv] if case.value_scale.dim() > 1 else case.value_scale)
    return c


@pytest.mark.parametrize("per_token", [False, True])
def test_shuffled_page_table_equals_contiguous(per_token):
    case = cases.make([300, 520], query_length=2, num_q_heads=2, block_size=16,
                      per_token=per_token, shuffle=False, spare_pages=20)
    a = run(case, num_partitions=2)
    b = run(permuted(case), num_partitions=2)
    assert torch.equal(a, b)


def test_pages_past_the_tiles_are_never_read():
    case = cases.make([100], query_length=2, num_q_heads=2, block_size=16, spare_pages=24)
    a = run(case, num_partitions=1)
    read = set(case.block_tables[0, :16].tolist())  # one 256-token tile = 16 pages
    unread = [p for p in case.block_tables[0, 16:].tolist() if p not in read]
    assert unread
    case.key_cache.view(torch.uint8)[unread] = 0x7F  # NaN codes
    case.value_cache.view(torch.uint8)[unread] = 0x7F
    assert torch.equal(run(case, num_partitions=1), a)


def test_nan_in_the_last_tiles_tail():
    # K past context_len in the last tile is masked by a select: NaN there changes nothing.
    # V there meets P = 0 in the PV product, and 0 * NaN = NaN (upstream's MFMA, both versions).
    case = cases.make([100], num_q_heads=2, block_size=16, spare_pages=24)
    a = run(case, num_partitions=1)
    tail = case.block_tables[0, 7:16].long()  # tokens 112..255 of tile 0
    kc = case.key_cache.clone()
    case.key_cache.view(torch.uint8)[tail] = 0x7F
    assert torch.equal(run(case, num_partitions=1), a)
    case.key_cache = kc
    case.value_cache.view(torch.uint8)[tail] = 0x7F
    for version in (MAIN, BEFORE):
        assert run(case, num_partitions=1, upstream=version).isnan().all()


def test_985c653a_failure_before_and_after():
    # MTP: c = 257 leaves tile 1 with one token; rows qi < 3 see none of it, and with
    # NP = 2 it is their partition's first tile. Per-token scales, one M-tile (8 rows).
    case = cases.make([257], query_length=4, num_q_heads=2, block_size=16, per_token=True, seed=11)
    before = run(case, num_partitions=2, upstream=BEFORE)
    after = run(case, num_partitions=2, upstream=MAIN)
    assert before.isnan().any(dim=2).all()  # every row: NaN P packs reach every partial
    assert not after.isnan().any()
    assert_close_to_reference(after, cases.reference(case), case)
    # per-tensor scales: the P of 1 packs to 448, finite, and the merge weighs it 0
    pt = cases.make([257], query_length=4, num_q_heads=2, block_size=16, seed=11)
    assert not run(pt, num_partitions=2, upstream=BEFORE).isnan().any()


def test_zero_context():
    case = cases.make([0, 5], query_length=1, num_q_heads=2, block_size=16)
    one = run(case, num_partitions=1)
    assert torch.equal(one[0], torch.zeros_like(one[0]))
    assert run(case, num_partitions=2)[0].isnan().all()  # every partition -inf


def test_recorder_partitions_and_merge():
    case = cases.make([900], query_length=2, num_q_heads=2, block_size=64, seed=2)
    rec = {}
    out = run(case, num_partitions=3, recorder=rec)
    assert rec["tiles"] == [[(0, 2), (2, 4), (4, 4)]]
    w = rec["weights"][0, 0]
    assert torch.allclose(w.sum(dim=0), torch.ones(4), atol=1e-6)
    assert float(w[2].abs().max()) == 0.0  # the empty partition
    merged = (rec["pout"][0, 0] * w[..., None]).sum(dim=0)
    assert torch.allclose(merged.reshape(2, 2, -1), out.float(), atol=2e-2)


def test_the_inf_path_correction_overflows_on_a_far_negative_first_tile():
    # main, more than 16 rows (the -inf path): the first tile a row sees in its partition
    # has max m_new; the correction is exp2(safe_prev - m_new) with safe_prev = 0 while m is
    # -inf, so m_new <= -128 gives inf, and l = 0 * inf = NaN (l.716-717, l.747-752). Here
    # c = 258, QL = 9, G = 2 (18 rows), NP = 2: partition 1 is tile 1, where row qi = 7 sees
    # token 256 alone, whose score is about -5170 log2 units.
    case = cases.make([258], query_length=9, num_q_heads=2, block_size=16, seed=4)
    case.query.fill_(1.0)
    case.key_scale.fill_(1.0)
    page = int(case.block_tables[0, 256 // 16])
    case.key_cache.view(torch.uint8)[page, :, :, 0, :] = 0xFE   # e4m3 -448
    ref = cases.reference(case)
    assert torch.isfinite(ref).all()
    out = run(case, num_partitions=2, upstream=MAIN)
    assert out[7].isnan().all() and not out[:7].isnan().any()
    # the sentinel path (before the fix; or 16 rows) starts m at -inf: exp2(-inf) = 0
    assert not run(case, num_partitions=2, upstream=BEFORE).isnan().any()
    assert not run(case, num_partitions=1, upstream=MAIN).isnan().any()
    rec = {}
    run(case, num_partitions=2, upstream=MAIN, recorder=rec)
    assert float(rec["pmax"][0, 0, 1, 14]) * model.LOG2E < -128 and rec["psum"][0, 0, 1, 14].isnan()
