"""fa_lab.timing: how many calls are timed, the order of alternated calls and their medians,
the rounds of a tuner's ranking and their guards, on the CPU (callables whose time a test
controls, through ``CpuTimer``'s clock); the CUDA timer on a GPU."""

import pytest
import torch

from _shared import CappedClock, VirtualTime
from fa_lab import timing


def test_measure_sizes_the_calls_by_time_and_count():
    vt = VirtualTime(calls_per_round=10**6)
    fn = vt.kernel("a", [2.0])
    timer = timing.CpuTimer(now=vt.now)
    fn()  # the warm-up call
    assert timing.measure(fn, timer, min_calls=1, min_ms=10.0) == (pytest.approx(2.0), 5)  # 10 ms / 2 ms
    assert timing.measure(fn, timer, min_calls=7, min_ms=1.0)[1] == 7
    assert timing.measure(fn, timer, min_calls=1, min_ms=1e9, max_calls=4)[1] == 4


def test_measure_cycle_alternates_one_call_of_each_from_the_lead_and_takes_their_medians():
    vt = VirtualTime(calls_per_round=10**6, warm_calls=0)
    a, b, c = vt.kernel("a", [2.0]), vt.kernel("b", [3.0]), vt.kernel("c", [5.0])
    timer = timing.CpuTimer(now=vt.now)
    # 30 ms / (2 + 3 + 5) ms per cycle -> 3 cycles; every third call of each is +50 ms
    medians, n = timing.measure_cycle([a, b, c], timer, min_calls=1, min_ms=30.0)
    assert vt.log == ["a", "b", "c"] * 3
    assert (medians, n) == ([pytest.approx(2.0), pytest.approx(3.0), pytest.approx(5.0)], 3)
    vt.log.clear()
    medians, n = timing.measure_cycle([a, b, c], timer, min_calls=4, min_ms=0.0, lead=2)
    # the lead first, then the list order after it; medians stay in fns' order
    assert vt.log == ["c", "a", "b"] * 4
    assert (medians, n) == ([pytest.approx(2.0), pytest.approx(3.0), pytest.approx(5.0)], 4)
    assert timing.measure_cycle([a, b], timer, min_calls=1, min_ms=1e9, max_calls=2)[1] == 2


def test_alternated_calls_see_the_same_clock_where_calls_in_turn_do_not():
    """Two kernels of the same work under a clock that drops by 20 % part way: timed in
    turn, the second runs after the drop and reads 25 % slower; alternated, both run before
    and after it alike, whichever leads."""
    clock = CappedClock(t_drop=0.010)
    a, b = clock.kernel(1.0), clock.kernel(1.0)
    timer = timing.CpuTimer(now=clock.now)
    ma, _ = timing.measure(a, timer, min_calls=10, min_ms=0)
    mb, _ = timing.measure(b, timer, min_calls=10, min_ms=0)
    assert mb / ma == pytest.approx(1.25)
    for lead in (0, 1):
        clock.t, clock.t_drop = 0.0, 0.007  # the drop falls in the middle of the cycles
        (ma, mb), n = timing.measure_cycle([a, b], timer, min_calls=10, min_ms=0, lead=lead)
        assert (ma, n) == (pytest.approx(1.25), 10) and mb == pytest.approx(ma)


def test_time_alternated_moves_the_lead_each_round_and_ranks_under_a_clock_drop():
    """Candidates of 1.00 and 0.97 ms of work: timed one after the other (as a tuner that
    benchmarks each candidate in turn), the faster one meets the dropped clock and loses;
    in alternated rounds it wins every round."""
    clock = CappedClock(t_drop=0.030)
    slow, fast = clock.kernel(1.0), clock.kernel(0.97)
    timer = timing.CpuTimer(now=clock.now)
    in_turn = [timing.measure(fn, timer, min_calls=30, min_ms=0)[0] for fn in (slow, fast)]
    assert in_turn[1] > in_turn[0]  # the wrong pick
    clock.t = 0.0
    rounds = timing.time_alternated([slow, fast], timer, rounds=4, min_calls=11, min_ms=0)
    assert len(rounds) == 2 and all(len(r) == 4 for r in rounds)
    assert all(f / s == pytest.approx(0.97) for s, f in zip(*rounds))

    vt = VirtualTime(calls_per_round=10**6, warm_calls=0)
    fns = [vt.kernel(name, [1.0]) for name in "abc"]
    timing.time_alternated(fns, timing.CpuTimer(now=vt.now), rounds=4, min_calls=2, min_ms=0)
    leads = [vt.log[6 * r] for r in range(4)]  # 2 cycles of 3 calls a round
    assert leads == ["a", "b", "c", "a"]


SIZES = [
    (dict(min_calls=0), "min_calls must be an int >= 1"),
    (dict(min_calls=2.0), "min_calls must be an int >= 1"),
    (dict(max_calls=0), "max_calls must be an int >= 1"),
    (dict(min_ms=-1.0), "min_ms must be a finite number >= 0"),
    (dict(min_ms=float("nan")), "min_ms must be a finite number >= 0"),
    (dict(min_ms=float("inf")), "min_ms must be a finite number >= 0"),
    (dict(min_ms="5"), "min_ms must be a finite number >= 0"),
    (dict(min_ms=True), "min_ms must be a finite number >= 0"),
]


@pytest.mark.parametrize("kwargs, match", [
    (dict(rounds=0), "rounds must be an int >= 1"),
    (dict(rounds=True), "rounds must be an int >= 1"),
    (dict(rounds=2.0), "rounds must be an int >= 1"),
    *SIZES,
])
def test_time_alternated_refuses_bad_arguments_before_any_call(kwargs, match):
    calls = []
    with pytest.raises(ValueError, match=match):
        timing.time_alternated([lambda: calls.append(1)], timing.CpuTimer(), **kwargs)
    assert calls == []


@pytest.mark.parametrize("kwargs, match", SIZES)
def test_measure_and_measure_cycle_refuse_bad_sizes_before_any_call(kwargs, match):
    calls = []
    with pytest.raises(ValueError, match=match):
        timing.measure(lambda: calls.append(1), timing.CpuTimer(), **kwargs)
    with pytest.raises(ValueError, match=match):
        timing.measure_cycle([lambda: calls.append(1)], timing.CpuTimer(), **kwargs)
    assert calls == []


def test_measure_cycle_and_time_alternated_refuse_no_callables_and_a_bad_lead():
    calls = []
    fns = [lambda: calls.append("a"), lambda: calls.append("b")]
    for bad in (2, -1, True, 1.0):
        with pytest.raises(ValueError, match="lead must be an index into fns"):
            timing.measure_cycle(fns, timing.CpuTimer(), lead=bad)
    for f in (timing.measure_cycle, timing.time_alternated):
        with pytest.raises(ValueError, match="at least one callable"):
            f([], timing.CpuTimer())
        with pytest.raises(TypeError, match=r"fns\[1\] must be callable, got int"):
            f([fns[0], 3], timing.CpuTimer())
    with pytest.raises(TypeError, match="fn must be callable, got NoneType"):
        timing.measure(None, timing.CpuTimer())
    assert calls == []


def test_gpu_timing_tests_skip_where_xdist_workers_share_the_gpu(monkeypatch):
    """conftest's hook: on a GPU, ``gpu_alone`` tests skip where several xdist workers
    run and run otherwise (one worker, or none); without a GPU every ``gpu`` test skips."""
    import conftest

    class Item:
        def __init__(self, *marks):
            self.keywords, self.added = set(marks), []

        def add_marker(self, mark):
            self.added.append(mark.kwargs["reason"])

    def reasons(has_gpu, workers):
        monkeypatch.setattr(conftest, "HAS_GPU", has_gpu)
        if workers:
            monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(workers))
        else:
            monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
        items = [Item("gpu", "gpu_alone"), Item("gpu"), Item()]
        conftest.pytest_collection_modifyitems(None, items)
        return [i.added for i in items]

    alone, plain, cpu = reasons(True, 8)
    assert "needs it alone" in alone[0] and plain == cpu == []
    assert reasons(True, 1) == reasons(True, 0) == [[], [], []]
    for workers in (0, 1, 8):
        gpu_alone, gpu, cpu = reasons(False, workers)
        assert "needs a CUDA/ROCm GPU" in gpu_alone[0] and "needs a CUDA/ROCm GPU" in gpu[0] and cpu == []


# ---- on a GPU ------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.gpu_alone
def test_cuda_timer_times_alternated_calls_each_alone():
    """Spin kernels of 1e6 and 4e6 cycles called in alternation: each call's events hold
    its own kernel only (medians 1 : 4 within 10 %), whichever leads the cycle; in rounds
    too."""
    timer = timing.CudaTimer("cuda")
    one, four = (lambda: torch.cuda._sleep(1_000_000)), (lambda: torch.cuda._sleep(4_000_000))
    for lead in (0, 1):
        (ma, mb), n = timing.measure_cycle([one, four], timer, min_calls=8, min_ms=5, lead=lead)
        assert n >= 8 and 3.6 < mb / ma < 4.4, (ma, mb)
    r_one, r_four = timing.time_alternated([one, four], timer, rounds=2, min_calls=4, min_ms=5)
    assert all(3.6 < b / a < 4.4 for a, b in zip(r_one, r_four)), (r_one, r_four)
