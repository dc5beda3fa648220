"""kernels/_triton/tuner.py: ranking candidate launches in alternated rounds, on the CPU
(stand-in launches on a clock the test controls; the fast bf16 kernel's real launches
through Triton's interpreter). The GPU side (CUDA timer, compiled launches) runs in the
fast kernels' GPU tests, which tune."""

import pytest
import torch
from triton.runtime.errors import OutOfResources

from _shared import CappedClock
from fa_lab import policies, timing
from fa_lab.kernels._triton import fast as common_fast
from fa_lab.kernels._triton import tuner
from fa_lab.kernels._triton.fast import Config
from fa_lab.kernels.swp_bf16 import fast as fast_bf16
from fa_lab.kernels.swp_fp8 import fast as fast_fp8

A, B, C = Config(64, 64, 4, 1, False), Config(32, 32, 4, 1, True), Config(64, 128, 8, 2, True)


def test_the_pick_is_the_lowest_median_over_rounds_and_every_round_is_recorded():
    """A config that wins one round by a clock's luck and loses the others is not the
    pick: the median over rounds ranks. A tie goes to the first listed."""
    rounds = [[1.0, 1.2, 1.2], [1.1, 1.1, 1.1], [1.3, 1.0, 1.3]]
    best, records = tuner.pick_fastest([A, B, C], rounds)
    assert best == B
    assert records == [{"config": x.describe(), "ms": m, "ms_rounds": r}
                       for x, m, r in zip((A, B, C), (1.2, 1.1, 1.3), rounds)]
    assert tuner.pick_fastest([A, B], [[2.0, 1.0, 3.0], [1.0, 2.0, 3.0]])[0] == A
    assert tuner.pick_fastest([A], [[1.0]], lazy=False)[1][0]["config"] == A.describe(False)
    with pytest.raises(ValueError):  # a config without its rounds
        tuner.pick_fastest([A, B], [[1.0]])


def test_rank_calls_each_candidate_once_then_alternates_and_keeps_the_unrunnable_on_record():
    """Each candidate's first call comes before any timing; one that cannot run here
    (``OutOfResources``) is not timed, a warning names it and its record (in its place)
    holds the error; the others alternate, one call of each per cycle, and are ranked."""
    clock = CappedClock(t_drop=0.050)
    log = []

    def launch(name, work):
        def fn():
            log.append(name)
            clock.kernel(work)()
        return fn

    def too_big():
        log.append("B")
        raise OutOfResources(300000, 232448, "shared memory")

    with pytest.warns(RuntimeWarning, match=r"BM32 BN32 w4 s1 tma rowsum cannot run here"):
        best, records = tuner.rank([A, B, C], [launch("A", 1.0), too_big, launch("C", 0.9)],
                                   timing.CpuTimer(now=clock.now))
    assert log[:3] == ["A", "B", "C"] and "B" not in log[3:]
    timed = log[3:]
    assert len(timed) % 2 == 0 and all({timed[i], timed[i + 1]} == {"A", "C"}
                                       for i in range(0, len(timed), 2))
    assert best == C
    assert [r["config"] for r in records] == [A.describe(), B.describe(), C.describe()]
    assert records[2]["ms"] / records[0]["ms"] == pytest.approx(0.9)
    assert all(len(records[i]["ms_rounds"]) == tuner.ROUNDS for i in (0, 2))
    assert records[1]["ms"] is None and records[1]["ms_rounds"] == []
    assert records[1]["error"].startswith("OutOfResources: out of resource: shared memory")


def test_rank_lets_a_bug_through_and_refuses_when_no_candidate_runs():
    """An error that is not "this GPU cannot run the tiling" propagates from the first
    calls; when every candidate cannot run, a RuntimeError names each, chained to the
    last one's error; launches that do not match the configs are refused before any."""
    calls = []

    def bug():
        calls.append("bug")
        raise NameError("name 'acc2' is not defined")
    with pytest.raises(NameError, match="acc2"):
        tuner.rank([A, B], [lambda: calls.append("A"), bug], timing.CpuTimer())
    assert calls == ["A", "bug"]

    def too_big(n):
        def fn():
            raise OutOfResources(n, 232448, "shared memory")
        return fn
    with pytest.warns(RuntimeWarning), pytest.raises(
            RuntimeError, match=r"no candidate launch ran: BM64 BN64 w4 s1 rowsum: OutOfResources: .*"
                                r"; BM32 BN32 w4 s1 tma rowsum: OutOfResources: ") as info:
        tuner.rank([A, B], [too_big(300000), too_big(400000)], timing.CpuTimer())
    assert isinstance(info.value.__cause__, OutOfResources)
    calls.clear()
    for configs, fns in (([A, B], [lambda: calls.append(1)]), ([], [])):
        with pytest.raises(ValueError, match="one launch per config and at least one"):
            tuner.rank(configs, fns, timing.CpuTimer())
    assert calls == []


def _captured_launch(monkeypatch, call):
    """(kernel, grid, args, meta) of the launch a fast forward makes, and its result."""
    seen = {}
    real = common_fast.launch_fast

    def spy(kernel, tuned, grid, args, meta, config, interpret):
        seen.update(kernel=kernel, grid=grid, args=args, meta=meta)
        real(kernel, tuned, grid, args, meta, config, interpret)
    monkeypatch.setattr(common_fast, "launch_fast", spy)
    result = call()
    monkeypatch.setattr(common_fast, "launch_fast", real)
    return seen, result


def test_a_tuner_ranks_real_launches_and_launches_its_pick_with_its_tile_shape(monkeypatch):
    """The fast bf16 kernel through the interpreter: two candidates whose KV tiles differ
    (64 and 32 columns; the TMA descriptors take each one's shape from the pre-hook), both
    timed; the launch after the ranking writes the pick's output, bit for bit what a
    launch pinned to it writes; the next call at that key launches without ranking."""
    monkeypatch.setattr(tuner, "ROUNDS", 2)
    monkeypatch.setattr(tuner, "CALLS", 1)
    monkeypatch.setattr(tuner, "MS", 0.0)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 96, 2, 64, generator=gen).to(torch.bfloat16) for _ in range(3))
    pol = policies.resolve(fp8=False, seqlen_kv=96, rescale="lazy")
    seen, _ = _captured_launch(monkeypatch, lambda: fast_bf16.forward(
        q, k, v, causal=True, policy=pol, interpret=True, config=A))
    tuned = common_fast.autotuners(seen["kernel"], (A, B), ["seqlen_q", "seqlen_kv", "H", "GROUP", "D", "CAUSAL"],
                                   common_fast.set_block_shapes, row_sum_filters=(True,))[True]
    out = seen["args"][3]
    real_rank = tuner.rank

    def rank_then_clear(*a, **kw):  # the ranking's own launches wrote into out too
        picked = real_rank(*a, **kw)
        out.zero_()
        return picked
    monkeypatch.setattr(tuner, "rank", rank_then_clear)
    tuned.run(seen["grid"], seen["args"], seen["meta"], timer=timing.CpuTimer(), interpret=True)
    pick = common_fast.tuned_config(tuned, (96, 96, 2, 1, 64, True))
    assert common_fast.tuned_config(tuned, (97,)) is None
    records = common_fast.tuning_timings(tuned)
    assert [r["config"] for r in records] == [A.describe(), B.describe()]
    assert all(r["ms"] > 0 and len(r["ms_rounds"]) == 2 for r in records)
    assert pick.describe() == min(records, key=lambda r: r["ms"])["config"]
    pinned, _ = fast_bf16.forward(q, k, v, causal=True, policy=pol, interpret=True, config=pick)
    assert torch.equal(out, pinned)

    def no_ranking(*a, **kw):
        raise AssertionError("ranked again at a key already tuned")
    monkeypatch.setattr(tuner, "rank", no_ranking)
    out.zero_()
    tuned.run(seen["grid"], seen["args"], seen["meta"], timer=timing.CpuTimer(), interpret=True)
    assert torch.equal(out, pinned)


def test_the_fp8_tuner_keys_on_the_shapes_and_the_p_cast(monkeypatch):
    """The fp8 kernel's two P casts (saturate, or NaN past 448) are different kernels: a
    pick each. The key holds the named shapes and flags, the dtypes and the device."""
    q8 = torch.zeros(1, 40, 2, 128).to(torch.float8_e4m3fn)
    pol = policies.resolve(fp8=True, seqlen_kv=40, rescale="lazy")
    seen, _ = _captured_launch(monkeypatch, lambda: fast_fp8.forward(
        q8, q8[:, :, :1], q8[:, :, :1], q_descale=1.0, k_descale=1.0, v_descale=1.0,
        causal=True, policy=pol, interpret=True))
    tuned = fast_fp8._TUNED[True]
    key = tuned.key(seen["args"], seen["meta"])
    assert key[:6] == (40, 40, 2, 2, True, True)
    assert key[6:] == ("torch.float8_e4m3fn",) * 3 + ("torch.bfloat16", "torch.float32", "cpu")
    assert tuned.key(seen["args"], {**seen["meta"], "SATURATE": False}) != key
