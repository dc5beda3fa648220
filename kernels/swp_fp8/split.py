"""FlyDSL #1097 on the fp8 BN128 kernel: head dims (D, Dv), split-K and its combine, the LSE.

What it models (ROCm/FlyDSL, the ``flash_attn_fp8_gfx950.py`` and ``flash_attn_utils.py``
copies the code index holds at 20a76439, after #1097; the LSE from the same PR's author's
port to ROCm/aiter, ``fmha_gfx950/pipeline.py``'s ``_store_lse``; docs/semantics.md §16):

* **(D, Dv).** Q and K have D columns (a multiple of 64; 128 or 192 here), V and the output
  Dv (``_make_dualwave_swp_fp8_traits``: 64 <= Dv <= 192, Dv % 32 == 0). The softmax
  scale is 1/sqrt(D): ``ls = f32(c * f32(qd * kd))``, ``c = f32(f32(1/sqrt(D)) * f32(log2 e))``
  (``fa_lab.numerics.log2_scale``).
* **The walk.** As ``model``: raw fp8-product scores, 64-column tiles in pairs, one
  rescale decision per pair, ``P = exp2(fma(S, ls, -ls*m + H))`` with the headroom
  ``H = log2 448 - THR`` (lazy) or ``log2 448`` (eager), ``l`` summing P in fp32 before
  the e4m3 cast, O accumulating ``e4m3(P) @ V8``. Varlen and split-K run this paired walk
  too: at 20a76439 ``_make_dualwave_swp_fp8_traits`` sets ``bn128 = True`` for every build
  and the file's one attention kernel is the BN128 one (docs/semantics.md §3.6).
* **The epilogue.** ``inv = (rcp(l) if l > 0 else 0) * v_descale``, then ``O * inv`` (the
  kernel folds the V descale into the reciprocal first).
* **Split-K.** ``num_kv_splits`` > 1 cuts each 256-row block's N tiles as the bf16 kernel
  does (``swp_bf16.model.split_ranges``). Each split walks its tiles from its own -inf max
  and stores a partial: O normalised by its own l (times the V descale), rounded to bf16;
  ``m * ls`` (the scaled units, ``store_splitk_partial_o``); its l, which still carries
  the 2**H headroom. An empty split stores O = 0, m = -1e30, l = 0.
* **The combine** (``DualwaveSplitKCombineHelper``): ``m_max = maxNum_s m_s``; for each
  split with l_s > 0 (a NaN or zero l is skipped), ``wl = exp2(m_s - m_max) * l_s``,
  ``den += wl``, ``acc += wl * O_s``; out = bf16(acc * (rcp(den) if den > 0 else 0)).
  The headroom cancels in the ratio: every split carries the same 2**H.
* **The LSE** (natural log): ``m_scaled * ln 2 + ln(l) - H * ln 2`` with ``m_scaled = m *
  ls`` (dense) or ``m_max`` (split-K, l = den): the P headroom removed.

Two unit contracts, each a field of ``fa_lab.upstream.Fp8SplitVersion``:
``m_units="scaled"`` (#1097: the partial maxima leave the kernel multiplied by ls, so the
combine's ``exp2(m_s - m_max)`` is a log2-unit difference) or ``"raw"`` (the bug aiter
#4676's ``splitk_m_out`` docstring records: raw fp8-product maxima, whose gaps are ~1e5
under fp8 descales, so every split but the largest gets weight exp2(-gap) = 0);
``lse_headroom`` True subtracts H from the LSE, False leaves l's 2**H in it.
"""

from __future__ import annotations

import torch

from fa_lab import upstream as versions
from fa_lab.capabilities import check_semantics
from fa_lab.checks import check_int
from fa_lab.numerics import LN2, bf16, exp2, f32, fmax, guarded_rcp, log2_scale
from fa_lab.policies import Policy
from fa_lab.trace import TraceRecorder
from . import FAMILY
from .._common.geometry import block_groups, padded_rows
from .._common.models import check_decidable, heads
from .walk import walk
from ..swp_bf16.model import _pad_kv, split_ranges

#: Q/K head dims (multiples of 64 that upstream's fp8 traits build) and V/output head dims
#: (64 <= Dv <= 192, Dv % 32 == 0) this model runs.
HEAD_DIMS = (128, 192)
HEAD_DIMS_V = (64, 96, 128, 160, 192)
#: What an empty split stores as its maximum (``store_empty_split``).
EMPTY_SPLIT_M = -1e30
M_UNITS = ("scaled", "raw")


def check_args(q8, v8, num_kv_splits, m_units, lse_headroom) -> None:
    """Before any work: ValueError/TypeError naming the argument (``m_units`` and
    ``lse_headroom`` as resolved from the version)."""
    if q8.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"head dim D={q8.shape[-1]} is not supported; the fp8 kernel takes D = "
                         f"{' or '.join(map(str, HEAD_DIMS))}")
    if v8.shape[-1] not in HEAD_DIMS_V:
        raise ValueError(f"v head dim Dv={v8.shape[-1]} is not supported; the fp8 kernel takes "
                         f"Dv in {HEAD_DIMS_V} (64 <= Dv <= 192, a multiple of 32)")
    check_int("num_kv_splits", num_kv_splits, lo=1)
    if m_units not in M_UNITS:
        raise ValueError(f"m_units={m_units!r}; choose one of {M_UNITS}")
    if not isinstance(lse_headroom, bool):
        raise TypeError(f"lse_headroom must be a bool, got {type(lse_headroom).__name__}")


def forward(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, *, q_descale: float,
            k_descale: float, v_descale: float, causal: bool, policy: Policy,
            num_kv_splits: int = 1, upstream: str | None = None, m_units: str | None = None,
            lse_headroom: bool | None = None, saturate: bool = True,
            recorder: TraceRecorder | None = None):
    """q8 [B, Sq, H, D], k8 [B, Skv, Hkv, D], v8 [B, Skv, Hkv, Dv], float8_e4m3fn (shapes and
    dtypes checked by the caller; D, Dv and the split arguments here).

    ``upstream``: an ``fa_lab.upstream.FP8_SPLIT_VERSIONS`` name (None: the default,
    #1097), whose ``m_units`` and ``lse_headroom`` apply unless given here.
    Returns (out [B, Sq, H, Dv] bf16, lse [B, H, Sq] fp32, natural log, -inf where l = 0).
    A trace records the dense walk (one split) only."""
    version = versions.check_fp8_split(upstream)
    m_units = version.m_units if m_units is None else m_units
    lse_headroom = version.lse_headroom if lse_headroom is None else lse_headroom
    check_args(q8, v8, num_kv_splits, m_units, lse_headroom)
    check_semantics(policy, FAMILY, "model")
    check_decidable(policy, f"the {FAMILY.name} model")
    if recorder is not None and num_kv_splits > 1:
        raise ValueError("trace records the dense walk; pass num_kv_splits=1")
    B, Sq, H, D = q8.shape
    Skv, Dv = k8.shape[1], v8.shape[-1]
    ls = log2_scale(q_descale, k_descale, D)
    vd = f32(v_descale)
    headroom = f32(policy.p_headroom)
    qf, kf, vf = heads(q8, k8, v8, padded_rows(Sq))
    Hkv, G, n_rows = qf.shape[1], qf.shape[2], qf.shape[3]
    out = torch.empty(B, Hkv, G, n_rows, Dv, device=q8.device)
    lse = torch.empty(B, Hkv, G, n_rows, device=q8.device)
    walk_kw = dict(Sq=Sq, Skv=Skv, causal=causal, policy=policy, ls=ls, saturate=saturate,
                   headroom=headroom, rec=recorder)
    for g in block_groups(Sq, Skv, causal, q8.device):
        rows, N = g.rows, g.n_tiles
        if recorder is not None:
            recorder.bind_group(rows)
        kp, vp = _pad_kv(kf, vf, N)
        q_rows = qf[..., rows, :]
        if num_kv_splits == 1:
            m, l, O = walk(q_rows, kp, vp, rows, 0, N, **walk_kw)
            o = bf16(O * (guarded_rcp(l) * vd)[..., None])
            # m*ls*ln2 + ln l - H*ln2, fp32 in that order (``_store_lse``)
            ln_l = torch.log(l)
            l_e = (m * ls) * f32(LN2) + ln_l
            l_e = l_e + f32(-headroom * LN2) if lse_headroom else l_e
        else:
            parts = []
            for t0, t_end in split_ranges(N, num_kv_splits):
                if t_end > t0:
                    parts.append(partial(*walk(q_rows, kp, vp, rows, t0, t_end, **walk_kw), ls=ls,
                                         v_descale=vd, m_units=m_units))
                else:
                    parts.append(empty_partial(q_rows.shape[:-1], Dv, q8.device))
            o, l_e = combine(parts, headroom=headroom if lse_headroom else 0.0)
        if recorder is not None:
            recorder.finish_group(o, l_e)
        out[..., rows, :], lse[..., rows] = o, l_e
    out = out[..., :Sq, :].reshape(B, H, Sq, Dv).permute(0, 2, 1, 3).to(torch.bfloat16)
    return out.contiguous(), lse[..., :Sq].reshape(B, H, Sq).contiguous()


def partial(m, l, O, *, ls: float, v_descale: float, m_units: str = "scaled"):
    """One split's stored partial (``store_splitk_partial_o``): (O bf16 [..., Dv] normalised
    by its own l and scaled by the V descale, m in ``m_units``, l with its 2**H)."""
    o = bf16(O * (guarded_rcp(l) * f32(v_descale))[..., None])
    return o, (m * ls if m_units == "scaled" else m), l


def empty_partial(shape, Dv: int, device):
    """What a split with no tiles stores (``store_empty_split``): O 0, m -1e30, l 0."""
    return (torch.zeros(*shape, Dv, device=device),
            torch.full(shape, EMPTY_SPLIT_M, device=device), torch.zeros(shape, device=device))


def combine(parts, *, headroom: float = 0.0):
    """The combine pass over ``parts`` [(O_s, m_s, l_s), ...] in split order: returns
    (out bf16-valued fp32 [..., Dv], lse [...]). ``headroom`` (log2 units) is taken off
    the LSE; the output does not depend on it."""
    m_max = parts[0][1]
    for _, m_s, _ in parts[1:]:
        m_max = fmax(m_max, m_s)
    den = torch.zeros_like(m_max)
    acc = torch.zeros_like(parts[0][0])
    for o_s, m_s, l_s in parts:
        take = l_s > 0  # NaN and zero l: the split is skipped
        wl = exp2(m_s - m_max) * l_s
        den = torch.where(take, den + wl, den)
        acc = torch.where(take[..., None], acc + wl[..., None] * o_s, acc)
    out = bf16(acc * guarded_rcp(den)[..., None])
    lse = m_max * f32(LN2) + torch.log(den)
    if headroom:
        lse = lse + f32(-headroom * LN2)
    return out, lse
