"""The MLA decode's safe region in closed form (``fa_lab.studies.onset.bound("mla_decode")``;
docs/semantics.md §14.4): where its unscaled e4m3 P cast loses precision or mass.

The kernel computes P = 2^(H - d) for a key d log2 units below the running max of its own
64-key tile (``model.work_item``: the max is updated per tile before P is taken), H the
headroom lift (0 upstream), sums the fp32 P into ``l`` and casts P to e4m3 for the PV
product. e4m3 is normal down to 2^-6 and subnormal on a 2^-9 grid below it, so a key keeps
4 significant bits while d < 6 + H and rounds to 0 (its mass leaves O but stays in l)
once d >= 10 + H (P <= 2^-10, the tie, goes to the even 0). Both boundaries are exact for
"some key's P is subnormal" and "some key's P flushes"; how much mass that costs is
``fa_lab.studies.mla_mass_loss``'s measurement.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._common.hazard import Hazard, HazardChecks
from .model import BLOCK_N, LOG2E, exact_dot

#: The spreads (log2 units below the tile's running max) where P goes subnormal and where it
#: flushes to 0, for no headroom.
SUBNORMAL_AT = 6.0
FLUSH_AT = 10.0


@dataclass
class MLAMeasure:
    """Per row (head) of one work item: ``spread``, the largest d of a valid key (log2
    units below the running max of its tile; -inf for an empty item)."""

    spread: torch.Tensor


@dataclass(frozen=True)
class MLARegion(HazardChecks):
    """The MLA decode's region for a headroom lift ``headroom`` (log2 units)."""

    headroom: float
    hazards: tuple
    kernel: str = "mla_decode"


    def describe(self) -> str:
        return self._described(f"{self.kernel} (P lifted by 2^{self.headroom:g}): safe where")

    def to_dict(self) -> dict:
        return {"policy": "mla_decode", "kernel": self.kernel, "headroom": self.headroom,
                "hazards": [h.to_dict() for h in self.hazards]}


def measure(q: torch.Tensor, kv: torch.Tensor, softmax_scale: float) -> MLAMeasure:
    """``MLAMeasure`` of one work item: ``q`` [H, 576] and ``kv`` [n, 576] fp32 holding e4m3
    values (``model.work_item``'s arguments), scores taken as the model takes them."""
    x = (exact_dot(q, kv) * float(softmax_scale)).double() * float(LOG2E)  # log2 units
    spread = torch.full((q.shape[0],), float("-inf"), dtype=torch.float64)
    run = torch.full_like(spread, float("-inf"))
    for t0 in range(0, x.shape[1], BLOCK_N):
        tile = x[:, t0:t0 + BLOCK_N]
        run = torch.maximum(run, tile.amax(dim=1))
        spread = torch.maximum(spread, (run[:, None] - tile).amax(dim=1))
    return MLAMeasure(spread)


def _below(at: float):
    def check(m: MLAMeasure):
        s = m.spread[m.spread > float("-inf")]
        margin = at - float(s.max()) if s.numel() else float("inf")
        return margin > 0, margin
    return check


def region(upstream: str | None = None, *, headroom: float = 0.0) -> MLARegion:
    """The safe region of ``mla_fwd_decode_m16x8_fp8_fp8`` (``upstream``: None, the one
    version modelled) with P lifted by 2^``headroom`` before the cast (0 upstream)."""
    if upstream not in (None, ""):
        raise ValueError(f"upstream={upstream!r}: the MLA decode has one version modelled; "
                         "name it 'mla_decode' alone")
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or headroom < 0:
        raise ValueError(f"headroom must be a number >= 0, got {headroom!r}")
    h = float(headroom)
    return MLARegion(h, (
        Hazard("p_subnormal", "precision", f"every valid key's spread d < {SUBNORMAL_AT + h:g}",
                  _below(SUBNORMAL_AT + h), note="below, P keeps fewer than 4 bits"),
        Hazard("p_flush", "mass", f"every valid key's spread d < {FLUSH_AT + h:g}",
                  _below(FLUSH_AT + h),
                  note="from there P rounds to 0: its mass stays in l, leaves O"),
    ))
