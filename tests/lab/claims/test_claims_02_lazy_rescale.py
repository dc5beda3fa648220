"""The sentences of lesson 02 (notebooks/02_lazy_rescale.ipynb), computed again: each test
recomputes the numbers its markdown states, on its own inputs (its CPU defaults), so that a
change to the package that makes a sentence false fails here. The lessons keep only the asserts
that check the learner (fa_lab.lab.exercises); tests/lab/claims/ holds one file per lesson."""

import itertools
import math

import pytest
import torch

for _extra in ("plotly", "ipywidgets", "anywidget"):  # fa_lab.lab needs the [lab] extra
    pytest.importorskip(_extra, reason="fa_lab.lab needs the [lab] extra")

import fa_lab  # noqa: E402
from fa_lab.lab import lessons  # noqa: E402
from fa_lab.lab import recorded  # noqa: E402
from fa_lab.lab import solutions as sol  # noqa: E402
from fa_lab.studies import experiments  # noqa: E402

# ---- lesson 02, section 1: the ballot ----------------------------------------------------

def test_02_the_ballot_of_one_wave():
    """Section 1's wave (its seed, its 32 rows): one row votes, the wave fires for all 32, the
    other 31 sit below their base; unfixed they get corr > 1 and a lower base, fixed corr = 1;
    the voter gets the same correction below 1 both ways; a wave with no vote does not fire."""
    from fa_lab.kernels._common.geometry import WAVE_ROWS, wave_any
    from fa_lab.numerics import exp2, fmax, le

    g = torch.Generator().manual_seed(4)
    m = 100 + 4 * torch.randn(WAVE_ROWS, generator=g)
    mt = m - 20 * torch.rand(WAVE_ROWS, generator=g)
    mt[7] = m[7] + 12
    vote = ~le(mt - m, 8.0)
    fire = wave_any(vote)
    below = fire & (mt < m)
    m_unfixed, m_fixed = torch.where(fire, mt, m), torch.where(fire, fmax(m, mt), m)
    corr_u, corr_f = exp2(m - m_unfixed), exp2(m - m_fixed)
    assert int(vote.sum()) == 1 and bool(vote[7]) and bool(fire.all())
    assert int(below.sum()) == WAVE_ROWS - 1 and (corr_u[below] > 1).all()
    assert (m_unfixed[below] < m[below]).all() and (corr_f[below] == 1).all()
    assert corr_u[7] == corr_f[7] < 1
    two_waves = torch.cat([vote, torch.zeros(WAVE_ROWS, dtype=torch.bool)])
    assert wave_any(two_waves)[:WAVE_ROWS].all() and not wave_any(two_waves)[WAVE_ROWS:].any()


# ---- lesson 02, section 1: the by-hand table --------------------------------------------

HAND = {"A": [0, 20, 40, 60, 80, 100], "B": [100, 30, 60, -10, 50, -40],
        "C": [50, 45, 60, 58, 10, 70]}


def deficits(tile_max):
    return [r - mt for r, mt in zip(itertools.accumulate(tile_max, max), tile_max)]


def test_02_by_hand_row_b_dies_at_tile_5_and_the_sum_of_drops_says_3():
    assert deficits(HAND["B"]) == [0, 70, 40, 110, 50, 140]
    assert sol.first_nan_tile(HAND["B"]) == 5
    drops = list(itertools.accumulate(max(0, a - b) for a, b in zip(HAND["B"], HAND["B"][1:])))
    assert drops[2] == 140 and drops[1] < 128            # the sum of drops reaches 140 at tile 3
    assert max(deficits(HAND["C"])) == 50 and sol.first_nan_tile(HAND["C"]) is None
    assert all(b - a > 8 for a, b in zip(HAND["A"], HAND["A"][1:]))   # A votes at every step


# ---- lesson 02, section 2: the onset rule on the bug report's first block ----------------

@pytest.fixture(scope="module")
def unfixed_block():
    q, k, v = experiments.bf16_inputs(1, 8192, 1, 128, 32)
    tr = fa_lab.trace(q[:, :256].contiguous(), k, v, rows=range(256), causal=False,
                      rescale="lazy_unfixed")
    return tr, lessons.with_deficit(tr)


def test_02_waves_fire_at_every_loop_step_and_the_deficit_is_record_minus_tile_max(unfixed_block):
    _, U = unfixed_block
    loop = U[U.phase == "loop"]
    assert loop.fire.all()
    assert ((loop.deficit - (loop.true_max - loop.mt)).abs() == 0).all()


@pytest.mark.slow
def test_02_a_drag_in_the_kernel_model(unfixed_block):
    """Section 2's block at K x32: every drag of the unfixed rule has corr > 1 and moves m
    down, and the rows that die reach a deficit past 100 first; under the fix the same event
    leaves the base alone; eager's deficit is 0 and the fixed lazy rescale's within 8; both
    stay finite. Section 4: a row that votes gets the same new max and correction either way."""
    tr, U = unfixed_block
    q, k, v = experiments.bf16_inputs(1, 8192, 1, 128, 32)
    other = {pol: fa_lab.trace(q[:, :256].contiguous(), k, v, rows=range(256), causal=False,
                               rescale=pol) for pol in ("lazy", "eager")}
    L, EG = (lessons.with_deficit(other[p]) for p in ("lazy", "eager"))
    drags_u, below_f = U[U.swept], L[L.swept]
    assert len(drags_u) > 0 and (drags_u["corr"] > 1).all() and (drags_u.m < drags_u.m_before).all()
    assert len(below_f) > 0 and (below_f["corr"] == 1).all() and (below_f.m == below_f.m_before).all()
    bad = tr.lanes[~tr.lanes.out_finite]
    for lane, step in bad.first_nonfinite_step.astype(int).items():
        assert float(U[(U.lane == lane) & (U.step == step)].deficit.iloc[0]) > 100
    assert (EG.deficit == 0).all() and 0 <= L.deficit.min() and L.deficit.max() <= 8
    assert other["lazy"].lanes.out_finite.all() and other["eager"].lanes.out_finite.all()
    # section 4: where a row votes with the same running max in both runs, both agree after
    both = U.merge(L, on=["lane", "step"], suffixes=("_u", "_f"))
    voted = both[both.vote_u & both.vote_f & (both.m_before_u == both.m_before_f)]
    assert len(voted) > 0 and (voted.m_u == voted.m_f).all() and (voted.corr_u == voted.corr_f).all()
    assert (U[U.vote].m == U[U.vote].mt).all() and (L[L.vote].m == L[L.vote].mt).all()


def test_02_the_onset_rule_on_the_block(unfixed_block):
    tr, U = unfixed_block
    lanes = tr.lanes
    bad = lanes[~lanes.out_finite]
    by_rule = U[(U.phase == "loop") & (U.true_max - U.mt >= 128)].groupby("lane").step.min()
    assert lanes.loc[by_rule.index].out_finite.sum() == 0     # every such row dies
    died = bad.first_nonfinite_step.astype(int)
    at_rule = (died == by_rule.reindex(bad.index)).sum()
    assert at_rule > len(bad) / 2                              # most, exactly at the rule's tile
    assert (died <= by_rule.reindex(bad.index).fillna(10**6)).all()   # none later
    at_death = [float(U[(U.lane == ln) & (U.step == s)].deficit.iloc[0]) for ln, s in died.items()]
    assert 126 <= min(at_death) < 128                          # the rest: a binade or two early


# ---- lesson 02, section 3: the K-scale table on the back of an envelope ------------------

def test_02_the_envelope_reproduces_the_report_within_a_few_points():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(4096, 8192, generator=g)
    tm = z.view(4096, -1, 64).amax(-1)
    record = torch.cummax(tm, 1).values
    gap = (record - tm)[:, 1:-3].amax(1)
    assert abs(record[:, -1].median().item() - 3.8) < 0.1       # "near 3.8 sigma"
    assert abs(tm.median().item() - 2.3) < 0.1                   # "near 2.3 sigma"
    assert abs(gap.median().item() - 2.3) < 0.1                 # "the typical gap, about 2.3"
    for r in experiments.seed_table("bf16")["rows"]:
        need = 128 / (r["k_scale"] * math.log2(math.e))
        dying = 100 * (gap >= need).float().mean().item()
        assert abs(dying - r["lazy_unfixed_nan_pct"]) < 5, (r["k_scale"], dying)
        if r["k_scale"] <= 16:
            assert dying == 0 and need > 5.5
    assert abs(128 / (24 * math.log2(math.e)) - 3.7) < 0.01
    assert abs(128 / (48 * math.log2(math.e)) - 1.85) < 0.01


# ---- lesson 02, section 3: where NaN starts ----------------------------------------------

def test_02_where_nan_starts():
    """The grid of lesson 02's section 3 at its CPU sizes (1 head x 256 rows, 4096 keys), as
    the lesson reads it from its record (tests/lab/test_lesson_records.py checks the record
    against the model)."""
    sweep, source = recorded.recorded("lesson02_sweep", **recorded.LESSON_PARAMS["lesson02_sweep"])
    assert source.startswith("recorded on ")
    K_GRID, THR_GRID = (24, 32, 48, 64), (8, 16, 32, 64, 96)
    nan_u, nan_f = (sweep["grid"].nan_pct.xs(p, level="policy").unstack("threshold")
                    for p in ("lazy_unfixed", "lazy"))
    assert nan_f.to_numpy().max() == 0                                       # the fix: none
    for thr in THR_GRID:                                                     # more spread, more NaN
        assert nan_u.loc[64, thr] > nan_u.loc[32, thr] >= nan_u.loc[24, thr]
    assert all(nan_u.loc[K].is_monotonic_decreasing for K in K_GRID)        # higher threshold, less
    by_kv = sweep["by_kv"]["unfixed NaN %"].tolist()
    assert by_kv == sorted(by_kv) and by_kv[-1] > 4 * by_kv[0]               # more keys, more NaN
    rates = sweep["rates"]
    assert 30 < rates.loc[8, "rows voting %"] < 50 and rates.loc[8, "waves firing %"] == 100
    fire = rates["waves firing %"].tolist()                 # "two in five vote, every wave fires"
    assert fire == sorted(fire, reverse=True) and fire[2] > 90 > 60 > fire[3]


def test_02_all_three_fates_happen():
    """Section 2's fates (16 heads' first blocks at K x32, from the lesson's record): every
    fate of lessons.FATES occurs, LSE = +inf most often and LSE = NaN least, and at least 95 %
    of the rows with NaN have LSE = +inf."""
    fates = recorded.recorded("lesson02_fates", **recorded.LESSON_PARAMS["lesson02_fates"])[0]["fates"]
    counts = fates.fate.value_counts().reindex(list(lessons.FATES), fill_value=0)
    nan_rows = fates[fates.NaN > 0]
    assert (counts > 0).all()
    assert counts[lessons.FATES[1]] > counts[lessons.FATES[0]] > counts[lessons.FATES[2]]
    assert (nan_rows.fate == lessons.FATES[1]).mean() >= 0.95


# ---- lesson 02, section 2: the featured row dies the common way --------------------------------

def test_02_the_featured_row_dies_at_its_rule_tile_through_a_finite_factor(unfixed_block):
    """Section 2's featured row (the median death step among rows whose factor at death is
    finite): it dies at the first tile 128 below its record, its factor there is finite (about
    2^66), its l one step earlier about 2^65 (its deficit then), and the product is its deficit
    of about 131; a few other rows (5 of the 35) die through an infinite factor."""
    import numpy as np

    tr, U = unfixed_block
    lanes = tr.lanes
    bad = lanes[~lanes.out_finite].sort_values(["first_nonfinite_step", "row"])
    corr_at = U.set_index(["lane", "step"])["corr"]
    died = bad.first_nonfinite_step.astype(int)
    common = [ln for ln, s in died.items() if np.isfinite(corr_at[ln, s])]
    assert len(bad) - len(common) == 5 and len(bad) == 35
    lane = int(common[len(common) // 2])
    row = U[U.lane == lane].set_index("step")
    s = int(died[lane])
    assert s == int(row[(row.phase == "loop") & (row.true_max - row.mt >= 128)].index.min())
    log2_corr, log2_l_before = math.log2(row["corr"][s]), math.log2(row.l[s - 1])
    assert round(log2_corr) == 66 and round(log2_l_before) == 65 and round(row.deficit[s]) == 131
    assert abs(log2_l_before - row.deficit[s - 1]) < 1
    assert abs(log2_corr + log2_l_before - row.deficit[s]) < 1 and row.deficit[s] > 128


def test_02_one_block_alone_is_the_full_run():
    """Section 2's first line: rows 256-511 run alone give exactly the rows of the full run
    (NaN where it has NaN), and that block has NaN at K x48; a block is a faithful sample."""
    q, k, v = experiments.bf16_inputs(1, 1024, 2, 128, 48)
    full = fa_lab.flash_attn_func(q, k, v, causal=False, rescale="lazy_unfixed")
    part = fa_lab.flash_attn_func(q[:, 256:512].contiguous(), k, v, causal=False, rescale="lazy_unfixed")
    assert torch.equal(full[:, 256:512].nan_to_num(7.0), part.nan_to_num(7.0))
    assert part.isnan().any()


def test_02_the_fixed_columns_dip_is_the_bases_rise(unfixed_block):
    """Section 2's compare figure, fixed column: at the deepest dip of log2(l) the base rose
    by as much as log2(l) fell, and one step later log2(l) is back near 0."""
    import numpy as np

    tr, U = unfixed_block
    lanes = tr.lanes
    bad = lanes[~lanes.out_finite].sort_values(["first_nonfinite_step", "row"])
    corr_at = U.set_index(["lane", "step"])["corr"]
    common = [ln for ln, s in bad.first_nonfinite_step.astype(int).items() if np.isfinite(corr_at[ln, s])]
    lane = int(common[len(common) // 2])
    q, k, v = experiments.bf16_inputs(1, 8192, 1, 128, 32)
    fixed = fa_lab.trace(q[:, :256].contiguous(), k, v, rows=range(256), causal=False, rescale="lazy")
    dip = lessons.l_lag_dip(fixed, lane)
    assert dip["rise"] > 1
    assert abs(dip["log2_l"] - (dip["log2_l_before"] - dip["rise"])) < 1
    assert abs(dip["log2_l_next"]) < 1
