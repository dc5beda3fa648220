"""onset.bound for FlyDSL #1066's paged fp8 prefill (``fa_lab.studies.onset.paged_fp8``):
the dense fp8 region per sequence plus the pages the kernel reads past ``seqlen_k``. At
each exact edge an input +eps inside never fails and one -eps outside does (the model
decides); inputs inside the region never fail, against the fp64 reference."""

import dataclasses
import warnings

import pytest
import torch

import fa_lab
from fa_lab import policies
from fa_lab.kernels.swp_fp8 import paged_cases as pc
from fa_lab.numerics import log2_scale
from fa_lab.studies import onset
from fa_lab.studies.onset.bound import _floor_ls

FLOOR = "fp8 causal floor overflows"
PAST = "non-finite V in a page read past seqlen_k"
MASS = "silent mass loss (rounding and flushed tails)"


def run(case):
    return fa_lab.flash_attn_func(case.q8, case.k5, case.v5, **case.call, backend="emulator")


def measure(case, policy=None):
    return onset.paged_fp8.measure(case.q8, case.k5, case.v5, **case.call, policy=policy)


def nan_rows(out):
    return out.isnan().any(-1).any(-1)


def test_the_region_is_the_dense_fp8_region_per_sequence_and_the_pages_read_past():
    r = onset.bound("swp_fp8_paged")
    assert r.to_dict() == onset.bound("swp_fp8_paged:flydsl-6aeb4321").to_dict()
    pol = r.policy
    assert (pol.vote, pol.rebase, float(pol.threshold)) == ("wave", "max", 8.0)
    dense = onset.bound(pol, dtype="fp8")
    assert [h.name for h in r.hazards] == [h.name for h in dense.hazards] + [PAST]
    never = {h.name for h in r.hazards if h.never}
    assert "P saturation" in never        # H + THR = log2(448): no P passes 448
    assert "H = 0.807355" in next(h.formula for h in r.hazards if h.name == "accumulator overflow")
    assert "swp_fp8_paged" in r.describe() and r.to_dict()["version"] == "flydsl-6aeb4321"


def test_threshold_8_halves_the_headroom_the_mass_loss_bound_allows():
    """On one input, the mass-loss margin under threshold 6 (H = log2 448 - 6) is 2 log2
    units larger than under the builder's 8: the flushed tails' bound n 2^(-10 - H)."""
    case = pc.make([64], [128], seed=1)
    six = dataclasses.replace(policies.get("lazy"), threshold=6.0, p_headroom=True)
    m8, m6 = measure(case), measure(case, six)
    d = onset.paged_fp8.region(six).margins(m6)[MASS] - onset.bound("swp_fp8_paged").margins(m8)[MASS]
    assert d == pytest.approx(2.0, abs=1e-6)


def _ls_edge(kd=1.0):
    """(q_descale just inside, just outside) the causal floor's edge ls = 1.1342746."""
    lo, hi, edge = 1.0, 20.0, _floor_ls()
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if log2_scale(mid, kd, pc.HEAD_DIM) < edge else (lo, mid)
    return lo, hi


@pytest.mark.slow
def test_causal_floor_edge_plus_eps_holds_minus_eps_fails():
    """Sequence 0 has more query rows than keys: its first rows see nothing and the
    kernel's -ls * m meets the floored max. Just inside, those rows give 0; just outside,
    NaN; the other sequence is finite either way."""
    inside, outside = _ls_edge()
    assert 0 < outside - inside <= 1e-9 * outside
    region = onset.bound("swp_fp8_paged")
    got = {}
    for qd in (inside, outside):
        case = pc.make([70, 1], [64, 128], q_descale=qd, k_descale=1.0, seed=3)
        m = measure(case)
        with warnings.catch_warnings():   # the API warns of the overflow it runs into
            warnings.simplefilter("ignore", RuntimeWarning)
            out = run(case)
        got[qd] = (region.violated(m), region.margins(m)[FLOOR], nan_rows(out))
    v_in, m_in, bad_in = got[inside]
    v_out, m_out, bad_out = got[outside]
    assert v_in == [] and m_in > 0 and not bad_in.any()
    assert v_out == [FLOOR] and m_out <= 0
    assert bad_out[:6].all() and not bad_out[6:].any()    # 70 rows, 64 keys: 6 see none


def test_v_read_past_seqlen_k_is_exact():
    """Every slot with no key holds NaN. Sequence 0 ends on a pair (256 keys) and sequence 1
    on two pages (128 keys, its padding pair reading its own pages 0 and 1): inside, and
    finite. Cut sequence 1 to 100 keys (its last page's tail) or 150 (a partner page):
    outside, and exactly its rows come out NaN. NaN K there stays masked."""
    region = onset.bound("swp_fp8_paged")
    case = pc.make([40, 30], [256, 128], tail="nan", spare=2, seed=5)
    m = measure(case)
    assert region.contains(m) and not nan_rows(run(case)).any()
    for lens_k in ([256, 100], [256, 150]):
        case = pc.make([40, 30], lens_k, tail="nan", spare=2, seed=5)
        m = measure(case)
        assert region.violated(m) == [PAST] and [b for b, _ in m.read_past] == [1]
        bad = nan_rows(run(case))
        assert not bad[:40].any() and bad[40:].all()
        vf = case.vc.float()   # V finite again where it is read; K stays NaN there
        vc = torch.where(vf.isnan(), 1.0, vf).to(pc.FP8)
        fixed = case.with_cache(case.kc, vc)
        assert region.contains(measure(fixed)) and not nan_rows(run(fixed)).any()


@pytest.mark.parametrize("seed,k_mult", [(0, 1.0), (1, 8.0), (2, 40.0)])
def test_inputs_inside_the_region_do_not_fail(seed, k_mult):
    """Inside the region: every row that sees a key is finite and within the tolerance
    (0.25 max|V|) of the fp64 reference; a row that sees nothing gives 0."""
    case = pc.make([90, 20], [150, 256], k_mult=k_mult, seed=seed, tail="stale")
    region = onset.bound("swp_fp8_paged")
    assert region.contains(measure(case))
    out, ref = run(case).double(), pc.reference(case)
    vmax = max(float(v.float().abs().max()) for _, v in case.dense) * case.call["v_descale"]
    seen = ~ref.isnan().any(-1)
    assert ((out - ref).abs()[seen] <= region.dense.tolerance * vmax).all()
    assert (out[~seen] == 0).all()


def test_refusals_name_why():
    with pytest.raises(ValueError, match="semantics of its own"):
        onset.bound("swp_fp8_paged:sdpa_masked_row:before")
    with pytest.raises(ValueError, match="Python rule"):
        onset.paged_fp8.region(policies.Policy.from_rule(lambda **kw: None, name="r_s44"))
    case = pc.make([8], [128])
    with pytest.raises(TypeError, match="q8"):
        onset.paged_fp8.measure(case.q8.float(), case.k5, case.v5, **case.call)
    with pytest.raises(ValueError, match="block_table"):
        onset.paged_fp8.measure(case.q8, case.k5, case.v5, **{**case.call, "block_table": None})



def test_a_per_tile_call_is_answered_by_the_per_tile_region():
    """An odd page count runs #1066's per-tile kernel: its measure is the per-tile one and
    the paged region answers it with the per-tile region (onset.paged_fp8_tile)."""
    odd = pc.make([8], [3 * pc.PAGE])
    m = measure(odd)
    assert isinstance(m, onset.paged_fp8_tile.TileMeasure)
    r, tile = onset.bound("swp_fp8_paged"), onset.bound("swp_fp8_paged_tile")
    assert r.contains(m) and r.margins(m) == tile.margins(m)
    assert set(r.margins(m)) == {h.name for h in tile.hazards
                                 if not h.never and h.check(m)[1] is not None}
