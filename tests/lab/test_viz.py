"""fa_lab.lab.viz: what goes in comes out in the figure, colours per policy stay put, values
that cannot be plotted are marked, bad input is refused, and every figure can travel to
a FigureWidget (strict JSON, no NaN)."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

# The figures need plotly, which a GPU machine may lack; there these tests have nothing to test.
pytest.importorskip("plotly", reason="the lab's figures need plotly (pip install plotly)")

import plotly.graph_objects as go
import torch

from fa_lab import Policy, flash_attn_func, trace
from fa_lab.studies import experiments
from fa_lab.lab import viz

# S = 512 at K x64 is the smallest bf16 case where the unfixed lazy rescale makes NaN rows.
S_BF16, K_BF16 = 512, 64


@pytest.fixture(scope="module")
def bf16_case():
    q, k, v = experiments.bf16_inputs(1, S_BF16, 1, 128, K_BF16)
    out, lse = flash_attn_func(q, k, v, causal=False, rescale="lazy_unfixed", return_lse=True)
    bad = (~torch.isfinite(out[0, :, 0]).all(-1)).nonzero().flatten().tolist()
    assert bad, "the constructed case must have non-finite rows"
    w0 = bad[0] // 32 * 32
    tr = trace(q, k, v, rows=range(w0, w0 + 32), causal=False, rescale="lazy_unfixed")
    return dict(q=q, k=k, v=v, out=out, lse=lse, bad=bad, trace=tr, lane=bad[0] - w0)


@pytest.fixture(scope="module")
def fp8_trace():
    (q, k, v), (qd, kd, vd) = experiments.fp8_inputs(1, 512, 1, 5000)
    return trace(q, k, v, rows=range(0, 32), q_descale=qd, k_descale=kd, v_descale=vd,
                 causal=False, rescale="lazy_unfixed")


def by_name(fig, name):
    hits = [t for t in fig.data if t.name == name]
    assert len(hits) == 1, [t.name for t in fig.data]
    return hits[0]


def widget_json(fig):
    """Serialise the figure's traces as a FigureWidget does; strict JSON rejects NaN."""
    from plotly.serializers import _py_to_js

    def strip_buffers(x):  # 1-D float arrays travel as binary buffers, NaN allowed there
        if isinstance(x, dict):
            return {k: ("<buffer>" if isinstance(v, memoryview) else strip_buffers(v))
                    for k, v in x.items()}
        if isinstance(x, list):
            return [strip_buffers(v) for v in x]
        return x

    data = [t.to_plotly_json() for t in fig.data]
    return json.dumps(strip_buffers(_py_to_js(data, None)), allow_nan=False)


# ---- running_max_heatmap ---------------------------------------------------------------

def test_heatmap_holds_the_trace_matrix(bf16_case):
    tr = bf16_case["trace"]
    fig = viz.heatmap.running_max_heatmap(tr)
    heat = fig.data[1]
    want = tr.matrix("m").to_numpy(float)
    z = np.array(heat.z, dtype=float)
    assert z.shape == (32, tr.n_steps) == want.shape
    fin = np.isfinite(want)
    np.testing.assert_array_equal(z[fin], want[fin])
    assert list(heat.x) == list(range(tr.n_steps))
    assert "log2 units" in heat.colorbar.title.text
    assert fig.layout.xaxis.title.text == "KV step (tile of 64 columns)"
    # hover names the row, the step and the value
    r = int(tr.lanes.loc[3, "row"])
    assert f"row {r} " in heat.text[3][2] and "step 2" in heat.text[3][2]
    assert f"{want[3, 2]:.4g}" in heat.text[3][2]


def test_heatmap_marks_drags_fires_and_first_nonfinite(bf16_case):
    tr = bf16_case["trace"]
    st = tr.steps
    fig = viz.heatmap.running_max_heatmap(tr)
    fired = by_name(fig, "wave fired (row not swept)")
    swept = by_name(fig, "dragged (base moved down)")            # unfixed: every sweep drags
    star = by_name(fig, "first non-finite O or l")
    d = st[st.swept]
    f = st[st.fire & ~st.swept]
    assert len(d) > 0 and len(f) > 0
    assert sorted(zip(swept.x, swept.y)) == sorted(zip(d.step, d.lane))
    assert sorted(zip(fired.x, fired.y)) == sorted(zip(f.step, f.lane))
    first = tr.lanes.first_nonfinite_step.dropna()
    assert sorted(zip(star.x, star.y)) == sorted((int(s), int(i)) for i, s in first.items())
    assert bf16_case["lane"] in list(star.y)


def test_heatmap_of_l_flags_infinite_cells(bf16_case):
    tr = bf16_case["trace"]
    fig = viz.heatmap.running_max_heatmap(tr, "l")
    flag = np.array(fig.data[0].z, dtype=float)  # None -> nan
    l = tr.matrix("l").to_numpy(float)
    np.testing.assert_array_equal(flag == 1, np.isnan(l) | (l == math.inf))
    np.testing.assert_array_equal(flag == 0, l == 0)  # log2(0) = -inf: grey
    assert (flag == 1).any()
    assert any("+inf or NaN" in a.text for a in fig.layout.annotations)


def test_heatmap_converts_fp8_units(fp8_trace):
    fig = viz.heatmap.running_max_heatmap(fp8_trace)
    want = fp8_trace.matrix("m").to_numpy(float) * fp8_trace.log2_per_unit
    z = np.array(fig.data[1].z, dtype=float)
    fin = np.isfinite(want)
    np.testing.assert_allclose(z[fin], want[fin], rtol=1e-12)
    assert "tile pair of 128 columns" in fig.layout.xaxis.title.text
    assert "log2_per_unit" in fig.data[1].colorbar.title.text


# ---- lane_lines ------------------------------------------------------------------------

def test_lane_lines_values_events_and_lse(bf16_case):
    tr, lane = bf16_case["trace"], bf16_case["lane"]
    d = tr.lane(lane)
    fig = viz.lanes.lane_lines(tr, lane)
    np.testing.assert_array_equal(by_name(fig, "m, running max (the base)").y, d.m.to_numpy(float))
    np.testing.assert_array_equal(by_name(fig, "tile max").y, d.mt.to_numpy(float))
    with np.errstate(divide="ignore"):
        log_l = np.log2(d["l"].to_numpy(float))
    got = np.asarray(by_name(fig, "log2(l)").y, dtype=float)
    fin = np.isfinite(log_l)
    np.testing.assert_array_equal(got[fin], log_l[fin])
    assert np.isnan(got[~fin]).all()
    assert list(by_name(fig, "dragged (base moved down)").x) == d.step[d.swept].tolist()
    first = int(tr.lanes.loc[lane, "first_nonfinite_step"])
    vlines = [s for s in fig.layout.shapes if s.x0 == s.x1 == first]
    assert len(vlines) == 2  # both panels
    assert any(f"step {first}" in a.text for a in fig.layout.annotations)
    assert "final LSE = +inf" in fig.layout.title.text
    assert fig.layout.yaxis.title.text == "m, maxima (log2 units)"
    # the true running max and the deficit, against an independent cummax
    best = np.maximum.accumulate(d.mt.to_numpy(float))
    np.testing.assert_array_equal(by_name(fig, "true running max (largest tile max so far)").y, best)
    dfc = np.asarray(by_name(fig, "deficit = true max - m").y, dtype=float)
    want = best - d.m.to_numpy(float)
    np.testing.assert_array_equal(dfc[np.isfinite(want)], want[np.isfinite(want)])
    # opened zoomed on the break, with buttons to widen it to every step
    hi = min(tr.n_steps - 1, max(first + 4, 7))
    assert tuple(fig.layout.xaxis2.range) == (-0.5, hi + 0.5)
    labels = [b.label for b in fig.layout.updatemenus[0].buttons]
    assert labels[1] == f"all {tr.n_steps} steps"
    # l overflowed: marked at the top edge of the lower panel, with the fp32 ceiling drawn
    edge = [t for t in fig.data if t.name.startswith("not finite")][1]
    assert len(edge.x) > 0 and max(edge.y) >= np.nanmax(got)
    assert any(s.y0 == 128 for s in fig.layout.shapes)


def test_lane_lines_of_a_finite_lane_has_no_marks(bf16_case):
    tr = bf16_case["trace"]
    ok = tr.lanes.index[tr.lanes.out_finite & tr.lanes.first_nonfinite_step.isna()]
    fig = viz.lanes.lane_lines(tr, int(ok[0]))
    assert not [s for s in fig.layout.shapes if s.line.dash == "dash"]
    assert "final LSE = " in fig.layout.title.text and "inf" not in fig.layout.title.text
    # l = 0 before any P is added and corr = 0 at the first step are log2 = -inf, but not
    # failures: no "not finite" marker anywhere, step 0 included
    d = tr.lane(int(ok[0]))
    assert d["l"].iloc[0] == 0
    edges = [t for t in fig.data if t.name.startswith("not finite")]
    assert len(edges) == 2 and all(len(t.x) == 0 for t in edges)
    assert not fig.layout.updatemenus          # nothing broke: every step, no zoom


def test_lane_lines_fp8_threshold_in_log2_units(fp8_trace):
    fig = viz.lanes.lane_lines(fp8_trace, 0)
    vote = [t for t in fig.data if t.name.startswith("vote line")][0]
    assert vote.name.endswith("+ 8")  # the threshold, 8 log2 units, not raw units
    d = fp8_trace.lane(0)
    m = d.m.to_numpy(float) * fp8_trace.log2_per_unit
    np.testing.assert_allclose(np.asarray(vote.y, float), m[:-1][: len(vote.y)] + 8, rtol=1e-9)


# ---- outputs -----------------------------------------------------------------------------

def test_nonfinite_map_marks_every_bad_row_once():
    out = torch.zeros(2, 6, 3, 4)
    out[1, 0, 0, 1] = math.nan
    out[1, 1, 2, 0] = math.inf
    out[1, 2, 1, 3] = -math.inf
    out[1, 3, 1, 0], out[1, 3, 1, 1] = math.nan, math.inf  # NaN wins
    fig = viz.outputs.nonfinite_map(out, batch=1, highlight=(3, 1))
    marks = {t.name.split(":")[0]: sorted(zip(t.x, t.y)) for t in fig.data[:3]}
    assert marks == {"NaN": [(0, 0), (1, 3)], "+inf": [(2, 1)], "-inf": [(1, 2)]}
    assert [t.name.split(": ")[1] for t in fig.data[:3]] == ["2 rows", "1 rows", "1 rows"]
    assert all(t.marker.symbol == "line-ew" and t.marker.size >= 8 for t in fig.data[:3])
    ring = fig.data[3]
    assert list(ring.x) == [1] and list(ring.y) == [3] and ring.name == "followed row"
    assert "4 of 18" in fig.layout.title.text and "14 finite" in fig.layout.title.text
    assert len(viz.outputs.nonfinite_map(out, batch=0).data[0].x) == 0


def test_nonfinite_map_with_lse_names_how_each_row_died():
    out = torch.zeros(1, 5, 1, 4)
    lse = torch.zeros(1, 1, 5)
    out[0, 0, 0, 0] = -math.inf                      # O overflowed, LSE finite
    out[0, 1, 0] = math.nan
    lse[0, 0, 1] = math.inf                          # l overflowed
    out[0, 2, 0] = math.nan
    lse[0, 0, 2] = math.nan                          # inf * 0
    codes = viz.outputs.row_fates(out, lse)[0, :, 0].tolist()
    assert codes == [2, 1, 3, 0, 0]
    fig = viz.outputs.nonfinite_map(out, lse=lse)
    names = [t.name for t in fig.data]
    assert names[0].startswith("NaN output, LSE = +inf") and list(fig.data[0].y) == [1]
    assert names[1].startswith("inf output, LSE finite") and list(fig.data[1].y) == [0]
    assert names[2].startswith("LSE = NaN") and list(fig.data[2].y) == [2]
    # one mark per row at any H: a tall, one-head output keeps every bad row visible
    tall = torch.zeros(1, 8192, 1, 2)
    tall[0, [5, 4000, 8191], 0, 0] = math.nan
    t = viz.outputs.nonfinite_map(tall).data[0]
    assert sorted(t.y) == [5, 4000, 8191] and t.marker.size >= 8


def test_lse_rows_puts_nonfinite_rows_on_the_edges():
    lse = torch.tensor([[[1.0, 2.0, math.inf, math.nan, -math.inf, 3.0]]])
    out = torch.ones(1, 6, 1, 2)
    out[0, 5, 0, 0] = math.nan
    fig = viz.outputs.lse_rows(lse, out)
    ok = fig.data[0]
    assert list(ok.x) == [0, 1] and list(ok.y) == [1.0, 2.0]
    assert list(fig.data[1].x) == [5] and list(fig.data[1].y) == [3.0]
    top = fig.data[2]
    assert list(top.x) == [2] and top.y[0] > 3.0
    assert list(fig.data[3].x) == [3] and fig.data[3].y[0] == top.y[0]
    assert list(fig.data[4].x) == [4] and fig.data[4].y[0] < 1.0
    assert fig.data[2].name.startswith("LSE = +inf") and fig.data[2].name.endswith("1 rows")


def test_output_difference_rows_against_hand_computed():
    ref = torch.zeros(1, 4, 2, 3)
    a = ref.clone()
    a[0, 1, 1, 2] = 0.5
    a[0, 2, 1, 0] = -0.25
    a[0, 0, 1, 0] = 2.0 ** -10
    b = ref.clone()
    b[0, 3, 1, 1] = math.nan
    b[0, 0, 1, 0] = 2.0 ** -9
    b[0, 1, 0, 0] = 7.0  # head 0: not shown
    fig = viz.outputs.output_difference_rows({"lazy": a, "fp8": b}, ref, head=1)
    lazy, fp8 = fig.data[0], fig.data[1]
    y = np.asarray(lazy.y, float)
    np.testing.assert_array_equal(y[:3], [2.0 ** -10, 0.5, 0.25])
    assert 0 < y[3] < 2.0 ** -10  # equal to the reference: the bottom edge
    assert fp8.y[0] == 2.0 ** -9 and np.isnan(fp8.y[3])
    assert lazy.marker.color == viz.style.policy_color("lazy")
    assert fp8.marker.color == viz.style.policy_color("fp8")
    bad = fig.data[3]
    assert list(bad.x) == [3] and bad.y[0] > 0.5
    assert "1 non-finite rows" in bad.name


# ---- tables ------------------------------------------------------------------------------

def bf16_table():
    rows = []
    for K, nan in ((8, 0.0), (32, 0.1), (64, 0.8)):
        for pol, rel in (("lazy_unfixed", 5e-3), ("lazy", 6e-3), ("eager", 6.1e-3)):
            bad = pol == "lazy_unfixed" and nan > 0
            rows.append({"k_scale": K, "policy": pol, "rel_l2": math.nan if bad else rel * K / 8,
                         "nan_frac": nan if pol == "lazy_unfixed" else 0.0})
    return pd.DataFrame(rows)


def test_bf16_table_curves_values_colours_and_seed():
    seed = experiments.seed_table("bf16")
    fig = viz.tables.bf16_table_curves(bf16_table(), seed)
    unfixed = [t for t in fig.data if t.name == "lazy_unfixed"]
    rel, nan = unfixed[0], unfixed[1]
    assert list(rel.x) == [8, 32, 64]
    assert rel.y[0] == 5e-3 and np.isnan(rel.y[1:]).all()  # NaN output: no point
    assert list(nan.y) == [0.0, 10.0, 80.0]
    for t in fig.data:
        pol = t.legendgroup
        assert t.marker.color == viz.style.policy_color(pol), t.name
    seed_rel = [t for t in fig.data if t.name.startswith("lazy (the bug report")][0]
    assert list(seed_rel.y) == [r["lazy"] for r in seed["rows"]]
    assert seed_rel.marker.symbol.endswith("-open")
    seed_nan = [t for t in fig.data if t.name.startswith("lazy_unfixed NaN (the bug report")][0]
    assert list(seed_nan.y) == [r["lazy_unfixed_nan_pct"] for r in seed["rows"]]
    assert fig.layout.yaxis.type == "log"


def test_fp8_table_curves_values_zero_edge_and_seed():
    table = pd.DataFrame([
        {"k_scale": 1000, "variant": "unfixed", "mean_abs_dev": 1e-4, "nan": 0, "elements": 100},
        {"k_scale": 5000, "variant": "unfixed", "mean_abs_dev": 0.0, "nan": 50, "elements": 100},
        {"k_scale": 1000, "variant": "bound 16", "mean_abs_dev": 2e-4, "nan": 0, "elements": 100},
        {"k_scale": 5000, "variant": "bound 16", "mean_abs_dev": 3e-3, "nan": 0, "elements": 100},
    ])
    seed = experiments.seed_table("fp8")
    fig = viz.tables.fp8_table_curves(table, seed)
    unfixed = [t for t in fig.data if t.legendgroup == "unfixed" and "bug report" not in t.name]
    mad, zero, nan = unfixed
    assert mad.y[0] == 1e-4 and np.isnan(mad.y[1])
    assert list(zero.x) == [5000] and zero.y[0] < 1e-4  # exactly 0: bottom edge
    assert nan.y[1] == 50.0 and 0 < nan.y[0] < 50.0     # no NaN: the log axis' bottom edge
    assert nan.marker.symbol[0] == "triangle-down" and nan.marker.symbol[1] == "square"
    b16 = [t for t in fig.data if t.name.startswith("bound 16 (the bug report")][0]
    want = [r for r in seed["rows"] if r["policy"] == "lazy_capped" and r.get("bound") == 16]
    assert list(b16.x) == [r["k_scale"] for r in want]
    assert list(b16.y) == [r["mean_abs_dev"] for r in want]
    n_seed = 2 * 12288 * 8 * 128
    seed_nan = [t for t in fig.data if t.name.startswith("unfixed NaN (the bug report")][0]
    assert seed_nan.y[1] == pytest.approx(100 * 20.0e6 / n_seed)
    for t in fig.data:
        assert t.marker.color == viz.style.policy_color(t.legendgroup)
    assert fig.layout.xaxis.type == "log"


def test_policy_colours_are_distinct_and_shared():
    c = {n: viz.style.policy_color(n) for n in ("eager", "lazy", "lazy_unfixed", "lazy_capped", "fp8",
                                          "unfixed", "monotonic", "bound 8", "bound 16", "bound 32")}
    assert len({c["eager"], c["lazy"], c["lazy_unfixed"], c["lazy_capped"], c["fp8"]}) == 5
    assert c["unfixed"] == c["lazy_unfixed"] and c["monotonic"] == c["lazy"]
    assert c["bound 16"] == c["lazy_capped"]  # the default bound
    assert len({c["bound 8"], c["bound 16"], c["bound 32"]}) == 3
    assert viz.style.policy_color("something else") == viz.style.OTHER_COLOR


# ---- widget transport and bad input -------------------------------------------------------

def test_every_figure_survives_the_widget_protocol(bf16_case, fp8_trace):
    tr = bf16_case["trace"]
    figs = [viz.heatmap.running_max_heatmap(tr), viz.heatmap.running_max_heatmap(tr, "l"),
            viz.heatmap.running_max_heatmap(tr, "deficit", highlight=3),
            viz.heatmap.running_max_heatmap(tr, "swept"),
            viz.lanes.lane_lines(tr, bf16_case["lane"]), viz.lanes.lane_lines(fp8_trace, 0),
            viz.lanes.row_compare({"lazy_unfixed": tr, "again": tr}, bf16_case["lane"]),
            viz.heatmap.wave_ballot(tr, 3, highlight=bf16_case["lane"]), viz.heatmap.wave_ballot(fp8_trace, 0),
            viz.outputs.nonfinite_map(bf16_case["out"], lse=bf16_case["lse"], highlight=(0, 0)),
            viz.outputs.nonfinite_map(bf16_case["out"]), viz.outputs.lse_rows(bf16_case["lse"], bf16_case["out"]),
            viz.outputs.output_difference_rows({"lazy_unfixed": bf16_case["out"]}, bf16_case["out"].float()),
            viz.tables.bf16_table_curves(bf16_table(), experiments.seed_table("bf16"))]
    for fig in figs:
        widget_json(fig)  # raises ValueError on NaN/inf


def test_dashboard_figures_skip_the_tick_label_overflow_check(bf16_case):
    """The dashboards' figures keep their tick labels inside, so every axis lets them be
    ("allow") instead of plotly.js measuring each label on each redraw."""
    tr, lane = bf16_case["trace"], bf16_case["lane"]
    figs = [viz.heatmap.running_max_heatmap(tr), viz.lanes.lane_lines(tr, lane),
            viz.lanes.row_compare({"lazy_unfixed": tr, "again": tr}, lane), viz.heatmap.wave_ballot(tr, 3),
            viz.outputs.nonfinite_map(bf16_case["out"]),
            viz.outputs.output_difference_rows({"lazy_unfixed": bf16_case["out"]},
                                       bf16_case["out"].float())]
    for fig in figs:
        axes = [k for k in fig.to_plotly_json()["layout"] if k[1:5] == "axis"]
        assert axes and all(fig.layout[a].ticklabeloverflow == "allow" for a in axes), axes


@pytest.mark.parametrize("call, err, words", [
    (lambda t: viz.heatmap.running_max_heatmap("trace"), TypeError, "fa_lab.Trace"),
    (lambda t: viz.heatmap.running_max_heatmap(t, "q"), ValueError, "value='q'"),
    (lambda t: viz.lanes.lane_lines(t, 32), ValueError, "lane=32"),
    (lambda t: viz.lanes.lane_lines(t, 1.0), TypeError, "lane must be an int"),
    (lambda t: viz.outputs.nonfinite_map(torch.zeros(2, 3)), ValueError, "out must be 4-D"),
    (lambda t: viz.outputs.nonfinite_map(torch.zeros(1, 2, 3, 4), batch=1), ValueError, "batch=1"),
    (lambda t: viz.outputs.lse_rows(torch.zeros(1, 2, 3), torch.zeros(1, 3, 3, 4)), ValueError, "does not match"),
    (lambda t: viz.outputs.output_difference_rows({}, torch.zeros(1, 2, 1, 4)), ValueError, "non-empty dict"),
    (lambda t: viz.outputs.output_difference_rows({"a": torch.zeros(1, 3, 1, 4)}, torch.zeros(1, 2, 1, 4)),
     ValueError, "outputs['a']"),
    (lambda t: viz.tables.bf16_table_curves(pd.DataFrame({"k_scale": [8]})), ValueError, "lacks columns"),
    (lambda t: viz.tables.fp8_table_curves([1, 2]), TypeError, "DataFrame"),
    (lambda t: viz.tables.bf16_table_curves(bf16_table(), seed={"no": "rows"}), TypeError, "seed"),
    (lambda t: viz.export.to_png(go.Figure(), "/tmp/x.jpg"), ValueError, ".png"),
    (lambda t: viz.heatmap.wave_ballot(t, t.n_steps), ValueError, "step="),
    (lambda t: viz.heatmap.wave_ballot(t, 1.5), TypeError, "step must be an int"),
    (lambda t: viz.heatmap.wave_ballot(t, 1, wave=4096), ValueError, "no traced lane"),
    (lambda t: viz.lanes.row_compare({}, 0), ValueError, "non-empty dict"),
    (lambda t: viz.lanes.row_compare({"a": t}, 32), ValueError, "lane=32"),
    (lambda t: viz.outputs.nonfinite_map(torch.zeros(1, 3, 2, 4), lse=torch.zeros(1, 3, 2)), ValueError,
     "does not match"),
])
def test_bad_input_is_refused(bf16_case, call, err, words):
    with pytest.raises(err, match=None) as e:
        call(bf16_case["trace"])
    assert words in str(e.value)


def test_to_png_writes_a_png_in_place(tmp_path):
    fig = viz.tables.bf16_table_curves(bf16_table())
    path = viz.export.to_png(fig, tmp_path / "sub" / "t.png")
    assert path == tmp_path / "sub" / "t.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in path.parent.iterdir()] == ["t.png"]  # no temp file left


# ---- the mechanism: deficit, one wave, fixed beside unfixed ------------------------------

@pytest.fixture(scope="module")
def wave_traces(bf16_case):
    c = bf16_case
    w0 = c["bad"][0] // 32 * 32
    return {pol: trace(c["q"], c["k"], c["v"], rows=range(w0, w0 + 32), causal=False, rescale=pol)
            for pol in ("lazy_unfixed", "lazy", "eager")}


def test_deficit_is_the_true_max_minus_m(wave_traces):
    tr = wave_traces["lazy_unfixed"]
    d = viz.tracedata.deficit(tr).to_numpy()
    st = tr.steps
    lane = st[st.lane == 5]
    want = np.maximum.accumulate(lane.mt.to_numpy(float)) - lane.m.to_numpy(float)
    fin = np.isfinite(want)
    np.testing.assert_array_equal(d[5][fin], want[fin])
    assert np.nanmax(np.where(np.isfinite(d), d, np.nan)) > 100       # unfixed: deep
    assert (viz.tracedata.deficit(wave_traces["eager"]).to_numpy() == 0).all()   # eager: none
    fixed = viz.tracedata.deficit(wave_traces["lazy"]).to_numpy()
    assert (fixed >= 0).all() and fixed.max() <= 8                     # fixed: at most THR


def test_heatmap_flags_are_two_colours_and_ranges_stay_fixed(wave_traces):
    tr = wave_traces["lazy_unfixed"]
    flags = viz.heatmap.running_max_heatmap(tr, "fire")
    heat = flags.data[1]
    assert heat.zmin == 0 and heat.zmax == 1
    assert [c[1] for c in heat.colorscale] == ["#eeeeee", "#eeeeee", "#555555", "#555555"]
    assert heat.colorbar.ticktext == ("no", "fired")
    markers = [t for t in flags.data if t.type == "scatter" and t.marker.symbol != "star"]
    assert len(markers) == 5 and all(len(t.x) == 0 for t in markers)   # no markers over flags
    d1 = viz.heatmap.running_max_heatmap(tr, "deficit").data[1]
    d2 = viz.heatmap.running_max_heatmap(wave_traces["lazy"], "deficit").data[1]
    assert (d1.zmin, d1.zmax) == (d2.zmin, d2.zmax) == viz.style.FIXED_RANGES["deficit"]
    hl = viz.heatmap.running_max_heatmap(tr, "deficit", highlight=7)
    assert [(s.y0, s.y1) for s in hl.layout.shapes] == [(6.5, 7.5)]


def test_wave_ballot_counts_the_ballot(wave_traces, bf16_case):
    tr = wave_traces["lazy_unfixed"]
    st = tr.steps
    step = int(st[st.swept].step.iloc[0])
    fig = viz.heatmap.wave_ballot(tr, step, highlight=bf16_case["lane"])
    at = st[st.step == step]
    n_vote, n_drag = int(at.vote.sum()), int(at.swept.sum())
    lanes_voted = fig.data[1]                                          # drawn on top
    assert len(lanes_voted.x) == 2 * n_vote                            # two lanes per row
    voted = [t for t in fig.data if t.name and t.name.startswith("voted")][0]
    swept = [t for t in fig.data if t.name and t.name.startswith("dragged (base moved down)")][0]
    assert voted.name.endswith(f": {n_vote}") and swept.name.endswith(f": {n_drag}")
    assert all(x < 0 for x in swept.x) and all(x > 8 for x in voted.x)
    assert f"{n_vote} voted, the wave fired<br>{n_drag} dragged (base moved down)" in fig.layout.title.text
    assert any("FIRE" in a.text for a in fig.layout.annotations)


def test_row_compare_puts_fixed_beside_unfixed(wave_traces, bf16_case):
    lane = bf16_case["lane"]
    fig = viz.lanes.row_compare({"lazy_unfixed": wave_traces["lazy_unfixed"], "lazy": wave_traces["lazy"]},
                          lane)
    heads = [a.text for a in fig.layout.annotations if a.text.startswith("<b>")]
    assert heads[0].startswith("<b>lazy_unfixed</b>") and "non-finite from step" in heads[0]
    assert heads[1] == "<b>lazy</b>: stays finite"
    ms = [t for t in fig.data if t.name == "m, the base"]
    assert [t.line.color for t in ms] == [viz.style.policy_color("lazy_unfixed"), viz.style.policy_color("lazy")]
    np.testing.assert_array_equal(ms[1].y, wave_traces["lazy"].lane(lane).m.to_numpy(float))
    first = int(wave_traces["lazy_unfixed"].lanes.loc[lane, "first_nonfinite_step"])
    assert fig.layout.xaxis.range[0] == -0.5 and fig.layout.xaxis.range[1] >= first
    assert fig.layout.yaxis3.range == fig.layout.yaxis4.range          # one deficit scale
    wide = viz.lanes.row_compare({"a": wave_traces["lazy"]}, lane, window=None)
    assert wide.layout.xaxis.range[1] == wave_traces["lazy"].n_steps - 0.5
    with pytest.raises(ValueError, match="same rows"):
        viz.lanes.row_compare({"a": wave_traces["lazy"], "b": trace(
            bf16_case["q"], bf16_case["k"], bf16_case["v"], rows=range(480, 512), causal=False)}, 0)


def test_fp8_nan_share_sits_on_a_log_axis():
    table = pd.DataFrame([
        {"k_scale": 5000, "variant": "bound 32", "mean_abs_dev": 1e-4, "nan": 3, "elements": 10**6},
        {"k_scale": 5000, "variant": "unfixed", "mean_abs_dev": 1e-4, "nan": 8 * 10**5, "elements": 10**6},
        {"k_scale": 5000, "variant": "bound 16", "mean_abs_dev": 1e-4, "nan": 0, "elements": 10**6},
    ])
    fig = viz.tables.fp8_table_curves(table)
    assert fig.layout.yaxis2.type == "log"
    b32 = [t for t in fig.data if t.legendgroup == "bound 32" and t.xaxis == "x2"][0]
    assert b32.y[0] == pytest.approx(3e-4)                 # a leak of 3 in a million shows
    b16 = [t for t in fig.data if t.legendgroup == "bound 16" and t.xaxis == "x2"][0]
    assert 0 < b16.y[0] < 3e-4 and b16.marker.symbol[0].startswith("triangle-down")


def test_one_colour_per_implementation():
    assert viz.style.impl_color("fast_lazy") == viz.style.policy_color("lazy")
    assert viz.style.impl_color("fast_eager") == viz.style.policy_color("eager")
    assert viz.style.impl_color("fast_lazy_unfixed") == viz.style.policy_color("lazy_unfixed")
    assert len(set(viz.style.IMPL_COLORS.values())) == len(viz.style.IMPL_COLORS)
    assert viz.style.impl_color("lazy_capped") == viz.style.policy_color("lazy_capped")


# ---- a swept row, named by what its policy did to it -----------------------------------

def _moved(tr):
    """The trace's steps with the base before each step (NaN at a lane's first step)."""
    st = tr.steps.copy()
    st["m_before"] = st.groupby("lane").m.shift()
    return st


def test_sweep_outcomes_name_each_swept_row_by_its_base(wave_traces, bf16_case):
    """Dragged is a swept row whose base moved down; under the fix every swept row keeps
    its base and is left alone; a capped rule does both (drops within its bound are drags,
    larger ones are skipped). Checked against the base itself, not the correction."""
    c = bf16_case
    w0 = c["bad"][0] // 32 * 32
    capped = trace(c["q"], c["k"], c["v"], rows=range(w0, w0 + 32), causal=False,
                   rescale="lazy_capped")
    for tr, want in ((wave_traces["lazy_unfixed"], {"dragged"}), (wave_traces["lazy"], {"left_alone"}),
                     (capped, {"dragged", "left_alone"})):
        st = _moved(tr)
        got = viz.tracedata.sweep_outcomes(st)
        assert list(got) == list(viz.tracedata.SWEEP_OUTCOMES)
        assert (sum(m.astype(int) for m in got.values()) == st.swept.to_numpy()).all()  # one each
        assert {k for k, m in got.items() if m.any()} == want
        down = (st.swept & (st.m < st.m_before)).to_numpy()
        kept = (st.swept & (st.m == st.m_before)).to_numpy()
        assert (got["dragged"] == down).all() and (got["left_alone"] == kept).all()
    drops = (_moved(capped).eval("m_before - m") * capped.log2_per_unit)[
        viz.tracedata.sweep_outcomes(capped.steps)["dragged"]]
    assert drops.max() <= 16                                   # a drag within the cap only
    assert viz.tracedata.sweep_words(wave_traces["eager"].steps) == "never swept"
    n = int(viz.tracedata.sweep_outcomes(capped.steps)["dragged"].sum())
    assert viz.tracedata.sweep_words(capped.steps).startswith(f"dragged (base moved down) {n} times, ")
    # a rule of one's own that lifts a swept row's base above its max: rebased up
    lift = Policy.from_rule(lambda m, mt, thr: torch.where(
        (~(mt - m <= thr)).any(-1, keepdim=True), torch.maximum(m, mt) + 1, m), name="lift")
    up = viz.tracedata.sweep_outcomes(trace(c["q"], c["k"], c["v"], rows=range(w0, w0 + 32),
                                            causal=False, rescale=lift).steps)
    assert up["rebased_up"].any() and not up["dragged"].any() and not up["left_alone"].any()


def test_figures_name_a_sweep_by_policy(wave_traces):
    u, f = wave_traces["lazy_unfixed"], wave_traces["lazy"]
    step = int(u.steps[u.steps.swept].step.iloc[0])
    for tr, shown, hidden in ((u, "dragged (base moved down)", "swept: left alone"),
                              (f, "swept: left alone", "dragged (base moved down)")):
        n = int(tr.steps[tr.steps.step == step].swept.sum())
        wave = viz.heatmap.wave_ballot(tr, step)
        legend = [t.name for t in wave.data if t.name and t.showlegend is not False]
        assert f"{shown}: {n}" in legend and not any(x.startswith(hidden) for x in legend)
        assert f"the wave fired<br>{n} {shown}" in wave.layout.title.text
        assert hidden not in wave.layout.title.text
        heat = viz.heatmap.running_max_heatmap(tr, "swept")
        assert heat.data[1].colorbar.ticktext == ("not swept", shown)
        lane, at = map(int, tr.steps[tr.steps.swept].iloc[0][["lane", "step"]])
        assert heat.data[1].text[lane][at].endswith(f"<br>{shown}")
        marks = viz.heatmap.running_max_heatmap(tr, "deficit")
        assert by_name(marks, shown).showlegend and not by_name(marks, hidden).showlegend
        assert len(by_name(marks, shown).x) == int(tr.steps.swept.sum())
    # unfixed beside fixed: one legend entry each, from its own column
    fig = viz.lanes.row_compare({"lazy_unfixed": u, "lazy": f}, 0)
    sweeps = [(t.name, t.xaxis, len(t.x)) for t in fig.data if t.showlegend and t.marker.symbol == "x-thin"]
    assert sweeps == [("dragged (base moved down)", "x", int(u.lane(0).swept.sum())),
                      ("swept: left alone", "x2", int(f.lane(0).swept.sum()))]
    assert len(viz.lanes.row_compare({"a": f, "b": u}, 0).data) == len(fig.data)   # a redraw keeps them
