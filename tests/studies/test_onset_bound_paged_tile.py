"""onset.bound for FlyDSL #1066's per-tile paged fp8 kernel (``fa_lab.studies.onset.
paged_fp8_tile``): at each hazard's edge an input built from its mechanism +eps inside never
fails on the model and one -eps outside does; inputs inside the region never fail against
the fp64 reference; ``onset.bound("swp_fp8_paged")`` answers a per-tile call."""

import math
import warnings

import numpy as np
import pytest
import torch

import fa_lab
from fa_lab.kernels.swp_fp8 import paged_cases as pc
from fa_lab.numerics import bf16, e4m3, log2_scale
from fa_lab.studies import onset
from fa_lab.studies.onset import paged_fp8_tile as pt
from fa_lab.studies.onset.bound import _floor_ls

MASS = "e4m3 flush of unscaled P (in l, not in O)"
OVER = "accumulator overflow"
FLOOR = "fp8 causal floor overflows"
PAST = "non-finite V in a page read past seqlen_k"
TOL = 0.25


def run(case):
    return fa_lab.flash_attn_func(case.q8, case.k5, case.v5, **case.call, backend="emulator")


def measure(case, policy=None):
    return onset.paged_fp8.measure(case.q8, case.k5, case.v5, **case.call, policy=policy)


def nan_rows(out):
    return out.isnan().any(-1).any(-1)


def spike(skv, q_descale, *, v_top=0.0, v_rest=1.0):
    """One query row, one head, ``skv`` keys (an odd page count: the per-tile kernel): raw
    fp8 score 16 at key 0 (V = ``v_top``), 0 at every other key (V = ``v_rest``); every
    descale 1 but q's, so the other keys sit 16 ls log2 units below the row max, which
    lies in the first tile."""
    case = pc.make([1], [skv], H=1, Hkv=1, q_descale=q_descale, k_descale=1.0, v_descale=1.0)
    q8 = torch.zeros_like(case.q8)
    q8[0, 0, 0] = 1.0
    k = torch.zeros(1, skv, 1, pc.HEAD_DIM)
    k[0, 0, 0, 0] = 16.0
    v = torch.full((1, skv, 1, pc.HEAD_DIM), v_rest)
    v[0, 0] = v_top
    k8, v8 = k.to(pc.FP8), v.to(pc.FP8)
    kc, vc = case.kc.clone(), case.vc.clone()
    bt = case.call["block_table"]
    for t in range(math.ceil(skv / pc.PAGE)):
        rows = slice(t * pc.PAGE, min((t + 1) * pc.PAGE, skv))
        kc[bt[0, t], : rows.stop - rows.start] = k8[0, rows]
        vc[bt[0, t], : rows.stop - rows.start] = v8[0, rows]
    out = case.with_cache(kc, vc)
    out.q8, out.dense = q8, [(k8, v8)]
    return out


def q_descale_for(ls):
    """A q descale whose ``log2_scale`` (k descale 1) is ``ls`` to fp32's rounding."""
    return ls / log2_scale(1.0, 1.0, pc.HEAD_DIM)


def test_the_region_and_its_flush_edge():
    """The builder's per-tile defaults: threshold 8, no P headroom, so no P passes 2^8 <
    448. The flush edge: the largest fp32 P that bf16 then e4m3 send to 0 is 2^-10 (1 +
    2^-8), the next fp32 value survives."""
    r = onset.bound("swp_fp8_paged_tile")
    assert r.to_dict() == onset.bound("swp_fp8_paged_tile:flydsl-6aeb4321").to_dict()
    pol = r.policy
    assert (pol.vote, pol.rebase, float(pol.threshold), float(pol.p_headroom)) == ("wave", "max", 8.0, 0.0)
    assert [h.name for h in r.hazards] == [MASS, OVER, "P saturation", FLOOR, "output overflow",
                                           "non-finite V", PAST]
    assert [h.name for h in r.hazards if h.never] == ["P saturation"]
    edge = torch.tensor([pt.FLUSH_P], dtype=torch.float32)
    above = torch.nextafter(edge, torch.tensor([1.0]))
    assert float(e4m3(bf16(edge))) == 0 and float(e4m3(bf16(above))) == 2.0 ** -9
    assert float(edge) == pt.FLUSH_P and pt.FLUSH_GAP == pytest.approx(9.9943755, abs=1e-7)
    assert "swp_fp8_paged_tile" in r.describe() and r.to_dict()["version"] == "flydsl-6aeb4321"


@pytest.mark.parametrize("side", [-1, 1])
def test_a_key_past_the_flush_gap_leaves_o_but_stays_in_l(side):
    """191 keys FLUSH_GAP -+ 1e-4 log2 units below the row's max (V = 1; the max's V = 0):
    inside the gap each reaches O (rounded up to 2^-9); past it O gets nothing, so the
    output is exactly 0 while l counts their 191 2^-10 of weight."""
    g = pt.FLUSH_GAP + side * 1e-4
    case = spike(192, q_descale_for(g / 16))
    out = run(case).double()[0, 0]
    ref = pc.reference(case)[0, 0]
    w = 191 * 2.0 ** -g
    assert float(ref[0]) == pytest.approx(w / (1 + w), rel=1e-5)
    m = measure(case)
    assert float(m.parts[0].flushed[0]) == (pytest.approx(w / (1 + w), rel=1e-5) if side > 0 else 0.0)
    if side > 0:
        assert (out == 0).all()
    else:
        assert float(out[0]) == pytest.approx(191 * 2.0 ** -9 / (1 + w), rel=2 ** -7)
    # either way the error stays within the bound the region charges
    assert float((out - ref).abs().max()) <= float(m.parts[0].err.max())


@pytest.mark.parametrize("side", [1, -1])
def test_mass_loss_edge_plus_eps_holds_minus_eps_fails(side):
    """575 flushed keys (V = 1) under a max key of V = 0 in the first tile: the output is
    exactly 0 and the error the flushed weight F = w / (1 + w), w = 575 2^-g. The edge F =
    0.25 lies at g = log2(575 * 3); 1e-4 log2 units wider the call is inside and within the
    tolerance, 1e-4 narrower outside and past it."""
    g = math.log2(575 * (1 - TOL) / TOL) + side * 1e-4
    case = spike(576, q_descale_for(g / 16))
    region = onset.bound("swp_fp8_paged_tile")
    m = measure(case)
    out, ref = run(case).double(), pc.reference(case)
    err = float((out - ref).abs().max())
    assert (out == 0).all()
    margin = region.margins(m)[MASS]
    if side > 0:
        assert region.contains(m) and 0 <= margin < 1e-3 and err <= TOL
    else:
        assert region.violated(m) == [MASS] and -1e-3 < margin < 0 and err > TOL


@pytest.mark.parametrize("side", [1, -1])
def test_accumulator_overflow_edge(side):
    """The overflow edge on a summary (the model cannot reach it: 2^111 keys): n keys at the
    stale base's full excess THR = 8, raw |V| = 448."""
    r = pt.region()
    hz = next(h for h in r.hazards if h.name == OVER)
    acc = math.log2(1 + 19 * 2.0 ** -24)   # four tiles
    log_n = 128 - 8 - math.log2(448) - acc - side * 1e-6
    part = pt.TilePart(n=np.array([2.0 ** log_n]), jup=np.array([20.0]), err=np.zeros(1),
                       flushed=np.zeros(1), v_max=448.0, v_raw_max=448.0, v_descale=1.0,
                       ls=0.1, causal_short=False, tiles=4)
    safe, margin = hz.check(pt.TileMeasure([part], []))
    assert safe == (side > 0) and abs(margin) < 1e-5


def _ls_edge():
    lo, hi, edge = 1.0, 20.0, _floor_ls()
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if log2_scale(mid, 1.0, pc.HEAD_DIM) < edge else (lo, mid)
    return lo, hi


def test_causal_floor_edge_plus_eps_holds_minus_eps_fails():
    """Sequence 0 has 70 query rows and 64 keys (3 pages for the other: the per-tile
    kernel): its first 6 rows see nothing and keep the prologue's floored max. Just inside
    the ls edge they give 0; just outside, NaN; every other row is finite."""
    inside, outside = _ls_edge()
    assert 0 < outside - inside <= 1e-9 * outside
    region = onset.bound("swp_fp8_paged_tile")
    got = {}
    for qd in (inside, outside):
        case = pc.make([70, 1], [64, 192], q_descale=qd, k_descale=1.0, seed=3)
        m = measure(case)
        assert isinstance(m, pt.TileMeasure)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            out = run(case)
        got[qd] = (region.violated(m), region.margins(m)[FLOOR], nan_rows(out), out)
    v_in, m_in, bad_in, out_in = got[inside]
    v_out, m_out, bad_out, _ = got[outside]
    assert FLOOR not in v_in and m_in > 0 and not bad_in.any() and (out_in[:6] == 0).all()
    assert FLOOR in v_out and m_out <= 0
    assert bad_out[:6].all() and not bad_out[6:].any()


def test_v_read_past_seqlen_k_is_exact():
    """Every slot with no key holds NaN V. Sequence 1 (3 pages) pads to 4 tiles, the last
    reading block_table[0, 0], sequence 0's one page. With 64 keys that page is full:
    inside, finite. With 63 its last slot is NaN: sequence 0 reads it as its page's tail
    and sequence 1 through its padding tile, and exactly their rows are NaN. A tail of
    sequence 1's own last page makes its rows alone NaN."""
    region = onset.bound("swp_fp8_paged_tile")
    case = pc.make([5, 30], [64, 192], tail="nan", seed=5)
    m = measure(case)
    assert m.pages[1][3] == int(case.call["block_table"][0, 0])
    assert region.contains(m) and not nan_rows(run(case)).any()
    case = pc.make([5, 30], [63, 192], tail="nan", seed=5)
    m = measure(case)
    assert region.violated(m) == [PAST] and [b for b, _ in m.read_past] == [0, 1]
    assert nan_rows(run(case)).all()
    # V finite again where it is read (K stays NaN there: masked): inside, finite
    vf = case.vc.float()
    fixed = case.with_cache(case.kc, torch.where(vf.isnan(), 1.0, vf).to(pc.FP8))
    assert region.contains(measure(fixed)) and not nan_rows(run(fixed)).any()
    # the tail alone: sequence 1 ends inside its last page, page 0 of the table is full
    case = pc.make([5, 30], [64, 191], tail="nan", seed=5)
    m = measure(case)
    assert region.violated(m) == [PAST] and [b for b, _ in m.read_past] == [1]
    bad = nan_rows(run(case))
    assert not bad[:5].any() and bad[5:].all()


@pytest.mark.parametrize("seed,k_mult", [(0, 1.0), (1, 8.0), (2, 40.0)])
def test_inputs_inside_the_region_do_not_fail(seed, k_mult):
    """Inside the region: every row is finite and within the tolerance (0.25 max|V|) of
    the fp64 reference, and within the region's own per-row bound E."""
    case = pc.make([90, 20], [150, 192], k_mult=k_mult, seed=seed, tail="stale")
    region = onset.bound("swp_fp8_paged")
    m = measure(case)
    assert isinstance(m, pt.TileMeasure) and region.contains(m)
    out, ref = run(case).double(), pc.reference(case)
    vmax = max(float(v.float().abs().max()) for _, v in case.dense) * case.call["v_descale"]
    assert ((out - ref).abs() <= TOL * vmax).all()
    cq = case.call["cu_seqlens_q"].tolist()
    for b, part in enumerate(m.parts):   # rows ordered (head, query row) in the measure
        e = (out - ref)[cq[b]:cq[b + 1]].abs().amax(-1).T.flatten() / part.v_max
        assert (e.numpy() <= part.err + 1e-6).all()


def test_refusals_name_why():
    with pytest.raises(ValueError, match="semantics of its own"):
        onset.bound("swp_fp8_paged_tile:sdpa_masked_row:before")
    with pytest.raises(ValueError, match="rebases a row below"):
        onset.bound("swp_fp8_paged_tile:lazy_unfixed")
    with pytest.raises(ValueError, match="tolerance"):
        pt.region(tolerance=1.5)
    # the paired-page region of a policy the per-tile region refuses stands, and a per-tile
    # call against it says why
    r = onset.bound("swp_fp8_paged:lazy_unfixed")
    odd = pc.make([8], [3 * pc.PAGE])
    with pytest.raises(ValueError, match="per-tile kernel: .*rebases a row below"):
        r.violated(measure(odd, "lazy"))


def _d192_case(lens_q, lens_k, D, Dv, seed=1):
    """Packed q [total_q, 2, D] and a linear page-64 cache (one kv head, a shuffled table,
    page 0 unnamed), N(0, 1) q and V, 2 N(0, 1) K, quantized per tensor at absmax / 448."""
    g = torch.Generator().manual_seed(seed)
    n = [math.ceil(s / pc.PAGE) for s in lens_k]
    nb = 1 + len(lens_k) * (max(n) + 1)
    q = torch.randn(sum(lens_q), 2, D, generator=g)
    ks = [2 * torch.randn(s, 1, D, generator=g) for s in lens_k]
    vs = [torch.randn(s, 1, Dv, generator=g) for s in lens_k]
    qd, kd, vd = (max(float(x.abs().max()) for x in xs) / 448 for xs in ([q], ks, vs))
    dense = [((k / kd).to(pc.FP8)[None], (v / vd).to(pc.FP8)[None]) for k, v in zip(ks, vs)]
    kc = torch.randn(nb, pc.PAGE, 1, D, generator=g).to(pc.FP8)
    vc = torch.randn(nb, pc.PAGE, 1, Dv, generator=g).to(pc.FP8)
    bt = (1 + torch.randperm(nb - 1, generator=g)).reshape(len(lens_k), -1).to(torch.int32)
    for b, (kb, vb) in enumerate(dense):
        for t in range(n[b]):
            rows = kb[0, t * pc.PAGE:(t + 1) * pc.PAGE].shape[0]
            kc[bt[b, t], :rows] = kb[0, t * pc.PAGE:t * pc.PAGE + rows]
            vc[bt[b, t], :rows] = vb[0, t * pc.PAGE:t * pc.PAGE + rows]
    cum = [torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32)
           for x in (lens_q, lens_k)]
    call = dict(cu_seqlens_q=cum[0], cu_seqlens_kv=cum[1], max_seqlen_q=max(lens_q),
                block_table=bt, seqlen_k=torch.tensor(lens_k, dtype=torch.int32),
                kv_cache_layout="vectorized", q_descale=qd, k_descale=kd, v_descale=vd)
    return (q / qd).to(pc.FP8), kc, vc, call, dense


@pytest.mark.parametrize("D,Dv", [(192, 128), (192, 192)])
def test_the_d192_calls_inside_do_not_fail(D, Dv):
    """(192, 128) and (192, 192) always run the per-tile kernel: inside the region, every
    row within its bound E of the fp64 reference."""
    q8, kc, vc, call, dense = _d192_case([40, 70], [200, 256], D, Dv)
    k5 = kc.reshape(*kc.shape[:3], D // 16, 16).permute(0, 2, 3, 1, 4).contiguous()
    v5 = vc.reshape(vc.shape[0], 4, 16, 1, Dv).permute(0, 3, 1, 4, 2).contiguous()
    m = onset.paged_fp8.measure(q8, k5, v5, **call)
    assert isinstance(m, pt.TileMeasure) and onset.bound("swp_fp8_paged").contains(m)
    out = fa_lab.flash_attn_func(q8, k5, v5, **call, backend="emulator").double()
    cq = call["cu_seqlens_q"].tolist()
    for b, ((kb, vb), part) in enumerate(zip(dense, m.parts)):
        q = q8[cq[b]:cq[b + 1]].double() * call["q_descale"]
        k, v = kb[0].double() * call["k_descale"], vb[0].double() * call["v_descale"]
        s = torch.einsum("qhd,khd->hqk", q, k.expand(-1, q.shape[1], -1)) / math.sqrt(D)
        sq, skv = q.shape[0], k.shape[0]
        vis = torch.arange(skv)[None, :] <= torch.arange(sq)[:, None] + (skv - sq)
        ref = torch.einsum("hqk,khd->qhd", torch.softmax(s.masked_fill(~vis, -math.inf), -1),
                           v.expand(-1, q.shape[1], -1))
        e = (out[cq[b]:cq[b + 1]] - ref).abs().amax(-1).T.flatten() / part.v_max
        assert (e.numpy() <= part.err).all() and float(part.err.max()) < TOL
