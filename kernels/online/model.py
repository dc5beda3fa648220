"""Exact model of a generic online-softmax forward, driven by a Policy and its Semantics.

One model for the whole family of FlashAttention-style kernels whose failures the zoo
collects: every row walks its KV tiles of ``block_n`` columns, one online-softmax step per
tile, and each field of ``policy`` and ``policy.semantics`` (``fa_lab.semantics``,
``docs/semantics.md`` §10) decides one thing in that step. All state is fp32; a rounding to
a narrower type happens only where a field says so. One step, per row:

    x   = where(visible, f32(S * c) + bias, mask_value)     S = q.k (fp64 dot, rounded once)
    mt  = rowmax(x); floored: fmax(mt, floor_value)
    move, m' = the vote and rebase (``_common.models.choose``, shared with the FlyDSL models)
    f   = where(move, exp2(m - base(m')), 1)                  base: the empty-row guard
    P   = exp2((x - base(m' or, lagging, m)) + p_headroom)     fp32; l sums this P
    O   = gate(f) * O + cast(P) @ V;  l = f * l + sum(P);  m = m'
    out = O * epilogue(l);  lse = (m + log2 l - p_headroom) ln 2   (-inf where l == 0)

``q_prescale`` takes S from round(q * c) . k with no scale after; ``fixed_max`` pins m (no
vote, f = 1); ``l_sums_cast`` makes l sum cast(P); ``ftz`` flushes
exp2's subnormal results to 0; ``l_floor`` divides by fmax(l, l_floor) (NaN-propagating, as
``maximumf``) before the epilogue guard. ``softcap`` caps the natural-unit score
``f32(S * softmax_scale)`` by the chosen form of tanh before the bias and the mask;
``exp_floor`` floors every exp2 argument (maxNum); ``mask_stage="p"`` takes the max and P
over every score and multiplies P by the visibility afterwards; ``p_before_vote`` takes P
against fmax(m, mt) whatever the vote decides; ``kv_split`` restarts the walk every that
many steps and merges the partials' (out, lse) (``merge_partials``).

Scores are kept in one domain, log2 units: ``c = f32(f32(softmax_scale) * f32(log2 e))``
(``softmax_scale = LOG2_UNITS`` makes c exactly 1, so q.k are log2 units). Kernels that keep
raw maxima and fold c into exp2 (FA4, flashinfer, FlyDSL fp8), or exponentiate in base e
(TensorRT-LLM, PyTorch), differ from it by roundings only; their constants enter as the
fields give them (``mask_domain``). Rows are padded to whole waves (and to whole 32-row
groups, the unit the rescale counters read) with Q = 0, as the FlyDSL kernels' padding rows
are; they vote, and their outputs are dropped. Every row visits every tile of its
sequence, at least one (a kernel loads a first tile before it tests the length).

The family's entry for ``fa_lab.dispatch`` is the same ``forward``: a call's ``bias``
[Sq, Skv] (natural-log units, -inf = masked) is its additive mask; fp8 (e4m3) inputs come
with their descales, which fold into c (q, k) and the output (v); ``saturate=False``
(``fp8_saturate``) makes the P cast non-saturating; a ``recorder`` (``fa_lab.trace``'s
``TraceRecorder`` or a rescale counter) receives every step, with m, mt and the
threshold in log2 units.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fa_lab import values, varlen
from fa_lab.checks import check_qkv
from fa_lab.numerics import (FP32_TINY, LN2, LOG2E, bf16, e4m3, exp2, f16, f32, fmax,
                             guarded_rcp)
from fa_lab.policies import BY_KV_LEN, Policy

from .._common.models import check_decidable, choose

#: Columns per step when ``semantics.block_n`` is None.
DEFAULT_BLOCK_N = 64
#: The ``softmax_scale`` whose c is exactly 1: scores q.k are then in log2 units.
LOG2_UNITS = math.log(2.0)

#: Largest finite value of each P format, and the dtype that holds it.
FORMAT_MAX = {"bf16": 3.3895313892515355e38, "f16": 65504.0, "e4m3": 448.0, "e5m2": 57344.0}
_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "e5m2": torch.float8_e5m2}
_INPUT_FORMATS = {torch.float32: "none", torch.bfloat16: "bf16", torch.float16: "f16",
                  torch.float8_e4m3fn: "e4m3"}
#: How this model's errors name it.
_WHERE = "the online model"
#: Rows are padded to a multiple of this as well as of the wave: the counters' group.
_GROUP_ROWS = 32
#: e5m2's rounding boundary to inf: the midpoint of 57344 and 2**16 ties to the even inf.
_E5M2_INF = 61440.0


def cast_p(p: torch.Tensor, fmt: str, saturate: bool = True) -> torch.Tensor:
    """P rounded to nearest even to ``fmt`` (an fp32 tensor holding its values).
    ``saturate`` clamps to the format's largest finite value first (a satfinite convert);
    without it values past the format become inf (bf16, f16, e5m2) or NaN (e4m3, which has
    no inf). fp8 values are clamped before ``.to()``, never left to torch's own
    out-of-range conversion; bf16 and f16 round past their top to inf as IEEE says."""
    if fmt == "none":
        return p
    if fmt not in FORMAT_MAX:
        raise values.unknown("p_cast", fmt, _WHERE)
    if fmt == "e4m3":
        return e4m3(p, saturate)
    lim, dtype = FORMAT_MAX[fmt], _DTYPES[fmt]
    if not saturate and fmt != "e5m2":
        return p.to(dtype).to(torch.float32)
    y = p.clamp(-lim, lim).to(dtype).to(torch.float32)  # NaN passes a clamp
    if saturate:
        return y
    return torch.where(p.abs() >= _E5M2_INF, p.sign() * math.inf, y)


@dataclass
class TileRecord:
    """One step of the walk. ``tile`` [B]: the KV tile each batch entry visited (-1: none,
    its sequence has fewer tiles); the rest are per row [B, H, Sq]: the max before and
    after, the tile max, l after, the factor ``f`` (l's) and ``o_factor`` (what O was
    multiplied by, after the O gate), whether the row moved its max or skipped the tile,
    the largest P before its cast, how many P lay past the cast's largest value, and the
    largest |O| after the step (NaN once O holds a NaN)."""

    step: int
    tile: torch.Tensor
    m_old: torch.Tensor
    mt: torch.Tensor
    m: torch.Tensor
    l: torch.Tensor
    factor: torch.Tensor
    o_factor: torch.Tensor
    moved: torch.Tensor
    skipped: torch.Tensor
    p_max: torch.Tensor
    saturated: torch.Tensor
    o_max: torch.Tensor | None = None


def row_history(records: list[TileRecord], b: int = 0, h: int = 0, row: int = 0) -> list[dict]:
    """One row's steps as plain numbers, for tables and figures."""
    names = ("m_old", "mt", "m", "l", "factor", "o_factor", "p_max", "o_max")
    out = []
    for r in records:
        step = {"step": r.step, "tile": int(r.tile[b])}
        step.update({n: float(getattr(r, n)[b, h, row]) for n in names})
        step.update(moved=bool(r.moved[b, h, row]), skipped=bool(r.skipped[b, h, row]),
                    saturated=int(r.saturated[b, h, row]))
        out.append(step)
    return out


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, policy: Policy,
            causal: bool = False, mask: torch.Tensor | None = None, seqlen_kv=None,
            softmax_scale: float | None = None, record: list | None = None, recorder=None,
            bias: torch.Tensor | None = None, q_descale: float | None = None,
            k_descale: float | None = None, v_descale: float | None = None,
            saturate: bool = True):
    """q [B, Sq, H, D], k and v [B, Skv, Hkv, D] (fp32, bf16, f16 or float8_e4m3fn; fp8
    values may also come as fp32 tensors holding them). ``Skv`` may be 0. Returns
    (out [B, Sq, H, D] in q's dtype (bf16 for fp8 inputs), lse [B, H, Sq] fp32, natural
    log) under ``policy`` and its ``semantics``.

    ``mask``: bool (True = visible) or float (natural-log units added to the scaled score;
    -inf = masked), broadcastable to [B, H, Sq, Skv]; ``bias`` is the same as a float mask
    (dispatch's name for it; give one of the two). ``causal``: bottom-right aligned to
    each sequence's length. ``seqlen_kv``: an int or B ints, each sequence's valid keys
    (default Skv); columns past it are masked, and their V rows in the last tile are
    ``semantics.v_tail``. ``softmax_scale`` defaults to 1/sqrt(D). fp8 inputs need
    ``q_descale``, ``k_descale`` and ``v_descale``; ``saturate=False`` turns the P cast's
    clamp off whatever ``semantics.p_saturate`` says. ``record``: a list that receives one
    ``TileRecord`` per step; ``recorder``: a ``fa_lab.trace.TraceRecorder`` (or a counter
    with its interface) that receives every step."""
    B, Sq, H, D, Skv = _check(q, k, v, policy, causal, mask, bias, softmax_scale, record,
                              (q_descale, k_descale, v_descale), saturate)
    if bias is not None:
        mask = bias
    sem = policy.semantics
    dev = q.device
    fp8 = q.dtype == torch.float8_e4m3fn
    qd, kd, vd = (q_descale, k_descale, v_descale) if fp8 else (1.0, 1.0, 1.0)
    bn, W = sem.block_n or DEFAULT_BLOCK_N, sem.wave_rows
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else float(softmax_scale)
    c = f32(f32(scale * qd * kd) * f32(LOG2E))
    lens = _lengths(seqlen_kv, B, Skv, dev)
    n_tiles = ((lens + bn - 1) // bn).clamp(min=1)
    T = int(n_tiles.max()) if B else 1
    unit = max(W, _GROUP_ROWS)
    R, ncols = -(-Sq // unit) * unit, T * bn
    # each semantics field's value picks its case here, once; a value without one raises
    to_scaled = _case(sem, "mask_domain", {"scaled": lambda t: t, "raw": lambda t: f32(t * c)})
    zero_tail = _case(sem, "v_tail", {"zero": True, "cache": False})
    zero_base, skip_empty = _case(sem, "empty_row_guard", {
        "none": (False, False), "zero_base": (True, False), "skip": (False, True)})
    descending = _case(sem, "kv_order", {"ascending": False, "descending": True})
    floored = _case(sem, "tile_max_floor", {"never": False, "causal": causal, "always": True})
    gated = _case(sem, "o_gate", {"always": None, "row": False, "wave": True})
    mask_s, init_s = to_scaled(sem.mask_value), to_scaled(sem.m_init)
    fmt = sem.p_cast if sem.p_cast != "input" else _INPUT_FORMATS[q.dtype]
    sat = sem.p_saturate and saturate
    H_off = float(policy.p_headroom)

    # [B, H, R, D] rows (padding rows read Q = 0); [B, ncols, H, D] keys and values.
    qh = torch.nn.functional.pad(q.float().permute(0, 2, 1, 3), (0, 0, 0, R - Sq))
    c_s = c  # what the QK product is multiplied by
    if sem.q_prescale:  # round(q * c) . k: c is folded into Q, the product is not scaled
        qh = {torch.bfloat16: bf16, torch.float16: f16}.get(q.dtype, lambda t: t)(qh * c)
        c_s = 1.0
    cols_all = torch.arange(ncols, device=dev)

    def kv(t):
        t = t.float().repeat_interleave(H // t.shape[2], dim=2)
        return torch.nn.functional.pad(t, (0, 0, 0, 0, 0, ncols - Skv))

    kh, vh = kv(k), kv(v)
    if zero_tail:
        vh = vh.masked_fill((cols_all[None, :] >= lens[:, None])[..., None, None], 0.0)
    vis_user, bias_s = _user_mask(mask, B, H, Sq, Skv, R, ncols, dev)

    rows = torch.arange(R, device=dev)
    empty_at = (-math.inf, mask_s, init_s)

    def empty(t):
        return (t == empty_at[0]) | (t == empty_at[1]) | (t == empty_at[2])

    def base(t):  # the max an exponent subtracts
        if not zero_base:
            return t
        return torch.where(empty(t), torch.zeros_like(t), t)

    def clamp(d):
        return fmax(d, -math.inf) if sem.clamp_exp_diff else d

    def ex2(t):  # exp2 of the floored argument, its subnormal results flushed under ftz
        y = exp2(t if sem.exp_floor is None else fmax(t, sem.exp_floor))
        return y.masked_fill(y.abs() < FP32_TINY, 0.0) if sem.ftz else y

    def waves(flags):
        w = flags.reshape(B, H, R // W, W).any(-1, keepdim=True)
        return w.expand(B, H, R // W, W).reshape(B, H, R)

    trace = _Tracer(recorder, B, k.shape[2], H, R)
    fixed = sem.fixed_max is not None
    m0 = f32(sem.fixed_max) if fixed else init_s
    m = torch.full((B, H, R), m0, device=dev)
    l = torch.zeros(B, H, R, device=dev)
    O = torch.zeros(B, H, R, D, device=dev)
    bidx = torch.arange(B, device=dev)[:, None]
    nat = f32(scale * qd * kd)  # the natural-unit scale a softcap applies to

    def finish(m, l, O):  # the epilogue: (out [B, H, R, D] fp32, lse [B, H, R])
        l_div = torch.maximum(l, torch.full_like(l, sem.l_floor)) if sem.l_floor else l
        out = O * epilogue_scale(l_div, sem.epilogue_guard)[..., None]
        out = out * f32(vd) if fp8 else out
        lse = m * f32(LN2) + torch.log(l) - f32(H_off * LN2)
        return out, torch.where(l == 0, torch.full_like(l, -math.inf), lse)

    partials = []
    for s in range(T):
        if sem.kv_split is not None and s and s % sem.kv_split == 0:  # a partial ends
            partials.append(finish(m, l, O))
            m, l, O = torch.full_like(m, m0), torch.zeros_like(l), torch.zeros_like(O)
        active = s < n_tiles  # [B]
        tile = n_tiles - 1 - s if descending else torch.full_like(n_tiles, s)
        tile = torch.where(active, tile, torch.zeros_like(tile))
        cols = tile[:, None] * bn + torch.arange(bn, device=dev)  # [B, bn]
        kt, vt = kh[bidx, cols].permute(0, 2, 1, 3), vh[bidx, cols].permute(0, 2, 1, 3)
        S = (qh.double() @ kt.double().transpose(-1, -2)).float()  # [B, H, R, bn]
        if sem.softcap:
            x = softcap(S * nat, sem.softcap, sem.softcap_form) * f32(LOG2E)
        else:
            x = S * c_s
        vis = (cols < lens[:, None])[:, None, None, :]
        if causal:
            diag = rows[None, :, None] + (lens - Sq)[:, None, None]  # [B, R, 1]
            vis = vis & (cols[:, None, :] <= diag)[:, None]
        if vis_user is not None:
            idx = cols[:, None, None, :].expand(B, H, R, bn)
            vis = vis & vis_user.gather(3, idx)
            x = x + bias_s.gather(3, idx)
        if sem.mask_stage == "scores":
            x = torch.where(vis, x, torch.full_like(x, mask_s))

        mt = x.amax(-1)
        if floored:
            mt = fmax(mt, sem.floor_value)
        choice = choose(policy, m, mt, mt - m, _WHERE, wave_rows=W)
        vote, move, target = choice.vote, choice.move, choice.target
        if fixed:  # the max stays pinned: nothing votes or moves
            vote = move = torch.zeros_like(m, dtype=torch.bool)
        m_new = torch.where(move, target, m)
        skip = empty(m_new) if skip_empty else torch.zeros_like(move)
        m_new, move = torch.where(skip, m, m_new), move & ~skip

        f = torch.where(move, ex2(clamp(m - base(m_new))), torch.ones_like(m))
        lag = ~empty(m) if sem.max_lag else torch.zeros_like(move)
        p_base = torch.where(lag, base(m), base(m_new))
        if sem.p_before_vote:  # P against the candidate max, taken before the vote
            p_base = base(fmax(m, mt))
        P = ex2(clamp(x - p_base[..., None]) + H_off)
        if sem.mask_stage == "p":  # the mask multiplies P after the exponent
            P = P * vis.float()
        P = P.masked_fill(skip[..., None], 0.0)
        cp = cast_p(P, fmt, sat)
        pv = (cp.double() @ vt.double()).float()
        pv = pv.masked_fill(skip[..., None], 0.0)  # a skipped tile's PV is not issued
        psum = (cp if sem.l_sums_cast else P).double().sum(-1).float()
        if gated is None:  # "always"
            g = f
        else:  # "wave" (gated) or "row"
            want = f < 1
            g = torch.where(waves(want) if gated else want, f, torch.ones_like(f))
        O_new = torch.where(lag[..., None], (O + pv) * g[..., None], O * g[..., None] + pv)
        l_new = torch.where(lag, (l + psum) * f, l * f + psum)

        a = active[:, None, None]
        if record is not None:
            lim = FORMAT_MAX.get(fmt, math.inf)
            cut = (slice(None), slice(None), slice(0, Sq))
            record.append(TileRecord(
                step=s, tile=torch.where(active, tile, torch.full_like(tile, -1)),
                m_old=m[cut], mt=mt[cut], m=torch.where(a, m_new, m)[cut],
                l=torch.where(a, l_new, l)[cut], factor=f[cut], o_factor=g[cut],
                moved=(move & a)[cut], skipped=(skip & a)[cut], p_max=P.amax(-1)[cut],
                saturated=(P > lim).sum(-1)[cut],
                o_max=torch.where(a[..., None], O_new, O).abs().amax(-1)[cut]))
        lazy = vote is not None
        trace.step(s, int(tile[0]) * bn, m=torch.where(a, m_new, m), mt=mt,
                   vote=(vote & a) if lazy else None, fire=(move & a) if lazy else None,
                   swept=(move & a & (mt < m)) if lazy else None, corr=f,
                   l=torch.where(a, l_new, l), O=torch.where(a[..., None], O_new, O))
        m, l = torch.where(a, m_new, m), torch.where(a, l_new, l)
        O = torch.where(a[..., None], O_new, O)

    partials.append(finish(m, l, O))
    out, lse = partials[0] if len(partials) == 1 else merge_partials(
        partials, sem.merge_empty, sem.lse_base)
    out_dtype = torch.bfloat16 if fp8 else q.dtype
    trace.finish(out.to(out_dtype).float(), lse)
    out = out[:, :, :Sq].permute(0, 2, 1, 3).to(out_dtype).contiguous()  # one RNE rounding
    return out, lse[:, :, :Sq].contiguous()


class _Tracer:
    """Hands every step to a ``recorder`` (``fa_lab.trace.TraceRecorder`` or a rescale
    counter) in its layout: per-row state as [B, Hkv, G, R], O as [B, Hkv, G, R, D]. A
    row's ``vote`` is its own jump past the threshold, ``fire`` whether it moved its max,
    ``swept`` whether it moved while its tile max sat below its old max; an eager policy
    votes nothing (all False), as the FlyDSL models record it."""

    def __init__(self, recorder, B: int, Hkv: int, H: int, R: int):
        self.rec, self.shape = recorder, (B, Hkv, H // Hkv, R)
        if recorder is not None:
            recorder.bind_group(torch.arange(R))

    def _g(self, t):
        return t.reshape(*self.shape, *t.shape[3:])

    def step(self, step: int, col0: int, *, m, mt, vote, fire, swept, corr, l, O):
        if self.rec is None or not self.rec.active:
            return
        false = torch.zeros_like(m, dtype=torch.bool)
        self.rec.record(step, col0, "loop", m=self._g(m), mt=self._g(mt),
                        vote=self._g(false if vote is None else vote),
                        fire=self._g(false if fire is None else fire),
                        swept=self._g(false if swept is None else swept),
                        corr=self._g(corr), l=self._g(l), O=self._g(O))

    def finish(self, out, lse):
        if self.rec is not None:
            self.rec.finish_group(self._g(out), self._g(lse))


def forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, *,
                   policy: Policy, causal: bool = False, bias=None, **kw):
    """A packed (varlen) batch, q [total_q, H, D], k and v [total_kv, Hkv, D]: one
    ``forward`` per sequence, a sequence with no keys included (Skv = 0: what its rows give
    is the policy's semantics, not a convention). ``bias`` [total_q, max_seqlen_kv].
    Returns (out [total_q, H, D], lse [B, H, max_seqlen_q])."""
    packing = varlen.check(q, k, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv)

    def dense(qb, kb, vb, **extra):
        return forward(qb, kb, vb, policy=policy, causal=causal, **extra, **kw)

    out, lse = varlen.run(packing, q, k, v, dense, bias=bias, run_empty=True)
    return out.to(torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype), lse


def _case(sem, field: str, cases: dict):
    """The case of ``sem``'s value of ``field`` (``fa_lab.values.branch``)."""
    return values.branch(field, getattr(sem, field), _WHERE, cases)


def softcap(t: torch.Tensor, cap: float, form: str) -> torch.Tensor:
    """``cap * tanh(t / cap)`` in fp32, tanh computed as ``form`` says
    (``semantics.softcap_form``): ``"tanh"`` exactly; ``"exp_ratio"`` ``(e^u - e^-u) /
    (e^u + e^-u)`` (NaN once an exponential overflows: ``|u| > ~88.7``); ``"exp_sum"``
    ``1 - 2 / (e^(2u) + 1)``."""
    u = t / f32(cap)
    if form == "tanh":
        r = torch.tanh(u)
    elif form == "exp_ratio":
        e, ei = torch.exp(u), torch.exp(-u)
        r = (e - ei) / (e + ei)
    elif form == "exp_sum":
        r = 1.0 - 2.0 / (torch.exp(2.0 * u) + 1.0)
    else:
        raise values.unknown("softcap_form", form, _WHERE)
    return r * f32(cap)


def merge_partials(partials, merge_empty: str = "empty", lse_base: str = "e"):
    """Merge partial attention states [(out [B, H, R, D], lse [B, H, R]), ...] in fp32, in
    order, reading each LSE as a natural log: ``L_i = lse_i`` (``lse_base="2"``: the partial
    wrote ``lse_i log2 e``), ``w_i = e^(L_i - max L)``, ``out = sum w_i o_i / sum w_i``,
    ``lse = max L + ln sum w_i``. Where every partial is empty, ``merge_empty="empty"``
    gives (0, -inf) (the shift uses 0 for a -inf max), ``"nan"`` NaN."""
    L = torch.stack([p[1] for p in partials])
    if lse_base == "2":
        L = L * f32(LOG2E)
    top = L.amax(0)
    empty = top == -math.inf
    shift = torch.where(empty, torch.zeros_like(top), top) if merge_empty == "empty" else top
    w = torch.exp(L - shift)
    total = w.sum(0)
    acc = torch.zeros_like(partials[0][0])
    for i, (o, _) in enumerate(partials):
        acc = acc + w[i][..., None] * o
    out = acc / total[..., None]
    if merge_empty == "empty":
        out = torch.where((total == 0)[..., None], torch.zeros_like(out), out)
    return out, shift + torch.log(total)


def epilogue_scale(l: torch.Tensor, guard: str) -> torch.Tensor:
    """What O is multiplied by at the end (``semantics.epilogue_guard``): ``"zero"``
    ``1/l if l > 0 else 0``; ``"one"`` 1 where l is 0 or NaN, else ``1/l``; ``"none"``
    ``1/l``."""
    if guard == "zero":
        return guarded_rcp(l)
    if guard == "one":
        return torch.where((l == 0) | torch.isnan(l), torch.ones_like(l), 1.0 / l)
    if guard == "none":
        return 1.0 / l
    raise values.unknown("epilogue_guard", guard, _WHERE)


def _lengths(seqlen_kv, B: int, Skv: int, dev) -> torch.Tensor:
    if seqlen_kv is None:
        return torch.full((B,), Skv, dtype=torch.long, device=dev)
    if isinstance(seqlen_kv, torch.Tensor):
        seqlen_kv = seqlen_kv.tolist()
    values = [seqlen_kv] * B if isinstance(seqlen_kv, int) and not isinstance(seqlen_kv, bool) \
        else seqlen_kv
    if not isinstance(values, (list, tuple)) or len(values) != B or not all(
            isinstance(n, int) and not isinstance(n, bool) for n in values):
        raise TypeError(f"seqlen_kv must be None, an int or {B} ints (one per batch entry), "
                        f"got {seqlen_kv!r}")
    if any(n < 0 or n > Skv for n in values):
        raise ValueError(f"seqlen_kv must lie in [0, Skv={Skv}], got {list(values)}")
    return torch.tensor(values, dtype=torch.long, device=dev)


def _user_mask(mask, B, H, Sq, Skv, R, ncols, dev):
    """The user's mask padded to [B, H, R, ncols]: visibility (padding rows see every
    column, padding columns none) and the finite additive part in log2 units. Columns
    past ``ncols`` (a cache no sequence's length reaches) are never visited."""
    if mask is None:
        return None, None
    try:
        full = torch.broadcast_to(mask, (B, H, Sq, Skv))
    except RuntimeError as e:
        raise ValueError(f"mask {tuple(mask.shape)} does not broadcast to [B, H, Sq, Skv] = "
                         f"{[B, H, Sq, Skv]}") from e
    w = min(Skv, ncols)
    full = full[..., :w]
    vis = torch.zeros(B, H, R, ncols, dtype=torch.bool, device=dev)
    vis[:, :, Sq:] = True
    bias = torch.zeros(B, H, R, ncols, device=dev)
    if mask.dtype == torch.bool:
        vis[:, :, :Sq, :w] = full
    else:
        vis[:, :, :Sq, :w] = full != -math.inf
        bias[:, :, :Sq, :w] = torch.where(full != -math.inf, full.float(), 0.0) * f32(LOG2E)
    return vis, bias


def _check(q, k, v, policy, causal, mask, bias, softmax_scale, record, descales, saturate):
    """Every argument, before any work: TypeError/ValueError naming it."""
    B, Sq, H, D, _, _ = check_qkv(q, k, v, dtypes=tuple(_INPUT_FORMATS), head_dims=None,
                                  kernel="the online-softmax model", min_kv=0)
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a fa_lab.Policy, got {type(policy).__name__}")
    if policy.rule is not None:
        raise ValueError(f"policy {policy.name!r} is a Python rule; the online-softmax model "
                         "runs declarative policies (vote, rebase) only")
    if policy.threshold == BY_KV_LEN or policy.p_headroom is True:
        raise ValueError(f"policy {policy.name!r} is not resolved: give threshold and "
                         "p_headroom as numbers")
    check_decidable(policy, _WHERE)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if mask is not None and bias is not None:
        raise ValueError("give mask or bias, not both (bias is an additive float mask)")
    if bias is not None and not (isinstance(bias, torch.Tensor) and bias.is_floating_point()):
        raise TypeError(f"bias must be a floating-point tensor, got {type(bias).__name__}")
    for name, mk in (("mask", mask), ("bias", bias)):
        if mk is None:
            continue
        if not isinstance(mk, torch.Tensor):
            raise TypeError(f"{name} must be None or a torch.Tensor, got {type(mk).__name__}")
        if mk.dtype != torch.bool and not mk.is_floating_point():
            raise TypeError(f"{name} must be bool or floating point, got {mk.dtype}")
        if mk.is_floating_point() and bool((torch.isnan(mk) | (mk == math.inf)).any()):
            raise ValueError(f"{name} must not hold NaN or +inf (-inf masks a position)")
    fp8 = q.dtype == torch.float8_e4m3fn
    if fp8 and policy.semantics.q_prescale:
        raise ValueError(f"policy {policy.name!r}: q_prescale rounds Q to a 16-bit type; it "
                         "applies to bf16, f16 and fp32 inputs, not float8_e4m3fn")
    for name, x in zip(("q_descale", "k_descale", "v_descale"), descales):
        if fp8 and x is None:
            raise ValueError(f"float8_e4m3fn inputs need {name}")
        if not fp8 and x is not None:
            raise ValueError(f"{name} applies to float8_e4m3fn inputs only, got {q.dtype}")
        if x is not None and (isinstance(x, bool) or not isinstance(x, (int, float))
                              or not math.isfinite(x) or x <= 0):
            raise ValueError(f"{name} must be a finite number > 0, got {x!r}")
    if not isinstance(saturate, bool):
        raise TypeError(f"saturate must be a bool, got {type(saturate).__name__}")
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
            raise TypeError(f"softmax_scale must be a number, got {type(softmax_scale).__name__}")
        if not math.isfinite(softmax_scale) or softmax_scale <= 0:
            raise ValueError(f"softmax_scale must be a finite number > 0, got {softmax_scale!r}")
    if record is not None and not isinstance(record, list):
        raise TypeError(f"record must be None or a list, got {type(record).__name__}")
    return B, Sq, H, D, k.shape[1]
