"""The fp8 DUALWAVE_SWP kernel's main loop, shared by the dense model (``model``) and each
split of FlyDSL #1097's split-K (``split``): KV tiles in pairs, one vote per pair
(docs/semantics.md §4 and §16)."""

from __future__ import annotations

import torch

from fa_lab.numerics import CAUSAL_FLOOR, LN2, bf16, e4m3, exp2, f32, fma_f32, fmax, guarded_rcp

from . import FAMILY
from .._common.geometry import BLOCK_N, masked_columns
from .._common.models import decide


def tile_max(s: torch.Tensor) -> torch.Tensor:
    """A tile's row max as ``DualwaveFp8SoftmaxHelper.reduce_max`` folds it: maxNum from
    -inf (``_score_pair_max``), so a NaN score loses and a row of NaN and -inf gives -inf.
    Both fp8 kernels' maxima (the pair's ``max2`` and the causal floor are maxNum too)."""
    return torch.where(torch.isnan(s), float("-inf"), s).amax(-1)


def walk(qf, kp, vp, rows, t0, t_end, *, Sq, Skv, causal, policy, ls, saturate, headroom, rec):
    """The kernel's loop over KV tiles [t0, t_end), in pairs, from m = -inf, l = 0, O = 0
    (a split's first pair is 2 * (t0 // 2)): each pair's vote, rebase and P = e4m3 of
    exp2(fma(S, ls, H - ls * m)). Returns the running (m, l, O), unnormalised; O has v's
    head dim."""
    inf = float("inf")
    shape = (*qf.shape[:-1],)
    m = torch.full(shape, -inf, device=qf.device)
    l = torch.zeros(shape, device=qf.device)
    O = torch.zeros(*shape, vp.shape[-1], device=qf.device)

    def scores(t):
        s = qf @ kp[..., t * BLOCK_N:(t + 1) * BLOCK_N, :].transpose(-1, -2)
        return s.masked_fill(masked_columns(rows, t * BLOCK_N, Sq, Skv, causal), -inf)

    for p in range(t0 // 2, t_end // 2):
        tiles = (2 * p, 2 * p + 1)
        s_pair = [scores(t) for t in tiles]
        mt = fmax(tile_max(s_pair[0]), tile_max(s_pair[1]))  # maxNum throughout
        if causal:
            mt = fmax(mt, CAUSAL_FLOOR)
        dec = decide(policy, m, mt, ls, where=f"the {FAMILY.name} model",
                     at=f"KV tiles {2 * p}-{2 * p + 1} (step {p - t0 // 2})", rows=rows)
        O = O * dec.corr[..., None]
        l = l * dec.corr
        m = dec.target
        bias = (0.0 - ls * m) + headroom
        for t, s in zip(tiles, s_pair):
            P = exp2(fma_f32(s, ls, bias[..., None]))
            l = l + P.sum(-1)
            O = O + e4m3(P, saturate) @ vp[..., t * BLOCK_N:(t + 1) * BLOCK_N, :]
        if rec is not None and rec.active:
            false = torch.zeros_like(m, dtype=torch.bool)
            rec.record(p, tiles[0] * BLOCK_N, "pair", m=m, mt=mt,
                       vote=false if dec.vote is None else dec.vote,
                       fire=false if dec.fire is None else dec.fire,
                       swept=false if dec.swept is None else dec.swept, corr=dec.corr, l=l, O=O)
    return m, l, O


def run_group(qf, kp, vp, rows, N, Sq, Skv, causal, policy, ls, v_descale, saturate, rec):
    """One group of query blocks walking N tiles from m = -inf: (out bf16, lse). The
    epilogue folds the V descale into the reciprocal before it scales O,
    ``O * ((rcp(l) if l > 0 else 0) * v_descale)`` (the BN128 kernel's ``inv_l``); the LSE
    is the model's read-out ln l + (ls * m - H) ln 2 (-inf where l = 0). The dense model's
    and the paged one's."""
    inf = float("inf")
    headroom = f32(policy.p_headroom)
    m, l, O = walk(qf, kp, vp, rows, 0, N, Sq=Sq, Skv=Skv, causal=causal, policy=policy, ls=ls,
                   saturate=saturate, headroom=headroom, rec=rec)

    out = bf16(O * (guarded_rcp(l) * v_descale)[..., None])
    # ln(sum exp(S*ls*ln2)) = ln(l) + (ls*m - H) * ln 2
    lse = torch.where(l == 0, torch.full_like(l, -inf),
                      (m * ls - headroom) * f32(LN2) + torch.log(l))
    if rec is not None:
        rec.finish_group(out, lse)
    return out, lse
