"""What ``onset.bound``'s formulas read off one input: ``Measure`` and ``measure``.

Every quantity is taken per row, in log2 units, on the tiles the policy's kernel visits,
from the scores **as that kernel computes them** (every cast on the path):

* DUALWAVE_SWP bf16/f16 (``swp_bf16``): Q pre-scaled into log2 units and rounded to its
  own type once, ``round(q c) . k`` (``kernels/swp_bf16/model.py``);
* the fp8 kernel (``swp_fp8``): the raw fp8 product times ``ls``, the fp32 product of the
  scale, log2 e and the two descales in that order (``kernels/swp_fp8/model.py``);
* the online-softmax family: ``f32(q . k) * c`` with ``c = f32(f32(scale qd kd) log2 e)``,
  or ``round(q c) . k`` under ``q_prescale``; a ``softcap`` caps ``f32(S * f32(scale qd
  kd))`` by its form of tanh first (``kernels/online/model.py``).

``mask_stage="p"`` takes the tile maxima over every loaded score (masked ones and a cache
tail's too), as that kernel's max does; ``kv_split`` restarts the walk every that many
visited tiles, so the walk's quantities (R, Jup, the hollow tiles) are taken per partial
and the worst partial kept.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch

from fa_lab.checks import check_int
from fa_lab.numerics import LOG2E, f32

_INPUT_FORMAT = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "none",
                 torch.float8_e4m3fn: "e4m3"}


@dataclass
class Measure:
    """What the formulas read off one input (``fa_lab.studies.onset.bound``'s docstring).
    Per-row arrays cover every (batch, head, query row); ``defined`` marks the rows that
    see a key. ``lift``: how far the largest loaded score of a visited tile (masked ones
    included) lies above the row's best visible score (0 unless ``mask_stage="p"``);
    ``partial_empty``: a defined row with a split-KV partial that sees nothing;
    ``spread``: the largest gap between two non-empty partials' log2 masses; ``u_max``:
    the largest |t / softcap| a visible (``mask_stage="p"``: loaded) score reaches;
    ``masked_nonfinite``: a loaded score of a visited tile is not finite; ``v_descale`` and
    ``out_fmt``: the output's scale and format."""

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
    lift: np.ndarray | None = None
    partial_empty: np.ndarray | None = None
    spread: np.ndarray | None = None
    u_max: float = 0.0
    masked_nonfinite: bool = False
    v_descale: float = 1.0
    out_fmt: str = "bf16"

    @property
    def empty_rows(self) -> bool:
        return bool((~self.defined).any())


def resolve(policy, dtype: str, seqlen_kv):
    """(the policy resolved for its kernel, the kernel family): the online family for a
    policy with semantics of its own, else DUALWAVE_SWP or, for ``dtype="fp8"``, the fp8
    kernel. A Python rule (``Policy.from_rule``) is refused: a region is derived from what
    a policy's values declare. ``seqlen_kv`` (an int or a list of ints) resolves a
    threshold rule ("by_kv_len"); over a list, the largest threshold it resolves to (every
    hazard's formula grows with the threshold)."""
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
    lens = list(seqlen_kv) if isinstance(seqlen_kv, (list, tuple)) else [seqlen_kv]
    if not lens:
        raise ValueError("seqlen_kv is an empty list; give one length per sequence")
    got = [policies.resolve(fp8=dtype == "fp8", seqlen_kv=check_int("seqlen_kv", n, lo=0),
                            rescale=pol, headroom_any_dtype=any_dtype) for n in lens]
    return max(got, key=lambda p: float(p.threshold) if p.lazy else -math.inf), family


def block_n(pol, family: str) -> int:
    return 128 if family == "swp_fp8" else (pol.semantics.block_n or 64)


def _seqlens(seqlen_kv, B: int, Skv: int) -> list[int] | None:
    """Per-sequence key counts as a list of B ints in 0 .. Skv, or None for one count
    (None or an int, which ``measure`` takes as it is); ValueError/TypeError naming
    ``seqlen_kv``."""
    if seqlen_kv is None:
        return None
    if isinstance(seqlen_kv, torch.Tensor):
        seqlen_kv = seqlen_kv.item() if seqlen_kv.dim() == 0 else seqlen_kv.tolist()
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


def _scores(q, kf, pol, family, scale, qd, kd, D):
    """(x [B, H, Sq, cols] fp32 log2-unit scores as the kernel computes them, u [same]: the
    softcap's argument t / cap (zeros without a softcap), c: log2 units of one raw unit)."""
    sem = pol.semantics
    if family == "swp_fp8":
        from fa_lab.kernels.swp_fp8.model import log2_scale

        c = log2_scale(qd, kd, D)
        s = torch.einsum("bqhd,bkhd->bhqk", q.double(), kf.double()).float()
        return s * c, torch.zeros_like(s), c
    c = f32(f32(scale * qd * kd) * f32(LOG2E))
    half = q.dtype in (torch.bfloat16, torch.float16)
    if family == "swp_bf16" and half:  # the kernel pre-scales Q by its own c, rounded once
        from fa_lab.kernels.swp_bf16.model import softmax_scale_log2

        c = softmax_scale_log2(D)
    if (family == "swp_bf16" or sem.q_prescale) and half:  # round(q c) . k
        qs = (q.float() * c).to(q.dtype).double()
        s = torch.einsum("bqhd,bkhd->bhqk", qs, kf.double()).float()
        return s, torch.zeros_like(s), c
    S = torch.einsum("bqhd,bkhd->bhqk", q.double(), kf.double()).float()
    if not sem.softcap:
        return S * c, torch.zeros_like(S), c
    from fa_lab.kernels.online.model import softcap

    t = S * f32(scale * qd * kd)
    x = softcap(t, sem.softcap, sem.softcap_form) * f32(LOG2E)
    exact = softcap(t, sem.softcap, "tanh") * f32(LOG2E)   # where the form itself is NaN
    return torch.where(torch.isnan(x), exact, x), (t / f32(sem.softcap)).abs(), c


def measure(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, policy, causal: bool = False,
            bias: torch.Tensor | None = None, seqlen_kv=None,
            softmax_scale: float | None = None, q_descale: float | None = None,
            k_descale: float | None = None, v_descale: float | None = None,
            dtype: str | None = None) -> Measure:
    """The ``Measure`` of one input (q [B, Sq, H, D], k and v [B, Skv, Hkv, D]; ``bias``
    [Sq, Skv] in natural-log units, -inf = masked, or bool, True = visible; ``seqlen_kv``
    the valid keys: an int for every sequence, B ints (a list, tuple or 1-D tensor: one per
    sequence) or None, Skv; the fp8 descales as the call takes them) on the tiles
    ``policy``'s kernel visits, from the scores as that kernel computes them (module
    docstring)."""
    lens = _seqlens(seqlen_kv, q.shape[0], k.shape[1])
    if lens is not None:  # one sequence at a time, the rows joined in [B, H, Sq] order
        parts = [measure(q[b:b + 1], k[b:b + 1], v[b:b + 1], policy=policy, causal=causal,
                         bias=bias, seqlen_kv=n, softmax_scale=softmax_scale,
                         q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                         dtype=dtype) for b, n in enumerate(lens)]
        joined = {f.name: np.concatenate([getattr(m, f.name) for m in parts])
                  for f in dataclasses.fields(Measure)
                  if isinstance(getattr(parts[0], f.name), np.ndarray)}
        return dataclasses.replace(
            parts[0], **joined, v_max=max(m.v_max for m in parts),
            tail_nonfinite=any(m.tail_nonfinite for m in parts),
            causal_short=any(m.causal_short for m in parts), u_max=max(m.u_max for m in parts),
            masked_nonfinite=any(m.masked_nonfinite for m in parts))
    if dtype is None:
        dtype = "fp8" if q.dtype == torch.float8_e4m3fn else _INPUT_FORMAT.get(q.dtype, "bf16")
        dtype = "fp32" if dtype == "none" else dtype
    pol, family = resolve(policy, dtype, k.shape[1])
    sem = pol.semantics
    bn = block_n(pol, family)
    B, Sq, H, D = q.shape
    Skv = k.shape[1]
    n_kv = Skv if seqlen_kv is None else check_int("seqlen_kv", seqlen_kv, lo=0)
    qd = 1.0 if q_descale is None else float(q_descale)
    kd = 1.0 if k_descale is None else float(k_descale)
    vd = 1.0 if v_descale is None else float(v_descale)
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else float(softmax_scale)
    T = max(1, -(-n_kv // bn))
    width = T * bn
    G = H // k.shape[2]
    late = sem.mask_stage == "p"
    loaded = min(Skv, width) if late else n_kv        # a late mask's max sees the cache too
    kf = k.float().repeat_interleave(G, dim=2)[:, :loaded]
    kf = kf if late else kf.nan_to_num(0.0)
    s, u, c = _scores(q, kf, pol, family, scale, qd, kd, D)
    vis = torch.zeros(Sq, loaded, dtype=torch.bool)
    vis[:, :n_kv] = True
    if bias is not None:
        b = bias[:, :loaded]
        if b.dtype == torch.bool:
            vis = vis & b
        else:  # an entry whose log2-unit value overflows fp32 masks its key, as in a kernel
            add = torch.where(b != -math.inf, b.float(), 0.0) * f32(LOG2E)
            vis = vis & (b != -math.inf) & torch.isfinite(add)
            s = s + torch.where(torch.isfinite(add), add, 0.0)
    if causal:
        vis = vis & (torch.arange(loaded)[None, :] <= torch.arange(Sq)[:, None] + (n_kv - Sq))
    full = torch.full((B, H, Sq, width), -math.inf)
    full[..., :loaded] = torch.where(vis, s, torch.full_like(s, -math.inf))
    vis_t = torch.zeros(Sq, width, dtype=torch.bool)
    vis_t[:, :loaded] = vis
    order = list(range(T)) if sem.kv_order == "ascending" else list(range(T - 1, -1, -1))
    tiles = full.reshape(B, H, Sq, T, bn).amax(-1)[..., order]       # -inf: nothing visible
    seen = vis_t.reshape(Sq, T, bn).any(-1).expand(B, H, Sq, T)[..., order]
    if late:  # the walk's max: every loaded score, a padded column's 0 included
        every = torch.zeros(B, H, Sq, width)
        every[..., :loaded] = s
        walk = every.reshape(B, H, Sq, T, bn).amax(-1)[..., order]
        walk_seen = torch.ones_like(seen)
    else:
        walk, walk_seen = tiles, seen
    defined = seen.any(-1)
    split = sem.kv_split or T
    R = torch.zeros(B, H, Sq, dtype=torch.float64)
    J = torch.zeros_like(R)
    hollow_f = torch.zeros_like(defined)
    hollow_a = torch.zeros_like(defined)
    p_empty = torch.zeros_like(defined)
    masses = []
    s64 = full.double().reshape(B, H, Sq, T, bn)[..., order, :]
    for a in range(0, T, split):
        wt, ws, vs = walk[..., a:a + split], walk_seen[..., a:a + split], seen[..., a:a + split]
        has = ws.any(-1)
        first = torch.argmax(ws.to(torch.int8), dim=-1)
        after = torch.arange(wt.shape[-1])[None, None, None, :] > first[..., None]
        hollow_a |= has & (~ws & after).any(-1)
        hollow_f |= has & ~ws[..., 0]
        M = wt.amax(-1)
        low = torch.where(ws, wt, torch.full_like(wt, math.inf)).amin(-1)
        fm = wt.gather(-1, first[..., None])[..., 0]
        R = torch.maximum(R, torch.where(has, M - low, torch.zeros_like(M)).double())
        J = torch.maximum(J, torch.where(has, M - fm, torch.zeros_like(M)).double())
        p_empty |= ~vs.any(-1)
        part = s64[..., a:a + split, :].flatten(-2)
        masses.append(torch.logsumexp(part * math.log(2), -1) / math.log(2))
    mass = torch.stack(masses, -1)
    live = torch.isfinite(mass)
    spread = (torch.where(live, mass, -math.inf).amax(-1)
              - torch.where(live, mass, math.inf).amin(-1))
    spread = torch.where(live.sum(-1) > 1, spread, torch.zeros_like(spread))
    s_max = tiles.amax(-1)
    w_max = walk.amax(-1)
    lift = torch.where(defined, (w_max - s_max).clamp(min=0), torch.zeros_like(s_max))
    n_vis = vis[:, :n_kv].sum(-1).expand(B, H, Sq)
    vv = v[:, :n_kv].float().abs().nan_to_num(nan=math.inf, posinf=math.inf)   # no bound holds
    v_max = float(vv.max()) if vv.numel() else 0.0
    tail = v[:, n_kv:min(Skv, width)].float()
    ls = c if family == "swp_fp8" else None
    vis_u = vis.expand_as(u) if not late else torch.ones_like(u, dtype=torch.bool)
    u_max = float(u[vis_u].max()) if bool(vis_u.any()) and sem.softcap else 0.0
    out_fmt = "bf16" if dtype == "fp8" else {"fp32": "none"}.get(dtype, dtype)
    flat = {name: x.reshape(-1).numpy() for name, x in (
        ("defined", defined), ("hollow_first", defined & hollow_f),
        ("hollow_after", defined & hollow_a), ("R", R), ("Jup", J),
        ("n", n_vis), ("n_masked", width - n_vis), ("s_max", s_max.double()),
        ("steps", torch.full_like(n_vis, min(split, T) - 1)),
        ("lift", lift.double()), ("partial_empty", defined & p_empty),
        ("spread", spread.double()))}
    return Measure(**flat, v_max=v_max, tail_nonfinite=bool((~torch.isfinite(tail)).any()),
                   causal=causal, causal_short=causal and Sq > n_kv, c=c, ls=ls, block_n=bn,
                   u_max=u_max, masked_nonfinite=late and not bool(torch.isfinite(s).all()),
                   v_descale=vd, out_fmt=out_fmt)
