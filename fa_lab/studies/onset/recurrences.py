"""The kernels' recurrences the prediction replays: the DUALWAVE_SWP bf16/f16 schedule and
the fp8 BN128 one, their deficits, and the exact replay of the candidate rows."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from fa_lab.kernels._common.geometry import BLOCK_N, PV_SPLIT, block_groups, masked_columns, padded_rows
from fa_lab.numerics import CAUSAL_FLOOR, e4m3, exp2, fma_f32, fmax, ieee_fp32_matmul, round_to


#: log2 of the fp32 overflow boundary: a product or sum at or past 2^128 rounds to inf.
OVERFLOW_LOG2 = 128.0


#: log2 of where a P pack rounds to inf: bf16 from (2 - 2^-8) 2^127, f16 from 65520 (§2.4).
PACK_LIMIT_LOG2 = {torch.bfloat16: math.log2((2 - 2.0 ** -8) * 2.0 ** 127),
                   torch.float16: math.log2(65520.0)}


#: log2 of where a P pack rounds to 0 (half the smallest subnormal): bf16 2^-134, f16 2^-25.
PACK_FLOOR_LOG2 = {torch.bfloat16: -134.0, torch.float16: -25.0}


_INF = float("inf")


#: The score modifiers ``predict`` models (bf16/f16 only, as the kernel takes them).
SCORE_MODS = ("bias", "alibi_slopes")


@dataclass
class Tiles:
    """The policy-independent part of a prediction: per block group (rows with the same
    tile count N), each row's maximum per step (bf16: per tile; fp8: per tile pair), the
    column where it sits, and (bf16) the maximum over columns 16..63. Compute once with
    ``tile_maxima`` and pass to ``predict(..., tiles=)`` for every policy and threshold."""

    kernel: str
    shape: tuple
    groups: list          # of (rows [R] cpu, N, mt [B, H, R, S], arg, rest or None)
    seconds: float
    exact_scores: bool
    fingerprint: tuple = ()


def _first_true(x: torch.Tensor) -> torch.Tensor:
    """Index of the first True along the last dim, -1 where none."""
    idx = torch.argmax(x.to(torch.int8), dim=-1)
    return torch.where(x.any(-1), idx, torch.full_like(idx, -1))


def _shift(x: torch.Tensor, fill) -> torch.Tensor:
    """x[..., t - 1] at t (``fill`` at t = 0)."""
    return torch.cat([torch.full_like(x[..., :1], fill), x[..., :-1]], -1)


def _nan_to(x: torch.Tensor, value: float) -> torch.Tensor:
    return torch.where(torch.isnan(x), torch.full_like(x, value), x)


class _Kernel:
    """What the bf16 and fp8 predictors share: the head layout, the score pass, K/V of a
    block group and the one-hot element estimate."""

    step_cols = BLOCK_N

    def _layout(self, call, q_loaded):
        q, k, v = call.q, call.k, call.v
        self.B, self.Sq, self.H, self.D = q.shape
        self.Skv, self.Hkv = k.shape[1], k.shape[2]
        self.causal = call.causal
        self.shape = (tuple(q.shape), tuple(k.shape), call.causal)
        # which q, k and score modifiers these are (tiles of other inputs of the same shape
        # are not reused); a -inf bias entry counts apart from the finite ones
        mods = [call.mods[n] for n in SCORE_MODS if n in call.mods]
        self.fingerprint = (tuple(float(x.float().double().sum()) for x in (q, k))
                            + tuple((float(torch.nan_to_num(x.double(), neginf=0.0).sum()),
                                     int(torch.isneginf(x).sum())) for x in mods))
        self.dev = q.device
        self.q = torch.nn.functional.pad(q_loaded.permute(0, 2, 1, 3),
                                         (0, 0, 0, padded_rows(self.Sq) - self.Sq))
        self.k = k.float().permute(0, 2, 1, 3)                     # [B, Hkv, Skv, D]
        self.v = v.float().permute(0, 2, 1, 3)
        vabs = self.v.abs()
        self.vlog = torch.log2(vabs.amax(-1)).reshape(-1, self.Skv)            # [B*Hkv, Skv]
        self.vlog_max = torch.log2(vabs.amax((-1, -2)).clamp_min(2.0 ** -149)).reshape(-1)

    def head_index(self, R):
        """Each flat row's K/V head, b * Hkv + h // G, for a [B, H, R] layout."""
        G = self.H // self.Hkv
        hb = (torch.arange(self.B)[:, None] * self.Hkv + torch.arange(self.H)[None, :] // G)
        return hb[:, :, None].expand(self.B, self.H, R).reshape(-1).to(self.dev)

    def _kv(self, b, hk, n_cols):
        kk, vv = self.k[b, hk, :n_cols], self.v[b, hk, :n_cols]
        pad = n_cols - kk.shape[0]
        if pad > 0:
            kk = torch.nn.functional.pad(kk, (0, 0, 0, pad))
            vv = torch.nn.functional.pad(vv, (0, 0, 0, pad))
        return kk, vv

    def _replay_start(self, b, h, rows, N, walk):
        """A replay's inputs and empty state: the candidates' scores over N tiles, V, the
        walk's bases and factors, O and l at 0 and no first bad step yet (-1)."""
        rows = rows.to(self.dev)
        hk = h // (self.H // self.Hkv)
        s = self.scores(b, h, hk, rows, N)
        _, vv = self._kv(b, hk, N * BLOCK_N)
        R = rows.numel()
        return (s, vv, walk["m"], walk["corr"], torch.zeros(R, self.D, device=s.device),
                torch.zeros(R, device=s.device),
                torch.full((R,), -1, dtype=torch.int64, device=s.device))

    def masked(self, rows, n_cols, s):
        return s.masked_fill(masked_columns(rows, 0, self.Sq, self.Skv, self.causal, n_cols), -_INF)

    def tiles(self, chunk) -> Tiles:
        t0 = time.perf_counter()
        G = self.H // self.Hkv
        groups = []
        with ieee_fp32_matmul():
            for group in block_groups(self.Sq, self.Skv, self.causal, torch.device("cpu")):
                rows, N = group.rows, group.n_tiles
                rd = rows.to(self.dev)
                per = [[self.step_maxima(b, h, h // G, rd, N, chunk) for h in range(self.H)]
                       for b in range(self.B)]
                stack = [torch.stack([torch.stack([p[i] for p in per_b]) for per_b in per])
                         if per[0][0][i] is not None else None for i in range(3)]
                groups.append((rows, N, *stack))
        if self.dev.type == "cuda":
            torch.cuda.synchronize()
        return Tiles(self.kernel, self.shape, groups, time.perf_counter() - t0,
                     getattr(self, "exact", False), self.fingerprint)

    def one_hot_elements(self, tile, idx, head, chunk):
        """For the flat rows ``idx`` predicted bad: how many output elements the one-hot
        estimate loses (component d of O ~ 2^gap v[j*, d] reaching 2^128) and how many of
        them are NaN (l overflowed too, so rcp(l) = 0 and inf * 0; or a later factor
        underflowed to 0). Only the (row, step) pairs whose gap can reach 128 with the
        head's largest |v| are looked at."""
        if getattr(self, "_vlogd", None) is None:
            self._vlogd = torch.log2(self.v.abs()).reshape(-1, self.Skv, self.D)
        n_el, n_nan = [], []
        forced = tile["forced"][idx]
        nan_row = (tile["l_inf"] | tile["corr0"])[idx]
        for c0 in range(0, idx.numel(), chunk):
            ii = idx[c0:c0 + chunk]
            hh = head[ii]
            worst = torch.full((ii.numel(), self.D), -_INF, dtype=torch.float64, device=ii.device)
            need = OVERFLOW_LOG2 - self.vlog_max[hh].double()[:, None]
            for gap, key in tile["states"]:
                g = gap[ii]
                rr, ss = (g >= need).nonzero(as_tuple=True)
                if rr.numel():
                    kk = key[ii][rr, ss].clamp(max=self.Skv - 1)
                    est = _nan_to(g[rr, ss][:, None] + self._vlogd[hh[rr], kk].double(), -_INF)
                    worst.scatter_reduce_(0, rr[:, None].expand(-1, self.D), est, "amax")
            sl = slice(c0, c0 + chunk)
            comp = (worst >= OVERFLOW_LOG2) | forced[sl][:, None]
            n_el.append(comp.sum(-1))
            n_nan.append((comp & (nan_row[sl] | forced[sl])[:, None]).sum(-1))
        return torch.cat(n_el).cpu(), torch.cat(n_nan).cpu()

    def _verdict(self, walk, est, forced, bound, gap_l, deficit):
        """The shared end of tile_level: the verdict, its step, and the bookkeeping."""
        over = (est >= OVERFLOW_LOG2) | forced
        onset = _first_true(over)
        S = est.shape[-1]
        later = torch.arange(S, device=est.device) > onset[:, None]
        corr0 = ((walk["corr"] == 0) & later & (onset[:, None] >= 0)).any(-1)
        return {"bad": over.any(-1), "step": onset, "forced": forced.any(-1),
                "deficit": deficit, "margin": OVERFLOW_LOG2 - est.amax(-1),
                "dragged": walk["dragged"].sum(-1),
                "candidate": (bound >= OVERFLOW_LOG2 - 1.0).any(-1) | forced.any(-1),
                "l_inf": (gap_l >= OVERFLOW_LOG2).any(-1), "corr0": corr0}


class _Bf16(_Kernel):
    """DUALWAVE_SWP bf16/f16 (§2): one step per KV tile, t = 0 .. N-1."""

    kernel = "swp_bf16"

    def __init__(self, call, exact_scores=True):
        from fa_lab.kernels.swp_bf16.model import softmax_scale_log2

        q = call.q
        self.rnd = round_to(q.dtype)
        self.pack_limit = PACK_LIMIT_LOG2[q.dtype]
        self.pack_floor = PACK_FLOOR_LOG2[q.dtype]
        self.exact = exact_scores
        self.sdt = torch.float64 if exact_scores else torch.float32
        self._layout(call, self.rnd(q.float() * softmax_scale_log2(q.shape[-1])))  # Qs
        self.mods = None
        if call.mods:  # bias / ALiBi, in the model's own log2 form
            from fa_lab.kernels.swp_bf16.model import ScoreMods

            m = call.mods
            self.mods = ScoreMods.build(m.get("bias"), m.get("alibi_slopes"), None, self.B,
                                        self.Hkv, self.H // self.Hkv, self.Sq, self.Skv, self.dev)

    def scores(self, b, h, hk, rows, N):
        kk, _ = self._kv(b, hk, N * BLOCK_N)
        s = (self.q[b, h, rows].to(self.sdt) @ kk.to(self.sdt).T).float()
        if self.mods is not None:  # added in fp32 before masking, as the model does
            extra = self.mods.scores(rows, 0, N * BLOCK_N)
            if extra.dim() == 5:   # ALiBi: [B or 1, Hkv, G, R, cols]
                extra = extra[b if extra.shape[0] > 1 else 0, hk, h % (self.H // self.Hkv)]
            s = s + extra
        return self.masked(rows, N * BLOCK_N, s)

    def step_maxima(self, b, h, hk, rows, N, chunk):
        """Per row and tile: the tile max, its column, and the max over columns 16..63
        (the P values still pending at the rescale)."""
        mts, args, rests = [], [], []
        for c0 in range(0, rows.numel(), chunk):
            s = self.scores(b, h, hk, rows[c0:c0 + chunk], N).view(-1, N, BLOCK_N)
            mt, arg = s.max(-1)
            mts.append(mt)
            args.append(arg.to(torch.int16))
            rests.append(s[..., PV_SPLIT:].amax(-1))
        return torch.cat(mts), torch.cat(args), torch.cat(rests)

    def walk(self, mt, pol):
        """The base after each step, m[:, t], and the factor applied at it, corr[:, t]: the
        prologue sets m, the loop (tiles 1 .. N-4) decides by the policy per 32-row wave
        (``fa_lab.kernels._common.models.decide``, the models' own), the epilogue is eager.
        ``dragged``: rebased down at that step."""
        from fa_lab.kernels._common.models import decide

        R, N = mt.shape
        m = mt[:, 0]
        if self.causal:
            m = fmax(m, CAUSAL_FLOOR)
        ms, corrs = [m], [torch.ones_like(m)]
        drag = [torch.zeros(R, dtype=torch.bool, device=m.device)]
        for t in range(1, N - 3):
            dec = decide(pol, m, mt[:, t], where="the onset recurrence of swp_bf16",
                         at=f"KV tile {t}")
            drag.append(dec.target < m)
            m = dec.target
            ms.append(m)
            corrs.append(dec.corr)
        for t in range(max(1, N - 3), N):
            mn = fmax(m, mt[:, t])
            corrs.append(exp2(m - mn))
            m = mn
            ms.append(m)
            drag.append(torch.zeros_like(drag[0]))
        return {"m": torch.stack(ms, -1), "corr": torch.stack(corrs, -1),
                "dragged": torch.stack(drag, -1)}

    def tile_level(self, walk, mt, arg, rest, head):
        """The one-hot verdict per row. After step t, O holds tiles < t at base m_t
        (gap M_{t-1} - m_t, best key j*_{t-1}); at step t + 1 tile t joins it at the same
        base (gap M_t - m_t). A row is lost where gap + log2 max_d |v[j*, d]| >= 128, or
        where the base falls to -inf, a factor 2^(m - m_new) reaches 2^128 or a P pack
        overflows (bf16: near 2^128; f16: from 65520, so a gap of 16 is enough).
        ``candidate``: the exact level's bound (L <= keys seen, |o| <= max |v| of the
        head) comes within 1 of 128."""
        m = walk["m"].double()
        N = m.shape[-1]
        mtd = mt.double()
        M, ti = torch.cummax(_nan_to(mtd, -_INF), dim=-1)
        col = torch.gather(arg, -1, ti) + ti * BLOCK_N
        vlog = self.vlog[head[:, None], col.clamp(max=self.Skv - 1)].double()
        M_prev, col_prev, vlog_prev = _shift(M, -_INF), _shift(col, 0), _shift(vlog, 0.0)
        m_prev = torch.cat([m[:, :1], m[:, :-1]], -1)
        gap_after = _nan_to(M_prev - m, -_INF)
        gap_join = _nan_to(M - m, -_INF)
        est = torch.maximum(_nan_to(gap_after + vlog_prev, -_INF), _nan_to(gap_join + vlog, -_INF))
        neg = torch.isneginf(m) & ~torch.isneginf(m_prev)
        # the 48 pending P were packed at the old base (flushed to 0 below the pack's
        # floor) and are packed again after the factor: inf from the pack limit up
        rest_prev = _shift(rest.double(), -_INF)
        pending = ((_nan_to(rest_prev - m, -_INF) >= self.pack_limit)
                   & (_nan_to(rest_prev - m_prev, -_INF) > self.pack_floor))
        forced = ((_nan_to(m_prev - m, -_INF) >= OVERFLOW_LOG2)
                  | (_nan_to(mtd - m, -_INF) >= self.pack_limit) | pending | neg)
        forced[:, 0] = False
        if N > 1:  # a prologue base of -inf (no causal floor): exp2(-inf + inf) is NaN, and
            forced[:, 1] |= torch.isneginf(m[:, 0])   # l takes it in at step 1
        keys = torch.log2(torch.arange(1, N + 1, dtype=torch.float64, device=m.device) * BLOCK_N)
        bound = (_nan_to(M - torch.minimum(m, m_prev), -_INF) + keys
                 + self.vlog_max[head][:, None].double())
        deficit = gap_after[:, 1:].clamp(min=0, max=1e30).amax(-1) if N > 1 else m[:, 0] * 0
        out = self._verdict(walk, est, forced, bound, torch.maximum(gap_after, gap_join), deficit)
        out["states"] = [(gap_after, col_prev), (gap_join, col)]
        return out

    def replay(self, b, h, rows, N, walk):
        """The candidates' accumulation with their known bases and factors: §2.2 exactly
        (fp32 state, exact dots, the P packs rounded), each row free of its wave.
        Returns per-element non-finite and NaN flags and each row's first bad step."""
        from fa_lab.numerics import exact_dot, guarded_rcp

        s, vv, m, corr, O, l, first = self._replay_start(b, h, rows, N, walk)

        def tile(t):
            return s[:, t * BLOCK_N:(t + 1) * BLOCK_N]

        def vt(t, lo=0, hi=BLOCK_N):
            return vv[t * BLOCK_N + lo:t * BLOCK_N + hi]

        def mark(t):
            nonlocal first
            now = ~torch.isfinite(O).all(-1) & (first < 0)
            first = torch.where(now, torch.full_like(first, t), first)

        pf = exp2(tile(0) - m[:, :1])
        for t in range(1, N - 3):
            l = l + pf.sum(-1)
            pb = self.rnd(pf)
            O = O + exact_dot(pb[:, :PV_SPLIT], vt(t - 1, 0, PV_SPLIT))
            c = corr[:, t:t + 1]
            O = O * c
            rest = self.rnd(pb[:, PV_SPLIT:] * c)
            l = l * c[:, 0]
            O = O + exact_dot(rest, vt(t - 1, PV_SPLIT))
            pf = exp2(tile(t) - m[:, t:t + 1])
            mark(t)
        for t in range(max(1, N - 3), N):
            l = l + pf.sum(-1)
            O = O + exact_dot(self.rnd(pf), vt(t - 1))
            pf = exp2(tile(t) - m[:, t:t + 1])
            O = O * corr[:, t:t + 1]
            l = l * corr[:, t]
            mark(t)
        l = l + pf.sum(-1)
        O = O + exact_dot(self.rnd(pf), vt(N - 1))
        mark(N - 1)
        out = self.rnd(O * guarded_rcp(l)[:, None])
        return ~torch.isfinite(out), torch.isnan(out), first


class _Fp8(_Kernel):
    """fp8 BN128 (§3): one step per tile pair, p = 0 .. N/2 - 1; raw scores, ls-scaled."""

    kernel = "swp_fp8"
    step_cols = 2 * BLOCK_N

    def __init__(self, call):
        from fa_lab.kernels.swp_fp8.model import log2_scale

        qd, kd, _ = call.descales
        self.ls = log2_scale(qd, kd, call.q.shape[-1])
        self.headroom = float(torch.tensor(float(call.policy.p_headroom), dtype=torch.float32))
        self.saturate = call.fp8_saturate
        self._layout(call, call.q.float())

    def scores(self, b, h, hk, rows, N):
        kk, _ = self._kv(b, hk, N * BLOCK_N)
        return self.masked(rows, N * BLOCK_N, self.q[b, h, rows] @ kk.T)

    def step_maxima(self, b, h, hk, rows, N, chunk):
        """Per tile *pair*: its max (causal: floored at -3e38) and that key's column."""
        mts, args = [], []
        for c0 in range(0, rows.numel(), chunk):
            s = self.scores(b, h, hk, rows[c0:c0 + chunk], N).view(-1, N // 2, 2 * BLOCK_N)
            mt, arg = s.max(-1)
            mts.append(mt)
            args.append(arg.to(torch.int16))
        mt = torch.cat(mts)
        if self.causal:
            mt = fmax(mt, CAUSAL_FLOOR)
        return mt, torch.cat(args), None

    def walk(self, mt, pol):
        from fa_lab.kernels._common.models import decide

        R, n = mt.shape
        m = torch.full((R,), -_INF, device=mt.device)
        ms, corrs, drag = [], [], []
        for p in range(n):
            dec = decide(pol, m, mt[:, p], self.ls, where="the onset recurrence of swp_fp8",
                         at=f"KV tiles {2 * p}-{2 * p + 1} (step {p})")
            drag.append(dec.target < m)
            m = dec.target
            ms.append(m)
            corrs.append(dec.corr)
        return {"m": torch.stack(ms, -1), "corr": torch.stack(corrs, -1),
                "dragged": torch.stack(drag, -1)}

    def tile_level(self, walk, mt, arg, rest, head):
        """The one-hot verdict per row: the best key so far was cast at its own pair's base
        (``min(2^((M - m_p*) ls + H), 448)`` when saturating) and carried to the current
        base by ``2^((m_p* - m) ls)``."""
        ls, H = self.ls, self.headroom
        m = walk["m"].double()
        n = m.shape[-1]
        M, ti = torch.cummax(mt.double(), dim=-1)
        col = torch.gather(arg, -1, ti) + ti * 2 * BLOCK_N
        vlog = self.vlog[head[:, None], col.clamp(max=self.Skv - 1)].double()
        m_star = torch.gather(m, -1, ti)
        p_star = (M - m_star) * ls + H
        cast = p_star.clamp(max=math.log2(448.0)) if self.saturate else p_star
        gap = _nan_to(cast + (m_star - m) * ls, -_INF)
        est = _nan_to(gap + vlog, -_INF)
        m_prev = _shift(m, -_INF)
        corr_log = _nan_to((m_prev - m) * ls, -_INF)
        corr_log[:, 0] = -_INF
        # a base so low that the fp32 addend 0 - ls * m is +inf (the causal floor of a row
        # with no key, from ls = 1.1342746): every P of the pair is exp2(fma(s, ls, inf)),
        # inf or NaN (§1.2)
        lift_overflows = torch.isposinf(0.0 - self.ls * walk["m"])
        forced = (corr_log >= OVERFLOW_LOG2) | lift_overflows
        keys = torch.log2(torch.arange(1, n + 1, dtype=torch.float64, device=m.device) * 2 * BLOCK_N)
        low = torch.minimum(m, torch.where(torch.isinf(m_prev), m, m_prev))
        bound = _nan_to((M - low) * ls + H, -_INF) + keys + self.vlog_max[head][:, None].double()
        deficit = _nan_to((M - m) * ls, 0.0).clamp(min=0, max=1e30).amax(-1)
        gap_l = _nan_to((M - m) * ls + H, -_INF)   # l counts P before the cast
        out = self._verdict(walk, est, forced, bound, gap_l, deficit)
        out["states"] = [(gap, col)]
        return out

    def replay(self, b, h, rows, N, walk):
        """The candidates' pairs with their known bases and factors: §3.2 exactly."""
        from fa_lab.numerics import bf16, guarded_rcp

        s, vv, m, corr, O, l, first = self._replay_start(b, h, rows, N, walk)
        for p in range(N // 2):
            O = O * corr[:, p:p + 1]
            l = l * corr[:, p]
            bias = (0.0 - self.ls * m[:, p]) + self.headroom
            for t in (2 * p, 2 * p + 1):
                P = exp2(fma_f32(s[:, t * BLOCK_N:(t + 1) * BLOCK_N], self.ls, bias[:, None]))
                l = l + P.sum(-1)
                O = O + e4m3(P, self.saturate) @ vv[t * BLOCK_N:(t + 1) * BLOCK_N]
            now = ~torch.isfinite(O).all(-1) & (first < 0)
            first = torch.where(now, torch.full_like(first, p), first)
        out = bf16(O * guarded_rcp(l)[:, None])
        return ~torch.isfinite(out), torch.isnan(out), first
