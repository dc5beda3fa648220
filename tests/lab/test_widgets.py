"""fa_lab.lab.widgets: the dashboards' callbacks as plain functions (numbers against an
independent computation, data that changes when the K scale does, bad values refused),
and the wiring that copies their figures into FigureWidgets."""

from __future__ import annotations

import math

import numpy as np
import pytest

# The figures need plotly, which a GPU machine may lack; there these tests have nothing to test.
pytest.importorskip("plotly", reason="the lab's figures need plotly (pip install plotly)")

import plotly.graph_objects as go
import torch

import pandas as pd

from fa_lab import Policy, flash_attn_func, metrics, policies, reference
from fa_lab.studies import experiments
from fa_lab.lab import viz, widgets
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
    assert colours == {n: viz.style.policy_color(n) for n in v["outputs"]}
    st = v["stats"].set_index("policy")
    ref = v["reference"]
    assert st.loc["fp8", "rel_l2"] == metrics.rel_l2(v["outputs"]["fp8"], ref)
    # per-tensor e4m3 inputs cost far more accuracy than the bf16 rescale choice
    assert st.loc["fp8", "rel_l2"] > 5 * st.loc["eager", "rel_l2"]


# ---- a selected policy at its own settings; a moved setting is a variant ----------------------

@pytest.fixture
def cap24():
    """A registered user policy whose settings are all unlike the built-ins' (8, 16, 0)."""
    pol = policies.register(Policy("wave", "capped", threshold=6.0, rebase_bound=24.0,
                                   name="cap24"))
    widgets.clear_cache()
    try:
        yield pol
    finally:
        policies.unregister("cap24")
        widgets.clear_cache()


def _same(a, b) -> bool:
    return torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


def _notes(fig) -> list:
    return [a.text for a in fig.layout.annotations]


def test_variant_names_only_the_settings_that_differ(cap24):
    assert widgets.variant("cap24") is cap24
    assert widgets.variant("cap24", threshold=6, rebase_bound=24.0, p_headroom=False) is cap24
    v = widgets.variant("cap24", threshold=7.0, rebase_bound=20, p_headroom=True)
    assert v.name == "cap24 (thr 7; bound 20; headroom #1020)"
    assert (v.threshold, v.rebase_bound, v.p_headroom, v.color) == (7.0, 20.0, True, cap24.color)
    assert viz.style.policy_color(v) == cap24.color                  # a variant keeps its colour
    # a setting that does not apply to the policy leaves it as it is
    assert widgets.variant("eager", threshold=3.0, rebase_bound=9.0) is policies.get("eager")
    assert widgets.variant("lazy", threshold="by_kv_len").name == "lazy (thr by_kv_len)"


def test_bf16_view_runs_a_selected_policy_at_its_own_settings(cap24):
    base = dict(k_scale=64, causal=False, S=S, seed=0, row=0, H=H, figures=("row",))
    q, k, v = experiments.bf16_inputs(1, S, H, 128, 64)
    at_own = flash_attn_func(q, k, v, causal=False, rescale=cap24)
    at_8 = flash_attn_func(q, k, v, causal=False, rescale="cap24", rescale_threshold=8.0)
    assert not _same(at_own, at_8)          # the threshold matters for these inputs
    own = widgets.compute_rescale_view(policy="cap24", **base)
    assert own["label"] == "cap24" and _same(own["out"], at_own)
    assert (own["trace"].policy.threshold, own["trace"].policy.rebase_bound) == (6.0, 24.0)
    # the policies beside it run at its threshold: each a variant of its own
    assert own["trace_fix"].policy.name == "lazy (thr 6)"
    assert list(own["stats"].policy) == ["lazy_unfixed (thr 6)", "lazy (thr 6)", "eager", "cap24"]
    lazy6 = flash_attn_func(q, k, v, causal=False, rescale="lazy", rescale_threshold=6.0)
    assert _same(own["outputs"]["lazy (thr 6)"], lazy6)
    assert f"color:{policies.color('lazy')}'>&#9632; lazy (thr 6)" in own["summary"]
    # moved away from its own: a variant in the table, the summary and the figure
    moved = widgets.compute_rescale_view(policy="cap24", threshold=8.0, **base)
    assert moved["label"] == "cap24 (thr 8)" and _same(moved["out"], at_8)
    assert list(moved["stats"].policy) == ["lazy_unfixed", "lazy", "eager", "cap24 (thr 8)"]
    assert "<b>cap24 (thr 8)</b> stays finite" in moved["summary"]
    notes = _notes(moved["figures"]["row"])
    assert notes[0].startswith("<b>cap24 (thr 8)</b>") and notes[1].startswith("<b>lazy</b>")
    assert not any(n.startswith("<b>cap24</b>") for n in notes)
    assert moved["figures"]["row"].layout.annotations[0].font.color == cap24.color
    # moved back: the plain name again
    back = widgets.compute_rescale_view(policy="cap24", threshold=6.0, **base)
    assert back["label"] == "cap24" and _notes(back["figures"]["row"])[0].startswith("<b>cap24</b>")
    with pytest.raises(ValueError, match="by_kv_len"):
        policies.register(Policy("wave", "max", threshold="by_kv_len", name="bykv"))
        try:
            widgets.compute_rescale_view(policy="bykv", **base)
        finally:
            policies.unregister("bykv")


def test_fp8_view_runs_a_selected_policy_at_its_own_settings(cap24):
    base = dict(causal=False, S=512, seed=0, row=0, H=H, figures=("row",))
    (q8, k8, v8), (qd, kd, vd) = experiments.fp8_inputs(1, 512, H, 5000.0)
    kw = dict(q_descale=qd, k_descale=kd, v_descale=vd, causal=False, rows=range(32))
    votes_own = fa_trace(q8, k8, v8, rescale=cap24, **kw).matrix("vote")
    votes_old = fa_trace(q8, k8, v8, rescale="cap24", rescale_threshold=8.0, rebase_bound=16.0,
                         **kw).matrix("vote")
    assert not votes_own.equals(votes_old)   # what the dashboard ran before: not cap24's own
    own = widgets.compute_fp8_view(5000.0, policy="cap24", **base)
    assert own["label"] == "cap24" and own["policy"].name == "cap24"
    assert (own["policy"].threshold, own["policy"].rebase_bound, own["policy"].p_headroom) == \
        (6.0, 24.0, 0.0)
    assert own["trace"].matrix("vote").equals(votes_own)
    assert own["trace_fix"].policy.name == "lazy (thr 6)"
    assert "<b>cap24</b> (threshold 6 log2 units, rebase bound 24)" in own["summary"]
    moved = widgets.compute_fp8_view(5000.0, policy="cap24", threshold=8.0, rebase_bound=16.0,
                                     **base)
    assert moved["label"] == "cap24 (thr 8; bound 16)"
    assert moved["trace"].matrix("vote").equals(votes_old)
    assert moved["trace_fix"].policy.name == "lazy"
    assert "<b>cap24 (thr 8; bound 16)</b>" in moved["summary"]
    assert _notes(moved["figures"]["row"])[0].startswith("<b>cap24 (thr 8; bound 16)</b>")
    lifted = widgets.compute_fp8_view(5000.0, policy="cap24", headroom=True, **base)
    assert lifted["label"] == "cap24 (headroom #1020)"
    assert lifted["policy"].p_headroom == pytest.approx(math.log2(448) - 6)
    assert lifted["trace_fix"].policy.name == "lazy (thr 6; headroom #1020)"
    back = widgets.compute_fp8_view(5000.0, policy="cap24", threshold=6.0, rebase_bound=24.0,
                                    headroom=False, **base)
    assert back["label"] == "cap24"
    with pytest.raises(ValueError, match="headroom"):
        widgets.compute_fp8_view(5000.0, policy="cap24", headroom=-1.0, **base)


def test_compare_view_names_the_fp8_policy_as_run(cap24):
    v = widgets.compute_compare_view(32, S=256, H=H, fp8_policy="cap24", figures=False)
    assert v["fp8_label"] == "cap24" and "under cap24;" in v["summary"]
    assert list(v["stats"].policy) == ["lazy_unfixed (thr 6)", "lazy (thr 6)", "eager", "cap24",
                                       "fp8"]
    moved = widgets.compute_compare_view(32, 8.0, S=256, H=H, fp8_policy="cap24", figures=False)
    assert moved["fp8_label"] == "cap24 (thr 8)" and "under cap24 (thr 8);" in moved["summary"]
    assert list(moved["stats"].policy) == ["lazy_unfixed", "lazy", "eager", "cap24 (thr 8)", "fp8"]


@pytest.mark.slow
def test_choosing_a_policy_moves_the_controls_to_its_own_settings(cap24):
    d = widgets.fp8_dashboard(S=256, H=1, policy="lazy_unfixed", row=0)
    c = d.controls
    assert (c["threshold"].value, c["headroom"].value) == (8.0, "none")
    c["policy"].value = "cap24"
    assert (c["threshold"].value, c["rebase_bound"].value) == (6.0, 24.0)
    assert d.redraws == 1 and d.last["label"] == "cap24"      # one redraw for the move
    assert (d.last["policy"].threshold, d.last["policy"].rebase_bound) == (6.0, 24.0)
    c["threshold"].value = 8.0
    assert d.last["label"] == "cap24 (thr 8)" and "<b>cap24 (thr 8)</b>" in d.summary.value
    assert _notes(d.figures["row"])[0].startswith("<b>cap24 (thr 8)</b>")
    c["headroom"].value = "PR #1020"
    assert d.last["label"] == "cap24 (thr 8; headroom #1020)"
    assert d.last["policy"].p_headroom == pytest.approx(math.log2(448) - 8)
    c["headroom"].value, c["threshold"].value = "none", 6.0
    assert d.last["label"] == "cap24" and _notes(d.figures["row"])[0].startswith("<b>cap24</b>")
    c["policy"].value = "lazy"
    assert c["threshold"].value == 8.0 and d.last["label"] == "lazy"
    # a policy's own numeric headroom and an unlisted threshold join the choices
    policies.register(Policy("wave", "max", threshold=5.0, p_headroom=1.0, name="lift1"))
    try:
        f = widgets.fp8_dashboard(S=256, H=1, policy="lift1", row=0)
        assert (f.controls["threshold"].value, f.controls["headroom"].value) == (5.0, 1.0)
        assert f.last["label"] == "lift1" and f.last["policy"].p_headroom == 1.0
    finally:
        policies.unregister("lift1")
    b = widgets.rescale_dashboard(S=256, H=1, policy="lazy", row=0)
    assert b.controls["threshold"].value == 8.0
    assert b.controls["threshold"].max == 128.0          # reaches 64-96, where it matters
    b.controls["policy"].value = "cap24"
    assert b.controls["threshold"].value == 6.0 and b.last["label"] == "cap24"
    b.controls["threshold"].value = 7.0
    assert b.last["label"] == "cap24 (thr 7)" and "cap24 (thr 7)" in b.summary.value
    b.controls["policy"].value = "eager"                  # no threshold of its own: stays
    assert b.controls["threshold"].value == 7.0 and b.last["trace_fix"].policy.name == "lazy (thr 7)"
    assert widgets.rescale_dashboard(S=256, H=1, policy="cap24", row=0).controls[
        "threshold"].value == 6.0


def test_a_rule_that_raises_shows_in_the_summary():
    def boom(m, mt, thr):
        raise ArithmeticError("boom")

    policies.register(Policy.from_rule(boom, name="boom"))
    try:
        d = widgets.fp8_dashboard(S=256, H=1, policy="lazy", row=0)
        d.controls["policy"].value = "boom"
        assert d.errors == 1 and "fa-lab-error" in d.summary.value
        assert "policy &#x27;boom&#x27;: its rule raised ArithmeticError" in d.summary.value
    finally:
        policies.unregister("boom")


def test_first_bad_row_is_none_when_every_row_is_finite():
    assert widgets.first_bad_row(8, S=S, H=H) is None
    q, k, v = experiments.bf16_inputs(1, S, H, 128, 64)
    out = flash_attn_func(q, k, v, causal=False, rescale="lazy_unfixed")
    bad = [r for r in range(S) if not bool(torch.isfinite(out[0, r, 0]).all())]
    assert bad and widgets.first_bad_row(64, S=S, H=H) == bad[0]
    # row 0 bad and no row bad are told apart
    x = torch.zeros(1, 4, 1, 2)
    assert widgets.dashboards._first_nonfinite_row(x) is None
    x[0, 0, 0, 1] = math.nan
    assert widgets.dashboards._first_nonfinite_row(x) == 0


# ---- wiring ------------------------------------------------------------------------------

def _plain(d, name) -> dict:
    """The plain figure (plotly's JSON) that dashboard ``d`` shows as ``name`` before it
    goes live."""
    (out,) = d.slots[name].children
    (shown,) = out.outputs
    return shown["data"]["application/vnd.plotly.v1+json"]


def test_dashboard_slider_updates_figurewidgets_in_place():
    d = widgets.rescale_dashboard(S=256, H=H, k_scale=32, row=3)
    assert not d.live and d.figures == {}      # plain figures until something moves
    shown = _plain(d, "row")
    assert (shown["layout"]["width"], shown["layout"]["height"]) == widgets.FIGURE_SIZES["row"]
    y0 = np.array(d.last["make_figures"](("row",))["row"].data[1].y, dtype=float)
    assert shown["layout"]["title"] == d.last["make_figures"](("row",))["row"].layout.title.to_plotly_json()
    summary0 = d.summary.value
    d.controls["k_scale"].value = 64
    main = d.figures["row"]                    # the first move made the FigureWidgets
    assert isinstance(main, go.FigureWidget) and d.slots["row"].children == (main,)
    y1 = np.array(main.data[1].y, dtype=float)
    assert not np.array_equal(y0, y1, equal_nan=True)
    assert "K x64" in d.summary.value and d.summary.value != summary0
    assert d.last["params"]["k_scale"] == 64 and d.last_seconds > 0
    drawn = d.last["make_figures"](("row",))["row"]    # the same (memoised) figure
    np.testing.assert_array_equal(y1, np.array(drawn.data[1].y, dtype=float))
    assert "main figure sent after" in d.summary.value and "NaN" in d.summary.value
    assert (main.layout.width, main.layout.height) == widgets.FIGURE_SIZES["row"]
    # a figure in a closed tab is drawn when its tab opens, with the latest values
    d.controls["heat_value"].value = "corr"
    assert d.figures["row"] is main            # the same widget, new data
    heat = d.figures["heatmap"]
    assert "log2(corr)" not in heat.data[1].colorbar.title.text
    d.tabs.selected_index = widgets.LANE_TABS.index(("heatmap", "wave, step by step"))
    assert "log2(corr)" in heat.data[1].colorbar.title.text
    z = np.array(heat.data[1].z, dtype=float)
    np.testing.assert_array_equal(
        z, np.array(viz.heatmap.running_max_heatmap(d.last["trace"], "corr").data[1].z, dtype=float))
    # a new S moves the row slider's range with it
    d.controls["S"].value = 512
    assert d.controls["row"].max == 511 and d.last["params"]["S"] == 512


def _saved_bytes(widget) -> int:
    """The size of the widget state a notebook saves for ``widget`` and every widget it
    holds, as JSON."""
    import json

    from ipywidgets.embed import dependency_state

    return len(json.dumps(dependency_state(widget, drop_defaults=False)))


def test_a_dashboard_saved_before_any_move_is_small(monkeypatch):
    """A FigureWidget's saved state holds plotly's widget code (about 5 MB) once per figure:
    a lesson saved with four of them was 21 MB. Until the first move a dashboard holds plain
    figures; the first move (or FA_LAB_LIVE_FIGURES=1, as the docs build runs) makes them
    widgets, each with its own copy."""
    monkeypatch.delenv(widgets.LIVE_FIGURES_ENV, raising=False)
    d = widgets.rescale_dashboard(S=256, H=H, k_scale=32, row=3)
    plain = _saved_bytes(d.widget)
    assert plain < 1_000_000 and not d.live
    d.controls["k_scale"].value = 33           # the learner moves a control
    assert d.live and _saved_bytes(d.widget) > plain + 4 * 4_000_000
    monkeypatch.setenv(widgets.LIVE_FIGURES_ENV, "1")
    c = widgets.compare_dashboard(S=256, H=1, k_scale=8)
    assert c.live and set(c.figures) == {"difference"}
    assert c.slots["difference"].children == (c.figures["difference"],)


def test_wave_step_follows_the_row_until_moved():
    d = widgets.rescale_dashboard(S=512, H=H, k_scale=64, row=0)
    tr, lane = d.last["trace"], d.last["lane"]
    auto = d.controls["tile"].value
    assert auto == d.last["tile"] == widgets.views._auto_tile(tr, lane)
    assert d.controls["tile"].max == tr.n_steps - 1
    d.controls["tile"].value = 2                  # the user picks a step: it stays
    assert d.last["tile"] == 2 and "step 2" in d.figures["wave"].layout.title.text
    d.controls["row"].value = 40                  # another row: the step follows it again
    assert d.last["tile"] == widgets.views._auto_tile(d.last["trace"], d.last["lane"])
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
    assert set(d.slots) == set(widgets.LANE_FIGURES)
    for name in d.slots:                       # the plain figures, and then the widgets
        layout = _plain(d, name)["layout"]
        assert (layout["width"], layout["height"]) == widgets.FIGURE_SIZES[name]
    d.make_live()
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


# ---- what a redraw sends, and in which order ------------------------------------------------

def _sent(widget) -> list:
    """The update messages ``widget`` sends to the browser, as they are sent."""
    msgs = []
    widget.observe(lambda ch: ch["new"] is not None and msgs.append(ch["new"]),
                   names="_py2js_update")
    return msgs


def test_assign_figure_sends_only_what_changed():
    base = dict(mode="lines", line=dict(color="#123456", width=2), text=["a", "b"])
    old = go.Figure([go.Scatter(y=np.array([1.0, 2.0]), **base),
                     go.Scatter(y=np.array([5.0, 6.0]), **base)],
                    layout=dict(title="old", yaxis=dict(range=[0, 7]), xaxis=dict(range=[0, 1])))
    w = widgets.DashboardFigure(old)
    w.layout.width = 500
    msgs = _sent(w)
    new = go.Figure([go.Scatter(y=np.array([1.0, 2.0]), **base),
                     go.Scatter(y=np.array([5.0, 9.0]), **base)],
                    layout=dict(title="new", yaxis=dict(range=[0, 10]), xaxis=dict(range=[0, 1]),
                                width=800))
    traces, layout = widgets.figure_changes(w, new)
    assert list(traces) == [1] and list(traces[1]) == ["y"]
    np.testing.assert_array_equal(traces[1]["y"], [5.0, 9.0])
    assert layout == {"title": {"text": "new"}, "yaxis": {"range": [0, 10]}}
    widgets.assign_figure(w, new)
    (msg,) = msgs                                  # one message for the whole figure
    assert msg["style_traces"] == [1] and set(msg["style_data"]) == {"y"}
    assert set(msg["layout_data"]) == {"title", "yaxis"}    # not the widget's own width
    np.testing.assert_array_equal(w.data[1].y, [5.0, 9.0])
    assert w.layout.title.text == "new" and w.layout.width == 500
    widgets.assign_figure(w, new)                  # nothing changed: nothing sent
    assert len(msgs) == 1
    # a property the new figure lacks goes; one the reader set from the legend stays
    w.data[0].visible = "legendonly"
    widgets.assign_figure(w, go.Figure([go.Scatter(y=np.array([1.0, 2.0]), mode="lines"),
                                        go.Scatter(y=np.array([5.0, 9.0]), **base)],
                                       layout=new.layout))
    assert w.data[0].text is None and w.data[0].line.color is None
    assert w.data[0].visible == "legendonly"


def test_a_slider_move_sends_only_the_changed_traces_main_figure_first():
    d = widgets.rescale_dashboard(S=512, H=H, k_scale=40, row=3)
    d.make_live()
    row, wave = d.figures["row"], d.figures["wave"]
    order = []
    for name, w in (("row", row), ("wave", wave)):
        w.observe(lambda ch, name=name: ch["new"] is not None and order.append(name),
                  names="_py2js_update")
    full_runs = []
    compute = d.compute

    def spy(**kw):
        if kw.get("all_policies", True):
            full_runs.append(list(order))          # the figures sent before the numbers
        return compute(**kw)

    d.compute = spy
    msgs = _sent(row)
    old = [t.to_plotly_json() for t in d.last["make_figures"](("row",))["row"].data]
    d.controls["k_scale"].value = 41
    assert order == ["row", "wave"] and full_runs == [["row", "wave"]]
    (msg,) = msgs
    new = [t.to_plotly_json() for t in d.last["make_figures"](("row",))["row"].data]
    # exactly the traces whose data differ are sent, and of them only what differs: a K
    # move changes data, never a trace's name, colours or hover template
    changed = [i for i, (a, b) in enumerate(zip(old, new)) if not widgets.transport._same(a, b)]
    assert msg["style_traces"] == changed and 0 < len(changed) < len(new)
    assert set(msg["style_data"]) <= {"x", "y", "text"}
    shown = [{k: v for k, v in t.to_plotly_json().items() if k != "uid"} for t in row.data]
    assert all(widgets.transport._same(a, b) for a, b in zip(shown, new))


def test_dashboard_figure_takes_the_browsers_report_and_says_drawn():
    """The browser reports after every redraw; a property reported element by element
    (a typed array) must not raise (plotly's own handler does, on a numpy array), and the
    report of the latest update runs what waits for it."""
    w = widgets.DashboardFigure(go.Figure(go.Scatter(x=np.arange(3.0), y=np.arange(3.0))))
    called = []
    w.when_drawn(lambda: called.append("now"))     # nothing on its way: at once
    assert called == ["now"]
    widgets.assign_figure(w, go.Figure(go.Scatter(x=np.arange(4.0), y=np.arange(4.0))))
    w.when_drawn(lambda: called.append("drawn"))
    assert called == ["now"]
    w._js2py_traceDeltas = {"trace_deltas": [{"x": {"0": 0, "1": 1}}],
                            "trace_edit_id": w._last_trace_edit_id - 1}   # an older update
    assert called == ["now"]
    w._js2py_traceDeltas = {"trace_deltas": [{"x": {"0": 0, "1": 1}, "uid": w.data[0].uid}],
                            "trace_edit_id": w._last_trace_edit_id}
    assert called == ["now", "drawn"] and not w._trace_edit_in_process
    np.testing.assert_array_equal(w.data[0].x, np.arange(4.0))    # the figure as sent


def _browser_move(d, control, value):
    """A move as ipywidgets applies one from the browser: under the property lock."""
    w = d.controls[control]
    with w._lock_property(value=value), w.hold_trait_notifications():
        w.value = value


@pytest.mark.slow
def test_a_move_from_the_browser_waits_for_the_main_figure_drawn():
    import asyncio

    d = widgets.rescale_dashboard(S=512, H=H, k_scale=40, row=3)
    d.make_live()
    row = d.figures["row"]

    async def run():
        _browser_move(d, "k_scale", 41)
        assert d.last["partial"] and "computing" in d.summary.value     # the main figure only
        assert d.last["params"]["k_scale"] == 41 and row._trace_edit_in_process
        _browser_move(d, "k_scale", 42)            # a newer move before the browser drew
        await asyncio.sleep(0)
        assert d.last["partial"] and d.redraws == 0
        # the browser reports the main figure drawn: the rest of the newest move follows
        row._js2py_traceDeltas = {"trace_deltas": [], "trace_edit_id": row._last_trace_edit_id}
        assert not d.last["partial"] and d.last["params"]["k_scale"] == 42
        # one redraw finished: move 41's rest never ran
        assert d.redraws == 1 and "K x42" in d.summary.value and "rel-L2" in d.summary.value
        # no report at all (no browser showing it): the rest follows after DRAWN_WAIT_S
        _browser_move(d, "k_scale", 43)
        assert d.last["partial"]
        await asyncio.sleep(widgets.DRAWN_WAIT_S + 0.2)
        assert not d.last["partial"] and d.last["params"]["k_scale"] == 43 and d.redraws == 2
        assert "redraw 2: main figure sent after" in d.summary.value

    asyncio.run(run())
    # a move set from Python (no running loop, no lock) redraws everything before returning
    d.controls["k_scale"].value = 44
    assert not d.last["partial"] and d.redraws == 3


def test_the_collector_waits_while_the_main_figure_is_built():
    import gc

    d = widgets.rescale_dashboard(S=256, H=H, k_scale=20, row=0)
    seen = []
    compute = d.compute

    def spy(**kw):
        seen.append((kw.get("all_policies", True), gc.isenabled()))
        return compute(**kw)

    d.compute = spy
    assert gc.isenabled()
    d.controls["k_scale"].value = 21
    assert seen == [(False, False), (True, True)] and gc.isenabled()


def test_fp8_view_draws_its_figures_before_the_whole_output():
    widgets.clear_cache()
    base = dict(threshold=8.0, S=256, seed=0, row=5, H=H)
    part = widgets.compute_fp8_view(5000.0, figures=("row",), all_policies=False, **base)
    assert part["partial"] and part["stats"] is None and part["out"] is None
    assert "computing" in part["summary"] and set(part["figures"]) == {"row"}
    bad_rows = part["make_figures"](("nonfinite",))["nonfinite"]     # runs the output now
    assert part["out"] is not None
    full = widgets.compute_fp8_view(5000.0, figures=("row", "nonfinite"), **base)
    assert not full["partial"] and full["stats"]["nan"] == int(torch.isnan(full["out"]).sum())
    assert full["figures"]["row"] is part["figures"]["row"]           # the same traces
    assert full["figures"]["nonfinite"] is bad_rows
    # and the rescale view's map, asked for later, runs the policy's output then
    v = widgets.compute_rescale_view(40, S=256, H=1, row=5, figures=("row",), all_policies=False)
    assert v["out"] is None
    v["make_figures"](("nonfinite",))
    assert torch.equal(torch.isnan(v["out"]), torch.isnan(
        flash_attn_func(*experiments.bf16_inputs(1, 256, 1, 128, 40), causal=False,
                        rescale="lazy_unfixed")))


# ---- a swept row, named by what its policy did to it -----------------------------------

HARM, HARMLESS = "dragged (base moved down)", "swept: left alone"


def _base_moves(tr, lane):
    """The lane's swept steps whose base moved down, and those whose base stayed, read off
    the base m itself (not the correction the names are drawn from)."""
    d = tr.lane(lane)
    before = d.m.shift()
    return d.step[d.swept & (d.m < before)].tolist(), d.step[d.swept & (d.m == before)].tolist()


@pytest.mark.parametrize("policy", ["lazy_unfixed", "lazy"])
def test_dashboard_names_a_swept_row_by_what_its_policy_did(views, policy):
    """The unfixed rule's sweep moves the base down: the dashboard calls it dragged in the
    legend, the hover text and the summary. The fix's sweep leaves the row alone, and the
    dashboard says so, never "dragged"."""
    v = views[64] if policy == "lazy_unfixed" else widgets.compute_rescale_view(
        64, 8.0, "lazy", False, S, 0, 7, H=H)
    down, kept = _base_moves(v["trace"], v["lane"])
    name, other, steps = (HARM, HARMLESS, down) if policy == "lazy_unfixed" else (HARMLESS, HARM, kept)
    assert steps and not (kept if policy == "lazy_unfixed" else down)
    # the row's own column (x): the sweep's marker trace, its legend entry and hover
    col = {t.name: t for t in v["figures"]["row"].data if t.xaxis == "x" and t.mode == "markers"}
    assert list(col[name].x) == steps and col[name].showlegend
    assert name in col[name].hovertemplate
    assert len(col[other].x) == 0 and not col[other].showlegend
    # the fix's column beside it names its own sweeps the other way
    fix = {t.name: t for t in v["figures"]["row"].data if t.xaxis == "x2" and t.mode == "markers"}
    assert len(fix[other].x) > 0 and len(fix[name].x) == 0
    # the summary's sentence on the row
    assert f"{name} {len(steps)} times" in v["summary"] and other not in v["summary"]
    # the wave tab's legend and title, at a step where the row was swept
    wave = v["make_figures"](("wave",))["wave"] if v["tile"] in steps else widgets.compute_rescale_view(
        64, 8.0, policy, False, S, 0, 7, H=H, tile=steps[0], figures=("wave",))["figures"]["wave"]
    legend = [t.name for t in wave.data if t.name and t.showlegend is not False]
    assert any(n.startswith(f"{name}: ") for n in legend)
    assert not any(n.startswith(other) for n in legend) and other not in wave.layout.title.text
    assert any(name in (t.hovertemplate or "") for t in wave.data)
    # the heatmap of the swept flag
    heat = widgets.compute_rescale_view(64, 8.0, policy, False, S, 0, 7, H=H, heat_value="swept",
                                        figures=("heatmap",))["figures"]["heatmap"]
    assert heat.data[1].colorbar.ticktext == ("not swept", name)
    assert dict(widgets.HEAT_VALUES)["swept: dragged or left alone"] == "swept"
    # unfixed or fixed, the row figure has the same traces: a policy move redraws in place
    assert [t.type for t in v["figures"]["row"].data] == [t.type for t in views[64]["figures"]["row"].data]


def test_fp8_dashboard_names_the_caps_drags_and_skips_apart():
    """Under the bug report's cap a sweep is a drag where the drop fits the bound and left
    alone where it does not: the fp8 dashboard names each as it was."""
    v = widgets.compute_fp8_view(5000.0, threshold=8.0, policy="lazy_capped", rebase_bound=16.0,
                                 S=S, row=5, H=H, figures=("row",), all_policies=False)
    tr, lane = v["trace"], v["lane"]
    down, kept = _base_moves(tr, lane)
    assert len(down) == len(kept) == 1             # row 5: one drop within 16, one past it
    col = {t.name: t for t in v["figures"]["row"].data if t.xaxis == "x" and t.mode == "markers"}
    assert list(col[HARM].x) == down and list(col[HARMLESS].x) == kept
    assert f"{HARM} 1 time, {HARMLESS} 1 time." in v["summary"]
