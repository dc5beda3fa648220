"""Predict which rows a lazy rescale kills, from tile maxima, without the kernel's accumulation.

    from fa_lab.studies import onset
    pred = onset.predict(q, k, v, rescale="lazy_unfixed", causal=False)
    pred.bad            # [B, Sq, H] bool: rows predicted to come out non-finite
    pred.step           # [B, Sq, H] int: the step (KV tile; fp8: tile pair) where they overflow
    pred.bad_row_frac, pred.nonfinite_frac, pred.nan_frac
    onset.validate(pred, out)   # row-level confusion against a model's output

    tiles = onset.tile_maxima(q, k, v)                  # the score pass, once per input ...
    onset.predict(q, k, v, rescale="lazy", tiles=tiles)  # ... shared by every policy
    onset.validate_grid(S=2048, H=4, k_scales=(8, 32, 64))  # predictor vs model on a grid
    python -m fa_lab.studies.onset h200 --part bf16 --out DIR       # the full-size runs (CUDA)

**The mechanism** (``docs/semantics.md`` §7). Every row keeps a base ``m`` and, in real
arithmetic, ``l = 2^(M - m) L`` and ``O_d = 2^(M - m) L o_d``, where ``M`` is the best score
it has seen, ``L = sum 2^(s - M)`` is in [1, n] and ``o`` is its correct partial output. The
gap ``M - m`` is the **deficit** δ. A rescale that rebases a row *down* (a wave fired and
the row's own tile max sits below its base: it is *dragged*) raises δ by ``m - mt``;
the row's own later jumps lower it again. fp32 overflows at 2^128, so component ``d`` of O
is lost once ``δ + log2 L + log2|o_d| >= 128``, and inf never comes back. The row's output
is then non-finite. (l alone overflowing makes the output ``O * rcp(inf) = 0``: finite,
wrong, and not counted here as a bad row; the model agrees.)

**The prediction** needs only the row's tile maxima ``mt`` (one matmul and an amax per
tile; no exp, no PV), because the base sequence ``m_t`` is a function of them alone: the
ballot compares ``mt - m`` with the threshold per 32-row wave, and the rebase picks ``mt``,
``fmax(m, mt)`` or keeps ``m``. ``predict`` replays that recurrence with the kernel's own
decision function (``fa_lab.kernels._common.models.decide``, so user policies and rules work), then
judges overflow at two levels:

* ``level="tile"`` (default): the one-hot estimate. ``L ~ 1`` and ``o ~ v[j*]``, the value
  row of the best key so far, so component ``d`` dies at the first step where
  ``M_t - m_t + log2 |v[j*, d]| >= 128`` (NaN where l overflows too). Cheapest: scores,
  amax, argmax, the walk.
* ``level="exact"``: the tile level's upper bound (``L <= n``, ``|o_d| <= max|v|``) picks the
  *candidate* rows that could overflow; only those are replayed, each freed from its wave
  because its bases and factors are known, in the kernel's own arithmetic (fp32 state,
  exact dots, the P packs rounded), which gives each element's fate. Rows that cannot reach
  2^128 are never touched by an exp.

Kernels: DUALWAVE_SWP bf16/f16 (§2: prologue, lazy main loop over tiles ``1 .. N-4`` with
the 16/48 PV split, eager epilogue) and fp8 BN128 (§3: one decision per tile pair, P cast
to e4m3 before PV, headroom H). An fp8 base so low that the addend ``0 - ls * m`` is +inf
(a causal row with no visible key, floored at -3e38, once ls >= 1.1342746) kills the row
at that pair (§1.2). Calls that upstream routes to the generic kernel are eager and never
drag: every row is predicted finite.

Score modifiers: ``bias`` and ``alibi_slopes`` (bf16/f16) enter the scores exactly as the
model adds them (``models.swp_bf16.ScoreMods``, before masking), so they move the tile maxima,
the ballot and the walk. A row whose prologue tile is fully masked in a non-causal call
(a -inf bias over its first 64 keys: no causal floor, §1.2) starts from the base -inf, and
``exp2(-inf - -inf)`` is NaN at every column: the whole row is predicted NaN at step 1.
The sink, split-K and varlen are not modelled here (``predict`` takes no such argument).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
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
LEVELS = ("tile", "exact")
_INF = float("inf")


@dataclass
class Onset:
    """``predict``'s answer. Per row ([B, Sq, H]): ``bad`` (predicted non-finite output),
    ``step`` (first step, a KV tile for bf16 or a tile pair for fp8, at which it overflows;
    -1 if never), ``deficit`` (the largest deficit M - m the walk reaches, log2 units),
    ``margin`` (128 minus the tile level's estimate of log2 max|O| at its worst step:
    <= 0 means the tile level predicts overflow), ``dragged`` (loop steps at which the row
    was dragged down), ``elements`` / ``nan_elements`` (the predicted non-finite / NaN output
    elements of the row). ``meta``: kernel, policy, level, sizes, candidate rows (exact
    level) and timings."""

    bad: torch.Tensor
    step: torch.Tensor
    deficit: torch.Tensor
    margin: torch.Tensor
    dragged: torch.Tensor
    elements: torch.Tensor | None = None
    nan_elements: torch.Tensor | None = None
    meta: dict = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return self.bad.numel()

    @property
    def bad_row_frac(self) -> float:
        return float(self.bad.sum()) / max(1, self.bad.numel())

    @property
    def nonfinite_frac(self) -> float:
        """Predicted non-finite output elements over all elements."""
        D = self.meta["D"]
        if self.elements is None:
            return float(self.bad.sum()) * D / (self.bad.numel() * D)
        return float(self.elements.sum()) / (self.bad.numel() * D)

    @property
    def nan_frac(self) -> float:
        """Predicted NaN output elements over all elements."""
        if self.nan_elements is None:
            return math.nan
        return float(self.nan_elements.sum()) / (self.bad.numel() * self.meta["D"])

    def table(self) -> pd.DataFrame:
        """One row per predicted-bad row: batch, row, head, step, deficit, margin."""
        idx = self.bad.nonzero().tolist()
        return pd.DataFrame([{"batch": b, "row": r, "head": h, "step": int(self.step[b, r, h]),
                              "deficit": float(self.deficit[b, r, h]),
                              "margin": float(self.margin[b, r, h]),
                              "dragged": int(self.dragged[b, r, h])} for b, r, h in idx],
                            columns=["batch", "row", "head", "step", "deficit", "margin", "dragged"])


# ---- the call -----------------------------------------------------------------------------

#: The score modifiers ``predict`` models (bf16/f16 only, as the kernel takes them).
SCORE_MODS = ("bias", "alibi_slopes")


def _check(q, k, v, causal, rescale, rescale_threshold, rebase_bound, p_headroom, descales,
           fp8_saturate, kernel=None, bias=None, alibi_slopes=None):
    from fa_lab import api, dispatch

    opts = {"causal": causal, "rescale": rescale, "rescale_threshold": rescale_threshold,
            "rebase_bound": rebase_bound, "p_headroom": p_headroom, "backend": "emulator",
            "kernel": kernel, "bias": bias, "alibi_slopes": alibi_slopes}
    if q.dtype == torch.float8_e4m3fn:
        opts.update(q_descale=descales[0], k_descale=descales[1], v_descale=descales[2],
                    fp8_saturate=fp8_saturate)
    call = api.check_call(q, k, v, **opts)
    other = [f for f in call.features if f not in SCORE_MODS]
    if other or call.packing is not None:
        raise NotImplementedError(f"onset.predict models dense calls with at most "
                                  f"{' and '.join(SCORE_MODS)}; got {', '.join(call.features)}")
    return call, dispatch.plan(call).family


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


def tile_maxima(q, k, v, *, causal: bool = False, q_descale=None, k_descale=None,
                v_descale=None, exact_scores: bool = True, chunk_rows: int = 1024,
                bias=None, alibi_slopes=None) -> Tiles:
    """Every row's tile maxima (one matmul and an amax per tile; no exp, no PV): the only
    pass over the scores the tile level needs. Arguments as ``predict``."""
    fp8 = q.dtype == torch.float8_e4m3fn
    call, _ = _check(q, k, v, causal, "eager", None, None, None,
                     (q_descale, k_descale, v_descale), None, bias=bias,
                     alibi_slopes=alibi_slopes)
    kern = _Fp8(call) if fp8 else _Bf16(call, exact_scores)
    return kern.tiles(chunk_rows)


def predict(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
            rescale="lazy_unfixed", rescale_threshold=None, rebase_bound=None, p_headroom=None,
            q_descale=None, k_descale=None, v_descale=None, fp8_saturate=None,
            level: str = "tile", tiles: Tiles | None = None, exact_scores: bool = True,
            chunk_rows: int = 1024, kernel: str | None = None, bias=None,
            alibi_slopes=None) -> Onset:
    """Predict each row's fate under the kernel fa_lab would run for this call.

    Arguments as ``fa_lab.flash_attn_func`` (q [B, Sq, H, D], k and v [B, Skv, Hkv, D]; fp8
    with its descales; the default policy is ``lazy_unfixed``). ``level``: ``"tile"`` (tile
    maxima only: the one-hot estimate) or ``"exact"`` (candidate rows replayed with their
    known bases; see the module docstring). ``tiles``: a ``tile_maxima`` of the same
    inputs, to share the score pass between policies. ``exact_scores``: scores as the
    model computes them (the exact dot: fp64, one rounding to fp32), so the base sequence
    is the model's bit for bit; False: an fp32 matmul (faster; a few ulps off).
    ``chunk_rows``: rows whose scores are held at once (chunk_rows * Skv * 8 bytes).
    ``kernel``: force a kernel as ``flash_attn_func`` does ("swp_bf16", "swp_fp8").
    ``bias`` [Sq, Skv] and ``alibi_slopes`` [H] or [B, H]: as ``flash_attn_func`` (bf16/f16).
    Tensors may live on a GPU; the answer's tensors are on the CPU."""
    if level not in LEVELS:
        raise ValueError(f"level={level!r}; choose one of {LEVELS}")
    t0 = time.perf_counter()
    call, family = _check(q, k, v, causal, rescale, rescale_threshold, rebase_bound, p_headroom,
                          (q_descale, k_descale, v_descale), fp8_saturate, kernel, bias,
                          alibi_slopes)
    pol = call.policy
    B, Sq, H, D = q.shape
    Skv, Hkv = k.shape[1], k.shape[2]
    meta = {"kernel": family, "policy": pol.name, "policy_resolved": pol.describe(),
            "threshold": float(pol.threshold) if pol.lazy else None, "level": level,
            "B": B, "Sq": Sq, "Skv": Skv, "H": H, "Hkv": Hkv, "D": D, "causal": causal,
            "candidate_rows": 0, "tiles_s": 0.0, "walk_s": 0.0, "exact_s": 0.0}
    shape = (B, Sq, H)
    res = {"bad": torch.zeros(shape, dtype=torch.bool),
           "step": torch.full(shape, -1, dtype=torch.int64),
           "deficit": torch.zeros(shape), "margin": torch.full(shape, _INF),
           "dragged": torch.zeros(shape, dtype=torch.int64),
           "elements": torch.zeros(shape, dtype=torch.int64),
           "nan_elements": torch.zeros(shape, dtype=torch.int64)}
    if family not in KERNELS:  # the generic kernel: eager, never dragged
        meta.update(note=f"the {family} kernel is eager: no row is ever dragged",
                    seconds=time.perf_counter() - t0)
        return Onset(**res, meta=meta)
    kern = _Fp8(call) if family == "swp_fp8" else _Bf16(call, exact_scores)
    if (tiles is None or tiles.kernel != family or tiles.shape != kern.shape
            or tiles.fingerprint != kern.fingerprint
            or (family == "swp_bf16" and tiles.exact_scores != exact_scores)):
        tiles = kern.tiles(chunk_rows)
    meta["tiles_s"] = tiles.seconds
    with ieee_fp32_matmul():
        for rows, N, mt, arg, rest in tiles.groups:
            R, S = rows.numel(), mt.shape[-1]
            BH = B * H
            mt, arg = mt.reshape(BH, R, S), arg.reshape(BH, R, S)
            rest = None if rest is None else rest.reshape(BH, R, S)
            b_all, h_all, r_all = _unflatten(B, H, R)
            head_all = kern.head_index(R)
            per = max(1, CHUNK_ELEMENTS // (R * S))       # heads per piece, waves kept whole
            for c0 in range(0, BH, per):
                c1 = min(BH, c0 + per)
                f = slice(c0 * R, c1 * R)
                _predict_piece(kern, pol, level, res, meta, rows, N, Sq, H, chunk_rows,
                               mt[c0:c1].reshape(-1, S), arg[c0:c1].reshape(-1, S).long(),
                               None if rest is None else rest[c0:c1].reshape(-1, S),
                               head_all[f], b_all[f], h_all[f], r_all[f])
    meta["seconds"] = time.perf_counter() - t0
    return Onset(**res, meta=meta)


KERNELS = ("swp_bf16", "swp_fp8")
#: Row-steps handled at once by the walk and the verdict (whole heads at a time).
CHUNK_ELEMENTS = 1 << 23


def _predict_piece(kern, pol, level, res, meta, rows, N, Sq, H, chunk_rows, mt, arg, rest,
                   head, b_i, h_i, r_i):
    """The walk, the verdict and (exact level) the replay for some whole heads of a
    block group, written into ``res`` ([B, Sq, H] tensors on the CPU)."""
    tw = time.perf_counter()
    walk = kern.walk(mt, pol)
    tile = kern.tile_level(walk, mt, arg, rest, head)
    row = rows[r_i]
    real = row < Sq
    where = (b_i[real], row[real], h_i[real])
    for key in ("deficit", "margin", "dragged"):
        res[key][where] = tile[key][real.to(tile[key].device)].cpu().to(res[key].dtype)
    te = time.perf_counter()
    if level == "tile":
        idx = (tile["bad"].cpu() & real).nonzero().flatten()
        if idx.numel():
            w = (b_i[idx], row[idx], h_i[idx])
            res["bad"][w] = True
            res["step"][w] = tile["step"].cpu()[idx]
            n_el, n_nan = kern.one_hot_elements(tile, idx.to(mt.device), head, chunk_rows)
            res["elements"][w] = n_el
            res["nan_elements"][w] = n_nan
    else:
        cand = (tile["candidate"].cpu() & real).nonzero().flatten()
        meta["candidate_rows"] += int(cand.numel())
        hb = b_i[cand] * H + h_i[cand]
        for key in torch.unique(hb).tolist():
            mine = cand[hb == key]
            for c0 in range(0, mine.numel(), chunk_rows):
                sel = mine[c0:c0 + chunk_rows]
                b, h = divmod(key, H)
                sub = {n: walk[n][sel.to(mt.device)] for n in ("m", "corr")}
                fin, nan, st = (x.cpu() for x in kern.replay(b, h, rows[r_i[sel]], N, sub))
                w = (b_i[sel], row[sel], h_i[sel])
                res["elements"][w] = fin.sum(-1)
                res["nan_elements"][w] = nan.sum(-1)
                res["bad"][w] = fin.any(-1)
                res["step"][w] = torch.where(fin.any(-1), st, torch.full_like(st, -1))
    meta["walk_s"] += te - tw
    meta["exact_s"] += time.perf_counter() - te


def _unflatten(B, H, R):
    """(batch, head, row-in-group) of each flat index of a [B, H, R] layout."""
    f = torch.arange(B * H * R)
    return f // (H * R), (f // R) % H, f % R


# ---- the kernels' recurrences ---------------------------------------------------------------

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
            dec = decide(pol, m, mt[:, t])
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
            dec = decide(pol, m, mt[:, p], self.ls)
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


# ---- validation -------------------------------------------------------------------------

def model_bad_rows(out: torch.Tensor) -> torch.Tensor:
    """[B, Sq, H] bool: rows of a model's output with any non-finite element."""
    return ~torch.isfinite(out.float()).all(-1)


def validate(pred: Onset, out: torch.Tensor) -> dict:
    """Row-level confusion of ``pred`` against a model's output ``out`` [B, Sq, H, D]:
    tp/fp/fn/tn, precision, recall, agreement, and the predicted and measured bad-row,
    non-finite and NaN fractions (percentage points of error in ``*_err_pp``)."""
    meas = model_bad_rows(out).cpu()
    p = pred.bad
    tp = int((p & meas).sum())
    fp = int((p & ~meas).sum())
    fn = int((~p & meas).sum())
    tn = int((~p & ~meas).sum())
    n = tp + fp + fn + tn
    outf = out.float()
    meas_nonfinite = float((~torch.isfinite(outf)).sum()) / outf.numel()
    meas_nan = float(torch.isnan(outf).sum()) / outf.numel()
    res = {"rows": n, "tp": tp, "fp": fp, "fn": fn, "tn": tn,
           "precision": tp / (tp + fp) if tp + fp else math.nan,
           "recall": tp / (tp + fn) if tp + fn else math.nan,
           "agreement": (tp + tn) / n if n else math.nan,
           "pred_bad_row_frac": pred.bad_row_frac, "model_bad_row_frac": float(meas.float().mean()),
           "pred_nonfinite_frac": pred.nonfinite_frac, "model_nonfinite_frac": meas_nonfinite,
           "pred_nan_frac": pred.nan_frac, "model_nan_frac": meas_nan}
    res["bad_row_err_pp"] = 100 * abs(res["pred_bad_row_frac"] - res["model_bad_row_frac"])
    res["nonfinite_err_pp"] = 100 * abs(res["pred_nonfinite_frac"] - res["model_nonfinite_frac"])
    res["nan_err_pp"] = (100 * abs(res["pred_nan_frac"] - meas_nan)
                         if not math.isnan(res["pred_nan_frac"]) else math.nan)
    return res


# ---- validation over a grid ---------------------------------------------------------------

def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def validate_grid(*, dtype: str = "bf16", B: int = 1, S: int = 2048, H: int = 4, D: int = 128,
                  k_scales=(8, 16, 24, 32, 40, 48, 56, 64), thresholds=(2, 4, 6, 8, 10, 12),
                  policies=("lazy_unfixed", "lazy", "fa4_row", "lazy_capped", "eager"),
                  causal: bool = False, seed: int = 0, device="cpu", backend: str = "emulator",
                  levels=("tile", "exact"), exact_thresholds=None, exact_scores: bool = True,
                  chunk_rows: int = 1024, model: bool = True, on_k=None,
                  heads: int | None = None, progress: bool = False) -> pd.DataFrame:
    """The predictor against the model on a grid of the seed's inputs (``experiments.
    bf16_inputs`` / ``fp8_inputs``, as ``fa_lab.studies.sweep`` builds them): one row per (K scale,
    policy, threshold, level) with the row-level confusion and the predicted and measured
    fractions (``validate``), and the times: ``model_s`` (one model run), ``tiles_s`` (the
    score pass, shared by every cell of a K scale), ``predict_s`` (the walk and verdict,
    plus the replay at the exact level). A policy without a threshold (eager) runs once
    per K scale. ``exact_thresholds``: the thresholds at which the exact level runs
    (default: all). ``model=False``: the predictor alone (no confusion; the measured
    columns are NaN), for grids whose model runs are recorded elsewhere. ``on_k``: called
    with the table so far after each K scale (to save partial results). ``heads``: keep
    only batch 0's first ``heads`` heads of the full-size draw (a subsample: the same
    inputs those heads have in the whole tensor)."""
    from fa_lab import api
    from fa_lab.studies import experiments as ex
    from fa_lab import policies as pols

    rows = []
    cells = [(pol, thr) for pol in policies
             for thr in (thresholds if pols.get(pol).lazy else (None,))]
    total = len(k_scales) * len(cells)
    done = 0
    for K in k_scales:
        if dtype == "fp8":
            (q, k, v), (qd, kd, vd) = ex.fp8_inputs(B, S, H, K, seed=seed, device=device, D=D)
            desc = {"q_descale": qd, "k_descale": kd, "v_descale": vd}
        else:
            q, k, v = ex.bf16_inputs(B, S, H, D, K, seed=seed, device=device)
            desc = {}
        if heads is not None:
            q, k, v = (x[:1, :, :heads].contiguous() for x in (q, k, v))
        tiles = tile_maxima(q, k, v, causal=causal, exact_scores=exact_scores,
                            chunk_rows=chunk_rows, **desc)
        for pol, thr in cells:
            kw = {"causal": causal, "rescale": pol, "rescale_threshold": thr, **desc}
            out, model_s = None, math.nan
            if model:
                _sync(device)
                t0 = time.perf_counter()
                out = api.flash_attn_func(q, k, v, backend=backend, **kw)
                _sync(device)
                model_s = time.perf_counter() - t0
            for level in levels:
                if level == "exact" and exact_thresholds is not None and thr is not None \
                        and thr not in exact_thresholds:
                    continue
                pred = predict(q, k, v, level=level, tiles=tiles, chunk_rows=chunk_rows,
                               exact_scores=exact_scores, **kw)
                r = validate(pred, out) if out is not None else _unmeasured(pred)
                rows.append({"dtype": dtype, "B": B, "S": S, "H": H, "D": D, "causal": causal,
                             "heads_kept": heads,
                             "seed": seed, "k_scale": float(K), "policy": pol,
                             "threshold": math.nan if thr is None else float(thr),
                             "level": level, "backend": backend, **r,
                             "candidate_rows": pred.meta["candidate_rows"],
                             "model_s": model_s, "tiles_s": tiles.seconds,
                             "predict_s": pred.meta["walk_s"] + pred.meta["exact_s"]})
            del out
            done += 1
            if progress:
                print(f"\r{done}/{total} K={K} {pol} thr={thr}", end="", flush=True)
        del q, k, v, tiles
        if on_k is not None:
            on_k(pd.DataFrame(rows))
    if progress:
        print()
    return pd.DataFrame(rows)


def _unmeasured(pred: Onset) -> dict:
    nan = math.nan
    return {"rows": pred.rows, "tp": None, "fp": None, "fn": None, "tn": None,
            "precision": nan, "recall": nan, "agreement": nan,
            "pred_bad_row_frac": pred.bad_row_frac, "model_bad_row_frac": nan,
            "pred_nonfinite_frac": pred.nonfinite_frac, "model_nonfinite_frac": nan,
            "pred_nan_frac": pred.nan_frac, "model_nan_frac": nan, "bad_row_err_pp": nan,
            "nonfinite_err_pp": nan, "nan_err_pp": nan}


def worst_cell(table: pd.DataFrame, column: str = "bad_row_err_pp") -> dict:
    """The grid cell where the prediction misses by the most (ties: the first)."""
    i = table[column].astype(float).idxmax()
    return table.loc[i].to_dict()


# ---- the H200 runs (python -m fa_lab.studies.onset h200 --part ... --out DIR) ------------------------

#: The committed grids' axes (data/atlas/*.yaml).
BF16_SEED = {"B": 2, "S": 8192, "H": 32, "D": 128, "k_scales": tuple(range(8, 65, 4)),
             "thresholds": tuple(range(2, 13)),
             "policies": ("lazy_unfixed", "lazy", "fa4_row", "lazy_capped", "eager")}
FP8_SEED = {"B": 2, "S": 12288, "H": 8, "D": 128,
            "k_scales": (500, 1000, 2000, 5000, 10000, 20000), "thresholds": (2, 4, 6, 8, 10, 12),
            "policies": ("lazy_unfixed", "lazy_capped", "lazy", "eager")}


SCURVE = {"B": 2, "H": 32, "S": (512, 1024, 2048, 4096, 8192, 16384, 32768),
          "k_scales": (24, 28, 32, 36, 40)}
COST_S = (2048, 8192)


def _dump(df: pd.DataFrame, path, **extra) -> None:
    from fa_lab import results

    obj = {"rows": results._clean(df.to_dict("records")), **extra,
           "provenance": results.provenance(extra.get("device", "cpu"))}
    results.atomic_write_json(Path(path), obj)


def h200_run(part: str, out_dir, *, device="cuda", backend="triton", k_scales=None,
             thresholds=None) -> None:
    """One part of the full-size validation, written to ``out_dir/onset_<part>.json``
    after every K scale. ``bf16``: the committed bf16 grid, every cell, the model run
    beside the predictor (tile level everywhere, exact at thresholds 2, 8, 12). ``fp8``:
    the fp8 grid by the predictor, with model runs for lazy_unfixed and lazy_capped at
    threshold 8. ``scurve``: NaN onset over S at the seed's B, H, D for K 24..40 (the
    model beside the predictor). ``cost``: the emulator against the predictor, one cell.
    ``k_scales``: a subset of the grid's K scales (to finish a part that was cut short)."""
    from fa_lab import api
    from fa_lab.studies import experiments as ex

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    partial = k_scales is not None or thresholds is not None
    path = out_dir / f"onset_{part}{'_part' if partial else ''}.json"
    t0 = time.perf_counter()
    common = {"device": device, "backend": backend, "chunk_rows": 8192}
    if part == "bf16":
        g = dict(BF16_SEED, **({} if k_scales is None else {"k_scales": tuple(k_scales)}),
                 **({} if thresholds is None else {"thresholds": tuple(thresholds)}))
        validate_grid(**g, levels=("tile", "exact"), exact_thresholds=(2, 8, 12),
                      on_k=lambda df: _dump(df, path, part=part, wall_s=time.perf_counter() - t0,
                                            device=device), **common)
    elif part == "fp8":
        g = dict(FP8_SEED, **({} if k_scales is None else {"k_scales": tuple(k_scales)}))
        done = []  # the finished grids; on_k hands over the running grid's rows so far

        def save(df):
            _dump(pd.concat([*done, df], ignore_index=True), path, part=part,
                  wall_s=time.perf_counter() - t0, device=device)

        done.append(validate_grid(dtype="fp8", **g, levels=("tile",), model=False, on_k=save,
                                  **common))
        for pol in ("lazy_unfixed", "lazy_capped"):
            done.append(validate_grid(dtype="fp8", **{**g, "policies": (pol,), "thresholds": (8,)},
                                      levels=("tile", "exact"), on_k=save, **common))
    elif part == "scurve":
        tabs = []
        for S in SCURVE["S"]:
            tabs.append(validate_grid(B=SCURVE["B"], S=S, H=SCURVE["H"], D=128,
                                      k_scales=SCURVE["k_scales"] if k_scales is None
                                      else tuple(k_scales), thresholds=(8,),
                                      policies=("lazy_unfixed",), levels=("tile",), **common))
            _dump(pd.concat(tabs, ignore_index=True), path, part=part,
                  wall_s=time.perf_counter() - t0, device=device)
    elif part == "cost":
        rows = []
        for S in COST_S:
            q, k, v = ex.bf16_inputs(2, S, 32, 128, 32, device=device)
            kw = {"causal": False, "rescale": "lazy_unfixed", "rescale_threshold": 8.0}
            runs = {"emulator": (api.flash_attn_func, {"backend": "emulator"}),
                    backend: (api.flash_attn_func, {"backend": backend}),
                    "predict_tile": (predict, {"chunk_rows": 8192}),
                    "predict_exact": (predict, {"level": "exact", "chunk_rows": 8192})}
            for name, (fn, extra) in runs.items():
                fn(q, k, v, **kw, **extra)
                _sync(device)
                t1 = time.perf_counter()
                fn(q, k, v, **kw, **extra)
                _sync(device)
                rows.append({"S": S, "what": name, "seconds": time.perf_counter() - t1})
                _dump(pd.DataFrame(rows), path, part=part, device=device)
    else:
        raise ValueError(f"part={part!r}; choose bf16, fp8, scurve or cost")


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m fa_lab.studies.onset")
    sub = p.add_subparsers(dest="cmd", required=True)
    h = sub.add_parser("h200", help="the full-size validation parts (a CUDA machine)")
    h.add_argument("--part", action="append", required=True)
    h.add_argument("--out", required=True)
    h.add_argument("--device", default="cuda")
    h.add_argument("--backend", default="triton")
    h.add_argument("--k", type=float, action="append", help="K scales (default: the grid's)")
    h.add_argument("--thr", type=float, action="append", help="thresholds (default: the grid's)")
    args = p.parse_args(argv)
    for part in args.part:
        t0 = time.perf_counter()
        h200_run(part, args.out, device=args.device, backend=args.backend, k_scales=args.k,
                 thresholds=args.thr)
        print(f"{part}: {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
