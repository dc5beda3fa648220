"""fa_lab.lab.atlas: the atlas's heatmaps, one cell picked and opened in the lane dashboard."""

import math

import pandas as pd
import pytest

# The figures need plotly, which a GPU machine may lack; there these tests have nothing to test.
pytest.importorskip("plotly", reason="the lab's figures need plotly (pip install plotly)")

import plotly.graph_objects as go
from plotly.callbacks import Points

from fa_lab.lab import atlas, widgets
from fa_lab.studies import sweep


@pytest.fixture(scope="module")
def grid():
    """A CPU sweep at the dashboards' size: batch 1, S 512, H 1, so a cell and its
    dashboard run the very same inputs."""
    g = sweep.Grid({"policy": ["lazy_unfixed", "lazy", "eager"], "k_scale": [24, 64],
                    "threshold": [4, 8], "S": [512], "H": [1]})
    return pd.DataFrame([sweep.compute_point(p) for p in g.points()])


def test_heatmaps_carry_their_cells(grid):
    fig = atlas.heatmaps(grid, ["lazy_unfixed", "eager"])
    data = [t for t in fig.data if t.meta]
    assert [t.meta["policy"] for t in data] == ["lazy_unfixed", "eager"]
    for t in data:
        assert t.meta["x"] == {"4": 4.0, "8": 8.0} and t.meta["y"] == {"x24": 24.0, "x64": 64.0}
    unfixed = grid[(grid.policy == "lazy_unfixed") & (grid.k_scale == 64) & (grid.threshold == 8)]
    assert math.isclose(data[0].customdata[1][1], 100 * unfixed.nan_frac.iloc[0])
    eager = grid[(grid.policy == "eager") & (grid.k_scale == 64)].nan_frac.iloc[0]
    assert list(data[1].customdata[1]) == [100 * eager] * 2   # one run, under every column
    with pytest.raises(ValueError, match="^policies_: 'fa4_row' has no row"):
        atlas.heatmaps(grid, ["fa4_row"])


def test_the_cell_reaches_the_dashboard(grid):
    cell = atlas.pick(grid, "lazy_unfixed", 64, 8)
    assert cell.measured["nan_frac"] > 0.1 and cell.has_threshold
    d = atlas.open_cell(cell)
    p = d.last["params"]
    assert (p["policy"], p["k_scale"], p["threshold"], p["causal"], p["S"], p["H"], p["D"],
            p["seed"]) == ("lazy_unfixed", 64, 8.0, False, 512, 1, 128, 0)
    assert cell.same_inputs(cell.dashboard_args())
    stats = d.last["stats"].set_index("policy")
    for pol in ("lazy_unfixed", "lazy"):      # the same inputs: the cell's own NaN share
        other = atlas.pick(grid, pol, 64, 8)
        assert stats.nan_pct[pol] == pytest.approx(100 * other.measured["nan_frac"], abs=1e-12)
    assert not d.last["trace"].steps.o_finite.all()   # the first bad row's trace


def test_eager_is_one_run_under_every_column(grid):
    a, b = atlas.pick(grid, "eager", 24, 4), atlas.pick(grid, "eager", 24)
    assert a.measured["point_id"] == b.measured["point_id"] and not a.has_threshold
    # no column picked: the dashboard runs the policy's own (eager has none: upstream's 8)
    assert a.dashboard_args()["threshold"] == 4.0 and b.dashboard_args()["threshold"] is None
    assert widgets.views.view_threshold("eager", None) == 8.0


@pytest.mark.parametrize("args, exc, match", [
    (("fa4_row", 64, 8), ValueError, r"^policy='fa4_row' has no cell in table"),
    ((3, 64, 8), TypeError, r"^policy must be a str"),
    (("lazy", 32, 8), ValueError, r"^k_scale=32 is not a K scale of 'lazy' in table"),
    (("lazy", "64", 8), TypeError, r"^k_scale must be a number"),
    (("lazy", 64, 6), ValueError, r"^threshold=6.0: 'lazy' at K x64 has the thresholds"),
    (("lazy", 64, None), ValueError, r"^threshold=None: 'lazy' at K x64"),
    (("lazy", 64, "8"), TypeError, r"^threshold must be a number or None"),
    (("eager", 64, 6), ValueError, r"^threshold=6 is not a threshold column of table"),
])
def test_bad_cells_are_refused(grid, args, exc, match):
    with pytest.raises(exc, match=match):
        atlas.pick(grid, *args)


def test_bad_tables_are_refused(grid):
    with pytest.raises(TypeError, match="^table must be a pandas DataFrame"):
        atlas.pick(grid.to_dict("records"), "lazy", 64, 8)
    with pytest.raises(ValueError, match=r"^table lacks the column\(s\) \['threshold'\]"):
        atlas.pick(grid.drop(columns="threshold"), "lazy", 64, 8)
    twice = pd.concat([grid, grid.assign(seed=1)])
    with pytest.raises(ValueError, match=r"^table has 2 rows for this cell .*differ in \['seed'\]"):
        atlas.pick(twice, "lazy", 64, 8)
    with pytest.raises(ValueError, match=r"^table's dtype is 'f16'"):
        atlas.pick(grid.assign(dtype="f16"), "lazy", 64, 8)
    mine = grid.assign(policy=grid.policy.replace("lazy", "not_registered"))
    with pytest.raises(ValueError, match=r"^policy='not_registered' is not registered"):
        atlas.pick(mine, "not_registered", 64, 8)
    with pytest.raises(TypeError, match=r"^cell must be a fa_lab.lab.atlas.Cell"):
        atlas.open_cell(("lazy", 64, 8))


def test_a_cell_too_big_for_this_machine_opens_at_the_dashboard_size():
    table = sweep.reference("bf16_seed_h200")
    cell = atlas.pick(table, "lazy_unfixed", 32, 8)
    assert abs(100 * cell.measured["nan_frac"] - 9.20) < 0.01 and cell.size()["S"] == 8192
    args = cell.dashboard_args()
    assert (args["S"], args["H"], args["k_scale"], args["threshold"]) == (1024, 1, 32, 8.0)
    assert not cell.same_inputs(args)
    assert cell.describe() == ("lazy_unfixed, K x32, threshold 8: 9.202 % NaN "
                               "(B2 S8192 H32 D128 on NVIDIA H200)")
    assert cell.dashboard_args(S=8192, H=32)["S"] == 8192
    fp8 = atlas.pick(sweep.reference("fp8_seed_h200"), "lazy_capped", 5000, 8)
    assert fp8.dtype == "fp8" and fp8.dashboard_args()["rebase_bound"] == 16.0


def test_picker_opens_a_clicked_cell(grid):
    fig = go.FigureWidget(atlas.heatmaps(grid, ["lazy_unfixed", "lazy"]))
    picker = atlas.CellPicker(grid, ["lazy_unfixed", "lazy"], figure=fig, open=False)
    assert picker.dashboard is None
    trace = next(t for t in fig.data if t.meta and t.meta["policy"] == "lazy")
    picker.on_click(trace, Points(point_inds=[[0, 1]], xs=["8"], ys=["x24"], trace_name="lazy",
                                  trace_index=3))
    assert (picker.policy.value, picker.k_scale.value, picker.threshold.value) == ("lazy", 24.0, 8.0)
    p = picker.dashboard.last["params"]
    assert (p["policy"], p["k_scale"], p["threshold"], p["S"]) == ("lazy", 24, 8.0, 512)
    assert "the very same inputs" in picker.status.value and "lazy, K x24" in picker.status.value
    with pytest.raises(ValueError, match=r"^k_scale=33"):
        picker.select("lazy", 33, 8)
    assert picker.k_scale.value == 24.0 and picker.cell.k_scale == 24.0  # a bad cell changes nothing
    picker.policy.value = "lazy_unfixed"                # the options follow the policy
    picker.button.click()
    assert picker.dashboard.last["params"]["policy"] == "lazy_unfixed"
    with pytest.raises(TypeError, match="^figure must be a plotly FigureWidget"):
        picker.connect(atlas.heatmaps(grid, ["lazy"]))
