"""Inputs built at each hazard's boundary from its mechanism, for ``onset.bound``'s check:
just inside (margin >= 0) nothing fails; just outside the hazard's failure appears.

    from fa_lab.studies.onset import edges
    e = edges.edge("lazy", "accumulator overflow")     # an Edge, or None (edges.skipped says why)
    e.inside_fails, e.outside_fails, e.t_inside, e.t_outside

Each hazard has a builder (``BUILDERS``, by the hazard's name): a one-parameter family of
inputs ``case(t)`` along which the hazard's margin falls monotonically, built so that the
mechanism the hazard names is what fails there (the keys all at the stale excess for an
overflow, the masked keys of the first tile for a hollow-tile NaN, and so on). ``edge``
bisects ``t`` on the margin that ``measure`` reads off the input (so the scores are the
kernel's own, every cast included) down to ``eps``, and runs the policy's kernel at both
ends: the online-softmax model for a policy with semantics of its own (one query row,
D = 1, log2-unit scores, fp32), the DUALWAVE_SWP model for a FlyDSL policy (bf16, D = 64,
one 32-row wave; a drag's wave on the online model: 32 rows, D = 32). An *exact* hazard
must fail at ``t_outside``; a sufficient one must fail
by ``t_outside + slack`` (``Edge.beyond``), the slack its builder states.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .bound import bound
from .edge_builders import BUILDERS, SKIPPED, TOLERANCE_FOR, Case
from .measure import measure

#: The bisection's last step, in the parameter's units (log2 units for a magnitude).
EPS = 1e-3


@dataclass
class Edge:
    policy: str
    hazard: str
    parameter: str
    exact: bool
    t_inside: float
    t_outside: float
    inside_violates: list     # the region's other hazards the inside input lies outside of
    margin_inside: float | None
    margin_outside: float | None
    inside_fails: list
    outside_fails: list
    beyond: float | None = None
    beyond_fails: list | None = None


def _bias(case: Case):
    if case.mask is None:
        return None
    return torch.where(case.mask, 0.0, -math.inf)


def region_and_measure(pol, case: Case, tol: float = 0.25):
    from fa_lab.kernels.online.model import LOG2_UNITS

    region = bound(pol, dtype=case.dtype, tolerance=tol)
    if case.kind == "online":
        m = measure(case.q, case.k, case.v, policy=pol, bias=case.mask,
                    seqlen_kv=case.seqlen_kv, softmax_scale=LOG2_UNITS, dtype=case.dtype,
                    **case.descales())
    else:
        b = _bias(case)
        m = measure(case.q, case.k, case.v, policy=pol, bias=None if b is None else b.expand(
            case.q.shape[1], case.k.shape[1]), dtype=case.dtype, **case.descales())
    return region, m


def margin_of(pol, hazard: str, case: Case, tol: float = 0.25):
    """(inside, margin) of ``case`` for ``pol``'s hazard ``hazard``."""
    region, m = region_and_measure(pol, case, tol)
    h = next(h for h in region.hazards if h.name == hazard)
    ok, margin = h.check(m)
    return bool(ok), margin


def _online_fails(pol, case: Case, tol: float) -> dict:
    """The online model's failures on ``case`` against the fp64 reference (whose masked
    keys are zeroed: a masked key's K and V take no part in the attention asked for)."""
    from fa_lab import reference
    from fa_lab.kernels.online.model import LOG2_UNITS, forward

    rec: list = []
    out, _ = forward(case.q, case.k, case.v, policy=pol, mask=case.mask,
                     seqlen_kv=case.seqlen_kv, softmax_scale=LOG2_UNITS, record=rec,
                     **case.descales())
    n = case.k.shape[1] if case.seqlen_kv is None else case.seqlen_kv
    vd = 1.0 if case.v_descale is None else float(case.v_descale)
    k, v = case.k[:, :n].double(), case.v[:, :n].double() * vd
    bias = None
    if case.mask is not None:
        vis = case.mask[:, :n]
        if vis.shape[0] == 1:   # one row: its masked keys' K takes no part
            k = torch.where(vis.T[None, :, :, None], k, 0.0)
        bias = torch.where(vis, 0.0, -math.inf).double()
    ref, rl = reference.attention(case.q.double(), k, v, dtype=torch.float64,
                                  softmax_scale=LOG2_UNITS, bias=bias)
    o = out.double()
    defined = torch.isfinite(rl).permute(0, 2, 1)
    fin = torch.isfinite(o).all(-1)
    vv = v.abs()[torch.isfinite(v)]
    vmax = float(vv.max()) if vv.numel() else 1.0
    err = torch.where(defined & fin, (o - ref).abs().amax(-1), torch.zeros_like(o[..., 0]))
    return {"nonfinite": bool((~fin & defined).any()),
            "empty": bool((~defined & (~fin | (o != 0).any(-1))).any()),
            "silent": bool((err > tol * max(vmax, 1e-300)).any()),
            "saturation": any(bool((r.saturated > 0).any()) for r in rec),
            "nan_factor": any(bool(torch.isnan(r.o_factor).any()) for r in rec)}


def fails(pol, case: Case, tol: float = 0.25) -> list:
    """The classes of failure ``case`` shows under ``pol``'s kernel."""
    if case.kind == "online":
        return sorted(c for c, bad in _online_fails(pol, case, tol).items() if bad)
    import warnings

    from fa_lab import api, reference

    b = _bias(case)
    mods = {} if b is None else {"bias": b.expand(case.q.shape[1], case.k.shape[1])
                                 .to(torch.bfloat16)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kernel = "swp_bf16" if case.v_descale is None else "swp_fp8"
        out = api.flash_attn_func(case.q, case.k, case.v, causal=False, rescale=pol,
                                  backend="emulator", kernel=kernel, **mods,
                                  **case.descales()).double()
    ref, lse = reference.attention(case.q, case.k, case.v, causal=False, dtype=torch.float64,
                                   **mods, **case.descales())
    defined = torch.isfinite(lse).permute(0, 2, 1)
    fin = torch.isfinite(out).all(-1)
    vmax = float(case.v.double().abs().max()) * (case.v_descale or 1.0)
    err = torch.where(defined & fin, (out - ref).abs().amax(-1), torch.zeros_like(out[..., 0]))
    found = {"nonfinite": bool((~fin & defined).any()),
             "empty": bool((~defined & (~fin | (out != 0).any(-1))).any()),
             "silent": bool((err > tol * max(vmax, 1e-300)).any())}
    return sorted(c for c, bad in found.items() if bad)


def skipped(policy, hazard: str) -> str | None:
    """Why ``edge`` gives no input for ``policy``'s ``hazard`` (None: it gives one, or the
    hazard is unknown to the builders and ``SKIPPED``: a new hazard, which needs one)."""
    from fa_lab import policies
    from fa_lab.studies import adversary as A

    pol = policies.as_policy(policy)
    if hazard in SKIPPED:
        return SKIPPED[hazard]
    if hazard not in BUILDERS:
        return None
    built = BUILDERS[hazard](pol, "swp" if A.kernel_for(pol) == A.KERNEL else "online")
    return built if isinstance(built, str) else None


def edge(policy, hazard: str, *, eps: float = EPS) -> Edge | None:
    """The hazard's edge for ``policy`` (module docstring), or None where its builder has no
    input for the policy's kernel (``skipped`` says why) or the hazard is ``never``."""
    from fa_lab import policies
    from fa_lab.studies import adversary as A

    pol = policies.as_policy(policy)
    kind = "swp" if A.kernel_for(pol) == A.KERNEL else "online"
    tol = TOLERANCE_FOR.get(hazard, 0.25)
    region = bound(pol, dtype="fp32" if kind == "online" else "bf16", tolerance=tol)
    h = next((h for h in region.hazards if h.name == hazard), None)
    if h is None or h.never or hazard not in BUILDERS:
        return None
    built = BUILDERS[hazard](pol, kind)
    if built is None or isinstance(built, str):
        return None
    param, case, lo, hi, classes, slack = built
    if case(lo).dtype != region.dtype:   # built on another call (an fp8 call's descale)
        region = bound(pol, dtype=case(lo).dtype, tolerance=tol)
        h = next(h for h in region.hazards if h.name == hazard)
    ok_lo, _ = margin_of(pol, hazard, case(lo), tol)
    ok_hi, _ = margin_of(pol, hazard, case(hi), tol)
    if not ok_lo or ok_hi:
        raise ValueError(f"{pol.name}: {hazard}: the builder's ends do not straddle the edge "
                         f"({param} {lo} inside: {ok_lo}, {hi} inside: {ok_hi})")
    step = eps
    structural = h.kind == "nan" and margin_of(pol, hazard, case(lo), tol)[1] is None
    if structural:
        step = 1.0
    while abs(hi - lo) > step:
        mid = (lo + hi) / 2
        if structural:
            mid = float(math.floor(mid)) if mid != lo else lo + 1
            if mid in (lo, hi):
                break
        if margin_of(pol, hazard, case(mid), tol)[0]:
            lo = mid
        else:
            hi = mid
    inside, outside = case(lo), case(hi)
    got_in = [c for c in fails(pol, inside, tol) if c in classes]
    got_out = [c for c in fails(pol, outside, tol) if c in classes]
    beyond = beyond_fails = None
    if isinstance(slack, str) and slack.startswith("="):
        beyond = float(slack[1:])
    elif isinstance(slack, str):
        beyond = float(slack[1:]) * hi
    elif slack:
        beyond = hi + math.copysign(slack, hi - lo)
    if beyond is not None:
        beyond_fails = [c for c in fails(pol, case(beyond), tol) if c in classes]
    reg, m = region_and_measure(pol, inside, tol)
    others = [n for n in reg.violated(m) if n != hazard]
    return Edge(pol.name, hazard, param, h.exact and not slack, lo, hi, others,
                margin_of(pol, hazard, inside, tol)[1], margin_of(pol, hazard, outside, tol)[1],
                got_in, got_out, beyond, beyond_fails)
