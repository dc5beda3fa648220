"""The failure zoo's figures: a mechanism strip colours each cell by what it holds, and a
boundary figure draws the formula's line."""

import math

import pytest

# The figures need plotly, which a GPU machine may lack; there these tests have nothing to test.
pytest.importorskip("plotly", reason="the lab's figures need plotly (pip install plotly)")

from fa_lab.lab import viz
from fa_lab.kernels.online.model import row_history
from fa_lab.zoo import ENTRIES


def test_a_mechanism_strip_shows_the_row_state_per_step():
    e = ENTRIES["fa4_fp8_saturation"]
    hist = {k: row_history(e.run(k)[3]) for k in ("before", "after")}
    fig = viz.zoo.mechanism_strip(hist, title=e.title, p_limit=448.0)
    assert [t.type for t in fig.data] == ["heatmap", "heatmap"]
    before = fig.data[0]
    names = [label for _, label in viz.zoo.QUANTITIES]
    assert list(before.y) == names and len(before.x) == 2
    p_row = names.index("largest P")
    # step 1 before: P = 2^11.5 past e4m3's 448 (kind 1); after it stays at 256 (kind 0)
    assert before.z[p_row] == [0, 1] and fig.data[1].z[p_row] == [0, 0]
    assert before.text[p_row][1] == "2.9e+03"


def test_non_finite_cells_are_told_apart():
    e = ENTRIES["ffpa_vote_nan"]
    fig = viz.zoo.mechanism_strip({"before": row_history(e.run("before")[3])}, title="x")
    z = fig.data[0].z
    names = [label for _, label in viz.zoo.QUANTITIES]
    assert z[names.index("base m")][0] == 2                         # -inf: an empty max
    assert z[names.index("factor on O")][0] == 4                    # NaN
    assert fig.data[0].text[names.index("factor on O")][0] == "NaN"
    with pytest.raises(ValueError, match="histories"):
        viz.zoo.mechanism_strip({}, title="x")


def test_boundary_curves_draw_the_formula():
    fig = viz.zoo.boundary_curves([0, 1, 2], {"a": [0, 0, 1]}, boundary=math.log2(448) - 8,
                              x_title="x", y_title="y", title="t")
    assert fig.data[0].y == (0, 0, 1)
    assert fig.layout.shapes[0].x0 == pytest.approx(0.807, abs=1e-3)


def test_a_long_strip_title_wraps_at_a_word():
    from fa_lab.lab.viz.zoo import TITLE_WIDTH, wrap_title

    e = ENTRIES["fa3_v_tail_nan"]
    assert len(e.title) > TITLE_WIDTH
    wrapped = wrap_title(e.title)
    lines = wrapped.split("<br>")
    assert len(lines) == 2 and " ".join(lines) == e.title
    assert all(len(line) <= TITLE_WIDTH for line in lines) and lines[1].endswith("0 * NaN")
    assert wrap_title("short title") == "short title" and wrap_title("x" * 80) == "x" * 80
    hist = {k: row_history(e.run(k)[3]) for k in ("before", "after")}
    fig = viz.zoo.mechanism_strip(hist, title=e.title)
    assert fig.layout.title.text.startswith(wrapped + "<br><sup>")
    assert fig.layout.margin.t > 90 and fig.layout.height > 330      # room for the second line
