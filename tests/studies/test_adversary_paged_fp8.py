"""The attack's paged fp8 prefill space (``fa_lab.studies.adversary.paged_fp8``): candidates
built and judged against the model and the fp64 reference, the classes told apart on
constructed calls, and the search finding the paged failures from the space alone within
the attack's 60 s target."""

import contextlib
import io
import time

import pytest
import torch

from fa_lab.studies.adversary import paged_fp8 as P

VERSION = "flydsl-6aeb4321"


def test_the_candidate_builds_the_call_it_describes():
    c = P.PagedCandidate(n_seqs=3, pairs=2, last=30, ctx_step=-100, empty_seq="last", q_len=5,
                         q_step=2, heads=1, spare=2)
    assert c.lens_k == [158, 58, 0] and c.lens_q == [5, 7, 9]
    case = P.build(c)
    assert case.call["seqlen_k"].tolist() == [158, 58, 0]
    assert case.call["cu_seqlens_q"].tolist() == [0, 5, 12, 21]
    assert case.call["max_seqlen_kv"] == 256          # the longest context, a whole pair
    assert case.q8.shape == (21, 1, 128) and case.call["block_table"].shape[1] == 4 + 2
    # every context empty: the first sequence keeps its keys (the kernel needs one)
    assert P.PagedCandidate(n_seqs=2, empty_seq="last", ctx_step=-300, last=5).lens_k == [5, 0]
    assert P.canonical(P.PagedCandidate(ctx_step=7, outlier_at=0.2)) == P.PagedCandidate()


def test_a_nan_read_past_the_context_is_stale_nan():
    """59 keys: one page, so its pair's partner page is read past the context. NaN there
    makes every row NaN (stale_nan: the same call with stale finite values is clean, and
    it is not counted as nonfinite); stale values change nothing."""
    nan = P.PagedCandidate(last=59, q_len=2, heads=1, tail="nan", shuffle=False, spare=0, seed=3)
    v = P.judge(nan, VERSION, classes=P.PAGED_CLASSES)
    assert v.failed and v.classes == ["stale_nan"] and len(v.bad_rows) == 2
    stale = P.judge(P.PagedCandidate(**{**nan.to_dict(), "tail": "stale"}), VERSION,
                    classes=P.PAGED_CLASSES)
    assert not stale.failed and stale.max_err < 0.05


def test_rows_that_see_no_key_are_not_judged_but_must_give_0():
    """A sequence with no key: its rows are undefined (no reference) and give 0, so no
    class fails; the fitness counts the rows that see nothing."""
    short = P.PagedCandidate(n_seqs=2, last=100, ctx_step=-100, q_len=3, heads=1, seed=1)
    assert short.lens_k == [100, 0]
    v = P.judge(short, VERSION, classes=P.PAGED_CLASSES)
    assert not v.failed and len(v.undefined_rows) == 3 and 0 < v.fitness < 129
    out, _ = P.run(short, VERSION)
    assert torch.equal(out[3:], torch.zeros_like(out[3:]))


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="classes"):
        P.judge(P.PagedCandidate(), VERSION, classes="overflow")
    with pytest.raises(TypeError, match="classes"):
        P.check_classes([1])
    with pytest.raises(ValueError, match="version"):
        P.search("main-11c4174d")
    with pytest.raises(ValueError, match="budget_s"):
        P.search(VERSION, budget_s=-1)


@pytest.mark.slow
@pytest.mark.parametrize("classes", ["stale_nan", "empty"])
def test_the_search_finds_the_paged_failures_within_60_s(classes):
    """From uniform draws and mutations alone: a NaN V read past a context (the partner
    page, the last page's tail), and a row that sees no key coming out NaN (a NaN page
    its padding pair reads, or ls past the causal floor's limit); the repro line
    reproduces it."""
    t0 = time.perf_counter()
    res = P.search(VERSION, budget_s=60, seed=0, classes=classes)
    assert res.found and res.time_to_first_s < 60 and res.found_classes == [classes]
    assert time.perf_counter() - t0 < 90          # the shrink has a budget of its own
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(res.repro, {})
    assert buf.getvalue().strip() == "True"
