"""The fp8 family's arithmetic in upstream's order (docs/semantics.md §3.1, §3.2):

* ``ls = c * (q_descale * k_descale)``: the descales' product first
  (``DualwaveFp8KernelContext.init_descale``);
* the epilogue folds the V descale into the reciprocal, ``O * (rcp(l) * v_descale)``
  (the BN128 kernel's ``inv_l``);
* a tile's row max is maxNum (``reduce_max``, ``max2``): a NaN score loses.

Each test holds a case where the other order, or a NaN-propagating max, gives other bits,
and checks the model, and where named the faithful port, against values computed here
independently of both."""

import math

import numpy as np
import pytest
import torch

import fa_lab
from fa_lab import numerics
from fa_lab.kernels.swp_fp8 import faithful, model
from fa_lab.policies import resolve
from fa_lab.studies.experiments import quantize_e4m3

FP8 = torch.float8_e4m3fn
F32 = np.float32


@pytest.mark.parametrize("D, qd, kd", [(128, 0.05, 0.01), (192, 0.01, 0.03), (128, 0.1, 1 / 448)])
def test_log2_scale_multiplies_the_descales_first(D, qd, kd):
    c = F32(F32(1 / math.sqrt(D)) * F32(math.log2(math.e)))
    upstream = F32(c * F32(F32(qd) * F32(kd)))
    other = F32(F32(c * F32(qd)) * F32(kd))
    assert upstream != other  # the case tells the two orders apart
    assert numerics.log2_scale(qd, kd, D) == float(upstream)


def _epilogue_case():
    """One query row of zeros against three equal keys: S = 0, so P = exp2(0) = 1 for each
    key under eager with no headroom, l = 3 and O = 3 * v exactly; ``vd`` and the V values
    put some columns' two orders on different sides of a bf16 rounding boundary."""
    vals = torch.arange(-448.0, 449.0, 0.25).to(FP8).float().unique()
    row = torch.cat([vals[vals < 0][-64:], vals[vals > 0][-64:]])  # 128 e4m3 values
    q8 = torch.zeros(1, 1, 1, 128).to(FP8)
    k8 = torch.ones(1, 3, 1, 128).to(FP8)
    v8 = row.to(FP8).reshape(1, 1, 1, 128).expand(1, 3, 1, 128).contiguous()
    vd = 0.0037516276352107525  # an fp32 value
    o = 3.0 * row
    rcp = torch.tensor(1.0) / torch.tensor(3.0)
    folded = (o * (rcp * torch.tensor(vd))).to(torch.bfloat16)
    unfolded = ((o * rcp) * torch.tensor(vd)).to(torch.bfloat16)
    return (q8, k8, v8), dict(q_descale=1.0, k_descale=1.0, v_descale=vd), folded, unfolded


def test_the_epilogue_folds_the_v_descale_into_the_reciprocal():
    inputs, ds, folded, unfolded = _epilogue_case()
    assert int((folded != unfolded).sum()) >= 4  # columns where the order shows
    pol = resolve(fp8=True, seqlen_kv=3, rescale="eager", p_headroom=False)
    out, _ = model.forward(*inputs, **ds, causal=False, policy=pol)
    assert torch.equal(out[0, 0, 0], folded)


def test_the_ports_epilogue_folds_it_too():
    inputs, ds, folded, _ = _epilogue_case()
    pol = resolve(fp8=True, seqlen_kv=3, rescale="eager", p_headroom=False)
    out, _ = faithful.forward(*inputs, **ds, causal=False, policy=pol, interpret=True)
    assert torch.equal(out[0, 0, 0], folded)


def _nan_key_case():
    """Causal, 256 rows and keys. Key 150 is NaN; keys 151-159 are large, aligned with
    rows 151-159. Rows 150-255 see the NaN and come out NaN. In the pair of tiles 2-3, wave
    128-159's rows from 151 also see the large keys: with a maxNum tile max their jump
    exceeds the threshold and the wave fires; a NaN-propagating max would hide it (tile
    2's max NaN, tile 3 masked, the floor taking the NaN's place) and leave rows 128-149
    on their stale base. ``ref``: key 150 finite instead, where rows 151-159 vote the same."""
    g = torch.Generator().manual_seed(0)
    q8, qd = quantize_e4m3(torch.randn(1, 256, 1, 128, generator=g))
    k8, kd = quantize_e4m3(torch.randn(1, 256, 1, 128, generator=g))
    v8, vd = quantize_e4m3(torch.randn(1, 256, 1, 128, generator=g))
    big = torch.sign(q8[0, 151:160, 0].float().sum(0)) * 448
    k8[0, 151:160, 0] = big.to(FP8)
    kn = k8.clone()
    kn.view(torch.uint8)[0, 150, 0, :] = 0x7F  # e4m3 NaN
    pol = resolve(fp8=True, seqlen_kv=256, rescale="lazy", rescale_threshold=8.0, p_headroom=True)
    return (q8, kn, v8), (q8, k8, v8), dict(q_descale=qd, k_descale=kd, v_descale=vd), pol


def test_a_nan_score_loses_the_tile_max():
    nan_in, ref_in, ds, pol = _nan_key_case()
    out, lse = model.forward(*nan_in, **ds, causal=True, policy=pol)
    ref, ref_lse = model.forward(*ref_in, **ds, causal=True, policy=pol)
    assert torch.isnan(out[0, 150:]).all() and torch.isnan(lse[0, 0, 150:]).all()
    assert torch.equal(out[0, :150], ref[0, :150])  # bit for bit, the wave's fire included
    assert torch.equal(lse[0, 0, :150], ref_lse[0, 0, :150])


@pytest.mark.parametrize("backend", ["emulator", "interpret"])
def test_the_row_that_sees_the_nan_votes_on_its_finite_max(backend):
    """The model and the port record it: at step 1 (tiles 2-3) row 155's tile max is its
    finite maximum, past the threshold, so it votes and its wave fires; row 140 (no NaN in
    view) is rebased by that fire."""
    (q8, kn, v8), _, ds, _ = _nan_key_case()
    with pytest.warns(RuntimeWarning, match="non-finite"):
        tr = fa_lab.trace(q8, kn, v8, rows=[140, 155], causal=True, rescale="lazy",
                          rescale_threshold=8.0, p_headroom=True, backend=backend, **ds)
    st = tr.steps.set_index(["row", "step"])
    assert math.isfinite(st.loc[(155, 1), "mt"]) and st.loc[(155, 1), "mt"] > -1e38
    assert st.loc[(155, 1), "vote"] and st.loc[(140, 1), "fire"]
    assert not st.loc[(140, 1), "vote"]
