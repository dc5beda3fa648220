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


# ---- split-K and varlen suites ---------------------------------------------------------------

def test_split_and_varlen_shapes_name_and_count_flops():
    s = bench.SPLITK_SHAPES[0]
    assert (s.S, s.seqlen_kv, s.causal) == (512, 65536, False) and s.S >= 384
    assert s.name == "B1 Sq512 Skv65536 H32 D128"
    assert s.flops() == 4 * 1 * 32 * 512 * 65536 * 128
    v = bench.varlen_shape((1000, 3000), 2, 64, True)
    assert (v.B, v.S, v.varlen) == (2, 3000, True)
    assert v.name == "varlen B2 T4000 Smax3000 H2 D64 causal"
    assert v.flops() == 4 * 2 * 64 * (1000**2 + 3000**2) / 2
    lens = bench.VARLEN_LENGTHS
    assert len(lens) == 8 and 1024 <= min(lens) and max(lens) <= 8192 and 30_000 < sum(lens) < 34_000
    assert {x.causal for x in bench.VARLEN_SHAPES} == {False, True}


def test_suite_jobs_pick_each_suites_shapes_and_implementations():
    dense = bench.suite_jobs()
    assert [(s, i) for _, s, i in dense] == [(s, bench.IMPLS) for s in bench.SHAPES]
    splitk = bench.suite_jobs(("splitk",))
    assert [s for _, s, _ in splitk] == list(bench.SPLITK_SHAPES)
    for suite, _, impls in splitk:
        assert suite == "splitk" and {"fast_lazy", "fast_lazy_split2", "fast_lazy_split4",
                                      "fast_lazy_split8", "sdpa_flash", "flex"} <= set(impls)
    varlen = bench.suite_jobs(("varlen",))
    assert all({"fast_lazy", "fast_lazy_varlen", "sdpa_flash"} <= set(i) for _, _, i in varlen)
    # given implementations run where they apply
    mixed = bench.suite_jobs(("dense", "varlen"), ("fast_lazy", "fast_lazy_varlen", "fast_fp8_lazy",
                                                   "fast_lazy_split4"))
    for _, s, i in mixed:
        assert i == (("fast_lazy", "fast_lazy_varlen") if s.varlen
                     else ("fast_lazy", "fast_fp8_lazy", "fast_lazy_split4"))
    with pytest.raises(ValueError, match="unknown suites"):
        bench.suite_jobs(("dense", "sparse"))
    with pytest.raises(ValueError, match="unknown implementations"):
        bench.suite_jobs(("varlen",), ("fast_lazy", "mystery"))
    assert not bench.applies("fast_lazy_split2", bench.Shape(1, 256, 1, 64, False))  # Sq < 384


def test_format_table_prints_one_block_per_suite():
    t = _table()
    t["suite"] = "dense"
    extra = pd.DataFrame([
        {"suite": "splitk", "shape": "c", "impl": i, "tflops": tf, "ms": 1.0, "rel_l2": 1e-3,
         "config": None, "note": None}
        for i, tf in (("fast_lazy", 100.0), ("fast_lazy_split4", 400.0), ("sdpa_flash", 200.0))])
    text = bench.format_table(pd.concat([t, extra], ignore_index=True))
    for suite in ("dense", "splitk"):
        assert f"TFLOP/s (median of do_bench): {suite}" in text
    splitk = text.split(": splitk")[1].split("max rel-L2")[0]
    assert "fast_lazy_split4" in splitk and "0.250" in splitk  # 100 / 400
    assert "sdpa_cudnn" not in splitk  # only the suite's own columns


class _Interpreted:
    """A fast kernel module whose forward functions run on the CPU interpreter."""

    def __init__(self, name):
        import importlib
        self.mod = importlib.import_module(f"fa_lab.kernels.{name}")

    def forward(self, *a, **kw):
        return self.mod.forward(*a, interpret=True, **kw)

    def forward_varlen(self, *a, **kw):
        return self.mod.forward_varlen(*a, interpret=True, **kw)

    def __getattr__(self, name):  # best_config, tuning_timings, ...
        return getattr(self.mod, name)


def test_split_k_runners_on_the_interpreter(monkeypatch):
    monkeypatch.setattr(bench, "_fast_module", _Interpreted)
    shape = bench.Shape(1, 384, 2, 64, False, Skv=900)
    inp = bench._inputs(shape, "cpu", 0)
    assert inp.q.shape == (1, 384, 2, 64) and inp.k.shape == (1, 900, 2, 64)
    dense = bench._runner("fast_lazy", shape, inp)()
    split = bench._runner("fast_lazy_split2", shape, inp)()
    use, sdpa = bench._sdpa("sdpa_flash")
    assert bench._rel_l2(split, dense) < 1e-2
    with use():
        ref = sdpa(*(x.transpose(1, 2) for x in (inp.q, inp.k, inp.v))).transpose(1, 2)
    assert bench._rel_l2(split, ref) < 1e-2


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_runners_on_the_interpreter(monkeypatch, causal):
    """The packed kernel and the per-sequence loop see the same sequences: bit for bit the
    same output; SDPA once per sequence agrees to bf16 rounding."""
    monkeypatch.setattr(bench, "_fast_module", _Interpreted)
    shape = bench.varlen_shape((100, 37, 250), 2, 64, causal)
    inp = bench._inputs(shape, "cpu", 0)
    assert inp.q.shape == (387, 2, 64) and inp.cu.tolist() == [0, 100, 137, 387]
    loop = bench._runner("fast_lazy", shape, inp)()
    assert isinstance(loop, list) and [o.shape[0] for o in loop] == [100, 37, 250]
    packed = bench._runner("fast_lazy_varlen", shape, inp)()
    assert torch.equal(bench._packed(loop), packed)
    ref = bench._packed(bench._runner("sdpa_flash", shape, inp)())
    assert ref.shape == packed.shape and bench._rel_l2(packed, ref) < 1e-2
    with pytest.raises(bench.Unavailable, match="packed"):
        bench._runner("fast_fp8_lazy", shape, inp)


def test_cli_bench_checks_suites_before_any_work():
    with pytest.raises(SystemExit, match="unknown suites"):
        cli.main(["bench", "--suite", "dense,sparse", "--no-save"])
    with pytest.raises(SystemExit, match="--shapes takes indices 0..1 into the shapes of --suite"):
        cli.main(["bench", "--suite", "splitk", "--shapes", "2", "--no-save"])


def test_run_times_split_k_and_varlen_beside_dense_end_to_end(monkeypatch, tmp_path):
    """``run`` over a split-K and a varlen job with the kernels on the interpreter (and a
    fake clock): one row per (shape, impl), rel-L2 against SDPA, the FLOP count behind the
    TFLOP/s, a JSON file with the dense rows' columns, and the printed table."""
    import json

    monkeypatch.setattr(bench, "_fast_module", _Interpreted)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bench, "_time_ms", lambda fn, warmup, rep: 2.0)
    inputs = bench._inputs
    monkeypatch.setattr(bench, "_inputs",
                        lambda shape, device, seed, fp8=False: inputs(shape, "cpu", seed, fp8))
    split = bench.Shape(1, 384, 2, 64, False, Skv=900)
    packed = bench.varlen_shape((100, 37, 250), 2, 64, True)
    jobs = [("splitk", split, ("fast_lazy", "fast_lazy_split2", "sdpa_flash")),
            ("varlen", packed, ("fast_lazy", "fast_lazy_varlen", "sdpa_flash"))]
    saved = []
    table = bench.run(jobs=jobs, progress=False, on_shape=saved.append)
    assert len(saved) == 2 and len(table) == 6
    assert list(table["impl"]) == ["fast_lazy", "fast_lazy_split2", "sdpa_flash",
                                   "fast_lazy", "fast_lazy_varlen", "sdpa_flash"]
    assert table["note"].isna().all(), table["note"].tolist()
    fast = table[table["impl"] != "sdpa_flash"]
    assert (fast["rel_l2"] < 1e-2).all()
    assert (table["tflops"] == table["flops"] / 2e-3 / 1e12).all()
    assert list(table["suite"]) == ["splitk"] * 3 + ["varlen"] * 3
    assert table.loc[0, "Skv"] == 900 and table.loc[3, "lengths"] == [100, 37, 250]
    path = bench.save(table, "bench_features", directory=tmp_path, device="cpu")
    rows = json.loads(path.read_text())["rows"]
    assert {"impl", "shape", "tflops", "ms", "rel_l2", "B", "S", "H", "D", "causal"} <= set(rows[0])
    text = bench.format_table(table)
    assert "fast_lazy_split2" in text and "fast_lazy_varlen" in text
