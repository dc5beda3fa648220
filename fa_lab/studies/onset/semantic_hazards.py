"""``onset.bound``'s hazards for the zoo's later Semantics fields (``fa_lab.semantics``,
``docs/semantics.md`` §10-11): a softcap and its form, an exp floor, a late mask, P taken
before the vote, and split-KV merges (what an empty partial gives, the LSE's base).

Each has a closed form where one holds; ``refusal`` names the combinations where none does,
and ``bound`` refuses those policies with that reason. Margins are in log2 units (>= 0
inside) except where a hazard says otherwise.

* **softcap, ``exp_ratio``**: tanh(u) as (e^u - e^-u) / (e^u + e^-u) is inf / inf = NaN
  once e^|u| overflows fp32: exactly where |u| passes ``softcap_edge()`` (the largest fp32
  u with a finite ``torch.exp``). ``tanh`` and ``exp_sum`` stay finite; the cap itself
  enters every other hazard through the scores (``measure`` takes them capped).
* **exp floor**: every exp2 argument is ``fmax(arg, floor)``, so a masked column, a flushed
  tail and a rescale factor each keep a weight of at least 2^floor: a relative weight error
  of ``W = (n + n_masked) 2^(floor - H) + steps n 2^(floor + excess)``, an output error of
  at most ``2 W max|V|``.
* **late mask** (``mask_stage="p"``): the max sees every loaded score, so a masked score
  ``lift`` above the row's best visible one holds the base up: l >= 2^(H - lift), whose
  reciprocal overflows past 2^128, and the tails flush ``lift`` earlier; a non-finite loaded
  score gives 0 * NaN.
* **P before the vote**: a row that keeps its max keeps the P it took against
  fmax(m, mt), too small by 2^-(mt - m) <= 2^-min(Jup, THR); reweighting keys by factors in
  [2^-d, 1] moves the output by at most ``2 (1 - 2^-d) max|V|``.
* **split-KV**: an empty partial gives NaN unless its l stays 0 and its output is guarded;
  a base-2 LSE read as natural weighs each partial's mass a to the power 1/ln 2, factors
  spread by 2^((1/ln 2 - 1) D) for a gap D between partials' log2 masses: an output error
  of at most ``2 (1 - 2^-((1/ln 2 - 1) D)) max|V|``.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from fa_lab.numerics import LOG2E

#: log2 of the fp32 overflow boundary (``bound.OVERFLOW``).
OVERFLOW_LOG2 = 128.0


@functools.lru_cache(maxsize=1)
def softcap_edge() -> float:
    """The largest fp32 u whose ``torch.exp`` is finite (e^u past it is inf)."""
    lo = torch.tensor(88.0, dtype=torch.float32)
    hi = torch.tensor(89.0, dtype=torch.float32)
    while True:
        mid = ((lo.double() + hi.double()) / 2).float()
        if mid.item() in (lo.item(), hi.item()):
            break
        if torch.isfinite(torch.exp(mid)):
            lo = mid
        else:
            hi = mid
    return lo.item()


def refusal(pol, drags: bool) -> str | None:
    """Why the bound has no closed form for ``pol``'s fields, or None."""
    sem = pol.semantics
    later = [f for f in ("softcap", "exp_floor", "mask_stage", "p_before_vote", "kv_split")
             if f in pol.semantic_fields]
    if sem.fixed_max is not None and later:
        return (f"its semantics field(s) {', '.join(later)} with fixed_max: the fixed-max "
                "region reads raw scores against F and has no hazard formula for them")
    if sem.exp_floor is not None and (drags or sem.max_lag or sem.o_gate != "always"
                                      or sem.kv_split is not None):
        return ("its semantics field exp_floor with a dragging vote, max_lag, a gated O or "
                "kv_split: the floored factor's error is bounded here only for a row that "
                "rescales itself every tile, in one walk")
    if sem.p_before_vote and drags:
        return ("its semantics field p_before_vote with a vote that drags: the P taken against "
                "fmax(m, mt) is then off by the drag's fall, which no formula here bounds")
    return None


def _defined_max(m, x) -> float:
    ok = m.defined
    return float(np.asarray(x)[ok].max()) if ok.any() else -math.inf


def _log2(x: float) -> float:
    return math.log2(x) if x > 0 else -math.inf


def hazards(pol, *, Hazard, tolerance: float, budget: float, H: float, tau: float,
            flush: float, excess, v_error) -> list:
    """The later fields' hazards of ``pol``, each a ``Hazard`` (``bound``'s class, handed
    in: ``bound`` imports this module). ``budget``: the silent error left once the P and
    output casts' unit roundoffs are charged; ``excess(m)``: the largest exponent a P
    reaches over 2^H, per row; ``v_error(m, H, lift)``: V's scale's share
    (``bound._v_scale_error``)."""
    sem = pol.semantics
    out = []
    if sem.softcap and sem.softcap_form == "exp_ratio":
        edge = softcap_edge()

        def ratio(m):
            margin = _log2(edge) - _log2(m.u_max) if m.u_max > 0 else math.inf
            return m.u_max <= edge, margin

        out.append(Hazard(
            "softcap's exp ratio overflows", "nan",
            f"max |t / softcap| <= {edge!r} over the scores the kernel caps (t = S * scale; "
            f"softcap {sem.softcap:g})", ratio,
            note="e^|u| is inf past the edge: inf / inf = NaN in the capped score, and a "
                 "visible NaN score is a NaN row. Exact: the edge is fp32's own"))
    if sem.exp_floor is not None:
        fl = float(sem.exp_floor)

        def floored(m):
            ok = m.defined
            if not ok.any():
                return True, math.inf
            w = ((m.n + m.n_masked) * 2.0 ** (fl - H)
                 + m.steps * m.n * 2.0 ** (fl + excess(m)))
            err = 2 * _defined_max(m, w)
            margin = _log2(budget - v_error(m, H, 0.0)) - _log2(err)
            return margin >= 0, margin

        out.append(Hazard(
            "exp floor keeps masked and flushed weight", "mass_loss",
            f"2 ((n + n_masked) 2^({fl:g} - H) + steps n 2^({fl:g} + excess)) <= tol - u_P - "
            "u_out (and the V-scale terms)", floored, exact=False,
            note="sufficient: every floored exponent keeps a weight of at most 2^floor where "
                 "the kernel wanted less; a row that sees nothing weighs its masked columns "
                 "alike (the mean of V: the empty-row hazard)"))
    if sem.mask_stage == "p":
        def late_lift(m):
            ok = m.defined
            if not ok.any():
                return True, math.inf
            lift = m.lift
            margins = [float((OVERFLOW_LOG2 + H - lift)[ok].min())]
            room = budget - v_error(m, H, _defined_max(m, lift))
            top = np.log2(np.maximum(m.n, 1)) + flush - H + lift
            margins.append(float((_log2(room) - top)[ok].min()))
            margin = min(margins)
            return margin >= 0, margin

        out.append(Hazard(
            "late mask lifts the max", "mass_loss",
            f"lift < 128 + H and n 2^({flush:g} - H + lift) <= tol - u_P - u_out (and the "
            "V-scale terms), lift = the largest loaded score of a visited tile above the "
            "row's best visible one", late_lift, exact=False,
            note="the masked score holds the base: l >= 2^(H - lift) and the tails flush "
                 "lift binades earlier (the mass-loss formula with H lowered by the lift)"))
        out.append(Hazard(
            "late mask over a non-finite score", "nan",
            "every loaded score of a visited tile is finite (a cache tail's K included)",
            lambda m: (not m.masked_nonfinite, None),
            note="the max and P see the masked score before the mask: NaN * 0 = NaN. "
                 "Structural"))
    if sem.p_before_vote:
        edge_d = -math.log2(1 - budget / 2) if 0 < budget < 2 else (math.inf if budget >= 2
                                                                    else -math.inf)

        def kept(m):
            d = _defined_max(m, np.minimum(m.Jup, tau))
            margin = edge_d - max(d, 0.0)
            return margin >= 0, margin

        out.append(Hazard(
            "P before the vote drops a kept jump", "mass_loss",
            f"2 (1 - 2^-min(Jup, THR)) <= tol - u_P - u_out, i.e. min(Jup, THR) <= "
            f"{edge_d:.6g} (THR = {tau:g})", kept, exact=False, never=tau <= 0,
            note=("an eager rule moves on every jump: P's max is the row's own" if tau <= 0
                  else "sufficient: a kept jump's keys weigh 2^-(mt - m) too little")))
    if sem.kv_split is not None and sem.lse_base == "2":
        k = LOG2E - 1
        edge_s = (-math.log2(1 - budget / 2) / k) if 0 < budget < 2 else -math.inf

        def base2(m):
            d = _defined_max(m, m.spread)
            margin = edge_s - max(d, 0.0)
            return margin >= 0, margin

        out.append(Hazard(
            "base-2 LSE merged as natural", "mass_loss",
            f"2 (1 - 2^-((1/ln 2 - 1) D)) <= tol - u_P - u_out, i.e. D <= {edge_s:.6g}, D the "
            "largest gap between two non-empty partials' log2 masses", base2, exact=False,
            note="sufficient: each partial's weight is its mass to the power 1/ln 2; the "
                 "merged LSE itself is off by the same base (not judged here)"))
    return out


def empty_partial(pol, l_zero: bool, l_zero_causal: bool, Hazard):
    """The split-KV hazard (a ``Hazard``, ``bound``'s class): a row that sees keys with a
    partial that sees none."""
    guarded = pol.semantics.epilogue_guard != "none"
    never = l_zero and guarded

    def check(m):
        if l_zero_causal and m.causal and guarded:
            return True, None
        return not bool(m.partial_empty.any()), None

    return Hazard(
        "an empty partial poisons the merge", "nan",
        "every split-KV partial of a row that sees a key sees one too", check, never=never,
        note=("an empty partial's l stays 0: output 0, LSE -inf, weight 0" if never else
              "an empty partial's output is NaN (no guard against -inf - -inf, or 1/l with "
              "l = 0), and its weight 0 times NaN is NaN in the merge: structural"))
