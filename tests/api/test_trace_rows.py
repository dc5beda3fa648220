"""``fa_lab.trace``'s ``rows`` grammar (``fa_lab.trace.normalize_rows``), issue 15 finding 4.

Accepted: an integer; a range; a list/tuple of integers (rows of (batch, head)); a
list/tuple of (batch, head, row) 3-tuples (one lane each). An integer is a Python int, a
numpy integer scalar or a 0-d integer tensor. Refused: the bare 3-tuple ``(0, 1, 5)``
(ambiguous), floats, bools, strings, and anything else, with a message naming ``rows``,
``batch`` or ``head``. Every refusal comes before any model work.
"""

import numpy as np
import pytest
import torch

import fa_lab
from fa_lab import dispatch
from fa_lab.studies.experiments import bf16_inputs
from fa_lab.trace import normalize_rows

B, S, H, D = 2, 64, 2, 64


@pytest.fixture(scope="module")
def qkv():
    return bf16_inputs(B, S, H, D, 4.0, seed=3)


@pytest.fixture(scope="module")
def full_out(qkv):
    return fa_lab.flash_attn_func(*qkv, backend="emulator")


def traced(qkv, **kw):
    return fa_lab.trace(*qkv, backend="emulator", **kw)


def check_lanes(tr, full_out, expected):
    """The trace has exactly the expected lanes, in order, and each lane's output is the
    full run's output at that (batch, row, head): the lane really is the one named."""
    got = list(tr.lanes[["batch", "head", "row"]].itertuples(index=False, name=None))
    assert got == expected
    for i, (b, h, s) in enumerate(expected):
        assert torch.equal(tr.out[i], full_out[b, s, h].float()), (i, b, h, s)
    assert set(tr.steps.lane) == set(range(len(expected)))


# --- accepted forms ---------------------------------------------------------------------

@pytest.mark.parametrize("rows, batch, head, expected", [
    (5, 0, 0, [(0, 0, 5)]),
    (63, 1, 1, [(1, 1, 63)]),
    (np.int64(7), 1, 0, [(1, 0, 7)]),
    (np.int32(7), np.int16(1), np.uint8(1), [(1, 1, 7)]),
    (torch.tensor(9), torch.tensor(1), torch.tensor(0), [(1, 0, 9)]),
    (torch.tensor(9, dtype=torch.int32), 0, 1, [(0, 1, 9)]),
    (range(3, 6), 0, 1, [(0, 1, 3), (0, 1, 4), (0, 1, 5)]),
    (range(60, 64), 1, 0, [(1, 0, 60), (1, 0, 61), (1, 0, 62), (1, 0, 63)]),
    ([0, 1, 5], 1, 1, [(1, 1, 0), (1, 1, 1), (1, 1, 5)]),
    ((0, 1), 0, 1, [(0, 1, 0), (0, 1, 1)]),          # a tuple of ints that is not 3 long
    ((4, 3, 2, 1), 1, 0, [(1, 0, 4), (1, 0, 3), (1, 0, 2), (1, 0, 1)]),
    ([np.int64(2), torch.tensor(3), 4], 0, 0, [(0, 0, 2), (0, 0, 3), (0, 0, 4)]),
    ([7, 7], 0, 0, [(0, 0, 7), (0, 0, 7)]),          # duplicates kept, one lane each
    ([(0, 1, 5)], 0, 0, [(0, 1, 5)]),                # the lane a bare (0, 1, 5) may mean
    ([(1, 0, 63), (0, 1, 0)], 0, 0, [(1, 0, 63), (0, 1, 0)]),
    (((1, 1, 2), (0, 0, 3)), 0, 0, [(1, 1, 2), (0, 0, 3)]),   # a tuple of lanes
    ([(np.int64(1), torch.tensor(0), np.int32(8))], 0, 0, [(1, 0, 8)]),
    ([(1, 1, 2)], 1, 1, [(1, 1, 2)]),                # batch/head are not applied to lanes
])
def test_accepted_forms(qkv, full_out, rows, batch, head, expected):
    assert normalize_rows(rows, batch, head, (B, H, S)) == expected
    tr = traced(qkv, rows=rows, batch=batch, head=head)
    check_lanes(tr, full_out, expected)


def test_int_results_are_python_ints():
    got = normalize_rows([np.int64(2), torch.tensor(3)], np.int8(1), torch.tensor(1), (2, 2, 8))
    assert got == [(1, 1, 2), (1, 1, 3)]
    assert all(type(x) is int for t in got for x in t)


# --- refusals ---------------------------------------------------------------------------

@pytest.fixture
def no_work(monkeypatch):
    """A refusal must come before the model runs."""
    def boom(*a, **k):
        raise AssertionError("the model ran before the bad rows/batch/head was caught")
    monkeypatch.setattr(dispatch, "run", boom)


REFUSALS = [
    # the ambiguous bare 3-tuple: the message spells out both readings
    ((0, 1, 5), 0, 0, ValueError, r"rows=\(0, 1, 5\) is ambiguous.*\[0, 1, 5\].*\[\(0, 1, 5\)\]"),
    ((np.int64(0), 1, torch.tensor(5)), 0, 0, ValueError, r"rows=.* is ambiguous.*\[\(0, 1, 5\)\]"),
    # non-integers as rows
    (1.5, 0, 0, TypeError, r"^rows must be an integer.*float"),
    (2.0, 0, 0, TypeError, r"^rows must be an integer.*float"),
    (True, 0, 0, TypeError, r"^rows must be an integer, got the bool"),
    (np.True_, 0, 0, TypeError, r"^rows must be an integer, got the bool"),
    (np.float32(2), 0, 0, TypeError, r"^rows must be an integer"),
    (torch.tensor(2.0), 0, 0, TypeError, r"^rows must be an integer"),
    (torch.tensor(True), 0, 0, TypeError, r"^rows must be an integer.*bool tensor"),
    ("5", 0, 0, TypeError, r"^rows must be an int, a range, .*; got str"),
    (b"5", 0, 0, TypeError, r"^rows must be an int, a range, .*; got bytes"),
    ({1, 2}, 0, 0, TypeError, r"^rows must be .*; got set"),
    ((r for r in [1, 2]), 0, 0, TypeError, r"^rows must be .*; got generator"),
    (np.arange(3), 0, 0, TypeError, r"^rows must be .*; got ndarray; pass \.tolist\(\)"),
    (torch.arange(3), 0, 0, TypeError, r"^rows must be .*; got Tensor; pass \.tolist\(\)"),
    ({0: 1}, 0, 0, TypeError, r"^rows must be .*; got dict"),
    # non-integers inside rows
    ([1.5], 0, 0, TypeError, r"^rows\[0\] must be an integer.*float 1\.5"),
    ([1, 2.0], 0, 0, TypeError, r"^rows\[1\] must be an integer.*float"),
    ([True], 0, 0, TypeError, r"^rows\[0\] must be an integer, got the bool"),
    (["3"], 0, 0, TypeError, r"^rows\[0\] must be an integer.*str"),
    ([None], 0, 0, TypeError, r"^rows\[0\] must be an integer.*NoneType"),
    ([torch.tensor([3])], 0, 0, TypeError, r"^rows\[0\] must be an integer.*1-D tensor"),
    ([torch.tensor(3.0)], 0, 0, TypeError, r"^rows\[0\] must be an integer"),
    ([np.float64(3)], 0, 0, TypeError, r"^rows\[0\] must be an integer.*float64"),
    ([(0, 1, 2.5)], 0, 0, TypeError, r"^rows\[0\] must be an integer.*float"),
    ([(0, True, 2)], 0, 0, TypeError, r"^rows\[0\] must be an integer, got the bool"),
    ([[0, 1, 5]], 0, 0, TypeError, r"^rows\[0\] is a list .*a lane is a \(batch, head, row\) tuple"),
    # batch / head
    ([1], 1.7, 0, TypeError, r"^batch must be an integer.*float 1\.7"),
    ([1], 0, 1.7, TypeError, r"^head must be an integer.*float 1\.7"),
    ([1], True, 0, TypeError, r"^batch must be an integer, got the bool"),
    ([1], 0, False, TypeError, r"^head must be an integer, got the bool"),
    ([1], "0", 0, TypeError, r"^batch must be an integer.*str"),
    ([1], 0, None, TypeError, r"^head must be an integer.*NoneType"),
    ([1], np.float64(1), 0, TypeError, r"^batch must be an integer"),
    ([1], 0, torch.tensor(1.0), TypeError, r"^head must be an integer"),
    ([1], 0, torch.tensor([1]), TypeError, r"^head must be an integer.*1-D tensor"),
    ([(0, 0, 1)], 1.5, 0, TypeError, r"^batch must be an integer"),   # checked with lanes too
    # values
    (None, 0, 0, ValueError, r"^rows must name the query rows"),
    ([], 0, 0, ValueError, r"^rows is empty"),
    ((), 0, 0, ValueError, r"^rows is empty"),
    (range(0), 0, 0, ValueError, r"^rows is empty"),
    (S, 0, 0, ValueError, r"^rows\[0\]: query row 64 out of range \[0, 64\)"),
    (-1, 0, 0, ValueError, r"^rows\[0\]: query row -1 out of range"),
    ([0, 64], 0, 0, ValueError, r"^rows\[1\]: query row 64"),
    (range(60, 70), 0, 0, ValueError, r"^rows\[4\]: query row 64"),
    ([1], 2, 0, ValueError, r"^batch=2 out of range \[0, 2\)"),
    ([1], -1, 0, ValueError, r"^batch=-1 out of range"),
    ([1], 0, 2, ValueError, r"^head=2 out of range \[0, 2\)"),
    ([1], np.int64(5), 0, ValueError, r"^batch=5 out of range"),
    ([(2, 0, 0)], 0, 0, ValueError, r"^rows\[0\]: batch 2 out of range"),
    ([(0, 2, 0)], 0, 0, ValueError, r"^rows\[0\]: head 2 out of range"),
    ([(0, 0, 1), (0, 0, 64)], 0, 0, ValueError, r"^rows\[1\]: query row 64 out of range"),
    ([(0, 0)], 0, 0, ValueError, r"^rows\[0\]: a tuple must be \(batch, head, row\)"),
    ([(0, 0, 0, 0)], 0, 0, ValueError, r"^rows\[0\]: a tuple must be \(batch, head, row\)"),
    ([1, (0, 1, 5)], 0, 0, ValueError, r"^rows mixes query rows"),
    ([(0, 1, 5), 1], 0, 0, ValueError, r"^rows mixes query rows"),
]


@pytest.mark.parametrize("rows, batch, head, exc, pattern", REFUSALS)
def test_refusals_name_the_argument(qkv, no_work, rows, batch, head, exc, pattern):
    with pytest.raises(exc, match=pattern):
        normalize_rows(rows, batch, head, (B, H, S))
    with pytest.raises(exc, match=pattern):
        traced(qkv, rows=rows, batch=batch, head=head)


def test_refusal_messages_name_an_argument():
    """Every refusal above names rows (or rows[i]), batch or head in its first words."""
    for rows, batch, head, exc, _ in REFUSALS:
        with pytest.raises(exc) as info:
            normalize_rows(rows, batch, head, (B, H, S))
        assert str(info.value).split()[0].rstrip(":").split("=")[0].split("[")[0] in (
            "rows", "batch", "head"), str(info.value)


def test_the_unambiguous_neighbours_of_the_bare_triple(qkv, full_out):
    """What the ambiguity message proposes works, and each reading traces what it says."""
    as_rows = traced(qkv, rows=[0, 1, 5])
    check_lanes(as_rows, full_out, [(0, 0, 0), (0, 0, 1), (0, 0, 5)])
    as_lane = traced(qkv, rows=[(0, 1, 5)])
    check_lanes(as_lane, full_out, [(0, 1, 5)])
    assert not torch.equal(as_rows.out[2], as_lane.out[0])  # head 0 row 5 vs head 1 row 5


def test_issue_example_float_row_and_head_refused(qkv, no_work):
    """Issue 15: rows=[1.5], head=1.7 used to trace head 1, row 1."""
    with pytest.raises(TypeError, match=r"^head must be an integer"):
        traced(qkv, rows=[1.5], head=1.7)
    with pytest.raises(TypeError, match=r"^rows\[0\] must be an integer"):
        traced(qkv, rows=[1.5], head=1)


@pytest.mark.parametrize("rows, pattern", [
    (range(10**9), r"^rows\[64\]: query row 64 out of range \[0, 64\)$"),
    (range(-5, 10**12), r"^rows\[0\]: query row -5 out of range"),
    (range(10**12, 0, -1), r"^rows\[0\]: query row 1000000000000 out of range"),
    (range(63, -10**9, -1), r"^rows\[64\]: query row -1 out of range"),
])
def test_a_huge_range_is_refused_without_building_its_list(qkv, no_work, monkeypatch, rows, pattern):
    """The range's bounds are checked in O(1): no list of 10**9 rows (a MemoryError), the
    same error as for a list, naming the first row out of range."""
    real_list = list

    def guarded(x=()):
        if isinstance(x, range) and len(x) > 10**6:
            raise AssertionError("list() of a huge range")
        return real_list(x)
    monkeypatch.setattr("builtins.list", guarded)
    try:
        with pytest.raises(ValueError, match=pattern):
            normalize_rows(rows, 0, 0, (B, H, S))
    finally:
        monkeypatch.undo()
    with pytest.raises(ValueError, match=pattern):
        traced(qkv, rows=rows)
