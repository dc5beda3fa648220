"""The safe region of FlyDSL #1097's fp8 split-K (``fa_lab.kernels.swp_fp8.split``;
docs/semantics.md §16): ``onset.bound("swp_fp8_split")``.

    region = onset.bound("swp_fp8_split:flydsl-20a76439")    # or a policy's name after ':'
    m = onset.fp8_split.measure(q8, k8, v8, q_descale=..., k_descale=..., v_descale=...,
                                causal=True, num_kv_splits=3)
    region.violated(m)

**The mechanism.** Each 256-row block's N tiles are cut by ``split_ranges`` (chunks of
ceil(N / splits) rounded up to even, at least 6 tiles; a remainder under 4 joins the
split before it). Each split walks its own tiles from its own -inf maximum exactly as the
dense kernel walks a row (the same P cast, headroom and decisions), so every hazard of
the dense fp8 region holds per split, read off that split's columns alone (the columns of
the other splits masked, the call's causal floor kept): a split's first tile is where its
own walk starts. The stored partial O is rounded to bf16 once more before the combine, so
the silent hazards get a tolerance smaller by that rounding (2^-8).

**The combine.** With the maxima in scaled units (#1097) the weights exp2(m_s - m_max) l_s
are the softmax's, whatever the splits hold; a split whose row sees nothing stores l = 0
and is skipped. With raw maxima (the bug aiter #4676's docstring records,
``"aiter-4676-raw-m"``) each weight is exp2 of a raw fp8-product gap instead of that gap
times ls: wrong for every row that sees keys in two splits whose maxima differ (exact; the
rows where the gaps are equal or only one split is live come out right). The LSE: #1097
takes the P headroom H off it; a version that does not leaves it H ln 2 too high
(``lse_headroom``, exact whenever H > 0).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from fa_lab.kernels._common.hazard import Hazard, HazardChecks

from .bound import Region, bound, register_family
from .measure import measure as dense_measure

FAMILY = "swp_fp8_split"
#: The partial O's extra bf16 rounding (relative), charged to the silent hazards.
PARTIAL_ROUNDING = 2.0 ** -8


@dataclass
class SplitMeasure:
    """``parts``: the dense ``Measure`` of each (row block, non-empty split), on that
    split's columns; ``unequal_live``: some row sees keys in two splits whose maxima
    differ; ``num_kv_splits``."""

    parts: list
    unequal_live: bool
    num_kv_splits: int


@dataclass(frozen=True)
class SplitRegion(HazardChecks):
    """The split-K region: the dense fp8 region per split (``dense``) and the combine's
    unit contracts at ``version``."""

    version: str
    dense: Region
    hazards: tuple
    kernel: str = FAMILY

    @property
    def policy(self):
        return self.dense.policy

    def describe(self) -> str:
        return self._described(f"{self.kernel} at {self.version} ({self.policy.name}): safe "
                              "where, per split")

    def to_dict(self) -> dict:
        return {"policy": self.policy.name, "kernel": self.kernel, "version": self.version,
                "tolerance": self.dense.tolerance, "hazards": [h.to_dict() for h in self.hazards]}


def _resolve(name):
    """(the split version, the policy a bare fp8 call runs under it, or the named one)."""
    from fa_lab import dispatch, policies, upstream

    if name in (None, "") or (isinstance(name, str) and name in upstream.FP8_SPLIT_VERSIONS):
        pol = upstream.VERSIONS[upstream.DEFAULT].default_policy(fp8=True, lazy_flag=True)
        return upstream.check_fp8_split(name or None), pol
    pol = policies.as_policy(name)
    if dispatch.semantic_family(pol) is not None:
        raise ValueError(f"policy {pol.name!r} has semantics of its own and runs on the "
                         "online-softmax family, not on the fp8 split-K kernel; bound it with "
                         "onset.bound(policy)")
    return upstream.check_fp8_split(None), pol


def region(policy=None, *, tolerance: float = 0.25, seqlen_kv=4096) -> SplitRegion:
    """The fp8 split-K region under ``policy`` (None or a split version's name: #1097's or
    aiter #4676's unit contracts with the bare fp8 policy; else a policy's name, at the
    default version). ValueError naming why for what the dense region refuses, and for a
    tolerance the partial's rounding leaves nothing of."""
    version, pol = _resolve(policy)
    if not PARTIAL_ROUNDING < tolerance < 1:
        raise ValueError(f"tolerance must be in ({PARTIAL_ROUNDING:g}, 1) for split-K (the "
                         f"partials' bf16 rounding takes {PARTIAL_ROUNDING:g}), got {tolerance!r}")
    dense = bound(pol, dtype="fp8", tolerance=tolerance - PARTIAL_ROUNDING, seqlen_kv=seqlen_kv,
                  kernel="swp_fp8")
    H = float(dense.policy.p_headroom)
    raw = version.m_units == "raw"
    hz = [h.over_parts() for h in dense.hazards]
    hz.append(Hazard(
        "raw split maxima", "mass_loss",
        "num_kv_splits = 1, or no row sees keys in two splits whose maxima differ",
        lambda sm: (sm.num_kv_splits == 1 or not sm.unequal_live, None), never=not raw,
        note=("the combine weighs split s by exp2(raw gap) instead of exp2(ls * raw gap): "
              "under fp8 descales every split but the largest weighs 0" if raw else
              "#1097 stores m * ls: the combine's gaps are log2 units")))
    hz.append(Hazard(
        "LSE keeps the P headroom", "lse", f"H = 0 (H = {H:g})",
        lambda sm: (H == 0, None), never=version.lse_headroom or H == 0,
        note=("#1097 takes H ln 2 off the LSE" if version.lse_headroom else
              "l carries 2^H: the LSE comes out H ln 2 too high")))
    return SplitRegion(version.name, dense, tuple(hz))


def measure(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, *, q_descale: float,
            k_descale: float, v_descale: float, causal: bool, num_kv_splits: int,
            policy=None) -> SplitMeasure:
    """The ``SplitMeasure`` of one dense fp8 split-K call (q8 [B, Sq, H, D], k8 and v8 [B, Skv,
    Hkv, D / Dv], float8_e4m3fn; the arguments of ``kernels/swp_fp8/split.forward``)."""
    from fa_lab.checks import check_int
    from fa_lab.kernels._common.geometry import BLOCK_N, block_groups
    from fa_lab.kernels.swp_bf16.model import split_ranges

    for name, t in (("q8", q8), ("k8", k8), ("v8", v8)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float8_e4m3fn or t.dim() != 4:
            raise TypeError(f"{name} must be a 4-D float8_e4m3fn torch.Tensor")
    check_int("num_kv_splits", num_kv_splits, lo=1)
    _, pol = _resolve(policy)
    Sq = q8.shape[1]
    Skv = k8.shape[1]
    parts, unequal = [], False
    for g in block_groups(Sq, Skv, causal, q8.device):
        rows = g.rows[g.rows < Sq]
        if rows.numel() == 0:
            continue
        qg = q8[:, rows]
        live_max = []
        for t0, t1 in split_ranges(g.n_tiles, num_kv_splits) if num_kv_splits > 1 else [(0, g.n_tiles)]:
            c0, c1 = t0 * BLOCK_N, min(t1 * BLOCK_N, Skv)
            if c1 <= c0:
                continue
            cols = torch.arange(c0, c1)
            vis = torch.ones(rows.numel(), c1 - c0, dtype=torch.bool)
            if causal:
                vis = cols[None, :] <= rows[:, None] + (Skv - Sq)
            m = dense_measure(qg, k8[:, c0:c1], v8[:, c0:c1], policy=pol, bias=vis,
                              q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                              dtype="fp8")
            # the kernel's causal floor and a causal call's short rows are the whole call's
            parts.append(dataclasses.replace(m, causal=causal,
                                             causal_short=causal and Sq > Skv))
            s = torch.where(torch.as_tensor(m.defined), torch.as_tensor(m.s_max), float("nan"))
            live_max.append(s)
        if len(live_max) > 1:
            stack = torch.stack(live_max)          # [splits, rows (b, h, r)]: NaN = not live
            live = ~stack.isnan()
            hi = torch.where(live, stack, -torch.inf).amax(0)
            lo = torch.where(live, stack, torch.inf).amin(0)
            unequal = unequal or bool(((live.sum(0) > 1) & (hi > lo)).any())
    return SplitMeasure(parts, unequal, int(num_kv_splits))


def _family(policy, *, dtype, tolerance, seqlen_kv):
    """``bound(..., kernel="swp_fp8_split")``: fp8 inputs only, so the dtype names nothing."""
    return region(policy or None, tolerance=tolerance, seqlen_kv=seqlen_kv)


register_family(FAMILY, _family)
