"""The closed form of the decode's NaN rows (``fa_lab.kernels.pa_decode.bound``) against the
model, and a small attack that finds the 985c653a failure from random page tables and
context lengths alone."""

import random
import time

import pytest

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
