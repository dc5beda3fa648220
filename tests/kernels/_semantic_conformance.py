"""The conformance check of the ``Semantics`` fields that take a fixed set of values
(``fa_lab.values.DECLARED``, every field but ``vote`` and ``rebase``): each value of each
such field an implementation's ``Caps.semantics`` claims, run against an fp64 reference.

``claims(families)`` enumerates them: an implementation that runs a field claims every
value declared for it, so a newly declared value is picked up (and fails until its
implementation and its reference rule exist). ``CASES`` holds, per field, one small input
on which the field's values give different outputs (``test_conformance`` checks that
they do on the reference); a field without a case fails its claims, naming the field.

The reference (``reference``) is an online softmax in fp64 with fp32's exponent range,
per 64-column tile, whose every decision reads a table of this module (one rule per
declared value, written from ``docs/semantics.md`` §10 and ``fa_lab.semantics``'s field
list, not from the model's code): a value without a rule fails, naming it. Where a field
defines an fp32 computation (``q_prescale``'s rounding of q * c, the forms of
``softcap``'s tanh) the reference does those operations in fp32, as declared.

The ``Semantics`` fields that take a number (``NUMERIC_FIELDS``: every field without a
fixed set of values) are claims too: an implementation that runs one claims it at the
value ``NUMERIC`` gives it, on a case where that value and the field's default give
different reference outputs (``test_conformance`` checks that they do), so an
implementation that ignores the field fails, naming the family and the field. A numeric
field without a value in ``NUMERIC`` fails its claim, naming it.

Each claim runs the implementation's own entry point (``forward`` of the family's
implementation module, which takes ``seqlen_kv`` for ``v_tail``'s cache tail) with a policy
whose semantics set the claimed value over the case's base semantics.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from dataclasses import dataclass, field

import torch

from fa_lab import values
from fa_lab.kernels import FAMILIES, module
from fa_lab.policies import Policy
from fa_lab.semantics import Semantics

#: The Semantics fields that take a fixed set of values.
FIELDS = tuple(f for f in values.DECLARED if f not in values.POLICY_FIELDS)
#: The Semantics fields that take a number.
NUMERIC_FIELDS = tuple(f.name for f in dataclasses.fields(Semantics) if f.name not in values.DECLARED)
#: numeric field -> the value its claim runs (its case, in ``_cases``, tells it from the
#: default).
NUMERIC = {"mask_value": -10.0, "m_init": -5.0, "floor_value": -100.0, "block_n": 32,
           "fixed_max": 100.0, "l_floor": 1.0e4, "softcap": 1.0, "exp_floor": -2.0,
           "kv_split": 2}
BN = 64  # columns per step (block_n None)
LOG2E, LN2 = math.log2(math.e), math.log(2.0)
FLT_MAX = float(torch.finfo(torch.float32).max)


def _f32(x):
    """fp32 rounding, of a tensor or a Python float."""
    if isinstance(x, torch.Tensor):
        return x.float().double()
    return float(torch.tensor(x, dtype=torch.float32))


def _fit(x: torch.Tensor) -> torch.Tensor:
    """fp32's exponent range on fp64 values: overflow to inf, flush below the denormals."""
    x = torch.where(x.abs() > FLT_MAX, x.sign() * math.inf, x)
    return torch.where(x.abs() < 2.0 ** -149, torch.zeros_like(x), x)


@dataclass
class Call:
    """One call of a case: q [1, Sq, 1, D], k and v [1, Skv, 1, D]; ``bias`` [Sq, Skv]
    (natural-log units, -inf masks); ``seqlen_kv``: the valid keys (the rest a cache tail)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    causal: bool = False
    bias: torch.Tensor | None = None
    seqlen_kv: int | None = None


@dataclass
class Case:
    """A field's input: the policy's vote and rebase fields (``policy``), the semantics
    the claimed value is set over (``sem``) and one or more calls."""

    calls: list
    policy: dict = field(default_factory=lambda: {"vote": "tile", "rebase": "max"})
    sem: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------
# The reference's rules, one per declared value


def _rule(name: str, value, table: dict):
    if value not in table or type(value) is not type(next(iter(table))):
        raise AssertionError(f"the fp64 reference has no rule for {name}={value!r}: define it "
                             "in tests/kernels/_semantic_conformance.py before claiming it")
    return table[value]


def _waves(flags: torch.Tensor, W: int) -> torch.Tensor:
    R = flags.shape[-1]
    return flags.reshape(R // W, W).any(-1, keepdim=True).expand(R // W, W).reshape(R)


def _cast(fmt: str, sat: bool):
    """P rounded to ``fmt``: clamped to its largest finite value under ``sat``, else past
    it inf (bf16, f16, e5m2) or NaN (e4m3, which has no inf)."""
    if fmt == "none":
        return lambda p: p
    top, over, dt = {"bf16": (3.3895313892515355e38, math.inf, torch.bfloat16),
                     "f16": (65504.0, math.inf, torch.float16),
                     "e4m3": (448.0, math.nan, torch.float8_e4m3fn),
                     "e5m2": (57344.0, math.inf, torch.float8_e5m2)}[fmt]
    edge = {"bf16": 2.0 ** 128 * (1 - 2.0 ** -9), "f16": 65520.0, "e4m3": 464.0,
            "e5m2": 61440.0}[fmt]

    def cast(p):
        y = p.float().clamp(-top, top).to(dt).double()  # NaN passes a clamp
        if sat:
            return y
        return torch.where(p.abs() >= edge, torch.full_like(p, over) * p.sign(), y)
    return cast


def _tanh_forms(cap: float):
    def exact(t):
        return _f32(torch.tanh(_f32(t / cap)))

    def ratio(t):
        u = (t.float() / _f32(cap))
        e, ei = torch.exp(u), torch.exp(-u)
        return ((e - ei) / (e + ei)).double()

    def ssum(t):
        u = (t.float() / _f32(cap))
        return (1.0 - 2.0 / (torch.exp(2.0 * u) + 1.0)).double()
    return {"tanh": exact, "exp_ratio": ratio, "exp_sum": ssum}


RULES = {
    "wave_rows": {16: 16, 32: 32, 64: 64},
    "o_gate": {"always": lambda f, W: f,
               "row": lambda f, W: torch.where(f < 1, f, torch.ones_like(f)),
               "wave": lambda f, W: torch.where(_waves(f < 1, W), f, torch.ones_like(f))},
    "mask_domain": {"scaled": lambda x, c: x, "raw": lambda x, c: _f32(x * c)},
    "tile_max_floor": {"never": lambda causal: False, "causal": lambda causal: causal,
                       "always": lambda causal: True},
    "empty_row_guard": {"none": (False, False), "zero_base": (True, False),
                        "skip": (False, True)},
    "epilogue_guard": {
        "zero": lambda l: torch.where(l > 0, 1.0 / l, torch.zeros_like(l)),
        "one": lambda l: torch.where((l == 0) | l.isnan(), torch.ones_like(l), 1.0 / l),
        "none": lambda l: 1.0 / l},
    "clamp_exp_diff": {False: lambda d: d,
                       True: lambda d: torch.where(d.isnan(), torch.full_like(d, -math.inf), d)},
    "p_cast": {"input": None, "none": "none", "bf16": "bf16", "f16": "f16", "e4m3": "e4m3",
               "e5m2": "e5m2"},
    "p_saturate": {False: False, True: True},
    "max_lag": {False: False, True: True},
    "kv_order": {"ascending": lambda T: list(range(T)),
                 "descending": lambda T: list(range(T))[::-1]},
    "l_sums_cast": {False: False, True: True},
    "q_prescale": {False: False, True: True},
    "ftz": {False: lambda p: p,
            True: lambda p: torch.where(p.abs() < 2.0 ** -126, torch.zeros_like(p), p)},
    "softcap_form": {"tanh": "tanh", "exp_ratio": "exp_ratio", "exp_sum": "exp_sum"},
    "mask_stage": {"scores": False, "p": True},
    "p_before_vote": {False: False, True: True},
    "merge_empty": {"empty": True, "nan": False},
    "lse_base": {"e": 1.0, "2": LOG2E},
    "v_tail": {"zero": True, "cache": False},
}
#: vote -> (m, mt, policy, W) -> moving rows; rebase -> (m, mt, policy) -> (target, ok).
VOTES = {"tile": lambda m, mt, p, W: torch.ones_like(m, dtype=torch.bool),
         "wave": lambda m, mt, p, W: _waves(~(mt - m <= p.threshold), W),
         "row": lambda m, mt, p, W: ~(mt - m <= p.threshold)}
REBASES = {"max": lambda m, mt, p: (torch.fmax(m, mt), torch.ones_like(m, dtype=torch.bool)),
           "tile": lambda m, mt, p: (mt, torch.ones_like(m, dtype=torch.bool)),
           "capped": lambda m, mt, p: (torch.where(mt - m >= -p.rebase_bound, mt, m),
                                       mt - m >= -p.rebase_bound)}


def reference(call: Call, policy: Policy) -> torch.Tensor:
    """out [Sq, D] fp64 of ``call`` under ``policy`` and its semantics (module docstring)."""
    sem = policy.semantics
    r = {f: _rule(f, getattr(sem, f), RULES[f]) for f in FIELDS}
    q, k, v = (t[0, :, 0].double() for t in (call.q, call.k, call.v))
    R, C, D = q.shape[0], k.shape[0], q.shape[1]
    W = r["wave_rows"]
    bn = sem.block_n or BN
    assert R % max(W, 32) == 0 and C % bn == 0, "a case's rows fill whole waves, its keys tiles"
    fmt_in = {torch.bfloat16: "bf16", torch.float16: "f16"}[call.q.dtype]
    c = _f32(_f32(1.0 / math.sqrt(D)) * _f32(LOG2E))
    nat = _f32(1.0 / math.sqrt(D))
    if r["q_prescale"]:
        x = _f32(_cast(fmt_in, True)(_f32(q * c)) @ k.T)
    elif sem.softcap:
        t = _f32(_f32(q @ k.T) * nat)
        capped = _f32(_tanh_forms(sem.softcap)[r["softcap_form"]](t) * _f32(sem.softcap))
        x = _f32(capped * _f32(LOG2E))
    else:
        x = _f32(_f32(q @ k.T) * c)
    lens = C if call.seqlen_kv is None else call.seqlen_kv
    cols = torch.arange(C)
    vis = (cols < lens)[None, :].expand(R, C)
    if call.causal:
        vis = vis & (cols[None, :] <= torch.arange(R)[:, None] + (lens - R))
    if call.bias is not None:
        vis = vis & (call.bias != -math.inf)
        x = x + torch.where(call.bias == -math.inf, 0.0, call.bias.double()) * _f32(LOG2E)
    mask_s = r["mask_domain"](sem.mask_value, c)
    init_s = r["mask_domain"](sem.m_init, c)
    if not r["mask_stage"]:
        x = torch.where(vis, x, torch.full_like(x, mask_s))
    vv = torch.where((cols >= lens)[:, None], 0.0, v) if r["v_tail"] else v
    zero_base, skip_empty = r["empty_row_guard"]
    floored = r["tile_max_floor"](call.causal)
    fmt = fmt_in if r["p_cast"] is None else r["p_cast"]
    cast = _cast(fmt, r["p_saturate"])
    H = float(policy.p_headroom)

    def empty(t):
        return (t == -math.inf) | (t == mask_s) | (t == init_s)

    def base(t):
        return torch.where(empty(t), torch.zeros_like(t), t) if zero_base else t

    def ex2(t):  # exp_floor: every argument floored first (maxNum: NaN gives the floor)
        t = t if sem.exp_floor is None else torch.fmax(t, torch.full_like(t, sem.exp_floor))
        return r["ftz"](_fit(torch.exp2(t)))

    def finish(m, l, O):  # l_floor: the divisor floored (NaN-propagating) before the guard
        div = torch.maximum(l, torch.full_like(l, sem.l_floor)) if sem.l_floor else l
        out = O * r["epilogue_guard"](div)[:, None]
        lse = m * LN2 + torch.log(l) - H * LN2
        return out, torch.where(l == 0, torch.full_like(l, -math.inf), lse)

    T = -(-lens // bn) or 1
    fixed = sem.fixed_max is not None  # the max pinned: no vote, no move, f = 1
    m0 = torch.full((R,), _f32(sem.fixed_max) if fixed else init_s, dtype=torch.float64)
    m, l, O = m0.clone(), torch.zeros(R, dtype=torch.float64), torch.zeros(R, D, dtype=torch.float64)
    partials = []
    for s, tile in enumerate(r["kv_order"](T)):
        if sem.kv_split is not None and s and s % sem.kv_split == 0:
            partials.append(finish(m, l, O))
            m, l, O = m0.clone(), torch.zeros_like(l), torch.zeros_like(O)
        sl = slice(tile * bn, tile * bn + bn)
        xt = x[:, sl]
        mt = xt.amax(-1)
        if floored:
            mt = torch.fmax(mt, torch.full_like(mt, sem.floor_value))
        move = _rule("vote", policy.vote, VOTES)(m, mt, policy, W)
        target, ok = _rule("rebase", policy.rebase, REBASES)(m, mt, policy)
        move = move & ok & (not fixed)
        m_new = torch.where(move, target, m)
        skip = empty(m_new) & skip_empty
        m_new, move = torch.where(skip, m, m_new), move & ~skip
        f = torch.where(move, ex2(r["clamp_exp_diff"](m - base(m_new))), torch.ones_like(m))
        lag = ~empty(m) & r["max_lag"]
        p_base = torch.where(lag, base(m), base(m_new))
        if r["p_before_vote"]:
            p_base = base(torch.fmax(m, mt))
        P = ex2(r["clamp_exp_diff"](xt - p_base[:, None]) + H)
        if r["mask_stage"]:
            P = P * vis[:, sl]
        P = P.masked_fill(skip[:, None], 0.0)
        cp = cast(P)
        pv = _fit(cp @ vv[sl]).masked_fill(skip[:, None], 0.0)
        psum = _fit((cp if r["l_sums_cast"] else P).sum(-1))
        g = r["o_gate"](f, W)
        O = torch.where(lag[:, None], _fit((O + pv) * g[:, None]), _fit(O * g[:, None] + pv))
        l = torch.where(lag, _fit((l + psum) * f), _fit(l * f + psum))
        m = m_new
    partials.append(finish(m, l, O))
    if len(partials) == 1:
        return partials[0][0]
    L = torch.stack([p[1] for p in partials]) * r["lse_base"]
    top = L.amax(0)
    shift = torch.where(top == -math.inf, 0.0, top) if r["merge_empty"] else top
    w = torch.exp(L - shift)
    total = w.sum(0)
    out = sum(w[i][:, None] * p[0] for i, p in enumerate(partials)) / total[:, None]
    if r["merge_empty"]:
        out = torch.where((total == 0)[:, None], 0.0, out)
    return out


# ---------------------------------------------------------------------------------------
# The cases: per field, an input on which its values differ


def _inputs(dtype, D, rows, cols, targets=None, seg=128):
    """q, k, v whose score (log2 units) is ``targets[row] = (first, second)`` over columns
    [0, seg) and [seg, cols) (0 elsewhere); v is near 2.25 over the first segment and near
    0.75 over the second, so the segments' weights show in the output."""
    c = (1.0 / math.sqrt(D)) * LOG2E
    a = 16.0
    q = torch.zeros(1, rows, 1, D, dtype=torch.float64)
    for row, (s1, s2) in (targets or {}).items():
        q[0, row, 0, 0], q[0, row, 0, 1] = s1 / (a * c), s2 / (a * c)
    k = torch.zeros(1, cols, 1, D, dtype=torch.float64)
    k[0, :seg, 0, 0] = a
    k[0, seg:, 0, 1] = a
    g = torch.Generator().manual_seed(11)
    v = 0.5 * torch.rand(1, cols, 1, D, generator=g, dtype=torch.float64)
    v[0, :seg] += 2.0
    v[0, seg:] += 0.5
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _masked(rows, cols, where):
    """A bias [rows, cols]: 0, and -inf on each (row, column slice) of ``where``."""
    b = torch.zeros(rows, cols)
    for row, sl in where:
        b[row, sl] = -math.inf
    return b


LAZY = {"vote": "wave", "rebase": "max", "threshold": 200.0}


def _first_tile_empty(dt, D):
    """Row 0 and rows 32-63 see no key in the first tile: its max stays -inf."""
    bias = _masked(64, 256, [(0, slice(0, 64)), (slice(32, 64), slice(0, 64))])
    return [Call(*_inputs(dt, D, 64, 256), bias=bias)]


def _o_gate(dt, D):
    """Rows drop 5 after the first tile (seg 64). Wave A: row 0 jumps 240 and votes, so
    its factor is < 1 and the others' (2^5) > 1; wave B: row 32 sees nothing in the
    first two tiles (a NaN vote) and drags the others, whose factors are all > 1."""
    t = {r: (0, -5) for r in range(64)}
    t[0] = (0, 240)
    bias = _masked(64, 256, [(32, slice(0, 128))])
    return Case([Call(*_inputs(dt, D, 64, 256, t, seg=64), bias=bias)],
                {"vote": "wave", "rebase": "tile", "threshold": 200.0})


def _scaled_rows(dt, D, levels, cols=512):
    """Rows at a constant score each (log2 units), under m_init -1: P = 2^(level + 1)."""
    return _inputs(dt, D, 64, cols, {r: (t, t) for r, t in enumerate(levels)}, seg=cols)


def _closest_pair(q, x_a, x_b):
    """Of the sorted candidate q entries, the two neighbours whose scores' gap (log2
    units) gives the second segment the most different weight under two readings of the
    score (``x_a``, ``x_b``: a candidate's score under each)."""
    def weight(x):
        return 1.0 / (1.0 + torch.exp2(x[:-1] - x[1:]))
    i = int((weight(x_a) - weight(x_b)).abs().argmax())
    return q[i], q[i + 1]


def _pair_call(dt, D, q0, q1):
    q, k, v = _inputs(dt, D, 64, 256)
    q[0, :, 0, 0], q[0, :, 0, 1] = q0.to(dt), q1.to(dt)
    return Call(q, k, v)


def _candidates(dt, centre):
    grid = torch.tensor(centre, dtype=dt).double() * (1 + torch.arange(-64, 65) / 512.0)
    return grid.to(dt).double().unique()


def _q_prescale(dt, D):
    """Two segments scored near 1000 (log2 units) through neighbouring q entries whose
    q * c rounds (to the inputs' type) so that their scores' gap changes most."""
    c = _f32(_f32(1.0 / math.sqrt(D)) * _f32(LOG2E))
    a = 16.0
    q = _candidates(dt, 1000.0 / (a * c))
    fmt = {torch.bfloat16: "bf16", torch.float16: "f16"}[dt]
    plain = _f32(_f32(q * a) * c)
    pre = _f32(_cast(fmt, True)(_f32(q * c)) * a)
    return Case([_pair_call(dt, D, *_closest_pair(q, plain, pre))])


def _softcap(dt, D):
    """softcap 1e8: u = t / cap is near 1e-5, where exp_sum's cancellation errs by ~1e-2
    relative; the two segments' neighbouring q entries are picked so that its scores' gap
    differs most from tanh's. Row 1 scores past |u| = 88.7, where exp_ratio gives
    inf / inf."""
    cap, nat, a = 1.0e8, _f32(1.0 / math.sqrt(D)), 16.0
    forms = _tanh_forms(cap)
    q = _candidates(dt, 1000.0 / (a * nat))
    t = _f32(_f32(q * a) * nat)

    def score(form):
        return _f32(_f32(forms[form](t) * _f32(cap)) * _f32(LOG2E))
    call = _pair_call(dt, D, *_closest_pair(q, score("tanh"), score("exp_sum")))
    call.q[0, 1, 0, 0] = call.q[0, 1, 0, 1] = torch.tensor(1.0e11 / (a * nat), dtype=dt)
    return Case([call], sem={"softcap": cap})


def _overflowed_l(dt, D):
    """Row 0 holds its max at 0 (lazy) over two tiles scored 126, whose P = 2^126 sum past
    fp32's range in l while V = 2^-8 keeps O finite; its last tile jumps to 250, votes,
    and the factor 0 turns l's inf into NaN. The epilogue then meets a NaN l and a finite
    O."""
    q, k, v = _inputs(dt, D, 64, 256, {0: (0, 126)}, seg=64)
    k[0, 192:, 0, 1] = 0.0
    k[0, 192:, 0, 2] = 16.0
    c = (1.0 / math.sqrt(D)) * LOG2E
    q[0, 0, 0, 2] = torch.tensor(250.0 / (16.0 * c), dtype=dt)
    v[0, 64:192] = (v[0, 64:192].double() * 2.0 ** -9).to(dt)
    return Case([Call(q, k, v)], LAZY)


def _cases(dt, D) -> dict:
    """field -> a function making its Case (built on first use)."""
    first = functools.partial(_first_tile_empty, dt, D)
    return {
        # row 0 votes; rows 20 and 40 jump 160 (below the threshold): dragged or stale
        "wave_rows": lambda: Case([Call(*_inputs(dt, D, 128, 256, {
            0: (0, 240), 20: (0, 160), 40: (0, 160)}))], LAZY),
        # an empty first tile: its factor and P are NaN (-inf - -inf)
        "clamp_exp_diff": lambda: Case(first()),
        "o_gate": lambda: _o_gate(dt, D),
        "epilogue_guard": lambda: _overflowed_l(dt, D),
        "tile_max_floor": lambda: Case([
            Call(*_inputs(dt, D, 64, 256), causal=cz, bias=_masked(64, 256, [(0, slice(0, 64))]))
            for cz in (False, True)]),
        # the first segment masked at -1000, the second scored -300
        "mask_domain": lambda: Case([Call(*_inputs(dt, D, 64, 256, {
            r: (0, -300) for r in range(64)}), bias=_masked(64, 256, [(slice(0, 64), slice(0, 128))]))],
            sem={"mask_value": -1000.0}),
        # row 0 sees nothing; row 1 sees only the last tile, scored -8, above the mask -10
        "empty_row_guard": lambda: Case([Call(*_inputs(dt, D, 64, 192, {1: (0, -8)}),
                                              bias=_masked(64, 192, [(0, slice(None)),
                                                                     (1, slice(0, 128))]))],
                                        sem={"mask_value": -10.0}),
        # P at 2^-12, 2^-20, 2^-30, 2^-136: below e4m3's, e5m2's, f16's, bf16's smallest
        "p_cast": lambda: Case([Call(*_scaled_rows(t, D, (-13, -21, -31, -137)))
                                for t in (torch.bfloat16, torch.float16)],
                               sem={"m_init": -1.0}),
        "ftz": lambda: Case([Call(*_scaled_rows(dt, D, (-13, -136)))],
                            sem={"m_init": -1.0, "p_cast": "none"}),
        # P = 2^10 past e4m3's 448
        "p_saturate": lambda: Case([Call(*_inputs(dt, D, 64, 256))],
                                   {"vote": "tile", "rebase": "max", "p_headroom": 10.0},
                                   {"p_cast": "e4m3"}),
        "l_sums_cast": lambda: Case([Call(*_inputs(dt, D, 64, 256))],
                                    {"vote": "tile", "rebase": "max", "p_headroom": 10.0},
                                    {"p_cast": "e4m3"}),
        "max_lag": lambda: Case([Call(*_inputs(dt, D, 64, 256, {0: (0, 240)}))]),
        # row 0 jumps 160, below the threshold: stale ascending, fine descending
        "kv_order": lambda: Case([Call(*_inputs(dt, D, 64, 256, {0: (0, 160)}))], LAZY),
        "p_before_vote": lambda: Case([Call(*_inputs(dt, D, 64, 256, {0: (0, 160)}))], LAZY),
        # row 0's second segment masked and scored 200 above its first
        "mask_stage": lambda: Case([Call(*_inputs(dt, D, 64, 256, {0: (0, 200)}),
                                         bias=_masked(64, 256, [(0, slice(128, 256))]))]),
        "q_prescale": lambda: _q_prescale(dt, D),
        "softcap_form": lambda: _softcap(dt, D),
        # every partial of row 0 empty
        "merge_empty": lambda: Case([Call(*_inputs(dt, D, 64, 256),
                                          bias=_masked(64, 256, [(0, slice(None))]))],
                                    sem={"kv_split": 1, "clamp_exp_diff": True}),
        # two partials whose masses differ 4-fold
        "lse_base": lambda: Case([Call(*_inputs(dt, D, 64, 256, {r: (0, 2) for r in range(64)}))],
                                 sem={"kv_split": 2}),
        # the cache tail's V rows hold NaN
        "v_tail": lambda: Case([_tail_call(dt, D)]),
        # the numeric fields (NUMERIC's value against the default):
        # the first segment masked and scored below the mask value -10 by the second's -300
        "mask_value": lambda: Case([Call(*_inputs(dt, D, 64, 256, {
            r: (0, -300) for r in range(64)}), bias=_masked(64, 256, [(slice(0, 64), slice(0, 128))]))]),
        # every score -300: a max that starts at -5 (rebase max) leaves P = 2^-295 = 0
        "m_init": lambda: Case([Call(*_scaled_rows(dt, D, [-300] * 64, 256))]),
        # every score -300, floored at -100 on every tile: P = 2^-200 = 0
        "floor_value": lambda: Case([Call(*_scaled_rows(dt, D, [-300] * 64, 256))],
                                    sem={"tile_max_floor": "always"}),
        # row 0 jumps 160 at column 32: inside the first 64-column tile, stale past 32
        "block_n": lambda: Case([Call(*_inputs(dt, D, 64, 256, {0: (0, 160)}, seg=32))], LAZY),
        # row 0 jumps to 240: P = 2^140 against a max pinned at 100
        "fixed_max": lambda: Case([Call(*_inputs(dt, D, 64, 256, {0: (0, 240)}))]),
        # l near 256 divided by 1e4
        "l_floor": lambda: Case([Call(*_inputs(dt, D, 64, 256))]),
        # the segments 2 apart (log2 units): capped at 1 (natural units) they are 1.27 apart
        "softcap": lambda: Case([Call(*_inputs(dt, D, 64, 256, {r: (0, 2) for r in range(64)}))]),
        # the second segment 100 below the first: P = 2^-100 floored to 2^-2
        "exp_floor": lambda: Case([Call(*_inputs(dt, D, 64, 256, {r: (0, -100) for r in range(64)}))]),
        # row 0 jumps 160 at tile 2, where a second partial starts afresh
        "kv_split": lambda: Case([Call(*_inputs(dt, D, 64, 256, {0: (0, 160)}))], LAZY),
    }


def _tail_call(dt, D):
    q, k, v = _inputs(dt, D, 64, 256)
    v[0, 200:] = math.nan
    return Call(q, k, v, seqlen_kv=200)


@functools.cache
def case(field_name: str, dtype: torch.dtype, D: int) -> Case:
    cases = _cases(dtype, D)
    if field_name not in cases:
        raise AssertionError(f"no conformance case for the semantics field {field_name!r}: "
                             "add one to tests/kernels/_semantic_conformance.py CASES")
    return cases[field_name]()


def policy_for(field_name: str, value, the_case: Case) -> Policy:
    sem = Semantics(**{**the_case.sem, field_name: value})
    with warnings.catch_warnings():  # a headroom past e4m3's range is the point
        warnings.simplefilter("ignore", UserWarning)
        return Policy(**the_case.policy, semantics=sem, name=f"conf_{field_name}_{value}")


def claims(families, Claim) -> list:
    """Every (family, implementation, semantics field, value) claimed: each value declared
    for each fixed-set field in an implementation's ``Caps.semantics``, and each numeric
    field there at its ``NUMERIC`` value."""
    out = []
    for name, fam in families.items():
        for impl, im in fam.implementations.items():
            for f in FIELDS:
                if f in im.caps.semantics:
                    out.extend(Claim(name, impl, f, v, None) for v in values.names(f))
            for f in NUMERIC_FIELDS:
                if f in im.caps.semantics:
                    out.append(Claim(name, impl, f, numeric_value(f), None))
    return out


def numeric_value(field_name: str):
    """The value the claim of numeric field ``field_name`` runs (``NUMERIC``)."""
    if field_name not in NUMERIC:
        raise AssertionError(f"no conformance value for the numeric semantics field "
                             f"{field_name!r}: add one to tests/kernels/_semantic_conformance.py "
                             "NUMERIC, with its case")
    return NUMERIC[field_name]


def dtype_and_dim(claim):
    caps = FAMILIES[claim.family].caps(claim.impl)
    dt = torch.bfloat16 if "bf16" in caps.dtypes else torch.float16
    return dt, min(caps.head_dims)


def run_and_reference(claim, device: str = "cpu"):
    """(the implementation's outputs, the reference's), each [rows of every call, D] fp64."""
    dt, D = dtype_and_dim(claim)
    the_case = case(claim.field, dt, D)
    pol = policy_for(claim.field, claim.value, the_case)
    fwd = module(claim.family, claim.impl).forward
    outs, refs = [], []
    for call in the_case.calls:
        kw = {"bias": call.bias.to(device)} if call.bias is not None else {}
        if call.seqlen_kv is not None:
            kw["seqlen_kv"] = call.seqlen_kv
        got = fwd(call.q.to(device), call.k.to(device), call.v.to(device), policy=pol,
                  causal=call.causal, **kw)
        got = got[0] if isinstance(got, tuple) else got
        outs.append(got.cpu().double()[0, :, 0])
        refs.append(reference(call, pol))
    return torch.cat(outs), torch.cat(refs)
