"""Each lesson's exercise check (fa_lab.lab.exercises) accepts the reference answer
(fa_lab.lab.solutions) and rejects wrong-but-plausible answers with a message that names the
mistake; ``yours`` substitutes the reference answer only under FA_LAB_SOLUTIONS=1."""

import math
import statistics

import pytest
import torch

for _extra in ("plotly", "ipywidgets", "anywidget"):  # fa_lab.lab needs the [lab] extra
    pytest.importorskip(_extra, reason="fa_lab.lab needs the [lab] extra")

from fa_lab.lab import exercises as ex  # noqa: E402
from fa_lab.lab import online  # noqa: E402
from fa_lab.lab import solutions as sol  # noqa: E402


def rejects(check, answer, match, *args, **kwargs):
    with pytest.raises(AssertionError, match=match):
        check(answer, *args, **kwargs)


# ---- yours -------------------------------------------------------------------------------

def test_yours_returns_the_learners_function_unless_solutions_are_asked_for(monkeypatch):
    def update(state, s, v):
        raise NotImplementedError("write update")

    monkeypatch.delenv(ex.SOLUTIONS_ENV, raising=False)
    assert ex.yours(update) is update
    monkeypatch.setenv(ex.SOLUTIONS_ENV, "0")
    assert ex.yours(update) is update
    monkeypatch.setenv(ex.SOLUTIONS_ENV, "1")
    assert ex.yours(update) is sol.update


def test_yours_refuses_what_has_no_answer(monkeypatch):
    monkeypatch.setenv(ex.SOLUTIONS_ENV, "1")

    def not_an_exercise():
        pass

    with pytest.raises(ValueError, match="not_an_exercise"):
        ex.yours(not_an_exercise)
    with pytest.raises(TypeError, match="function"):
        ex.yours(3)


def test_a_stub_fails_with_what_to_write():
    def update(state, s, v):
        raise NotImplementedError("Exercise 1: write update(state, s, v)")

    with pytest.raises(NotImplementedError, match="write update"):
        ex.check_update(update)


# ---- lesson 00 ---------------------------------------------------------------------------

def test_lazy_bases_check():
    ex.check_lazy_bases(sol.lazy_bases)
    rejects(ex.check_lazy_bases, lambda row, thr: list(__import__("itertools").accumulate(row, max)),
            "within the threshold")                                          # eager
    rejects(ex.check_lazy_bases,
            lambda row, thr: [row[0]] + [b for b in _lazy(row, thr, ge=True)][1:],
            "MORE than the threshold")                                       # >= instead of >
    rejects(ex.check_lazy_bases, lambda row, thr: _lazy(row, 8.0), "threshold it is given")
    rejects(ex.check_lazy_bases, lambda row, thr: _lazy(row, thr, down=True), "moved down")

    def against_best(row, thr):               # compares with the best tile max so far
        bases, best = [], -math.inf
        for mt in row:
            bases.append(mt if not bases or mt - best > thr else bases[-1])
            best = max(best, mt)
        return bases

    rejects(ex.check_lazy_bases, against_best, "not with the best tile max so far")
    with pytest.raises(AssertionError) as e:
        ex.check_lazy_bases(against_best)
    assert "threshold it is given" not in str(e.value)


def _lazy(row, thr, ge=False, down=False):
    out = []
    for mt in row:
        if not out or (mt - out[-1] >= thr if ge else mt - out[-1] > thr) or (down and mt < out[-1] - 30):
            out.append(mt)
        else:
            out.append(out[-1])
    return out


# ---- lesson 01 ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def problem():
    return online.online_problem()


def test_update_check(problem):
    assert ex.check_update(sol.update, problem)["max |out - reference|"] < 1e-12

    def own_tile_max(state, s, v):            # the unfixed rebase: the base can fall
        m, l, O = state
        m_new = s.amax(-1)
        corr = torch.exp2(m - m_new)
        p = torch.exp2(s - m_new[:, None])
        return m_new, l * corr + p.sum(-1), O * corr[:, None] + p @ v

    def first_tile_base(state, s, v):         # a base fixed at the first tile's max
        m, l, O = state
        m_new = torch.where(torch.isinf(m), s.amax(-1), m)
        corr = torch.exp2(m - m_new)
        p = torch.exp2(s - m_new[:, None])
        return m_new, l * corr + p.sum(-1), O * corr[:, None] + p @ v

    def no_rescale(state, s, v):              # the right base, l and O never moved to it
        m, l, O = state
        m_new = torch.maximum(m, s.amax(-1))
        p = torch.exp2(s - m_new[:, None])
        return m_new, l + p.sum(-1), O + p @ v

    rejects(ex.check_update, own_tile_max, "the base fell below the one before it", problem)
    rejects(ex.check_update, first_tile_base, "does it move up when a tile beats it", problem)
    rejects(ex.check_update, no_rescale, "neither l nor O is moved to the new base", problem)


def _update(state, s, v, *, exp=torch.exp2, scale_l=True, scale_o=True, upside_down=False):
    """Lesson 01's update with one knob per natural mistake."""
    m, l, O = state
    m_new = torch.maximum(m, s.amax(-1))
    corr = exp(m_new - m) if upside_down else exp(m - m_new)
    corr = torch.where(torch.isinf(m), 0.0, corr)           # the first tile: nothing to rescale
    p = exp(s - m_new[:, None])
    return (m_new, (l * corr if scale_l else l) + p.sum(-1),
            (O * corr[:, None] if scale_o else O) + p @ v)


def test_update_check_names_o_not_rescaled_exp_and_an_upside_down_corr(problem):
    ex.check_update(_update, problem)                         # all knobs off: the right update
    rejects(ex.check_update, lambda *a: _update(*a, scale_o=False),
            "l is moved to the new base and O is not", problem)
    rejects(ex.check_update, lambda *a: _update(*a, scale_l=False),
            "O is moved to the new base and l is not", problem)
    rejects(ex.check_update, lambda *a: _update(*a, exp=torch.exp), "use|exp2, not exp", problem)
    rejects(ex.check_update, lambda *a: _update(*a, upside_down=True), "corr is upside down",
            problem)


def test_lesson_01_loop_is_the_update_and_its_lazy_rule(problem):
    """lessons.flash_forward (moved out of lesson 01, where its body gave exercise 1 away):
    eager, it is the reference update tile for tile; lazy, each base stays within the
    threshold of the row's true running max and the output still matches the fp64
    reference; round_p rounds only the P @ V operand."""
    from fa_lab.lab import lessons
    from fa_lab.numerics import bf16

    q, k, v, ref_out, _ = problem
    q, k, v = q[:32], k[:512], v[:512]
    ref, _ = online.reference_one_head(q, k, v)
    out, steps = lessons.flash_forward(q, k, v)
    mine, _ = online.finish(online.run_tiles(sol.update, q, k, v))
    assert torch.equal(out, mine) and (out - ref).abs().max() < 1e-12
    m, mt = lessons.stacked(steps, "m"), lessons.stacked(steps, "mt")
    assert torch.equal(m, torch.cummax(mt, 0).values)              # eager: the running max
    lazy, lsteps = lessons.flash_forward(q, k, v, threshold=8.0)
    stale = torch.cummax(lessons.stacked(lsteps, "mt"), 0).values - lessons.stacked(lsteps, "m")
    assert (stale >= 0).all() and 0 < stale.max() <= 8.0 and (lazy - ref).abs().max() < 1e-12
    assert lessons.stacked(lsteps, "corr").eq(1).sum() > lessons.stacked(steps, "corr").eq(1).sum()
    q32, k32, v32 = q.float(), k.float(), v.float()                # bf16 rounding, as the lesson
    plain, _ = lessons.flash_forward(q32, k32, v32)
    rounded, _ = lessons.flash_forward(q32, k32, v32, round_p=bf16)
    assert (rounded.double() - ref).abs().max() > 100 * (plain.double() - ref).abs().max()
    kept, _ = lessons.flash_forward(q32, k32, v32, round_p=bf16,
                                    exact=torch.ones(32, 512, dtype=torch.bool))
    assert torch.equal(kept, plain)                                # nothing rounded


def test_merge_check(problem):
    assert (ex.check_merge(sol.merge, problem).to_numpy() < 1e-12).all()

    def add(a, b):                            # no common base
        return torch.maximum(a[0], b[0]), a[1] + b[1], a[2] + b[2]

    def first_base(a, b):                     # the first part's base for both
        (m1, l1, O1), (m2, l2, O2) = a, b
        w2 = torch.exp2(m2 - m1)
        return m1, l1 + w2 * l2, O1 + w2[:, None] * O2

    def swapped(a, b):                        # each part weighted by the other's factor
        (m1, l1, O1), (m2, l2, O2) = a, b
        m = torch.maximum(m1, m2)
        w1, w2 = torch.exp2(m1 - m), torch.exp2(m2 - m)
        return m, w2 * l1 + w1 * l2, w2[:, None] * O1 + w1[:, None] * O2

    def natural(a, b):                        # exp for exp2
        (m1, l1, O1), (m2, l2, O2) = a, b
        m = torch.maximum(m1, m2)
        w1, w2 = torch.exp(m1 - m), torch.exp(m2 - m)
        return m, w1 * l1 + w2 * l2, w1[:, None] * O1 + w2[:, None] * O2

    def averaged(a, b):                       # the finished outputs averaged, l right
        (_, l1, O1), (_, l2, O2) = a, b
        m, l, _ = sol.merge(a, b)
        return m, l, (O1 / l1[:, None] + O2 / l2[:, None]) / 2 * l[:, None]

    def upside_down(a, b):                    # factors 2^(m - m_i)
        (m1, l1, O1), (m2, l2, O2) = a, b
        m = torch.maximum(m1, m2)
        w1, w2 = torch.exp2(m - m1), torch.exp2(m - m2)
        return m, w1 * l1 + w2 * l2, w1[:, None] * O1 + w2[:, None] * O2

    rejects(ex.check_merge, add, "differs from the reference: the parts are added as they are",
            problem)
    rejects(ex.check_merge, first_base, "max\\(m1, m2\\)", problem)
    rejects(ex.check_merge, swapped, "weighted by the other's factor", problem)
    rejects(ex.check_merge, natural, "exp2, not exp", problem)
    rejects(ex.check_merge, averaged, "average of the parts' outputs", problem)
    rejects(ex.check_merge, upside_down, "upside down", problem)


# ---- lesson 02 ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_rule_cases():
    return ex.rule_cases(rows=64, keys=2048)


@pytest.mark.slow
def test_rule_check(small_rule_cases):
    table = ex.check_rule(sol.my_rule, small_rule_cases)
    assert (table.loc["mine: bases moved"] < table.loc["fix: bases moved"]).any()

    def hard_coded_8(m, mt, threshold):       # right at the kernel's 8, and only there
        return torch.where(mt - m > 8.0, mt, m)

    def the_fix(m, mt, threshold):            # the wave's ballot and fmax: as many moves
        fire = (mt - m > threshold).any(-1, keepdim=True)
        return torch.where(fire, torch.maximum(m, mt), m)

    def unfixed(m, mt, threshold):            # the wave's ballot and the own tile max
        fire = (mt - m > threshold).any(-1, keepdim=True)
        return torch.where(fire, mt, m)

    def never(m, mt, threshold):              # the first tile's base to the end
        return m

    rejects(ex.check_rule, hard_coded_8, "use the threshold it is given", small_rule_cases)
    rejects(ex.check_rule, the_fix, "as many bases as the fix .*decides row by row",
            small_rule_cases)
    rejects(ex.check_rule, unfixed, "overflow", small_rule_cases)
    rejects(ex.check_rule, never, "overflow|threshold", small_rule_cases)


def test_first_nan_tile_check():
    shown = ex.check_first_nan_tile(sol.first_nan_tile)["first NaN tile"]
    assert shown.to_dict() == {"A": "survives", "B": 4, "C": "survives", "D": 3}   # no NaN shown

    def summed_drops(tile_max):               # accumulation: each drop adds to the deficit
        deficit = 0.0
        for t in range(1, len(tile_max)):
            deficit += max(0.0, tile_max[t - 1] - tile_max[t])
            if deficit >= 128:
                return t
        return None

    def strict(tile_max):                     # > 128 instead of >= 128
        best = -math.inf
        for t, mt in enumerate(tile_max):
            best = max(best, mt)
            if best - mt > 128:
                return t
        return None

    def overall_best(tile_max):               # against the row's best over all tiles
        top = max(tile_max)
        return next((t for t, mt in enumerate(tile_max) if top - mt >= 128), None)

    def previous_tile(tile_max):              # each drop from the tile before, alone
        return next((t for t in range(1, len(tile_max))
                     if tile_max[t - 1] - tile_max[t] >= 128), None)

    rejects(ex.check_first_nan_tile, summed_drops, "not a sum of drops")
    rejects(ex.check_first_nan_tile, strict, ">= 128")
    rejects(ex.check_first_nan_tile, previous_tile, "not against the tile before it")
    with pytest.raises(AssertionError) as e:
        ex.check_first_nan_tile(previous_tile)
    assert ">= 128" not in str(e.value)
    rejects(ex.check_first_nan_tile, overall_best, "SO FAR")

    def minus_one(tile_max):                  # a survivor as -1 instead of None
        got = sol.first_nan_tile(tile_max)
        return -1 if got is None else got

    rejects(ex.check_first_nan_tile, minus_one, "return None for a row that survives")


# ---- lesson 03 ---------------------------------------------------------------------------

def test_safe_threshold_check_accepts_the_reference_and_other_spellings():
    assert ex.check_safe_threshold(sol.largest_safe_threshold)
    assert ex.check_safe_threshold(lambda h=0.0: math.log2(464 / 2 ** h))
    assert ex.check_safe_threshold(lambda h=0.0: torch.tensor(464.0, dtype=torch.float64).log2() - h)
    assert ex.check_safe_threshold(lambda h=0.0: torch.tensor(464.0).log2() - h)      # float32


def test_safe_threshold_check_names_each_plausible_mistake():
    rejects(ex.check_safe_threshold, lambda h=0.0: math.log2(448) - h, "past 448 still rounds to 448")
    rejects(ex.check_safe_threshold, lambda h=0.0: math.log2(464) + h, "more headroom leaves less room")
    rejects(ex.check_safe_threshold, lambda h=0.0: math.log2(464), "is headroom in your answer")
    rejects(ex.check_safe_threshold, lambda h=0.0: math.log(464) - h, "ln 464: thresholds are log2")
    rejects(ex.check_safe_threshold, lambda h=0.0: 464 - h, "an exponent .log2 units., not a value of P")
    rejects(ex.check_safe_threshold, lambda h=0.0: math.log2(480) - h, "480, e4m3's next code")
    rejects(ex.check_safe_threshold, lambda h=0.0: 9.0 - h, "at 512: which P is the largest that still rounds to 448")
    rejects(ex.check_safe_threshold, lambda h=0.0: math.log2(464) - 2 * h, "largest_safe_threshold.1.")
    rejects(ex.check_safe_threshold, lambda h=0.0: None, "return a number")
    rejects(ex.check_safe_threshold, lambda h=0.0: math.inf, "finite")


def test_safe_threshold_check_against_the_kernels_table():
    import pandas as pd

    casts = pd.DataFrame([{"threshold": 8.84, "headroom": 0.0, "NaN rows, saturating": 0,
                           "NaN rows, non-saturating": 0, "mean |o - 1|, saturating": 0.01,
                           "mean |o - 1|, non-saturating": 0.01},
                          {"threshold": 8.0, "headroom": 1.0, "NaN rows, saturating": 0,
                           "NaN rows, non-saturating": 3, "mean |o - 1|, saturating": 0.02,
                           "mean |o - 1|, non-saturating": 0.03}]).set_index(["threshold", "headroom"])
    assert ex.check_safe_threshold(sol.largest_safe_threshold, casts)
    liar = casts.copy()
    liar.loc[(8.0, 1.0), "NaN rows, non-saturating"] = 0
    with pytest.raises(AssertionError, match="threshold 8, headroom 1: past your largest safe"):
        ex.check_safe_threshold(sol.largest_safe_threshold, liar)
    apart = casts.copy()
    apart.loc[(8.84, 0.0), "mean |o - 1|, non-saturating"] = 0.02
    with pytest.raises(AssertionError, match="within the bound, yet the casts differ"):
        ex.check_safe_threshold(sol.largest_safe_threshold, apart)
    clamped = casts.copy()
    clamped.loc[(8.84, 0.0), "NaN rows, saturating"] = 1
    with pytest.raises(AssertionError, match="a saturating cast made NaN"):
        ex.check_safe_threshold(sol.largest_safe_threshold, clamped)


# ---- lesson 04 ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_combine_cases():
    return ex.combine_cases()            # the lesson's own cases


def test_combine_check(small_combine_cases):
    table = ex.check_combine(sol.combine, small_combine_cases)
    assert table.loc["lazy_unfixed", "rows with a part's LSE NaN"] > 0   # a dead part is tested

    def nan_kept(parts):                      # a part with a NaN LSE kept in the LSE
        lse = torch.logsumexp(torch.stack([x for _, x in parts]), 0)
        return sum(torch.exp(x - lse).transpose(1, 2)[..., None] * o.float() for o, x in parts), lse

    def unnormalised(parts):                  # weights exp(LSE_i), not exp(LSE_i - LSE)
        lses = torch.stack([x for _, x in parts])
        lse = torch.logsumexp(torch.where(lses.isnan(), -math.inf, lses), 0)
        return sum(torch.exp(x).transpose(1, 2)[..., None] * o.float() for o, x in parts), lse

    def dead_dropped(parts):                  # a dead part's NaN output kept out of the row
        out, lse = sol.combine(parts)
        return out.nan_to_num(0.0), lse

    rejects(ex.check_combine, nan_kept, "out of the LSE", small_combine_cases)
    rejects(ex.check_combine, unnormalised, "exp\\(LSE_i - LSE\\)", small_combine_cases)
    rejects(ex.check_combine, dead_dropped, "still reaches its row", small_combine_cases)


def _combine(parts, layout):
    """The reference combine with the weights [B, H, S] laid onto o [B, S, H, D] by ``layout``."""
    lses = torch.stack([x for _, x in parts])
    lse = torch.logsumexp(torch.where(lses.isnan(), -math.inf, lses), 0)
    return sum(layout(torch.exp(x - lse))[..., None] * o.float() for o, x in parts), lse


def test_combine_check_names_the_layout(small_combine_cases):
    ex.check_combine(lambda parts: _combine(parts, lambda w: w.transpose(1, 2)),
                     small_combine_cases)
    # no transpose: torch's broadcasting refuses [B, H, S, 1] * [B, S, H, D]; the check says why
    rejects(ex.check_combine, lambda parts: _combine(parts, lambda w: w),
            "failed on a shape(.|\n)*\\[B, S, H\\] layout", small_combine_cases)
    # a reshape has the right shape and pairs each weight with another (row, head)
    rejects(ex.check_combine, lambda parts: _combine(parts, lambda w: w.reshape(
        w.shape[0], w.shape[2], w.shape[1])), "reshaped from \\[B, H, S\\] to \\[B, S, H\\]",
            small_combine_cases)
    with pytest.raises(AssertionError) as e:                  # not the weights' formula
        ex.check_combine(lambda parts: _combine(parts, lambda w: w.reshape(
            w.shape[0], w.shape[2], w.shape[1])), small_combine_cases)
    assert "exp(LSE_i - LSE)" not in str(e.value)


# ---- appendix F ---------------------------------------------------------------------------

def test_best_case_check():
    assert abs(ex.check_best_case(sol.best_case_speedup) - 10 / 9.5) < 1e-12

    def means(ms):
        m = {k: statistics.mean(x) for k, x in ms.items()}
        return m["eager"] / (m["no_rescale_bound"] + m["lazy_never"] - m["eager"])

    def bound_only(ms):
        m = {k: statistics.median(x) for k, x in ms.items()}
        return m["eager"] / m["no_rescale_bound"]

    rejects(ex.check_best_case, means, "median")
    rejects(ex.check_best_case, bound_only, "vote alone")


def _best(ms, *, vote="lazy_never", avg=statistics.median, inverse=False):
    m = {k: avg(x) for k, x in ms.items()}
    r = m["eager"] / (m["no_rescale_bound"] + m[vote] - m["eager"])
    return 1 / r if inverse else r


def test_best_case_check_names_the_mistake_without_the_formula():
    assert ex.check_best_case(_best) == ex.check_best_case(sol.best_case_speedup)
    # every variant of the measurement is in the launches: no KeyError for `lazy`
    for answer, named in ((lambda ms: _best(ms, vote="lazy"), "taken from `lazy`"),
                          (lambda ms: _best(ms, vote="lazy_at_b7e066d"), "lazy_at_b7e066d"),
                          (lambda ms: _best(ms, inverse=True), "upside down"),
                          (lambda ms: _best(ms, avg=min), "fastest round"),
                          (lambda ms: _best(ms, avg=statistics.mean), "mean"),
                          (lambda ms: 1.0, "the best case is 1.0526")):   # no mistake it knows
        with pytest.raises(AssertionError, match=named) as e:
            ex.check_best_case(answer)
        assert "bound + " not in str(e.value) and "eager / (" not in str(e.value)
    # a mistake the check has no name for is not named as another one
    def twice_never(ms):
        m = {k: statistics.median(x) for k, x in ms.items()}
        return m["eager"] / (2 * m["lazy_never"] - m["eager"])

    with pytest.raises(AssertionError, match="the best case is 1.0526") as e:
        ex.check_best_case(twice_never)
    assert "lazy_at_b7e066d" not in str(e.value)


# ---- lesson 06 ---------------------------------------------------------------------------

def test_guaranteed_safe_check():
    import pandas as pd

    assert abs(ex.check_guaranteed_safe(sol.guaranteed_safe) - 117) < 1e-12
    rejects(ex.check_guaranteed_safe, lambda t, n, v: t + math.log2(n) + math.log2(v) <= 128,
            "strictly below 128")
    rejects(ex.check_guaranteed_safe, lambda t, n, v: t + math.log2(n) < 128, "max \\|v\\|")
    rejects(ex.check_guaranteed_safe, lambda t, n, v: t + math.log(n) + math.log(v) < 128,
            "log2 units")
    # a bound that leaves out n_keys is told so, not sent to the strict-inequality message
    rejects(ex.check_guaranteed_safe, lambda t, n, v: t + math.log2(v) < 128, "is n_keys in")
    rejects(ex.check_guaranteed_safe, lambda t, n, v: t < 128, "is n_keys in")
    # against an atlas: a NaN where the bound says safe is the bound's fault
    nan = pd.DataFrame({8.0: [0.0, 0.0], 120.0: [0.1, 0.1]},
                       index=pd.MultiIndex.from_tuples([("lazy", 16), ("fa4_row", 16)]))
    ex.check_guaranteed_safe(sol.guaranteed_safe, nan, n_keys=2048, v_max=4.0)
    with pytest.raises(AssertionError, match="made NaN there"):
        ex.check_guaranteed_safe(sol.guaranteed_safe, nan, n_keys=1, v_max=1.0)   # 120 < 128


# ---- lesson 07 ---------------------------------------------------------------------------

@pytest.mark.slow
def test_zoo_policy_check():
    import dataclasses

    from fa_lab import Policy
    from fa_lab.semantics import Semantics

    answer = sol.zoo_policy()
    ex.check_zoo_policy(answer)
    start = Policy(vote="row", rebase="max", threshold=4.0, p_headroom=8.0, name="start",
                   semantics=Semantics(p_cast="e4m3", block_n=128, tile_max_floor="causal",
                                       empty_row_guard="none", o_gate="always", v_tail="cache"))
    rejects(ex.check_zoo_policy, start, "entries' own inputs(.|\n)*the attack broke it")
    rejects(ex.check_zoo_policy, dataclasses.replace(answer, semantics=dataclasses.replace(
        answer.semantics, p_cast="input")), "e4m3 P cast")
    rejects(ex.check_zoo_policy, dataclasses.replace(answer, threshold=1.0), "P saturation")


def test_zoo_policy_check_wants_the_fp8_p_worth_something():
    """Threshold 0 and headroom 0, every guard on: nothing saturates and nothing is NaN, but
    the tails stay within tolerance only up to 188 keys; each binade of H doubles that, and
    the reference answer's H = 8 reaches the bug report's 8192 keys."""
    import dataclasses

    # n 2^(-10 - H) <= 0.25 - 2^-4 (e4m3's rounding) - 2^-8 (the bf16 output's): 188 keys at H = 0
    at_h0 = (0.25 - 2 ** -4 - 2 ** -8) * 2 ** 10
    answer = sol.zoo_policy()
    flat = dataclasses.replace(answer, threshold=0.0, p_headroom=0.0)
    assert ex.zoo_safe_keys(flat) == pytest.approx(at_h0) and round(at_h0) == 188
    assert ex.zoo_safe_keys(dataclasses.replace(flat, p_headroom=1.0)) == pytest.approx(2 * at_h0)
    assert ex.zoo_safe_keys(answer) == pytest.approx(at_h0 * 2 ** 8)
    assert ex.zoo_safe_keys(answer) >= ex.ZOO_MIN_KEYS
    rejects(ex.check_zoo_policy, flat, "only up to 188 keys(.|\n)*8,192 keys", max_evals=6)
    with pytest.raises(AssertionError) as e:
        ex.check_zoo_policy(flat, max_evals=6)
    assert "\n" not in str(e.value)                          # the only layer it fails


def test_zoo_policy_try_this():
    """Lesson 07's Try-this, on the reference answer: threshold 1 makes P saturation live,
    headroom 4 (threshold 4) keeps it out at a sixteenth of the safe length, and reopening the
    empty-tile guards brings back exactly the six entries whose inputs hold rows that see nothing."""
    import dataclasses

    from fa_lab.studies import onset
    from fa_lab.zoo import ENTRIES

    def hazard(policy, name):
        return next(h for h in onset.bound(policy).hazards if h.name == name)

    def safe_keys(policy):
        one = torch.ones(1, 1, 1, 8)
        margins = onset.bound(policy).margins(onset.measure(one, one, one, policy=policy))
        return 2 ** margins["silent mass loss (rounding and flushed tails)"]

    answer = sol.zoo_policy()
    assert hazard(answer, "P saturation").never
    assert not hazard(dataclasses.replace(answer, threshold=1.0), "P saturation").never
    low = dataclasses.replace(answer, p_headroom=4.0, threshold=4.0)
    assert hazard(low, "P saturation").never and safe_keys(answer) == 16 * safe_keys(low)
    open_ = dataclasses.replace(answer, semantics=dataclasses.replace(
        answer.semantics, tile_max_floor="causal", empty_row_guard="none", clamp_exp_diff=False))
    assert not any(e.shows(answer) for e in ENTRIES.values())
    assert {n for n, e in ENTRIES.items() if e.shows(open_)} == {
        "flydsl_fp8_empty_tile", "sdpa_masked_row", "pytorch_cpu_masked_block", "te_cp_empty_band",
        "flashinfer_merge_empty", "pytorch_mha_masked_row"}


# ---- lesson 09 ---------------------------------------------------------------------------

def test_lse2_floored_check():
    assert ex.check_lse2_floored(sol.lse2_floored)
    rejects(ex.check_lse2_floored, lambda x: torch.fmax(x, torch.tensor(-3e38)), "log2 units")
    rejects(ex.check_lse2_floored, lambda x: torch.fmax(x, torch.tensor(-3e38)) * math.log2(math.e),
            "floor after converting")
    rejects(ex.check_lse2_floored, lambda x: torch.clamp(x * math.log2(math.e), min=-3e38), "fmax")


# ---- lesson 08 ---------------------------------------------------------------------------

def _naive_merge(maxes, sums, outs, *, exp=torch.exp, log=torch.log, norm=True, by_sum=True):
    """The split reduce without guards, with one knob per plausible mistake."""
    top = maxes.amax(0)
    w = (sums if by_sum else torch.ones_like(sums)) * exp(maxes - top)
    total = w.sum(0)
    out = ((w / total if norm else w)[..., None] * outs).sum(0)
    return out, top + log((sums * torch.exp(maxes - top)).sum(0))


@pytest.fixture(scope="module")
def decode_partitions():
    from fa_lab import decode
    from fa_lab.kernels.pa_decode import cases

    c = cases.make([900], num_q_heads=4, block_size=64, seed=2)
    return decode.partitions(c.query, c.key_cache, c.value_cache, c.block_tables,
                             c.context_lengths, c.key_scale, c.value_scale, num_partitions=3)


def test_merge_partitions_check(decode_partitions):
    table = ex.check_merge_partitions(sol.merge_partitions, model=decode_partitions)
    assert (table.iloc[:2].to_numpy() < 1e-10).all() and len(table) == 3
    assert table.iloc[2, 0] < 2 ** -8      # within a bf16 step of the model's output
    rec = dict(decode_partitions, pout=decode_partitions["pout"].flip(2))     # partitions swapped
    rejects(ex.check_merge_partitions, sol.merge_partitions, "decode model", model=rec)
    rejects(ex.check_merge_partitions, lambda m, s, o: _naive_merge(m, s, o, norm=False),
            "not normalized")
    rejects(ex.check_merge_partitions, lambda m, s, o: _naive_merge(m, s, o, by_sum=False),
            "by its sum")
    rejects(ex.check_merge_partitions, lambda m, s, o: _naive_merge(m, s, o, exp=torch.exp2),
            "natural logs")
    rejects(ex.check_merge_partitions, lambda m, s, o: _naive_merge(m, s, o, log=torch.log2),
            "not log2")
    rejects(ex.check_merge_partitions, _naive_merge, "0 \\* NaN is NaN")      # no guards


def test_merge_partitions_check_names_an_lse_in_log2():
    def log2_lse(maxes, sums, outs):          # the right merge, its LSE in log2 units
        out, lse = sol.merge_partitions(maxes, sums, outs)
        return out, lse * math.log2(math.e)

    rejects(ex.check_merge_partitions, log2_lse, "an LSE in log2")
    ex.check_merge_partitions(sol.merge_partitions)


def test_merge_partitions_check_wants_a_row_without_keys_guarded():
    def zeroes_nan_outputs_only(maxes, sums, outs):   # empty partitions out, no row guard
        return _naive_merge(maxes, sums, torch.nan_to_num(outs))

    rejects(ex.check_merge_partitions, zeroes_nan_outputs_only, "no token at all")
