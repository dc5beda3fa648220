"""The sliding-window decode's region (``kernels/pa_decode/swa_bound.py``,
``onset.bound("pa_decode_swa")``): the P cast's flush edge (+eps keeps the token's value,
-eps loses it), dropped tiles, rows no computed tile shows anything, and NaN anywhere in a
computed tile, each against the model; inputs inside never fail."""

import random

import pytest
import torch

from fa_lab import decode
from fa_lab.kernels.pa_decode import cases, swa, swa_bound

FLUSH = "p_cast_flush"


def make(ctx, **kw):
    kw.setdefault("num_q_heads", 1)
    return cases.make(ctx, block_size=swa.PAGE, spare_pages=1, **kw)


def run(case, window, npart=None, sm=None):
    out = torch.empty_like(case.query)
    ql = case.query.shape[0] // case.context_lengths.shape[0]
    npart = swa.recommended_partitions(window, ql) if npart is None else npart
    decode.pa_decode_ps_launch(out, case.query, case.key_cache, case.value_cache,
                               case.context_lengths, None, None, sm, case.key_scale,
                               case.value_scale, sliding_window=window,
                               block_tables=case.block_tables, max_context_partition_num=npart)
    return out.float()


def two_tokens():
    """Context 2, window 1, one row: it sees tokens 0 (K 1, V 0) and 1 (K 0, V 1); q all
    ones. The gap of token 1 is 64 sm log2(e) (per tensor), continuous in sm."""
    case = make([2], head_dim=64, shuffle=False, seed=0)
    case.query.fill_(1.0)
    page = int(case.block_tables[0, 0])
    for t in range(2):
        case.key_cache[page, 0, :, t, :] = torch.tensor(1.0 - t).to(torch.float8_e4m3fn)
    v = case.value_cache  # trans_v [nb, hkv, bs/16, D, 16]
    v[page, 0, 0, :, 0] = torch.tensor(0.0).to(torch.float8_e4m3fn)
    v[page, 0, 0, :, 1] = torch.tensor(1.0).to(torch.float8_e4m3fn)
    case.key_scale.fill_(1.0)
    case.value_scale.fill_(1.0)
    return case


def test_flush_edge_plus_eps_keeps_minus_eps_loses():
    case, region = two_tokens(), swa_bound.region()

    def margin(sm):
        return region.margins(swa_bound.measure(case, sliding_window=1, softmax_scale=sm))[FLUSH]

    lo, hi = 0.05, 0.2           # 64 sm log2(e) = 10 near sm = 0.108
    assert margin(lo) > 0 >= margin(hi)
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if margin(mid) > 0 else (lo, mid)
    assert 0 < hi - lo < 1e-6
    # eps: 1e-5 relative in sm, about 1e-4 log2 units of gap, past the fp32 rounding of
    # the kernel's exponent (a few 2^-24 relative), which the closed form does not carry
    lo, hi = lo * (1 - 1e-5), hi * (1 + 1e-5)
    inside = swa_bound.measure(case, sliding_window=1, softmax_scale=lo)
    outside = swa_bound.measure(case, sliding_window=1, softmax_scale=hi)
    assert region.violated(inside) == ["p_cast_subnormal"]
    assert region.violated(outside) == ["p_cast_subnormal", FLUSH]
    assert (run(case, 1, sm=lo) > 0).all() and (run(case, 1, sm=hi) == 0).all()
    assert (cases.reference(case, hi, sliding_window=1) > 0).all()


def structural(region, m):
    """The hazards ``m`` violates other than the P cast's (N(0, 1) scores over D = 64
    reach gaps past 6 in most tiles: no headroom)."""
    return [h for h in region.violated(m) if not h.startswith("p_cast")]


def test_dropped_tiles_empty_rows_and_nan_in_a_computed_tile():
    region = swa_bound.region()
    case = make([900], seed=1)   # window 600: tiles 1..3 visible
    full = swa_bound.measure(case, sliding_window=600, num_partitions=3)
    assert structural(region, full) == []
    drop = swa_bound.measure(case, sliding_window=600, num_partitions=2)
    assert structural(region, drop) == ["dropped_tiles"]
    ref = cases.reference(case, sliding_window=600)
    assert float((run(case, 600, 2).double() - ref).abs().max()) > 0.05
    assert float((run(case, 600, 3).double() - ref).abs().max()) < 0.05
    # QL 4 over a context of 2: rows 0 and 1 see nothing; NP 2 makes them NaN, NP 1 zero
    short = make([2], query_length=4, seed=2)
    assert structural(region, swa_bound.measure(short, sliding_window=8, num_partitions=2)) == [
        "empty_row"]
    assert run(short, 8, 2)[:2].isnan().all()
    assert structural(region, swa_bound.measure(short, sliding_window=8, num_partitions=1)) == []
    assert (run(short, 8, 1)[:2] == 0).all()
    # NaN past the context inside the last computed tile: every row NaN
    tail = cases.make([900], block_size=swa.PAGE, spare_pages=1, num_q_heads=1, seed=1,
                      tail="nan")
    assert structural(region, swa_bound.measure(tail, sliding_window=600, num_partitions=3)) == [
        "nonfinite_tile"]
    assert run(tail, 600, 3).isnan().all()
    # NaN before the window, in a tile no partition computes: nothing happens
    late = cases.make([1000], block_size=swa.PAGE, spare_pages=1, num_q_heads=1, seed=1)
    page = int(late.block_tables[0, 0])
    late.value_cache.view(torch.uint8)[page, :, 0] = 0x7F   # tokens 0..15, tile 0
    assert structural(region, swa_bound.measure(late, sliding_window=300)) == []
    assert not run(late, 300).isnan().any()


def test_inside_the_region_no_row_fails():
    """K scaled down (k_mult 0.05: every gap below 6) so the draws land inside."""
    rng = random.Random(3)
    region = swa_bound.region()
    inside = 0
    for _ in range(4):
        ql, w = rng.randint(1, 4), rng.randint(50, 700)
        case = make([rng.randint(ql, 1200)], query_length=ql, per_token=rng.random() < 0.5,
                    seed=rng.randint(0, 99), k_mult=0.05)
        m = swa_bound.measure(case, sliding_window=w)
        if region.contains(m):
            inside += 1
            out, ref = run(case, w).double(), cases.reference(case, sliding_window=w)
            seen = ~ref.isnan().any(-1)
            assert torch.isfinite(out[seen]).all()
            vmax = float(case.value_scale.max()) * 448
            assert float((out - ref).abs()[seen].max()) <= 2.0 ** -4 * vmax
    assert inside >= 3


def test_the_onset_bound_hook():
    from fa_lab.studies import onset

    r = onset.bound("pa_decode_swa")
    assert r.kernel == "pa_decode_swa" and r.upstream == "main-11c4174d"
    assert [h.name for h in r.hazards] == ["p_cast_subnormal", FLUSH, "dropped_tiles",
                                           "empty_row", "nonfinite_tile"]
    assert onset.bound("pa_decode_swa:flydsl-985c653a^").upstream == "flydsl-985c653a^"
    with pytest.raises(ValueError, match="upstream"):
        swa_bound.region("main-00000000")
