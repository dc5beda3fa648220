"""The inputs of ``onset.edges``: ``Case`` (one input) and, per hazard, a builder of a
one-parameter family of inputs at its boundary from its mechanism (``BUILDERS``, by the
hazard's name; ``edges`` bisects each and runs the kernel at both ends), with the hazards
that have none (``SKIPPED``) and the tolerances other than the attack's (``TOLERANCE_FOR``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .bound import FORMATS, _drags, _fmt, bound


@dataclass
class Case:
    """One input: q, k, v, a bool mask [Sq, Skv] (True = visible) or None, seqlen_kv;
    ``kind``: "online" (fp32, log2-unit scores) or "swp" (bf16 or f16, q's type, for the
    DUALWAVE_SWP model);
    ``v_descale`` set: an fp8 call (q, k, v float8_e4m3fn, q and k descales 1), which runs
    the online model on fp8 inputs or, for a DUALWAVE_SWP policy, the fp8 kernel."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None = None
    seqlen_kv: int | None = None
    kind: str = "online"
    v_descale: float | None = None

    @property
    def dtype(self) -> str:
        if self.v_descale is not None:
            return "fp8"
        if self.kind == "online":
            return "fp32"
        return "f16" if self.q.dtype == torch.float16 else "bf16"

    def descales(self) -> dict:
        if self.v_descale is None:
            return {}
        return {"q_descale": 1.0, "k_descale": 1.0, "v_descale": float(self.v_descale)}


def _online_row(scores, values, mask=None, seqlen_kv=None):
    n = len(scores)
    q = torch.ones(1, 1, 1, 1)
    k = torch.tensor(scores, dtype=torch.float64).float().reshape(1, n, 1, 1)
    v = torch.tensor(values, dtype=torch.float64).float().reshape(1, n, 1, 1)
    m = None if mask is None else torch.tensor(mask, dtype=torch.bool).reshape(1, n)
    return Case(q, k, v, m, seqlen_kv)


def _online_wave(rows_scores, mask):
    """fp32 [1, 32, 1, 32] q and [1, n, 1, 32] k, v = 1 for the online model's 32-row
    wave: row r's log2-unit scores per key are ``rows_scores[r]`` (rows past the list score
    0; row r reads dimension r); ``mask`` [32, n] bool."""
    n = len(rows_scores[0])
    q, k = torch.zeros(1, 32, 1, 32), torch.zeros(1, n, 1, 32)
    for r in range(32):
        q[0, r, 0, r] = 1.0
    for r, sc in enumerate(rows_scores):
        k[0, :, 0, r] = torch.tensor(sc, dtype=torch.float64).float()
    return Case(q, k, torch.ones(1, n, 1, 32), torch.tensor(mask, dtype=torch.bool))


def _swp(rows_scores, values=1.0, mask=None):
    """bf16 [1, 32, 1, 64] q and [1, 64 T, 1, 64] k, v: row r's log2-unit scores per key are
    ``rows_scores[r]`` (rows past the list score 0; row r reads dimension r), V = ``values``
    (a number or a per-key list)."""
    from fa_lab.kernels.swp_bf16.model import softmax_scale_log2

    n = len(rows_scores[0])
    qs = float(torch.tensor(8.0 * softmax_scale_log2(64)).to(torch.bfloat16))
    q = torch.zeros(1, 32, 1, 64)
    k = torch.zeros(1, n, 1, 64)
    for r, sc in enumerate(rows_scores):
        q[0, r, 0, r] = 8.0
        k[0, :, 0, r] = torch.tensor(sc, dtype=torch.float64).float() / qs
    vv = torch.tensor(values, dtype=torch.float64).float()
    v = (vv.reshape(1, n, 1, 1) if vv.dim() else vv) * torch.ones(1, n, 1, 64)
    m = None if mask is None else torch.tensor(mask, dtype=torch.bool)
    return Case(q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16), m, None, "swp")


# -- the builders: (parameter name, case(t), t_lo (inside), t_hi (outside), classes, slack)

def _first_other(pol, bn):
    """(first visited tile's columns, the second visited tile's columns) of 2 tiles."""
    a, b = list(range(bn)), list(range(bn, 2 * bn))
    return (a, b) if pol.semantics.kv_order == "ascending" else (b, a)


def _overflow(pol, kind):
    if kind == "swp":
        if _drags(pol):
            from fa_lab.studies.experiments import drag_case

            capped = "rebase_bound" in pol.parameters
            # a capped fall stays below its bound; the trigger rises just past THR
            tiles, top, rise = (13, 15.9, 8.5) if capped else (8, 40.0, 10.0)

            def case(f):
                q, k, v = drag_case(n_tiles=tiles, rise=rise, fall=float(f), D=64)
                return Case(q, k, v, None, None, "swp")
            # the staircase's deficit grows with its fall (by at most the cap a tile): the
            # onset lies within twice (a capped rebase: 1.5 times) the formula's fall
            return ("the victim's fall per tile (log2)", case, 4.0, top, ("nonfinite",),
                    "x1.5" if capped else "x2")
        tau = float(pol.threshold) if pol.lazy else 0.0
        ex = min(tau, 4.0) - 1 / 64 if tau else 0.0
        # one key at the base and 768 at the stale excess in the lazy tiles; the last 3
        # tiles (eager: they rebase) masked, so n 2^ex is tight
        mask = [[j == 0 or 64 <= j < 832 for j in range(1024)]] * 32

        def case(vlog):
            return _swp([[0.0] * 64 + [ex] * 960], values=2.0 ** vlog, mask=mask)
        return "log2 max|V|", case, 100.0, 127.99, ("nonfinite",), 0.01 if ex else 0.0
    sem = pol.semantics
    bn = sem.block_n or 64
    tau = float(pol.threshold) if pol.lazy else 0.0
    fmax, _, unit = FORMATS[_fmt(pol, "fp32", "online")]
    room = math.log2(fmax) - float(pol.p_headroom)   # below the P cast's saturation
    ex = max(min(tau, 4.0, room) - 1 / 64, 0.0) if tau else 0.0
    if sem.p_before_vote or sem.kv_split is not None:
        ex = 0.0   # a kept jump (or a partial's own base) is its own hazard
    first, other = _first_other(pol, bn)
    full = sem.kv_split is not None   # equal partials: no base-2 merge gap

    def case(vlog):  # one key at the base, a tile at the stale excess
        scores, mask = [0.0] * (2 * bn), [False] * (2 * bn)
        for j in (first if full else first[:1]):
            mask[j] = True
        for j in other:
            scores[j], mask[j] = ex, True
        return _online_row(scores, [2.0 ** vlog] * (2 * bn), mask)
    # 1 + bn 2^ex keys against the formula's (1 + bn) 2^ex; each P's cast rounds
    slack = (0.03 if ex else 0.0) + (math.log2(1 + unit) if math.isfinite(fmax) else 0.0)
    if sem.kv_split is not None:
        slack = 1.01       # n counts both partials' keys; each overflows with its own
    return "log2 max|V|", case, 100.0, 127.99, ("nonfinite",), slack


#: log2 of the smallest fp32 output that the bf16 cast rounds to inf (2^128 - 2^119, the
#: midpoint above bf16's largest value).
BF16_INF_LOG2 = math.log2(2.0 ** 128 - 2.0 ** 119)


def _out_overflow(pol, kind):
    """The output's cast, driven by the only factor outside the accumulators: an fp8
    call's ``v_descale`` (O = sum P v stays at the keys' V while the epilogue multiplies
    by v_descale). Every key scores 0 and reads V = 1, so ``out = v_descale`` exactly; the
    region's (1 + u_P) allows for a P cast rounding up, which these P (2^H, exact) do
    not, so the failure (bf16 inf) lies past the edge by at most log2(1 + u_P) plus the gap
    from bf16's largest value to its rounding midpoint. In a bf16 or fp32 call
    (``v_descale`` 1) the output cannot overflow before O does: out = O / l with
    l >= 2^H >= 1 (``test_onset_bound_edges`` shows this margin dominance)."""
    fp8 = torch.float8_e4m3fn
    if kind == "swp":
        def case(t):
            q = torch.zeros(1, 32, 1, 128).to(fp8)
            k = torch.zeros(1, 128, 1, 128).to(fp8)
            v = torch.ones(1, 128, 1, 128).to(fp8)
            return Case(q, k, v, None, None, "swp", 2.0 ** t)
        unit = FORMATS["e4m3"][2]
    else:
        sem = pol.semantics
        # one visible key; a split: one in each of two partials (no empty partial, no
        # base-2 gap), whose merge sums both outputs before dividing
        split = sem.kv_split
        bn = sem.block_n or 64
        n = 2 * split * bn if split else 1
        mask = None if not split else torch.tensor([[j in (0, split * bn) for j in range(n)]])

        def case(t):
            return Case(torch.ones(1, 1, 1, 1).to(fp8), torch.zeros(1, n, 1, 1).to(fp8),
                        torch.ones(1, n, 1, 1).to(fp8), mask, None, "online", 2.0 ** t)
        unit = FORMATS[_fmt(pol, "fp8", "online")][2]
    top = math.log2(FORMATS["bf16"][0])
    slack = math.log2(1 + unit) + (BF16_INF_LOG2 - top) + 1e-4
    return "log2 v_descale", case, 120.0, BF16_INF_LOG2 + 1e-3, ("nonfinite",), slack


#: log2 of the smallest fp32 P that an f16 pack rounds to inf (65520, the midpoint above
#: f16's largest value 65504; the tie goes to the even inf).
F16_INF_LOG2 = math.log2(65520.0)


def _swp_fine(rows_scores, dtype):
    """16-bit [1, 32, 1, 64] q and [1, n, 1, 64] k, v = 1 for DUALWAVE_SWP: row r reads
    dimensions r and r + 32, each with Q = 8, so its score per key is round(8 c) (k_a + k_b)
    summed exactly: k_a carries ``rows_scores[r]`` at the format's precision and k_b the
    rest, which puts a score on fp32's grid (one 16-bit K is 2^-11 coarse)."""
    from fa_lab.kernels.swp_bf16.model import softmax_scale_log2

    n = len(rows_scores[0])
    qs = float(torch.tensor(8.0 * softmax_scale_log2(64)).to(dtype))
    q, k = torch.zeros(1, 32, 1, 64), torch.zeros(1, n, 1, 64)
    for r, sc in enumerate(rows_scores):
        want = torch.tensor(sc, dtype=torch.float64) / qs
        a = want.to(dtype).double()
        b = (want - a).to(dtype).double()
        q[0, r, 0, r] = q[0, r, 0, r + 32] = 8.0
        k[0, :, 0, r], k[0, :, 0, r + 32] = a.float(), b.float()
    return Case(q.to(dtype), k.to(dtype), torch.ones(1, n, 1, 64, dtype=dtype), None, None,
                "swp")


def _carried_saturation(pol):
    """DUALWAVE_SWP carries the second part of the previous tile's P pack (columns 16-63)
    across the loop's decision and scales it by the correction: under a drag (row 0 jumps
    by 10 at tile 1 and fires the wave) the victim, row 1, is rebased from its tile 0 max
    (0) down to its tile 1 max (-t), and its carried P = 1 becomes round(2^t). An f16 pack
    passes 65504 at t = log2 65504 (the formula's edge; a capped rebase drops 16 in one
    step, past it) and rounds to inf from log2 65520 on: the row's O, hence its output, is
    inf. Five tiles: the decision runs on loop tiles 1 .. N - 4 only. A bf16 pack would need
    t > 127.99, which no input inside the region reaches: a deficit needs two visible keys,
    and the accumulator bound H + R + log2 n < 128 then keeps R below 127
    (``test_onset_bound_edges`` checks this dominance)."""
    def case(t):
        trigger = [0.0] * 64 + [10.0] * 256
        victim = [0.0] * 64 + [-float(t)] * 256
        return _swp_fine([trigger, victim], torch.float16)
    # the edge (65504) and the first inf (65520) lie 2^-11 apart: the failure is checked
    # between 65520 and 65536, where a capped rebase still moves
    return ("the victim's drag (log2)", case, 8.0, 17.0, ("nonfinite",),
            f"={math.log2(65528.0)!r}")


def _saturation(pol, kind):
    if kind == "swp":
        if _drags(pol):
            return _carried_saturation(pol)
        return "a DUALWAVE_SWP P saturates only under a drag"
    bn = pol.semantics.block_n or 64
    first, other = _first_other(pol, bn)

    def case(d):
        scores, mask, vals = [0.0] * (2 * bn), [False] * (2 * bn), [0.0] * (2 * bn)
        mask[first[0]] = mask[other[0]] = True
        scores[other[0]], vals[other[0]] = d, 1.0
        return _online_row(scores, vals, mask)
    tau = float(pol.threshold) if pol.lazy else 0.0
    return "the second tile's jump (log2)", case, 0.0, max(tau, 1.0), ("saturation",), 0.0


def _hollow(pol, kind):
    if kind == "swp":
        def case(L):
            L = int(round(L))
            mask = torch.ones(32, 256, dtype=torch.bool)
            mask[:, :L] = False
            return _swp([[1.0] * 256], mask=mask.tolist())
        return "masked keys before the first visible one", case, 0.0, 128.0, ("nonfinite",), 0.0
    sem = pol.semantics
    bn = sem.block_n or 64
    n = 2 * bn

    def case(L):
        L = int(round(L))
        mask = [True] * n
        for j in (range(L) if sem.kv_order == "ascending" else range(n - L, n)):
            mask[j] = False
        return _online_row([1.0] * n, [1.0] * n, mask)
    return ("masked keys before the first visible one", case, 0.0, float(bn),
            ("nonfinite", "nan_factor"), 0.0)


def _empty(pol, kind):
    """The row's keys masked from the end of its walk: its first visited key goes last."""
    if kind == "swp" and _drags(pol) and "rebase_bound" not in pol.parameters:
        def case(t):  # one key per tile (a drag finds no all-masked tile), or none
            mask = torch.ones(32, 256, dtype=torch.bool)
            mask[0] = False
            if t < 0.5:
                mask[0, ::64] = True
            return _swp([[1.0] * 256], mask=mask.tolist())
        return "row 0 sees one key a tile (0) or none (1)", case, 0.0, 1.0, ("empty",), 0.0
    if kind == "swp":
        def case(L):
            mask = torch.ones(32, 256, dtype=torch.bool)
            mask[0, 256 - int(round(L)):] = False
            return _swp([[1.0] * 256], mask=mask.tolist())
        return "masked keys of row 0", case, 0.0, 256.0, ("empty",), 0.0
    sem = pol.semantics
    bn = sem.block_n or 64
    # one tile where a later all-masked tile (a drag) or an empty partial is its own
    # hazard; two where a split's merge of empty partials is what this hazard is about
    region = bound(pol, dtype="fp32")
    partial_live = any(h.name == "an empty partial poisons the merge" and not h.never
                       for h in region.hazards)
    one = _drags(pol) or (sem.kv_split is not None and partial_live)
    n = bn if one else 2 * bn
    asc = sem.kv_order == "ascending"

    def case(L):
        L = int(round(L))
        return _online_row([1.0] * n, [1.0] * n,
                           [(j < n - L) if asc else (j >= L) for j in range(n)])
    return "masked keys of the row", case, 0.0, float(n), ("empty",), 0.0


def _partial(pol, kind):
    bn = pol.semantics.block_n or 64
    n = 2 * bn

    def case(L):  # the second partial's keys masked from its end, its mass kept at 2 bn
        L = int(round(L))
        lift = 1.0 + math.log2(bn / max(bn - L, 1))
        return _online_row([1.0] * bn + [lift] * bn, [1.0] * n, [j < n - L for j in range(n)])
    return "masked keys of the last partial", case, 0.0, float(bn), ("nonfinite",), 0.0


def _drag_hollow(pol, kind):
    if kind != "swp":
        # the same wave on the online model: tiles of block_n keys; the trigger's jump
        # passes THR (the wave fires) but keeps its P within the format (no saturation)
        bn = pol.semantics.block_n or 64
        tau = float(pol.threshold)
        room = math.log2(FORMATS[_fmt(pol, "fp32", "online")][0]) - float(pol.p_headroom)
        jump = (tau + min(room, tau + 1.0)) / 2
        trigger = [0.0] * (2 * bn) + [jump] * (4 * bn)
        victim = [1.0] * (6 * bn)

        def case(L):  # each row sees one key a tile (few keys: no flushed mass), the
            L = int(round(L))   # victim its third tile's keys up to L from its end
            mask = torch.zeros(32, 6 * bn, dtype=torch.bool)
            mask[:, ::bn] = True
            mask[1, 2 * bn:3 * bn] = False
            mask[1, 2 * bn:3 * bn - L] = True
            return _online_wave([trigger, victim], mask.tolist())
        return "masked keys of the victim's third tile", case, 0.0, float(bn), (
            "nonfinite", "nan_factor"), 0.0
    # row 0 (the trigger) jumps by 20 at tile 2 and fires the wave; row 1 (the victim) sees
    # keys of tile 0 only: the masked keys of its tile 2 run from its end
    trigger = [0.0] * 128 + [20.0] * 64 + [20.0] * 192
    victim = [1.0] * 384

    def case(L):
        L = int(round(L))
        mask = torch.ones(32, 384, dtype=torch.bool)
        mask[1, 192 - L:192] = False
        return _swp([trigger, victim], mask=mask.tolist())
    return "masked keys of the victim's third tile", case, 0.0, 64.0, ("nonfinite",), 0.0


def _tail(pol, kind):
    bn = pol.semantics.block_n or 64

    def case(t):  # the valid keys end t keys before the second tile's end
        used = 2 * bn - int(round(t))
        vals = [1.0] * used + [math.nan] * (2 * bn - used)
        return _online_row([1.0] * (2 * bn), vals, seqlen_kv=used)
    return "keys of the last tile past seqlen_kv", case, 0.0, 1.0, ("nonfinite",), 0.0


def _mass(pol, kind):
    """V's scale: the max key (v = 0) and one key per later tile at -3 (v = 2^t): each
    tile's PV is 2^(t - 3), lost below 2^-150, and 8 tiles carry half the output. Where
    no tile's PV can be lost alone (bf16 V stops at 2^-133, where the PV sums are exact in
    fp32; a split normalises each partial) the output's own cast is what fails: two keys
    of equal weight with V = 2^t and 0 give 2^(t - 1), which the output's format rounds
    (a tie to even) to 0 once 2^t is its smallest subnormal."""
    sem = pol.semantics
    if kind == "swp":
        def case(t):  # 64 keys of one tile, V alternating 2^t and 0
            return _swp([[0.0] * 64], values=[2.0 ** t if j % 2 == 0 else 0.0
                                              for j in range(64)])
        return "log2 max|V|", case, -120.0, -133.0, ("silent",), "=-133"
    if sem.kv_split is not None:
        bn = sem.block_n or 64
        n = 2 * sem.kv_split * bn
        at = (0, sem.kv_split * bn)   # the first key of each partial

        def case(t):
            vals = [0.0] * n
            vals[at[0]] = 2.0 ** t
            return _online_row([0.0] * n, vals, [j in at for j in range(n)])
        return "log2 max|V|", case, -130.0, -149.0, ("silent",), "=-149"
    bn = sem.block_n or 64
    T = 9
    first = 0 if sem.kv_order == "ascending" else T - 1

    def case(t):
        scores, mask, vals = [0.0] * (T * bn), [False] * (T * bn), [0.0] * (T * bn)
        for i in range(T):
            j = i * bn
            mask[j] = True
            if i != first:
                scores[j], vals[j] = -3.0, 2.0 ** t
        return _online_row(scores, vals, mask)
    # fp32 V stops at 2^-149, where the tiles' PV (and, past a headroom, the output's
    # own rounding) is lost: the failure is checked there
    return "log2 max|V|", case, -130.0, -149.0, ("silent",), "=-149"


def _late_lift(pol, kind):
    def case(L):  # one visible key at 0 and a masked key L above it
        return _online_row([0.0, float(L)], [1.0, 0.0], [True, False])
    return "the masked key's lift (log2)", case, 100.0, 140.0, ("nonfinite", "silent",
                                                                "empty"), 0.0


def _late_nan(pol, kind):
    def case(t):
        return _online_row([0.0, math.nan if t >= 0.5 else 1.0], [1.0, 1.0], [True, False])
    return "the masked key is NaN", case, 0.0, 1.0, ("nonfinite",), 0.0


def _softcap(pol, kind):
    def case(s):
        return _online_row([s], [1.0])
    cap = pol.semantics.softcap
    return "the key's score (log2 units)", case, 50.0, 100.0 * cap / math.log(2), (
        "nonfinite",), 0.0


def _kept_jump(pol, kind):
    bn = pol.semantics.block_n or 64
    first, other = _first_other(pol, bn)

    def case(d):
        scores, mask, vals = [0.0] * (2 * bn), [False] * (2 * bn), [0.0] * (2 * bn)
        mask[first[0]] = mask[other[0]] = True
        vals[first[0]] = -1.0
        scores[other[0]], vals[other[0]] = d, 1.0
        return _online_row(scores, vals, mask)
    return "the kept jump (log2)", case, 0.0, 3.0, ("silent",), 1.0


def _base2(pol, kind):
    bn = pol.semantics.block_n or 64

    def case(d):  # partials of one key each, masses 1 and 2^d, values -1 and 1
        scores, mask, vals = [0.0] * (2 * bn), [False] * (2 * bn), [0.0] * (2 * bn)
        mask[0] = mask[bn] = True
        vals[0], scores[bn], vals[bn] = -1.0, d, 1.0
        return _online_row(scores, vals, mask)
    return "the partials' mass gap (log2)", case, 0.0, 8.0, ("silent",), 0.7


def _v_inf(pol, kind):
    def case(t):  # one of two keys' V is 1 or inf; the row sees only the other
        vals = [1.0, math.inf if t >= 0.5 else 1.0]
        if kind == "swp":
            mask = torch.ones(32, 256, dtype=torch.bool)
            mask[:, 255] = False
            return _swp([[1.0] * 256], values=[1.0] * 255 + vals[1:], mask=mask.tolist())
        return _online_row([0.0, 0.0], vals, [True, False])
    return "the masked key's V is inf", case, 0.0, 1.0, ("nonfinite",), 0.0


def _sentinel(pol, kind):
    sem = pol.semantics
    _, flush, unit = FORMATS[_fmt(pol, "fp32", "online")]
    H = float(pol.p_headroom)
    n = sem.block_n or 64
    sig = sem.m_init if math.isfinite(sem.m_init) else sem.mask_value
    if abs(sig) > 2.0 ** 40:
        return (f"a sentinel at {sig:g}: no fp32 score lies within the hazard's 160 binades of "
                "it but on a grid coarser than the edge")
    # raw-domain sentinels: c = 1 here (log2-unit scores), so raw and scaled agree
    if math.isfinite(sem.m_init):
        def case(d):
            return _online_row([sig - d] + [sig + flush - H - 0.01] * (n - 1),
                               [0.0] + [1.0] * (n - 1))
        return "sigma_init - s_max (log2)", case, 0.0, 160.0, ("silent", "empty",
                                                                "nonfinite"), 2.0

    def case(d):
        return _online_row([sig + d] + [0.0] * (n - 1), [1.0] + [-1.0] * (n - 1),
                           [True] + [False] * (n - 1))
    return "s_max - sigma_mask (log2)", case, 40.0, 0.0, ("silent",), 1.0


def _fixed_over(pol, kind):
    """One key at score t against the fixed max F: its P = 2^(t - F + H) overflows."""
    F, H = float(pol.semantics.fixed_max), float(pol.p_headroom)

    def case(t):
        return _online_row([F - H + t], [1.0])
    return "s - F + H (log2)", case, 120.0, 130.0, ("nonfinite",), 0.0


def _fixed_under(pol, kind):
    """One key at score t against the fixed max F: its P = 2^(t - F + H) flushes to 0 and
    the row is silently zero."""
    F, H = float(pol.semantics.fixed_max), float(pol.p_headroom)

    def case(t):
        return _online_row([F - H + t], [1.0])
    return "s - F + H (log2)", case, -120.0, -140.0, ("silent", "empty", "nonfinite"), 0.0


#: The builders, by hazard name (``bound``'s); a builder returns a str (why) where it has no
#: input for that policy's kernel.
BUILDERS = {
    "accumulator overflow": _overflow, "P saturation": _saturation,
    "NaN from a first tile with nothing visible": _hollow,
    "NaN factor through the O vote": _hollow,
    "a row that sees nothing gives 0": _empty, "an empty partial poisons the merge": _partial,
    "drag onto a tile with nothing visible": _drag_hollow, "V cache tail": _tail,
    "silent mass loss (rounding and flushed tails)": _mass,
    "late mask lifts the max": _late_lift, "late mask over a non-finite score": _late_nan,
    "softcap's exp ratio overflows": _softcap, "P before the vote drops a kept jump": _kept_jump,
    "base-2 LSE merged as natural": _base2, "finite sentinel": _sentinel,
    "non-finite V": _v_inf, "output overflow": _out_overflow,
    "overflow at the fixed max": _fixed_over, "underflow at the fixed max": _fixed_under,
}

#: A tolerance other than the attack's 0.25 where a hazard's failure stays below it: two
#: partials' base-2 merge moves the output by at most ~0.15 of max|V|.
TOLERANCE_FOR = {"base-2 LSE merged as natural": 0.1}

#: Hazards with no builder here, and why (the edge test fails on a live hazard in neither).
SKIPPED = {
    "exp floor keeps masked and flushed weight": "the floor is 2^-127.7: the margin needs "
                                                 "2^124 keys",
    "fp8 addend loses the row max": "sufficient at 448^2 D per score: unreachable with fp8 "
                                    "inputs at a descale near 1",
    "fp8 causal floor overflows": "boundcheck.fp8_floor_sweep",
}
