"""The closed form of the decode's NaN rows (``fa_lab.kernels.pa_decode.bound``) against the
model, and a small attack that finds the 985c653a failure from random page tables and
context lengths alone."""

import random
import time

import pytest
import torch

from fa_lab import decode
from fa_lab.kernels.pa_decode import bound, cases

MAIN, BEFORE = "main-11c4174d", "flydsl-985c653a^"


def nan_rows(out, ql, group):
    return out.isnan().any(dim=2).reshape(-1).tolist()  # rows r = qi * G + g


@pytest.mark.parametrize("seed", range(3))
def test_closed_form_brackets_the_model(seed):
    rng = random.Random(seed)
    for i in range(12):
        ql, group, npart = rng.randint(1, 5), rng.choice([1, 2, 4, 8]), rng.randint(1, 4)
        c = rng.choice([0, rng.randint(1, 6), rng.randint(250, 263), rng.randint(507, 519)])
        per_token, version = rng.random() < 0.7, rng.choice([MAIN, BEFORE])
        case = cases.make([c], query_length=ql, num_q_heads=group, block_size=16,
                          per_token=per_token, seed=seed * 100 + i)
        got = nan_rows(decode.pa_decode_tile(*case.args(), num_partitions=npart, upstream=version),
                       ql, group)
        lo = bound.nan_rows(c, ql, group, npart, upstream=version, per_token=per_token)
        hi = bound.possible_nan_rows(c, ql, group, npart, upstream=version, per_token=per_token)
        assert all(a <= b <= h for a, b, h in zip(lo, got, hi)), (c, ql, group, npart, per_token,
                                                                 version, lo, got, hi)


def test_closed_form_by_hand():
    # c = 257: the last tile holds k = 1 token; QL = 4, G = 2 (one M-tile, first row qi 0)
    assert bound.nan_rows(257, 4, 2, 2, upstream=BEFORE) == [True] * 8
    assert bound.nan_rows(257, 4, 2, 2, upstream=BEFORE, per_token=False) == [False] * 8
    # k = 4 > QL - 1 = 3: the first row sees a token of the last tile; nothing certain
    assert not any(bound.nan_rows(260, 4, 2, 2, upstream=BEFORE))
    assert bound.nan_rows(257, 4, 2, 2, upstream=MAIN) == [False] * 8
    assert bound.nan_rows(0, 1, 2, 2, upstream=MAIN) == [True, True]
    assert bound.fully_masked_first_tile(257, 4, 1, 2) == [True, True, True, False]
    assert bound.fully_masked_first_tile(257, 4, 1, 1) == [False] * 4


def test_attack_finds_the_sentinel_failure():
    """Random page tables (shuffled pools, spare pages), context lengths, MTP lengths,
    groups and partition counts, per-token scales: stop at the first NaN on the version
    before 985c653a, then check main is finite there. Budget 60 s; it takes a few tries."""
    rng = random.Random(2026)
    start, tries = time.monotonic(), 0
    while time.monotonic() - start < 60:
        tries += 1
        ql, group, npart = rng.randint(1, 8), rng.choice([1, 2, 4]), rng.randint(1, 4)
        ctx = [rng.randint(0, 1100) for _ in range(rng.randint(1, 2))]
        case = cases.make(ctx, query_length=ql, num_q_heads=group, block_size=rng.choice([16, 64]),
                          per_token=True, seed=tries, spare_pages=rng.randint(0, 4))
        before = decode.pa_decode_tile(*case.args(), num_partitions=npart, upstream=BEFORE)
        if before.isnan().any() and 0 not in ctx:
            after = decode.pa_decode_tile(*case.args(), num_partitions=npart, upstream=MAIN)
            assert not after.isnan().any()
            return
    pytest.fail(f"no failure found in {tries} tries")


def _inf_path_case():
    # c = 258, QL = 9, G = 2 (18 rows: the -inf path), NP = 2; row qi = 7 sees token 256 alone
    # in partition 1, and its score is about -5170 log2 units
    case = cases.make([258], query_length=9, num_q_heads=2, block_size=16, seed=4)
    case.query.fill_(1.0)
    case.key_scale.fill_(1.0)
    case.key_cache.view(torch.uint8)[int(case.block_tables[0, 16]), :, :, 0, :] = 0xFE  # -448
    return case


def test_the_region_of_each_version_on_constructed_calls():
    sentinel = cases.make([257], query_length=4, num_q_heads=2, block_size=16, per_token=True,
                          seed=11)
    m = bound.measure(sentinel, num_partitions=2, upstream=BEFORE)
    assert bound.region(BEFORE).violated(m) == ["sentinel_pack_nan"]
    assert bound.region(MAIN).contains(bound.measure(sentinel, num_partitions=2, upstream=MAIN))
    inf = _inf_path_case()
    m = bound.measure(inf, num_partitions=2, upstream=MAIN)
    # the -448 token also sits thousands of log2 units below the max: its P flushes
    assert bound.region(MAIN).violated(m) == ["inf_path_correction", "p_cast_subnormal",
                                              "p_cast_flush"]
    assert bound.region(MAIN).margins(m)["inf_path_correction"] < -5000
    assert bound.region(BEFORE).violated(bound.measure(inf, num_partitions=2, upstream=BEFORE)) == [
        "p_cast_subnormal", "p_cast_flush"]   # no NaN before 985c653a: the mass loss only
    empty = cases.make([0, 40], num_q_heads=2, block_size=16)
    assert bound.region(MAIN).violated(bound.measure(empty, num_partitions=2)) == ["empty_context"]
    assert bound.region(MAIN).contains(bound.measure(empty, num_partitions=1))
    tail = cases.make([100], num_q_heads=2, block_size=16, tail="nan")
    assert bound.region(MAIN).violated(bound.measure(tail, num_partitions=1)) == ["stale_v_tail"]
    full = cases.make([256], num_q_heads=2, block_size=16, tail="nan")  # no tail in the tile
    assert bound.region(MAIN).contains(bound.measure(full, num_partitions=1))


def test_inside_the_region_the_model_is_finite_on_every_row_that_sees_a_token():
    rng = random.Random(7)
    for version in (MAIN, BEFORE):
        for _ in range(4):
            ql, group, npart = rng.randint(1, 9), rng.randint(1, 3), rng.randint(1, 3)
            case = cases.make([rng.randint(1, 700)], query_length=ql, num_q_heads=group,
                              block_size=16, per_token=rng.random() < 0.5,
                              seed=rng.randint(0, 99))
            m = bound.measure(case, num_partitions=npart, upstream=version)
            out = decode.pa_decode_tile(*case.args(), num_partitions=npart, upstream=version)
            seen = torch.isfinite(cases.reference(case)).all(-1)
            if bound.region(version).contains(m):
                assert torch.isfinite(out[seen].float()).all()


def test_the_onset_bound_hook_and_bad_versions():
    from fa_lab.studies import onset

    assert onset.bound("pa_decode").upstream == MAIN
    assert onset.bound(f"pa_decode:{BEFORE}").upstream == BEFORE
    never = {h.name for h in onset.bound("pa_decode").hazards if h.never}
    assert never == {"sentinel_pack_nan"}
    assert "inf_path_correction" in onset.bound(f"pa_decode:{BEFORE}").describe()
    with pytest.raises(ValueError, match="upstream"):
        bound.region("main-00000000")
