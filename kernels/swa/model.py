"""Exact model of the gfx950 GQA sliding-window kernel, ``swa_gfx950.py`` (docs/semantics.md
§5). Not routed by ``flydsl_flash_attn_func``: upstream calls ``build_gqa_attn``
directly, and so does this model's caller.

Plain vectorised PyTorch, in the kernel's order. References are to
kernels/attention/swa_gfx950.py in ROCm/FlyDSL ``main`` 11c4174d.

Window (l.48-56, ``_mask_band_half`` l.474-490). ``sliding_window=(LEFT, RIGHT)`` keeps, for
query row i, keys j with ``i - LEFT <= j <= i + RIGHT`` (tested as one unsigned compare of
``j - i + LEFT`` against ``LEFT + RIGHT``); Sq must equal Skv, so the window is both top-left
and bottom-right aligned. There is no separate causal flag: causal is RIGHT = 0, so this
model's ``causal=True`` demands ``window_right == 0``. ``window_left=None`` is upstream's
``sliding_window=None``: no mask at all (full non-causal attention) and no floor.

Geometry. A workgroup (CTA) owns 256 query rows, 8 independent waves of 32 rows (the ballot
is per wave). With a window, each CTA walks its own band of KV tiles (l.443-464):
``base0 = 64 * floor(max(0, q0 - LEFT) / 64)``, ``right = min(q0 + 255 + RIGHT, Skv - 1)``,
``nt = clamp(roundup4(floor((right - base0 + 64) / 64)), 4, NT_BAND)`` with
``NT_BAND = max(4, roundup4(ceil((LEFT + 255 + RIGHT + 64) / 64)))``, and
``base = max(0, min(base0, Skv - 64 nt))``; tile t covers columns base + 64t ... + 63.
Without a window nt = Skv // 64 from column 0. The loop advances four tiles per iteration
(l.857-864) and nothing checks bounds (no masks past Skv, no row guard on the O store), so
the model requires Sq = Skv, a multiple of 256, D = 128 and bf16, as the kernel assumes
(the D = 128 MFMA layout is hard-wired; upstream's test uses exactly this).

Domain. ``Qs = bf16(f32(Q) * TS)`` with TS = f32(0.08838834764 * 1.44269504089) for D = 128
(l.65-68, l.588-590): scores are in log2 units. Masked scores are -inf.

Schedule (the same shape as the DUALWAVE_SWP bf16 kernel, docs/semantics.md §2.2; l.609-1051):

  prologue (tile 0)   m = rowmax(S_0), floored at -30 with a window (NEG_FLOOR, l.101, l.619)
                      Pf = exp2(S_0 - m); l = 0; O = 0
  loop (1..nt-4)      l += sum(Pf); Pb = bf16(Pf); O += Pb[:16] @ V   (first PV slice)
                      rescale_defer (l.655-681): m_cur = fmax(rowmax(S_t), -30 if window)
                        m_new = fmax(m_cur, m); vote = (m_new - m) > THR (ordered compare)
                        if any row of the 32-row wave votes, every row of it does
                        corr = exp2(m - m_new) <= 1; O *= corr; Pb[16:] = bf16(Pb[16:] * corr)
                        l *= corr (applied at the next finish, before its sum: same order)
                      O += Pb[16:] @ V; Pf = exp2(S_t - m)
  epilogue (nt-3..)   ``rescale_uncond`` (l.872-877), always: m_new = fmax(m, m_cur);
                      O += bf16(Pf) @ V_{t-1}; O *= corr; l *= corr
  out = bf16(O * rcp(l)), rcp guarded by l > 0 only with a window (l.1039-1042)

Because m_new = fmax(m_cur, m) is taken before the ballot, every correction is <= 1 and
no row is ever dragged down. ``rescale="lazy_unfixed"`` is a counterfactual, not an
upstream kernel: the same ballot decided on the row's own (floored) tile max,
``vote = (m_cur - m) > THR``, with a firing wave rebasing every row to m_cur as upstream
main's DUALWAVE_SWP did; it shows what the -30 floor does and does not prevent.

Read-outs. The kernel writes no LSE; the model returns ``m * ln 2 + ln(l)`` (-inf when
l == 0). Consequences of the -30 floor worth knowing, where softmax would give a convex
combination of the row's V rows: a row whose visible scores all sit between about -158
and -179.5 (log2 units) ends with l an fp32 subnormal, whose reciprocal overflows, so its
output is inf, or NaN where its bf16 P already rounded to 0 (below about -163); below
about -179.5 every P is 0, l = 0 and the output is 0 (LSE -inf). fp32 subnormals are
kept here, as everywhere in the models.

The trace records one step per 64-column tile of the CTA's band; ``col0`` is the tile's
first global column; ``mt`` is the kernel's m_cur (floored at -30 with a window).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from fa_lab import values
from fa_lab.capabilities import check_semantics, policy_refusal
from fa_lab.checks import check_int, check_qkv
from fa_lab.numerics import LN2, bf16, exact_dot, exp2, f32, fmax, guarded_rcp
from fa_lab.policies import BY_KV_LEN, Policy, as_policy, check_number
from fa_lab.trace import TraceRecorder
from . import FAMILY
from .._common.models import heads, run_groups
from .._common.geometry import BLOCK_N, PV_SPLIT, WAVE_ROWS, wave_any

KERNEL = "swa"
CTA_ROWS = 8 * WAVE_ROWS  # 256
HEAD_DIM = 128
#: RESCALE_THRESHOLD upstream (log2 units).
DEFAULT_THRESHOLD = 8.0
#: NEG_FLOOR upstream: the windowed kernel's floor on every tile max (log2 units).
NEG_FLOOR = -30.0


def swa_policy(rescale) -> Policy:
    """``rescale`` (a policy name or a ``fa_lab.Policy``) as a policy the SWA kernel runs
    (its ``Caps``: a 32-row wave ballot with the monotonic rebase, upstream's
    rescale_defer, "max", or the counterfactual own-tile-max one, "tile"), or ValueError
    naming the field it lacks."""
    policy = as_policy(rescale)
    why = policy_refusal(FAMILY.caps("model"), policy, "the SWA kernel")
    if why:
        raise ValueError(f"rescale={policy.name!r}: {why}")
    check_semantics(policy, FAMILY, "model")
    if policy.p_headroom:  # True or a number: the fp8 kernel's P lift, absent here
        raise ValueError(f"rescale={policy.name!r}: p_headroom={policy.p_headroom!r} applies to "
                         "the fp8 kernel only; the SWA kernel has no P headroom")
    return policy


def temperature_scale(head_dim: int = HEAD_DIM) -> float:
    """The kernel's Q pre-scale, a double product of truncated decimals rounded to fp32."""
    return f32((0.08838834764 if head_dim == 128 else 0.125) * 1.44269504089)


def nt_band(window_left: int, window_right: int) -> int:
    """NT_BAND: the largest band (in 64-column tiles) any CTA may walk."""
    span = window_left + (CTA_ROWS - 1) + window_right
    return max(4, math.ceil(math.ceil((span + BLOCK_N) / BLOCK_N) / 4) * 4)


def cta_band(q0: int, seqlen_kv: int, window_left: int | None, window_right: int) -> tuple[int, int]:
    """(first KV column, number of 64-column tiles) walked by the CTA whose first row is q0."""
    if window_left is None:
        return 0, seqlen_kv // BLOCK_N
    left_edge = max(q0 - window_left, 0)
    right_edge = min(q0 + CTA_ROWS - 1 + window_right, seqlen_kv - 1)
    base0 = (left_edge // BLOCK_N) * BLOCK_N
    span_tiles = (right_edge - base0 + BLOCK_N) // BLOCK_N
    nt = min(max((span_tiles + 3) // 4 * 4, 4), nt_band(window_left, window_right))
    base = max(min(base0, seqlen_kv - nt * BLOCK_N), 0)
    return base, nt


def _check_int(name, value, allow_none=False):
    if value is None and allow_none:
        return None
    return check_int(name, value, lo=0)


def check_args(q, k, v, window_left, window_right, causal, threshold, rescale):
    """Every argument against what the kernel supports; raises naming the argument. Returns
    the policy the kernel runs: ``rescale``'s, with ``threshold`` in place of its own
    unless that is None."""
    _, Sq, _, _, Skv, _ = check_qkv(q, k, v, dtypes=(torch.bfloat16,), head_dims=(HEAD_DIM,),
                                    kernel="the SWA kernel")
    if Skv != Sq:
        raise ValueError(f"the SWA kernel needs seq_len_q == seq_len_kv, got {Sq} and {Skv}")
    if Sq % CTA_ROWS:
        raise ValueError(f"sequence length must be a positive multiple of {CTA_ROWS} "
                         f"(the kernel has no bounds checks), got {Sq}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    _check_int("window_left", window_left, allow_none=True)
    _check_int("window_right", window_right)
    if window_left is None:
        if causal:
            raise ValueError("window_left=None is the kernel's unwindowed mode, which has no mask: "
                             "pass causal=False, or a window_left (e.g. the sequence length) for causal")
        if window_right:
            raise ValueError(f"window_right={window_right} needs a window_left (None means no window)")
    elif causal and window_right:
        raise ValueError(f"causal=True means window_right=0 (keys up to the diagonal), got "
                         f"window_right={window_right}; pass causal=False for a two-sided window")
    policy = swa_policy(rescale)
    if threshold is None:  # the policy's own
        if policy.threshold == BY_KV_LEN:
            raise ValueError(f"rescale={policy.name!r} has threshold {BY_KV_LEN!r}, the fp8 "
                             "kernel's rule; the SWA kernel takes a number (rescale_threshold=)")
        threshold = policy.threshold
    check_number("rescale_threshold", threshold, allow_none=False)
    return dataclasses.replace(policy, threshold=float(threshold))


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window_left: int | None,
            window_right: int = 0, causal: bool = True, threshold: float | None = None,
            rescale: str = "lazy", recorder: TraceRecorder | None = None):
    """q [B, S, H, 128], k and v [B, S, Hkv, 128], bf16; S a multiple of 256.

    Query row i attends keys i - window_left ... i + window_right (``window_left=None``:
    every key, non-causal). ``threshold`` (log2 units) replaces ``rescale``'s own; None
    keeps it. Returns (out [B, S, H, 128] bf16, lse [B, H, S] fp32, the model's
    natural-log read-out).
    """
    policy = check_args(q, k, v, window_left, window_right, causal, threshold, rescale)
    S, D = q.shape[1], q.shape[3]
    qs, kf, vf = heads(bf16(q.float() * temperature_scale(D)), k, v, S)

    def run(q_rows, rows, band):
        base, nt = band
        cols = slice(base, base + nt * BLOCK_N)
        return _run_group(q_rows, kf[..., cols, :], vf[..., cols, :], rows, base, nt,
                          window_left, window_right, policy.threshold, policy, recorder)

    groups = ((rows, band) for band, rows in _cta_groups(S, window_left, window_right, q.device).items())
    return run_groups(qs, groups, run, recorder, torch.bfloat16, S)


def _cta_groups(S, window_left, window_right, device) -> dict[tuple[int, int], torch.Tensor]:
    """CTAs that walk the same band run together: {(base, nt): their global rows}."""
    groups: dict[tuple[int, int], list[int]] = {}
    for q0 in range(0, S, CTA_ROWS):
        groups.setdefault(cta_band(q0, S, window_left, window_right), []).append(q0)
    return {key: torch.cat([torch.arange(q0, q0 + CTA_ROWS) for q0 in starts]).to(device)
            for key, starts in groups.items()}


def _run_group(qs, kb, vb, rows, base, nt, window_left, window_right, thr, policy, rec):
    """State per row [B, Hkv, G, R]; kb, vb hold the band's nt * 64 columns."""
    inf = float("inf")
    windowed = window_left is not None

    def scores(t):
        s = exact_dot(qs, kb[..., t * BLOCK_N:(t + 1) * BLOCK_N, :].transpose(-1, -2))
        if not windowed:
            return s
        cols = torch.arange(base + t * BLOCK_N, base + (t + 1) * BLOCK_N, device=rows.device)
        rel = cols[None, :] - rows[:, None]
        return s.masked_fill((rel < -window_left) | (rel > window_right), -inf)

    def tile_max(s):
        mt = s.amax(-1)
        return fmax(mt, NEG_FLOOR) if windowed else mt

    def v_tile(t, lo=0, hi=BLOCK_N):
        return vb[..., t * BLOCK_N + lo:t * BLOCK_N + hi, :]

    def record(t, phase, *, mt, vote=None, fire=None, swept=None, corr=None):
        if rec is not None and rec.active:
            false = torch.zeros_like(m, dtype=torch.bool)
            rec.record(t, base + t * BLOCK_N, phase, m=m, mt=mt,
                       vote=false if vote is None else vote, fire=false if fire is None else fire,
                       swept=false if swept is None else swept,
                       corr=torch.ones_like(m) if corr is None else corr, l=l, O=O)

    # Prologue: tile 0 sets the first base.
    s = scores(0)
    m = tile_max(s)
    pf = exp2(s - m[..., None])
    l = torch.zeros_like(m)
    O = torch.zeros(*m.shape, qs.shape[-1], device=qs.device)
    record(0, "prologue", mt=m)

    # Main loop: rescale_defer, one 32-row wave ballot per tile.
    for t in range(1, nt - 3):
        l = l + pf.sum(-1)
        pb = bf16(pf)
        O = O + exact_dot(pb[..., :PV_SPLIT], v_tile(t - 1, 0, PV_SPLIT))
        s = scores(t)
        mt = tile_max(s)
        # upstream's own ballot, not the shared one (``_common.models.choose``): an ordered
        # compare, so a NaN jump does not vote, and under "max" it reads the monotonic target
        if policy.rebase == "max":
            target = fmax(mt, m)
            vote = (target - m) > thr
        elif policy.rebase == "tile":  # lazy_unfixed: the counterfactual own-tile-max rebase
            target = mt
            vote = (mt - m) > thr
        else:
            raise values.unknown("rebase", policy.rebase, f"the {FAMILY.name} model")
        fire = wave_any(vote)
        swept = fire & (mt < m)
        corr = torch.where(fire, exp2(m - target), torch.ones_like(m))
        O = O * corr[..., None]
        pb_rest = bf16(pb[..., PV_SPLIT:] * corr[..., None])  # packs not yet consumed
        l = l * corr
        m = torch.where(fire, target, m)
        O = O + exact_dot(pb_rest, v_tile(t - 1, PV_SPLIT))
        pf = exp2(s - m[..., None])
        record(t, "loop", mt=mt, vote=vote, fire=fire, swept=swept, corr=corr)

    # Epilogue: rescale_uncond on the last three tiles.
    for t in range(max(1, nt - 3), nt):
        l = l + pf.sum(-1)
        O = O + exact_dot(bf16(pf), v_tile(t - 1))
        s = scores(t)
        mt = tile_max(s)
        mn = fmax(mt, m)
        corr = exp2(m - mn)
        m = mn
        pf = exp2(s - m[..., None])
        O = O * corr[..., None]
        l = l * corr
        if t < nt - 1:
            record(t, "epilogue", mt=mt, corr=corr)
    l = l + pf.sum(-1)
    O = O + exact_dot(bf16(pf), v_tile(nt - 1))
    record(nt - 1, "epilogue", mt=mt, corr=corr)

    inv = guarded_rcp(l) if windowed else 1.0 / l
    out = bf16(O * inv[..., None])
    lse = torch.where(l == 0, torch.full_like(l, -inf), m * f32(LN2) + torch.log(l))
    if rec is not None:
        rec.finish_group(out, lse)
    return out, lse
