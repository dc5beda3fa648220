"""The MLA decode's safe region (``kernels/mla_decode/bound.py``): its spread measure by
hand, and its two boundaries against what the model does to a dominant key and keys at a
given spread below it."""

import math

import pytest
import torch

from fa_lab.kernels.mla_decode import bound
from fa_lab.kernels.mla_decode import model as M


def item(low: float, n_low: int = 63):
    """One dominant key (score 0) then ``n_low`` keys at raw score ``low``, V column 1 = 1;
    q picks dimension 0, scale 1, so a key's spread is -low * log2 e (log2 units)."""
    q = torch.zeros(M.NUM_HEADS, M.QK_HEAD_DIM)
    q[:, 0] = 1.0
    kv = torch.zeros(1 + n_low, M.QK_HEAD_DIM)
    kv[1:, 0] = low
    kv[:, 1] = 1.0
    return q, kv


@pytest.mark.parametrize("low, violated", [(-3.0, []), (-5.0, ["p_subnormal"]),
                                           (-8.0, ["p_subnormal", "p_flush"])])
def test_the_boundaries_against_the_model(low, violated):
    q, kv = item(low)
    m = bound.measure(q, kv, 1.0)
    d = -low * math.log2(math.e)
    assert torch.allclose(m.spread, torch.full((M.NUM_HEADS,), d, dtype=torch.float64), atol=1e-5)
    region = bound.region()
    assert region.violated(m) == violated
    out, _ = M.work_item(q, kv, 1.0)
    p = 2.0 ** -d
    kept = 1.0 / (1.0 + 63 * p)  # the dominant key's share: what O keeps once P flushes
    if "p_flush" in violated:
        assert torch.allclose(out[:, 1].double(), torch.full((M.NUM_HEADS,), kept,
                                                             dtype=torch.float64), rtol=1e-5)
    else:
        assert float((out[:, 1] - 1.0).abs().max()) <= 2.0 ** -4


def test_a_headroom_moves_both_boundaries():
    q, kv = item(-8.0)
    m = bound.measure(q, kv, 1.0)
    lifted = bound.region(headroom=2.0)
    assert lifted.violated(m) == ["p_subnormal"]
    assert lifted.margins(m)["p_flush"] == pytest.approx(12.0 - 8.0 * math.log2(math.e))


def test_the_onset_bound_hook_and_bad_input():
    from fa_lab.studies import onset

    assert onset.bound("mla_decode").kernel == "mla_decode"
    with pytest.raises(ValueError, match="upstream"):
        bound.region("main-11c4174d")
    with pytest.raises(ValueError, match="headroom"):
        bound.region(headroom=-1)
