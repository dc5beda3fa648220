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
