"""The attack's MLA decode space (``adversary.mla``) and the search loop it shares with the
decode's (``adversary.climb``): the judge on constructed calls against the closed form of the
mass loss and the bound that makes the lifted kernel safe, empty contexts, the search finding
the mass loss from the space alone and nothing with the lift, bad input, the record."""

import math

import numpy as np
import pytest
import torch

from fa_lab.studies import mla_mass_loss
from fa_lab.studies.adversary import check_record, climb, mla
from fa_lab.studies.adversary.judge import Verdict

C = mla.MLACandidate
# 192 keys, V = 1, the peak first: head h stands 12.8 (h + 1) / 128 log2 units above the rest,
# so head 99 is at the flush point, 10
FLUSH = C(tiles=3, last=64, scores="peak", spread=12.8, values="ones", peak_at=0.0)


def test_the_mass_loss_fails_without_the_lift_as_the_closed_form_says():
    v = mla.judge(FLUSH, 0.0)
    assert v.failed and v.classes == ["silent"] and v.fitness == 129.0
    out = mla.run(FLUSH, 0.0)
    # the closed form of one dominant key plus 191 at the head's gap (V = 1: deficit = error)
    for h in (79, 99, 127):
        gap = 12.8 * (h + 1) / 128
        want = float(mla_mass_loss.deficit_closed_form(gap, 191))
        assert abs((1 - float(out[0, h].double().mean())) - want) < 2 ** -8, h
    bad = {h for _, h in v.bad_rows}
    assert 99 in bad and all(((1 - out[0, h].double()).abs().max() > mla.SILENT_TOL)
                             for h in bad)
    assert {h for h in range(128) if (1 - out[0, h].double()).abs().max() > mla.SILENT_TOL} == bad


def test_the_lift_keeps_every_row_inside_the_bound_of_the_tolerance():
    # 512 keys spanning gaps to 24 (past the lifted flush point, 18), V = 1 and N(0, 1)
    for values in ("ones", "normal"):
        c = C(tiles=8, last=64, scores="peak", spread=24.0, values=values, num_kv_splits=3)
        bound = 2 ** -4 + 512 * 2 ** -18 + 2 ** -9
        v = mla.judge(c, 8.0)
        assert not v.failed and v.max_err < bound < mla.SILENT_TOL
    assert mla.judge(C(tiles=8, last=64, scores="peak", spread=24.0, values="ones"), 0.0).failed


def test_an_empty_context_is_judged_only_for_the_empty_class():
    c = C(n_seqs=2, ctx_step=40, tiles=1, last=0)
    assert c.contexts == [0, 40]
    v = mla.judge(c)
    assert not v.failed and v.undefined_rows == [[0, h] for h in range(128)]
    e = mla.judge(c, classes="empty")
    assert e.failed and e.bad_rows == [[0, h] for h in range(128)]   # the empty item's NaN


def test_the_candidate_is_the_call_it_names():
    c = C(n_seqs=2, tiles=3, last=10, ctx_step=-100, scores="gaussian", spread=2.0)
    q, kv, indptr, pages, scale = mla.build(c)
    assert c.contexts == [138, 38] and indptr.tolist() == [0, 138, 176]
    assert q.dtype == kv.dtype == torch.float8_e4m3fn and tuple(q.shape) == (2, 128, 576)
    assert scale == pytest.approx(math.log(2.0))
    x = (q[0].double() @ kv.double().reshape(-1, 576)[:138].T)      # log2 units
    assert 1.5 < float(x.std()) < 2.5
    assert mla.canonical(C(jitter=3.0, peak_at=0.5, ctx_step=9)) == C()


def _toy(target):
    """A one-field space for the shared loop: fitness -|x - target|, fails at x == target."""
    from dataclasses import dataclass, replace

    @dataclass(frozen=True)
    class X:
        x: int = 0

        def to_dict(self):
            return {"x": self.x}

    def judge(c):
        return Verdict(failed=c.x == target, bad_rows=[], fitness=-abs(c.x - target),
                       ref_finite=True, max_err=0.0, seconds=0.0)

    def mutate(c, rng, sigma):
        return replace(c, x=int(np.clip(c.x + round(rng.normal() * sigma * 200), -100, 100)))

    return X, dict(draw=lambda rng: X(int(rng.integers(-100, 101))), mutate=mutate,
                   judge=judge, canonical=lambda c: c)


def test_the_shared_loop_climbs_stops_at_a_failure_and_is_deterministic():
    X, parts = _toy(37)

    def go(seed, max_evals):
        res = mla.MLAAttack(policy="toy", space={}, budget_s=60.0, seed=seed, threshold=None)
        found = climb.run_search(res, budget_s=60.0, seed=seed, max_evals=max_evals,
                                 random_starts=3, lam=4, **parts)
        return res, found

    res, found = go(0, 2000)
    assert found == X(37) and res.best_fitness == 0 and res.evals < 2000
    again, _ = go(0, 2000)
    assert again.history == [dict(h, t=g["t"]) for h, g in zip(res.history, again.history)]
    capped, none = go(1, 5)
    assert none is None and capped.evals == 5
    shrunk, evals = climb.shrink(X(90), (("x", lambda v: [v // 2, v - 1]),),
                                 fails=lambda c: c.x >= 40, canonical=lambda c: c)
    assert shrunk == X(40) and evals > 0


@pytest.mark.slow
def test_the_search_finds_the_mass_loss_from_the_space_alone():
    res = mla.search(budget_s=60, seed=0, max_evals=200)
    assert res.found and res.found_classes == ["silent"]
    s = res.shrunk
    assert mla.judge(s, 0.0).failed and not mla.judge(s, 8.0).failed
    rec = mla.record([(res, res.search_s)], params={"seed": 0}, provenance={"device": "cpu"})
    rec["name"] = "attack_mla_test"
    check_record(rec, "the MLA record")
    ns: dict = {}
    exec(rec["repro"].replace("print(", "ns['out'] = ("), {"ns": ns})
    assert ns["out"] is True


@pytest.mark.slow
def test_the_search_finds_nothing_with_the_lift_in_n_runs():
    res = mla.search(8, budget_s=60, max_evals=12, seed=0)
    assert not res.found and res.evals == 12 and res.best_fitness < 100
    assert res.policy == "mla_decode:p_headroom=8"
    assert "nothing in 12 runs found a failure" in mla.summary(res)


@pytest.mark.parametrize("call, exc, needle", [
    (lambda: mla.search(-1.0), ValueError, "p_headroom"),
    (lambda: mla.search(9.0), ValueError, "p_headroom"),
    (lambda: mla.search(True), TypeError, "p_headroom"),
    (lambda: mla.search(budget_s=-1), ValueError, "budget_s"),
    (lambda: mla.search(classes="stale_nan"), ValueError, "classes"),
    (lambda: mla.judge(FLUSH, classes=[3]), TypeError, "classes"),
    (lambda: mla.record([], params={}), ValueError, "runs"),
])
def test_bad_input_is_refused_naming_the_argument(call, exc, needle):
    with pytest.raises(exc, match=needle):
        call()
