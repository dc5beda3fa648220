"""fa_lab.studies.bench: the FLOP count, the table it prints, its figure and its guards; the
interleaved rounds, their statistics and the fp32 reference, on the CPU (with callables
whose time a test controls, through the harness's own CPU timer); the CUDA timer on a GPU."""

import importlib.util
import json
import math
import time

import pandas as pd
import pytest
import torch

from fa_lab import cli, timing
from fa_lab.studies import bench

from _shared import CappedClock, VirtualTime


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


# The bench runs on GPU machines without the lab's extras (make test-triton-floor's venv is
# one): only its figure needs plotly, imported on use.
@pytest.mark.skipif(importlib.util.find_spec("plotly") is None, reason="the figure needs plotly")
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
            bench.run(device="cuda")
    with pytest.raises(ValueError, match="CUDA device or the CPU"):
        bench.run(device="meta")
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        bench.run(device="cpu", rounds=0)
    with pytest.raises(TypeError, match="min_calls must be an int"):
        bench.run(device="cpu", min_calls=2.5)
    with pytest.raises(ValueError, match="rep must be >= 0"):
        bench.run(device="cpu", rep=-1)
    with pytest.raises(TypeError, match="paired must be a bool"):
        bench.run(device="cpu", paired="yes")


def test_cli_bench_rejects_bad_shape_indices():
    with pytest.raises(SystemExit, match="--shapes takes indices"):
        cli.main(["bench", "--shapes", str(len(bench.SHAPES)), "--no-save"])


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
        assert f"TFLOP/s: {suite}" in text  # a table without rounds (an older result)
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

    @property
    def TransposedV(self):  # its V^T copy interpreted too
        import types
        return types.SimpleNamespace(
            from_v=lambda v8: self.mod.TransposedV.from_v(v8, interpret=True))

    def __getattr__(self, name):  # best_config, tuning_timings, ...
        return getattr(self.mod, name)


@pytest.mark.slow
def test_split_k_runners_on_the_interpreter(monkeypatch):
    monkeypatch.setattr(bench.impls, "_fast_module", _Interpreted)
    shape = bench.Shape(1, 384, 2, 64, False, Skv=900)
    inp = bench.impls._inputs(shape, "cpu", 0)
    assert inp.q.shape == (1, 384, 2, 64) and inp.k.shape == (1, 900, 2, 64)
    dense = bench.impls._runner("fast_lazy", shape, inp)()
    split = bench.impls._runner("fast_lazy_split2", shape, inp)()
    use, sdpa = bench.impls._sdpa("sdpa_flash")
    assert bench.impls._rel_l2(split, dense) < 1e-2
    with use():
        ref = sdpa(*(x.transpose(1, 2) for x in (inp.q, inp.k, inp.v))).transpose(1, 2)
    assert bench.impls._rel_l2(split, ref) < 1e-2


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_runners_on_the_interpreter(monkeypatch, causal):
    """The packed kernel and the per-sequence loop see the same sequences: bit for bit the
    same output; SDPA once per sequence agrees to bf16 rounding."""
    monkeypatch.setattr(bench.impls, "_fast_module", _Interpreted)
    shape = bench.varlen_shape((100, 37, 250), 2, 64, causal)
    inp = bench.impls._inputs(shape, "cpu", 0)
    assert inp.q.shape == (387, 2, 64) and inp.cu.tolist() == [0, 100, 137, 387]
    loop = bench.impls._runner("fast_lazy", shape, inp)()
    assert isinstance(loop, list) and [o.shape[0] for o in loop] == [100, 37, 250]
    packed = bench.impls._runner("fast_lazy_varlen", shape, inp)()
    assert torch.equal(bench.impls._packed(loop), packed)
    ref = bench.impls._packed(bench.impls._runner("sdpa_flash", shape, inp)())
    assert ref.shape == packed.shape and bench.impls._rel_l2(packed, ref) < 1e-2
    with pytest.raises(bench.Unavailable, match="packed"):
        bench.impls._runner("fast_fp8_lazy", shape, inp)


def test_cli_bench_checks_suites_before_any_work():
    with pytest.raises(SystemExit, match="unknown suites"):
        cli.main(["bench", "--suite", "dense,sparse", "--no-save"])
    with pytest.raises(SystemExit, match="--shapes takes indices 0..1 into the shapes of --suite"):
        cli.main(["bench", "--suite", "splitk", "--shapes", "2", "--no-save"])


@pytest.mark.slow
def test_run_times_split_k_and_varlen_beside_dense_end_to_end(monkeypatch, tmp_path):
    """``run`` on the CPU over a split-K and a varlen job with the kernels on the
    interpreter: one row per (shape, impl), rel-L2 against fp32 attention, the FLOP count
    behind the TFLOP/s, a JSON file with the dense rows' columns, and the printed table."""
    monkeypatch.setattr(bench.impls, "_fast_module", _Interpreted)
    # small shapes: the runners' own tests above check the kernels at larger ones; Skv 300
    # still splits in two and ends in a ragged key block
    split = bench.Shape(1, 128, 2, 64, False, Skv=300)
    packed = bench.varlen_shape((70, 37, 130), 2, 64, True)
    jobs = [("splitk", split, ("fast_lazy", "fast_lazy_split2", "sdpa_flash")),
            ("varlen", packed, ("fast_lazy", "fast_lazy_varlen", "sdpa_flash"))]
    saved = []
    table = bench.run(jobs=jobs, device="cpu", rounds=1, min_calls=1, rep=0, warmup=0,
                      progress=False, on_shape=saved.append)
    assert len(saved) == 2 and len(table) == 6
    assert list(table["impl"]) == ["fast_lazy", "fast_lazy_split2", "sdpa_flash",
                                   "fast_lazy", "fast_lazy_varlen", "sdpa_flash"]
    assert table["note"].isna().all(), table["note"].tolist()
    assert (table["rel_l2"] < 1e-2).all()  # every row, SDPA's too, against fp32
    assert (table["tflops"] == table["flops"] / (table["ms"] * 1e-3) / 1e12).all()
    assert (table["rounds"] == 1).all() and (table["ms"] > 0).all()
    assert list(table["suite"]) == ["splitk"] * 3 + ["varlen"] * 3
    assert table.loc[0, "Skv"] == 300 and table.loc[3, "lengths"] == [70, 37, 130]
    path = bench.save(table, "bench_features", directory=tmp_path, device="cpu")
    rows = json.loads(path.read_text())["rows"]
    assert {"impl", "shape", "tflops", "ms", "rel_l2", "B", "S", "H", "D", "causal"} <= set(rows[0])
    text = bench.format_table(table)
    assert "fast_lazy_split2" in text and "fast_lazy_varlen" in text


# ---- interleaved rounds: scheduling and statistics, with callables whose time is known ---------

A_MS = [2.0, 4.0, 3.0, 5.0, 1.0]  # median 3, min 1, max 5
B_MS = [4.0, 4.0, 6.0, 10.0, 3.0]  # median 4, min 3, max 10
C_MS = [8.0, 8.0, 8.0, 8.0, 8.0]


def test_round_orders_rotate_and_spread_their_starting_points():
    impls = ["a", "b", "c", "d", "e", "f", "g", "h", "i"]
    orders = bench.round_orders(impls, 5)
    assert [o[0] for o in orders] == ["a", "b", "d", "f", "h"]  # offsets r * 9 // 5
    for o in orders:  # each a rotation of the list: every implementation once
        k = impls.index(o[0])
        assert o == impls[k:] + impls[:k]
    assert bench.round_orders(["a", "b"], 4) == [["a", "b"], ["b", "a"], ["a", "b"], ["b", "a"]]
    assert bench.round_orders(["a", "b", "c"], 1) == [["a", "b", "c"]]
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        bench.round_orders(impls, 0)


def test_time_rounds_times_each_implementation_once_per_round_in_rotated_order():
    vt = VirtualTime(calls_per_round=3)
    fns = {"a": vt.kernel("a", A_MS), "b": vt.kernel("b", B_MS), "c": vt.kernel("c", C_MS)}
    steps = []
    res = bench.time_rounds(fns, rounds=5, min_calls=3, min_ms=0, warmup_ms=0,
                            timer=timing.CpuTimer(now=vt.now), on_step=lambda r, i: steps.append((r, i)))
    assert res.errors == {}
    assert res.orders == bench.round_orders(["a", "b", "c"], 5)
    # the calls ran in that order: the warm-up call of each, then per round each
    # implementation's 3 calls together
    assert vt.log[:3] == ["a", "b", "c"]
    rounds_log = [vt.log[3 + 9 * r: 3 + 9 * (r + 1)] for r in range(5)]
    assert rounds_log == [[i for i in order for _ in range(3)] for order in res.orders]
    assert steps == [(-1, "a"), (-1, "b"), (-1, "c")] + [(r, i) for r, o in enumerate(res.orders) for i in o]
    # each round's value is the median of its calls: the +50 ms outlier is dropped
    assert res.ms == {"a": pytest.approx(A_MS), "b": pytest.approx(B_MS), "c": pytest.approx(C_MS)}
    assert res.calls == {i: [3] * 5 for i in fns}
    assert len(res.spans) == 5 and all(t1 >= t0 for t0, t1 in res.spans)


def test_spread_and_per_round_ratios_match_hand_computed_values():
    assert bench.spread(A_MS) == {"median": 3.0, "min": 1.0, "max": 5.0, "n": 5}
    assert bench.spread([4.0, None, 2.0, 3.0]) == {"median": 3.0, "min": 2.0, "max": 4.0, "n": 3}
    assert bench.spread([2.0, 4.0]) == {"median": 3.0, "min": 2.0, "max": 4.0, "n": 2}
    assert bench.spread([None]) == {"median": None, "min": None, "max": None, "n": 0}
    ms = {"a": A_MS, "b": B_MS, "c": [8.0, None, 8.0, 8.0, 8.0]}
    assert bench.ratio_rounds(ms, "a", "b") == pytest.approx([2.0, 1.0, 2.0, 2.0, 3.0])
    assert bench.ratio_rounds(ms, "b", "a") == pytest.approx([0.5, 1.0, 0.5, 0.5, 1 / 3])
    assert bench.ratio_rounds(ms, "a", "c")[1] is None
    # the median of per-round ratios is not the ratio of medians (4 / 3 here)
    assert bench.spread(bench.ratio_rounds(ms, "a", "b"))["median"] == 2.0
    api = bench.ratio_pairs(["api_lazy", "fast_lazy", "sdpa_cudnn"])
    assert api[:2] == [("api_lazy", "fast_lazy"), ("api_lazy", "sdpa_cudnn")]  # the headline
    pairs = bench.ratio_pairs(["fast_lazy", "fast_eager", "fast_fp8_lazy", "sdpa_cudnn", "flex"])
    assert pairs[:4] == [("fast_lazy", "fast_eager"), ("fast_lazy", "fast_fp8_lazy"),
                         ("fast_lazy", "sdpa_cudnn"), ("fast_lazy", "flex")]
    assert ("fast_fp8_lazy", "sdpa_cudnn") in pairs and ("fast_fp8_lazy", "fast_lazy") in pairs
    assert ("fast_fp8_lazy", "fast_fp8_eager") not in pairs  # fp8 eager absent
    assert bench.ratio_pairs(["sdpa_flash", "flex"]) == []
    # every pair timed call-alternated also has its ratio over turns (notebook 04 sets the
    # two side by side)
    assert set(bench.PAIRED_RATIOS) <= set(bench.ratio_pairs(bench.ALL_IMPLS))


def test_host_time_is_the_median_wall_time_of_one_call():
    ticks = iter(range(100))
    timer = timing.CpuTimer(now=lambda: next(ticks) * 1e-3)  # each reading 1 ms later
    calls = []
    assert bench.host_time(lambda: calls.append(1), timer, probes=5) == 1.0 and len(calls) == 5
    assert 3.0 <= bench.host_time(lambda: time.sleep(0.003), timing.CpuTimer(), probes=3) < 50


def test_time_rounds_on_the_real_clock_with_sleeping_callables():
    """The harness's CPU timer (time.perf_counter) on callables that sleep 4 and 16 ms:
    the medians come out near those (a sleep never ends early) and the per-round ratio
    near 4."""
    fns = {"short": lambda: time.sleep(0.004), "long": lambda: time.sleep(0.016)}
    res = bench.time_rounds(fns, rounds=3, min_calls=2, min_ms=0, warmup_ms=0)
    assert res.orders == [["short", "long"], ["long", "short"], ["short", "long"]]
    short, long = bench.spread(res.ms["short"]), bench.spread(res.ms["long"])
    assert 4.0 <= short["min"] and short["median"] < 12.0
    assert 16.0 <= long["min"] and long["median"] < 30.0
    ratio = bench.spread(bench.ratio_rounds(res.ms, "short", "long"))
    assert 2.0 < ratio["median"] < 4.2 and res.calls["short"] == [2, 2, 2]


def test_time_rounds_keeps_going_when_one_implementation_fails():
    vt = VirtualTime(calls_per_round=1)
    ok = vt.kernel("ok", [1.0] * 4)
    flaky = vt.failing(3, "CUDA out of memory\nmore text")
    res = bench.time_rounds({"ok": ok, "flaky": flaky}, rounds=4, min_calls=1, min_ms=0,
                            warmup_ms=0, timer=timing.CpuTimer(now=vt.now))
    # flaky: call 1 is the warm-up, 2 its first round; it fails in its second round
    assert res.errors == {"flaky": "round 2: RuntimeError: CUDA out of memory"}
    assert res.ms["flaky"] == [pytest.approx(1.0), None, None, None]
    assert res.ms["ok"] == pytest.approx([1.0] * 4)
    with pytest.raises(ValueError, match="min_calls"):
        bench.time_rounds({"ok": ok}, min_calls=0)


def test_call_alternated_pairs_see_the_same_clock_where_turns_do_not():
    """Two kernels of the same work under a clock that drops by 20 % during the round:
    timed in turns (``time_rounds``), the second one's turn runs after the drop and a
    reads 25 % faster than b; call-alternated (``time_paired``), both run before and after it alike
    and the ratio is 1."""
    clock = CappedClock(t_drop=0.015)
    fns = {"a": clock.kernel(1.0), "b": clock.kernel(1.0)}
    timer = timing.CpuTimer(now=clock.now)
    res = bench.time_rounds(fns, rounds=1, min_calls=10, min_ms=0, warmup_ms=0, timer=timer)
    assert bench.ratio_rounds(res.ms, "a", "b") == [pytest.approx(1.25)]
    clock.t, clock.t_drop = 0.0, 0.007  # the drop falls in the middle of the cycles
    out = bench.time_paired(fns, [("a", "b")], rounds=1, min_calls=10, min_ms=0, timer=timer)
    assert out == {("a", "b"): {"rounds": [pytest.approx(1.0)], "calls": [10], "error": None}}


def test_time_paired_refuses_bad_pairs_and_keeps_going_past_a_failure():
    vt = VirtualTime(calls_per_round=10**6, warm_calls=0)
    fns = {"a": vt.kernel("a", [1.0]), "b": vt.kernel("b", [2.0])}
    with pytest.raises(ValueError, match="not in fns"):
        bench.time_paired(fns, [("a", "c")])
    with pytest.raises(ValueError, match="two different"):
        bench.time_paired(fns, [("a", "a")])
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        bench.time_paired(fns, [("a", "b")], rounds=0)
    with pytest.raises(ValueError, match="min_calls"):
        bench.time_paired(fns, [("a", "b")], min_calls=0)
    assert vt.log == []  # refused before any call
    flaky = vt.failing(4, "CUDA out of memory")
    steps = []
    out = bench.time_paired({**fns, "flaky": flaky}, [("a", "b"), ("a", "flaky")], rounds=3,
                            min_calls=3, min_ms=0, timer=timing.CpuTimer(now=vt.now),
                            on_step=lambda r, p: steps.append((r, p)))
    assert out[("a", "b")]["rounds"] == [pytest.approx(2.0)] * 3
    assert out[("a", "flaky")]["rounds"] == [pytest.approx(1.0), None, None]
    assert out[("a", "flaky")]["error"] == "round 2: RuntimeError: CUDA out of memory"
    assert steps == [(r, p) for r in range(3) for p in (("a", "b"), ("a", "flaky"))]
    # a that takes no time gives no ratio: said, not a silent gap
    still = {"z": lambda: None, "b": fns["b"]}
    out = bench.time_paired(still, [("z", "b")], rounds=2, min_calls=2, min_ms=0,
                            timer=timing.CpuTimer(now=vt.now))
    assert out[("z", "b")] == {"rounds": [None, None], "calls": [2, None],
                               "error": "round 1: z took 0 ms, no ratio"}


def _stand_in_runner(vt, times):
    """bench.impls._runner's stand-in: each implementation of ``times`` ({impl: ms per round})
    advances the virtual clock by its round's ms and returns SDPA's output (``wrong``:
    that output plus one); others are unavailable."""
    def runner(impl, shape, inp):
        if impl not in times:
            raise bench.Unavailable(f"{impl} is not in this test")
        qt, kt, vt_ = (x.transpose(1, 2).float() for x in (inp.q, inp.k, inp.v))
        out = torch.nn.functional.scaled_dot_product_attention(
            qt, kt, vt_, is_causal=shape.causal).transpose(1, 2).to(inp.q.dtype)
        return vt.kernel(impl, times[impl], out + 1 if impl == "fast_eager" else out)
    return runner


def test_run_on_the_cpu_gives_medians_spreads_ratios_and_saves_them(monkeypatch, tmp_path):
    """``run`` end to end on the CPU, its kernels replaced by callables of known time:
    the medians, min / max, per-round values and per-round ratios of the table and of
    the saved JSON match the hand-computed ones; the rounds' orders rotate; every row has
    its rel-L2 against fp32 attention."""
    vt = VirtualTime(calls_per_round=3, warm_calls=2)  # run's first call, then the warm-up
    times = {"fast_lazy": A_MS, "fast_eager": B_MS, "sdpa_cudnn": C_MS}
    monkeypatch.setattr(bench.harness, "_runner", _stand_in_runner(vt, times))
    shape = bench.Shape(1, 64, 2, 32, True)
    impls = ("fast_lazy", "fast_eager", "sdpa_cudnn", "flex")
    tuning = []
    table = bench.run(jobs=[("dense", shape, impls)], device="cpu", rounds=5, min_calls=3, rep=0,
                      warmup=0, progress=False, timer=timing.CpuTimer(now=vt.now), tuning=tuning)
    t = table.set_index("impl")
    assert list(table["impl"]) == list(impls)
    lazy = t.loc["fast_lazy"]
    assert (lazy.ms, lazy.ms_min, lazy.ms_max, lazy.rounds) == (pytest.approx(3.0), pytest.approx(1.0),
                                                                pytest.approx(5.0), 5)
    assert lazy.ms_rounds == pytest.approx(A_MS) and lazy.calls_rounds == [3] * 5
    f = shape.flops()
    assert lazy.tflops == pytest.approx(f / 3e-3 / 1e12)
    assert (lazy.tflops_min, lazy.tflops_max) == (pytest.approx(f / 5e-3 / 1e12), pytest.approx(f / 1e-3 / 1e12))
    assert lazy.tflops_rounds == pytest.approx([f / (m * 1e-3) / 1e12 for m in A_MS])
    assert lazy.spread_pct == pytest.approx(100 * (5 - 1) / 3)
    assert t.loc["fast_eager"].ms == pytest.approx(4.0) and t.loc["sdpa_cudnn"].ms == pytest.approx(8.0)
    assert pd.isna(t.loc["flex"].ms) and "not in this test" in t.loc["flex"].note
    # correctness beside speed: against fp32 attention
    assert lazy.rel_l2 < 1e-2 and t.loc["fast_eager"].rel_l2 > 0.5
    # per-round ratios
    rat = bench.ratio_table(table).set_index("ratio")
    assert list(rat.index) == ["fast_lazy / fast_eager", "fast_lazy / sdpa_cudnn", "fast_eager / sdpa_cudnn"]
    le = rat.loc["fast_lazy / fast_eager"]
    assert le["rounds"] == pytest.approx([2.0, 1.0, 2.0, 2.0, 3.0])
    assert (le["median"], le["min"], le["max"], le["n"]) == (pytest.approx(2.0), pytest.approx(1.0),
                                                             pytest.approx(3.0), 5)
    assert rat.loc["fast_lazy / sdpa_cudnn", "rounds"] == pytest.approx([4.0, 2.0, 8 / 3, 1.6, 8.0])
    assert rat.loc["fast_lazy / sdpa_cudnn", "median"] == pytest.approx(8 / 3)
    # per shape: the rounds' orders, clocks (none on the CPU), the reference's heads
    info, = table.attrs["shapes"]
    assert info["orders"] == bench.round_orders(["fast_lazy", "fast_eager", "sdpa_cudnn"], 5)
    assert info["clocks"]["start"]["source"] is None and info["clocks"]["rounds_sm_mhz"] is None
    assert info["reference_heads"] == [0, 1] and len(info["round_seconds"]) == 5
    assert table.attrs["timing"]["timer"] == timing.CpuTimer.name
    text = bench.format_table(table)
    assert "fast_lazy / fast_eager" in text and "2.000  [1.000 .. 3.000]" in text
    assert "TFLOP/s (median over 5 interleaved rounds): dense" in text
    assert "max rel-L2 vs fp32 attention" in text
    # the saved JSON holds it all
    path = bench.save(table, "bench_rounds", directory=tmp_path, device="cpu",
                      params={"rounds": 5}, tuning=tuning)
    obj = json.loads(path.read_text())
    assert {"provenance", "params", "timing", "shapes", "ratios", "autotune_timings", "rows"} <= set(obj)
    row = next(r for r in obj["rows"] if r["impl"] == "fast_lazy")
    assert row["ms_rounds"] == pytest.approx(A_MS) and row["ms_min"] == pytest.approx(1.0)
    assert next(r for r in obj["rows"] if r["impl"] == "flex")["ms"] is None  # NaN -> null
    assert obj["shapes"][0]["orders"] == info["orders"]
    assert obj["ratios"][0]["ratio"] == "fast_lazy / fast_eager" and obj["ratios"][0]["median"] == 2.0
    assert bench.ratio_table(obj).shape[0] == 3
    # the call-alternated pair (both at their last round's time: 1 and 3 ms)
    pr, = obj["paired_ratios"]
    assert (pr["ratio"], pr["rounds"], pr["calls"], pr["error"]) == (
        "fast_lazy / fast_eager", pytest.approx([3.0] * 5), [3] * 5, None)
    assert "call-alternated" in text and "3.000  [3.000 .. 3.000]" in text


# ---- the fp32 reference ------------------------------------------------------------------------

def test_reference_heads_subsample_only_the_largest_shapes():
    dense = {s.name: bench.reference_heads(s) for s in bench.SHAPES}
    assert dense["B2 S8192 H32 D128"] == list(range(32))
    assert dense["B1 S61380 H32 D128 causal"] == [0, 10, 21, 31]  # 2**34 // 61380**2 = 4
    assert all(len(h) == 32 for n, h in dense.items() if "S61380" not in n and "H16" not in n)
    s = bench.Shape(1, 4096, 8, 64, False)
    assert bench.reference_heads(s, budget=4096 * 4096) == [0]
    assert bench.reference_heads(s, budget=3 * 4096 * 4096) == [0, 4, 7]


@pytest.mark.parametrize("shape", [bench.Shape(2, 70, 8, 32, True, Hkv=2),
                                   bench.varlen_shape((40, 23), 4, 32, False)])
def test_reference_on_a_subsample_of_heads_matches_the_whole(shape):
    from fa_lab import reference

    inp = bench.impls._inputs(shape, "cpu", 0)
    heads = [1, 3]
    sub = bench.impls._reference(shape, inp, heads)
    if shape.varlen:
        whole = torch.cat([reference.attention(inp.q[None, a:b], inp.k[None, a:b], inp.v[None, a:b],
                                               causal=shape.causal)[0][0] for a, b in inp.spans(shape)])
    else:
        whole = reference.attention(inp.q, inp.k, inp.v, causal=shape.causal)[0]
    torch.testing.assert_close(sub, whole[..., heads, :], rtol=1e-5, atol=1e-6)
    assert bench.impls._rel_l2(whole.to(torch.bfloat16), sub, heads) < 1e-2


def test_gqa_shape_runs_sdpa_and_flex_runners_correctly():
    shape = bench.Shape(1, 96, 4, 32, True, Hkv=2)
    assert shape.name == "B1 S96 H4 Hkv2 D32 causal" and shape.heads_kv == 2
    inp = bench.impls._inputs(shape, "cpu", 0)
    assert inp.q.shape == (1, 96, 4, 32) and inp.k.shape == (1, 96, 2, 32)
    ref = bench.impls._reference(shape, inp, [0, 1, 2, 3])
    out = bench.impls._runner("sdpa_flash", shape, inp)()
    assert out.shape == inp.q.shape and bench.impls._rel_l2(out, ref, [0, 1, 2, 3]) < 1e-2
    with pytest.raises(ValueError, match="must divide"):
        bench.Shape(1, 8, 4, 32, False, Hkv=3)


def test_fp8_rows_get_a_dequantised_reference():
    shape = bench.Shape(1, 64, 2, 128, False)
    inp = bench.impls._inputs(shape, "cpu", 0, fp8=True)
    full = bench.impls._reference(shape, inp, [0, 1])
    deq = bench.impls._reference(shape, inp, [0, 1], fp8=True)
    assert deq.shape == full.shape and 1e-4 < bench.impls._rel_l2(deq, full) < 0.1  # the quantisation


@pytest.mark.slow
def test_run_checks_the_fast_kernels_against_fp32_on_the_interpreter(monkeypatch):
    """The real runners of the fast bf16 and fp8 kernels (Triton's CPU interpreter) at a
    GQA shape, in 2 rounds: bf16 rows close to fp32 attention, the fp8 row closer to the
    fp32 attention of its own quantised inputs than to that of the bf16 ones; fp8 with V
    stored transposed gives the fp8 row's output, and is timed alternated with it. The API
    rows (``flash_attn_func(..., backend="fast")``) run the same kernels: the same outputs,
    and each row carries its host time per call."""
    monkeypatch.setattr(bench.impls, "_fast_module", _Interpreted)
    shape = bench.Shape(1, 128, 2, 128, True, Hkv=1)
    impls = ("api_lazy", "api_fp8_lazy", "fast_lazy", "fast_eager", "fast_fp8_lazy",
             "fast_fp8_lazy_vt", "sdpa_flash")
    table = bench.run(jobs=[("dense", shape, impls)],
                      device="cpu", rounds=2, min_calls=1, rep=0, warmup=0, progress=False)
    t = table.set_index("impl")
    assert t["note"].isna().all(), t["note"].tolist()
    assert (t["rounds"] == 2).all()
    assert (t.loc[["fast_lazy", "fast_eager", "sdpa_flash"], "rel_l2"] < 1e-2).all()
    fp8 = t.loc["fast_fp8_lazy"]
    assert fp8.rel_l2_dequant < fp8.rel_l2 < 0.1
    vt = t.loc["fast_fp8_lazy_vt"]
    assert (vt.rel_l2, vt.rel_l2_dequant, vt.dtype) == (fp8.rel_l2, fp8.rel_l2_dequant, fp8.dtype)
    api, api8 = t.loc["api_lazy"], t.loc["api_fp8_lazy"]
    assert api.rel_l2 == t.loc["fast_lazy", "rel_l2"] and api.config == t.loc["fast_lazy", "config"]
    assert (api8.rel_l2, api8.rel_l2_dequant, api8.dtype) == (fp8.rel_l2, fp8.rel_l2_dequant, fp8.dtype)
    assert (t["host_ms"] > 0).all()
    assert {q["ratio"] for q in table.attrs["ratios"]} >= {"fast_lazy / fast_eager",
                                                          "fast_fp8_lazy / fast_lazy",
                                                          "fast_fp8_lazy_vt / fast_lazy"}
    assert {q["ratio"] for q in table.attrs["ratios"]} >= {"api_lazy / fast_lazy",
                                                          "api_fp8_lazy / fast_fp8_lazy",
                                                          "api_fp8_lazy / api_lazy"}
    assert {q["ratio"] for q in table.attrs["paired_ratios"]} == {
        "api_lazy / fast_lazy", "api_fp8_lazy / fast_fp8_lazy", "fast_lazy / fast_eager",
        "fast_fp8_lazy_vt / fast_fp8_lazy"}


def test_dense_suite_holds_the_issues_shapes():
    names = [s.name for s in bench.SHAPES]
    assert names == ["B2 S8192 H32 D128", "B2 S8192 H32 D128 causal", "B4 S4096 H32 Hkv8 D128 causal",
                     "B4 S4096 H32 D64", "B16 S1024 H16 D128 causal", "B32 S512 H32 D128 causal",
                     "B1 S16384 H32 D128", "B1 S61380 H32 D128 causal"]
    assert bench.IMPLS[:3] == ("api_lazy", "api_eager", "api_fp8_lazy")  # what users call


# ---- clocks ------------------------------------------------------------------------------------

def test_clock_readings_parse_and_name_their_reasons():
    assert bench.clock_reasons(0) == []
    assert bench.clock_reasons(0x4 | 0x40) == ["sw_power_cap", "hw_thermal_slowdown"]
    assert bench.clock_reasons(0x1000) == ["0x1000"] and bench.clock_reasons(None) is None
    r = bench.parse_smi("1755, 1980, 3201, 51, 612.35, 0x0000000000000004")
    assert r == {"source": "nvidia-smi", "sm_mhz": 1755, "max_sm_mhz": 1980, "mem_mhz": 3201,
                 "temp_c": 51, "power_w": 612.35, "reasons": ["sw_power_cap"]}
    r = bench.parse_smi("345, 1980, 3201, [N/A], [N/A]")
    assert r["temp_c"] is None and r["power_w"] is None and r["reasons"] is None
    assert bench.gpu_clocks("cpu")["source"] is None
    s = bench.ClockSampler("cpu")
    with s:
        pass
    assert not s.active and s.summary(0, 1) is None


# ---- the CLI -------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,flag", [
    (["bench", "--rounds", "0"], "--rounds"), (["bench", "--rounds", "x"], "--rounds"),
    (["bench", "--rounds", "-5"], "--rounds"), (["bench", "--min-calls", "0"], "--min-calls"),
    (["bench", "--rep", "-1"], "--rep"), (["bench", "--warmup", "1.5"], "--warmup"),
    (["bench", "--device", "tpu"], "--device"),
])
def test_cli_bench_refuses_bad_round_arguments(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and err.count("\n") == 1


def test_cli_bench_sweep_needs_a_gpu_device(capsys, monkeypatch):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--sweep", "--device", "cpu", "--no-save"])
    assert e.value.code == 2
    assert "--sweep times pinned GPU launch configs" in capsys.readouterr().err


def test_cli_bench_runs_rounds_on_the_cpu_and_saves_them(monkeypatch, tmp_path, capsys):
    """``fa-lab bench --device cpu`` end to end on a one-shape suite of SDPA's CPU kernel
    (cuDNN has none on the CPU: a note), 2 rounds: the printed blocks and the JSON."""
    shape = bench.Shape(1, 128, 2, 64, True)
    monkeypatch.setitem(bench.SUITES, "dense", ((shape,), ("sdpa_flash", "sdpa_cudnn")))
    assert cli.main(["bench", "--device", "cpu", "--rounds", "2", "--min-calls", "2", "--rep", "1",
                     "--warmup", "0", "--out-dir", str(tmp_path), "--name", "cpu_bench"]) == 0
    out, err = capsys.readouterr()
    assert "2 round(s), as asked" in err and "perf_counter" in err
    assert "== dense · B1 S128 H2 D64 causal · 2 rounds" in out
    assert "note: sdpa_cudnn @ B1 S128 H2 D64 causal" in out
    obj = json.loads((tmp_path / "cpu_bench.json").read_text())
    assert obj["params"]["rounds"] == 2 and obj["params"]["device"] == "cpu"
    assert obj["params"]["completed_shapes"] == [shape.name]
    flash = next(r for r in obj["rows"] if r["impl"] == "sdpa_flash")
    assert len(flash["ms_rounds"]) == 2 and all(c >= 2 for c in flash["calls_rounds"])
    assert flash["rel_l2"] < 1e-2
    assert obj["shapes"][0]["orders"] == [["sdpa_flash"], ["sdpa_flash"]]
    assert obj["timing"]["timer"] == timing.CpuTimer.name


# ---- on a GPU ------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.gpu_alone
def test_cuda_timer_measures_gpu_time_in_proportion():
    """Spin kernels of 1e6 and 4e6 cycles: the CUDA timer's medians stand at 1 : 4 (within
    10 %), however slow the host; the clocks have a source."""
    timer = timing.CudaTimer("cuda")
    fns = {"one": lambda: torch.cuda._sleep(1_000_000), "four": lambda: torch.cuda._sleep(4_000_000)}
    res = bench.time_rounds(fns, rounds=3, min_calls=5, min_ms=5, warmup_ms=5, timer=timer)
    ratio = bench.spread(bench.ratio_rounds(res.ms, "one", "four"))
    assert 3.6 < ratio["median"] < 4.4, res.ms
    assert bench.gpu_clocks("cuda")["source"] is not None


@pytest.mark.gpu
def test_run_on_a_gpu_times_rounds_and_reads_clocks():
    shape = bench.Shape(1, 1024, 4, 64, True)
    table = bench.run(jobs=[("dense", shape, ("fast_lazy", "fast_eager", "sdpa_flash"))], rounds=2,
                      min_calls=3, rep=5, warmup=5, progress=False)
    assert table["note"].isna().all(), table["note"].tolist()
    assert (table["rounds"] == 2).all() and (table["rel_l2"] < 1e-2).all()
    info, = table.attrs["shapes"]
    assert info["clocks"]["start"]["source"] is not None
    assert set(info["autotune"]) == {"fast_lazy", "fast_eager"}
    pr, = table.attrs["paired_ratios"]
    assert pr["ratio"] == "fast_lazy / fast_eager" and pr["n"] == 2 and pr["error"] is None
