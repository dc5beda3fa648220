"""onset.bound: each policy's safe region in closed form, its formulas against hand
computations, the measure of an input, and the two checks on small worked cases."""

import math

import numpy as np
import pytest
import torch

from fa_lab import policies
from fa_lab.kernels.online.model import LOG2_UNITS
from fa_lab.numerics import f32
from fa_lab.studies import onset
from fa_lab.studies.onset import boundcheck as BC
from fa_lab.zoo import ENTRIES

LOG448 = math.log2(448)


def one_row(scores, values=None, mask=None):
    n = len(scores)
    q = torch.ones(1, 1, 1, 1)
    k = torch.tensor(scores, dtype=torch.float32).reshape(1, n, 1, 1)
    v = torch.tensor(values or [1.0] * n, dtype=torch.float32).reshape(1, n, 1, 1)
    return q, k, v, mask


def m_of(policy, scores, values=None, mask=None, **kw):
    q, k, v, mask = one_row(scores, values, mask)
    return onset.measure(q, k, v, policy=policy, bias=mask, softmax_scale=LOG2_UNITS,
                         dtype="fp32", **kw)


def hazard(region, name):
    return next(h for h in region.hazards if h.name == name)


def test_the_measure_of_a_hand_case():
    """FA4's tiles: 128 columns, the last (partial) visited first. Keys 0..129 with key 0
    at 3.5, key 128 at -1 and the rest at 0: the first visited tile's max is 0 (keys 128,
    129 hold -1 and 0), the row's best 3.5: Jup = 3.5, R = 3.5 - 0 = 3.5."""
    scores = [3.5] + [0.0] * 127 + [-1.0, 0.0]
    m = m_of("fa4_fp8_saturation:before", scores)
    assert m.block_n == 128 and m.defined.tolist() == [True]
    assert m.Jup.tolist() == [3.5] and m.R.tolist() == [3.5] and m.n.tolist() == [130]
    assert m.n_masked.tolist() == [256 - 130] and m.s_max.tolist() == [3.5]
    assert m.steps.tolist() == [1] and m.v_max == 1.0 and not m.tail_nonfinite
    # ascending 64-column tiles (the defaults): tile 0 has 3.5, tile 1 (keys 64..127) 0,
    # tile 2 (keys 128, 129) 0: Jup = 0 (the first tile holds the best), R = 3.5
    m = m_of("sdpa_masked_row:before", scores)
    assert m.Jup.tolist() == [0.0] and m.R.tolist() == [3.5] and m.steps.tolist() == [2]
    # a mask hiding keys 0..63 makes the first tile hollow; hiding all, the row empty
    mask = torch.ones(1, 130, dtype=torch.bool)
    mask[0, :64] = False
    m = m_of("sdpa_masked_row:before", scores, mask=mask)
    assert m.hollow_first.tolist() == [True] and m.s_max.tolist() == [0.0]
    m = m_of("sdpa_masked_row:before", scores, mask=torch.zeros(1, 130, dtype=torch.bool))
    assert m.defined.tolist() == [False] and m.empty_rows


def test_fa4_saturation_sits_at_log2_448_minus_the_offset():
    r = onset.bound("fa4_fp8_saturation:before")
    sat = hazard(r, "P saturation")
    assert sat.exact and not sat.never and "log2(448) = 8.8074" in sat.formula
    for jump, inside in ((0.80, True), (0.8073, True), (0.8075, False), (3.9, False)):
        scores = [jump] + [0.0] * 128
        safe, margin = sat.check(m_of(r.policy, scores))
        assert safe == inside and margin == pytest.approx(LOG448 - 8 - jump, abs=1e-6)  # fp32 k
    # a jump past the threshold (4) rescales: the stale excess is capped at THR
    safe, margin = sat.check(m_of(r.policy, [9.0] + [0.0] * 128))
    assert not safe and margin == pytest.approx(LOG448 - 12)
    # the fixes: threshold 0 or 0.75, or offset 4, rule saturation out on every input
    for name in ("fa4_fp8_saturation:after", "fa4_fp8_saturation:threshold_0.75",
                 "fa4_fp8_saturation:dtype_aware_offset", "fa4_fp8_offset:after",
                 "fa4_fp8_saturation:before_e5m2"):
        assert hazard(onset.bound(name), "P saturation").never, name


def test_the_accumulator_bound_by_hand():
    """eager: O <= n max|V| (P <= 1, and the cast of a P <= 1 is at most 1): 1024 keys at
    V = 2^100 leave 128 - 10 - 100 = 18 less fp32's roundings (16 tiles: 4 T + 3 = 67 of
    them); FA4 before: P is clipped at 448 in O but counted whole (2^12) in l."""
    h = hazard(onset.bound("eager"), "accumulator overflow")
    q = torch.ones(1, 1, 1, 64, dtype=torch.bfloat16)
    k = torch.zeros(1, 1024, 1, 64, dtype=torch.bfloat16)
    v = torch.full((1, 1024, 1, 64), 2.0 ** 100).to(torch.bfloat16)
    m = onset.measure(q, k, v, policy="eager")
    acc = math.log2(1 + 67 * 2.0 ** -24)
    assert h.check(m) == (True, pytest.approx(18.0 - acc))
    fa4 = onset.bound("fa4_fp8_saturation:before")
    m = m_of(fa4.policy, [0.0] * 128 + [5.0] * 128, values=[2.0 ** 100] * 256)
    # the first visited tile (keys 128..255) holds the best: Jup = 0, P <= 2^8 (an e4m3
    # value: its cast stays at 2^8); 2 tiles: 11 fp32 roundings
    acc = math.log2(1 + 11 * 2.0 ** -24)
    assert hazard(fa4, "accumulator overflow").check(m)[1] == pytest.approx(
        128 - 8 - 8 - 100 - acc)
    m = m_of(fa4.policy, [5.0] * 128 + [0.0] * 128, values=[2.0 ** 100] * 256)
    # Jup = 5 > THR: the excess is THR = 4, O's P clipped at 448
    assert hazard(fa4, "accumulator overflow").check(m)[1] == pytest.approx(
        128 - LOG448 - 8 - 100 - acc)


def test_the_drag_bound_and_the_cap():
    """lazy_unfixed: a dragged row's deficit reaches R; lazy_capped: at most B per step."""
    scores = [60.0] * 64 + [0.0] * 64 + [-20.0] * 64           # tile maxima 60, 0, -20
    m = m_of("lazy_unfixed", scores)
    assert m.R.tolist() == [80.0] and m.steps.tolist() == [2]
    up, acc = 0.0, math.log2(1 + 15 * 2.0 ** -24)   # bf16 P at a power of 2, 3 tiles
    h = hazard(onset.bound("lazy_unfixed"), "accumulator overflow")
    assert not h.exact and h.check(m)[1] == pytest.approx(128 - 80 - up - math.log2(192) - acc)
    hc = hazard(onset.bound("lazy_capped"), "accumulator overflow")
    assert hc.check(m)[1] == pytest.approx(128 - 2 * 16 - up - math.log2(192) - acc)
    hl = hazard(onset.bound("lazy"), "accumulator overflow")
    assert hl.exact and hl.check(m)[1] == pytest.approx(128 - 0 - up - math.log2(192) - acc)


def test_tail_flush_and_sentinels_by_hand():
    """e4m3 flushes P below 2^-10: n keys lose n 2^(-10 - H) of the row's weight; a finite
    sentinel above the scores lowers every P by the lift, and l below 2^-128 overflows its
    reciprocal."""
    fly = onset.bound("flydsl_fp8_empty_tile:before", dtype="fp32")      # e4m3, H = 0
    h = hazard(fly, "silent mass loss (rounding and flushed tails)")
    m = m_of(fly.policy, [0.0] * 100)
    assert h.check(m)[1] == pytest.approx(math.log2(0.25 - 2 ** -4) - (math.log2(100) - 10))
    fi = onset.bound("flashinfer_sentinel:before", dtype="fp32")     # fp32 P: flush at 2^-150
    sen = hazard(fi, "finite sentinel")
    assert not sen.never and hazard(onset.bound("trtllm_neg_inf:before"), "finite sentinel").never
    # scores 100 log2 units below the -5e4 sentinel (raw domain, c = 1 here): lift 100
    m = m_of(fi.policy, [-5e4 - 100.0] * 64)
    assert m.c == 1.0
    safe, margin = sen.check(m)
    flush_side = math.log2(0.25 - 2 ** -24) - (6 - 150 + 100)
    assert safe and margin == pytest.approx(min(128 - 100, flush_side))
    assert not sen.check(m_of(fi.policy, [-5e4 - 130.0] * 64))[0]    # 1/l overflows
    assert sen.check(m_of(fi.policy, [-4e4] * 64))[0]                # above the sentinel


def test_structural_hazards_name_their_tile():
    r = onset.bound("pytorch_cpu_masked_block:before")
    h = hazard(r, "NaN from a first tile with nothing visible")
    assert "512-column tile" in h.formula and not h.never
    mask = torch.ones(1, 700, dtype=torch.bool)
    mask[0, :511] = False
    assert h.check(m_of(r.policy, [0.0] * 700, mask=mask))[0]
    mask[0, :512] = False
    assert not h.check(m_of(r.policy, [0.0] * 700, mask=mask))[0]
    after = onset.bound("pytorch_cpu_masked_block:after")
    assert hazard(after, "NaN from a first tile with nothing visible").never
    # the fix skips empty tiles, but its epilogue 1/l still gives a row that sees nothing NaN
    assert not hazard(after, "a row that sees nothing gives 0").never
    assert hazard(onset.bound("sdpa_masked_row:after"), "a row that sees nothing gives 0").never
    # the FlyDSL policies floor a causal row's tile max: causal calls are inside
    lazy = onset.bound("lazy")
    h = hazard(lazy, "NaN from a first tile with nothing visible")
    q = torch.ones(1, 4, 1, 64, dtype=torch.bfloat16)
    k = torch.zeros(1, 128, 1, 64, dtype=torch.bfloat16)
    bias = torch.zeros(4, 128)
    bias[:, :64] = -math.inf
    assert not h.check(onset.measure(q, k, k, policy="lazy", bias=bias))[0]
    assert h.check(onset.measure(q, k, k, policy="lazy", bias=bias, causal=True))[0]
    # bf16's finfo.min times log2 e overflows fp32: a mask, not a logit
    m = onset.measure(q, k, k, policy="lazy", bias=bias.masked_fill(bias == -math.inf, -3.3e38)
                      .to(torch.bfloat16))
    assert m.hollow_first.all()


def test_fp8_hazards_of_the_fp8_kernel():
    r = onset.bound("lazy", dtype="fp8")
    assert r.kernel == "swp_fp8"
    h = hazard(r, "fp8 causal floor overflows")
    ls0 = float(h.formula.split("ls < ")[1])
    assert math.isinf(f32(f32(ls0 + 1e-6) * -3e38)) and not math.isinf(f32(f32(ls0 - 1e-6) * -3e38))
    a = hazard(r, "fp8 addend loses the row max")
    assert "2^32" in a.formula and not a.exact
    assert "fp8" not in " ".join(h.name for h in onset.bound("lazy").hazards)


def test_every_policy_has_a_region_and_bad_arguments_are_refused():
    for name in policies.names():
        fields = set(policies.get(name).semantic_fields) & set(onset.UNBOUNDED)
        if fields:  # refused by name, never called safe
            with pytest.raises(ValueError, match="cannot bound"):
                onset.bound(name)
            continue
        r = onset.bound(name)
        assert r.hazards and r.describe().startswith(f"{name} on ")
        d = r.to_dict()
        assert d["policy"] == name and all(h["formula"] for h in d["hazards"])
    with pytest.raises(ValueError, match="dtype"):
        onset.bound("lazy", dtype="fp16")
    with pytest.raises(ValueError, match="tolerance"):
        onset.bound("lazy", tolerance=1.5)
    with pytest.raises(ValueError, match="rescale='nope'"):
        onset.bound("nope")


@pytest.mark.parametrize("name", list(ENTRIES))
def test_each_entry_case_lies_outside_before_and_inside_after(name):
    """The entry's own smallest input violates its 'before' region (the hazard its report
    names) and lies inside its 'after' one, but for the two fixes the lab's reference still
    counts: ffpa's still-NaN first tile and tt-metal's NaN for a row that sees nothing
    (the fix gives NaN, as torch.softmax does; the reference gives 0)."""
    e = ENTRIES[name]
    c = e.case()
    dt = "bf16" if c.q.dtype == torch.bfloat16 else "fp32"
    lens = c.seqlen_kv if c.seqlen_kv is not None else c.k.shape[1]
    lens = [lens] * c.q.shape[0] if isinstance(lens, int) else list(lens)

    def violated(pol):
        r = onset.bound(pol, dtype=dt)
        out = set()
        for b, n in enumerate(lens):
            m = onset.measure(c.q[b:b + 1], c.k[b:b + 1], c.v[b:b + 1], policy=pol,
                              causal=c.causal, bias=c.mask, seqlen_kv=n,
                              softmax_scale=c.softmax_scale, dtype=dt)
            out |= set(r.violated(m))
        return out

    assert violated(e.before)
    rest = violated(e.after)
    still = {"ffpa_vote_nan": {"NaN from a first tile with nothing visible"},
             "ttmetal_exp_clamp": {"a row that sees nothing gives 0"}}
    assert rest == still.get(name, set())


def test_the_sweeps_cross_at_the_formula():
    """The checks on two hazards, small: FA4's saturation onset is the formula's
    0.8074 to within the sweep's 1/64 step, and PyTorch's first-block NaN starts at 512."""
    r = BC.sweep("fa4_fp8_saturation:before", "P saturation")
    assert r["sound"] and r["within_one_binade_or_tile"]
    assert abs(r["measured_onset"] - (LOG448 - 8)) <= 1 / 64
    r = BC.sweep("pytorch_cpu_masked_block:before", "NaN from a first tile with nothing visible")
    assert r["sound"] and r["measured_onset"] == r["formula_boundary"] == 512.0
    assert BC.sweep("fa4_fp8_saturation:after", "P saturation") is None      # never
    with pytest.raises(ValueError, match="builtin_sweep"):
        BC.sweep("lazy", "accumulator overflow")


def test_a_region_filter_rejects_what_lies_outside():
    from fa_lab.studies.adversary import Candidate

    inside = BC.region_filter("fa4_fp8_saturation:before")
    flat = Candidate(family="scores", spread=0.0, n_tiles=3, trim=0)
    jump = Candidate(family="scores", spread=0.0, n_tiles=3, trim=0, jump=3.0, jump_col=0)
    assert inside(flat) and not inside(jump)
    np.testing.assert_equal(inside(Candidate(family="scores", n_tiles=1, trim=0, jump=3.0)), True)


def test_bound_refuses_a_rule_policy():
    """A rule has no vote, rebase or threshold for the formulas to read: bounding it would
    call inputs safe that it kills (issue 36), so it is refused, saying why."""
    rule = policies.Policy.from_rule(lambda m, mt, thr: mt, name="always_rebase_down")
    with pytest.raises(ValueError, match=r"^policy 'always_rebase_down' decides by a Python "
                                         r"rule \(Policy.from_rule\): onset.bound derives"):
        onset.bound(rule)


def _list_cases():
    for name, e in ENTRIES.items():
        c = e.case()
        if isinstance(c.seqlen_kv, (list, tuple)):
            yield name, e, c


@pytest.mark.parametrize("name", [n for n, _, _ in _list_cases()])
def test_measure_takes_per_sequence_lengths(name):
    """The zoo's varlen cases give seqlen_kv as one length per sequence: measure takes it,
    as the joined measures of each sequence alone (rows in [B, H, Sq] order)."""
    e, c = ENTRIES[name], ENTRIES[name].case()
    kw = dict(policy=e.before, causal=c.causal, bias=c.mask, softmax_scale=c.softmax_scale)
    m = onset.measure(c.q, c.k, c.v, seqlen_kv=c.seqlen_kv, **kw)
    B, Sq, H = c.q.shape[0], c.q.shape[1], c.q.shape[2]
    per = Sq * H
    for b, n in enumerate(c.seqlen_kv):
        alone = onset.measure(c.q[b:b + 1], c.k[b:b + 1], c.v[b:b + 1], seqlen_kv=n, **kw)
        mine = slice(b * per, (b + 1) * per)
        assert np.array_equal(m.n[mine], alone.n) and (m.n[mine] <= n).all()
        assert np.array_equal(m.defined[mine], alone.defined)
        assert (not m.defined[mine].any()) == (n == 0)
    assert m.n.shape == (B * per,)
    with pytest.raises(ValueError, match=r"^seqlen_kv has 1 lengths; q has"):
        onset.measure(c.q, c.k, c.v, seqlen_kv=[1], **kw)
    with pytest.raises(ValueError, match=r"seqlen_kv\[0\]=\d+ exceeds the \d+ keys of k"):
        onset.measure(c.q, c.k, c.v, seqlen_kv=[c.k.shape[1] + 1] * B, **kw)
