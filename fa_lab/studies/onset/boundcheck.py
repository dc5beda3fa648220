"""``bound``'s two checks: no attack run inside a region fails, and the measured boundary of
each hazard lies within one binade (or one tile) of its formula.

* ``attack_inside(policy)``: ``fa_lab.studies.adversary.search`` with a region filter, so
  every judged run lies inside ``bound(policy)``; it should report "nothing in N runs found a failure".
* ``sweep(policy, hazard)``: one parameter of a worst-case input stepped across the
  hazard's boundary; at every step the model runs and the region's margin is read. The
  check holds when no step with margin >= 0 fails (sound) and the first failing step's
  margin is at least -1 (within one binade of the formula), or, for a structural hazard,
  the first failing step is the formula's tile boundary.
* ``atlas_onset``: the same comparison against a measured atlas (``data/atlas``), for the
  lazy drag's overflow over K scale.
"""

from __future__ import annotations

import math
import time

import torch

from .bound import _drags, bound
from .measure import measure

#: The sweeps ``sweep`` runs, by hazard name (``bound``'s).
SWEPT = ("accumulator overflow", "P saturation", "silent mass loss (rounding and flushed tails)",
         "finite sentinel", "NaN from a first tile with nothing visible",
         "a row that sees nothing gives 0", "V cache tail", "NaN factor through the O vote")


def region_filter(policy, *, dtype: str = "bf16", tolerance: float | None = None):
    """A callable(Candidate) -> bool: whether the attack's input lies inside
    ``bound(policy)`` (its ``Measure`` on the policy's tiles)."""
    from fa_lab.studies import adversary as A

    kw = {} if tolerance is None else {"tolerance": tolerance}
    region = bound(policy, dtype=dtype, **kw)

    def inside(c) -> bool:
        q, k, v = A.build(c)
        mods = A.build_mods(c)
        m = measure(q, k, v, policy=policy, causal=c.causal, bias=mods.get("bias"),
                    seqlen_kv=c.kv_used)
        return region.contains(m)

    return inside


def judged_classes(pol) -> tuple:
    """The attack's classes a zoo preset is judged on inside its region: every class (a
    softcap's too: the fp64 reference caps its scores as well, ``adversary.softcap_reference``)."""
    from fa_lab.studies import adversary as A

    return tuple(A.CLASSES)


def attack_inside(policy, *, budget_s: float = 20.0, seed: int = 0, max_evals=None) -> dict:
    """Attack ``policy`` inside its region: the zoo's space and every class of failure for a
    policy with semantics of its own, the ``values`` space with masks (bias) counting
    non-finite rows for a FlyDSL policy. Returns the attack's record, with the region."""
    from fa_lab import policies
    from fa_lab.studies import adversary as A

    pol = policies.as_policy(policy)
    zoo = A.kernel_for(pol) != A.KERNEL
    kw = dict(space="zoo", classes=judged_classes(pol)) if zoo else dict(space="values",
                                                                        mods="bias")
    t0 = time.perf_counter()
    res = A.search(pol, budget_s=budget_s, seed=seed, max_evals=max_evals,
                   region=region_filter(pol), **kw)
    return {"policy": pol.name, "space": res.space["name"], "classes": list(res.classes),
            "found": res.found, "found_classes": res.found_classes, "runs_inside": res.evals,
            "skipped_outside": res.outside, "budget_s": budget_s, "seed": seed,
            "wall_s": time.perf_counter() - t0, "summary": A.summary(res),
            "repro": res.repro if res.found else None,
            "region": bound(pol).to_dict()}


# -- worst-case inputs, one parameter each ------------------------------------------------

def _row(scores, values, *, mask=None, seqlen_kv=None):
    """One query row (D = 1, q = 1, c = 1: q.k are log2 units) over keys with ``scores``."""
    n = len(scores)
    q = torch.ones(1, 1, 1, 1)
    k = torch.tensor(scores, dtype=torch.float64).float().reshape(1, n, 1, 1)
    v = torch.tensor(values, dtype=torch.float64).float().reshape(1, n, 1, 1)
    return q, k, v, mask, seqlen_kv


def _run_online(pol, q, k, v, mask, seqlen_kv, causal=False):
    from fa_lab.kernels.online.model import LOG2_UNITS, forward

    rec: list = []
    out, lse = forward(q, k, v, policy=pol, causal=causal, mask=mask, seqlen_kv=seqlen_kv,
                       softmax_scale=LOG2_UNITS, record=rec)
    return out, lse, rec


def _reference(q, k, v, mask, seqlen_kv, causal=False):
    from fa_lab.kernels.online.model import LOG2_UNITS
    from fa_lab import reference

    n = k.shape[1] if seqlen_kv is None else seqlen_kv
    bias = None
    if mask is not None:
        mk = mask[..., :n].reshape(q.shape[1], n)
        bias = torch.where(mk, 0.0, -math.inf).double() if mk.dtype == torch.bool else mk.double()
    return reference.attention(q, k[:, :n], v[:, :n], causal=causal, dtype=torch.float64,
                               softmax_scale=LOG2_UNITS, bias=bias)


def _fails(pol, case, tol, causal=False) -> dict:
    """The classes ``case`` shows under ``pol`` (the online family's model)."""
    q, k, v, mask, n = case
    out, lse, rec = _run_online(pol, q, k, v, mask, n, causal)
    ref, rl = _reference(q, k, v, mask, n, causal)
    o = out.double()
    defined = torch.isfinite(rl).permute(0, 2, 1)
    fin = torch.isfinite(o).all(-1)
    vv = v[:, :k.shape[1] if n is None else n].double().abs()
    vmax = float(vv[torch.isfinite(vv)].max()) if vv.numel() else 1.0
    err = torch.where(defined & fin, (o - ref).abs().amax(-1), torch.zeros_like(o[..., 0]))
    return {"nonfinite": bool((~fin & defined).any()),
            "empty": bool((~defined & (~fin | (o != 0).any(-1))).any()),
            "silent": bool((err > tol * max(vmax, 1e-300)).any()),
            "saturation": any(bool((r.saturated > 0).any()) for r in rec),
            "nan_factor": any(bool(torch.isnan(r.o_factor).any()) for r in rec)}


def _margin(region, name, case, pol, causal=False):
    q, k, v, mask, n = case
    from fa_lab.kernels.online.model import LOG2_UNITS

    m = measure(q, k, v, policy=pol, causal=causal, bias=mask, seqlen_kv=n,
                softmax_scale=LOG2_UNITS, dtype="fp32")
    h = next(h for h in region.hazards if h.name == name)
    return h.check(m)


def _cases(pol, name, region):
    """(parameter name, [(value, case, causal)]) stepping ``name``'s boundary for ``pol``."""
    sem = pol.semantics
    bn = sem.block_n or 64
    tau = float(pol.threshold) if pol.lazy else 0.0
    H = float(pol.p_headroom)
    order_first = 0 if sem.kv_order == "ascending" else 1
    drags = _drags(pol)
    if name == "P saturation" and not drags:
        # two tiles: the first visited holds one key at 0, the other one key delta higher
        vals = [i / 64 for i in range(0, int(64 * (tau + 1)) + 1)]
        out = []
        for d in vals:
            scores = [0.0] * (bn + 1)
            hi = bn if order_first == 0 else 0
            scores[hi] = d
            mask = torch.zeros(1, bn + 1, dtype=torch.bool)
            mask[0, 0] = mask[0, bn] = True
            values = [0.0] * (bn + 1)
            values[hi] = 1.0
            out.append((d, _row(scores, values, mask=mask), False))
        return "jump delta (log2)", out
    if name == "accumulator overflow":
        # n keys: the first visited tile at 0, every other at the stale excess; V = 2^v
        from .bound import FORMATS, _fmt

        n = 16 * bn
        ex = min(tau, 4.0) if pol.lazy else 0.0
        fmax = FORMATS[_fmt(pol, "fp32", "online")][0]
        top = 128.0 - min(H + ex, math.log2(fmax)) - math.log2(n)
        out = []
        for i in range(-48, 17):
            vlog = top + i / 16
            scores = [ex - 1e-3 if ex else 0.0] * n
            first = range(0, bn) if order_first == 0 else range(n - bn, n)
            for j in first:
                scores[j] = 0.0
            out.append((vlog, _row(scores, [2.0 ** vlog] * n), False))
        return "log2 max|V|", out
    if name == "silent mass loss (rounding and flushed tails)":
        # the first visited key at 0 (v = 0: its P is the base's 2^H, exact) and n tail keys
        # just below the flush point (v = 1): the output loses the tails' whole weight.
        # Only e4m3: e5m2's onset needs 2^23 keys.
        from .bound import FORMATS

        if sem.p_cast != "e4m3":
            return None, []
        _, flush, unit = FORMATS[sem.p_cast]
        centre = math.log2(0.25 - unit) + H - flush
        out = []
        for i in range(-32, 25):
            n = int(round(2 ** (centre + i / 16)))
            scores, values = [flush - H - 0.01] * (n + 1), [1.0] * (n + 1)
            top = 0 if order_first == 0 else n
            scores[top], values[top] = 0.0, 0.0
            out.append((math.log2(n), _row(scores, values), False))
        return "log2 n (tail keys)", out
    if name == "finite sentinel":
        # sentinel above the row (m_init): one key at sigma - d (v = 0) and 63 keys whose P
        # lands just below the flush point (v = 1); with masked columns: one visible key at
        # sigma + d (v = 1) beside 63 masked ones (v = -1)
        from .bound import FORMATS, _fmt

        _, flush, unit = FORMATS[_fmt(pol, "fp32", "online")]
        sig = sem.m_init if math.isfinite(sem.m_init) else sem.mask_value
        out = []
        n = bn
        if math.isfinite(sem.m_init):
            centre = min(128.0 + H, math.log2(0.25 - unit) - math.log2(n - 1) - flush + H)
            for i in range(-32, 25):
                d = centre + i / 16
                scores = [sig - d] + [sig + flush - H - 0.01] * (n - 1)
                out.append((d, _row(scores, [0.0] + [1.0] * (n - 1)), False))
            return "sigma_init - s_max (log2)", out
        for i in range(-32, 25):
            d = 1 + math.log2((n - 1) / 0.25) + i / 16
            mask = torch.zeros(1, n, dtype=torch.bool)
            mask[0, 0] = True
            out.append((d, _row([sig + d] + [0.0] * (n - 1), [1.0] + [-1.0] * (n - 1),
                                mask=mask), False))
        return "s_max - sigma_mask (log2)", out
    if name == "NaN from a first tile with nothing visible":
        n = 3 * bn
        out = []
        for L in range(0, n, max(1, bn // 16)):
            mask = torch.ones(1, n, dtype=torch.bool)
            if order_first == 0:
                mask[0, :L] = False
            else:
                mask[0, n - L:] = False
            out.append((float(L), _row([1.0] * n, [1.0] * n, mask=mask), False))
        return "masked keys before the first visible one", out
    if name == "a row that sees nothing gives 0":
        n = bn
        out = []
        for L in range(0, n + 1):
            mask = torch.ones(1, n, dtype=torch.bool)
            mask[0, :L] = False
            out.append((float(L), _row([1.0] * n, [1.0] * n, mask=mask), False))
        return "masked keys of the row", out
    if name == "V cache tail":
        out = []
        for n_used in range(1, 2 * bn + 1):
            cap = 2 * bn
            values = [1.0] * n_used + [math.nan] * (cap - n_used)
            out.append((float(n_used), _row([1.0] * cap, values, seqlen_kv=n_used), False))
        return "seqlen_kv (cache of 2 tiles)", out
    return None, []


def sweep(policy, name: str, *, tolerance: float = 0.25) -> dict | None:
    """Step ``policy``'s hazard ``name`` across its boundary on a worst-case input (a
    zoo preset's online-softmax model, one query row, D = 1, log2-unit scores) and compare
    what fails with the region. Returns None where the hazard is ``never`` or has no sweep
    here; else the steps' (value, margin, failed), the first failing step, and the two
    verdicts: ``sound`` (no step inside the region failed) and ``within`` (the onset's
    margin >= -1, or for a structural hazard the onset at the formula's tile boundary)."""
    from fa_lab import policies
    from fa_lab.studies import adversary as A

    pol = policies.as_policy(policy)
    if A.kernel_for(pol) == A.KERNEL:
        raise ValueError(f"sweep runs the online family's model; {pol.name!r} runs on "
                         f"{A.KERNEL} (see builtin_sweep)")
    region = bound(pol, dtype="fp32", tolerance=tolerance)
    hz = {h.name: h for h in region.hazards}
    if name not in hz or hz[name].never:
        return None
    param, cases = _cases(pol, name, region)
    if not cases:
        return None
    klass = {"P saturation": ("saturation",), "accumulator overflow": ("nonfinite",),
             "silent mass loss (rounding and flushed tails)": ("silent",),
             "finite sentinel": ("silent", "empty", "nonfinite"), "V cache tail": ("nonfinite",),
             "NaN from a first tile with nothing visible": ("nonfinite", "nan_factor"),
             "a row that sees nothing gives 0": ("empty",),
             "NaN factor through the O vote": ("nan_factor",)}[name]
    steps = []
    for value, case, causal in cases:
        safe, margin = _margin(region, name, case, pol, causal)
        got = _fails(pol, case, tolerance, causal)
        steps.append({"value": value, "margin": margin, "inside": bool(safe),
                      "failed": any(got[c] for c in klass)})
    failing = [s for s in steps if s["failed"]]
    onset = failing[0] if failing else None
    sound = not any(s["failed"] and s["inside"] for s in steps)
    first_out = next((s for s in steps if not s["inside"]), None)
    if onset is None and first_out is None:
        within = None  # neither boundary lies in the swept range
    elif hz[name].kind in ("overflow", "saturation", "mass_loss"):
        within = onset is not None and onset["margin"] is not None and onset["margin"] >= -1.0
    else:
        within = (onset is not None and first_out is not None
                  and onset["value"] == first_out["value"])
    return {"policy": pol.name, "hazard": name, "formula": hz[name].formula,
            "exact": hz[name].exact, "parameter": param, "tolerance": tolerance,
            "formula_boundary": None if first_out is None else first_out["value"],
            "measured_onset": None if onset is None else onset["value"],
            "onset_margin": None if onset is None else onset["margin"],
            "sound": sound, "within_one_binade_or_tile": within, "steps": len(steps)}


# -- the FlyDSL policies on their own kernels ----------------------------------------------

def _swp_case(scores_by_tile, *, n_rows=32, vlog=0.0, bias=None):
    """bf16 q, k, v [1, n_rows, 1, 64] / [1, 64 T, 1, 64]: every row's log2-unit score of the
    keys of tile t is ``scores_by_tile[t]`` (Q = 8 on dimension 0), V = 2^vlog."""
    from fa_lab.kernels.swp_bf16.model import softmax_scale_log2

    T = len(scores_by_tile)
    qs = float(torch.tensor(8.0 * softmax_scale_log2(64)).to(torch.bfloat16))
    q = torch.zeros(1, n_rows, 1, 64)
    q[0, :, 0, 0] = 8.0
    k = torch.zeros(1, 64 * T, 1, 64)
    for t, s in enumerate(scores_by_tile):
        k[0, 64 * t:64 * (t + 1), 0, 0] = s / qs
    v = torch.full((1, 64 * T, 1, 64), 2.0 ** vlog)
    return q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16), bias


def _swp_fails(pol, case, causal=False) -> bool:
    from fa_lab import api, reference

    q, k, v, bias = case
    mods = {} if bias is None else {"bias": bias}
    out = api.flash_attn_func(q, k, v, causal=causal, rescale=pol, backend="emulator",
                              kernel="swp_bf16", **mods)
    ref, lse = reference.attention(q, k, v, causal=causal, dtype=torch.float64, **mods)
    judged = torch.isfinite(ref).all(-1) & torch.isfinite(lse).permute(0, 2, 1)
    return bool((~torch.isfinite(out.float()).all(-1) & judged).any())


def builtin_sweep(policy, name: str) -> dict | None:
    """``sweep`` for a FlyDSL policy on the DUALWAVE_SWP model (bf16, D = 64, one wave):
    ``"accumulator overflow"`` steps log2 max|V| over n = 1024 keys at the stale excess
    (the first tile at 0, the rest at min(THR, 4) - 0.01; a dragging policy: the drag
    staircase of ``experiments.drag_case``, stepping its fall), ``"NaN from a first tile
    with nothing visible"`` the -inf bias's length over the first keys (non-causal)."""
    import warnings

    from fa_lab import policies

    pol = policies.as_policy(policy)
    region = bound(pol, dtype="bf16")
    hz = {h.name: h for h in region.hazards}
    if name not in hz or hz[name].never:
        return None
    tau = float(pol.threshold) if pol.lazy else 0.0
    drags = _drags(pol)
    steps, param = [], ""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if name == "accumulator overflow" and drags:
            from fa_lab.studies.experiments import drag_case

            param = "the victim's fall per tile (log2)"
            for f in range(4, 41):
                q, k, v = drag_case(n_tiles=8, rise=10.0, fall=float(f), D=64)
                steps.append((float(f), (q, k, v, None)))
        elif name == "accumulator overflow":
            ex = min(tau, 4.0) - 0.01 if pol.lazy else 0.0
            top = 128.0 - max(ex, 0.0) - 10.0
            param = "log2 max|V|"
            for i in range(-24, 17):
                vlog = top + i / 8
                steps.append((vlog, _swp_case([0.0] + [max(ex, 0.0)] * 15, vlog=vlog)))
        elif name == "NaN from a first tile with nothing visible":
            param = "masked keys before the first visible one"
            for L in range(0, 192, 4):
                bias = torch.zeros(32, 256)
                bias[:, :L] = -math.inf
                steps.append((float(L), _swp_case([1.0] * 4, bias=bias.to(torch.bfloat16))))
        else:
            return None
        rows = []
        for value, case in steps:
            q, k, v, bias = case
            m = measure(q, k, v, policy=pol, bias=bias)
            safe, margin = hz[name].check(m)
            rows.append({"value": value, "margin": margin, "inside": bool(safe),
                         "failed": _swp_fails(pol, case)})
    onset = next((s for s in rows if s["failed"]), None)
    first_out = next((s for s in rows if not s["inside"]), None)
    sound = not any(s["failed"] and s["inside"] for s in rows)
    if onset is None and first_out is None:
        within = None  # neither boundary lies in the swept range
    elif hz[name].kind == "overflow":
        within = onset is not None and onset["margin"] >= -1.0
        if drags and onset is not None and first_out is not None:
            # the staircase's deficit grows with its fall: one binade of the fall itself
            within = onset["value"] <= 2 * first_out["value"]
    else:
        within = onset is not None and first_out is not None and onset["value"] == first_out["value"]
    return {"policy": pol.name, "hazard": name, "formula": hz[name].formula,
            "exact": hz[name].exact, "parameter": param, "kernel": region.kernel,
            "formula_boundary": None if first_out is None else first_out["value"],
            "measured_onset": None if onset is None else onset["value"],
            "onset_margin": None if onset is None else onset["margin"],
            "sound": sound, "within_one_binade_or_tile": None if within is None else bool(within),
            "steps": len(rows)}


def atlas_onset(policy, *, atlas: str = "bf16_seed_h200", threshold: float = 8.0) -> dict:
    """The region's overflow boundary against a measured atlas (``data/atlas/<atlas>``: a
    sweep of the seed's inputs over K scale): per K scale, the atlas's non-finite rows and
    the region's margin on that K's inputs. The inputs are rebuilt here
    (``experiments.bf16_inputs``, seed 0); their scores scale with K (K multiplies k
    before its bf16 rounding), so each row's R and Jup are taken once, at K = 1, and
    scaled. Sound: no K inside the region has a non-finite row; within one binade: the
    atlas's first failing K is at most twice the K where the region's margin reaches 0
    (``k_formula``, linear between the grid's K scales)."""
    import pandas as pd
    from fa_lab import policies
    from fa_lab.studies import experiments as ex
    from fa_lab.studies.sweep.grid import REFERENCE_ATLAS_DIR as ATLAS_DIR
    from .measure import Measure

    pol = policies.as_policy(policy)
    table = pd.read_parquet(ATLAS_DIR / atlas / "part-all.parquet")
    rows = table[(table.policy == pol.name) & ((table.threshold == threshold)
                                              | table.threshold.isna())]
    if rows.empty:
        raise ValueError(f"atlas {atlas!r} has no rows for policy {pol.name!r}")
    first = rows.iloc[0]
    B, S, H, D = (int(first[a]) for a in ("B", "S", "H", "D"))
    pol_t = policies.resolve(fp8=False, seqlen_kv=S, rescale=pol,
                             rescale_threshold=threshold if pol.lazy else None)
    region = bound(pol_t, dtype="bf16")
    hazard = next(h for h in region.hazards if h.name == "accumulator overflow")
    q, k, v = ex.bf16_inputs(B, S, H, D, 1.0, seed=int(first["seed"]))
    from fa_lab.kernels.swp_bf16.model import softmax_scale_log2

    c = softmax_scale_log2(D)
    R, J = [], []
    for b in range(B):
        for h in range(H):
            s = (q[b, :, h].float() @ k[b, :, h].float().T) * c               # [S, S]
            tiles = s.reshape(S, S // 64, 64).amax(-1)
            M = tiles.amax(-1)
            R.append(M - tiles.amin(-1))
            J.append(M - tiles[:, 0])
    R1, J1 = torch.cat(R).double().numpy(), torch.cat(J).double().numpy()
    v_max = float(v.float().abs().max())
    out = []
    for K, g in rows.groupby("k_scale"):
        m = Measure(defined=R1 == R1, hollow_first=R1 != R1, hollow_after=R1 != R1, R=R1 * K,
                    Jup=J1 * K, steps=R1 * 0 + S // 64 - 1, n=R1 * 0 + S, n_masked=R1 * 0,
                    s_max=R1 * 0, v_max=v_max, tail_nonfinite=False)
        safe, margin = hazard.check(m)
        out.append({"k_scale": float(K), "bad_rows": int(g.bad_rows.iloc[0]), "inside": bool(safe),
                    "margin": margin})
    inside_k = [r["k_scale"] for r in out if r["inside"]]
    failing_k = [r["k_scale"] for r in out if r["bad_rows"] > 0]
    last_in = max(inside_k) if inside_k else None
    onset = min(failing_k) if failing_k else None
    sound = not any(r["inside"] and r["bad_rows"] > 0 for r in out)
    # the margin falls linearly in K once a drag's R (or Jup) sets it: where it crosses 0
    k_formula = None
    for a, b in zip(out, out[1:]):
        if a["margin"] > 0 >= b["margin"]:
            k_formula = a["k_scale"] + (b["k_scale"] - a["k_scale"]) * a["margin"] / (
                a["margin"] - b["margin"])
    within = None if onset is None or last_in is None else onset <= 2 * (k_formula or last_in)
    return {"policy": pol.name, "atlas": atlas, "threshold": threshold, "formula": hazard.formula,
            "exact": hazard.exact, "sizes": {"B": B, "S": S, "H": H, "D": D},
            "largest_k_inside": last_in, "k_formula": k_formula, "first_failing_k": onset,
            "sound": sound,
            "within_one_binade": within, "per_k": out}


def fp8_floor_sweep(policy, *, steps: int = 41) -> dict:
    """The fp8 kernel's causal floor (``bound``'s "fp8 causal floor overflows"): a causal
    call with 256 queries over 128 keys (its first 128 rows see no key), fp8 inputs, and
    q_descale stepped so that ls crosses the formula's boundary; a step fails where any
    output is NaN."""
    import warnings

    from fa_lab import api, policies
    from fa_lab.kernels.swp_fp8.model import log2_scale

    pol = policies.as_policy(policy)
    region = bound(pol, dtype="fp8")
    hz = next(h for h in region.hazards if h.name == "fp8 causal floor overflows")
    base = log2_scale(1.0, 1.0, 128)
    g = torch.Generator().manual_seed(0)
    q8, k8, v8 = (torch.randn(1, n, 1, 128, generator=g).to(torch.float8_e4m3fn)
                  for n in (256, 128, 128))
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(steps):
            ls_target = 1.12 + 0.03 * i / (steps - 1)
            qd = ls_target / base
            m = measure(q8, k8, v8, policy=pol, causal=True, q_descale=qd, k_descale=1.0)
            safe, margin = hz.check(m)
            out = api.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=1.0, v_descale=1.0,
                                      causal=True, rescale=pol, backend="emulator")
            rows.append({"ls": m.ls, "inside": bool(safe), "margin": margin,
                         "failed": bool(torch.isnan(out.float()).any())})
    onset = next((r for r in rows if r["failed"]), None)
    first_out = next((r for r in rows if not r["inside"]), None)
    return {"policy": pol.name, "hazard": hz.name, "formula": hz.formula, "exact": hz.exact,
            "parameter": "ls", "formula_boundary": None if first_out is None else first_out["ls"],
            "measured_onset": None if onset is None else onset["ls"],
            "sound": not any(r["failed"] and r["inside"] for r in rows),
            "within_one_binade_or_tile": (onset is not None and first_out is not None
                                          and onset["ls"] == first_out["ls"]),
            "steps": len(rows)}


def fixed_max_atlas_onset(policy="primus-a6a16cdc", *, atlas: str = "fixed_max_cpu",
                          k_scales=None) -> dict:
    """A fixed max's region (``bound``'s "overflow at the fixed max" and "underflow at the
    fixed max") against a measured atlas of the seed's inputs over K scale
    (``data/atlas/<atlas>``, e.g. ``fixed_max_cpu``), row by row.

    Per K scale (``k_scales``: a subset of the atlas's, default all) the inputs are rebuilt
    (``experiments.bf16_inputs`` at the atlas's sizes and seed), the model is run once more
    (its non-finite rows must be the atlas's count: the atlas is reproduced) and each row
    is measured: a row lies outside the region when a hazard of the region fails on that
    row alone. Sound: every non-finite (or silently zero) row lies outside, and no K whose
    rows all lie inside has one. ``k_formula``: the K at which the region's margin reaches
    0 (linear between the grid's K scales); ``first_failing_k``: the atlas's first K with a
    non-finite row. ``outside_rows`` over ``bad_rows`` says how far the sufficient formula
    (log2 n + log2 max|V| on top of the row's best score) overcounts."""
    import dataclasses
    import warnings

    import numpy as np
    from fa_lab import api, policies
    from fa_lab.studies import experiments as ex
    from fa_lab.studies.sweep.store import reference

    pol = policies.as_policy(policy)
    if pol.semantics.fixed_max is None:
        raise ValueError(f"policy {pol.name!r} has no fixed max (Semantics.fixed_max)")
    table = reference(atlas)
    table = table[table.policy == pol.name].sort_values("k_scale")
    if table.empty:
        raise ValueError(f"atlas {atlas!r} has no rows for policy {pol.name!r}")
    if k_scales is not None:
        missing = sorted(set(map(float, k_scales)) - set(table.k_scale.astype(float)))
        if missing:
            raise ValueError(f"k_scales {missing} are not in atlas {atlas!r}")
        table = table[table.k_scale.isin([float(k) for k in k_scales])]
    first = table.iloc[0]
    B, S, H, D = (int(first[a]) for a in ("B", "S", "H", "D"))
    causal, seed = bool(first["causal"]), int(first["seed"])
    region = bound(pol, dtype="bf16")
    hazards = [h for h in region.hazards if not h.never]
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _, row in table.iterrows():
            K = float(row["k_scale"])
            q, k, v = ex.bf16_inputs(B, S, H, D, K, seed=seed)
            o, lse = api.flash_attn_func(q, k, v, causal=causal, rescale=pol,
                                         backend="emulator", return_lse=True)
            nonfinite = (~torch.isfinite(o.float()).all(-1)).permute(0, 2, 1).flatten().numpy()
            zero = ((o.float() == 0).all(-1).permute(0, 2, 1).flatten()
                    & (lse.flatten() == -math.inf)).numpy()
            m = measure(q, k, v, policy=pol, causal=causal)
            safe, margin = zip(*(h.check(m) for h in hazards))
            outside = np.zeros(m.defined.shape, dtype=bool)

            def split(idx):  # a group whose rows all pass is inside; else halve it
                sub = np.zeros_like(m.defined)
                sub[idx] = True
                if all(h.check(dataclasses.replace(m, defined=sub))[0] for h in hazards):
                    return
                if len(idx) == 1:
                    outside[idx[0]] = True
                    return
                split(idx[:len(idx) // 2])
                split(idx[len(idx) // 2:])

            split(np.flatnonzero(m.defined))
            bad = nonfinite | zero
            out.append({"k_scale": K, "atlas_bad_rows": int(row["bad_rows"]),
                        "bad_rows": int(nonfinite.sum()), "zero_rows": int(zero.sum()),
                        "outside_rows": int(outside.sum()),
                        "bad_rows_inside": int((bad & ~outside).sum()),
                        "inside": bool(all(safe)),
                        "margin": float(min(x for x in margin if x is not None)),
                        "s_max": float(m.s_max[m.defined].max())})
    first_failing = next((r["k_scale"] for r in out if r["atlas_bad_rows"] > 0), None)
    k_formula = None
    for a, b in zip(out, out[1:]):
        if a["margin"] > 0 >= b["margin"]:
            k_formula = a["k_scale"] + (b["k_scale"] - a["k_scale"]) * a["margin"] / (
                a["margin"] - b["margin"])
    return {"policy": pol.name, "atlas": atlas, "sizes": {"B": B, "S": S, "H": H, "D": D},
            "causal": causal, "seed": seed, "formulas": [h.formula for h in hazards],
            "reproduced": all(r["atlas_bad_rows"] == r["bad_rows"] for r in out),
            "sound": all(r["bad_rows_inside"] == 0 and not (r["inside"] and r["bad_rows"])
                         for r in out),
            "k_formula": k_formula, "first_failing_k": first_failing,
            "largest_k_inside": max((r["k_scale"] for r in out if r["inside"]), default=None),
            "per_k": out}
