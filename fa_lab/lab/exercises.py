"""The lessons' exercises: the checks that hold what a learner writes (``notebooks/``).

Every exercise starts in its lesson as a stub that raises ``NotImplementedError`` saying what
to write. The cell after it runs ``f = exercises.yours(f)`` and then this module's
``check_*(f)``: each check raises an ``AssertionError`` whose message names the mistake,
and returns what the lesson shows. The reference answers live in ``fa_lab.lab.solutions``;
``yours`` substitutes them when ``FA_LAB_SOLUTIONS=1`` (``SOLUTIONS_ENV``), which nbval
(``notebooks/conftest.py``) and the docs build (``docs/conf.py``) set, so CI runs every
lesson with an answer and a learner meets the stub. ``tests/lab/test_exercises.py`` shows
that each check accepts the reference answer and rejects wrong ones.

Checks that run a kernel take their cases as an argument (the lesson's by default), so a
test can hold them on smaller inputs.
"""

from __future__ import annotations

import math
import os

import pandas as pd
import torch

from fa_lab.lab import mistakes
from fa_lab.lab.online import empty_state, finish, online_problem, reference_one_head, run_tiles

#: The environment variable under which ``yours`` returns the reference answers.
SOLUTIONS_ENV = "FA_LAB_SOLUTIONS"


def yours(fn):
    """The learner's ``fn``, or, with ``FA_LAB_SOLUTIONS=1``, the reference answer of the same
    name from ``fa_lab.lab.solutions`` (CI and the docs build run the lessons that way)."""
    from fa_lab.lab import solutions

    name = getattr(fn, "__name__", None)
    if not callable(fn) or name is None:
        raise TypeError(f"yours takes the function the exercise asks for, got {fn!r}")
    if os.environ.get(SOLUTIONS_ENV) == "1":
        if not hasattr(solutions, name):
            raise ValueError(f"no reference answer named {name!r} in fa_lab.lab.solutions")
        return getattr(solutions, name)
    return fn


def _named(mistake):
    """``": " + mistake`` when ``fa_lab.lab.mistakes`` named one, else nothing."""
    return f": {mistake}" if mistake else ""


# ---- lesson 00: one row's lazy bases ------------------------------------------------------

def check_lazy_bases(lazy_bases) -> pd.DataFrame:
    """``lazy_bases(tile_max, threshold)``: one row's base after each tile under the lazy rule
    for one row. Returns the hand-made row and its bases."""
    row = [3.0, 9.0, 11.0, 12.0, 30.0, 20.0, 38.0, 38.5, 47.0, 10.0]
    got = [float(x) for x in lazy_bases(row, 8.0)]
    assert len(got) == len(row), f"one base per tile: {len(row)} tiles, got {len(got)} bases"
    assert got[0] == row[0], "the first tile sets the base to its own max"
    assert all(b >= a for a, b in zip(got, got[1:])), \
        f"a base moved down ({got}): the lazy rule only ever raises it"
    assert got[1] == row[0], \
        "tile 1 beats the base by 6, within the threshold of 8: the base stays (not eager)"
    assert got[2] == row[0], \
        "tile 2 beats the base by exactly 8: only MORE than the threshold moves it"
    if got[3] == row[0]:
        raise AssertionError(
            "tile 3's max (12) beats the base (3) by 9, more than the threshold, yet the base "
            "stayed: compare each tile max with the base, not with the best tile max so far "
            "(11), which it beats by only 1")
    assert got[3] == row[3], "tile 3 beats the base (3) by 9: the base moves up to that tile max (12)"
    assert got[4] == row[4], "tile 4 beats the base (12) by 18: the base moves up to that tile max"
    assert got[-1] == row[8], "a tile far below the base leaves it where it is"
    for thr in (2.0, 20.0):
        want = _lazy_reference(row, thr)
        got_t = [float(x) for x in lazy_bases(row, thr)]
        assert got_t == want, f"at threshold {thr:g} the bases are {want}, got {got_t}: does " \
                              f"your rule use the threshold it is given?"
    return pd.DataFrame({"tile max": row, "base": got})


def _lazy_reference(row, thr):
    from fa_lab.lab import solutions

    return [float(x) for x in solutions.lazy_bases(row, thr)]


# ---- lesson 01: the update and the merge ---------------------------------------------------

def check_update(update, problem=None) -> dict:
    """Exercise 1 of lesson 01: ``update(state, s, v)`` three ways: fp64 against the reference;
    tile by tile (m is the largest score so far, l at most the keys seen); fp32 at K x32 over
    128 tiles. Returns the fp64 errors."""
    q, k, v, ref_out, ref_lse = problem or online_problem()
    out, lse = finish(run_tiles(update, q, k, v))
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape, \
        f"update must return (m [R], l [R], O [R, D]); the output came out {tuple(out.shape)}"
    err_out = (out - ref_out).abs().max().item()
    err_lse = (lse - ref_lse).abs().max().item()
    if not err_out < 1e-12:
        raise AssertionError("the output differs from fa_lab.reference.attention"
                             + _named(mistakes.update(update)))
    assert err_lse < 1e-12, "the output is right but the LSE is not: is l against the final m?"
    c = math.log2(math.e) / math.sqrt(q.shape[1])
    s_all = (q @ k.T) * c
    state = empty_state(q.shape[0], v.shape[1])
    for j in range(0, k.shape[0], 64):
        before = state[0]
        state = update(state, s_all[:, j:j + 64], v[j:j + 64])
        want = s_all[:, :j + 64].amax(-1)
        if not torch.equal(state[0], want):
            if (state[0] < before).any():
                msg = "the base fell below the one before it: is it the tile's own max?"
            elif (state[0] < want).any():
                msg = ("the base stayed below a larger score in this tile: does it move up "
                       "when a tile beats it?")
            else:
                msg = "the base is above every score seen so far"
            raise AssertionError(
                f"after tile {j // 64}, m is not the largest score seen so far: {msg}")
        assert (state[1] <= j + 64).all(), \
            f"after tile {j // 64}, l exceeds the {j + 64} keys seen: a correction above 1?"
    g32 = torch.Generator().manual_seed(32)
    d = q.shape[1]
    q32, k32, v32 = (torch.randn(n, d, generator=g32) * sc
                     for n, sc in ((q.shape[0], 1), (8192, 32), (8192, 1)))
    out32, lse32 = finish(run_tiles(update, q32, k32, v32))
    ref32, ref_lse32 = reference_one_head(q32, k32, v32)
    assert torch.isfinite(out32).all() and torch.isfinite(lse32).all(), \
        "fp32, K x32: your output or LSE overflowed: does the base stay at the running max?"
    assert (out32 - ref32).abs().max() < 1e-4 and (lse32 - ref_lse32).abs().max() < 1e-3, \
        "fp32, K x32: finite, but far from the reference"
    return {"tiles": k.shape[0] // 64, "rows": q.shape[0], "max |out - reference|": err_out,
            "max |LSE - reference|": err_lse}


def check_merge(merge, problem=None, cuts=(0, 640, 1408, 2048)) -> pd.DataFrame:
    """Exercise 2 of lesson 01: ``merge(a, b)`` of the states of three uneven parts of the keys
    (each from the reference update), in two orders, against the reference; the merged base
    must be ``max(m1, m2)``. Returns the errors per order."""
    from fa_lab.lab import solutions

    q, k, v, ref_out, ref_lse = problem or online_problem()
    parts = [run_tiles(solutions.update, q, k[a:b], v[a:b]) for a, b in zip(cuts, cuts[1:])]
    orders = {"(a ⊕ b) ⊕ c": lambda: merge(merge(parts[0], parts[1]), parts[2]),
              "c ⊕ (b ⊕ a)": lambda: merge(parts[2], merge(parts[1], parts[0]))}
    rows = {}
    for name, run in orders.items():
        o, lse = finish(run())
        e_out, e_lse = (o - ref_out).abs().max().item(), (lse - ref_lse).abs().max().item()
        if not (e_out < 1e-12 and e_lse < 1e-12):
            raise AssertionError(f"{name} differs from the reference" + _named(mistakes.merge(merge)))
        rows[name] = {"max |out - reference|": e_out, "max |LSE - reference|": e_lse}
    for a, b in ((parts[0], parts[1]), (parts[2], parts[0])):    # either part may hold the max
        assert torch.equal(merge(a, b)[0], torch.maximum(a[0], b[0])), \
            "the merged base must be max(m1, m2): below it, the other part's terms exceed 1"
    return pd.DataFrame(rows).T


# ---- lesson 02: a rule that survives, and the onset rule ----------------------------------

def rule_cases(rows=256, keys=8192, device="cpu") -> dict:
    """Lesson 02's cases for ``check_rule``: the bug report's first block of rows at K x32 and
    x64 (``rows`` query rows against ``keys`` keys) and ``experiments.drag_case()``."""
    from fa_lab.studies import experiments

    def block(k_scale):
        q, k, v = experiments.bf16_inputs(1, keys, 1, 128, k_scale)
        return tuple(t.contiguous().to(device) for t in (q[:, :rows], k, v))

    return {"K x32": block(32), "K x64": block(64),
            "drag_case": tuple(t.to(device) for t in experiments.drag_case())}


def _rule_row(qc, kc, vc, pol, ref):
    from fa_lab import api, metrics
    from fa_lab.lab import lessons

    # kernel="swp_bf16": drag_case's 32 rows would go to upstream's eager generic kernel;
    # every case runs DUALWAVE_SWP, the kernel lesson 02 is about
    st = lessons.with_deficit(api.trace(qc, kc, vc, rows=range(qc.shape[1]), causal=False,
                                        rescale=pol, kernel="swp_bf16"))
    out = api.flash_attn_func(qc, kc, vc, causal=False, rescale=pol, kernel="swp_bf16")
    return {"finite": bool(torch.isfinite(out).all()), "rel-L2": metrics.rel_l2(out, ref),
            "bases moved": int((st.m != st.m_before)[st.step > 0].sum()),
            "largest deficit": float(st.deficit.max())}


def check_rule(rule, cases=None, *, threshold=8.0, other_threshold=4.0) -> pd.DataFrame:
    """Lesson 02's exercise: ``rule(m, mt, threshold)`` as a policy, on each case against the
    unfixed rule, the fix and eager: finite, as accurate as eager (within 2 %), fewer bases
    moved than the fix (in no case more), and every deficit within the threshold; then again
    at ``other_threshold`` on the first case, where a rule that ignores its threshold lets a
    base fall further behind. Returns the table, one column per case."""
    from fa_lab import Policy, reference

    cases = rule_cases() if cases is None else cases
    mine = Policy.from_rule(rule, name="my_rule", threshold=threshold)
    table = {}
    for case, (qc, kc, vc) in cases.items():
        ref, _ = reference.attention(qc, kc, vc, causal=False)
        row = {}
        for name, pol in (("unfixed", "lazy_unfixed"), ("fix", "lazy"), ("eager", "eager"),
                          ("mine", mine)):
            row.update({f"{name}: {k}": x for k, x in _rule_row(
                qc, kc, vc, _at(pol, threshold), ref).items()})
        table[case] = row
    checks = pd.DataFrame(table).T
    assert not checks["unfixed: finite"].all(), "these cases should break the unfixed rule"
    assert checks["mine: finite"].all(), \
        f"your rule lets some output overflow: {list(checks.index[~checks['mine: finite'].astype(bool)])}"
    assert (checks["mine: rel-L2"] <= 1.02 * checks["eager: rel-L2"]).all(), "less accurate than eager"
    assert (checks["mine: bases moved"] <= checks["fix: bases moved"]).all(), \
        "moves more bases than the fix in some case"
    assert checks["mine: bases moved"].sum() < checks["fix: bases moved"].sum(), \
        f"your rule moves as many bases as the fix ({int(checks['fix: bases moved'].sum())} in " \
        f"all): the fix moves every row of a firing wave whose tile max beat its base at all, " \
        f"even by less than the threshold; a rule that moves fewer decides row by row"
    assert (checks["mine: largest deficit"] <= threshold).all(), \
        f"a base fell more than the threshold ({threshold:g}) behind its row's true max"
    case, (qc, kc, vc) = next(iter(cases.items()))
    ref, _ = reference.attention(qc, kc, vc, causal=False)
    other = _rule_row(qc, kc, vc, Policy.from_rule(rule, name="my_rule",
                                                   threshold=other_threshold), ref)
    assert other["finite"] and other["largest deficit"] <= other_threshold, \
        f"at threshold {other_threshold:g} ({case}) a base fell {other['largest deficit']:.2f} " \
        f"behind its row's true max: does your rule use the threshold it is given?"
    return checks.T


def _at(pol, threshold):
    """A named policy at ``threshold`` (eager has none)."""
    import dataclasses

    from fa_lab import policies

    p = policies.get(pol) if isinstance(pol, str) else pol
    return p if not p.lazy or p.rule is not None else dataclasses.replace(p, threshold=threshold)


def check_first_nan_tile(first_nan_tile) -> pd.DataFrame:
    """Lesson 02's puzzle: ``first_nan_tile(tile_max)``, the tile at which a row dies under the
    unfixed rule when its wave fires on every step (None if it never does). Returns the
    hand-made rows and the answers (a survivor's as "survives")."""
    rows = {"A": [0, 100, 40, -20, 90, -27, 60],       # deficits up to 127: never
            "B": [50, 10, -60, -77, -78, 0],           # 50 - (-78) = 128 at tile 4
            "C": [0, 120, 5, 130, 10, 3],              # against the record so far: never
            "D": [10, -100, 200, 72, 100, 71]}         # 200 - 72 = 128 at tile 3
    want = {"A": None, "B": 4, "C": None, "D": 3}
    got = {}
    for name, row in rows.items():
        got[name] = first_nan_tile([float(x) for x in row])
        if got[name] != want[name]:
            # B's deficit reaches exactly 128, over four drops of 40, 70, 17 and 1: an answer
            # that misses it compares with > 128, or measures each drop from the tile before
            step_by_step = first_nan_tile([0.0, -100.0, -150.0]) != 2   # 150 below, in two drops
            if want[name] is None and first_nan_tile([0.0, 1.0]) is not None:  # a sure survivor
                raise AssertionError(f"row {name} {row} never dies, and neither does [0, 1], yet you "
                                     f"returned {got[name]!r} for it: return None for a row that "
                                     "survives")
            hint = {"A": "the deficit is the best tile max so far minus the CURRENT tile max, "
                         "not a sum of drops",
                    "B": ("measure each tile max against the best tile max so far, not against "
                          "the tile before it: row B ends 128 below its record (50) after "
                          "four drops, none of them 128 on its own" if step_by_step else
                          "the row dies at a deficit of 128 or more (>= 128, in log2 units)"),
                    "C": "measure against the best tile max SO FAR, not the row's overall best",
                    "D": "measure against the best tile max so far, not the first tile's"}[name]
            raise AssertionError(f"row {name} {row}: dies at {want[name]}, you said "
                                 f"{got[name]}: {hint}")
    # object dtype: a survivor shows "survives", not the NaN a float column would make of None
    return pd.DataFrame({"tile maxima": {n: r for n, r in rows.items()},
                         "first NaN tile": pd.Series({n: "survives" if t is None else int(t)
                                                      for n, t in got.items()}, dtype=object)})


# ---- lesson 03: the saturation bound --------------------------------------------------------

#: e4m3's largest value, and the midpoint to the code after it: a P up to the midpoint rounds to
#: 448 (the midpoint itself ties to the even 448), a P past it is NaN under a non-saturating cast.
_E4M3_LAST, _E4M3_MIDPOINT, _E4M3_NEXT = 448.0, 464.0, 480.0


def _threshold(fn, headroom):
    got = fn(headroom)
    try:
        got = float(got)
    except (TypeError, ValueError):
        raise AssertionError(f"largest_safe_threshold({headroom:g}) returned {got!r}: return a number, "
                             "the threshold in log2 units") from None
    assert math.isfinite(got), f"largest_safe_threshold({headroom:g}) returned {got}: return a finite threshold"
    return got


def check_safe_threshold(largest_safe_threshold, casts: pd.DataFrame | None = None) -> bool:
    """Lesson 03's exercise: ``largest_safe_threshold(headroom)``, the largest lazy threshold
    (log2 units) at which no P, with ``headroom`` added in its exponent, rounds past e4m3's
    last code, so that the saturating and the non-saturating cast agree (the reference answer,
    derived, is in ``fa_lab.lab.solutions``). Checked at a few headrooms first and, given
    ``casts`` (one row per (threshold, headroom) with the kernel's NaN rows under each cast and
    mean |o - 1|), against what the kernel did."""
    exact = math.log2(_E4M3_MIDPOINT)
    got0 = _threshold(largest_safe_threshold, 0.0)

    def near(x, y):     # within fp32's rounding of log2 464: an answer in float32 passes
        return abs(x - y) < 1e-5

    assert got0 < 64, \
        f"largest_safe_threshold(0) = {got0:g}: a threshold is an exponent (log2 units), not a " \
        "value of P: which THR makes 2^THR reach the largest P that still rounds to 448?"
    assert not near(got0, math.log(_E4M3_MIDPOINT)), \
        f"largest_safe_threshold(0) = {got0:.4f} is ln 464: thresholds are log2 units (P = 2^(THR + H))"
    assert not near(got0, math.log2(_E4M3_LAST)), \
        f"largest_safe_threshold(0) = {got0:.4f} puts the largest P at 448 exactly, but a P a little " \
        "past 448 still rounds to 448: the casts part only past 464, the midpoint to the next code " \
        "(section 2)"
    assert not near(got0, math.log2(_E4M3_NEXT)), \
        f"largest_safe_threshold(0) = {got0:.4f} lets P reach 480, e4m3's next code, which e4m3fn " \
        "spends on NaN: a P rounds there from past the midpoint 464"
    assert near(got0, exact), \
        f"largest_safe_threshold(0) = {got0:.6g} puts the largest P, 2^THR, at {2 ** got0:.6g}: which " \
        "P is the largest that still rounds to 448 (section 2; a P exactly on that boundary counts as safe)?"
    got1 = _threshold(largest_safe_threshold, 1.0)
    assert not near(got1, got0), \
        f"largest_safe_threshold(1) = largest_safe_threshold(0) = {got0:.4f}: the headroom is " \
        "added in P's exponent, so it changes how large P gets: is headroom in your answer?"
    assert not near(got1, exact + 1.0), \
        f"largest_safe_threshold(1) = {got1:.4f}, more than at headroom 0: the headroom raises every " \
        "P (P up to 2^(THR + H)), so more headroom leaves less room for the threshold"
    for head in (1.0, math.log2(_E4M3_LAST) - 8.0, 0.25, 4.0, 8.0):
        got = _threshold(largest_safe_threshold, head)
        assert near(got, exact - head), \
            f"largest_safe_threshold({head:g}) = {got:.4f} puts the largest P, 2^(THR + H), at " \
            f"{2 ** (got + head):.1f}: it should be 464, the largest P that rounds to 448"
    if casts is not None:
        for (thr, head), r in casts.iterrows():
            assert r["NaN rows, saturating"] == 0, "a saturating cast made NaN"
            past = bool(thr > largest_safe_threshold(head))
            assert (r["NaN rows, non-saturating"] > 0) == past, \
                f"threshold {thr:g}, headroom {head:g}: {'past' if past else 'within'} your largest " \
                f"safe threshold, but the non-saturating cast made {r['NaN rows, non-saturating']} NaN rows"
            if not past:
                assert r["mean |o - 1|, saturating"] == r["mean |o - 1|, non-saturating"], \
                    f"threshold {thr:g}, headroom {head:g}: within the bound, yet the casts differ"
    return True


# ---- lesson 04: split-K's combine -----------------------------------------------------------

def combine_cases(rows=512, keys=2048, heads=2, n_splits=3, k_scale=48.0, device="cpu") -> dict:
    """Lesson 04's cases for ``check_combine``: per policy (``lazy``, ``lazy_unfixed``), the
    parts ``(o, lse)`` of a walk cut where the kernel cuts it and the kernel's own
    ``num_kv_splits`` result on the whole walk."""
    from fa_lab import api
    from fa_lab.kernels.swp_bf16.model import split_ranges
    from fa_lab.studies.experiments import bf16_inputs

    q, k, v = bf16_inputs(1, keys, heads, 128, k_scale, seed=0, device=device)
    q = q[:, :rows].contiguous()
    cuts = [(64 * a, 64 * z) for a, z in split_ranges(k.shape[1] // 64, n_splits)]
    cases = {}
    for policy in ("lazy", "lazy_unfixed"):
        parts = [api.flash_attn_func(q, k[:, a:z], v[:, a:z], causal=False, rescale=policy,
                                     return_lse=True) for a, z in cuts]
        whole = api.flash_attn_func(q, k, v, causal=False, rescale=policy, return_lse=True,
                                    num_kv_splits=n_splits)
        cases[policy] = (parts, whole)
    return cases


def check_combine(combine, cases=None) -> pd.DataFrame:
    """Lesson 04's exercise: ``combine(parts)`` against the kernel's split-K result on each
    case: NaN and inf in the same places, the LSE within 1e-3, the output within one bf16
    step. Returns one row per policy."""
    cases = combine_cases() if cases is None else cases
    rows = {}
    for policy, (parts, (o_k, lse_k)) in cases.items():
        try:
            o_c, lse_c = combine(parts)
        except RuntimeError as err:   # torch's broadcasting refuses a weight in the LSE's layout
            if "size" not in str(err) and "shape" not in str(err):
                raise
            raise AssertionError(f"{policy}: combine failed on a shape ({err}): "
                                 f"{mistakes.LAYOUT}") from err
        assert o_c.shape == o_k.shape and lse_c.shape == lse_k.shape, \
            f"combine returns out [B, S, H, D] {tuple(o_k.shape)} (each part's o's layout) and " \
            f"lse [B, H, S] {tuple(lse_k.shape)} (each part's lse's), got out " \
            f"{tuple(o_c.shape)} and lse {tuple(lse_c.shape)}"
        assert torch.equal(lse_c.isnan(), lse_k.isnan()) and torch.equal(lse_c.isinf(), lse_k.isinf()), \
            f"{policy}: your LSE is NaN or inf where the kernel's is not, or the reverse: the " \
            f"kernel leaves a part whose LSE is NaN out of the LSE"
        both = torch.isfinite(lse_c) & torch.isfinite(lse_k)
        lse_diff = (lse_c - lse_k)[both].abs().max().item()
        assert lse_diff < 1e-3, \
            f"{policy}: your LSE differs from the kernel's: is it the log-sum-exp of the parts' LSEs?"
        layout = mistakes.combine_layout(parts, o_c)
        assert layout is None, f"{policy}: {layout}"
        assert not (o_k.isnan() & ~o_c.isnan()).any(), \
            f"{policy}: the kernel's output is NaN where yours is not: a dead part's NaN " \
            f"output still reaches its row"
        assert not (o_c.isnan() & ~o_k.isnan()).any(), \
            f"{policy}: your output is NaN where the kernel's is not: do the weights " \
            f"overflow? part i is weighted by exp(LSE_i - LSE)"
        ok = torch.isfinite(o_c) & torch.isfinite(o_k.float())
        rel = ((o_c - o_k.float()).abs() / o_k.float().abs().clamp_min(1))[ok].max().item()
        assert rel <= 2 ** -7, \
            f"{policy}: your output differs from the kernel's by more than a bf16 step: is " \
            f"part i weighted by exp(LSE_i - LSE)?"
        rows[policy] = {"NaN % (your combine)": 100 * o_c.isnan().float().mean().item(),
                        "NaN % (split-K kernel)": 100 * o_k.isnan().float().mean().item(),
                        "largest |difference| / |o|": rel, "largest |LSE difference|": lse_diff,
                        "rows with a part's LSE NaN": int(torch.stack(
                            [x.isnan() for _, x in parts]).any(0).sum())}
    return pd.DataFrame(rows).T


# ---- appendix F: the best case ---------------------------------------------------------------

#: Appendix F's constructed launches, every variant of the measurement: in both, eager takes
#: 10 ms, the multiply 1 ms of it and the vote alone 0.5 ms (medians), and ``lazy`` and
#: ``lazy_at_b7e066d`` take times no other mistake's formula reaches (so each mistake is named
#: as itself); the second's three rounds give other answers for
#: their means, minima and per-round ratios than for their medians.
BEST_CASE_LAUNCHES = (
    {"eager": [10.0], "no_rescale_bound": [9.0], "lazy_never": [10.5], "lazy": [10.7],
     "lazy_at_b7e066d": [12.25]},
    {"eager": [10.0, 12.0, 10.0], "no_rescale_bound": [9.0, 9.0, 6.0],
     "lazy_never": [10.5, 8.0, 10.5], "lazy": [10.7, 9.0, 11.0], "lazy_at_b7e066d": [12.25, 13.0, 12.25]})


def check_best_case(best_case_speedup) -> float:
    """Appendix F's exercise on ``BEST_CASE_LAUNCHES``: a lazy policy that skips every
    multiply and pays only the vote runs in 9.5 ms. A wrong answer is named by
    ``fa_lab.lab.mistakes.best_case`` (the message never gives the formula). Returns the
    answer on the first launch."""
    want = 10 / 9.5
    answers = [best_case_speedup({k: list(x) for k, x in launch.items()})
               for launch in BEST_CASE_LAUNCHES]
    for launch, got in zip(BEST_CASE_LAUNCHES, answers):
        if not abs(got - want) < 1e-12:
            named = mistakes.best_case(best_case_speedup, BEST_CASE_LAUNCHES[1], want)
            rounds = len(launch["eager"])
            raise AssertionError(
                f"best_case_speedup: {named}" if named else
                f"best_case_speedup gave {got:.4f} on a constructed launch ({rounds} round"
                f"{'s' if rounds > 1 else ''}) where eager takes 10 ms (median), cutting the "
                f"multiply saves 1 ms of it and the vote alone costs 0.5 ms: the best case is "
                f"{want:.4f}")
    return answers[0]


# ---- lesson 06: the deficit bound -----------------------------------------------------------

def check_guaranteed_safe(guaranteed_safe, nan: pd.DataFrame | None = None, *, n_keys=2048,
                          v_max: float | None = None) -> float:
    """Lesson 06's exercise: ``guaranteed_safe(threshold, n_keys, v_max)`` on hand-picked values
    and, given the atlas's NaN table (``nan``: index (policy, K scale), one column per
    threshold) and its ``v_max``, against every cell of it for ``lazy`` and ``fa4_row``.
    Returns the limit the bound gives at ``n_keys`` and ``v_max`` (1 when not given)."""
    assert guaranteed_safe(8.0, 2048, 4.5), "the kernel's threshold of 8 is safe at 2048 keys"
    assert not guaranteed_safe(160.0, 2048, 4.5), "160 is past fp32's 128"
    # before the boundary cases, so that a bound without n_keys is told so (125 + 10 is past
    # 128 in log2 units and in natural-log units alike; 125 alone is not)
    assert not guaranteed_safe(125, 2 ** 10, 1), \
        "1024 keys add 10 binades (125 + 10 > 128): is n_keys in your bound?"
    assert not guaranteed_safe(117, 2048, 1), \
        "117 + log2(2048) = 128 reaches fp32's limit: in log2 units, and strictly below 128"
    assert guaranteed_safe(116.9, 2048, 1), "116.9 + log2(2048) < 128: safe, in log2 units"
    assert not guaranteed_safe(100, 2048, 2 ** 20), \
        "values up to 2^20 add 20 binades: is max |v| in your bound?"
    assert guaranteed_safe(120, 1, 1), "one key and values at most 1: only the threshold counts"
    vm = 1.0 if v_max is None else float(v_max)
    if nan is not None:
        for pol in ("lazy", "fa4_row"):
            for t in nan.columns:
                if guaranteed_safe(float(t), n_keys, vm):
                    assert (nan.loc[pol][t] == 0).all(), \
                        f"your bound says threshold {t:g} is safe, but {pol} made NaN there"
    return 128 - math.log2(n_keys) - math.log2(vm)


# ---- lesson 07: a policy that survives the zoo ----------------------------------------------

def check_zoo_policy(policy, *, max_evals=40, budget_s=120.0):
    """Lesson 07's exercise, three layers on ``policy`` (a ``Policy`` with an e4m3 P cast):
    every zoo entry's own input, an attack of ``max_evals`` runs over every class of failure,
    and the bound (every input, in closed form: no live NaN or saturation hazard, and the
    silent mass loss within tolerance up to ``ZOO_MIN_KEYS`` keys, so that an offset too
    small to make the fp8 P worth anything fails). An AssertionError lists every layer it
    fails. Returns the attack's result and the bound."""
    from fa_lab.studies import adversary, onset
    from fa_lab.zoo import ENTRIES

    assert policy.semantics.p_cast == "e4m3", "the exercise asks for an e4m3 P cast"
    fails = []
    shows = [name for name, e in ENTRIES.items() if e.shows(policy)]
    if shows:
        fails.append(f"the symptom is back on these entries' own inputs: {shows}")
    attack = adversary.search(policy, max_evals=max_evals, budget_s=budget_s, seed=0, shrink=False)
    if attack.found:
        fails.append(f"the attack broke it: {adversary.summary(attack).splitlines()[0]}")
    region = onset.bound(policy)
    live = [h.name for h in region.hazards if h.kind in ("nan", "saturation") and not h.never]
    if live:
        fails.append(f"the bound leaves these hazards live: {live}")
    keys = zoo_safe_keys(policy)
    if keys < ZOO_MIN_KEYS:
        fails.append(
            f"the bound keeps your output within {region.tolerance:g} of max|V| only up to "
            f"{keys:,.0f} keys (its silent mass loss hazard: a P below 2^-10 rounds to 0, "
            f"against a largest P of 2^H); the exercise asks for an fp8 P worth something at "
            f"the bug report's {ZOO_MIN_KEYS:,} keys: the offset H buys length, each binade of "
            f"it doubling the safe row (section 1), within H + THR <= log2 448")
    assert not fails, "\n".join(fails)
    return attack, region


#: The shortest row lesson 07's policy must keep within the bound's tolerance: the bug
#: report's sequence length (S = 8192), the length lessons 00 to 02 run.
ZOO_MIN_KEYS = 8192


def zoo_safe_keys(policy) -> float:
    """The longest row the bound's silent-mass-loss hazard allows ``policy`` at its
    tolerance: 2 to the hazard's margin (log2 units) on a row of one key, as lesson 07's
    ``safe_keys`` reads it."""
    from fa_lab.studies import onset

    one = torch.ones(1, 1, 1, 8)
    margins = onset.bound(policy).margins(onset.measure(one, one, one, policy=policy))
    return 2 ** margins["silent mass loss (rounding and flushed tails)"]


# ---- lesson 09: the backward's LSE floor -------------------------------------------------

def check_lse2_floored(fn) -> bool:
    """Accept ``fn(lse)`` only if it converts a natural-log LSE to log2 units and floors it as
    the dQ kernel does (convert, then maxNum with -3e38); the message names the mistake."""
    log2e = math.log2(math.e)
    lse = torch.tensor([0.5, -2.0, 80.0, -math.inf, math.nan, math.inf])
    got = fn(lse.clone())
    assert isinstance(got, torch.Tensor) and got.shape == lse.shape, "return a tensor of lse's shape"
    assert got.dtype == torch.float32, f"keep fp32 (the kernel's registers), got {got.dtype}"
    assert torch.allclose(got[:3], lse[:3] * log2e), \
        "finite LSEs must come out in log2 units: multiply by log2(e) = 1.4427 (the recompute is an exp2)"
    assert not torch.isneginf(got[3]), \
        "-inf came out -inf: floor after converting (-3e38 * log2(e) overflows fp32 to -inf)"
    assert got[3] == torch.tensor(-3e38), f"an LSE of -inf must become the floor -3e38, got {got[3].item():.3g}"
    assert not torch.isnan(got[4]), \
        "a NaN LSE stayed NaN: the kernel's floor is fmax (maxNum); use torch.fmax, not clamp/maximum"
    assert got[4] == torch.tensor(-3e38), "a NaN LSE must become the floor -3e38"
    assert torch.isposinf(got[5]), "+inf is above the floor: it stays +inf"
    # the floor in use: the empty band's rows recompute P = 0 for every (masked) key
    assert (torch.exp2(torch.full((64,), -math.inf) - got[3]) == 0).all(), "exp2(-inf - floor) must be 0"
    return True


# ---- lesson 08: the decode's split reduce ---------------------------------------------------

def partition_problem(rows=6, d=16, cuts=(0, 256, 512, 900, 900), k_scale=6.0, seed=8):
    """Lesson 08's inputs for ``check_merge_partitions``: one query's rows against 900 keys
    cut into four partitions (the last empty), each partition's state in fp64 as the
    decode stores it: max in natural-log units, sum against it, output O / l (0 / 0 = NaN
    where the partition saw nothing); the last row sees no key at all. Returns (maxes,
    sums, outs) and the fp64 reference (out, lse) of the rows that see keys."""
    from fa_lab.lab import solutions

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, d, generator=g, dtype=torch.float64)
    k = torch.randn(cuts[-1], d, generator=g, dtype=torch.float64) * k_scale
    v = torch.randn(cuts[-1], d, generator=g, dtype=torch.float64)
    parts = [run_tiles(solutions.update, q, k[a:b], v[a:b]) if b > a else empty_state(rows, d)
             for a, b in zip(cuts, cuts[1:])]
    maxes = torch.stack([m for m, _, _ in parts]) * math.log(2)     # log2 -> natural units
    sums = torch.stack([l for _, l, _ in parts])
    outs = torch.stack([O / l[:, None] for _, l, O in parts])       # NaN where l = 0
    maxes[:, -1], sums[:, -1], outs[:, -1] = -math.inf, 0.0, math.nan   # a row with no key
    return (maxes, sums, outs), reference_one_head(q[:-1], k, v)


def check_merge_partitions(merge_partitions, problem=None, model=None) -> pd.DataFrame:
    """Lesson 08's exercise: ``merge_partitions(maxes, sums, outs)`` -> (out, lse) on
    ``partition_problem()``: normalized weights, each partition weighed by its sum, maxima
    read as natural logs, the LSE in natural log, empty partitions and a row with no key
    guarded; then, given ``model`` (a ``fa_lab.decode.partitions`` record of one sequence
    and KV head on main), on the exact decode model's partitions, within the output's
    bf16 step. Returns the errors."""
    (maxes, sums, outs), (ref_out, ref_lse) = problem or partition_problem()
    live = (sums[:, :-1] > 0).all(1)                        # the partitions that saw keys

    def run(mx, sm, ot):
        got = merge_partitions(mx.clone(), sm.clone(), ot.clone())
        assert isinstance(got, tuple) and len(got) == 2, "return (out [R, D], lse [R])"
        return got

    mx, sm, ot = maxes[live, :-1], sums[live, :-1], outs[live, :-1]   # rows and parts with keys
    out1, _ = run(mx, sm, torch.ones_like(ot))
    assert torch.allclose(out1, torch.ones_like(out1), atol=1e-12), \
        "every partition's output is 1 and the merge is not 1: the weights are not normalized " \
        "(divide by their sum over the partitions)"
    want = (sm[..., None] * ot).sum(0) / sm.sum(0)[:, None]
    got, _ = run(torch.zeros_like(mx), sm, ot)
    assert torch.allclose(got, want, atol=1e-12), \
        "with equal maxima the merge must weigh each partition by its sum l_p (the mass it " \
        "saw), not equally"
    out, lse = run(mx, sm, ot)
    assert out.shape == ot.shape[1:] and lse.shape == mx.shape[1:], \
        f"out must be {tuple(ot.shape[1:])} and lse {tuple(mx.shape[1:])}"
    w2 = sm * torch.exp2(mx - mx.amax(0))
    as_log2 = (w2[..., None] * ot).sum(0) / w2.sum(0)[:, None]
    if not torch.allclose(out, ref_out, atol=1e-10) and torch.allclose(out, as_log2, atol=1e-10):
        raise AssertionError("the maxima are natural logs (main stores m / log2 e): weigh "
                             "partition p by exp(m_p - M), not exp2(m_p - M)")
    err_out = (out - ref_out).abs().max().item()
    assert err_out < 1e-10, "the merged output differs from the fp64 reference"
    top = mx.amax(0)
    lse2 = top + torch.log2((sm * torch.exp(mx - top)).sum(0))
    assert not torch.allclose(lse, lse2, atol=1e-10), \
        "the LSE is in natural log: M + ln(sum_p l_p exp(m_p - M)), not log2 of the sum"
    err_lse = (lse - ref_lse).abs().max().item()
    assert mistakes.merge_partitions_lse(lse, ref_lse) is None, mistakes.merge_partitions_lse(lse, ref_lse)
    assert err_lse < 1e-10, "the LSE differs from the fp64 reference: M + ln(sum_p l_p exp(m_p - M))"
    out_e, lse_e = run(maxes, sums, outs)
    assert not out_e[:-1].isnan().any(), \
        "an empty partition (sum 0, max -inf, out 0/0 = NaN) made a row NaN: its weight is " \
        "0 but 0 * NaN is NaN: leave it out by selection (torch.where), not by multiplying"
    assert torch.allclose(out_e[:-1], out, atol=1e-12) and torch.allclose(lse_e[:-1], lse), \
        "adding an empty partition changed the result: it saw no token and adds nothing"
    assert not out_e[-1].isnan().any() and not lse_e[-1].isnan(), \
        "a row with no token at all came out NaN: every max is -inf and -inf - (-inf) is NaN; " \
        "guard it (out 0, LSE -inf)"
    assert (out_e[-1] == 0).all() and lse_e[-1] == -math.inf, \
        "a row with no token at all: out 0 and LSE -inf"
    errors = {"out vs fp64 reference": err_out, "LSE vs fp64 reference": err_lse}
    if model is not None:
        assert model.get("pmax_units") == "natural", "model: a main-version record (natural-log maxima)"
        got_m, _ = merge_partitions(model["pmax"][0, 0].double(), model["psum"][0, 0].double(),
                                    model["pout"][0, 0].double())
        want_m = model["output"].double().reshape(got_m.shape)
        errors["out vs the decode model (bf16)"] = (got_m - want_m).abs().max().item()
        assert errors["out vs the decode model (bf16)"] <= 2 ** -7 * want_m.abs().max().item(), \
            "on the decode model's own partitions your merge is not the model's output"
    return pd.DataFrame({"max |difference|": errors})
