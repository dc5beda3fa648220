"""The training figure (viz.first_nonfinite_steps) and the lessons' answer switch
(fa_lab.lab.solutions)."""

import math

import pytest
import torch

from fa_lab.lab import solutions, viz


def row(policy, scale, step, steps_run=40):
    return {"policy": policy, "scale": scale, "steps_run": steps_run, "first_step": step,
            "module": None if step is None else "blocks.0.attn", "phase": "forward",
            "tensor": "out", "n_rows": 2, "temperature": 50.0}


def test_failed_runs_are_a_curve_and_finite_runs_hollow_at_their_last_step():
    fig = viz.first_nonfinite_steps([row("lazy", 16, None), row("lazy", 64, None),
                                     row("lazy_unfixed", 64, 38, 39), row("lazy_unfixed", 16, None)])
    by = {t.name: t for t in fig.data}
    assert set(by) == {"lazy: finite to the last step", "lazy_unfixed: first non-finite",
                       "lazy_unfixed: finite to the last step"}
    assert list(by["lazy: finite to the last step"].x) == [16, 64]
    assert list(by["lazy: finite to the last step"].y) == [39, 39]
    assert list(by["lazy_unfixed: first non-finite"].y) == [38]
    assert "blocks.0.attn forward out" in by["lazy_unfixed: first non-finite"].text[0]
    assert fig.layout.xaxis.type == "log"
    with pytest.raises(ValueError, match="rows is empty"):
        viz.first_nonfinite_steps([])


def test_pick_returns_the_learners_answer_unless_solutions_are_on(monkeypatch):
    mine = object()
    monkeypatch.delenv("FA_LAB_SOLUTIONS", raising=False)
    assert solutions.pick("09.lse_floor", mine) is mine
    monkeypatch.setenv("FA_LAB_SOLUTIONS", "1")
    assert solutions.pick("09.lse_floor", mine) is solutions.lse_floor
    with pytest.raises(ValueError, match="no answer named"):
        solutions.pick("nope", mine)


def test_the_lse_floor_answer_converts_then_floors_with_maxnum():
    lse = torch.tensor([1.0, -math.inf, math.nan, math.inf])
    got = solutions.lse_floor(lse)
    assert got.dtype == torch.float32
    assert got[0] == torch.tensor(math.log2(math.e))
    assert got[1] == got[2] == torch.tensor(-3e38) and torch.isposinf(got[3])
