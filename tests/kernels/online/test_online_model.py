"""The online-softmax model (fa_lab.kernels.online.model): the plain softmax under the defaults, each
Semantics field against a hand-computed case, the recording, and every bad argument.

Most hand cases use ``softmax_scale = LOG2_UNITS`` (c = 1 exactly), so a score q.k is its
own log2-unit value and every P is a power of two that fp32 holds exactly."""

import math

import pytest
import torch

from fa_lab import Policy, policies as P, reference
from fa_lab.numerics import f32
from fa_lab.semantics import FLT_MAX, Semantics
from fa_lab.kernels.online.model import LOG2_UNITS, cast_p, epilogue_scale, forward, row_history

INF = math.inf


def pol(vote="tile", rebase="max", threshold=None, headroom=0.0, **sem):
    lazy = {} if threshold is None else {"threshold": threshold}  # an eager vote reads none
    return Policy(vote=vote, rebase=rebase, p_headroom=headroom, name="t",
                  semantics=Semantics(**sem), **lazy)


def row_case(scores, values, visible=None):
    """One query row (q = 1, D = 1) over keys whose log2-unit scores are ``scores``."""
    n = len(scores)
    k = torch.tensor(scores, dtype=torch.float32).reshape(1, n, 1, 1)
    v = torch.tensor(values, dtype=torch.float32).reshape(1, n, 1, 1)
    mask = None if visible is None else torch.tensor(visible).reshape(1, n)
    return torch.ones(1, 1, 1, 1), k, v, mask


def run(case, policy, **kw):
    q, k, v, mask = case
    rec = []
    out, lse = forward(q, k, v, policy=policy, mask=mask, softmax_scale=LOG2_UNITS, record=rec,
                       **kw)
    return float(out.flatten()[0]), float(lse.flatten()[0]), row_history(rec)


# -- the plain softmax under the defaults ---------------------------------------------------

@pytest.mark.parametrize("name", ["eager", "lazy", "fa4_row", "lazy_unfixed", "lazy_capped"])
@pytest.mark.parametrize("causal", [False, True])
def test_defaults_reproduce_the_reference(name, causal, gen):
    q = torch.randn(2, 70, 4, 16, generator=gen)
    k, v = (torch.randn(2, 150, 2, 16, generator=gen) for _ in range(2))
    ref_o, ref_l = reference.attention(q, k, v, causal=causal, dtype=torch.float64)
    out, lse = forward(q, k, v, policy=P.get(name), causal=causal)
    assert out.dtype == torch.float32 and out.shape == q.shape and lse.shape == (2, 4, 70)
    assert (out.double() - ref_o).abs().max() < 2e-6
    assert (lse.double() - ref_l).abs().max() < 2e-6


def test_masks_lengths_and_empty_sequences_match_the_reference(gen):
    """Bool and additive masks, per-sequence lengths, Skv = 0, bf16 inputs: the defaults
    with the tile max floored always (so a row that sees nothing gives 0 and -inf)."""
    safe = pol(tile_max_floor="always")
    q = torch.randn(2, 40, 2, 8, generator=gen)
    k, v = (torch.randn(2, 100, 2, 8, generator=gen) for _ in range(2))
    visible = torch.rand(40, 100, generator=gen) > 0.7
    visible[3] = False  # a row that sees nothing
    bias = torch.where(visible, torch.randn(40, 100, generator=gen), -INF)
    for mask in (visible, bias):
        out, lse = forward(q, k, v, policy=safe, mask=mask, seqlen_kv=[100, 37])
        for b, n in enumerate((100, 37)):
            add = torch.where(mask[:, :n], 0.0, -INF) if mask.dtype == torch.bool else mask[:, :n]
            ro, rl = reference.attention(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n], causal=False,
                                         bias=add.double(), dtype=torch.float64)
            assert (out[b:b + 1].double() - ro).abs().max() < 2e-6
            assert torch.equal(torch.isinf(lse[b:b + 1]), torch.isinf(rl))
            fin = torch.isfinite(rl)
            assert (lse[b:b + 1].double()[fin] - rl[fin]).abs().max() < 2e-6
        assert (out[:, 3] == 0).all() and (lse[:, :, 3] == -INF).all()
    empty = torch.zeros(1, 0, 2, 8)
    out, lse = forward(q[:1], empty, empty, policy=safe)
    assert (out == 0).all() and (lse == -INF).all()
    qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
    out, _ = forward(qb, kb, vb, policy=P.get("eager"))
    ref_o, _ = reference.attention(qb, kb, vb, causal=False)
    assert out.dtype == torch.bfloat16 and (out.float() - ref_o).abs().max() < 2e-2


def test_the_default_floor_is_causal_only():
    """FlyDSL's semantics: a non-causal row with nothing visible is NaN (its max stays
    -inf); causal rows floor the tile max at -3e38 and give 0 (hand: exp2(-inf + 3e38) = 0)."""
    case = row_case([0.0, 1.0], [1.0, 2.0], visible=[False, False])
    out, lse, hist = run(case, P.get("eager"))
    assert math.isnan(out) and math.isnan(lse) and hist[0]["mt"] == -INF
    q = torch.ones(1, 2, 1, 1)
    k = v = torch.ones(1, 1, 1, 1)  # causal, Sq > Skv: row 0 sees nothing
    rec = []
    out, lse = forward(q, k, v, policy=P.get("eager"), causal=True, record=rec)
    assert float(out[0, 0]) == 0.0 and float(lse[0, 0, 0]) == -INF
    assert float(rec[0].m[0, 0, 0]) == f32(-3e38) and float(rec[0].l[0, 0, 0]) == 0.0


# -- one hand case per field ----------------------------------------------------------------

def test_wave_rows_and_vote():
    """Row 0 jumps 20 at tile 1; row 40's tile 1 max (0) lies 10 below its running max. A
    32-row ballot leaves row 40 alone; a 64-row ballot fires for it too, and lazy_unfixed
    drags it: factor exactly 2^10. A per-row vote moves only row 0."""
    q = torch.zeros(1, 64, 1, 2)
    q[0, 0, 0, 0] = q[0, 40, 0, 1] = 1.0
    k = torch.zeros(1, 2, 1, 2)
    k[0, 1, 0, 0] = 20.0    # tile 1: row 0 scores 20
    k[0, 0, 0, 1] = 10.0    # tile 0: row 40 scores 10
    v = torch.ones(1, 2, 1, 2)
    for rows, vote, dragged in ((32, "wave", False), (64, "wave", True), (64, "row", False)):
        rec = []
        forward(q, k, v, policy=pol(vote, "tile", 8.0, wave_rows=rows, block_n=1),
                softmax_scale=LOG2_UNITS, record=rec)
        step = row_history(rec, row=40)[1]
        assert step["moved"] is dragged and step["factor"] == (1024.0 if dragged else 1.0)
        assert row_history(rec, row=0)[1]["factor"] == 2.0 ** -20


def test_o_gate():
    """Row 16 sees nothing in tiles 0-1 (factor exp2(-inf + inf) = NaN); row 0 jumps 5 at
    tile 1 (factor 2^-5). 'always' applies NaN; 'row' applies only factors < 1; 'wave'
    applies every factor of a wave in which some row has one < 1."""
    q = torch.zeros(1, 32, 1, 1)
    q[0, 0] = q[0, 16] = 1.0  # the other rows score 0 everywhere: factor 1 at tile 1
    k = torch.tensor([0.0, 5.0, 1.0]).reshape(1, 3, 1, 1)
    v = torch.ones(1, 3, 1, 1)
    mask = torch.ones(32, 3, dtype=torch.bool)
    mask[16, :2] = False
    expect = {  # (gate, wave_rows) -> row 16's O factor at tile 1
        ("always", 32): "nan", ("row", 32): 1.0, ("wave", 32): "nan", ("wave", 16): 1.0}
    for (gate, rows), want in expect.items():
        rec = []
        forward(q, k, v, policy=pol(o_gate=gate, wave_rows=rows, block_n=1), mask=mask,
                softmax_scale=LOG2_UNITS, record=rec)
        got = row_history(rec, row=16)[1]
        assert math.isnan(got["factor"])  # l takes the row's own factor whatever the gate
        assert (math.isnan(got["o_factor"]) if want == "nan" else got["o_factor"] == want)
        assert row_history(rec, row=0)[1]["o_factor"] == 2.0 ** -5


def test_mask_value_m_init_and_their_domain():
    """A finite sentinel at the max: masked columns weigh exp2(0) = 1 each. Scores -10 and
    -10 visible, two masked columns with V = 3 and 5, sentinel -10: out = (1+2+3+5)/4."""
    case = row_case([-10.0, -10.0, 0.0, 0.0], [1.0, 2.0, 3.0, 5.0], [True, True, False, False])
    out, lse, hist = run(case, pol(mask_value=-10.0, m_init=-10.0, tile_max_floor="never",
                                   block_n=4))
    assert out == 11.0 / 4 and lse == pytest.approx(-10 * math.log(2) + math.log(4), rel=1e-7)
    assert hist[0]["m_old"] == -10.0
    # in a 64-column tile the 60 padding columns hold the sentinel too: 11 / 64
    assert run(case, pol(mask_value=-10.0, m_init=-10.0, tile_max_floor="never"))[0] == 11 / 64
    # raw domain: c = 0.5 exactly (softmax_scale ln2 / 2), so -5e4 on the raw logit is -25000
    q, k, v, _ = row_case([0.0, 0.0], [1.0, 1.0])
    rec = []
    raw = pol(mask_value=-5e4, m_init=-6e4, mask_domain="raw", tile_max_floor="never")
    forward(q, k, v, policy=raw, mask=torch.tensor([[False, False]]), softmax_scale=LOG2_UNITS / 2,
            record=rec, seqlen_kv=2)
    assert float(rec[0].m_old) == -30000.0 and float(rec[0].mt) == -25000.0


def test_tile_max_floor_and_its_value():
    """An all-masked first tile: no floor gives NaN; 'always' floors the tile max at
    floor_value (hand: m = -1e30, the next tile's factor exp2(-1e30 - 2) = 0) and the row
    ends exactly as the softmax of its visible key: out = v = 7, lse = 2 ln 2."""
    case = row_case([9.0, 2.0], [1.0, 7.0], visible=[False, True])
    out, _, _ = run(case, pol(tile_max_floor="never", block_n=1))
    assert math.isnan(out)
    out, lse, hist = run(case, pol(tile_max_floor="always", floor_value=-1e30, block_n=1))
    assert (out, hist[0]["m"], hist[1]["factor"]) == (7.0, float(torch.tensor(-1e30)), 0.0)
    assert lse == pytest.approx(2 * math.log(2), rel=1e-7)


def test_empty_row_guard():
    """TensorRT-LLM's sentinel (-FLT_MAX) on a row that sees nothing: no guard gives every
    masked column weight 1 (out = mean of V = 2.5, lse = -FLT_MAX ln 2 + ln 4); 'zero_base'
    exponentiates against 0 (P = exp2(-FLT_MAX) = 0: out 0, lse -inf); 'skip' leaves the
    row untouched. An all-masked first tile with -inf: 'skip' and 'zero_base' recover the
    second tile's key exactly where 'none' gives NaN."""
    trt = dict(mask_value=-FLT_MAX, m_init=-FLT_MAX, tile_max_floor="never", epilogue_guard="one")
    case = row_case([0.0] * 4, [1.0, 2.0, 3.0, 4.0], [False] * 4)
    trt["block_n"] = 4  # a wider tile's padding columns would weigh 1 too (test_block_n...)
    out, lse, _ = run(case, pol(**trt))
    assert out == 2.5 and lse == pytest.approx(-FLT_MAX * math.log(2) + math.log(4), rel=1e-7)
    out, lse, _ = run(case, pol(empty_row_guard="zero_base", **trt))
    assert (out, lse) == (0.0, -INF)
    out, lse, hist = run(case, pol(empty_row_guard="skip", **trt))
    assert (out, lse, hist[0]["skipped"], hist[0]["l"]) == (0.0, -INF, True, 0.0)
    case = row_case([9.0, 2.0], [1.0, 7.0], visible=[False, True])
    for guard, want in (("none", None), ("zero_base", 7.0), ("skip", 7.0)):
        out, _, hist = run(case, pol(tile_max_floor="never", empty_row_guard=guard, block_n=1))
        assert math.isnan(out) if want is None else out == want
    assert hist[0]["skipped"] and hist[0]["factor"] == 1.0 and not hist[1]["skipped"]


def test_epilogue_guard():
    l = torch.tensor([0.0, math.nan, INF, 2.0])
    got = {g: epilogue_scale(l, g).tolist() for g in ("zero", "one", "none")}
    assert got["zero"] == [0.0, 0.0, 0.0, 0.5] and got["one"] == [1.0, 1.0, 0.0, 0.5]
    assert got["none"][0] == INF and math.isnan(got["none"][1]) and got["none"][2:] == [0.0, 0.5]
    # a row that sees nothing (floored, so O = 0 and l = 0): 0, 0, and 0 * inf = NaN
    case = row_case([1.0], [3.0], visible=[False])
    outs = {g: run(case, pol(tile_max_floor="always", epilogue_guard=g))[0]
            for g in ("zero", "one", "none")}
    assert outs["zero"] == 0.0 and outs["one"] == 0.0 and math.isnan(outs["none"])


def test_clamp_exp_diff():
    """An all-masked first tile, no floor: fmax(-inf - (-inf), -inf) = -inf, so the first
    factor and every masked P are 0, and the row ends as the softmax of its visible key."""
    case = row_case([9.0, 2.0], [1.0, 7.0], visible=[False, True])
    out, lse, hist = run(case, pol(tile_max_floor="never", clamp_exp_diff=True, block_n=1))
    assert (out, hist[0]["factor"], hist[0]["l"]) == (7.0, 0.0, 0.0)
    assert lse == pytest.approx(2 * math.log(2), rel=1e-7)


def test_p_cast_values():
    x = torch.tensor([2896.309326171875, 448.0, 465.0, 2.0 ** -10, 2.0 ** -9 * 6.58, 0.0])
    assert cast_p(x, "e4m3").tolist() == [448.0, 448.0, 448.0, 0.0, 7 * 2.0 ** -9, 0.0]
    nonsat = cast_p(x, "e4m3", saturate=False)
    assert math.isnan(nonsat[0]) and nonsat[1] == 448.0 and math.isnan(nonsat[2])
    y = torch.tensor([2896.309326171875, 181.02, 61439.0, 61440.0, 2.0 ** -17, 1.5 * 2.0 ** -17])
    assert cast_p(y, "e5m2").tolist() == [3072.0, 192.0, 57344.0, 57344.0, 0.0, 2.0 ** -16]
    assert cast_p(y, "e5m2", saturate=False)[3] == INF and cast_p(y, "e5m2", False)[2] == 57344.0
    z = torch.tensor([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, 65519.0, 65520.0])
    assert cast_p(z, "bf16").tolist()[:2] == [1.0, 1 + 2.0 ** -6]
    assert cast_p(z, "f16").tolist()[2:] == [65504.0, 65504.0]
    assert cast_p(z, "f16", saturate=False)[3] == INF
    assert cast_p(torch.tensor([math.nan]), "e5m2").isnan().all()
    assert torch.equal(cast_p(x, "none"), x)


def test_p_offset_cast_and_saturation_in_a_row():
    """FA4's mechanism by hand: offset 8, threshold 4, key scores 0 then 3.5 (one per tile).
    The row keeps max 0, so P = 2^11.5 clips to 448 while l counts it: out = 448/(256 +
    2^11.5); without saturation that P is NaN in e4m3; the LSE stays exact."""
    case = row_case([0.0, 3.5], [0.0, 1.0])
    fa4 = dict(vote="row", threshold=4.0, headroom=8.0, p_cast="e4m3", block_n=1)
    out, lse, hist = run(case, pol(**fa4))
    assert out == pytest.approx(448 / (256 + 2 ** 11.5), rel=1e-6)
    assert lse == pytest.approx(math.log(1 + 2 ** 3.5), rel=1e-6)
    assert hist[1]["p_max"] == pytest.approx(2 ** 11.5, rel=1e-7) and hist[1]["saturated"] == 1
    out, _, _ = run(case, pol(p_saturate=False, **fa4))
    assert math.isnan(out)
    out, _, _ = run(case, pol(**{**fa4, "p_cast": "none"}))
    assert out == pytest.approx(2 ** 3.5 / (1 + 2 ** 3.5), rel=1e-6)


def test_max_lag():
    """Scores 0 then 3 (one per tile). Lagging, tile 1's P is taken against max 0: 2^3 = 8
    before the rescale, which then covers it; in fp32 the output is still exact (8/9 with
    V = 0, 1). With offset 8 and e4m3, that P is 2^11 -> 448: out = 448 / (256 + 2048)."""
    case = row_case([0.0, 3.0], [0.0, 1.0])
    out, _, hist = run(case, pol(max_lag=True, block_n=1))
    assert out == pytest.approx(8 / 9, rel=1e-7) and hist[1]["p_max"] == 8.0
    assert hist[1]["factor"] == 0.125 and hist[1]["l"] == 1.125
    _, _, hist = run(case, pol(block_n=1))
    assert hist[1]["p_max"] == 1.0
    out, _, _ = run(case, pol(max_lag=True, headroom=8.0, p_cast="e4m3", block_n=1))
    assert out == pytest.approx(448 / 2304, rel=1e-6)


def test_block_n_and_kv_order():
    """block_n sets the steps (ceil(Skv / block_n), at least one) and kv_order their order.
    FA4's toy: scores 3.5 (column 0) and 0 (column 128) under threshold 4 and offset 8.
    Ascending, 3.5 comes first and nothing saturates (exact); descending, 0 comes first,
    3.5 stays under the stale max and saturates; one 256-column tile sees both at once."""
    scores, values = [3.5] + [0.0] * 128, [1.0] + [0.0] * 128
    visible = [True] + [False] * 127 + [True]
    case = row_case(scores, values, visible)
    fa4 = dict(vote="row", threshold=4.0, headroom=8.0, p_cast="e4m3")
    exact = 2 ** 3.5 / (1 + 2 ** 3.5)
    out, _, hist = run(case, pol(block_n=128, **fa4))
    assert [h["tile"] for h in hist] == [0, 1] and out == pytest.approx(exact, rel=1e-6)
    out, _, hist = run(case, pol(block_n=128, kv_order="descending", **fa4))
    assert [h["tile"] for h in hist] == [1, 0]
    assert out == pytest.approx(448 / (256 + 2 ** 11.5), rel=1e-6)
    out, _, hist = run(case, pol(block_n=256, kv_order="descending", **fa4))
    assert len(hist) == 1 and out == pytest.approx(exact, rel=1e-6)
    assert len(run(case, pol())[2]) == 3  # the default: 64 columns a step


def test_v_tail():
    """V rows past seqlen_kv inside its last tile: 'zero' reads 0, 'cache' reads what the
    tensor holds there (NaN), and P = 0 times NaN is NaN."""
    q, k, v, _ = row_case([1.0, 2.0, 0.0], [1.0, 3.0, math.nan])
    for tail, nan in (("zero", False), ("cache", True)):
        out, lse = forward(q, k, v, policy=pol(v_tail=tail), softmax_scale=LOG2_UNITS, seqlen_kv=2)
        assert math.isnan(float(out)) is nan
        if not nan:
            assert float(out) == pytest.approx((2 + 3 * 4) / 6, rel=1e-7)


def test_records_and_batch_lengths():
    """Each step records per-row state; a sequence with fewer tiles records tile -1 and
    keeps its state."""
    q = torch.ones(2, 3, 1, 1)
    k = v = torch.ones(2, 5, 1, 1)
    rec = []
    forward(q, k, v, policy=pol(block_n=2), seqlen_kv=[5, 1], record=rec)
    assert [r.tile.tolist() for r in rec] == [[0, 0], [1, -1], [2, -1]]
    assert rec[0].m.shape == (2, 1, 3) and rec[2].saturated.dtype == torch.int64
    assert float(rec[2].l[1, 0, 0]) == float(rec[0].l[1, 0, 0]) == 1.0
    assert float(rec[2].l[0, 0, 0]) == 5.0


@pytest.mark.parametrize("change, exc, words", [
    (dict(q=[1.0]), TypeError, "q must be a torch.Tensor"),
    (dict(k=torch.ones(1, 2, 1)), ValueError, "k must be"),
    (dict(v=torch.ones(1, 2, 1, 1, dtype=torch.float64)), TypeError, "v has dtype torch.float64; the online-softmax model takes float32"),
    (dict(v=torch.ones(1, 3, 1, 1)), ValueError, "must have the same shape"),
    (dict(k=torch.ones(1, 2, 2, 1), v=torch.ones(1, 2, 2, 1)), ValueError, "multiple of the kv heads"),
    (dict(q=torch.ones(2, 1, 1, 1)), ValueError, r"\[B=2"),
    (dict(policy="eager"), TypeError, "policy"),
    (dict(policy=Policy.from_rule(lambda m, mt, t: mt, name="r")), ValueError, "rule"),
    (dict(policy=Policy("wave", "max", threshold="by_kv_len", name="u")), ValueError, "resolved"),
    (dict(policy=Policy("wave", "max", p_headroom=True, name="u")), ValueError, "resolved"),
    (dict(causal=1), TypeError, "causal"),
    (dict(mask=[[True]]), TypeError, "mask"),
    (dict(mask=torch.ones(1, 2, dtype=torch.int32)), TypeError, "mask"),
    (dict(mask=torch.ones(3, 3, dtype=torch.bool)), ValueError, "mask"),
    (dict(mask=torch.tensor([[0.0, math.nan]])), ValueError, "mask"),
    (dict(mask=torch.tensor([[0.0, INF]])), ValueError, "mask"),
    (dict(seqlen_kv=3), ValueError, "seqlen_kv"),
    (dict(seqlen_kv=-1), ValueError, "seqlen_kv"),
    (dict(seqlen_kv=[1, 1]), TypeError, "seqlen_kv"),
    (dict(seqlen_kv=1.0), TypeError, "seqlen_kv"),
    (dict(softmax_scale=0.0), ValueError, "softmax_scale"),
    (dict(softmax_scale="1"), TypeError, "softmax_scale"),
    (dict(record=()), TypeError, "record"),
])
def test_bad_arguments_name_themselves(change, exc, words):
    args = dict(q=torch.ones(1, 1, 1, 1), k=torch.ones(1, 2, 1, 1), v=torch.ones(1, 2, 1, 1),
                policy=P.get("eager"))
    args.update(change)
    with pytest.raises(exc, match=words):
        forward(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def test_a_mask_over_a_cache_longer_than_the_sequence():
    """A mask given for the whole cache ([Sq, Skv]) while seqlen_kv ends tiles earlier: the
    columns no tile reaches are never read, and the answer is the short sequence's."""
    g = torch.Generator().manual_seed(11)
    q = torch.randn(1, 3, 1, 8, generator=g)
    k, v = (torch.randn(1, 300, 1, 8, generator=g) for _ in range(2))
    bias = torch.randn(3, 300, generator=g)
    bias[1, :40] = -INF
    p = pol(vote="tile")
    out, lse = forward(q, k, v, policy=p, mask=bias, seqlen_kv=70)
    short, short_lse = forward(q, k[:, :70], v[:, :70], policy=p, mask=bias[:, :70])
    assert torch.equal(out, short) and torch.equal(lse, short_lse)
