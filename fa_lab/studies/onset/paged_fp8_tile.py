"""The safe region of FlyDSL #1066's per-tile paged fp8 kernel
(``fa_lab.kernels.swp_fp8.paged_tile``; docs/semantics.md §17.3):
``onset.bound("swp_fp8_paged_tile")``, and what ``onset.bound("swp_fp8_paged")`` answers for
a call that ``fa_lab.paged.fp8_schedule`` sends to this kernel ((D, Dv) other than (128,
128), or an odd page count).

    region = onset.bound("swp_fp8_paged_tile")         # the builder's defaults: lazy, THR 8
    m = onset.paged_fp8.measure(q8, k, v, **call)      # a TileMeasure for a per-tile call
    region.violated(m), region.margins(m)

**The mechanism** (the model's docstring). Per sequence the kernel walks 64-column tiles
with the bf16 kernel's schedule on raw fp8 scores: the prologue's tile max floored at
-3e38, one wave-ballot decision per loop tile (threshold 8), the last three tiles eager.
P = 2^(ls s - ls m + H) with **no** headroom (H = 0 at the builder's defaults), packed to
bf16, then to e4m3 for P V, while l sums the fp32 P. The claims below hold for a policy
whose rebase never lowers a row's base (the base m of a row is then at most its best score
M and, under a threshold THR, at least its running max minus THR; a lowering rebase is
refused).

**Flush (the mass loss).** e4m3's smallest subnormal is 2^-9; round to nearest even sends
every value up to half of it, 2^-10, to 0 (the tie included). P is rounded to bf16 first,
and bf16(P) <= 2^-10 exactly when P <= 2^-10 (1 + 2^-8) (the bf16 midpoint above 2^-10
ties down to it). So a key whose P <= 2^-10 (1 + 2^-8), that is a key at least
``FLUSH_GAP`` = 10 - log2(1 + 2^-8) = 9.9943755 log2 units (plus H) below its row's base,
adds nothing to O but its full P to l: the row's output loses that key's weight. As the
base never passes M, a key within ``FLUSH_GAP`` + H of M is never flushed; one past it is
flushed at base M (so always when M lies in the row's first tile, where the base stays at
M). The hazard bounds a row's error, as a fraction of max|V|, by

    E = [sum_flushed P_j |v_j| + sum_kept e_j |v_j|] / L + (2^-8 + g) A + r

with P_j = 2^(s_j - M + H) as the kernel computes it at base M (fp32), L = sum_j P_j, e_j
the bf16-then-e4m3 rounding bound (``_rounding``), A a bound on |out| / max|V| (the kept
keys' weights), g the fp32 roundings of l, rcp and the products, r O's and the output's
flush below their subnormals. Each term holds at any base in [M - THR, M] (a flushed key's
error over l is P_j / L whatever the base); E is the error itself when the row's max lies
in its first tile and the kept keys have V = 0 (the boundary test's construction).

**Overflow.** Under the lazy threshold a row's P reaches 2^(H + min(THR, Jup)) before a
rescale (Jup: its best score over its first tile's max); O sums n of them times raw fp8 V
(|V| <= 448) and l sums n of them in fp32: both stay below 2^128 while
log2 n + H + min(THR, Jup) + log2 max|V_raw| + a < 128.

**Paging.** Tile t of sequence b reads block-table entry t while t < ceil(seqlen_k / 64),
else ``block_table[0, 0]`` (the padding tiles up to the group's tile count, at least 4):
a non-finite V row the kernel reads past seqlen_k (its last page's tail, or the page
``block_table[0, 0]`` names, under a padding tile) enters P V as 0 * NaN.

**The causal floor.** A row with no key (more query rows than keys) keeps the prologue's
floored max -3e38; once f32(ls * -3e38) is -inf (ls >= 1.1342746) its P is NaN.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch

from fa_lab.kernels._common.hazard import Hazard, HazardChecks
from fa_lab.numerics import E4M3_MAX, bf16, e4m3, exp2, fma_f32, ieee_fp32_matmul, log2_scale

from .bound import OVERFLOW, OUTPUTS, _cast_log2, _floor_ls, register_family
from .measure import resolve

FAMILY = "swp_fp8_paged_tile"
#: The largest fp32 P that the bf16 pack and the e4m3 cast send to 0.
FLUSH_P = 2.0 ** -10 * (1 + 2.0 ** -8)
#: How far (log2 units) below the base a key's P flushes: -log2(FLUSH_P).
FLUSH_GAP = 10.0 - math.log2(1 + 2.0 ** -8)
#: e4m3's smallest normal and the unit roundoffs: a normal P after the bf16 pack, the
#: correction's bf16 repack and the e4m3 cast is off by at most U_P P.
E4M3_NORMAL = 2.0 ** -6
U_BF16 = 2.0 ** -8
U_P = 2.0 ** -4 + 3 * U_BF16
F32_TINY_LOG2 = -149.0


@dataclass
class TilePart:
    """One sequence on the per-tile kernel, per row that sees a key: ``n`` its keys,
    ``jup`` its best score over its first tile's max (log2 units), ``err`` the bound E of
    the module docstring, ``flushed`` the weight of its keys flushed at base M; and
    ``v_max`` (dequantized), ``v_raw_max``, ``v_descale``, ``ls``, ``causal_short`` (more
    query rows than keys) and ``tiles`` (its longest row group's)."""

    n: np.ndarray
    jup: np.ndarray
    err: np.ndarray
    flushed: np.ndarray
    v_max: float
    v_raw_max: float
    v_descale: float
    ls: float
    causal_short: bool
    tiles: int

    @property
    def empty_rows(self) -> bool:
        """Some row sees no key (causal, more query rows than keys)."""
        return self.causal_short


@dataclass
class TileMeasure:
    """A per-tile call: ``parts`` (a ``TilePart`` per sequence with rows), ``read_past``
    ((sequence, tile count) of each row group that reads a non-finite V row past its
    ``seqlen_k``) and ``pages`` (per sequence with rows, the page each tile reads)."""

    parts: list
    read_past: list
    pages: list = dataclasses.field(default_factory=list)
    schedule: str = "tile"


@dataclass(frozen=True)
class TileRegion(HazardChecks):
    """The per-tile kernel's region under ``policy`` at ``version``."""

    version: str
    policy: object
    tolerance: float
    hazards: tuple
    kernel: str = FAMILY

    def describe(self) -> str:
        thr = float(self.policy.threshold) if self.policy.lazy else 0.0
        return self._described(f"{self.kernel} at {self.version} ({self.policy.name}, threshold "
                              f"{thr:g}, H = {float(self.policy.p_headroom):g}): safe where, "
                              "per sequence")

    def to_dict(self) -> dict:
        return {"policy": self.policy.name, "kernel": self.kernel, "version": self.version,
                "tolerance": self.tolerance, "hazards": [h.to_dict() for h in self.hazards]}


def resolve_policy(name, *, seqlen_kv=4096):
    """(version, policy) of a per-tile call: a paged version's default (None, '' or a name
    in ``fa_lab.upstream.FP8_PAGED_VERSIONS``: its threshold, no headroom unless the
    version lifts P) or a named policy. Refused, ValueError naming why: a policy with
    semantics of its own, a Python rule, a rebase that lowers a row's base."""
    from fa_lab import upstream, values

    if name in (None, "") or (isinstance(name, str) and name in upstream.FP8_PAGED_VERSIONS):
        version = name or upstream.FP8_PAGED_DEFAULT
        owner = next(v for v in upstream.VERSIONS.values() if v.fp8_paged == version)
        return version, owner.default_policy(fp8=True, lazy_flag=True, paged="tile")
    pol, family = resolve(name, "fp8", seqlen_kv)
    if family != "swp_fp8":
        raise ValueError(f"policy {pol.name!r} has semantics of its own and runs on the "
                         "online-softmax family, not on the paged fp8 kernel; bound it with "
                         "onset.bound(policy)")
    if values.get("rebase", pol.rebase).lowers:
        raise ValueError(f"policy {pol.name!r} rebases a row below its max (rebase "
                         f"{pol.rebase!r}): the per-tile region's flush and overflow bounds "
                         "need a base that never falls, so no region is derived")
    return upstream.FP8_PAGED_DEFAULT, pol


def _rounding(p: torch.Tensor) -> torch.Tensor:
    """The most the bf16 pack (and repack) and the e4m3 cast move a kept P (fp64):
    U_P P for a normal one, else half e4m3's subnormal step plus the bf16 roundings (the
    larger of the two: a rebase may lift a subnormal P into the normals)."""
    sub = torch.maximum(U_P * p, 2.0 ** -10 + 2 * U_BF16 * p)
    return torch.where(p >= E4M3_NORMAL, U_P * p, sub)


def part_measure(q8, kg, vg, *, skv: int, ls: float, headroom: float, v_descale: float,
                 tiles: int) -> TilePart:
    """The ``TilePart`` of one sequence: q8 [Sq, H, D], kg and vg [1, >= skv, Hkv, D|Dv] as
    its tiles read them."""
    Sq, H, D = q8.shape
    Hkv = kg.shape[2]
    qf = q8.float().reshape(Sq, Hkv, H // Hkv, D).permute(1, 2, 0, 3)       # [Hkv, G, Sq, D]
    kf = kg[0, :skv].float().permute(1, 0, 2)[:, None]                     # [Hkv, 1, skv, D]
    vraw = vg[0, :skv].float().abs().amax(-1).permute(1, 0)[:, None, None]  # [Hkv, 1, 1, skv]
    with ieee_fp32_matmul():
        s = qf @ kf.transpose(-1, -2)                                       # [Hkv, G, Sq, skv]
    cols = torch.arange(skv)
    vis = cols[None, :] <= torch.arange(Sq)[:, None] + (skv - Sq)
    neg = torch.tensor(float("-inf"))
    sv = torch.where(vis, torch.where(torch.isnan(s), neg, s), neg)
    M = sv.amax(-1)
    t0 = sv[..., :64].amax(-1)
    defined = vis.any(-1).expand_as(M)
    Mb = torch.where(defined, M, torch.zeros_like(M))
    p32 = exp2(fma_f32(s, ls, ((0.0 - ls * Mb) + headroom)[..., None]))
    p32 = torch.where(vis, p32, torch.zeros_like(p32))
    flushed = vis & (e4m3(bf16(p32)) == 0)
    p = p32.double()
    L = p.sum(-1)
    v_raw_max = float(vraw.max()) if skv else 0.0
    if not math.isfinite(v_raw_max):
        v_raw_max = math.inf
    vr = torch.nan_to_num(vraw.double(), nan=math.inf)
    e = _rounding(p) * vis
    lost = torch.where(flushed, p, e * (~flushed)) * vr
    jup = ((Mb - t0) * ls).double()
    # |out| / max|V|: the kept keys' weights, and a flushed key's (up to twice its P, kept
    # at a lower base) unless the row's max lies in its first tile (its base is then M)
    A = (torch.where(flushed, 2 * p * (jup > 0)[..., None], p + e) * vr).sum(-1)
    n = vis.sum(-1).expand_as(M)
    gamma = (n.double() + 70 * tiles + 8) * 2.0 ** -24
    if v_raw_max > 0 and math.isfinite(v_raw_max):
        err = (lost.sum(-1) + (U_BF16 + gamma) * A) / L / v_raw_max
        err = err + (4 * tiles + 3) * 2.0 ** (F32_TINY_LOG2 - headroom) / v_raw_max
        err = err + 2.0 ** OUTPUTS["bf16"][0] / (v_raw_max * v_descale)
    else:
        err = torch.zeros_like(L) if v_raw_max == 0 else torch.full_like(L, math.inf)
    ok = defined.flatten()
    return TilePart(n=n.flatten()[ok].numpy(), jup=jup.flatten()[ok].numpy(),
                    err=err.flatten()[ok].numpy(),
                    flushed=((p * flushed).sum(-1) / L).flatten()[ok].numpy(),
                    v_max=v_raw_max * v_descale, v_raw_max=v_raw_max, v_descale=v_descale,
                    ls=ls, causal_short=Sq > skv, tiles=tiles)


def measure_call(paged, q8, k, v, *, q_descale: float, k_descale: float, v_descale: float,
                 policy) -> TileMeasure:
    """The ``TileMeasure`` of a checked per-tile call (``paged.schedule == "tile"``)."""
    from fa_lab.kernels import swp_fp8
    from fa_lab.kernels._common.geometry import block_groups

    ls = log2_scale(q_descale, k_descale, q8.shape[-1])
    H = float(policy.p_headroom)
    parts, read_past, pages = [], [], []
    for b, skv in enumerate(paged.seqlen_k):
        q0, q1 = paged.cu_q[b], paged.cu_q[b + 1]
        if q1 == q0:
            continue
        groups = block_groups(q1 - q0, skv, True, q8.device)
        n_tiles = max(g.n_tiles for g in groups)
        kg, vg = swp_fp8.paged_tile.gather(paged, k, v, b, n_tiles)
        pages.append(paged.page_ids(b, n_tiles).tolist())
        parts.append(part_measure(q8[q0:q1], kg, vg, skv=skv, ls=ls, headroom=H,
                                  v_descale=float(v_descale), tiles=n_tiles))
        for g in groups:
            past = vg[0, skv:g.n_tiles * paged.page_size].float()
            if not bool(torch.isfinite(past).all()):
                read_past.append((b, g.n_tiles))
    return TileMeasure(parts, read_past, pages)


def _rows(m, key):
    x = getattr(m, key)
    return x if x.size else None


def hazards(pol, tolerance: float) -> tuple:
    """The per-tile kernel's hazards under ``pol`` (each checked on a ``TilePart``; the
    region takes them over the parts), then the pages read past seqlen_k."""
    tau = float(pol.threshold) if pol.lazy else 0.0
    H = float(pol.p_headroom)
    log_fmax = math.log2(E4M3_MAX)
    hz = []

    def mass(m):
        if m.err.size == 0:
            return True, math.inf
        top = float(m.err.max())
        margin = math.log2(tolerance) - (math.log2(top) if top > 0 else -math.inf)
        return margin >= 0, margin

    hz.append(Hazard(
        "e4m3 flush of unscaled P (in l, not in O)", "mass_loss",
        f"E = [sum over keys with P <= 2^-10 (1 + 2^-8), at least {FLUSH_GAP:.7f} + H log2 "
        f"units below the row max, of P |v| + sum over the others of e |v|] / L + (2^-8 + g) A "
        f"+ r <= {tolerance:g} max|V| (P at the row max as base, H = {H:g}; e: the bf16 and "
        "e4m3 roundings; A: the kept weights; g, r: fp32's roundings and flushes)", mass,
        exact=False,
        note="a P the e4m3 cast flushes still counts in l. The flush edge itself is exact "
             "(bf16 then e4m3, ties to even); E is the error itself where the row's max lies "
             "in its first tile and the kept keys' V is 0, sufficient elsewhere"))

    def excess(m):
        return H + np.minimum(m.jup, tau)

    def overflow(m):
        if m.n.size == 0:
            return True, math.inf
        e = excess(m)
        acc = math.log2(1 + (4 * m.tiles + 3) * 2.0 ** -24)
        log_n = np.log2(np.maximum(m.n, 1))
        o = np.minimum(_cast_log2(e, "e4m3"), log_fmax) + log_n + math.log2(
            max(m.v_raw_max, 2.0 ** -149)) + acc
        margin = OVERFLOW - float(np.maximum(o, e + log_n + acc).max())
        return margin > 0, margin

    hz.append(Hazard(
        "accumulator overflow", "overflow",
        f"log2 cast(2^(H + min(THR, Jup))) + log2 n + log2 max|V_raw| + a < 128 and "
        f"H + min(THR, Jup) + log2 n + a < 128 (H = {H:g}, THR = {tau:g}; a = log2(1 + "
        "(4 T + 3) 2^-24))", overflow,
        note="a row's P reaches 2^(H + THR) before the ballot fires; O sums raw fp8 V, "
             "the V descale waits for the epilogue"))

    def saturation(m):
        if m.n.size == 0:
            return True, math.inf
        margin = log_fmax - float(excess(m).max())
        return margin >= 0, margin

    hz.append(Hazard(
        "P saturation", "saturation", f"H + min(THR, Jup) <= log2(448) = {log_fmax:.4f}",
        saturation, never=H + tau <= log_fmax,
        note=f"H + THR = {H + tau:g} <= {log_fmax:.4f}: no P can pass 448" if H + tau <= log_fmax
        else "a clipped P keeps its full weight in l"))

    floor_ls = _floor_ls()

    def floor(m):
        margin = math.log2(floor_ls) - math.log2(m.ls)
        return (not m.causal_short) or margin > 0, margin

    hz.append(Hazard(
        "fp8 causal floor overflows", "nan", f"not Sq > seqlen_k, or ls < {floor_ls:.8g}", floor,
        note="the prologue floors a row's max at -3e38; f32(ls * -3e38) = -inf makes a row "
             "with no key NaN"))

    def out_overflow(m):
        if m.v_raw_max <= 0:
            return True, math.inf
        margin = math.log2(OUTPUTS["bf16"][2]) - math.log2(m.v_raw_max * (1 + U_P) * m.v_descale)
        return margin > 0, margin

    hz.append(Hazard(
        "output overflow", "overflow", "(1 + u_P) max|V_raw| v_descale < 3.3895e38 (bf16)",
        out_overflow, exact=False,
        note="the output is a weighted mean of raw V times the descale: sufficient"))
    hz.append(Hazard("non-finite V", "input", "every V row of a valid key is finite",
                     lambda m: (math.isfinite(m.v_raw_max), None),
                     note="0 * inf and 0 * NaN are NaN in P V. Structural"))
    parts = tuple(h.over_parts() for h in hz)
    return parts + (READ_PAST,)


READ_PAST = Hazard(
    "non-finite V in a page read past seqlen_k", "nan",
    "every V row the kernel reads past seqlen_k (its last page's tail; under a padding "
    "tile, the page block_table[0, 0] names) is finite",
    lambda tm: (not tm.read_past, None),
    note="masked in S, but P = 0 times NaN or inf in P V is NaN for every row of the group "
         "that reads it. Structural")


def region(policy=None, *, tolerance: float = 0.25, seqlen_kv=4096) -> TileRegion:
    """The per-tile kernel's safe region under ``policy`` (``resolve_policy``)."""
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 < tolerance < 1:
        raise ValueError(f"tolerance must be a number in (0, 1), got {tolerance!r}")
    version, pol = resolve_policy(policy, seqlen_kv=seqlen_kv)
    return TileRegion(version, pol, float(tolerance), hazards(pol, float(tolerance)))


def _family(policy, *, dtype, tolerance, seqlen_kv):
    return region(policy or None, tolerance=tolerance, seqlen_kv=seqlen_kv)


register_family(FAMILY, _family)
