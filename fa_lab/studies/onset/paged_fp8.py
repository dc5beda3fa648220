"""The safe region of FlyDSL #1066's paged fp8 prefill (``fa_lab.kernels.swp_fp8.paged``;
docs/semantics.md §17): ``onset.bound("swp_fp8_paged")``.

    from fa_lab.studies import onset
    region = onset.bound("swp_fp8_paged")            # the builder's defaults: lazy, THR 8
    m = onset.paged_fp8.measure(q8, k, v, **call)    # flash_attn_func's paged fp8 arguments
    region.contains(m), region.violated(m), region.margins(m)

**The mechanism.** Per sequence the kernel runs the dense fp8 BN128 loop (one decision per
tile pair, P lifted by H = log2(448) - THR before its e4m3 cast, a causal row's tile max
floored) over the tiles its pages give (``kernels/swp_fp8/paged.py``'s ``gather``): a
sequence is a dense causal (bottom-right) call of its own rows against its own
``seqlen_k`` keys. So every hazard of the dense fp8 region (``onset.bound(policy,
dtype="fp8")``) holds per sequence, read off the keys that sequence's pages hold, and the
paged region is the dense one applied to each sequence (a margin: the smallest over the
sequences). The builder's lazy threshold 8 leaves P a headroom of log2(448) - 8 = 0.807:
P never saturates (H + THR = log2 448), and the silent mass-loss hazard's bound on the
flushed tails, n 2^(-10 - H), is 4 times that of the dense builder's threshold 6
(H = 2.807) for the same n.

**What paging adds.** The tile pairs a row group visits read whole pages: its last page's
tail past ``seqlen_k``, the partner page after an odd page count, and the padding pairs
(entries 0 and 1) up to the group's tile count. Those columns are masked in S (so K there
can hold anything), but their V rows enter P V with P = 0, and 0 * NaN (or 0 * inf) is
NaN: a non-finite V row among the pages a group reads past ``seqlen_k`` makes that group's
rows NaN (on the heads of that kv head). This is exact, and pages the kernel never reads
(entries past the pairs it visits, pages no table names) are safe whatever they hold.

``bound`` answers for the version (``fa_lab.upstream.FP8_PAGED_VERSIONS``; its default
policy) or for a policy named after the family (``"swp_fp8_paged:lazy"``): a policy that
runs on another family (semantics of its own) is refused, and so is whatever the dense
region refuses, with its reason.

**The per-tile kernel.** A call that ``fa_lab.paged.fp8_schedule`` sends to #1066's other
kernel ((D, Dv) other than (128, 128), or an odd page count) is measured as that kernel
runs it (``measure`` gives a ``paged_fp8_tile.TileMeasure``), and the region answers it
with the per-tile region (``paged_fp8_tile``: no P headroom, 64-column tiles, padding
tiles on ``block_table[0, 0]``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from fa_lab.kernels._common.hazard import Hazard, HazardChecks

from . import paged_fp8_tile
from .bound import Region, bound, register_family
from .measure import Measure, measure as dense_measure

FAMILY = "swp_fp8_paged"


@dataclass
class PagedMeasure:
    """What the paged region reads off one call: ``parts``, the dense ``Measure`` of each
    sequence with rows (on the keys its pages hold, ``seqlen_k`` of them, causal), and
    ``read_past``: (sequence, tile count) of each row group that reads a non-finite V row
    past its sequence's ``seqlen_k``; ``pages``: per sequence with rows, the page each KV
    tile it visits reads (its longest row group's tiles, in order)."""

    parts: list
    read_past: list
    pages: list = dataclasses.field(default_factory=list)


@dataclass(frozen=True)
class PagedRegion(HazardChecks):
    """The paged fp8 prefill's region: the dense fp8 region (``dense``) per sequence, and
    the pages read past ``seqlen_k``. A per-tile call's measure (``TileMeasure``) is
    answered by ``tile``, the per-tile kernel's region (``paged_fp8_tile``)."""

    version: str
    dense: Region
    hazards: tuple
    kernel: str = FAMILY
    tile: object = None   # the per-tile region, or why it is not derived for this policy

    @property
    def policy(self):
        return self.dense.policy

    def _tile(self, m):
        if not isinstance(m, paged_fp8_tile.TileMeasure):
            return None
        if isinstance(self.tile, str):
            raise ValueError(f"this call runs #1066's per-tile kernel: {self.tile}")
        return self.tile

    def violated(self, m) -> list[str]:
        t = self._tile(m)
        return t.violated(m) if t is not None else super().violated(m)

    def contains(self, m) -> bool:
        return not self.violated(m)

    def margins(self, m) -> dict:
        t = self._tile(m)
        return t.margins(m) if t is not None else super().margins(m)

    def describe(self) -> str:
        return self._described(f"{self.kernel} at {self.version} ({self.policy.name}, threshold "
                              f"{float(self.policy.threshold):g}): safe where, per sequence")

    def to_dict(self) -> dict:
        return {"policy": self.policy.name, "kernel": self.kernel, "version": self.version,
                "tolerance": self.dense.tolerance, "hazards": [h.to_dict() for h in self.hazards]}


READ_PAST = Hazard(
    "non-finite V in a page read past seqlen_k", "nan",
    "every V row the kernel reads past seqlen_k (the last page's tail, an odd page count's "
    "partner page, the padding pairs' entries 0 and 1) is finite",
    lambda pm: (not pm.read_past, None),
    note="masked in S, but P = 0 times NaN or inf in P V is NaN: every row of the group that "
         "reads it. Pages the kernel does not read never matter. Structural")


def _policy(name):
    """The policy a paged call runs: a paged version's default (None, '' or a version name),
    or a policy's name, resolved as a bare fp8 call resolves it."""
    from fa_lab import dispatch, policies, upstream

    if name in (None, "") or (isinstance(name, str) and name in upstream.FP8_PAGED_VERSIONS):
        version = name or upstream.FP8_PAGED_DEFAULT
        owner = next(v for v in upstream.VERSIONS.values() if v.fp8_paged == version)
        return version, owner.default_policy(fp8=True, lazy_flag=True, paged=True)
    pol = policies.as_policy(name)
    if dispatch.semantic_family(pol) is not None:
        raise ValueError(f"policy {pol.name!r} has semantics of its own and runs on the "
                         "online-softmax family, not on the paged fp8 kernel; bound it with "
                         "onset.bound(policy)")
    return upstream.FP8_PAGED_DEFAULT, pol


def region(policy=None, *, tolerance: float = 0.25, seqlen_kv=4096) -> PagedRegion:
    """The paged fp8 prefill's safe region under ``policy`` (None or a version name: the
    builder's defaults; else a policy's name or a Policy), ``tolerance`` as the dense
    region's; a per-tile call's measure is answered by the per-tile region
    (``paged_fp8_tile.region``, the version's per-tile defaults or the same policy).
    ValueError naming why for what either region cannot bound."""
    version, pol = _policy(policy)
    dense = bound(pol, dtype="fp8", tolerance=tolerance, seqlen_kv=seqlen_kv, kernel="swp_fp8")
    try:
        tile = paged_fp8_tile.region(policy or None, tolerance=tolerance, seqlen_kv=seqlen_kv)
    except ValueError as e:    # the paired-page region stands; a per-tile call says why not
        tile = str(e)
    return PagedRegion(version, dense, tuple(h.over_parts() for h in dense.hazards) + (READ_PAST,),
                       tile=tile)


def schedule(q8: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **call) -> str:
    """Which of #1066's kernels a paged fp8 call (``flash_attn_func``'s paged arguments)
    runs: "bn128" (the paired-page kernel this region bounds) or "tile" (the per-tile
    kernel, ``fa_lab.paged.fp8_schedule``); the call is checked as ``flash_attn_func``
    checks it."""
    return _checked(q8, k, v, **call).schedule


def _checked(q8, k, v, *, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, block_table, seqlen_k,
             max_seqlen_kv=None, kv_cache_layout="vectorized", **_descales):
    from fa_lab.paged import check_fp8

    if not isinstance(q8, torch.Tensor) or q8.dtype != torch.float8_e4m3fn:
        raise TypeError("q8 must be a float8_e4m3fn torch.Tensor [total_q, H, D]")
    return check_fp8(q8, k, v, causal=True, cu_seqlens_q=cu_seqlens_q,
                     cu_seqlens_kv=cu_seqlens_kv, max_seqlen_q=max_seqlen_q,
                     max_seqlen_kv=max_seqlen_kv, block_table=block_table, seqlen_k=seqlen_k,
                     kv_cache_layout=kv_cache_layout)


def measure(q8: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cu_seqlens_q, cu_seqlens_kv,
            max_seqlen_q, block_table, seqlen_k, q_descale: float, k_descale: float,
            v_descale: float, max_seqlen_kv=None, kv_cache_layout: str = "vectorized",
            policy=None):
    """The ``PagedMeasure`` of one paged fp8 call (``flash_attn_func``'s arguments, checked
    as it checks them, ``fa_lab.paged.check_fp8``) under ``policy`` (as ``region``'s); a
    call that runs the per-tile kernel (``schedule``) gives the per-tile kernel's
    ``paged_fp8_tile.TileMeasure`` (its policy: ``paged_fp8_tile.resolve_policy``'s)."""
    from fa_lab.kernels import swp_fp8
    from fa_lab.kernels._common.geometry import block_groups

    paged = _checked(q8, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
                     max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv,
                     block_table=block_table, seqlen_k=seqlen_k, kv_cache_layout=kv_cache_layout)
    if paged.schedule == "tile":
        return paged_fp8_tile.measure_call(
            paged, q8, k, v, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
            policy=paged_fp8_tile.resolve_policy(policy)[1])
    _, pol = _policy(policy)
    parts: list[Measure] = []
    read_past, pages = [], []
    for b, skv in enumerate(paged.seqlen_k):
        q0, q1 = paged.cu_q[b], paged.cu_q[b + 1]
        if q1 == q0:
            continue
        groups = block_groups(q1 - q0, skv, True, q8.device)
        n_tiles = max(g.n_tiles for g in groups)
        kg, vg = swp_fp8.paged.gather(paged, k, v, b, n_tiles)
        pages.append(paged.page_ids(b, n_tiles).tolist())
        parts.append(dense_measure(q8[q0:q1][None], kg, vg, policy=pol, causal=True,
                                   seqlen_kv=skv, q_descale=q_descale, k_descale=k_descale,
                                   v_descale=v_descale, dtype="fp8"))
        for g in groups:
            past = vg[0, skv:g.n_tiles * paged.page_size].float()
            if not bool(torch.isfinite(past).all()):
                read_past.append((b, g.n_tiles))
    return PagedMeasure(parts, read_past, pages)


def _family(policy, *, dtype, tolerance, seqlen_kv):
    """``bound(..., kernel="swp_fp8_paged")``: the family takes fp8 inputs only, so the
    dtype names nothing here (as for the decode families)."""
    return region(policy or None, tolerance=tolerance, seqlen_kv=seqlen_kv)


register_family(FAMILY, _family)
