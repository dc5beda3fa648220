"""Safe regions in closed form: for a policy (a built-in or a failure zoo preset), the inputs
on which no overflow, NaN, saturation or silent mass loss can happen.

    from fa_lab.studies import onset
    region = onset.bound("fa4_fp8_saturation:before")
    print(region.describe())              # each hazard: its formula, exact or sufficient
    m = onset.measure(q, k, v, policy="fa4_fp8_saturation:before", causal=False)
    region.contains(m), region.violated(m)

``docs/semantics.md`` §11 derives every formula. The quantities they read (``Measure``)
are taken per row, in log2 units, on the tiles the policy's kernel visits (``block_n``
columns, in its ``kv_order``):

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
  has more queries than keys.

A ``Hazard`` is one way to fail, with the formula of its safe side, whether that formula is
the exact boundary or only sufficient, and ``never`` where the policy's own fields rule it
out for every input. A continuous hazard reports a ``margin`` in log2 units (>= 0 inside).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from fa_lab import values
from fa_lab.checks import check_int
from fa_lab.numerics import CAUSAL_FLOOR, E4M3_MAX, LOG2E, f32

#: log2 of the fp32 overflow boundary.
OVERFLOW = 128.0
#: Each P format: (largest finite value, log2 of half its smallest subnormal (a P below it
#: rounds to 0), its unit roundoff 2^-(mantissa bits + 1)).
FORMATS = {"e4m3": (E4M3_MAX, -10.0, 2.0 ** -4), "e5m2": (57344.0, -17.0, 2.0 ** -3),
           "f16": (65504.0, -25.0, 2.0 ** -11), "bf16": (3.3895313892515355e38, -134.0, 2.0 ** -9),
           "none": (math.inf, -150.0, 2.0 ** -24)}
#: The default tolerance of the silent hazards, as the attack's ``silent`` class.
TOLERANCE = 0.25
#: The fp8 kernel's addend -ls * m loses the row max once its magnitude passes 2^32.
FP8_ADDEND_LOG2 = 32.0

_INPUT_FORMAT = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "none",
                 torch.float8_e4m3fn: "e4m3"}


@dataclass
class Measure:
    """What the formulas read off one input (module docstring). Per-row arrays cover every
    (batch, head, query row); ``defined`` marks the rows that see a key."""

    defined: np.ndarray
    hollow_first: np.ndarray
    hollow_after: np.ndarray
    R: np.ndarray
    Jup: np.ndarray
    steps: np.ndarray
    n: np.ndarray
    n_masked: np.ndarray
    s_max: np.ndarray
    v_max: float
    tail_nonfinite: bool
    causal: bool = False
    causal_short: bool = False
    c: float = 1.0
    ls: float | None = None
    block_n: int = 64

    @property
    def empty_rows(self) -> bool:
        return bool((~self.defined).any())


@dataclass(frozen=True)
class Hazard:
    """One way to fail. ``check(m) -> (safe, margin)``: margin in log2 units (None for a
    structural hazard); ``exact``: the formula is the boundary itself (else sufficient);
    ``never``: the policy's fields rule it out on every input; ``note``: why, or why no
    closed form holds."""

    name: str
    kind: str
    formula: str
    check: Callable = field(repr=False, compare=False)
    exact: bool = True
    never: bool = False
    note: str = ""

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "formula": self.formula, "exact": self.exact,
                "never": self.never, "note": self.note}


@dataclass(frozen=True)
class Region:
    """``bound``'s answer: the policy's hazards; an input is inside when none applies."""

    policy: object
    kernel: str
    dtype: str
    tolerance: float
    hazards: tuple

    def violated(self, m: Measure) -> list[str]:
        """The hazards ``m`` lies outside of (names)."""
        return [h.name for h in self.hazards if not h.never and not h.check(m)[0]]

    def contains(self, m: Measure) -> bool:
        return not self.violated(m)

    def margins(self, m: Measure) -> dict:
        """Each continuous hazard's margin (log2 units, >= 0 inside) on ``m``."""
        return {h.name: h.check(m)[1] for h in self.hazards if not h.never
                and h.check(m)[1] is not None}

    def describe(self) -> str:
        lines = [f"{self.policy.name} on {self.kernel} ({self.dtype}): safe where"]
        for h in self.hazards:
            tag = "never" if h.never else ("exact" if h.exact else "sufficient")
            lines.append(f"  [{h.kind}] {h.name}: {h.formula} ({tag})")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"policy": self.policy.name, "kernel": self.kernel, "dtype": self.dtype,
                "tolerance": self.tolerance, "hazards": [h.to_dict() for h in self.hazards]}


def _resolve(policy, dtype: str, seqlen_kv: int):
    from fa_lab import dispatch, policies

    pol = policies.as_policy(policy)
    if pol.rule is not None:
        raise ValueError(f"policy {pol.name!r} decides by a Python rule (Policy.from_rule): "
                         "onset.bound derives a region from what a policy's vote and rebase "
                         "values declare (fa_lab.values), and a rule has none; use onset.predict "
                         "or the attack (fa_lab.studies.adversary) on it")
    family = dispatch.semantic_family(pol)
    if family is None:
        family = "swp_fp8" if dtype == "fp8" else "swp_bf16"
    any_dtype = dispatch.TABLE[(family, "emulator")].caps.headroom_any_dtype
    return policies.resolve(fp8=dtype == "fp8", seqlen_kv=seqlen_kv, rescale=pol,
                            headroom_any_dtype=any_dtype), family


def _fmt(pol, dtype: str, family: str) -> str:
    if family == "swp_fp8":
        return "e4m3"
    cast = pol.semantics.p_cast
    if cast == "input":
        return {"bf16": "bf16", "f16": "f16", "fp8": "e4m3", "fp32": "none"}[dtype]
    return cast


def _block_n(pol, family: str) -> int:
    return 128 if family == "swp_fp8" else (pol.semantics.block_n or 64)


def _drags(pol) -> bool:
    """Whether ``pol`` can lower a row's max without that row's own vote: its vote moves
    rows that did not vote and its rebase may go down (``fa_lab.values``' ``drags`` and
    ``lowers``, so a new value is bounded by what it declares)."""
    return values.get("vote", pol.vote).drags and values.get("rebase", pol.rebase).lowers


#: Semantics fields the bound has no formula for: it refuses a policy that sets one.
UNBOUNDED = ("softcap", "softcap_form", "exp_floor", "mask_stage", "p_before_vote", "kv_split",
             "merge_empty", "lse_base")


#: Decode families whose safe regions live in their own folders (``kernels/<family>/bound.py``).
DECODE_FAMILIES = ("pa_decode", "mla_decode")


def bound(policy, *, dtype: str = "bf16", tolerance: float = TOLERANCE,
          seqlen_kv: int = 4096) -> Region:
    """The safe region of ``policy`` on the kernel it runs on: the online-softmax family for
    a policy with semantics of its own, else DUALWAVE_SWP, or the fp8 kernel for
    ``dtype="fp8"``. An input is inside when no hazard applies (``Region.violated``). A
    decode family's name (``DECODE_FAMILIES``, with ``:<upstream version>`` for
    ``pa_decode``) gives that family's own region (``kernels/<family>/bound.py``'s
    ``region``).

    Parameters
    ----------
    policy : str or fa_lab.Policy
        A registered policy's name (the zoo's presets included), a Policy, or a decode
        family's name (``"pa_decode:main-11c4174d"``, ``"mla_decode"``).
    dtype : str
        The inputs' type: ``"bf16"`` (default), ``"f16"``, ``"fp8"`` or ``"fp32"``.
    tolerance : float
        The silent hazards' error, as a fraction of max|V|, in (0, 1).
    seqlen_kv : int
        Resolves an fp8 threshold rule (``"by_kv_len"``); default 4096.

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
    >>> live("sdpa_masked_row:before")
    ['accumulator overflow', 'NaN from a first tile with nothing visible', 'a row that sees nothing gives 0']
    >>> live("sdpa_masked_row:after")     # the fix rules the empty row out
    ['accumulator overflow']
    >>> "drag onto a tile with nothing visible" in live("lazy_unfixed")
    True
    >>> onset.bound("lazy").kernel, onset.bound("sdpa_masked_row:after").kernel
    ('swp_bf16', 'online')
    """
    if isinstance(policy, str) and policy.partition(":")[0] in DECODE_FAMILIES:
        import importlib
        family, _, version = policy.partition(":")
        return importlib.import_module(f"fa_lab.kernels.{family}").bound.region(version or None)
    if dtype not in ("bf16", "f16", "fp8", "fp32"):
        raise ValueError(f"dtype must be 'bf16', 'f16', 'fp8' or 'fp32', got {dtype!r}")
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 < tolerance < 1:
        raise ValueError(f"tolerance must be a number in (0, 1), got {tolerance!r}")
    pol, family = _resolve(policy, dtype, seqlen_kv)
    sem = pol.semantics
    unbounded = [f for f in UNBOUNDED if f in pol.semantic_fields]
    if unbounded:
        raise ValueError(f"onset.bound cannot bound policy {pol.name!r}: its semantics field(s) "
                         f"{', '.join(unbounded)} (a softcap, an exp floor, a late mask, P before "
                         "the vote, a merge of partials) have no hazard formula here")
    if sem.fixed_max is not None:
        return _fixed_max_region(pol, family, dtype, float(tolerance))
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
        o = np.minimum(e, log_fmax) + log_n + math.log2(max(m.v_max, 2.0 ** -149))
        top = np.maximum(o, e + log_n)
        margin = OVERFLOW - float(top[ok].max()) if ok.any() else math.inf
        return margin > 0, margin

    dev = ("min(R, B steps)" if math.isfinite(cap) else "R") if drags else (
        "Jup" if lag else "min(THR, Jup)")
    hz.append(Hazard(
        "accumulator overflow", "overflow",
        f"min(H + {dev}, log2 Fmax) + log2 n + log2 max|V| < 128 and H + {dev} + log2 n < 128 "
        f"(H = {H:g}, THR = {tau:g}, Fmax = {fmax:g}, the largest {fmt} P)", overflow,
        exact=not drags,
        note=("a dragged row's deficit reaches at most R, but whether a ballot drags it that far "
              "depends on the other rows of its wave: sufficient, the exact onset is the "
              "recurrence (onset.predict)") if drags else
             "tight when n keys all sit at the stale base's full excess"))

    # 2. saturation of the P cast
    never_sat = not math.isfinite(fmax) or (not drags and not lag and H + tau <= log_fmax)

    def saturation(m):
        ok = m.defined
        margin = log_fmax - H - float(excess(m)[ok].max()) if ok.any() else math.inf
        return margin >= 0, margin

    hz.append(Hazard(
        "P saturation", "saturation",
        f"H + {dev} <= log2({fmax:g}) = {log_fmax:.4f} ({fmt} P)", saturation,
        never=never_sat, exact=not drags,
        note=(f"H + THR = {H + tau:g} <= {log_fmax:.4f}: no P can pass the format" if never_sat
              else "the clipped P keeps its full weight in l: the row loses mass silently")))

    # 3. P values below half the format's smallest subnormal round to 0
    def mass_loss(m):
        ok = m.defined
        if not ok.any():
            return True, math.inf
        need = math.log2(tolerance - unit) if tolerance > unit else -math.inf
        margin = need - float((np.log2(np.maximum(m.n, 1)) + flush - H)[ok].max())
        return margin >= 0, margin

    tiny = tolerance > unit and math.log2(tolerance - unit) - (flush - H) >= 64
    hz.append(Hazard(
        "silent mass loss (rounding and flushed tails)", "mass_loss",
        f"2^-{-math.log2(unit):g} + n 2^({flush:g} - H) <= {tolerance:g} ({fmt} P)", mass_loss,
        exact=False, never=tiny,
        note="sufficient: every key's P is off by at most its unit roundoff or the flushed "
             "2^flush, against a largest P of at least 2^H"))

    # 4. structural NaN: a row's max is -inf after a tile with nothing visible
    guard = (sem.tile_max_floor == "always" or sem.empty_row_guard != "none" or sem.clamp_exp_diff
             or sem.mask_value != -math.inf or sem.m_init != -math.inf)
    causal_floor = sem.tile_max_floor == "causal" and not guard

    def hollow(m):
        bad = m.hollow_first & m.defined
        return (causal_floor and m.causal) or not bool(bad.any()), None

    hz.append(Hazard(
        "NaN from a first tile with nothing visible", "nan",
        f"every row sees a key in the first {_block_n(pol, family)}-column tile it visits"
        + (" (or the call is causal: its tile max is floored)" if causal_floor else ""), hollow,
        never=guard, note=("a floor, an empty-row guard, a clamp or a finite sentinel keeps "
                           "the max finite" if guard else
                           "(-inf) - (-inf) = NaN in the factor and in P; no magnitude is "
                           "involved, so the boundary is one tile: the first visible key's "
                           "column against block_n")))
    if drags:
        def drag_hollow(m):
            return not bool((m.hollow_after & m.defined).any()), None

        hz.append(Hazard(
            "drag onto a tile with nothing visible", "nan",
            "no row sees an all-masked tile after its first visible key", drag_hollow,
            note="a firing wave rebases a row to that tile's max, -inf or the floor; the "
                 "next exponent against it is NaN or inf. Structural, no magnitude"))

    # 5. rows that see nothing
    def empty(m):
        floored = causal_floor and m.causal and sem.epilogue_guard != "none"
        return floored or not m.empty_rows, None

    zero_empty = guard and sem.epilogue_guard != "none" and (
        sem.mask_value == -math.inf or sem.empty_row_guard == "zero_base")
    hz.append(Hazard(
        "a row that sees nothing gives 0", "nan",
        "every row sees a key", empty, never=zero_empty,
        note=("the guard keeps P at 0 and the epilogue gives 0" if zero_empty else
              "NaN (no guard, or 1/l with l = 0) or the mean of V (a finite sentinel weighs "
              "every masked column 1): structural")))

    # 6. finite sentinels: masked columns weigh 2^(sigma - s_max); a base held above the
    #    row's scores pushes every P down towards the format's flush point
    sentinel = sem.mask_value != -math.inf or sem.m_init != -math.inf
    if sentinel:
        # a sentinel at -1e38 log2 units or below weighs nothing beside any finite score
        far = all(x == -math.inf or (sem.mask_domain == "scaled" and x <= -1e38)
                  for x in (sem.mask_value, sem.m_init))

        def near_sentinel(m):
            return _sentinel_margin(m, pol, tolerance, H, flush, unit)

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
    return Region(pol, family, dtype, float(tolerance), tuple(hz))


def _fixed_max_region(pol, family: str, dtype: str, tolerance: float) -> Region:
    """A fixed max F (``semantics.fixed_max``): nothing rescales, so every P is 2^(x - F)
    against the row's raw scores. Overflow: a P past the cast's range, or l or O past
    fp32's; a zero row: every P flushed."""
    sem = pol.semantics
    F, H = float(sem.fixed_max), float(pol.p_headroom)
    fmt = _fmt(pol, dtype, family)
    fmax = FORMATS[fmt][0]
    mant = {"e4m3": 3, "e5m2": 2, "f16": 10, "bf16": 7, "none": 23}[fmt]
    # a P rounds to inf (non-saturating cast) from the midpoint of the format's largest
    # value and the next power of two; fp32 itself overflows at that midpoint too
    fp32_edge = OVERFLOW + math.log2(1 - 2.0 ** -25)
    top = (math.log2(fmax + 2.0 ** (math.floor(math.log2(fmax)) - mant - 1))
           if math.isfinite(fmax) else fp32_edge)
    edge = min(fp32_edge if sem.p_saturate else top, fp32_edge)
    hz = []

    def overflow(m):
        ok = m.defined
        if not ok.any():
            return True, math.inf
        e = m.s_max - F + H + np.log2(np.maximum(m.n, 1)) + math.log2(max(m.v_max, 1.0))
        margin = edge - float(e[ok].max())
        return margin > 0, margin

    hz.append(Hazard(
        "overflow at the fixed max", "overflow",
        f"s_max - F + H + log2 n + log2 max(1, max|V|) < {edge:.6f} (F = {F:g}, H = {H:g}; "
        f"{fmt} P{' saturating' if sem.p_saturate else ''})", overflow, exact=False,
        note="exact for one visible key with |V| <= 1 (its P reaches the format's or fp32's "
             "overflow point); with n keys and larger V, l and O overflow earlier: sufficient"))

    low = -126.0 if sem.ftz else -128.0

    def zero_row(m):
        ok = m.defined
        if not ok.any():
            return True, math.inf
        margin = float((m.s_max - F + H)[ok].min()) - low
        return (margin >= 0) if sem.ftz else (margin > 0), margin

    hz.append(Hazard(
        "underflow at the fixed max", "mass_loss",
        f"s_max - F + H {'>=' if sem.ftz else '>'} {low:g}", zero_row, exact=sem.ftz,
        note=("every P below 2^-126 flushes to 0: a row whose best score lies below F - 126 "
              "sums l = 0 and gives a zero row, silently" if sem.ftz else
              "subnormal P: below F - 128 the row's l is under 2^-128 and rcp(l) overflows, "
              "or l rounds to 0 (a zero row): sufficient")))
    hz.append(Hazard(
        "NaN from a first tile with nothing visible", "nan", "none: the max never moves",
        lambda m: (True, None), never=True,
        note="F is finite and never replaced, so no exponent subtracts -inf from -inf"))
    zero_empty = sem.epilogue_guard != "none"
    hz.append(Hazard(
        "a row that sees nothing gives 0", "nan", "every row sees a key",
        lambda m: (zero_empty or not m.empty_rows, None), never=zero_empty,
        note="l = 0, and the epilogue's guard gives 0" if zero_empty else "1/l with l = 0"))
    return Region(pol, family, dtype, tolerance, tuple(hz))


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


def _seqlens(seqlen_kv, B: int, Skv: int) -> list[int] | None:
    """Per-sequence key counts as a list of B ints in 0 .. Skv, or None for one count
    (None or an int, which ``measure`` takes as it is); ValueError/TypeError naming
    ``seqlen_kv``."""
    if seqlen_kv is None:
        return None
    if isinstance(seqlen_kv, torch.Tensor):
        if seqlen_kv.dim() == 0:
            seqlen_kv = seqlen_kv.item()
        else:
            seqlen_kv = seqlen_kv.tolist()
    if not isinstance(seqlen_kv, (list, tuple)):
        n = check_int("seqlen_kv", seqlen_kv, lo=0)
        if n > Skv:
            raise ValueError(f"seqlen_kv={n} exceeds the {Skv} keys of k")
        return None
    if len(seqlen_kv) != B:
        raise ValueError(f"seqlen_kv has {len(seqlen_kv)} lengths; q has {B} sequences")
    lens = [check_int(f"seqlen_kv[{i}]", n, lo=0) for i, n in enumerate(seqlen_kv)]
    for i, n in enumerate(lens):
        if n > Skv:
            raise ValueError(f"seqlen_kv[{i}]={n} exceeds the {Skv} keys of k")
    return lens


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
        if tol > unit:
            top = np.log2(np.maximum(m.n, 1)) + flush - H + lift
            margins.append(float((math.log2(tol - unit) - top)[ok].min()))
    margin = min(margins) if margins else math.inf
    return margin > 0, margin


def measure(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, policy, causal: bool = False,
            bias: torch.Tensor | None = None, seqlen_kv=None,
            softmax_scale: float | None = None, q_descale: float | None = None,
            k_descale: float | None = None, dtype: str | None = None) -> Measure:
    """The ``Measure`` of one input (q [B, Sq, H, D], k and v [B, Skv, Hkv, D]; ``bias``
    [Sq, Skv] in natural-log units, -inf = masked, or bool, True = visible; ``seqlen_kv``
    the valid keys: an int for every sequence, B ints (a list, tuple or 1-D tensor: one per
    sequence, as the zoo's cases give them) or None, Skv) on the tiles ``policy``'s kernel
    visits. Scores are q.k rounded to fp32 times c = f32(scale q_descale k_descale) log2 e (a policy
    with ``q_prescale``: round(q c) . k, as its kernel computes them)."""
    lens = _seqlens(seqlen_kv, q.shape[0], k.shape[1])
    if lens is not None:  # one sequence at a time, the rows joined in [B, H, Sq] order
        parts = [measure(q[b:b + 1], k[b:b + 1], v[b:b + 1], policy=policy, causal=causal,
                         bias=bias, seqlen_kv=n, softmax_scale=softmax_scale,
                         q_descale=q_descale, k_descale=k_descale, dtype=dtype)
                 for b, n in enumerate(lens)]
        joined = {f.name: np.concatenate([getattr(m, f.name) for m in parts])
                  for f in dataclasses.fields(Measure)
                  if isinstance(getattr(parts[0], f.name), np.ndarray)}
        return dataclasses.replace(parts[0], **joined, v_max=max(m.v_max for m in parts),
                                   tail_nonfinite=any(m.tail_nonfinite for m in parts),
                                   causal_short=any(m.causal_short for m in parts))
    if dtype is None:
        dtype = "fp8" if q.dtype == torch.float8_e4m3fn else _INPUT_FORMAT.get(q.dtype, "bf16")
        dtype = "fp32" if dtype == "none" else dtype
    pol, family = _resolve(policy, dtype, k.shape[1])
    sem = pol.semantics
    bn = _block_n(pol, family)
    B, Sq, H, D = q.shape
    Skv = k.shape[1]
    n_kv = Skv if seqlen_kv is None else check_int("seqlen_kv", seqlen_kv, lo=0)
    qd = 1.0 if q_descale is None else q_descale
    kd = 1.0 if k_descale is None else k_descale
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else float(softmax_scale)
    c = f32(f32(scale * qd * kd) * f32(LOG2E))
    T = max(1, -(-n_kv // bn))
    width = T * bn
    G = H // k.shape[2]
    kf = k.float().repeat_interleave(G, dim=2)[:, :n_kv].nan_to_num(0.0)
    if sem.q_prescale and q.dtype in (torch.bfloat16, torch.float16):  # round(q c) . k
        qs = (q.float() * c).to(q.dtype).double()
        s = torch.einsum("bqhd,bkhd->bhqk", qs, kf.double()).float()
    else:
        s = torch.einsum("bqhd,bkhd->bhqk", q.double(), kf.double()).float() * c  # [B, H, Sq, n]
    vis = torch.ones(Sq, n_kv, dtype=torch.bool)
    if bias is not None:
        b = bias[:, :n_kv]
        if b.dtype == torch.bool:
            vis = vis & b
        else:  # an entry whose log2-unit value overflows fp32 masks its key, as in a kernel
            add = torch.where(b != -math.inf, b.float(), 0.0) * f32(LOG2E)
            vis = vis & (b != -math.inf) & torch.isfinite(add)
            s = s + torch.where(torch.isfinite(add), add, 0.0)
    if causal:
        vis = vis & (torch.arange(n_kv)[None, :] <= torch.arange(Sq)[:, None] + (n_kv - Sq))
    full = torch.full((B, H, Sq, width), -math.inf)
    full[..., :n_kv] = torch.where(vis, s, torch.full_like(s, -math.inf))
    vis_t = torch.zeros(Sq, width, dtype=torch.bool)
    vis_t[:, :n_kv] = vis
    tiles = full.reshape(B, H, Sq, T, bn).amax(-1)                     # -inf: nothing visible
    seen = vis_t.reshape(Sq, T, bn).any(-1).expand(B, H, Sq, T)
    order = list(range(T)) if sem.kv_order == "ascending" else list(range(T - 1, -1, -1))
    tiles, seen = tiles[..., order], seen[..., order]
    defined = seen.any(-1)
    first = torch.argmax(seen.to(torch.int8), dim=-1)                  # first tile with a key
    after = torch.arange(T)[None, None, None, :] > first[..., None]
    hollow_after = (~seen & after).any(-1)
    M = tiles.amax(-1)
    first_max = tiles.gather(-1, first[..., None])[..., 0]
    low = torch.where(seen, tiles, torch.full_like(tiles, math.inf)).amin(-1)
    n_vis = vis.sum(-1).expand(B, H, Sq)
    vv = v[:, :n_kv].float().abs().nan_to_num(math.inf)   # a non-finite V row: no bound holds
    v_max = float(vv.max()) if vv.numel() else 0.0
    tail = v[:, n_kv:min(Skv, width)].float()
    ls = None
    if family == "swp_fp8":
        from fa_lab.kernels.swp_fp8.model import log2_scale

        ls = log2_scale(qd, kd, D)
    flat = {name: x.reshape(-1).numpy() for name, x in (
        ("defined", defined), ("hollow_first", defined & ~seen[..., 0]),
        ("hollow_after", defined & hollow_after),
        ("R", torch.where(defined, M - low, torch.zeros_like(M)).double()),
        ("Jup", torch.where(defined, M - first_max, torch.zeros_like(M)).double()),
        ("n", n_vis), ("n_masked", width - n_vis), ("s_max", M.double()),
        ("steps", torch.full_like(n_vis, T - 1)))}
    return Measure(**flat, v_max=v_max, tail_nonfinite=bool((~torch.isfinite(tail)).any()),
                   causal=causal, causal_short=causal and Sq > n_kv, c=c, ls=ls, block_n=bn)
