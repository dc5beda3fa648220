"""What the models share: the head layout and group loop, and the rescale decision.

``heads`` and ``run_groups`` are the scaffold of every model's ``forward``: q, k, v go
to the [B, Hkv, G, rows, D] layout in which a group of query blocks walks its KV tiles
together, each group's rows are computed and stored, and the results come back as
[B, Sq, H, D] and [B, H, Sq]. ``decide`` reads a resolved ``fa_lab.Policy``'s fields
(``docs/semantics.md`` §9), so a user's policy, declarative or a Python rule, runs
exactly as a built-in one does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fa_lab.numerics import exp2, fmax, ieee_fp32_matmul, le
from fa_lab.policies import Policy
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
    """One step's decision, per row. ``vote``/``fire``/``dragged`` are None for a
    ``vote="tile"`` policy (nothing is voted: every row rescales); ``target`` is the new
    running max and ``corr = exp2((m - target) * scale)`` the factor O and l are multiplied by."""

    target: torch.Tensor
    corr: torch.Tensor
    vote: torch.Tensor | None = None
    fire: torch.Tensor | None = None
    dragged: torch.Tensor | None = None


def _run_rule(policy: Policy, m: torch.Tensor, mt: torch.Tensor, scale: float | None):
    """The rule's decision as (apply, target): the rule sees one wave's rows at a time in
    log2 units (fp8: m * ls and mt * ls); a row applies where its answer differs from m.
    A target that is one of the rule's inputs maps back to that input exactly, so a
    rule that selects (fmax, where) rescales exactly as the built-in it spells out."""
    shape = m.shape
    waves = (*shape[:-1], shape[-1] // WAVE_ROWS, WAVE_ROWS)
    ms, mts = (m, mt) if scale is None else (m * scale, mt * scale)
    answer = policy.rule(ms.reshape(waves), mts.reshape(waves), float(policy.threshold))
    if not isinstance(answer, torch.Tensor) or answer.shape != waves:
        got = tuple(answer.shape) if isinstance(answer, torch.Tensor) else type(answer).__name__
        raise ValueError(f"policy {policy.name!r}: its rule must return a tensor shaped like m "
                         f"{waves}, got {got}")
    answer = answer.to(m.dtype).reshape(shape)
    apply = ~(answer == ms)
    if scale is None:
        return apply, answer
    return apply, torch.where(answer == mts, mt, answer / scale)


def decide(policy: Policy, m: torch.Tensor, mt: torch.Tensor, scale: float | None = None) -> Decision:
    """The decision at one loop step for running maxima ``m`` and tile maxima ``mt``
    ([..., R] with whole 32-row waves in the last dimension). ``scale`` (fp8: ls) turns
    score differences into log2 units; None for scores already in log2 units.

    vote="tile": every row to fmax(m, mt). Otherwise a row votes when its tile max jumped
    more than the threshold (NaN votes); "wave" moves every row of a wave where any row
    voted, "row" only the rows that voted; a moving row takes fmax(m, mt) ("max"), mt
    ("tile"), or mt unless that is more than rebase_bound below m ("capped"). A rule's
    rows move where its m_new differs from m (see ``_run_rule``); its vote and fire record
    those rows."""

    def scaled(x):
        return x if scale is None else x * scale

    if policy.rule is not None:
        apply, target = _run_rule(policy, m, mt, scale)
        vote, fire = apply, wave_any(apply)
    elif policy.vote == "tile":
        target = fmax(m, mt)
        return Decision(target=target, corr=exp2(scaled(m - target)))
    else:
        d = scaled(mt - m)
        vote = ~le(d, policy.threshold)
        fire = wave_any(vote)
        apply = vote if policy.vote == "row" else fire
        if policy.rebase == "capped":
            # a downward rebase past the bound is skipped (NaN: skipped); a skipped row's
            # factor is exp2(-0) = 1, whatever m is
            safe = d >= -policy.rebase_bound
            target = torch.where(safe, mt, m)
            moved = exp2(-torch.where(safe, d, torch.zeros_like(d)))
        else:
            target = fmax(m, mt) if policy.rebase == "max" else mt
            moved = exp2(scaled(m - target))
        corr = torch.where(apply, moved, torch.ones_like(m))
        return Decision(target=torch.where(apply, target, m), corr=corr, vote=vote, fire=fire,
                        dragged=fire & (mt < m))
    corr = torch.where(apply, exp2(scaled(m - target)), torch.ones_like(m))
    return Decision(target=torch.where(apply, target, m), corr=corr, vote=vote, fire=fire,
                    dragged=fire & (mt < m))
