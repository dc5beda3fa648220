"""The safe region of a fixed-max policy (``Semantics.fixed_max``, e.g. Primus-Turbo's
forward): ``onset.bound`` hands such a policy here. Nothing rescales, so each hazard is read
off the row's raw scores against the fixed max F; the formats, the output's rounding and V's
scale error are ``bound``'s."""

from __future__ import annotations

import math

import numpy as np

from fa_lab.kernels._common.hazard import Hazard

from .bound import (FIXED_MAX_BOUND, FORMATS, OUTPUTS, OVERFLOW, Region, _fmt, _v_nonfinite,
                    _v_scale_error)


def region(pol, family: str, dtype: str, tolerance: float) -> Region:
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
    # the silent side: the row's largest P is 2^(s_max - F + H), not 2^H; against it the
    # cast's rounding, the flushed tails (the format's, or 2^-126 under ftz), V's scale
    # and the output's cast
    _, flush, unit = FORMATS[fmt]
    flush = max(flush, -126.0) if sem.ftz else flush
    out_unit = OUTPUTS["bf16" if dtype == "fp8" else {"fp32": "none"}.get(dtype, dtype)][1]

    def silent(m):
        ok = m.defined
        if not ok.any():
            return True, math.inf
        hf = (m.s_max - F + H)[ok]
        need = tolerance - unit - out_unit - _v_scale_error(m, float(hf.min()), 0.0)
        # the row's largest P is not a tail: n - 1 keys can flush
        tails = np.log2(np.maximum(m.n - 1, 2.0 ** -1074))
        top = float((tails[ok] + flush - hf).max())
        margin = (math.log2(need) if need > 0 else -math.inf) - top
        return margin >= 0, margin

    hz.append(Hazard(
        "silent mass loss (rounding and flushed tails)", "mass_loss",
        f"u_P + u_out + (n - 1) 2^({flush:g} - (s_max - F + H)) + e_V <= {tolerance:g} (e_V: V's "
        "scale against the row's largest P, 2^(s_max - F + H))", silent, exact=False,
        note="sufficient: §11.3's formula with the row's largest P at 2^(s_max - F + H)"))
    hz.append(Hazard(
        "NaN from a first tile with nothing visible", "nan", "none: the max never moves",
        lambda m: (True, None), never=True,
        note="F is finite and never replaced, so no exponent subtracts -inf from -inf"))
    zero_empty = sem.epilogue_guard != "none"
    hz.append(Hazard(
        "a row that sees nothing gives 0", "nan", "every row sees a key",
        lambda m: (zero_empty or not m.empty_rows, None), never=zero_empty,
        note="l = 0, and the epilogue's guard gives 0" if zero_empty else "1/l with l = 0"))
    hz.append(_v_nonfinite())
    return Region(pol, family, dtype, tolerance, tuple(hz))


FIXED_MAX_BOUND.append(region)
