"""The training figure (viz.training.first_nonfinite_steps)."""

import pytest

pytest.importorskip("plotly", reason="the figures need the [lab] extra (plotly)")

from fa_lab.lab import viz  # noqa: E402


def row(policy, scale, step, steps_run=40):
    return {"policy": policy, "scale": scale, "steps_run": steps_run, "first_step": step,
            "module": None if step is None else "blocks.0.attn", "phase": "forward",
            "tensor": "out", "n_rows": 2, "temperature": 50.0}


def test_failed_runs_are_a_curve_and_finite_runs_hollow_at_their_last_step():
    fig = viz.training.first_nonfinite_steps([row("lazy", 16, None), row("lazy", 64, None),
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
        viz.training.first_nonfinite_steps([])


def test_a_table_whose_finite_runs_hold_nan_draws_no_empty_trace():
    """Lesson 09 passes ``table.to_dict("records")``: there a finite run's first step is NaN,
    not None. Such a policy gets no "first non-finite" trace (a legend entry with no points)."""
    import pandas as pd

    rows = pd.DataFrame([row("lazy", 16, None), row("lazy", 64, None),
                         row("lazy_unfixed", 16, 4, 39), row("lazy_unfixed", 64, None)])
    records = rows.to_dict("records")
    assert any(r["first_step"] != r["first_step"] for r in records)     # NaN, as the lesson has
    fig = viz.training.first_nonfinite_steps(records)
    by = {t.name: t for t in fig.data}
    assert set(by) == {"lazy: finite to the last step", "lazy_unfixed: first non-finite",
                       "lazy_unfixed: finite to the last step"}
    assert list(by["lazy: finite to the last step"].x) == [16, 64]
    assert list(by["lazy_unfixed: first non-finite"].y) == [4]
    assert ", 2 rows," in by["lazy_unfixed: first non-finite"].text[0]
    assert all(len(t.x) > 0 for t in fig.data)


def run(policy, scale, tops, first=None):
    return {"config": {"policy": policy, "scale": scale},
            "scores": [[{"s_max": t, "best_min": -t, "spread": 2 * t},
                        {"s_max": float("nan"), "best_min": float("nan"), "spread": 0.0}]
                       for t in tops],
            "first": None if first is None else {"step": first, "module": "blocks.0.attn",
                                                 "phase": "forward", "tensor": "out",
                                                 "kind": "nonfinite", "n_rows": 3}}


def test_score_growth_draws_the_chosen_scale_and_marks_the_first_failure():
    runs = [run("lazy", 64, [1.0, 2.0, 4.0]), run("primus-a6a16cdc", 64, [1.0, 50.0, 130.0], 2),
            run("lazy", 16, [9.0, 9.0, 9.0])]
    fig = viz.training.score_growth(runs, scale=64)
    by = {t.name: t for t in fig.data}
    assert list(by["lazy: largest score"].y) == [1.0, 2.0, 4.0]        # NaN layer left out
    assert fig.layout.yaxis.range == (-384.0, 640.0)
    far = viz.training.score_growth([run("lazy", 64, [1.0, 900.0])], scale=64)
    assert far.data[0].name == "lazy: largest score (peak 900)"
    assert list(by["primus-a6a16cdc: lowest row max"].y) == [-1.0, -50.0, -130.0]
    mark = by["primus-a6a16cdc: first non-finite (step 2)"]
    assert list(mark.x) == [2] and list(mark.y) == [130.0] and "blocks.0.attn" in mark.text[0]
    assert "lazy: first non-finite" not in " ".join(by)
    assert sorted(s.y0 for s in fig.layout.shapes) == [-126.0, 128.0]
    with pytest.raises(ValueError, match="scale=32"):
        viz.training.score_growth(runs, scale=32)
