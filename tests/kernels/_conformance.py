"""The conformance check: every (family, implementation, policy value, feature) that the
families' capabilities claim, run against an independent fp64 reference of the policy.

``claims()`` enumerates from ``fa_lab.kernels.FAMILIES`` what each implementation's
``Caps`` lists: each vote and rebase value, with no feature and with each feature it
claims that the reference models (``FEATURES``); and each value of each fixed-set
``Semantics`` field it runs (``_semantic_conformance``: its own reference and inputs).
``check(claim)`` runs it and raises
AssertionError naming the family, implementation, value and feature when its output
differs from the reference.

The reference is a plain online softmax in fp64 with fp32's exponent range (a value past
fp32's largest overflows to inf, one below its smallest denormal flushes to 0), deciding
per 64-column tile and 32-row wave by the policy's rules written out here
(``REFERENCE_VOTES``, ``REFERENCE_REBASES``), independently of the models' code. A value
without a rule here fails the check, naming it: a new value is defined here before any
implementation can claim it.

The input (``Case``) makes every value of a field give a different output. Scores are
constant over each of two column segments (0-127, 128-end) per row, in log2 units, so
the families' own tilings (64 or 128 columns, an eager last few tiles) decide alike; with
threshold 200 and rebase bound 200 (log2 units):

* wave A: row 0 jumps +240 (votes); row 1 drops 250 (a drag to its tile max overflows
  the factor 2^250: NaN; "capped" skips it); row 2 jumps +160 (stale unless dragged up: P =
  2^160 overflows);
* wave B: row 32 jumps +240; row 33 drops 160 (NaN under "tile" and "capped");
  row 34 jumps +160;
* wave C: row 64 jumps +160 alone (stale under every lazy vote);
* the other rows keep a constant score.

So vote "tile" leaves every row finite, "wave" breaks row 64, "row" rows 2, 34 and 64;
under "wave" rebase "max" breaks 64, "tile" 1, 33 and 64, "capped" 33 and 64.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

import _semantic_conformance as SEM

import fa_lab
from fa_lab import dispatch, values
from fa_lab.kernels import FAMILIES
from fa_lab.policies import Policy

THRESHOLD = 200.0
BOUND = 200.0
FLT_MAX = float(torch.finfo(torch.float32).max)
FLT_TINY = 2.0 ** -149
SEG = 128  # the first segment's columns
ROWS = 128
COLS = 512
#: How each backend reaches an implementation on CPU tensors.
BACKEND = {impl: b for b, impl in dispatch.IMPLEMENTATION.items() if b != "triton"}
#: Features the reference models; the others a family may claim are listed, with why
#: they are not run here, in ``UNCOVERED``.
FEATURES = (None, "bias", "alibi_slopes", "sink", "varlen", "trace")
UNCOVERED = {"num_kv_splits": "split-K restarts each split's running max and ends it with "
                              "its own eager tiles, a schedule the segment input does not fix",
             "paged": "a paged call reads the same tiles as a dense one, through a page table; "
                      "tests/kernels/swp_bf16/test_paged.py checks it against the dense call "
                      "and an fp64 reference"}
#: The pseudo-feature of an implementation whose Caps.head_dims_v let Dv differ from D:
#: its claims also run with v's head dim the smallest Dv below D.
HEAD_DIMS_V = "head_dims_v"
#: (field, value) -> what the other field is set to, so that the value decides the output.
PARTNER = {"vote": ("rebase", ("tile", "capped", "max")), "rebase": ("vote", ("wave", "row"))}


@dataclass(frozen=True)
class Claim:
    family: str
    impl: str
    field: str
    value: str
    feature: str | None

    def __str__(self):
        return (f"family {self.family!r}, implementation {self.impl!r}, "
                f"{self.field}={self.value!r}, feature {self.feature or 'none'}")


def claims(families=None) -> list[Claim]:
    """Every (family, implementation, vote or rebase value, feature) the capabilities
    claim, for the features the reference models; then every value of every fixed-set
    ``Semantics`` field they claim (``_semantic_conformance``), with no feature."""
    out = []
    families = families or FAMILIES
    for name, fam in families.items():
        for impl, im in fam.implementations.items():
            caps = im.caps
            feats = [f for f in FEATURES if f is None or f in caps.features]
            if caps.head_dims_v:  # V head dims other than D: one more claim, v narrower than q
                feats.append(HEAD_DIMS_V)
            for field, claimed in (("vote", caps.votes), ("rebase", caps.rebases)):
                for value in sorted(claimed):
                    out.extend(Claim(name, impl, field, value, f) for f in feats)
    return out + SEM.claims(families, Claim)


def policy_for(claim: Claim, caps) -> Policy:
    """A policy setting ``claim``'s value, with the other field chosen among the values
    the implementation claims so that the value shows in the output."""
    other, prefs = PARTNER[claim.field]
    fields = {claim.field: claim.value}
    reads_rebase = claim.field == "vote" and "rebase" in values.get("vote", claim.value).uses
    if claim.field == "vote" and not reads_rebase:
        fields["rebase"] = "max"
    else:
        have = caps.rebases if other == "rebase" else caps.votes
        pick = [p for p in prefs if p in have]
        if not pick:  # no lazy vote: only vote "tile" runs this rebase ("max")
            fields[other] = "tile"
        else:
            fields[other] = pick[0]
    pol = {"vote": fields["vote"], "rebase": fields["rebase"],
           "name": f"conf_{fields['vote']}_{fields['rebase']}"}
    if "threshold" in values.get("vote", fields["vote"]).uses:
        pol["threshold"] = THRESHOLD
    if "rebase_bound" in values.get("rebase", fields["rebase"]).uses:
        pol["rebase_bound"] = BOUND
    return Policy(**pol)


# ---------------------------------------------------------------------------------------
# The fp64 reference


def _fit(x: torch.Tensor) -> torch.Tensor:
    """fp32's exponent range on fp64 values: overflow to inf, flush below the denormals."""
    x = torch.where(x.abs() > FLT_MAX, x.sign() * math.inf, x)
    return torch.where(x.abs() < FLT_TINY, torch.zeros_like(x), x)


def _waves(flags: torch.Tensor) -> torch.Tensor:
    shape = flags.shape
    w = flags.reshape(*shape[:-1], shape[-1] // 32, 32).any(-1, keepdim=True)
    return w.expand(*shape[:-1], shape[-1] // 32, 32).reshape(shape)


#: vote -> (m, mt, policy) -> the rows that move (the reference's reading of each value).
REFERENCE_VOTES = {
    "tile": lambda m, mt, p: torch.ones_like(m, dtype=torch.bool),
    "wave": lambda m, mt, p: _waves(~(mt - m <= p.threshold)),
    "row": lambda m, mt, p: ~(mt - m <= p.threshold),
}
#: rebase -> (m, mt, policy) -> (where a moving row's max goes, which moving rows do).
REFERENCE_REBASES = {
    "max": lambda m, mt, p: (torch.maximum(m, mt), torch.ones_like(m, dtype=torch.bool)),
    "tile": lambda m, mt, p: (mt, torch.ones_like(m, dtype=torch.bool)),
    "capped": lambda m, mt, p: (torch.where(mt - m >= -p.rebase_bound, mt, m),
                                mt - m >= -p.rebase_bound),
}


def reference(s2: torch.Tensor, v: torch.Tensor, policy: Policy, *, fp8: bool,
              sink2: torch.Tensor | None = None) -> torch.Tensor:
    """The policy's online softmax in fp64 with fp32's range: ``s2`` [H, R, C] scores in
    log2 units, ``v`` [C, D]; P is cast as the kernels cast it (fp8: saturating at 448).
    ``sink2`` [H] adds 2^sink2 to each row's denominator. Returns out [H, R, D]."""
    for field, table in (("vote", REFERENCE_VOTES), ("rebase", REFERENCE_REBASES)):
        if getattr(policy, field) not in table:
            raise AssertionError(f"the fp64 reference has no rule for {field}="
                                 f"{getattr(policy, field)!r}: define it in "
                                 "tests/kernels/_conformance.py before claiming it")
    H, R, C = s2.shape
    m = torch.full((H, R), -math.inf, dtype=torch.float64)
    l = torch.zeros(H, R, dtype=torch.float64)
    O = torch.zeros(H, R, v.shape[-1], dtype=torch.float64)
    for c0 in range(0, C, 64):
        x = s2[..., c0:c0 + 64]
        mt = x.amax(-1)
        move = REFERENCE_VOTES[policy.vote](m, mt, policy)
        target, ok = REFERENCE_REBASES[policy.rebase](m, mt, policy)
        move = move & ok
        m_new = torch.where(move, target, m)
        corr = torch.where(move, _fit(torch.exp2(m - m_new)), torch.ones_like(m))
        P = _fit(torch.exp2(x - m_new[..., None]))
        Pc = P.clamp(max=448.0) if fp8 else P
        l = _fit(l * corr + P.sum(-1))
        O = _fit(O * corr[..., None] + Pc @ v[c0:c0 + 64])
        m = m_new
    if sink2 is not None:
        l = _fit(l + _fit(torch.exp2(sink2[:, None] - m)))
    rcp = torch.where(l > 0, 1.0 / l, torch.zeros_like(l))
    return O * rcp[..., None]


# ---------------------------------------------------------------------------------------
# The input and the run


def targets(rows: int = ROWS) -> torch.Tensor:
    """[rows, 2]: each row's score (log2 units) over the first and the second segment."""
    t = torch.zeros(rows, 2, dtype=torch.float64)
    for r, (a, b) in {0: (0, 240), 1: (250, 0), 2: (0, 160), 32: (0, 240), 33: (160, 0),
                      34: (0, 160), 64: (0, 160)}.items():
        t[r] = torch.tensor([a, b], dtype=torch.float64)
    return t


def make_case(dtype: str, D: int, rows: int, cols: int):
    """q [1, rows, 1, D], k and v [1, cols, 1, D] of ``dtype`` whose scores are
    ``targets()`` per segment, with the softmax scale and descales the call uses."""
    c = (1.0 / math.sqrt(D)) * math.log2(math.e)
    a = 16.0
    t = targets(rows)
    q = torch.zeros(1, rows, 1, D, dtype=torch.float64)
    q[0, :, 0, 0], q[0, :, 0, 1] = t[:, 0] / (a * c), t[:, 1] / (a * c)
    k = torch.zeros(1, cols, 1, D, dtype=torch.float64)
    k[0, :SEG, 0, 0] = a
    k[0, SEG:, 0, 1] = a
    g = torch.Generator().manual_seed(7)
    v = 0.5 + torch.rand(1, cols, 1, D, generator=g, dtype=torch.float64)
    tdt = torch.float8_e4m3fn if dtype == "fp8" else getattr(torch, {"bf16": "bfloat16",
                                                                     "f16": "float16"}[dtype])
    if dtype == "fp8":  # q's entries up to 250 / (16 c) exceed e4m3's 448 at c < 0.035: none here
        assert float(q.abs().max()) < 448
    return q.to(tdt), k.to(tdt), v.to(tdt), c


def _dtype(caps) -> str:
    return "bf16" if "bf16" in caps.dtypes else sorted(caps.dtypes)[0]


def run_and_reference(claim: Claim, device: str = "cpu"):
    """(the implementation's out, the reference's out), both [tokens, H, D] fp64 on the
    CPU; ``device="cuda"`` runs the compiled ports (the faithful one as backend="triton")."""
    fam = FAMILIES[claim.family]
    caps = fam.caps(claim.impl)
    policy = policy_for(claim, caps)
    dtype, D = _dtype(caps), min(caps.head_dims)
    backend = "triton" if device != "cpu" and claim.impl == "faithful" else BACKEND[claim.impl]
    routed = fam.routed
    rows = ROWS if routed else COLS  # a non-routed (SWA) kernel: Sq == Skv
    q, k, v, c = make_case(dtype, D, rows, COLS)
    if claim.feature == HEAD_DIMS_V:
        v = v[..., :min(d for d in caps.head_dims_v if d < D)].contiguous()
    q, k, v = q.to(device), k.to(device), v.to(device)
    fp8 = dtype == "fp8"
    kw = dict(causal=False, rescale=policy, backend=backend)
    if fp8:
        kw.update(q_descale=1.0, k_descale=1.0, v_descale=1.0)
    mods, bias2, sink2 = {}, None, None
    pos = torch.arange(rows, dtype=torch.float64)[:, None] + (COLS - rows) - torch.arange(COLS)
    if claim.feature == "bias":
        g = torch.Generator().manual_seed(3)
        bias = (torch.rand(rows, COLS, generator=g) - 0.5).to(torch.bfloat16)
        mods["bias"], bias2 = bias.to(device), bias.double() * math.log2(math.e)
    elif claim.feature == "alibi_slopes":
        mods["alibi_slopes"] = torch.tensor([2.0 ** -9], device=device)
        bias2 = -(2.0 ** -9) * pos.abs() * math.log2(math.e)
    elif claim.feature == "sink":
        mods["sink"] = torch.tensor([1.5], device=device)
        sink2 = torch.tensor([1.5 * math.log2(math.e)], dtype=torch.float64)

    def ref_one(qs, ks, vs):
        qd, kd = qs.cpu().double()[0, :, 0], ks.cpu().double()[0, :, 0]
        s2 = (qd @ kd.T) * c
        if bias2 is not None:
            s2 = s2 + bias2
        return reference(s2[None], vs.cpu().double()[0, :, 0], policy, fp8=fp8, sink2=sink2)[0]

    with warnings.catch_warnings():
        warnings.simplefilter("error", fa_lab.RoutingWarning)
        if not routed:
            if claim.family != "swa":
                raise AssertionError(f"family {claim.family!r} is not routed and has no "
                                     "conformance entry point")
            out = fa_lab.swa_attn_func(q, k, v, window_left=COLS, window_right=COLS,
                                       causal=False, rescale=policy, backend=backend)
            return out.cpu().double()[0, :, 0], ref_one(q, k, v)
        planned = fa_lab.api.plan(q, k, v, kernel=claim.family, **kw, **mods)
        assert (planned.family, planned.backend) == (claim.family, backend), (
            f"{claim}: planned {planned.family}/{planned.backend}")
        if claim.feature == "varlen":
            qq, kk, vv = torch.cat([q, q], 1)[0], torch.cat([k, k], 1)[0], torch.cat([v, v], 1)[0]
            cq = torch.tensor([0, rows, 2 * rows], dtype=torch.int32, device=device)
            ck = torch.tensor([0, COLS, 2 * COLS], dtype=torch.int32, device=device)
            out = fa_lab.flash_attn_func(qq, kk, vv, cu_seqlens_q=cq, cu_seqlens_kv=ck,
                                         max_seqlen_q=rows, max_seqlen_kv=COLS,
                                         kernel=claim.family, **kw)
            ref = ref_one(q, k, v)
            return out.cpu().double()[:, 0], torch.cat([ref, ref])
        if claim.feature == "trace":
            tr = fa_lab.trace(q, k, v, rows=range(rows), kernel=claim.family, **kw)
            return tr.out.cpu().double(), ref_one(q, k, v)
        out = fa_lab.flash_attn_func(q, k, v, kernel=claim.family, **kw, **mods)
        return out.cpu().double()[0, :, 0], ref_one(q, k, v)


def check(claim: Claim, device: str = "cpu") -> None:
    """Run ``claim`` and compare with the reference: the same NaN and inf rows, and finite
    outputs within the input format's error relative to the reference's (at least 1; a
    row of zeros, where an overflowed l meets a saturated O, included). AssertionError
    naming the claim."""
    if claim.field in values.POLICY_FIELDS:
        out, ref = run_and_reference(claim, device)
    else:
        out, ref = SEM.run_and_reference(claim, device)
    bad = []
    for what, f in (("NaN", torch.isnan), ("inf", torch.isinf)):
        got, want = f(out).any(-1), f(ref).any(-1)
        if not torch.equal(got, want):
            bad.append(f"{what} rows {got.nonzero().flatten().tolist()[:8]}, the reference's "
                       f"{want.nonzero().flatten().tolist()[:8]}")
    fin = torch.isfinite(out) & torch.isfinite(ref)
    tol = 0.1 if FAMILIES[claim.family].caps(claim.impl).dtypes <= {"fp8"} else 0.02
    err = ((out - ref).abs() / ref.abs().clamp(min=1.0)).where(fin, torch.zeros_like(out))
    if float(err.max()) > tol:
        r = int(err.amax(-1).argmax())
        bad.append(f"row {r} differs by {float(err[r].max()):.3g} (tolerance {tol})")
    if bad:
        raise AssertionError(f"{claim} does not run the value as declared: " + "; ".join(bad))
