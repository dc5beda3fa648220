"""The sliding-window decode model (``fa_lab.kernels.pa_decode.swa``) through
``fa_lab.decode.pa_decode_ps_launch(sliding_window=W)``: against an fp64 reference with the
window applied, hand-computed windows and mass loss, the window's fully masked partitions
(the 985c653a class) in both versions, stale pages, dropped tiles, and bad input; and its
faithful Triton port against it: in Triton's interpreter on CPU at small sizes, compiled
on a GPU (``gpu``), with identical NaN/inf masks and finite values within one bf16 step
(the two sum in different fp32 orders)."""

import pytest
import torch

from fa_lab import decode
from fa_lab.kernels.pa_decode import cases, swa

MAIN, BEFORE = "main-11c4174d", "flydsl-985c653a^"
NEG_INF = float("-inf")


def make(ctx, **kw):
    kw.setdefault("num_q_heads", 2)
    kw.setdefault("num_kv_heads", 1)
    return cases.make(ctx, block_size=swa.PAGE, spare_pages=1, **kw)


def run(case, window, npart=None, *, upstream=MAIN, recorder=None, output=None, **kw):
    out = torch.empty_like(case.query) if output is None else output
    ql = case.query.shape[0] // case.context_lengths.shape[0]
    npart = swa.recommended_partitions(window, ql) if npart is None else npart
    path = decode.pa_decode_ps_launch(out, case.query, case.key_cache, case.value_cache,
                                      case.context_lengths, None, None, None, case.key_scale,
                                      case.value_scale, sliding_window=window,
                                      block_tables=case.block_tables,
                                      max_context_partition_num=npart, upstream=upstream,
                                      recorder=recorder, **kw)
    assert path == ("ps_sw_fused_partitioned" if npart == 1 else "ps_sw_partitioned")
    return out


def assert_close_to_reference(out, ref, case):
    """P's e4m3 pack (relative 2**-4, or absolute 2**-10 below the normals, P being at most
    1) and the two bf16 stores; averaged over the window their root mean square stays
    below 2**-8 of max |V|."""
    vmax = float(case.value_scale.max()) * 448
    err = (out.double() - ref).abs()
    assert torch.equal(out.isnan(), ref.isnan())
    fin = ~ref.isnan()
    assert float(err[fin].max()) <= 2.0 ** -4 * vmax + 2.0 ** -8 * float(ref[fin].abs().max())
    assert float(err[fin].pow(2).mean().sqrt()) < 2.0 ** -8 * vmax


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("ctx,ql,window,hd,trans_v", [
    ([700, 1500], 1, 300, 64, True), ([1030], 4, 772, 128, False), ([200, 9], 2, 100, 64, True),
    ([1279], 16, 1000, 64, True)])
def test_model_matches_fp64_reference(per_token, ctx, ql, window, hd, trans_v):
    case = make(ctx, query_length=ql, head_dim=hd, per_token=per_token, trans_v=trans_v,
                seed=ql + len(ctx))
    out = run(case, window)
    assert_close_to_reference(out, cases.reference(case, sliding_window=window), case)


def test_geometry_by_hand():
    # ctx 1030, QL 4, W 772: the union of windows starts at 254, in tile 0; 5 tiles visible
    assert swa.visible_tiles(1030, 4, 772) == (0, 5)
    assert swa.visible_tiles(1500, 1, 600) == (3, 3)   # start 899 -> tile 3; tiles 3..5
    assert swa.visible_tiles(0, 1, 100) == (0, 0)
    assert swa.recommended_partitions(600, 1) == 4     # 601 tokens touch at most 4 tiles
    assert swa.recommended_partitions(255, 1) == 2
    assert swa.partition_tiles(1500, 1, 600, 4) == [3, 4, 5, None]
    assert swa.partition_tiles(1500, 1, 600, 1) == [3]
    assert swa.partition_tiles(0, 1, 100, 1) == [0]
    assert swa.dropped_tiles(1500, 1, 600, 2) == 1
    # row qi sees ctx - QL - W + qi <= t < ctx + 1 - QL + qi: W + 1 tokens
    assert swa.window_bounds(10, 2, 1, 3) == ([5, 6], [9, 10])


def test_uniform_scores_average_the_window_exactly():
    # K = 0: every visible score is 0, P = 1 (exact in e4m3), so each row is the mean of
    # V over its W + 1 tokens, rounded to bf16 (partials) and bf16 again (the reduce)
    case = make([600], query_length=2, seed=1)
    case.key_cache.view(torch.uint8).zero_()
    out = run(case, 299)
    k, v = swa.logical_kv(case.key_cache, case.value_cache)
    vv = v[case.block_tables[0, 0].long(), 0].double() * float(case.value_scale)
    for qi in range(2):
        want = vv[600 - 2 - 299 + qi:600 + 1 - 2 + qi].mean(0)
        assert torch.allclose(out[qi, 0].double(), want, rtol=2.0 ** -6, atol=1e-3)


def _spread_case(per_token):
    """One tile of 256 tokens, V = 1 everywhere, Q = 1: token 0's key is 1 and the others'
    0.09375, so with D 64 and scale 1/8 the scores are 8 and 0.75; P = e^-7.25 = 2**-10.46
    for the 255 others."""
    case = make([256], head_dim=64, per_token=per_token, seed=2)
    case.query.fill_(1.0)
    pg = int(case.block_tables[0, 0])
    one, small = torch.tensor(1.0).to(torch.float8_e4m3fn), torch.tensor(0.09375).to(torch.float8_e4m3fn)
    case.key_cache[pg] = small
    case.key_cache[pg, :, :, 0] = one
    case.value_cache.fill_(1.0)  # the byte of 1.0 in every V slot
    case.key_scale.fill_(1.0)
    case.value_scale.fill_(1.0)
    return case


def test_per_tensor_p_cast_loses_mass():
    # per tensor, P enters e4m3 in (0, 1]: the 255 small P (below 2**-10) flush to 0
    # while the sum keeps them, so the output is 1 / (1 + 255 e^-7.25) instead of 1
    out = run(_spread_case(False), 255)
    lost = 1.0 / (1.0 + 255 * torch.exp(torch.tensor(-7.25, dtype=torch.float64)))
    assert abs(float(out[0, 0, 0]) - float(lost)) < 2.0 ** -8
    assert float(lost) < 0.85
    # per token, P is scaled by 240 / max V scale first: the mass is kept
    assert abs(float(run(_spread_case(True), 255)[0, 0, 0]) - 1.0) < 2.0 ** -7


@pytest.mark.parametrize("upstream", [MAIN, BEFORE])
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("ctx,ql,window", [([257], 4, 300), ([1030], 4, 772)])
def test_window_masked_partitions_stay_finite(upstream, per_token, ctx, ql, window):
    # early MTP rows see nothing of the last tile (ctx 257) or late rows nothing of the
    # first (union start 254, row 3 starts at 257): the 985c653a shape. The kernel masks
    # with -inf and guards every base, so those partitions store (max -inf, sum 0, out 0)
    case = make(ctx, query_length=ql, per_token=per_token, seed=3)
    rec = {}
    out = run(case, window, upstream=upstream, recorder=rec)
    empty_tiles = torch.tensor([[t is None for t in ts] for ts in rec["tiles"]])
    masked = (rec["pmax"] == NEG_INF) & ~empty_tiles[:, None, :, None]
    assert int(masked.sum()) >= 4
    assert float(rec["psum"][masked].abs().max()) == 0.0
    assert float(rec["pout"][masked].abs().max()) == 0.0
    assert not out.isnan().any()
    assert_close_to_reference(out, cases.reference(case, sliding_window=window), case)


def test_stale_nan_before_the_window_poisons_only_a_visible_tile():
    case = make([900], seed=5)  # W 300: tiles 2 and 3 visible, the window starts at 599
    base = run(case, 300)
    pg = int(case.block_tables[0, 0])
    v = case.value_cache.view(torch.uint8)  # trans_v: [nb, hkv, 64 groups of 16 tokens, D, 16]
    v[pg, :, 0:10] = 0x7F                   # tokens 0..159: tile 0, never read
    assert torch.equal(run(case, 300), base)
    v[pg, :, 33] = 0x7F                     # tokens 528..543: tile 2, masked, P = 0, 0 * NaN
    assert run(case, 300).isnan().all()


def test_too_few_partitions_drop_the_newest_tiles():
    case = make([1500], seed=6)
    ref = cases.reference(case, sliding_window=600)
    errs = {}
    for npart in (4, 2, 1):
        rec = {}
        out = run(case, 600, npart, recorder=rec)
        assert rec["dropped"] == [max(0, 3 - npart)]
        errs[npart] = float((out.double() - ref).abs().max())
    assert errs[4] < 0.02 < 0.1 < errs[2] < errs[1]


def test_empty_context_fused_is_zero_partitioned_is_nan():
    case = make([0, 300], seed=4, per_token=True)
    fused = run(case, 100, 1)
    assert torch.equal(fused[0], torch.zeros_like(fused[0]))
    split = run(case, 100, 2)
    assert split[0].isnan().all() and not split[1].isnan().any()


def test_partition_buffers_and_view():
    case = make([700], query_length=2, seed=7)
    es, ml = torch.empty(1, 1, 3, 4), torch.empty(1, 1, 3, 4)
    to = torch.empty(1, 1, 3, 4, 64, dtype=torch.bfloat16)
    out = run(case, 300, 3, exp_sums=es, max_logits=ml, temporary_output=to)
    view = decode.partitions(case.query, case.key_cache, case.value_cache, case.block_tables,
                             case.context_lengths, case.key_scale, case.value_scale,
                             sliding_window=300, num_partitions=3)
    assert torch.equal(view["output"], out)
    assert torch.equal(view["pmax"], ml) and torch.equal(view["psum"], es)
    assert view["pmax_units"] == "natural" and view["tiles"] == [[1, 2, None]]
    assert torch.equal(ml[0, 0, 2], torch.full((4,), NEG_INF)) and (es[0, 0, 2] == 0).all()


def test_zero_partitions_follow_the_version():
    case = make([700], seed=8)
    with pytest.raises(ValueError, match="max_context_partition_num"):
        run(case, 300, 0, upstream=MAIN)
    before = run(case, 300, 0, upstream=BEFORE)  # the parent takes the recommended count
    assert torch.equal(before, run(case, 300, swa.recommended_partitions(300, 1)))


@pytest.fixture(scope="module")
def base():
    return make([700, 40], query_length=2, num_q_heads=4, num_kv_heads=2)


@pytest.mark.parametrize("change,exc,word", [
    (dict(sliding_window=-1), ValueError, "sliding_window"),
    (dict(sliding_window=2.5), ValueError, "sliding_window"),
    (dict(max_context_partition_num=65), ValueError, "max_context_partition_num"),
    (dict(max_context_partition_num=True), ValueError, "max_context_partition_num"),
    (dict(block_tables=None), ValueError, "block_tables"),
    (dict(block_tables="short"), ValueError, "block_tables"),
    (dict(block_tables="bad_id"), ValueError, "block_tables"),
    (dict(key_cache="pages16"), ValueError, "key_cache"),
    (dict(query="hd256"), ValueError, "head_dim"),
    (dict(query="ql17"), ValueError, "query_length"),
    (dict(key_scale="per_token_wrong"), ValueError, "key_scale"),
    (dict(output="f16_fused"), ValueError, "output"),
    (dict(recorder=[]), TypeError, "recorder"),
    (dict(exp_sums=torch.empty(3)), ValueError, "exp_sums"),
])
def test_bad_input_is_refused_by_name(base, change, exc, word):
    out, q, kc, vc, bt, ctx, ks, vs = base.args()
    kw = dict(sliding_window=300, block_tables=bt, max_context_partition_num=3)
    key = next(iter(change))
    val = change[key]
    if val == "short":
        val = bt[:, :0]
    elif val == "bad_id":
        val = bt.clone().fill_(10 ** 6)
    elif val == "pages16":
        kc = torch.zeros(4, 2, 4, 16, 16, dtype=torch.float8_e4m3fn)
        vc = torch.zeros(4, 2, 1, 64, 16, dtype=torch.float8_e4m3fn)
    elif val == "hd256":
        q = torch.zeros(4, 4, 256, dtype=torch.bfloat16)
        out = q.clone()
    elif val == "ql17":
        q = torch.zeros(34, 4, 64, dtype=torch.bfloat16)
        out = q.clone()
    elif val == "per_token_wrong":
        ks = vs = torch.ones(kc.shape[0], 2, 16)
    elif val == "f16_fused":
        q, out = q.half(), out.half()
        kw["max_context_partition_num"] = 1
    if key in kw or key in ("recorder", "exp_sums"):
        if not isinstance(val, str):
            kw[key] = val
    with pytest.raises(exc, match=word):
        decode.pa_decode_ps_launch(out, q, kc, vc, ctx, None, None, None, ks, vs, **kw)


# -- the faithful port ---------------------------------------------------------------------

def assert_matches(port, ref):
    assert torch.equal(port.isnan(), ref.isnan())
    assert torch.equal(port.isinf(), ref.isinf())
    fin = ref.isfinite()
    diff = (port.float() - ref.float()).abs()[fin]
    assert bool((diff <= 2.0 ** -7 * ref.float().abs()[fin] + 1e-6).all())


def stale_nan(case):
    """NaN in V of tokens 528..543 of sequence 0: before a window of 300 over a context of
    900, inside its first visible tile (tile 2)."""
    case.value_cache.view(torch.uint8)[int(case.block_tables[0, 0]), :, 33] = 0x7F
    return case


def stale_inf_scale(case):
    """An infinite per-token V scale at token 260 of a context of 700 (tile 1, before a
    window of 300 that starts at 399): the tile's V-scale max reads it (t < ctx)."""
    case.value_scale[int(case.block_tables[0, 0]), :, 260] = float("inf")
    return case


CASES = [  # (context_lengths, query_length, window, partitions, per_token, dtype, poison)
    ([700], 1, 300, None, False, torch.bfloat16, None),
    ([257], 4, 300, None, True, torch.bfloat16, None),    # window-masked partitions
    ([0, 300], 1, 100, 1, True, torch.bfloat16, None),    # fused: an empty context is 0
    ([0, 300], 2, 100, 2, False, torch.float16, None),    # partitioned: it is NaN
    ([900], 1, 300, 3, False, torch.bfloat16, stale_nan),
    ([700], 1, 300, 3, True, torch.bfloat16, stale_inf_scale),
]


@pytest.mark.parametrize("ctx,ql,window,npart,per_token,dtype,poison", CASES)
def test_interpreter_matches_model(ctx, ql, window, npart, per_token, dtype, poison):
    case = make(ctx, query_length=ql, per_token=per_token, dtype=dtype, seed=ql + len(ctx))
    if poison is not None:
        poison(case)
    ref = run(case, window, npart)
    port = run(case, window, npart, backend="interpret")
    assert_matches(port, ref)
    if poison is not None or npart == 2:
        assert port.isnan().any()


@pytest.mark.gpu
@pytest.mark.parametrize("version", [MAIN, BEFORE])
@pytest.mark.parametrize("per_token", [False, True])
def test_compiled_matches_model(version, per_token):
    case = make([257, 1500, 3000, 40], query_length=4, num_q_heads=8, num_kv_heads=2,
                head_dim=128, per_token=per_token, seed=1)
    npart = swa.recommended_partitions(700, 4)
    ref = run(case, 700, npart, upstream=version)
    dev = type(case)(*[t.cuda() for t in (case.query, case.key_cache, case.value_cache,
                                          case.block_tables, case.context_lengths,
                                          case.key_scale, case.value_scale)])
    port = run(dev, 700, npart, upstream=version, backend="triton")
    assert_matches(port.cpu(), ref)
