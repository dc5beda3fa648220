"""The attack's decode space (``adversary.decode``, ``adversary.decode_search``): the judge on
constructed calls (the 985c653a NaN before its fix and not after, the NaN a cache tail
brings in both versions, an empty context), the geometry its fitness reads, the search
finding the sentinel failure from the space alone and finding nothing on the fixed
version, bad input, and the record's schema."""

import dataclasses

import numpy as np
import pytest
import torch

from fa_lab.studies.adversary import check_record, decode, decode_search
from fa_lab.studies.adversary.decode import DecodeCandidate

BEFORE, MAIN = "flydsl-985c653a^", "main-11c4174d"
# 257 tokens, two MTP positions: the last tile holds one token, which row 0 does not see
SENTINEL = DecodeCandidate(tiles=2, last=1, query_length=2, group=1, per_token=True)


def test_the_sentinel_call_fails_before_the_fix_and_not_after():
    v = decode.judge(SENTINEL, BEFORE)
    assert v.failed and v.classes == ["nonfinite"] and v.bad_rows == [[1, 0]]
    assert v.fitness == 129.0
    after = decode.judge(SENTINEL, MAIN)
    assert not after.failed and after.max_err < 0.1
    # per-tensor scales: P * 448 = 448 packs fine in both versions
    assert not decode.judge(DecodeCandidate(tiles=2, last=1, query_length=2, group=1), BEFORE).failed


def test_a_nan_cache_tail_is_its_own_class_in_both_versions():
    c = DecodeCandidate(tiles=1, last=100, tail="nan", group=2)
    for version in (BEFORE, MAIN):
        assert not decode.judge(c, version).failed          # the default class: nonfinite
        v = decode.judge(c, version, classes="nonfinite,stale_nan")
        assert v.failed and v.classes == ["stale_nan"] and len(v.bad_rows) == 2
    # stale finite values past the context, or NaN only in pages never read: nothing
    assert not decode.judge(DecodeCandidate(tiles=1, last=100, tail="stale"), MAIN,
                            classes="nonfinite,stale_nan").failed
    assert not decode.judge(DecodeCandidate(tiles=1, last=256, tail="nan"), MAIN,
                            classes="nonfinite,stale_nan").failed


def test_an_empty_context_is_judged_only_for_the_empty_class():
    c = DecodeCandidate(n_seqs=2, ctx_step=40, tiles=1, last=0, num_partitions=2, group=2)
    assert c.contexts == [0, 40]
    v = decode.judge(c, MAIN)
    assert not v.failed and v.undefined_rows == [[0, 0], [0, 1]]
    e = decode.judge(c, MAIN, classes="empty")
    assert e.failed and e.bad_rows == [[0, 0], [0, 1]]  # the reduce's (-inf) - (-inf)


def test_the_fitness_geometry_by_hand():
    # 257 tokens, QL 2: row 0 sees 256 (tile 1 empty for it), row 1 sees 257
    assert decode.closest_masked_tile(SENTINEL) == (0, 0.5)
    # 300 tokens, QL 4: the last tile holds 44, 43, 42, 41 tokens for rows 3..0
    assert decode.closest_masked_tile(DecodeCandidate(tiles=2, last=44, query_length=4,
                                                      group=1)) == (41, 0.0)
    assert decode.closest_masked_tile(DecodeCandidate(tiles=1, last=0)) == (-1, 0.0)
    c = DecodeCandidate(tiles=2, last=44, query_length=4, group=1)
    rec: dict = {}
    decode.run(c, MAIN, recorder=rec)
    m = rec["first_max"]
    top = float(m[torch.isfinite(m)].abs().max())
    assert 0 < top < 128 and decode.max_range(rec) == top / 128
    assert decode.judge(c, MAIN).fitness == pytest.approx(-41.0 + 0.9 * top / 128)


def test_the_fitness_prefers_maxima_far_from_zero_within_one_token_count():
    """A key outlier of 2^16 under a per-tensor scale puts a row's running max far from 0:
    the same geometry scores higher, by at most 0.9, never past the next token count."""
    c = DecodeCandidate(tiles=2, last=44, query_length=4, group=2)
    far = dataclasses.replace(c, outlier_log2=16.0, outlier_at=0.5, outlier_in="k")
    a, b = decode.judge(c, MAIN).fitness, decode.judge(far, MAIN).fitness
    assert -41.0 < a < b <= -41.0 + decode.RANGE_WEIGHT < -40.0


def test_the_fitness_climbs_with_a_positive_exp2_argument():
    """On main's several-M-tile path the guard's 0 stands for an empty previous max, so the
    first correction is exp2(0 - m): its argument grows as the outlier key pulls a row's
    first max below 0, and the fitness with it (100 + 28 x / 128), up to the failure at
    128. The one-M-tile version never takes a positive argument: its fitness stays put."""
    c = DecodeCandidate(tiles=2, last=2, query_length=9, group=2, num_partitions=2,
                        shuffle=False, spare_pages=0, outlier_at=0.9984808043197476,
                        outlier_in="k", seed=1401260371)
    fits = []
    for log2 in (4.0, 6.0, 7.0, 8.0):
        d = dataclasses.replace(c, outlier_log2=log2)
        rec: dict = {}
        decode.run(d, MAIN, recorder=rec)
        x = float(rec["exp2_arg"][torch.isfinite(rec["exp2_arg"])].max())
        fit = decode.judge(d, MAIN).fitness
        assert fit == 129.0 if x >= 128 else fit == pytest.approx(100 + 28 * x / 128)
        fits.append(fit)
        assert decode.judge(d, BEFORE).fitness < 102
    assert fits[0] < fits[1] < fits[2] < fits[3] == 129.0


def test_a_draw_puts_a_number_at_an_end_of_its_range_a_quarter_of_the_time():
    rng = np.random.default_rng(0)
    draws = [decode_search.random_candidate(decode.DECODE_SPACE, rng) for _ in range(400)]
    ends = sum(d.outlier_at in (0.0, 1.0) for d in draws) / len(draws)
    assert 0.18 < ends < 0.32
    assert sum(d.last in (1, 2) for d in draws) > 0.05 * len(draws)
    assert all(0 <= d.last <= 256 and 1 <= d.tiles <= 5 for d in draws)


def test_a_boundary_draw_cuts_the_call_at_a_partition_boundary():
    """The partition-boundary family: one sequence, a context 1 .. QL tokens into its last
    tile, every tile a partition of its own, and the outlier at that tile's first token
    (the one the earliest row to see the tile sees alone); inside the space's ranges."""
    rng = np.random.default_rng(0)
    for sp in (decode.DECODE_SPACE, decode.DECODE_SPACES["decode_v_outliers"]):
        for _ in range(200):
            c = decode_search.boundary_candidate(sp, rng)
            (ctx,) = c.contexts
            assert 1 <= c.last <= c.query_length and c.num_partitions >= c.tiles
            first = 256 * (c.tiles - 1)
            assert int(c.outlier_at * (ctx - 1)) == first and c.outlier_log2 >= 0
            assert all(sp.range(f)[0] <= getattr(c, f) <= sp.range(f)[1]
                       for f in ("last", "num_partitions", "outlier_log2", "outlier_at"))
            assert c.outlier_in in sp.range("outlier_in")
            bounds = decode.model.row_bounds(ctx, c.query_length, c.group)
            assert min(b - first for b in bounds if b > first) == 1 or c.query_length == 1


@pytest.mark.slow
def test_the_search_finds_nothing_where_no_row_sits_far_below_zero():
    """Outliers in V only: no key's score dwarfs the rest, and main's inf path is not met."""
    res = decode_search.search(MAIN, space="decode_v_outliers", budget_s=60, max_evals=30,
                               seed=0)
    assert not res.found and res.evals == 30 and res.best_fitness < 129
    assert "nothing in 30 runs found a failure" in decode_search.summary(res)


@pytest.mark.slow
def test_the_search_finds_the_inf_path_overflow_on_main():
    res = decode_search.search(MAIN, budget_s=600, max_evals=30, seed=0, shrink_found=False)
    assert res.found and res.evals_to_first <= 30, decode_search.summary(res)
    s = res.first
    assert s.query_length * s.group > 16 and decode.judge(s, MAIN).failed
    rec: dict = {}
    decode.run(s, MAIN, recorder=rec)     # the inf path's first correction, exp2(0 - m)
    assert float(rec["exp2_arg"][torch.isfinite(rec["exp2_arg"])].max()) >= 128


@pytest.mark.slow
def test_the_search_finds_the_sentinel_failure_from_the_space_alone():
    res = decode_search.search(BEFORE, budget_s=60, seed=0)
    assert res.found and res.time_to_first_s < 60
    s = res.shrunk
    assert s.per_token and s.query_length >= 2 and len(s.contexts) == 1
    assert decode.judge(s, BEFORE).failed and not decode.judge(s, MAIN).failed
    rec = decode_search.record(BEFORE, [(res, res.search_s)], params={"seed": 0},
                               provenance={"device": "cpu"})
    rec["name"] = "attack_decode_test"
    check_record(rec, "the decode record")
    assert rec["found"] and "decode.DecodeCandidate" in rec["repro"]
    ns: dict = {}
    exec(rec["repro"].replace("print(", "ns['out'] = ("), {"ns": ns})
    assert ns["out"] is True


@pytest.mark.parametrize("call, exc, needle", [
    (lambda: decode_search.search("lazy", budget_s=1), ValueError, "upstream"),
    (lambda: decode_search.search(MAIN, budget_s=-1), ValueError, "budget_s"),
    (lambda: decode_search.search(MAIN, classes="silent"), ValueError, "classes"),
    (lambda: decode.judge(SENTINEL, MAIN, classes=[3]), TypeError, "classes"),
])
def test_bad_input_is_refused_naming_the_argument(call, exc, needle):
    with pytest.raises(exc, match=needle):
        call()


def test_the_attacks_find_on_main_the_inf_path_correction_overflow():
    # found by a search on main-11c4174d (seed 1), shrunk: 258 tokens, QL 9, G 2 (18 rows,
    # the -inf path), NP 2; token 256 is a key outlier (x 2^12.9 under a per-tensor scale)
    # that row qi = 7 sees alone in partition 1, far below zero: exp2(0 - m) = inf, l = 0 * inf
    c = DecodeCandidate(tiles=2, last=2, query_length=9, group=2, num_partitions=2,
                        shuffle=False, spare_pages=0, outlier_log2=12.910788992954508,
                        outlier_at=0.9984808043197476, outlier_in="k", seed=1401260371)
    v = decode.judge(c, MAIN)
    assert v.failed and v.bad_rows == [[7, 0], [7, 1]]
    assert not decode.judge(c, BEFORE).failed
    assert not decode.judge(dataclasses.replace(c, num_partitions=1), MAIN).failed


def test_the_sliding_window_kernel_in_the_decode_space():
    """``window`` > 0 runs the sliding-window kernel over 1024-token pages: a NaN cache tail
    inside a computed tile is stale_nan in every row (masked tokens enter P V too); a
    zero context with NP > 1 is the reduce's empty-row NaN; the fitness reads the window's
    tiles. The default spaces pin the window at 0."""
    c = DecodeCandidate(tiles=2, last=100, tail="nan", group=2, window=300, num_partitions=3)
    assert c.size["page"] == 1024 and c.size["window"] == 300
    assert decode.canonical(dataclasses.replace(c, block_size=64)) == c
    v = decode.judge(c, MAIN, classes="nonfinite,stale_nan")
    assert v.classes == ["stale_nan"] and len(v.bad_rows) == 2
    clean = dataclasses.replace(c, tail="finite")
    ok = decode.judge(clean, MAIN, classes="nonfinite,stale_nan")
    assert not ok.failed and ok.max_err < 0.1
    # the window of row 0 (QL 1, 356 tokens, W 300) starts at token 55: tile 0 holds 201
    # of its tokens, tile 1 holds 100
    assert decode.closest_masked_tile(clean) == (100, 0.0)
    empty = DecodeCandidate(n_seqs=2, ctx_step=40, tiles=1, last=0, num_partitions=2, window=64)
    assert decode.judge(empty, MAIN, classes="empty").bad_rows == [[0, 0], [0, 1], [0, 2], [0, 3]]
    assert decode.DECODE_SPACES["decode"].range("window") == (0, 0)
    assert decode.DECODE_SPACES["decode_swa"].range("window") == (1, 1000)


@pytest.mark.slow
def test_the_search_finds_a_sliding_window_failure_from_its_space():
    res = decode_search.search(MAIN, space="decode_swa", budget_s=60, seed=0,
                               classes="stale_nan,empty")
    assert res.found and res.time_to_first_s < 60 and res.shrunk.window > 0
