"""The decode region's P-cast hazards (``bound.region``'s ``p_cast_flush``): P is in (0, 1]
(the max is eager per tile) and meets only its cast factor w before e4m3, 448 per tensor or
v_scale[t] 448 / vmax per token. A valid token whose gap (m - x) - log2 w reaches 10 rounds
to 0: its P stays in l, its value leaves O. +eps inside the edge keeps the token's value in
the output, -eps outside loses it; a per-token V-scale outlier flushes its tile's other
tokens."""

import pytest
import torch

from fa_lab import decode
from fa_lab.kernels.pa_decode import bound, cases, model
from fa_lab.numerics import E4M3_MAX

FLUSH = "p_cast_flush"


def two_tokens(*, per_token=False, k=(1.0, 0.0), v_scale=(1.0, 1.0)):
    """One sequence of 2 tokens, one query row, D = 64, q all ones (q8 = 448): token t's K
    is ``k[t]`` and its V 0 (token 0) or 1 (token 1) in every dimension; scales 1 unless
    ``v_scale`` (per token) says otherwise."""
    case = cases.make([2], query_length=1, num_q_heads=1, head_dim=64, block_size=16,
                      per_token=per_token, seed=0, shuffle=False, spare_pages=0)
    case.query.fill_(1.0)
    page = int(case.block_tables[0, 0])
    for t in range(2):
        case.key_cache[page, 0, :, t, :] = torch.tensor(k[t]).to(torch.float8_e4m3fn)
        case.value_cache[page, 0, 0, :, t] = torch.tensor(float(t)).to(torch.float8_e4m3fn)
    case.key_scale.fill_(1.0)
    case.value_scale.fill_(1.0)
    if per_token:
        case.value_scale[page, 0, 0], case.value_scale[page, 0, 1] = v_scale
    return case


def run(case, sm):
    return decode.pa_decode_tile(*case.args(), softmax_scale=sm, num_partitions=1).float()


def margin(case, sm):
    return bound.region().margins(bound.measure(case, num_partitions=1, softmax_scale=sm))[FLUSH]


def test_per_tensor_flush_edge_plus_eps_keeps_minus_eps_loses():
    case = two_tokens()
    lo, hi = 0.1, 0.3            # the gap is 64 sm log2(e) - log2(448): 10 near sm = 0.204
    assert margin(case, lo) > 0 >= margin(case, hi)
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if margin(case, mid) > 0 else (lo, mid)
    assert 0 < hi - lo < 1e-6
    # eps: 1e-5 relative in sm, about 1e-4 log2 units of gap, past the fp32 rounding of
    # the kernel's exponent (a few 2^-24 relative), which the closed form does not carry
    lo, hi = lo * (1 - 1e-5), hi * (1 + 1e-5)
    region = bound.region()
    inside = bound.measure(case, num_partitions=1, softmax_scale=lo)
    outside = bound.measure(case, num_partitions=1, softmax_scale=hi)
    # at the flush edge P w is subnormal already (the precision hazard, from gap 6)
    assert region.violated(inside) == ["p_cast_subnormal"]
    assert region.violated(outside) == ["p_cast_subnormal", FLUSH]
    assert (run(case, lo) > 0).all()        # token 1's value survives its cast
    assert (run(case, hi) == 0).all()       # flushed: the row reads 0 where the answer is > 0
    assert (cases.reference(case, hi) > 0).all()


def test_a_per_token_v_scale_outlier_flushes_the_other_tokens():
    """Equal scores (gap log2(vmax / v_scale) - log2(448)): a V scale 2^20 times its
    neighbour's flushes the neighbour; 2^18 does not."""
    region = bound.region()
    for ratio, lost in ((2.0 ** 18, False), (2.0 ** 20, True)):
        case = two_tokens(per_token=True, k=(0.0, 0.0), v_scale=(ratio, 1.0))
        m = bound.measure(case, num_partitions=1)
        gap = float(m.p_cast_gap.max())
        assert gap == pytest.approx(torch.log2(torch.tensor(ratio / E4M3_MAX)).item(), abs=1e-4)
        assert (FLUSH in region.violated(m)) is lost
        out, ref = run(case, 64 ** -0.5), cases.reference(case)
        assert ref.double().sub(0.5).abs().max() < 1e-12   # two equal weights, V = 0 and 1
        assert bool((out == 0).all()) is lost


def test_the_gap_is_the_model_own_cast():
    """Over random tiles, a token the gap puts past 10 packs to e4m3 zero and one before it
    does not (per tensor), from ``model.p_cast_gap`` against the P the model casts."""
    g = torch.Generator().manual_seed(0)
    s_raw = torch.randn(4, model.TILE_TOK, generator=g) * 3000
    valid = torch.ones(4, model.TILE_TOK, dtype=torch.bool)
    scale = torch.full((4,), 0.01)
    m_new = (s_raw * scale[:, None]).amax(1)
    from fa_lab.upstream import check_decode
    gap = model.p_cast_gap(m_new, s_raw, valid, None, None, scale, ver=check_decode(None))
    p = torch.exp2(s_raw * scale[:, None] - m_new[:, None])
    zero = (p * E4M3_MAX).to(torch.float8_e4m3fn).float() == 0
    per_tok = m_new[:, None].double() - (s_raw * scale[:, None]).double() - torch.log2(torch.tensor(448.0)).double()
    assert torch.allclose(gap, per_tok.amax(1))
    assert (zero == (per_tok >= 10))[(per_tok - 10).abs() > 1e-4].all()
