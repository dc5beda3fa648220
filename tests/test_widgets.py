"""fa_lab.widgets: the dashboards' callbacks as plain functions (numbers against an
independent computation, data that changes when the K scale does, bad values refused),
and the wiring that copies their figures into FigureWidgets."""

from __future__ import annotations

import math

import numpy as np
import plotly.graph_objects as go
import pytest
import torch

import pandas as pd

from fa_lab import experiments, flash_attn_func, metrics, reference, viz, widgets
from fa_lab import trace as fa_trace

S, H = 512, 1  # small: K x64 still makes NaN rows here, K x8 none


@pytest.fixture(scope="module")
def views():
    widgets.clear_cache()
    return {K: widgets.compute_rescale_view(K, 8.0, "lazy_unfixed", False, S, 0, 7, H=H)
            for K in (8, 64)}


def test_rescale_view_changes_with_k_scale(views):
    lo, hi = views[8], views[64]
    st_lo = lo["stats"].set_index("policy")
    st_hi = hi["stats"].set_index("policy")
    assert st_lo.loc["lazy_unfixed", "nan_pct"] == 0
    assert st_hi.loc["lazy_unfixed", "nan_pct"] > 0
    assert math.isnan(st_hi.loc["lazy_unfixed", "rel_l2"])
    assert st_hi.loc["lazy", "nan_pct"] == st_hi.loc["eager", "nan_pct"] == 0
    assert st_hi.loc["lazy", "rel_l2"] > st_lo.loc["lazy", "rel_l2"]
    z_lo = np.array(lo["figures"]["heatmap"].data[1].z, dtype=float)
    z_hi = np.array(hi["figures"]["heatmap"].data[1].z, dtype=float)
    assert z_lo.shape == z_hi.shape == (32, S // 64)
    assert np.nanmax(z_hi) > np.nanmax(z_lo)  # a wider score range, a larger running max
    assert "K x64" in hi["summary"] and "K x8" in lo["summary"]
    # every non-finite row of the output is one mark on the bad-row map
    marks = sum(len(t.x) for t in hi["figures"]["nonfinite"].data[:-1])
    assert marks == int((~torch.isfinite(hi["out"]).all(-1)).sum()) > 0
    assert sum(len(t.x) for t in lo["figures"]["nonfinite"].data[:-1]) == 0


def test_rescale_view_numbers_match_an_independent_run(views):
    v = views[64]
    q, k, vv = experiments.bf16_inputs(1, S, H, 128, 64)
    ref, _ = reference.attention(q, k, vv, causal=False)
    lazy = flash_attn_func(q, k, vv, causal=False, rescale="lazy")
    unfixed = flash_attn_func(q, k, vv, causal=False, rescale="lazy_unfixed")
    st = v["stats"].set_index("policy")
    assert st.loc["lazy", "rel_l2"] == metrics.rel_l2(lazy, ref)
    assert st.loc["lazy_unfixed", "nan_rows"] == int(torch.isnan(unfixed).any(-1).sum())
    assert torch.equal(torch.isnan(v["out"]), torch.isnan(unfixed))


def test_rescale_view_trace_is_the_rows_wave(views):
    v = views[64]
    tr, lane = v["trace"], v["lane"]
    assert list(tr.lanes.row) == list(range(0, 32)) and lane == 7
    # the traced lane ends where the full output does
    finite_row = bool(torch.isfinite(v["out"][0, 7, 0]).all())
    assert bool(tr.lanes.loc[lane, "out_finite"]) == finite_row
    assert v["figures"]["row"].layout.title.text.startswith("row 7 ")
    # the row beside the fix, on the same rows
    assert v["trace_fix"].policy.name == "lazy" and list(v["trace_fix"].lanes.row) == list(range(32))


def test_threshold_and_policy_reach_the_kernel():
    base = dict(k_scale=8, causal=False, S=S, seed=0, row=0, H=H, figures=False)
    a = widgets.compute_rescale_view(threshold=8.0, policy="lazy", **base)
    b = widgets.compute_rescale_view(threshold=0.0, policy="lazy", **base)
    assert a["trace"].policy.threshold == 8.0 and b["trace"].policy.threshold == 0.0
    # threshold 0: every wave fires at every loop tile
    loop = b["trace"].steps[b["trace"].steps.phase == "loop"]
    assert loop.fire.all()
    assert not a["trace"].steps[a["trace"].steps.phase == "loop"].fire.all()
    e = widgets.compute_rescale_view(threshold=8.0, policy="eager", **base)
    assert e["trace"].policy.name == "eager"


@pytest.mark.parametrize("kw, err, words", [
    (dict(k_scale=0), ValueError, "k_scale"),
    (dict(k_scale="32"), TypeError, "k_scale"),
    (dict(threshold=-1.0), ValueError, "threshold"),
    (dict(policy="capped"), ValueError, "policy='capped'"),
    (dict(causal=1), TypeError, "causal"),
    (dict(S=0), ValueError, "S=0"),
    (dict(row=S), ValueError, f"row={S}"),
    (dict(seed=-1), ValueError, "seed=-1"),
    (dict(heat_value="x"), ValueError, "heat_value"),
])
def test_bad_rescale_values_raise_before_work(kw, err, words):
    args = dict(k_scale=32, threshold=8.0, policy="lazy", causal=False, S=S, seed=0, row=0, H=H)
    args.update(kw)
    with pytest.raises(err) as e:
        widgets.compute_rescale_view(**args)
    assert words in str(e.value)


def test_fp8_view_policies_bound_headroom_and_threshold():
    base = dict(threshold=8.0, causal=False, S=S, seed=0, row=0, H=H, figures=False)
    unfixed = widgets.compute_fp8_view(5000.0, policy="lazy_unfixed", **base)
    capped = widgets.compute_fp8_view(5000.0, policy="lazy_capped", rebase_bound=16.0, **base)
    assert unfixed["stats"]["nan"] > 0 and capped["stats"]["nan"] == 0
    assert capped["policy"].rebase_bound == 16.0
    low = widgets.compute_fp8_view(1000.0, policy="lazy_unfixed", **base)
    assert low["stats"]["nan"] < unfixed["stats"]["nan"]
    # the view's mean |o - 1| is the seed's metric, computed here independently
    (q, k, v), (qd, kd, vd) = experiments.fp8_inputs(1, S, H, 5000.0)
    out = flash_attn_func(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, causal=False,
                          rescale="lazy_capped", rebase_bound=16.0)
    dev = (out.double() - 1).abs()
    assert capped["stats"]["mean_abs_dev"] == pytest.approx(float(dev.mean()), rel=1e-12)
    lifted = widgets.compute_fp8_view(5000.0, policy="lazy", headroom=True, **base)
    assert lifted["policy"].p_headroom == pytest.approx(math.log2(448) - 8)
    bykv = widgets.compute_fp8_view(5000.0, policy="lazy",
                                    **dict(base, threshold="by_kv_len"))
    assert bykv["policy"].threshold == 6.0  # Skv <= 4096
    with pytest.raises(ValueError, match="rebase_bound"):
        widgets.compute_fp8_view(5000.0, policy="lazy_capped", rebase_bound=-1.0, **base)
    with pytest.raises(ValueError, match="policy"):
        widgets.compute_fp8_view(5000.0, policy="capped", **base)


def test_compare_view_has_every_output_against_fp32():
    v = widgets.compute_compare_view(48, S=S, H=H)
    assert set(v["outputs"]) == {"lazy_unfixed", "lazy", "eager", "fp8"}
    fig = v["figures"]["difference"]
    colours = {t.legendgroup: t.marker.color for t in fig.data}
    assert colours == {n: viz.policy_color(n) for n in v["outputs"]}
    st = v["stats"].set_index("policy")
    ref = v["reference"]
    assert st.loc["fp8", "rel_l2"] == metrics.rel_l2(v["outputs"]["fp8"], ref)
    # per-tensor e4m3 inputs cost far more accuracy than the bf16 rescale choice
    assert st.loc["fp8", "rel_l2"] > 5 * st.loc["eager", "rel_l2"]


# ---- wiring ------------------------------------------------------------------------------

def test_dashboard_slider_updates_figurewidgets_in_place():
    d = widgets.rescale_dashboard(S=256, H=H, k_scale=32, row=3)
    main = d.figures["row"]
    assert isinstance(main, go.FigureWidget)
    y0 = np.array(main.data[1].y, dtype=float)
    summary0 = d.summary.value
    d.controls["k_scale"].value = 64
    assert d.figures["row"] is main  # the same widget, new data
    y1 = np.array(main.data[1].y, dtype=float)
    assert not np.array_equal(y0, y1, equal_nan=True)
    assert "K x64" in d.summary.value and d.summary.value != summary0
    assert d.last["params"]["k_scale"] == 64 and d.last_seconds > 0
    drawn = d.last["make_figures"](("row",))["row"]    # the same (memoised) figure
    np.testing.assert_array_equal(y1, np.array(drawn.data[1].y, dtype=float))
    assert "figures after" in d.summary.value and "NaN" in d.summary.value
    assert (main.layout.width, main.layout.height) == widgets.FIGURE_SIZES["row"]
    # a figure in a closed tab is drawn when its tab opens, with the latest values
    d.controls["heat_value"].value = "corr"
    heat = d.figures["heatmap"]
    assert "log2(corr)" not in heat.data[1].colorbar.title.text
    d.tabs.selected_index = widgets.LANE_TABS.index(("heatmap", "wave, step by step"))
    assert "log2(corr)" in heat.data[1].colorbar.title.text
    z = np.array(heat.data[1].z, dtype=float)
    np.testing.assert_array_equal(
        z, np.array(viz.running_max_heatmap(d.last["trace"], "corr").data[1].z, dtype=float))
    # a new S moves the row slider's range with it
    d.controls["S"].value = 512
    assert d.controls["row"].max == 511 and d.last["params"]["S"] == 512


def test_wave_step_follows_the_row_until_moved():
    d = widgets.rescale_dashboard(S=512, H=H, k_scale=64, row=0)
    tr, lane = d.last["trace"], d.last["lane"]
    auto = d.controls["tile"].value
    assert auto == d.last["tile"] == widgets._auto_tile(tr, lane)
    assert d.controls["tile"].max == tr.n_steps - 1
    d.controls["tile"].value = 2                  # the user picks a step: it stays
    assert d.last["tile"] == 2 and "step 2" in d.figures["wave"].layout.title.text
    d.controls["row"].value = 40                  # another row: the step follows it again
    assert d.last["tile"] == widgets._auto_tile(d.last["trace"], d.last["lane"])
    assert d.controls["tile"].value == d.last["tile"]


def test_block_trace_is_the_full_trace():
    q, k, v = experiments.bf16_inputs(1, 768, 1, 128, 48)
    for causal in (False, True):
        rows = range(288, 320)
        full = fa_trace(q, k, v, rows=rows, causal=causal, rescale="lazy_unfixed")
        part = widgets.block_trace(q, k, v, rows, causal=causal, rescale="lazy_unfixed")
        pd.testing.assert_frame_equal(full.steps, part.steps)
        pd.testing.assert_frame_equal(full.lanes, part.lanes)
        assert torch.equal(full.out.nan_to_num(7.0), part.out.nan_to_num(7.0))
    (q8, k8, v8), (qd, kd, vd) = experiments.fp8_inputs(1, 768, 1, 5000.0)
    kw = dict(q_descale=qd, k_descale=kd, v_descale=vd, causal=False, rescale="lazy_unfixed")
    full = fa_trace(q8, k8, v8, rows=range(512, 544), **kw)
    part = widgets.block_trace(q8, k8, v8, range(512, 544), **kw)
    pd.testing.assert_frame_equal(full.steps, part.steps)


def test_dashboards_fit_one_screen():
    # the control column and the figures side by side within 1600 px with JupyterLab's file
    # browser open (about 1200 px for a cell's output); the main figure, the tab bar and a
    # tab's figure within 1000 px minus JupyterLab's bars
    assert widgets.LEFT_WIDTH + widgets.FIGURE_WIDTH + 20 <= 1200
    assert widgets.MAIN_HEIGHT + 40 + widgets.TAB_HEIGHT <= 860
    d = widgets.fp8_dashboard(S=256, H=1)
    assert set(d.figures) == set(widgets.LANE_FIGURES)
    for name, fig in d.figures.items():
        assert (fig.layout.width, fig.layout.height) == widgets.FIGURE_SIZES[name]
        assert fig.layout.width <= widgets.FIGURE_WIDTH


def test_dashboard_shows_errors_instead_of_raising():
    d = widgets.compare_dashboard(S=256, H=1, k_scale=8)
    d.fixed["threshold"] = -2.0  # no control can make this, the error path still must hold
    seconds = d.update()
    assert math.isnan(seconds) and d.errors == 1
    assert "threshold" in d.summary.value and "fa-lab-error" in d.summary.value


def test_fp8_dashboard_disables_what_does_not_apply():
    d = widgets.fp8_dashboard(S=256, H=1, policy="lazy_unfixed")
    assert d.controls["rebase_bound"].disabled and not d.controls["threshold"].disabled
    d.controls["policy"].value = "eager"
    assert d.controls["threshold"].disabled
    d.controls["policy"].value = "lazy_capped"
    assert not d.controls["rebase_bound"].disabled
    assert d.last["policy"].name == "lazy_capped"


def test_assign_figure_clears_stale_shapes_and_replaces_other_traces():
    w = go.FigureWidget(go.Figure(go.Scatter(y=[1, 2]), layout=dict(
        shapes=[dict(type="line", x0=0, x1=1, y0=0, y1=1)], title="old")))
    widgets.assign_figure(w, go.Figure(go.Scatter(y=[3, 4, 5]), layout=dict(title="new")))
    assert list(w.data[0].y) == [3, 4, 5] and w.layout.shapes == () and w.layout.title.text == "new"
    widgets.assign_figure(w, go.Figure([go.Heatmap(z=[[1]]), go.Scatter(y=[1])]))
    assert [t.type for t in w.data] == ["heatmap", "scatter"]


def test_benchmark_reports_each_move():
    d = widgets.rescale_dashboard(S=256, H=1, k_scale=16, row=0)
    r = widgets.benchmark(d, "k_scale", [17, 18])
    assert len(r["times_s"]) == 2 and r["min_s"] <= r["median_s"] <= r["max_s"]
    assert d.last["params"]["k_scale"] == 18
    with pytest.raises(ValueError, match="control='K'"):
        widgets.benchmark(d, "K", [1])


def test_figures_first_runs_only_what_the_figures_need():
    widgets.clear_cache()
    v = widgets.compute_rescale_view(40, S=256, H=1, row=5, figures=("row", "wave"),
                                     all_policies=False)
    assert v["partial"] and v["reference"] is None and v["outputs"] == {} and v["out"] is None
    assert set(v["figures"]) == {"row", "wave"} and "computing" in v["summary"]
    full = widgets.compute_rescale_view(40, S=256, H=1, row=5, figures=("row",))
    assert not full["partial"] and set(full["outputs"]) == set(widgets.BF16_POLICIES)
    assert full["figures"]["row"] is v["figures"]["row"]    # the same traces, the same figure
    with_map = widgets.compute_rescale_view(40, S=256, H=1, row=5, figures=("nonfinite",),
                                            all_policies=False)
    assert set(with_map["outputs"]) == {"lazy_unfixed"} and with_map["out"] is not None
