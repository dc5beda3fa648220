"""FlyDSL's gfx950 backward pass as its host runs it: ``delta = rowsum(dO * O)``, then the
dQ kernel (``dq``) and the dK/dV kernel (``dkdv``), all from the forward's O and LSE."""

from __future__ import annotations

from .common import check_backward, delta as row_delta
from .dkdv import backward_dkdv
from .dq import backward_dq


def backward(q, k, v, out, dout, lse, *, causal: bool, bias=None, dropout_p: float = 0.0,
             keep=None, lse_floor: bool = True):
    """(dq, dk, dv) in q's dtype. q, out, dout [B, Sq, H, D]; k, v [B, Skv, Hkv, D]; lse
    [B, H, Sq] fp32, the forward's natural-log LSE (-inf for a row that saw no key).
    ``lse_floor=False``: the dQ kernel without its LSE floor (a variant, for comparison)."""
    check_backward(q, k, v, out, dout, lse, causal=causal, bias=bias, dropout_p=dropout_p,
                   keep=keep)
    d = row_delta(out, dout)
    kw = dict(causal=causal, bias=bias, dropout_p=dropout_p, keep=keep)
    dq = backward_dq(q, k, v, dout, lse, d, lse_floor=lse_floor, **kw)
    dk, dv = backward_dkdv(q, k, v, dout, lse, d, **kw)
    return dq, dk, dv
