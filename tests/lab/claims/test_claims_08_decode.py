"""The sentences of lesson 08 (notebooks/08_decode.ipynb), computed again: each test recomputes
the numbers its markdown states, on its own inputs (its CPU defaults), so that a change to the
package that makes a sentence false fails here. The lessons keep only the asserts that check
the learner (fa_lab.lab.exercises); tests/lab/claims/ holds one file per lesson."""

import math

import pytest
import torch

for _extra in ("plotly", "ipywidgets", "anywidget"):  # fa_lab.lab needs the [lab] extra
    pytest.importorskip(_extra, reason="fa_lab.lab needs the [lab] extra")


# ---- lesson 08: partitions, the merge, the empty row, the sentinel cancellation ------------

_DECODE_MAIN, _DECODE_BEFORE = "main-11c4174d", "flydsl-985c653a^"


def test_08_partitions_and_upstreams_default():
    """Section 1's table and line: 900 tokens make ceil(900 / 256) = 4 tiles, and 3 partitions
    of ceil(4 / 3) = 2 tiles leave the third the empty range (4, 4); upstream's default is 8
    partitions for one sequence on one KV head and 4 for 64 sequences on 8."""
    from fa_lab import decode
    from fa_lab.kernels.pa_decode import model

    tiles = math.ceil(900 / 256)
    per = math.ceil(tiles / 3)
    assert tiles == 4 and model.partition_tiles(900, 3) == [
        (min(p * per, tiles), min((p + 1) * per, tiles)) for p in range(3)] == [(0, 2), (2, 4), (4, 4)]
    assert decode.recommended_splits(1, 1, 64) == 8 and decode.recommended_splits(64, 8, 64) == 4


def test_08_the_merge_by_hand():
    """Section 1's eight scores: the three partitions' merge is one softmax over all eight
    (60.440725781844) and its LSE the logsumexp (9.075944055342); e^(LSE_p - LSE) is each
    weight, and the partition holding the 9 weighs 0.9442."""
    x = torch.tensor([3., 1., 4., 1., 5., 9., 2., 6.], dtype=torch.float64)
    val = torch.tensor([10., 20., 30., 40., 50., 60., 70., 80.], dtype=torch.float64)
    parts = [(x[a:b], val[a:b]) for a, b in ((0, 3), (3, 6), (6, 8))]
    lse_p = torch.stack([torch.logsumexp(s, 0) for s, _ in parts])
    o_p = torch.stack([torch.softmax(s, 0) @ v for s, v in parts])
    lse = torch.logsumexp(lse_p, 0)
    w = torch.exp(lse_p - lse)
    full = (torch.softmax(x, 0) @ val).item()
    assert abs((w * o_p).sum().item() - full) < 1e-12 and abs(w.sum().item() - 1) < 1e-15
    assert f"{full:.12f}" == "60.440725781844" and f"{lse.item():.12f}" == "9.075944055342"
    assert int(w.argmax()) == 1 and round(w[1].item(), 4) == 0.9442 and x[3:6].max() == 9


def test_08_the_merge_on_the_model():
    """Section 1 on the model's partitions (900 tokens, NP 3): the weights by hand agree with
    the reduce's to fp32 rounding (5.96e-08), the hand merge with the bf16 output within one
    bf16 step (2.35e-04 of 3.91e-03), and the model is sixteen times farther (3.81e-03) from
    the fp64 reference than from the hand merge."""
    from fa_lab import decode
    from fa_lab.kernels.pa_decode import cases

    case = cases.make([900], num_q_heads=4, block_size=64, seed=2)
    rec = decode.partitions(case.query, case.key_cache, case.value_cache, case.block_tables,
                            case.context_lengths, case.key_scale, case.value_scale, num_partitions=3)
    pmax, psum, pout = rec["pmax"][0, 0], rec["psum"][0, 0], rec["pout"][0, 0]
    assert rec["tiles"][0][2][0] == rec["tiles"][0][2][1] and psum[2].eq(0).all()   # one empty
    scaled = psum * torch.exp(pmax - pmax.amax(0))
    w = scaled / scaled.sum(0)
    out = rec["output"][0].float()
    hand = ((w[..., None] * pout).sum(0) - out).abs().max().item()
    to_ref = (out.double() - cases.reference(case)[0]).abs().max().item()
    assert (w - rec["weights"][0, 0]).abs().max().item() < 1e-7
    assert f"{hand:.2e}" == "2.35e-04" and hand < 2 ** -8
    assert f"{to_ref:.2e}" == "3.81e-03" and round(to_ref / hand) == 16


@pytest.mark.parametrize("n", [1, 2])
def test_08_nothing_to_merge(n):
    """Section 2: a zero-length context gives 0 with one partition and NaN with two, as the
    closed form says for its two rows; the 5-token sequence beside it stays finite."""
    from fa_lab import decode
    from fa_lab.kernels.pa_decode import bound, cases

    zero = cases.make([0, 5], num_q_heads=2, block_size=16)
    out = decode.pa_decode_tile(*zero.args(), num_partitions=n)
    assert (out[0].isnan().all() if n > 1 else (out[0] == 0).all()).item()
    assert torch.isfinite(out[1]).all()
    assert bound.nan_rows(0, 1, 2, n) == [n > 1] * 2


def test_08_the_sentinel_cancellation():
    """Section 3's table and steps: before 985c653a rows 0-5 (qi <= 2, which cannot see the
    second tile's one token) sum exactly 256 masked P = 1 in partition 1 and every output row is
    NaN; on main those sums are 0 and nothing is NaN. Row 0's base is the sentinel times its
    scale (-1.032e+27, stored as pmax in log2 units), so P = exp2(0) = 1; 448 / 1e-8 = 4.48e10
    times it and the V scale (2.527e+08) packs to NaN in e4m3 without saturation."""
    from fa_lab import decode
    from fa_lab.kernels.pa_decode import cases, model
    from fa_lab.numerics import E4M3_MAX, e4m3, f32

    mtp = cases.make([257], query_length=4, num_q_heads=2, block_size=16, per_token=True, seed=11)
    runs = {v: decode.partitions(mtp.query, mtp.key_cache, mtp.value_cache, mtp.block_tables,
                                 mtp.context_lengths, mtp.key_scale, mtp.value_scale,
                                 num_partitions=2, upstream=v) for v in (_DECODE_BEFORE, _DECODE_MAIN)}
    before, after = runs[_DECODE_BEFORE], runs[_DECODE_MAIN]
    assert before["psum"][0, 0, 1].tolist() == [256.0] * 6 + [1.0, 1.0]
    assert before["pout"][0, 0, 1].isnan().any(-1).all() and before["output"].isnan().any(-1).all()
    assert (before["weights"][0, 0, 1, :6] == 0).all()
    assert after["psum"][0, 0, 1].tolist() == [0.0] * 6 + [1.0, 1.0]
    assert not after["output"].isnan().any()
    _, qs = model.quantize_q(mtp.query.float()[0:1, 0])
    m_row = -1e30 * f32(1 / math.sqrt(mtp.query.shape[-1]) * math.log2(math.e)) * qs[0].item()
    assert f"{m_row:.4g}" == "-1.032e+27"
    assert before["pmax"][0, 0, 1, 0].item() == pytest.approx(m_row, rel=1e-6)
    norm = E4M3_MAX / 1e-8
    packed = 1.0 * mtp.value_scale.reshape(-1)[0].item() * norm
    assert norm == 4.48e10 and f"{packed:.4g}" == "2.527e+08" and packed > E4M3_MAX
    assert math.isnan(e4m3(torch.tensor(packed), saturate=False).item())


def test_08_per_tensor_scales_never_had_it():
    """Section 3: the same case with per-tensor scales, before the fix, has no NaN row, and
    its output is within 0.0116 of the fp64 reference."""
    from fa_lab import decode
    from fa_lab.kernels.pa_decode import cases

    pt = cases.make([257], query_length=4, num_q_heads=2, block_size=16, per_token=False, seed=11)
    out = decode.pa_decode_tile(*pt.args(), num_partitions=2, upstream=_DECODE_BEFORE)
    assert not out.isnan().any()
    assert f"{(out.double() - cases.reference(pt)).abs().max().item():.3g}" == "0.0116"


def test_08_the_closed_form_around_the_tile_edges():
    """Section 3's grid (QL 4, G 2, NP 2): in both versions the model's NaN rows lie between
    nan_rows and possible_nan_rows on all 20 runs; before the fix a last tile of 1 to 3
    tokens kills all 8 rows when it starts its partition and 2 when it does not, a last tile
    of 4 one possible row; main has none."""
    from fa_lab import decode
    from fa_lab.kernels.pa_decode import bound, cases

    certain = {256: 0, 257: 8, 258: 8, 259: 8, 260: 0, 300: 0, 512: 0, 513: 8, 769: 2, 1025: 2}
    model_before = {**certain, 260: 1}
    for c in certain:
        mk = cases.make([c], query_length=4, num_q_heads=2, block_size=16, per_token=True, seed=c)
        for v in (_DECODE_BEFORE, _DECODE_MAIN):
            got = decode.pa_decode_tile(*mk.args(), num_partitions=2, upstream=v).reshape(8, -1).isnan().any(-1)
            lo = torch.tensor(bound.nan_rows(c, 4, 2, 2, upstream=v))
            hi = torch.tensor(bound.possible_nan_rows(c, 4, 2, 2, upstream=v))
            assert (got >= lo).all() and (got <= hi).all(), (c, v)
            assert int(lo.sum()) == (certain[c] if v == _DECODE_BEFORE else 0), (c, v)
            assert int(got.sum()) == (model_before[c] if v == _DECODE_BEFORE else 0), (c, v)


@pytest.mark.parametrize("ql", [1, 2, 4, 8, 16])
def test_08_try_this_one_query_row_never_has_it(ql):
    """Section 3's "Try this": before the fix, some context below 1300 gives NaN at every
    NP tried, unless QL = 1 (one query row sees every token: no tile is fully masked)."""
    from fa_lab.kernels.pa_decode import bound

    for n in (1, 2, 3, 8):
        hits = [c for c in range(1, 1300) if any(bound.nan_rows(c, ql, 2, n, upstream=_DECODE_BEFORE))]
        assert (len(hits) == 0) == (ql == 1), (ql, n)


@pytest.mark.slow
def test_08_the_search_finds_the_shape_blind():
    """Section 3's search (seed 3, 300 runs): it fails after 9 model runs and shrinks in 12 more
    to two tiles, the last of one token, two query positions, per-token scales; main passes
    the shrunk call."""
    from fa_lab.studies.adversary import decode as decode_space, decode_search

    found = decode_search.search(_DECODE_BEFORE, max_evals=300, budget_s=600, seed=3)
    assert found.found and found.evals_to_first == 9 and found.shrink_evals == 12
    s = found.shrunk
    assert (s.tiles, s.last, s.query_length, s.per_token) == (2, 1, 2, True)
    assert decode_space.judge(s, _DECODE_BEFORE).failed and not decode_space.judge(s, _DECODE_MAIN).failed
