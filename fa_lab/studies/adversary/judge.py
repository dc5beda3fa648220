"""Judging one candidate: it runs under the policy, against the fp32 reference, and fails
where a row the reference keeps finite comes out NaN or inf, or its error passes the
tolerance (``Verdict``); ``fitness`` says how near a finite candidate came.

A policy with semantics of its own (the failure zoo's: ``space.kernel_for``) is judged on
the online-softmax family's model, for the classes of failure ``CLASSES`` names (its
entry's, by default: ``default_classes``)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from fa_lab.dispatch import routing_quiet

from .space import Candidate, KERNEL, build, build_mods, first_tile_visible, kernel_for

#: The classes of failure the judge can count. ``nonfinite``: a row that sees a key (its
#: reference is defined) comes out NaN or inf; ``empty``: a row that sees no key comes out
#: anything but 0 (NaN, or a finite nonzero value such as the mean of V); ``silent``: a
#: finite row that sees a key is off the fp64 reference by more than ``silent_tol`` times
#: max|V| (mass lost or gained, nothing flags it); ``saturation``: some P passed its cast's
#: largest finite value; ``nan_factor``: a NaN factor multiplied some row's O. The last two
#: are read from the online-softmax model's per-tile records.
CLASSES = ("nonfinite", "empty", "silent", "saturation", "nan_factor")
#: The default ``silent_tol``: above what an e4m3 P cast's rounding (2^-4 of a P) can move
#: an output, far below the failures' (the FA4 saturation loses up to 89 % of a weight).
SILENT_TOL = 0.25


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
    classes: list = field(default_factory=list)


def judged_rows(ref: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """[Sq] bool: the rows of a [1, Sq, 1, D] reference output (and its [1, 1, Sq] LSE) whose
    attention is defined, so a policy's output there is judged: output row and LSE finite.
    A row with no finite logit (fully masked, no sink) has LSE -inf and is not judged."""
    return torch.isfinite(ref).all(-1)[0, :, 0] & torch.isfinite(lse)[0, 0, :]


def default_classes(policy) -> tuple:
    """What the attack counts for ``policy`` unless told: a zoo preset's entry's class of
    failure (``Entry.failure``), every class for another policy with semantics of its own,
    and ``("nonfinite",)`` for the lab's FlyDSL policies (the attack as it always was)."""
    if kernel_for(policy) == KERNEL:
        return ("nonfinite",)
    from fa_lab import zoo

    found = zoo.entry_of(policy)
    return tuple(found[0].failure) if found is not None else CLASSES


def check_classes(policy, classes) -> tuple:
    """``classes`` (None: ``default_classes``; a comma-separated str or names) as a tuple
    of ``CLASSES``; the last four need the online-softmax family's model. ValueError or
    TypeError naming ``classes``."""
    if classes is None:
        return default_classes(policy)
    names = [x.strip() for x in classes.split(",")] if isinstance(classes, str) else list(classes)
    if not names or not all(isinstance(x, str) for x in names):
        raise TypeError(f"classes must name classes of failure as str, got {classes!r}")
    bad = [x for x in names if x not in CLASSES]
    if bad:
        raise ValueError(f"classes: unknown class {bad[0]!r}; choose from {', '.join(CLASSES)}")
    if kernel_for(policy) == KERNEL and set(names) != {"nonfinite"}:
        raise ValueError(f"classes: {getattr(policy, 'name', policy)!r} runs on {KERNEL}, whose "
                         "attack counts non-finite rows only (classes='nonfinite'); the other "
                         "classes are judged on the online-softmax family's model")
    return tuple(x for x in CLASSES if x in names)


@routing_quiet()
def judge(c: Candidate, policy, *, threshold=None, tolerance=None, baseline=None, classes=None,
          silent_tol: float = SILENT_TOL) -> Verdict:
    """Run the model and the fp64 reference on ``c`` (its score modifiers too) under
    ``policy``. A row fails where the model's output is non-finite and the row is judged
    (``judged_rows``); with ``tolerance``, also where a finite row's max error exceeds
    ``tolerance * max|ref row|``. With ``baseline`` (a policy), a row counts only where the
    baseline's output is finite: the failure is the policy's own, not one every kernel
    shares. A policy with semantics of its own is judged for ``classes`` instead
    (``check_classes``; ``zoo_judge``)."""
    from fa_lab import api, reference
    from fa_lab.studies import onset

    if kernel_for(policy) != KERNEL:
        if baseline is not None or tolerance is not None:
            raise ValueError("baseline and tolerance apply to the FlyDSL policies' attack; a "
                             "policy with semantics of its own is judged by classes")
        return zoo_judge(c, policy, threshold=threshold, classes=check_classes(policy, classes),
                         silent_tol=silent_tol)
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
                   undefined_rows=(~ref_ok).nonzero().flatten().tolist(),
                   classes=["nonfinite"] if bool(bad.any()) else [])


def run_online(c: Candidate, policy, *, threshold=None, recorder=None):
    """(out, lse, records, q, k, v, mods) of ``c`` under ``policy`` on the online-softmax
    family: the call is checked and resolved as ``flash_attn_func`` would
    (``api.plan``, kernel="online"), then its model runs with the candidate's KV length
    (``Candidate.kv_used``: a dense call has no argument for a cache's tail)."""
    from fa_lab import api
    from fa_lab.kernels.online import model

    q, k, v = build(c)
    mods = build_mods(c)
    planned = api.plan(q, k, v, causal=c.causal, rescale=policy, rescale_threshold=threshold,
                       backend="emulator", kernel=kernel_for(policy), **mods)
    records: list = []
    seqlen = None if c.kv_used == c.seqlen_kv else c.kv_used
    out, lse = model.forward(q, k, v, policy=planned.call.policy, causal=c.causal,
                             seqlen_kv=seqlen, record=records, recorder=recorder, **mods)
    return out, lse, records, planned.call.policy, (q, k, v, mods)


def reference_of(c: Candidate, q, k, v, mods, *, softcap: float | None = None):
    """The fp64 reference of ``c`` over its valid keys (``kv_used``): (out, lse); a row
    with no valid key gives 0 and LSE -inf. A bias entry whose log2-unit value overflows
    fp32 (bf16's ``finfo.min``, -3.4e38, times log2 e) masks its key here as it does in
    every kernel that folds log2 e into the bias: such a key is a mask, not a logit.
    ``softcap`` (a policy's ``semantics.softcap``): each scaled score t becomes
    ``cap * tanh(t / cap)`` (exact tanh, fp64) before the bias and the masks, the
    attention the capped kernel is asked for (``softcap_reference``)."""
    from fa_lab import reference
    from fa_lab.numerics import LOG2E

    n = c.kv_used
    if n == 0:
        return (torch.zeros(q.shape, dtype=torch.float64),
                torch.full((1, 1, q.shape[1]), -math.inf, dtype=torch.float64))
    bias = mods.get("bias")
    if bias is not None:
        bias = bias[:, :n].double()
        bias = bias.masked_fill(torch.isinf((bias * LOG2E).float()), -math.inf)
    if softcap:
        return softcap_reference(q, k[:, :n], v[:, :n], softcap, causal=c.causal, bias=bias)
    return reference.attention(q, k[:, :n], v[:, :n], causal=c.causal, dtype=torch.float64,
                               bias=bias)


def softcap_reference(q, k, v, cap: float, *, causal: bool = False, bias=None,
                      softmax_scale: float | None = None):
    """fp64 attention with a softcapped score: q [B, Sq, H, D], k and v [B, Skv, Hkv, D];
    ``s = cap * tanh(scale * q . k / cap) + bias`` (``bias`` [Sq, Skv] natural-log units,
    -inf = masked), causal bottom-right aligned; returns (out [B, Sq, H, D], lse [B, H, Sq])
    in fp64, a row that sees no key giving 0 and LSE -inf."""
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0:
        raise ValueError(f"softcap must be a positive number, got {cap!r}")
    B, Sq, H, D = q.shape
    Skv, Hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else float(softmax_scale)
    idx = torch.arange(H) // (H // Hkv)
    qf = q.double().permute(0, 2, 1, 3)
    kf, vf = (t.double().permute(0, 2, 1, 3)[:, idx] for t in (k, v))
    s = float(cap) * torch.tanh((qf @ kf.transpose(-1, -2)) * scale / float(cap))
    if bias is not None:
        s = s + bias.double()
    if causal:
        cols, rows = torch.arange(Skv), torch.arange(Sq)
        s = s.masked_fill(cols[None, :] > rows[:, None] + (Skv - Sq), -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    return (p @ vf).permute(0, 2, 1, 3).contiguous(), lse


def zoo_judge(c: Candidate, policy, *, threshold=None, classes=CLASSES,
              silent_tol: float = SILENT_TOL) -> Verdict:
    """``judge`` for a policy with semantics of its own: run ``c`` on the online-softmax
    family (``run_online``) and the fp64 reference over its valid keys, and count the rows
    that show any of ``classes`` (``CLASSES``). ``undefined_rows``: the rows that see no
    key (judged for ``empty`` only). The fitness climbs towards a failure of the classes
    asked for: the error against ``silent_tol`` (silent), the largest P against its
    format's limit (saturation), and 100 for an input with a row that sees no key or a
    first visited tile with nothing visible (the shapes the NaN classes need)."""
    from fa_lab.kernels.online.model import FORMAT_MAX

    t0 = time.perf_counter()
    out, lse, records, pol, (q, k, v, mods) = run_online(c, policy, threshold=threshold)
    ref, ref_lse = reference_of(c, q, k, v, mods, softcap=pol.semantics.softcap)
    o = out.double()[0, :, 0]
    defined = torch.isfinite(ref_lse)[0, 0]
    finite = torch.isfinite(o).all(-1)
    vv = v[:, :c.kv_used].double().abs()
    vmax = float(vv.max()) if vv.numel() and float(vv.max()) > 0 else 1.0
    err = torch.where(defined & finite, (o - ref[0, :, 0]).abs().amax(-1) / vmax,
                      torch.zeros_like(o[:, 0]))
    rows = {"nonfinite": ~finite & defined,
            "empty": ~defined & (~finite | (o != 0).any(-1)),
            "silent": err > silent_tol}
    sat = torch.zeros_like(defined)
    nanf = torch.zeros_like(defined)
    for r in records:
        sat |= (r.saturated[0, 0] > 0)
        nanf |= torch.isnan(r.o_factor[0, 0])
    rows["saturation"], rows["nan_factor"] = sat, nanf
    bad = torch.zeros_like(defined)
    found = []
    for name in classes:
        if bool(rows[name].any()):
            found.append(name)
            bad |= rows[name]
    fmt = pol.semantics.p_cast if pol.semantics.p_cast != "input" else None
    fit = -1e3
    if "silent" in classes and float(err.max()) > 0:
        fit = max(fit, 128.0 + math.log2(float(err.max()) / silent_tol))
    if "saturation" in classes and fmt in FORMAT_MAX and records:
        p_max = max(float(r.p_max[0, 0].nan_to_num(0.0).max()) for r in records)
        if p_max > 0:
            fit = max(fit, 128.0 + math.log2(p_max / FORMAT_MAX[fmt]))
    if {"nonfinite", "empty", "nan_factor"} & set(classes):
        sem = pol.semantics
        first = first_tile_visible(c, sem.block_n or 64, sem.kv_order)
        if bool((~defined | ~first).any()):
            fit = max(fit, 100.0)
    fit = min(fit, 127.999)
    if found:
        fit = 129.0
    return Verdict(failed=bool(found), bad_rows=bad.nonzero().flatten().tolist(), fitness=fit,
                   ref_finite=bool(defined.all()), max_err=float(err.max()),
                   seconds=time.perf_counter() - t0,
                   undefined_rows=(~defined).nonzero().flatten().tolist(), classes=found)


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
