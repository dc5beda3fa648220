"""Rescale policies: a name plus its parameters, resolved once here.

The models and kernels branch on ``RescalePolicy.name`` in one place each; everything a
user can say about the rescale (``rescale=``, ``dualwave_swp_lazy_rescale=``,
``rescale_threshold=``, ``rebase_bound=``, ``p_headroom=``) is checked and folded into one
``RescalePolicy`` here, so that nothing asked for is silently ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .numerics import E4M3_MAX

#: DUALWAVE_SWP_RESCALE_THRESHOLD upstream, in log2 units.
DEFAULT_THRESHOLD = 8.0
#: The seed's proposed cap on a downward rebase of the fp8 helper, in log2 units.
DEFAULT_REBASE_BOUND = 16.0

#: What each policy means (shown in the CLI, the notebooks and error messages).
POLICIES_BF16 = {
    "eager": "rescale every tile to fmax(m, tile max): the reference online softmax",
    "lazy": "wave ballot, then every row rebases to fmax(m, tile max) (PR #1033, fixed)",
    "lazy_unfixed": "wave ballot, then every row rebases to its own tile max (upstream main before #1033)",
    "fa4_row": "FlashAttention-4: each row rebases to fmax(m, tile max) only if it jumped past the "
               "threshold itself; the wave's O multiply is skipped when no row needs it",
}
POLICIES_FP8 = {
    "eager": "rescale every pair to fmax(m, tile max) (PR #1020's eager helper)",
    "lazy": "wave ballot, monotonic rebase to fmax(m, tile max) (PR #1033)",
    "lazy_unfixed": "wave ballot, every row rebases to its own tile max (upstream main)",
    "lazy_capped": "wave ballot, downward rebases larger than rebase_bound skipped (the seed's proposal)",
}
LAZY_POLICIES = frozenset({"lazy", "lazy_unfixed", "lazy_capped", "fa4_row"})


@dataclass(frozen=True)
class RescalePolicy:
    """A resolved rescale policy.

    ``threshold`` is the ballot threshold (log2 units; fp8 compares scaled differences).
    ``rebase_bound`` is set for ``lazy_capped`` only. ``p_headroom`` is the value H added
    to the fp8 P exponent (0 when off); always 0 for bf16.
    """

    name: str
    threshold: float = DEFAULT_THRESHOLD
    rebase_bound: float | None = None
    p_headroom: float = 0.0

    @property
    def lazy(self) -> bool:
        return self.name in LAZY_POLICIES

    def describe(self) -> str:
        parts = [self.name]
        if self.lazy:
            parts.append(f"thr={self.threshold:g}")
        if self.rebase_bound is not None:
            parts.append(f"bound={self.rebase_bound:g}")
        if self.p_headroom:
            parts.append(f"H={self.p_headroom:.3f}")
        return " ".join(parts)


def threshold_by_kv_len(seqlen_kv: int) -> float:
    """Upstream fp8 threshold after PR #1020: 6 for Skv <= 4096, else 4."""
    return 6.0 if seqlen_kv <= 4096 else 4.0


def _check_number(name: str, value, allow_none=True):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def resolve(
    *,
    fp8: bool,
    seqlen_kv: int,
    rescale: str | None = None,
    dualwave_swp_lazy_rescale: bool = True,
    rescale_threshold: float | str | None = None,
    rebase_bound: float | None = None,
    p_headroom: bool | float | None = None,
) -> RescalePolicy:
    """Fold the user's rescale arguments into one policy, or raise naming the argument."""
    table = POLICIES_FP8 if fp8 else POLICIES_BF16
    if not isinstance(dualwave_swp_lazy_rescale, bool):
        raise TypeError("dualwave_swp_lazy_rescale must be a bool, "
                        f"got {type(dualwave_swp_lazy_rescale).__name__}")
    if rescale is None:
        name = "lazy" if dualwave_swp_lazy_rescale else "eager"
    else:
        if not isinstance(rescale, str):
            raise TypeError(f"rescale must be a policy name (str), got {type(rescale).__name__}")
        if rescale not in table:
            kind = "fp8" if fp8 else "bf16/f16"
            raise ValueError(f"rescale={rescale!r} is not a {kind} policy; choose one of {sorted(table)}")
        if not dualwave_swp_lazy_rescale and rescale in LAZY_POLICIES:
            raise ValueError(f"rescale={rescale!r} contradicts dualwave_swp_lazy_rescale=False")
        name = rescale

    lazy = name in LAZY_POLICIES
    if isinstance(rescale_threshold, str):
        if rescale_threshold != "by_kv_len":
            raise ValueError(f"rescale_threshold must be a number or 'by_kv_len', got {rescale_threshold!r}")
        if not fp8:
            raise ValueError("rescale_threshold='by_kv_len' is the fp8 kernel's rule (PR #1020); "
                             "give a number for bf16/f16")
        threshold = threshold_by_kv_len(seqlen_kv)
    else:
        threshold = _check_number("rescale_threshold", rescale_threshold)
        if threshold is None:
            threshold = DEFAULT_THRESHOLD
    if rescale_threshold is not None and not lazy:
        raise ValueError(f"rescale_threshold has no effect with rescale={name!r} (eager rescales every tile)")

    bound = _check_number("rebase_bound", rebase_bound)
    if name == "lazy_capped":
        bound = DEFAULT_REBASE_BOUND if bound is None else bound
    elif bound is not None:
        raise ValueError(f"rebase_bound applies to rescale='lazy_capped' only, not {name!r}")

    headroom = 0.0
    if p_headroom is not None:
        if not fp8:
            raise ValueError("p_headroom applies to fp8 inputs only (PR #1020 lifts the fp8 P before its cast)")
        if isinstance(p_headroom, bool):
            if p_headroom:
                # The largest P of a lazy row is 2**THR before the lift, so the lift is
                # log2(448) - THR; an eager row's largest P is 1.
                headroom = math.log2(E4M3_MAX) - (threshold if lazy else 0.0)
        else:
            headroom = _check_number("p_headroom", p_headroom, allow_none=False)
    return RescalePolicy(name=name, threshold=threshold, rebase_bound=bound, p_headroom=headroom)
