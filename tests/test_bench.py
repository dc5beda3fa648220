"""fa_lab.bench: the FLOP count, the table it prints, its figure and its guards (CPU).
The timings themselves need a GPU: `fa-lab bench` on one."""

import math

import pandas as pd
import pytest
import torch

from fa_lab import bench, cli


def test_flops_counts_two_matmuls_and_halves_for_causal():
    s = bench.Shape(B=2, S=8192, H=32, D=128, causal=False)
    assert s.flops() == 4 * 2 * 32 * 8192 * 8192 * 128
    assert bench.Shape(2, 8192, 32, 128, True).flops() == s.flops() / 2
    assert s.name == "B2 S8192 H32 D128"


def test_shapes_include_a_length_that_is_not_a_multiple_of_64():
    assert any(s.S % 64 for s in bench.SHAPES)
    assert {s.causal for s in bench.SHAPES} == {False, True}


def _table():
    rows = []
    for shape, scale in (("a", 1.0), ("b", 2.0)):
        for impl, tf in (("fast_lazy", 500.0), ("fast_eager", 400.0), ("sdpa_flash", 250.0),
                         ("sdpa_cudnn", 625.0), ("flex", None)):
            rows.append({"shape": shape, "impl": impl, "tflops": None if tf is None else tf * scale,
                         "ms": 1.0, "rel_l2": 1e-3 if impl != "sdpa_flash" else None,
                         "config": "BM128" if impl == "fast_lazy" else None,
                         "note": "no kernel" if tf is None else None})
    return pd.DataFrame(rows)


def test_ratios_divide_the_fast_lazy_throughput_by_each_peer():
    r = bench.ratios(_table())
    assert r.loc["a", "fast_lazy / sdpa_flash"] == pytest.approx(2.0)
    assert r.loc["b", "fast_lazy / sdpa_cudnn"] == pytest.approx(0.8)
    assert r.loc["a", "fast_lazy / fast_eager"] == pytest.approx(1.25)
    with pytest.raises(ValueError, match="no timings"):
        bench.ratios(_table(), impl="fast_fp8_lazy")


def test_format_table_shows_numbers_ratios_and_notes():
    text = bench.format_table(_table())
    assert "500.0" in text and "1250.0" in text  # 625 * 2
    assert "2.000" in text and "0.800" in text
    assert "note: flex @ a: no kernel" in text
    assert "autotuned fast_lazy @ b: BM128" in text


def test_figure_has_one_bar_trace_per_implementation():
    fig = bench.figure(_table())
    names = [t.name for t in fig.data]
    assert names == ["fast_lazy", "fast_eager", "sdpa_flash", "sdpa_cudnn", "flex"]
    lazy = fig.data[0]
    assert list(lazy.x) == ["a", "b"] and list(lazy.y) == [500.0, 1000.0]
    assert all(y is None or math.isnan(y) for y in fig.data[-1].y)


def test_run_refuses_bad_arguments_before_any_work():
    with pytest.raises(ValueError, match="unknown implementations"):
        bench.run(impls=("fast_lazy", "mystery"))
    with pytest.raises(ValueError, match="shapes is empty"):
        bench.run(shapes=())
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs a CUDA device"):
            bench.run(device="cpu")


def test_cli_bench_rejects_bad_shape_indices():
    with pytest.raises(SystemExit, match="--shapes takes indices"):
        cli.main(["bench", "--shapes", "7", "--no-save"])
