"""What the models share: the head layout and group loop, and the rescale decision.

``heads`` and ``run_groups`` are the scaffold of every model's ``forward``: q, k, v go
to the [B, Hkv, G, rows, D] layout in which a group of query blocks walks its KV tiles
together, each group's rows are computed and stored, and the results come back as
[B, Sq, H, D] and [B, H, Sq]. ``decide`` reads a resolved ``fa_lab.Policy``'s fields
(``docs/semantics.md`` §9), so a user's policy, declarative or a Python rule, runs
exactly as a built-in one does.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from fa_lab.numerics import exp2, fmax, ieee_fp32_matmul, le
from fa_lab import values
from fa_lab.policies import Policy, RuleError
from .geometry import WAVE_ROWS, wave_any


def heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_rows: int):
    """q [B, Sq, H, D] as the kernel loads it (scaled and rounded by the caller), k and v
    [B, Skv, Hkv, D] -> fp32 q [B, Hkv, G, n_rows, D] (rows past Sq read Q = 0) and
    k, v [B, Hkv, 1, Skv, D]; G = H / Hkv query heads share a KV head (GQA)."""
    B, Sq, H, D = q.shape
    Hkv = k.shape[2]
    qh = q.float().permute(0, 2, 1, 3).reshape(B, Hkv, H // Hkv, Sq, D)
    qh = torch.nn.functional.pad(qh, (0, 0, 0, n_rows - Sq))
    kh = k.float().permute(0, 2, 1, 3).unsqueeze(2)
    vh = v.float().permute(0, 2, 1, 3).unsqueeze(2)
    return qh, kh, vh


def run_groups(qh: torch.Tensor, groups, run, recorder, out_dtype, seqlen_q: int):
    """For each ``(rows, extra)`` of ``groups``, ``run(q_rows, rows, extra) -> (out, lse)``
    computes those query rows (fp32 matmuls rounded as IEEE); the recorder, if any, is
    bound to them first. Returns (out [B, Sq, H, D] in ``out_dtype``, lse [B, H, Sq])."""
    B, Hkv, G, n_rows, D = qh.shape
    out = torch.empty(B, Hkv, G, n_rows, D, device=qh.device)
    lse = torch.empty(B, Hkv, G, n_rows, device=qh.device)
    with ieee_fp32_matmul():
        for rows, extra in groups:
            if recorder is not None:
                recorder.bind_group(rows)
            out[..., rows, :], lse[..., rows] = run(qh[..., rows, :], rows, extra)
    H, Sq = Hkv * G, seqlen_q
    out = out[..., :Sq, :].reshape(B, H, Sq, D).permute(0, 2, 1, 3).to(out_dtype)
    return out.contiguous(), lse[..., :Sq].reshape(B, H, Sq).contiguous()


@dataclass
class Decision:
    """One step's decision, per row. ``vote``/``fire``/``swept`` are None for a
    ``vote="tile"`` policy (nothing is voted: every row rescales); ``target`` is the new
    running max and ``corr = exp2((m - target) * scale)`` the factor O and l are multiplied by."""

    target: torch.Tensor
    corr: torch.Tensor
    vote: torch.Tensor | None = None
    fire: torch.Tensor | None = None
    swept: torch.Tensor | None = None


#: At most this many single-wave calls look for the wave a raising rule fails on.
_LOCATE_CALLS = 4096


def _wave_site(waves: tuple, idx: tuple, rows, lane: int | None = None) -> str:
    """Where wave ``idx`` of a ``waves``-shaped decision lies (or its row ``lane``): its
    query rows (``rows``: the query row of each position of the last dimension, if known)
    and, in the models' [B, Hkv, G, rows] layout, its batch and query head."""
    *lead, w = idx
    lo, hi = w * WAVE_ROWS, (w + 1) * WAVE_ROWS - 1
    if lane is not None:
        lo = hi = lo + lane
    if rows is not None:
        lo, hi = int(rows[lo]), int(rows[hi])
    span = (f"query row {lo}" if lo == hi else f"query rows {lo}-{hi}") + (
        "" if rows is not None else " of the call")
    if len(lead) == 3:
        b, hkv, g = lead
        return f"{span} of batch {b}, head {hkv * waves[2] + g}"
    return span + (f" at index {tuple(lead)}" if lead else "")


def _locate_raise(rule, mw, mtw, threshold):
    """The first wave (an index of ``mw.shape[:-1]``) on which ``rule`` raises when called
    on that wave alone, or None (it raises only on the whole step, or too many waves)."""
    lead = mw.shape[:-1]
    if math.prod(lead) > _LOCATE_CALLS:
        return None
    for idx in itertools.product(*(range(n) for n in lead)):
        sl = tuple(slice(i, i + 1) for i in idx)
        try:
            rule(mw[sl], mtw[sl], threshold)
        except Exception:
            return idx
    return None


def _check_answer(policy: Policy, answer, mw: torch.Tensor, mtw: torch.Tensor, at: str, rows):
    """Refuse, naming the policy, an answer that is not a tensor like m (shape, dtype,
    device) or that is non-finite where the rule made it so. A non-finite m_new is taken
    only as a pass-through of the row's own non-finite input: NaN where m or mt is NaN (the
    scores were NaN); the row's mt where mt is not finite (a masked tile: rebasing to it is
    what the unfixed rule does); the row's m where mt is not finite either (no score seen
    yet). Any other NaN or infinity is refused, keeping m = -inf past a tile with a finite
    max included: that base makes every P of the row infinite, and its output NaN or zero
    without a word."""
    who = f"policy {policy.name!r}: its rule returned"
    want = f"a {mw.dtype} tensor shaped like m, {tuple(mw.shape)}, on {mw.device}"
    if not isinstance(answer, torch.Tensor):
        raise ValueError(f"{who} a {type(answer).__name__} {at}; expected {want}")
    if tuple(answer.shape) != tuple(mw.shape):
        raise ValueError(f"{who} shape {tuple(answer.shape)} {at}; expected {want}")
    if answer.dtype != mw.dtype:
        raise ValueError(f"{who} dtype {answer.dtype} {at}; expected {want} (the rule's m and "
                         f"mt are {mw.dtype}: a cast would change m_new)")
    if answer.device != mw.device:
        raise ValueError(f"{who} a tensor on {answer.device} {at}; expected {want}")
    passed = ((answer == mtw) | ((answer == mw) & ~torch.isfinite(mtw))
              | (torch.isnan(answer) & (torch.isnan(mw) | torch.isnan(mtw))))
    made = ~torch.isfinite(answer) & ~passed
    if bool(made.any()):
        idx = tuple(int(i) for i in made.nonzero()[0])
        n = int(made.sum())
        raise ValueError(
            f"{who} m_new = {float(answer[idx])} for "
            f"{_wave_site(tuple(mw.shape), idx[:-1], rows, idx[-1])} {at}, where m = "
            f"{float(mw[idx])} and mt = "
            f"{float(mtw[idx])}" + (f", and {n - 1} more such value(s)" if n > 1 else "")
            + "; a rule's m_new must be finite, except that it may pass the row's own "
            "non-finite value through: NaN where m or mt is NaN, mt where mt is not finite, "
            "m where mt is not finite either")


def _run_rule(policy: Policy, m: torch.Tensor, mt: torch.Tensor, scale: float | None,
              at: str | None = None, rows=None):
    """The rule's decision as (apply, target): the rule sees one wave's rows at a time in
    log2 units (fp8: m * ls and mt * ls); a row applies where its answer differs from m.
    A target that is one of the rule's inputs maps back to that input exactly, so a
    rule that selects (fmax, where) rescales exactly as the built-in it spells out.

    ``at`` (the loop step, in words) and ``rows`` (the query row of each position of the
    last dimension) say where, in the errors: a rule that raises is re-raised as a
    ``RuleError`` naming the policy, the step and the rows, chained from its exception; to
    name the wave, batch and head, the rule is then called again on each wave alone, and
    the first wave it raises on is named. An answer of the wrong type, shape, dtype or
    device, or non-finite where the rule made it so (``_check_answer``), is a ValueError."""
    shape = m.shape
    waves = (*shape[:-1], shape[-1] // WAVE_ROWS, WAVE_ROWS)
    ms, mts = (m, mt) if scale is None else (m * scale, mt * scale)
    mw, mtw = ms.reshape(waves), mts.reshape(waves)
    at = f"at {at}" if at else "at a loop step"
    threshold = float(policy.threshold)
    try:
        answer = policy.rule(mw, mtw, threshold)
    except Exception as e:
        idx = _locate_raise(policy.rule, mw, mtw, threshold)
        if idx is not None:
            site = (f"{_wave_site(waves, idx, rows)} (called again on each 32-row wave alone, "
                    "it raised first there)")
        else:
            lo, hi = ((int(rows.min()), int(rows.max())) if rows is not None
                      else (0, shape[-1] - 1))
            site = (f"query rows {lo}-{hi} of every batch and head at once (m shaped "
                    f"{tuple(waves)}; on no one wave alone)")
        raise RuleError(f"policy {policy.name!r}: its rule raised {type(e).__name__} {at}, on "
                        f"{site}: {e}") from e
    _check_answer(policy, answer, mw, mtw, at, rows)
    answer = answer.reshape(shape)
    apply = ~(answer == ms)
    if scale is None:
        return apply, answer
    return apply, torch.where(answer == mts, mt, answer / scale)


def wave_ballot(flags: torch.Tensor, wave_rows: int = WAVE_ROWS) -> torch.Tensor:
    """True for every row of a ``wave_rows``-row wave where any row is True; ``flags`` has
    rows in its last dimension, whole waves in order."""
    if wave_rows == WAVE_ROWS:
        return wave_any(flags)
    shape = flags.shape
    w = flags.reshape(*shape[:-1], shape[-1] // wave_rows, wave_rows).any(-1, keepdim=True)
    return w.expand(*shape[:-1], shape[-1] // wave_rows, wave_rows).reshape(shape)


@dataclass
class Choice:
    """Which rows move their running max at one step, and to what (``choose``): ``vote``
    (None for vote "tile": nothing is voted), ``fire`` (the ballot of each wave; None for
    "tile"), ``move`` (the rows that move) and ``target`` (where a moving row's max goes)."""

    vote: torch.Tensor | None
    fire: torch.Tensor | None
    move: torch.Tensor
    target: torch.Tensor


def choose(policy: Policy, m: torch.Tensor, mt: torch.Tensor, d: torch.Tensor, where: str, *,
           wave_rows: int = WAVE_ROWS) -> Choice:
    """The vote and rebase of a declarative policy at one step, the one decision the models
    share: ``m`` and ``mt`` the running and tile maxima, ``d`` the jump ``mt - m`` in log2
    units (fp8: scaled by ls) and ``where`` the model, for the error on a value this code
    does not implement (``fa_lab.values.unknown``). Values as ``fa_lab.values`` declares
    them: vote "tile" moves every row to fmax(m, mt); "wave" and "row" take a row's vote
    where not ``d <= threshold`` (a NaN jump votes), "wave" moving every row of a wave
    (``wave_rows`` rows) where some row voted, "row" the voters only; rebase "max" moves to
    fmax(m, mt), "tile" to mt, "capped" to mt unless ``d < -rebase_bound`` (or NaN), when
    the row keeps m and does not move."""
    if policy.vote == "tile":
        vote = fire = None
        move = torch.ones_like(m, dtype=torch.bool)
    elif policy.vote in ("wave", "row"):
        vote = ~le(d, policy.threshold)
        fire = wave_ballot(vote, wave_rows)
        move = vote if policy.vote == "row" else fire
    else:
        raise values.unknown("vote", policy.vote, where)
    if policy.rebase == "max":
        target = fmax(m, mt)
    elif policy.rebase == "tile":
        target = mt
    elif policy.rebase == "capped":
        # a downward rebase past the bound is skipped (NaN: skipped): the row keeps m
        safe = d >= -policy.rebase_bound
        target, move = torch.where(safe, mt, m), move & safe
    else:
        raise values.unknown("rebase", policy.rebase, where)
    return Choice(vote, fire, move, target)


def check_decidable(policy: Policy, where: str) -> None:
    """Before any work: ValueError (``fa_lab.values.unknown``) when ``choose`` has no code
    for a declarative policy's vote or rebase; ``where`` names the model."""
    if policy.rule is None:
        row = torch.zeros(WAVE_ROWS)
        choose(policy, row, row, row, where)


def decide(policy: Policy, m: torch.Tensor, mt: torch.Tensor, scale: float | None = None, *,
           where: str, at: str | None = None, rows: torch.Tensor | None = None) -> Decision:
    """The decision at one loop step for running maxima ``m`` and tile maxima ``mt``
    ([..., R] with whole 32-row waves in the last dimension). ``scale`` (fp8: ls) turns
    score differences into log2 units; None for scores already in log2 units. ``where``
    names the model (its errors name it).

    A declarative policy decides by ``choose``; a moving row's factor is
    ``exp2((m - target) * scale)``. A rule's rows move where its m_new differs from m (see
    ``_run_rule``); its vote and fire record those rows. ``at`` and ``rows`` say where the
    step is, for a rule's errors."""

    def scaled(x):
        return x if scale is None else x * scale

    if policy.rule is not None:
        apply, target = _run_rule(policy, m, mt, scale, at, rows)
        vote, fire = apply, wave_any(apply)
    else:
        c = choose(policy, m, mt, scaled(mt - m), where)
        vote, fire, apply, target = c.vote, c.fire, c.move, c.target
        if vote is None:  # every row moves: nothing voted, nothing swept
            return Decision(target=target, corr=exp2(scaled(m - target)))
    corr = torch.where(apply, exp2(scaled(m - target)), torch.ones_like(m))
    return Decision(target=torch.where(apply, target, m), corr=corr, vote=vote, fire=fire,
                    swept=fire & (mt < m))
