"""The MLA decode model (docs/semantics.md §14) against an fp64 reference, hand-computed
cases for its tiles, sentinels and the split merge, and the mass-loss closed form at its
edges.

Tolerances. Against fp64 the model's one lossy step is the e4m3 cast of P: a normal P
moves by at most 2**-4 of itself, a subnormal or flushed one by at most 2**-10 (in units of
its tile's running max, <= the final max), so per output element
|out - ref| <= (2**-4 sum P |v| + 2**-10 sum |v|) / l, plus fp32 rounding (1e-5 here).
The LSE skips the cast: it is the fp64 LSE to fp32 accuracy.
"""

from __future__ import annotations

import math

import pytest
import torch

from fa_lab.kernels.mla_decode import model as M
from fa_lab.numerics import e4m3, f32
from fa_lab.studies import mla_mass_loss as study

FP8 = torch.float8_e4m3fn
SCALE = 576 ** -0.5


def inputs(n, seed=0, k_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(M.NUM_HEADS, M.QK_HEAD_DIM, generator=g).to(FP8).float()
    kv = (torch.randn(n, M.QK_HEAD_DIM, generator=g) * k_scale).to(FP8).float()
    return q, kv


def cast_bound(q, kv, scale):
    """The per-element bound on |out - ref| from the P cast (module docstring)."""
    s = (q.double() @ kv.double().T) * scale
    p = torch.exp(s - s.amax(-1, keepdim=True))
    v = kv[:, :M.V_HEAD_DIM].double().abs()
    return (2 ** -4 * p @ v + 2 ** -10 * v.sum(0)) / p.sum(-1, keepdim=True)


@pytest.mark.parametrize("n,k_scale", [(1, 1.0), (63, 1.0), (64, 1.0), (65, 2.0), (200, 3.0)])
def test_model_matches_fp64_within_the_cast_bound(n, k_scale):
    q, kv = inputs(n, seed=n, k_scale=k_scale)
    o, lse = M.work_item(q, kv, SCALE)
    ro, rl = M.reference(q, kv, SCALE)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    err = (o.double() - ro).abs()
    assert (err <= cast_bound(q, kv, SCALE) + 1e-5).all()
    assert (lse.double() - rl).abs().max() <= 1e-5 * rl.abs().max() + 1e-6
    if n > 1:  # the cast is visible: the model is not the reference
        assert err.max() > 1e-4


def test_one_key_and_two_equal_keys_by_hand():
    q = torch.zeros(M.NUM_HEADS, M.QK_HEAD_DIM)
    q[:, 0] = 2.0
    kv = torch.zeros(2, M.QK_HEAD_DIM)
    kv[:, 0] = 1.5
    kv[0, 1:M.V_HEAD_DIM] = 0.25
    kv[1, 1:M.V_HEAD_DIM] = 0.75
    o, lse = M.work_item(q, kv[:1], 0.5)  # x = f32(3 * 0.5) = 1.5, P = 1, l = 1
    assert torch.equal(o, kv[:1, :M.V_HEAD_DIM].expand(M.NUM_HEADS, -1))
    assert torch.equal(lse, torch.full((M.NUM_HEADS,), 1.5))  # fma(log2 1, ., m) = m
    o, lse = M.work_item(q, kv, 0.5)  # two equal scores: P = 1, 1; l = 2
    assert torch.equal(o[:, 1:], torch.full((M.NUM_HEADS, M.V_HEAD_DIM - 1), 0.5))
    assert torch.equal(lse, torch.full((M.NUM_HEADS,), f32(1.0 * M.INV_LOG2E + 1.5)))


def test_tile_sum_is_the_lane_order():
    # group 0 holds keys 0-3, 16-19, 32-35, 48-51: 1 then fifteen 2**-24 stays 1 (ties to
    # even at every step); a tree or fp64 sum would keep 15 * 2**-24 of them
    p = torch.zeros(1, M.BLOCK_N)
    p[0, M.LANE_KEYS[0]] = 2.0 ** -24
    p[0, 0] = 1.0
    assert float(M.tile_sum(p)[0]) == 1.0
    assert float(p.double().sum()) == 1.0 + 15 * 2.0 ** -24
    # (g0 + g2) + (g1 + g3): with g0 = 1, g2 = 2**-24, g1 = g3 = 2**-24 the pairs give
    # 1 + 2**-23 (no tie left), where ((g0 + g1) + g2) + g3 would give 1
    p = torch.zeros(1, M.BLOCK_N)
    p[0, 0] = 1.0
    for j in (1, 2, 3):
        p[0, M.LANE_KEYS[j][0]] = 2.0 ** -24
    assert float(M.tile_sum(p)[0]) == 1.0 + 2.0 ** -23


def test_keys_past_kv_end_are_masked_and_never_read():
    q, kv = inputs(70, seed=3)
    o, lse = M.work_item(q, kv[:65], SCALE)
    ro, rl = M.reference(q, kv[:65], SCALE)
    assert ((o.double() - ro).abs() <= cast_bound(q, kv[:65], SCALE) + 1e-5).all()
    # the launcher: pages after kv_end poisoned with NaN codes change nothing
    query = q.to(FP8)[None]
    buf = kv.to(FP8).reshape(70, 1, 1, -1).clone()
    pages = torch.arange(70, dtype=torch.int32)
    sch = M.schedule([0, 65], 1)
    outs = []
    for poison in (False, True):
        if poison:
            buf.view(torch.uint8)[65:] = 0x7F
        so, sl = torch.zeros(1, 1, 128, 512), torch.zeros(1, 1, 128, 1)
        M.forward(query, buf, pages, sch["work_indptr"], sch["work_info_set"], so, sl, SCALE)
        outs.append((so.clone(), sl.clone()))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert torch.equal(outs[0][0][0, 0], o) and torch.equal(outs[0][1][0, 0, :, 0], lse)


def test_sentinels_empty_item_and_nan_key():
    q, kv = inputs(10, seed=4)
    o, lse = M.work_item(q, kv[:0], SCALE)  # -inf - -inf = NaN on the one masked tile
    assert o.isnan().all() and lse.isnan().all()
    kv[3, 600 % M.QK_HEAD_DIM] = math.nan  # a NaN code in one key's rope part
    o, lse = M.work_item(q, kv, SCALE)
    assert o.isnan().all() and lse.isnan().all()
    # NaN scores are skipped by maxNum: the tile max is the other keys' max
    x = torch.tensor([[math.nan, 1.0, -math.inf], [math.nan, math.nan, math.nan]])
    assert M.tile_max(x)[0] == 1.0 and M.tile_max(x)[1].isnan()


def test_multi_tile_rescale_matches_fp64():
    # the max grows in the last tile: earlier tiles are rescaled in fp32, not re-cast
    q, kv = inputs(192, seed=5, k_scale=2.0)
    kv[-1, M.V_HEAD_DIM:] = (q[0, M.V_HEAD_DIM:].sign() * 8).to(FP8).float()
    o, lse = M.work_item(q, kv, SCALE)
    ro, rl = M.reference(q, kv, SCALE)
    assert ((o.double() - ro).abs() <= cast_bound(q, kv, SCALE) + 1e-5).all()
    assert (lse.double() - rl).abs().max() <= 1e-5 * rl.abs().max() + 1e-6


def test_reduce_by_hand():
    so = torch.zeros(4, 1, M.NUM_HEADS, M.V_HEAD_DIM)
    sl = torch.zeros(4, 1, M.NUM_HEADS, 1)
    so[0], so[1] = 1.0, 3.0
    sl[1] = f32(math.log(3.0))  # weights 1/4 and 3/4: 0.25 + 2.25 = 2.5
    so[2] = 7.0
    sl[3] = math.nan
    final = torch.full((3, M.NUM_HEADS, M.V_HEAD_DIM), -1.0, dtype=torch.bfloat16)
    M.reduce(so, sl, torch.tensor([0, 2, 3, 5]), torch.tensor([[0, 1], [1, 2], [2, 3]]),
             torch.tensor([0, 1, 2, 0, 3]), final)
    assert (final[0].float() - 2.5).abs().max() <= 2 ** -6  # bf16 of an fp32 near 2.5
    assert (final[1] == -1).all()  # one split: skipped, the row keeps what it held
    assert final[2].float().isnan().all()  # a NaN LSE poisons the merge


def test_splits_merge_to_the_unsplit_answer():
    q, kv = inputs(300, seed=6)
    query, buf = q.to(FP8)[None], kv.to(FP8).reshape(300, 1, 1, -1)
    pages = torch.randperm(300, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    ro, _ = M.reference(q, kv[pages.long()], SCALE)
    for splits in (2, 5):
        sch = M.schedule([0, 300], splits)
        n = sch["num_partial"]
        assert n == splits
        so, sl = torch.zeros(n, 1, 128, 512), torch.zeros(n, 1, 128, 1)
        M.forward(query, buf, pages, sch["work_indptr"], sch["work_info_set"], so, sl, SCALE)
        final = torch.zeros(1, 128, 512, dtype=torch.bfloat16)
        M.reduce(so, sl, sch["reduce_indptr"], sch["reduce_final_map"],
                 sch["reduce_partial_map"], final)
        bound = cast_bound(q, kv[pages.long()], SCALE) + 2 ** -8 * ro.abs() + 1e-5
        assert ((final[0].double() - ro).abs() <= bound).all()


# ---- the mass loss: closed form against the model, at the edges -------------------------

def test_onset_values():
    assert study.onset(0.0) == {"subnormal": 6.0, "flush": 10.0}
    assert study.onset(8.0) == {"subnormal": 14.0, "flush": 18.0}
    assert float(e4m3(torch.tensor([2.0 ** -10]))[0]) == 0.0  # the tie goes to 0
    assert float(e4m3(torch.tensor([2.0 ** -10 * (1 + 2 ** -20)]))[0]) == 2.0 ** -9


@pytest.mark.parametrize("headroom", [0.0, 8.0])
def test_closed_form_matches_the_model_at_the_flush_edge(headroom):
    flush = study.onset(headroom)["flush"]
    eps = 2.0 ** -7
    spreads = [flush - eps, flush, flush + eps, flush + 2, 3.0, 9.5]
    n = 256
    rows = study.canonical_rows(spreads, n, "first", headroom)
    for r in rows:
        assert abs(r["model_deficit"] - r["closed_form_deficit"]) <= 1e-5, r
        assert abs(r["reference_deficit"]) <= 1e-12
    below, at, above = rows[0], rows[1], rows[2]
    # at and past the flush point the keys' whole share is gone; l's fp32 adds of
    # P * 2**H onto 2**H err by at most 64 half-ulps
    for r, d in ((at, flush), (above, flush + eps)):
        p = 2.0 ** -d
        assert r["model_deficit"] == pytest.approx((n - 1) * p / (1 + (n - 1) * p),
                                                   abs=64 * 2.0 ** -25)
    assert below["model_deficit"] < 0  # just above 2**-10: rounded up to 2**-9
    if headroom == 0.0:
        assert rows[5]["model_deficit"] < -0.05  # subnormal rounding at 9.5
    else:
        # lifted, 2**-9.5 is a normal e4m3 value: rounding, at most 2**-4 of the keys' share
        share = 255 * 2.0 ** -9.5 / (1 + 255 * 2.0 ** -9.5)
        assert 0 < rows[5]["model_deficit"] <= 2.0 ** -4 * share


def test_headroom_moves_the_flush_by_its_log2():
    r0 = study.canonical_rows([12.0], 512, "first", 0.0)[0]
    r8 = study.canonical_rows([12.0], 512, "first", 8.0)[0]
    assert r0["model_deficit"] == pytest.approx(511 / (4096 + 511), rel=1e-4)
    assert r8["model_deficit"] == 0.0  # 2**-12 * 2**8 = 2**-4: exact in e4m3


def test_a_dominant_key_last_costs_only_its_own_tile():
    n = 256  # 4 tiles; with the dominant key last only the last tile's 63 keys flush
    first = study.canonical_rows([12.0], n, "first", 0.0)[0]
    last = study.canonical_rows([12.0], n, "last", 0.0)[0]
    p = 2.0 ** -12
    assert last["model_deficit"] == pytest.approx(63 * p / (1 + 255 * p), rel=1e-4)
    assert last["predicted_deficit"] == pytest.approx(last["model_deficit"], rel=1e-4)
    assert first["model_deficit"] > 3 * last["model_deficit"]


@pytest.mark.parametrize("headroom", [0.0, 8.0])
def test_tile_aware_prediction_matches_the_model_on_gaussian_logits(headroom):
    # 128 heads of N(0, 9) logits over 256 keys: the fp64 prediction from the exact scores
    # (tile running maxima, the cast) against the model's fp32 output, V = 1
    row = study.gaussian_row(3.0, 256, headroom, seed=1)
    assert row["model_deficit"] == pytest.approx(row["predicted_deficit"], abs=1e-5)
    if headroom == 0.0:
        assert row["model_deficit"] > 1e-3
    else:
        assert abs(row["model_deficit"]) < 1e-3
