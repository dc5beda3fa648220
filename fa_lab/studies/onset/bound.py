"""Safe regions in closed form: for a policy (a built-in or a failure zoo preset), the inputs
on which no overflow, NaN, saturation or silent mass loss can happen.

    from fa_lab.studies import onset
    region = onset.bound("fa4_fp8_saturation:before")
    print(region.describe())              # each hazard: its formula, exact or sufficient
    m = onset.measure(q, k, v, policy="fa4_fp8_saturation:before", causal=False)
    region.contains(m), region.violated(m)

``docs/semantics.md`` §11 derives every formula. The quantities they read (``Measure``,
``measure.py``) are taken per row, in log2 units, on the tiles the policy's kernel visits
(``block_n`` columns, in its ``kv_order``), from the scores as that kernel computes them
(every cast on the path):

* ``R``, the row's **score spread**: its best visible score minus the lowest maximum of a
  visited tile that has a visible key; ``Jup``: its best score minus the maximum of the first
  such tile it visits (how far a later tile can rise above the base it started from);
* ``n``, its visible keys, ``n_masked`` the masked columns of its visited tiles, ``s_max``
  its best score, ``v_max`` the largest |V| of a valid key;
* structural facts: a row that sees nothing, a row whose first visited tile shows it nothing
  (*hollow*), a hollow tile after the first that shows it something, a non-finite V row
  inside the last tile past the sequence's end;
* ``c``, the log2 units of one raw logit unit (a raw-domain sentinel is ``value * c``);
  whether the call is causal (the FlyDSL kernels floor a causal row's tile max); fp8 (the
  swp_fp8 kernel): ``ls``, its log2 scale of a raw fp8 product, and whether a causal call
  has more queries than keys; the output's format and ``v_descale``;
* for the later Semantics fields (``semantic_hazards.py``): a late mask's lift, a
  softcap's largest argument, split-KV partials that see nothing and the gap between
  partials' masses.

Every silent hazard charges the P cast's and the output cast's unit roundoffs and V's
scale (O's fp32 sums below the subnormals, the output's flush): small V is a hazard of
every policy. ``bound`` refuses what it cannot analyse (a Python rule; the field
combinations ``semantic_hazards.refusal`` names) with a ValueError saying why; another
kernel family registers its own bound (``register_family``, ``FAMILY_BOUNDS``).

A ``Hazard`` is one way to fail, with the formula of its safe side, whether that formula is
the exact boundary or only sufficient, and ``never`` where the policy's own fields rule it
out for every input. A continuous hazard reports a ``margin`` in log2 units (>= 0 inside).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from fa_lab import values
from fa_lab.kernels._common.hazard import Hazard, HazardChecks
from fa_lab.numerics import CAUSAL_FLOOR, E4M3_MAX, f32

from . import semantic_hazards as SH
from .measure import Measure, block_n as _block_n, resolve as _resolve

#: log2 of the fp32 overflow boundary.
OVERFLOW = SH.OVERFLOW_LOG2
#: Each P format: (largest finite value, log2 of half its smallest subnormal (a P below it
#: rounds to 0), its unit roundoff 2^-(stored mantissa bits + 1)).
FORMATS = {"e4m3": (E4M3_MAX, -10.0, 2.0 ** -4), "e5m2": (57344.0, -17.0, 2.0 ** -3),
           "f16": (65504.0, -25.0, 2.0 ** -11), "bf16": (3.3895313892515355e38, -134.0, 2.0 ** -8),
           "none": (math.inf, -150.0, 2.0 ** -24)}
#: The default tolerance of the silent hazards, as the attack's ``silent`` class.
TOLERANCE = 0.25
#: The fp8 kernel's addend -ls * m loses the row max once its magnitude passes 2^32.
FP8_ADDEND_LOG2 = 32.0

#: The output's format per input dtype (an fp8 call writes bf16): (the smallest subnormal's
#: half, log2, below which an output rounds to 0; its unit roundoff; its largest value).
OUTPUTS = {"bf16": (-134.0, 2.0 ** -8, 3.3895313892515355e38),
           "f16": (-25.0, 2.0 ** -11, 65504.0), "none": (-150.0, 2.0 ** -24, math.inf)}
#: log2 of half fp32's smallest subnormal: an fp32 result below it rounds to 0.
F32_FLUSH = -150.0


@dataclass(frozen=True)
class Region(HazardChecks):
    """``bound``'s answer: the policy's hazards; an input is inside when none applies."""

    policy: object
    kernel: str
    dtype: str
    tolerance: float
    hazards: tuple

    def describe(self) -> str:
        return self._described(f"{self.policy.name} on {self.kernel} ({self.dtype}): safe where")

    def to_dict(self) -> dict:
        return {"policy": self.policy.name, "kernel": self.kernel, "dtype": self.dtype,
                "tolerance": self.tolerance, "hazards": [h.to_dict() for h in self.hazards]}


def _fmt(pol, dtype: str, family: str) -> str:
    if family == "swp_fp8":
        return "e4m3"
    cast = pol.semantics.p_cast
    if cast == "input":
        return {"bf16": "bf16", "f16": "f16", "fp8": "e4m3", "fp32": "none"}[dtype]
    return cast


def _drags(pol) -> bool:
    """Whether ``pol`` can lower a row's max without that row's own vote: its vote moves
    rows that did not vote and its rebase may go down (``fa_lab.values``' ``drags`` and
    ``lowers``, so a new value is bounded by what it declares)."""
    return values.get("vote", pol.vote).drags and values.get("rebase", pol.rebase).lowers


#: The later Semantics fields (the zoo's second round), each bounded in
#: ``semantic_hazards`` where a closed form holds; ``refusal`` says where none does.
LATER_FIELDS = ("softcap", "softcap_form", "exp_floor", "mask_stage", "p_before_vote",
                "kv_split", "merge_empty", "lse_base")
#: Kept for callers that list what the bound refuses: the fields with no closed form in
#: any combination (none; ``refusal`` names the combinations it refuses).
UNBOUNDED: tuple = ()

#: Per-family bounds: a kernel family whose walk is not the online softmax's (a decode
#: kernel's partitions, say) registers ``fn(policy, dtype=, tolerance=, seqlen_kv=) ->
#: Region`` here (``register_family``), and ``bound(..., kernel=name)`` hands it over.
FAMILY_BOUNDS: dict[str, Callable] = {}
#: The families ``bound`` derives itself.
OWN_FAMILIES = ("swp_bf16", "swp_fp8", "online")


#: The region of a fixed-max policy (``fixed_max.region``, which registers itself when the
#: package loads: it reads this module's formats, so it cannot be imported from here).
FIXED_MAX_BOUND: list[Callable] = []


def register_family(name: str, fn: Callable) -> None:
    """Make ``bound(policy, kernel=name)`` call ``fn`` (``FAMILY_BOUNDS``)."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    if name in OWN_FAMILIES:
        raise ValueError(f"family {name!r} is bounded here; register another family's bound")
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    FAMILY_BOUNDS[name] = fn


def _decode_family(family: str, module: str = "bound") -> Callable:
    """The bound of a decode family (``kernels/<family>/<module>.py``'s ``region``): its
    "policy" is the upstream version (empty: the family's default)."""
    def region(version, *, dtype, tolerance, seqlen_kv):
        import importlib
        fam = importlib.import_module(f"fa_lab.kernels.{family}")
        return getattr(fam, module).region(version or None)
    return region


# the sliding-window decode's region is its family's swa_bound.py
for _name, _family, _module in (("pa_decode", "pa_decode", "bound"),
                                ("mla_decode", "mla_decode", "bound"),
                                ("pa_decode_swa", "pa_decode", "swa_bound")):
    register_family(_name, _decode_family(_family, _module))


def bound(policy, *, dtype: str = "bf16", tolerance: float = TOLERANCE,
          seqlen_kv: int | list = 4096, kernel: str | None = None) -> Region:
    """The safe region of ``policy`` on the kernel it runs on: the online-softmax family for
    a policy with semantics of its own, else DUALWAVE_SWP, or the fp8 kernel for
    ``dtype="fp8"``. An input is inside when no hazard applies (``Region.violated``). A
    family registered in ``FAMILY_BOUNDS`` (the decode families: ``kernels/<family>/bound.py``)
    answers for itself: ``bound("pa_decode:main-11c4174d")`` is
    ``bound("main-11c4174d", kernel="pa_decode")``. A policy the formulas cannot analyse (a
    Python rule, a combination of fields ``semantic_hazards.refusal`` names) is refused,
    ValueError naming why.

    Parameters
    ----------
    policy : str or fa_lab.Policy
        A registered policy's name (the zoo's presets included), a Policy, or a decode
        family's name (``"pa_decode:main-11c4174d"``, ``"pa_decode_swa"``, ``"mla_decode"``,
        and the paged fp8 prefill's ``"swp_fp8_paged"``).
    dtype : str
        The inputs' type: ``"bf16"`` (default), ``"f16"``, ``"fp8"`` or ``"fp32"``.
    tolerance : float
        The silent hazards' error, as a fraction of max|V|, in (0, 1).
    seqlen_kv : int or list of int
        Resolves an fp8 threshold rule (``"by_kv_len"``; over one length per sequence, the
        largest threshold they give); default 4096.
    kernel : str or None
        A family registered in ``FAMILY_BOUNDS``, whose own bound answers; or one of
        ``OWN_FAMILIES``, which must be the family the policy runs on.

    Returns
    -------
    fa_lab.studies.onset.Region
        The policy's hazards, each with its formula, whether the formula is exact, and a
        check of a measured input.

    Examples
    --------
    >>> from fa_lab.studies import onset
    >>> def live(policy):                  # the hazards that some input can reach
    ...     return [h.name for h in onset.bound(policy).hazards if not h.never]
    >>> before, after = live("sdpa_masked_row:before"), live("sdpa_masked_row:after")
    >>> sorted(set(before) - set(after))    # what the fix rules out: the empty row
    ['NaN from a first tile with nothing visible', 'a row that sees nothing gives 0']
    >>> after
    ['accumulator overflow', 'silent mass loss (rounding and flushed tails)', 'output overflow', 'non-finite V']
    >>> "drag onto a tile with nothing visible" in live("lazy_unfixed")
    True
    >>> onset.bound("lazy").kernel, onset.bound("sdpa_masked_row:after").kernel
    ('swp_bf16', 'online')
    """
    if kernel is None and isinstance(policy, str) and policy.partition(":")[0] in FAMILY_BOUNDS:
        kernel, _, policy = policy.partition(":")
    if dtype not in ("bf16", "f16", "fp8", "fp32"):
        raise ValueError(f"dtype must be 'bf16', 'f16', 'fp8' or 'fp32', got {dtype!r}")
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 < tolerance < 1:
        raise ValueError(f"tolerance must be a number in (0, 1), got {tolerance!r}")
    if kernel is not None:
        if kernel in FAMILY_BOUNDS:
            return FAMILY_BOUNDS[kernel](policy, dtype=dtype, tolerance=float(tolerance),
                                         seqlen_kv=seqlen_kv)
        if kernel not in OWN_FAMILIES:
            raise ValueError(f"kernel {kernel!r} has no bound: onset.bound derives "
                             f"{', '.join(OWN_FAMILIES)}, and {sorted(FAMILY_BOUNDS)} are "
                             "registered (register_family)")
    pol, family = _resolve(policy, dtype, seqlen_kv)
    if kernel is not None and kernel != family:
        raise ValueError(f"policy {pol.name!r} with dtype {dtype!r} runs on {family!r}, "
                         f"not kernel={kernel!r}")
    sem = pol.semantics
    why = SH.refusal(pol, _drags(pol))
    if why:
        raise ValueError(f"onset.bound cannot bound policy {pol.name!r}: {why}")
    if sem.fixed_max is not None:
        return FIXED_MAX_BOUND[0](pol, family, dtype, float(tolerance))
    tau = float(pol.threshold) if pol.lazy else 0.0
    H = float(pol.p_headroom)
    fmt = _fmt(pol, dtype, family)
    fmax, flush, unit = FORMATS[fmt]
    drags = _drags(pol)
    lag = sem.max_lag
    hz = []

    cap = float(pol.rebase_bound) if "rebase_bound" in pol.parameters else math.inf

    def excess(m):  # the largest exponent a P can reach over 2^H, per row
        stale = np.minimum(m.Jup, tau) if not lag else m.Jup
        # a drag lowers the base to a tile max: the deficit stays within R, and a capped
        # rebase drops at most its bound per step
        deep = np.minimum(m.R, cap * m.steps) if math.isfinite(cap) else m.R
        return np.maximum(stale, deep) if drags else stale

    # 1. the accumulators: O = sum cast(P) v <= n min(2^(H + excess), Fmax) max|v| and
    #    l = sum P <= n 2^(H + excess)
    log_fmax = math.log2(fmax)


    def overflow(m):
        ok = m.defined
        e = H + excess(m)
        log_n = np.log2(np.maximum(m.n, 1))
        # O's and l's fp32 sums round up by at most 2^-24 per operation (4 T + 3 of them)
        tiles = float(((m.n + m.n_masked) / m.block_n).max()) if m.n.size else 1.0
        acc = math.log2(1 + (4 * tiles + 3) * 2.0 ** -24)
        # every P <= 2^e, and the cast rounds monotonically: cast(P) <= cast(2^e)
        o = np.minimum(_cast_log2(e, fmt), log_fmax) + log_n + math.log2(
            max(m.v_max, 2.0 ** -149)) + acc
        top = np.maximum(o, e + log_n + acc)
        margin = OVERFLOW - float(top[ok].max()) if ok.any() else math.inf
        return margin > 0, margin

    dev = ("min(R, B steps)" if math.isfinite(cap) else "R") if drags else (
        "Jup" if lag else "min(THR, Jup)")
    hz.append(Hazard(
        "accumulator overflow", "overflow",
        f"min(log2 cast(2^(H + {dev})), log2 Fmax) + log2 n + log2 max|V| + a < 128 and "
        f"H + {dev} + log2 n + a < 128 (H = {H:g}, THR = {tau:g}, Fmax = {fmax:g}, the largest "
        f"{fmt} P; cast: the P cast's rounding, at most 1 + u_P up; a = log2(1 + (4 T + 3) "
        "2^-24), fp32's roundings "
        "over T tiles)", overflow,
        exact=not drags,
        note=("a dragged row's deficit reaches at most R, but whether a ballot drags it that far "
              "depends on the other rows of its wave: sufficient, the exact onset is the "
              "recurrence (onset.predict)") if drags else
             "tight when n keys all sit at the stale base's full excess and their P casts "
             "round up"))

    # 2. saturation of the P cast. Only swp_bf16 carries a P pack across a decision (the
    #    pack of the previous tile not yet consumed is scaled by the correction, 2^deficit
    #    under a drag); every other kernel takes P after its step's decision, against the
    #    base that step chose: a wave that did not fire has every row within THR of its base,
    #    a fired row sits at (or, capped, above) its own tile max, so P <= 2^(H + THR)
    #    whatever drags happened before (a drag's deficit scales O and l, not P).
    carried = drags and family == "swp_bf16"
    sat_dev = dev if (carried or lag) else ("min(THR, R)" if drags else dev)

    def sat_excess(m):
        if drags and not carried and not lag:
            return np.minimum(m.R, tau)
        return excess(m)

    never_sat = not math.isfinite(fmax) or (not carried and not lag and H + tau <= log_fmax)

    def saturation(m):
        ok = m.defined
        margin = log_fmax - H - float(sat_excess(m)[ok].max()) if ok.any() else math.inf
        return margin >= 0, margin

    if never_sat and math.isfinite(fmax):
        sat_note = (f"H + THR = {H + tau:g} <= {log_fmax:.4f}: no P can pass the format" + (
            " (a drag lowers the base only at a fired step, where the row's P is taken "
            "against its own tile max: the deficit scales O and l, never P)" if drags else ""))
    elif never_sat:
        sat_note = "the P cast has no largest value"
    else:
        sat_note = "the clipped P keeps its full weight in l: the row loses mass silently" + (
            "; under a drag the carried P pack is scaled by 2^deficit, sufficient (whether a "
            "ballot drags that far depends on the wave's other rows)" if carried else "")
    hz.append(Hazard(
        "P saturation", "saturation",
        f"H + {sat_dev} <= log2({fmax:g}) = {log_fmax:.4f} ({fmt} P)", saturation,
        never=never_sat, exact=not drags, note=sat_note))

    # 3. P values below half the format's smallest subnormal round to 0; O's fp32 sums
    #    and the output's cast lose what falls below their own subnormals (V's scale)
    out_flush, out_unit, _ = OUTPUTS["bf16" if dtype == "fp8" else
                                     {"fp32": "none"}.get(dtype, dtype)]

    def mass_loss(m):
        ok = m.defined
        if not ok.any():
            return True, math.inf
        need = tolerance - unit - out_unit - _v_scale_error(m, H, 0.0)
        need = math.log2(need) if need > 0 else -math.inf
        margin = need - float((np.log2(np.maximum(m.n, 1)) + flush - H)[ok].max())
        return margin >= 0, margin

    hz.append(Hazard(
        "silent mass loss (rounding and flushed tails)", "mass_loss",
        f"2^-{-math.log2(unit):g} + n 2^({flush:g} - H) + u_out + (4 T + 3) 2^({F32_FLUSH:g} - H)"
        f" / max|V| + 2^({out_flush:g}) / (max|V| v_descale) <= {tolerance:g} ({fmt} P; the "
        f"output's unit roundoff u_out = 2^{math.log2(out_unit):g}; T tiles)", mass_loss,
        exact=False,
        note="sufficient: every key's P is off by at most its unit roundoff or the flushed "
             "2^flush, against a largest P of at least 2^H; each of O's fp32 roundings "
             "(the PV sums, the rescale, the add, the epilogue's product) is off by at most "
             "2^-150 absolute, which matters once max|V| is small; the output's own cast "
             "rounds below its subnormals to 0"))

    # the output's cast: |out| <= (1 + u_P) max|V| v_descale must stay below its format's
    # largest value (fp32's 2^128 for an fp32 output)
    out_top = OUTPUTS["bf16" if dtype == "fp8" else {"fp32": "none"}.get(dtype, dtype)][2]
    out_edge = min(math.log2(out_top), OVERFLOW)

    split = sem.kv_split

    def out_overflow(m):
        if m.v_max <= 0:
            return True, math.inf
        top = math.log2(m.v_max * (1 + unit) * m.v_descale)
        margin = out_edge - top
        if split:  # the merge's fp32 sum of k partial outputs, each weight <= 1
            tiles = float(((m.n + m.n_masked) / m.block_n).max()) if m.n.size else 1.0
            k = math.ceil(tiles / split)
            margin = min(margin, OVERFLOW - top - math.log2(k * (1 + k * 2.0 ** -24)))
        return margin > 0, margin

    merge = (f" and k (1 + u_P) max|V| v_descale (1 + k 2^-24) < 2^128 (the merge's fp32 sum "
             f"of k = ceil(T / {split}) partials)") if split else ""
    hz.append(Hazard(
        "output overflow", "overflow",
        f"(1 + u_P) max|V| v_descale < {out_top:g} (the output's largest value){merge}",
        out_overflow, exact=False,
        note="the output is a weighted mean of V, each weight's cast off by at most u_P, "
             "times the V descale" + (": a split's merge sums its partial outputs with "
                                      "weights up to 1 before dividing" if split else "")
             + ": sufficient"))

    # 4. structural NaN: a row's max is -inf after a tile with nothing visible
    guard = (sem.tile_max_floor == "always" or sem.empty_row_guard != "none" or sem.clamp_exp_diff
             or sem.mask_value != -math.inf or sem.m_init != -math.inf
             or sem.exp_floor is not None or sem.mask_stage == "p")
    # the online family floors every tile's max; the FlyDSL kernels floor the prologue's
    # only (kernels/swp_bf16/model.py: a loop tile's max is masked, not floored), so a
    # drag, which rebases a row to a later tile's raw max (-inf for an all-masked tile),
    # takes a causal row past the floor: there the floor protects nothing
    floored = sem.tile_max_floor == "causal" and not guard
    causal_floor = floored and (family == "online" or not drags)
    unfloored = floored and not causal_floor
    past_floor = (" (a causal call's floor holds the prologue's max only, and a vote's drag "
                  "rebases the row below it: sufficient, the exact condition also needs its "
                  "wave to fire at a loop tile that shows it nothing)") if unfloored else ""

    def hollow(m):
        bad = m.hollow_first & m.defined
        return (causal_floor and m.causal) or not bool(bad.any()), None

    one_tile = sem.kv_split == 1   # a one-tile partial sees a key at its first tile or none
    hz.append(Hazard(
        "NaN from a first tile with nothing visible", "nan",
        f"every row sees a key in the first {_block_n(pol, family)}-column tile it visits"
        + (" (or the call is causal: its tile max is floored)" if causal_floor else "")
        + past_floor, hollow, never=guard or one_tile, exact=not unfloored, note=(
            "each split-KV partial is one tile: a partial with nothing visible is an empty "
            "partial (its own hazard)" if one_tile and not guard else
            "a floor, an empty-row guard, a clamp, a finite sentinel, an exp "
                           "floor (maxNum takes the NaN to the floor) or a late mask (the max "
                           "sees every score) keeps the exponent from NaN" if guard else
                           "(-inf) - (-inf) = NaN in the factor and in P; no magnitude is "
                           "involved, so the boundary is one tile: the first visible key's "
                           "column against block_n")))
    if drags:
        def drag_hollow(m):
            return not bool((m.hollow_after & m.defined).any()), None

        capped = math.isfinite(cap)
        hz.append(Hazard(
            "drag onto a tile with nothing visible", "nan",
            "no row sees an all-masked tile after its first visible key", drag_hollow,
            never=capped,
            note=("a capped rebase skips a drop past its bound, and -inf (or the floor) lies "
                  "past every bound: the row keeps its max" if capped else
                  "a firing wave rebases a row to that tile's max, -inf or the floor; the "
                  "next exponent against it is NaN or inf. Structural, no magnitude")))

    # 5. rows that see nothing: l stays 0 where P of a masked column is 0 (a guard against
    #    -inf - -inf, and no exp floor); the epilogue (or a split's merge) then gives 0
    l_zero = sem.exp_floor is None and (sem.mask_stage == "p" or (guard and (
        sem.mask_value == -math.inf or sem.empty_row_guard == "zero_base")))
    l_zero_causal = sem.exp_floor is None and causal_floor
    split = sem.kv_split is not None
    gives_zero = (sem.merge_empty == "empty") if split else sem.epilogue_guard != "none"

    def empty(m):
        return (l_zero_causal and m.causal and gives_zero) or not m.empty_rows, None

    zero_empty = l_zero and gives_zero
    hz.append(Hazard(
        "a row that sees nothing gives 0", "nan",
        "every row sees a key" + past_floor, empty, never=zero_empty,
        exact=not (unfloored and gives_zero and sem.exp_floor is None),
        note=("the guard keeps P at 0, l = 0, and the " + ("merge" if split else "epilogue")
              + " gives 0" if zero_empty else
              "NaN (no guard, 1/l with l = 0, or a merge of empty partials that gives NaN) or "
              "the mean of V (a finite sentinel or an exp floor weighs every masked column): "
              "structural")))
    if split:
        hz.append(SH.empty_partial(pol, l_zero, l_zero_causal, Hazard))

    # 6. finite sentinels: masked columns weigh 2^(sigma - s_max); a base held above the
    #    row's scores pushes every P down towards the format's flush point
    sentinel = sem.mask_value != -math.inf or sem.m_init != -math.inf
    if sentinel:
        # a sentinel at -1e38 log2 units or below weighs nothing beside any finite score
        far = all(x == -math.inf or (sem.mask_domain == "scaled" and x <= -1e38)
                  for x in (sem.mask_value, sem.m_init))

        def near_sentinel(m):
            return _sentinel_margin(m, pol, tolerance, H, flush, unit + out_unit)

        hz.append(Hazard(
            "finite sentinel", "mass_loss",
            "rows with masked columns: s_max - sigma >= 1 + log2(n_masked / tol); and "
            "sigma_init - s_max < 128 + H and "
            f"n 2^({flush:g} - H + sigma_init - s_max) <= tol - 2^-{-math.log2(unit):g} "
            "(sigma: the sentinel in log2 units)", near_sentinel, exact=False, never=far,
            note=("the sentinel lies below every finite score" if far else
                  "the masked columns' weight against the row's best key; once the sentinel "
                  "holds the base above the row's scores, l falls to 2^(H - lift), whose "
                  "reciprocal overflows past 2^128 (0 * inf = NaN), and the tails flush (the "
                  "mass-loss formula with H lowered by the lift); sufficient")))

    hz.extend(SH.hazards(pol, Hazard=Hazard, tolerance=tolerance, budget=tolerance - unit - out_unit, H=H,
                         tau=tau, flush=flush, excess=excess, v_error=_v_scale_error))

    # 7. the V tail past the sequence inside its last tile
    if sem.v_tail == "cache":
        hz.append(Hazard(
            "V cache tail", "nan", "V past seqlen_kv inside its last tile is finite (or "
            "seqlen_kv is a multiple of block_n)", lambda m: (not m.tail_nonfinite, None),
            note="0 * NaN = NaN in the PV product: structural"))

    # 8. a NaN factor applied by a vote
    if sem.o_gate == "wave":
        hz.append(Hazard(
            "NaN factor through the O vote", "nan",
            "no row is hollow in its first visited tile and every row sees a key",
            lambda m: (not bool((m.hollow_first & m.defined).any()) and not m.empty_rows, None),
            never=guard, exact=False,
            note="sufficient: the exact condition also needs a row of the same wave to "
                 "rescale at that tile, which its padding rows do at the first"))

    # 9. the fp8 kernel's addend -ls * m (docs/semantics.md §1.2)
    if family == "swp_fp8":
        top = math.log2(E4M3_MAX * E4M3_MAX)

        def addend(m):
            margin = FP8_ADDEND_LOG2 - (math.log2(m.ls) + top + math.log2(128))
            return margin > 0, margin

        hz.append(Hazard("fp8 addend loses the row max", "nan",
                         "ls * 448^2 * D < 2^32 (ls = q_descale k_descale c)", addend, exact=False,
                         note="sufficient: 448^2 D bounds a raw fp8 score"))
        floor_ls = _floor_ls()

        def floor_overflow(m):
            margin = math.log2(floor_ls) - math.log2(m.ls)
            return (not m.causal_short) or margin > 0, margin

        hz.append(Hazard("fp8 causal floor overflows", "nan",
                         f"not causal with Sq > Skv, or ls < {floor_ls:.8g}", floor_overflow,
                         note="f32(ls * -3e38) = -inf: the addend is +inf at a row that sees "
                              "no key"))
    hz.append(_v_nonfinite())
    return Region(pol, family, dtype, float(tolerance), tuple(hz))


def _v_nonfinite() -> Hazard:
    """A non-finite V row among the valid keys: 0 * inf = NaN in every row's PV product,
    a row that sees nothing included (every region has it)."""
    return Hazard("non-finite V", "input", "every V row of a valid key is finite",
                  lambda m: (math.isfinite(m.v_max), None),
                  note="P = 0 does not mask it: 0 * inf and 0 * NaN are NaN. Structural")


_TORCH_FORMATS = {"bf16": torch.bfloat16, "f16": torch.float16, "e4m3": torch.float8_e4m3fn,
                  "e5m2": torch.float8_e5m2, "none": torch.float32}


def _cast_log2(e, fmt: str) -> np.ndarray:
    """log2 of the P cast's round-to-nearest of fp32 2^e (per element), the format's largest
    value where 2^e passes it: the most any P <= 2^e becomes after its cast."""
    p = torch.exp2(torch.as_tensor(np.asarray(e, dtype=np.float64)).float())
    p = p.clamp(max=FORMATS[fmt][0]).to(_TORCH_FORMATS[fmt]).double()
    return torch.log2(p).numpy()


def _floor_ls() -> float:
    """The smallest ls whose fp32 product with the causal floor is -inf."""
    lo, hi = 1.0, 2.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if math.isinf(f32(f32(mid) * CAUSAL_FLOOR)):
            hi = mid
        else:
            lo = mid
    return hi


def _v_scale_error(m: Measure, H: float, lift: float) -> float:
    """The error, as a fraction of max|V|, that V's scale adds below the subnormals: each of
    O's fp32 roundings (per tile the PV sum, the rescale and the add; the epilogue's
    product; 4 T + 3 in all) is off by at most 2^-150 absolute against an l of at least
    2^(H - lift), and the output's cast flushes below half its smallest subnormal."""
    if m.v_max <= 0:
        return 0.0
    if not math.isfinite(m.v_max):
        return math.inf
    tiles = float(((m.n + m.n_masked) / m.block_n).max()) if m.n.size else 1.0
    fl = OUTPUTS[m.out_fmt][0]
    e = F32_FLUSH - H + lift + math.log2(4 * tiles + 3) - math.log2(m.v_max)
    return (2.0 ** e if e < 1000 else math.inf) + 2.0 ** fl / (m.v_max * m.v_descale)


def _sentinel_margin(m: Measure, pol, tol: float, H: float, flush: float, unit: float):
    sem = pol.semantics
    to_scaled = (lambda x: x) if sem.mask_domain == "scaled" else (lambda x: f32(x * m.c))
    s_mask, s_init = to_scaled(sem.mask_value), to_scaled(sem.m_init)
    ok = m.defined
    if not ok.any():
        return True, math.inf
    masked = (m.n_masked > 0) & ok
    margins = []
    if masked.any() and math.isfinite(s_mask):
        need = 1.0 + np.log2(np.maximum(m.n_masked, 1)) - math.log2(tol)
        margins.append(float(((m.s_max - s_mask) - need)[masked].min()))
    if math.isfinite(s_init):
        lift = np.maximum(s_init - m.s_max, 0.0)
        # l >= 2^(H - lift): its reciprocal is finite while H - lift > -128
        margins.append(float((OVERFLOW + H - lift)[ok].min()))
        budget = tol - unit - _v_scale_error(m, H, float(lift[ok].max()))
        top = np.log2(np.maximum(m.n, 1)) + flush - H + lift
        margins.append(float(((math.log2(budget) if budget > 0 else -math.inf) - top)[ok].min()))
    margin = min(margins) if margins else math.inf
    return margin > 0, margin
