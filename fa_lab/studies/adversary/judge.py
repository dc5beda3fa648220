"""Judging one candidate: it runs under the policy, against the fp32 reference, and fails
where a row the reference keeps finite comes out NaN or inf, or its error passes the
tolerance (``Verdict``); ``fitness`` says how near a finite candidate came."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from .space import Candidate, KERNEL, build, build_mods


@dataclass
class Verdict:
    """The model's verdict on one candidate: ``failed``, the failing rows, the predictor's
    fitness (how close the closest judged row comes to 2^128, log2 units: ``_nearness``;
    above 128 once a row failed), whether the reference is finite on every row, the rows
    it leaves undefined (not judged: see the module docstring), the largest relative error
    on the rows both finite, and the seconds."""

    failed: bool
    bad_rows: list
    fitness: float
    ref_finite: bool
    max_err: float
    seconds: float
    undefined_rows: list = field(default_factory=list)


def judged_rows(ref: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """[Sq] bool: the rows of a [1, Sq, 1, D] reference output (and its [1, 1, Sq] LSE) whose
    attention is defined, so a policy's output there is judged: output row and LSE finite.
    A row with no finite logit (fully masked, no sink) has LSE -inf and is not judged."""
    return torch.isfinite(ref).all(-1)[0, :, 0] & torch.isfinite(lse)[0, 0, :]


def judge(c: Candidate, policy, *, threshold=None, tolerance=None, baseline=None) -> Verdict:
    """Run the model and the fp64 reference on ``c`` (its score modifiers too) under
    ``policy``. A row fails where the model's output is non-finite and the row is judged
    (``judged_rows``); with ``tolerance``, also where a finite row's max error exceeds
    ``tolerance * max|ref row|``. With ``baseline`` (a policy), a row counts only where the
    baseline's output is finite: the failure is the policy's own, not one every kernel
    shares."""
    from fa_lab import api, reference
    from fa_lab.studies import onset

    t0 = time.perf_counter()
    q, k, v = build(c)
    mods = build_mods(c)
    kw = {"causal": c.causal, "rescale": policy, "rescale_threshold": threshold,
          "kernel": KERNEL, **mods}
    out = api.flash_attn_func(q, k, v, backend="emulator", **kw)
    ref, lse = reference.attention(q, k, v, causal=c.causal, dtype=torch.float64, **mods)
    ref_ok = judged_rows(ref, lse)
    out_ok = torch.isfinite(out.float()).all(-1)[0, :, 0]
    bad = (~out_ok & ref_ok)
    if baseline is not None:
        base = api.flash_attn_func(q, k, v, backend="emulator", causal=c.causal,
                                   rescale=baseline, kernel=KERNEL, **mods)
        bad = bad & torch.isfinite(base.float()).all(-1)[0, :, 0]
    err = (out.double() - ref).abs().amax(-1)[0, :, 0]
    scale = ref.abs().amax(-1)[0, :, 0].clamp_min(1e-300)
    rel = torch.where(out_ok & ref_ok, err / scale, torch.zeros_like(err))
    if tolerance is not None:
        bad = bad | (rel > tolerance)
    rows = ref_ok
    near = _nearness(q, k, v, kw)
    if baseline is not None:  # climb where the policy nears 2^128 and the baseline does not:
        nb = _nearness(q, k, v, {**kw, "rescale": baseline, "rescale_threshold": None})
        rows = rows & (nb < onset.OVERFLOW_LOG2)   # rows the baseline is predicted to lose
        fb = float(nb[rows].max()) if rows.any() else -1e3      # are not the policy's
    fit = float(near[rows].max()) if rows.any() else -1e3
    if baseline is not None:
        fit -= 2.0 * max(0.0, fb - (onset.OVERFLOW_LOG2 - 8.0))
    if bool(bad.any()):
        fit = max(fit, onset.OVERFLOW_LOG2) + 1.0
    return Verdict(failed=bool(bad.any()), bad_rows=bad.nonzero().flatten().tolist(), fitness=fit,
                   ref_finite=bool(ref_ok.all()), max_err=float(rel.max()),
                   seconds=time.perf_counter() - t0,
                   undefined_rows=(~ref_ok).nonzero().flatten().tolist())


def _nearness(q, k, v, kw) -> torch.Tensor:
    """[Sq]: the predictor's estimate of how close each row comes to 2^128 (log2 units,
    within -1e3 .. 1e3); a row it predicts non-finite for another reason (a base of -inf)
    counts as reaching it. The sink is left out: folded in after the last tile by an
    upward-only rebase, it changes no row from finite to non-finite or back."""
    from fa_lab.studies import onset

    try:
        pred = onset.predict(q, k, v, level="tile", **{n: x for n, x in kw.items() if n != "sink"})
    except (NotImplementedError, ValueError):
        return torch.full((q.shape[1],), -1e3)
    near = onset.OVERFLOW_LOG2 - pred.margin[0, :, 0]
    near = torch.where(pred.bad[0, :, 0], near.clamp(min=onset.OVERFLOW_LOG2), near)
    return near.clamp(min=-1e3, max=1e3)
