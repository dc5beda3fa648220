"""The conformance check: every (family, implementation, policy value, feature) that the
families' capabilities claim, run against an independent fp64 reference of the policy.

``claims()`` enumerates from ``fa_lab.kernels.FAMILIES`` what each implementation's
``Caps`` lists: each vote and rebase value, with no feature and with each feature it
claims (``FEATURES``; a non-routed family runs through the entry point of the feature it
serves, ``ENTRY_POINTS``);
each numeric policy parameter its values read, at a second value (``PARAMETERS``); the
Python rules of ``RULES`` where it runs rules (``Caps.rules``);
each value of each fixed-set ``Semantics`` field it runs and each numeric one at a
non-default value (``_semantic_conformance``: its own reference and inputs); and each
choice of its own it claims (``Caps.modes``: a decode's scale mode, upstream version and
partitions, MLA's P headroom and splits, the backward's LSE; ``_mode_conformance``).
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

Features whose kernels do more than plain attention are checked against the same fp64
reference on the logical (dense) inputs, since they do not change the math:

* ``paged``: k and v are scattered into a page cache of 64-row pages in a shuffled order
  (the unused pages hold NaN, so a wrong gather shows), read through a block table, in
  the call form the implementation's ``Caps.paged_call`` names
  (``fa_lab.capabilities.PAGED_CALLS``), built by ``paged_call``: its first layout, non-causal
  where the form takes it, else bottom-right causal, q packed with cu_seqlens (one
  sequence) where the form is packed (the fp8 family's, FlyDSL #1066: causal, packed,
  vectorized only). A causal call's reference masks the scores past the diagonal to
  -inf, as the window below does. Row i sees keys up to i + 384, so every row's events
  (at column 128) stay visible and the rows break as above; the
  masked columns lie in tiles 6 and 7, and no row has a wholly masked 128-column pair
  (the fp8 kernel's decision unit, whose causal floor would then apply). Tile 7 is
  wholly masked for rows 0-63: the reference decides on tile 6 and skips tile 7 (no
  vote, no move, P = 0); the fp8 kernel decides once on the pair's max, which is tile
  6's, and adds P = 0 for tile 7: the same decision and sums;
* ``num_kv_splits`` (split-K, 2 splits): upstream takes split-K from 384 query rows and
  cuts a block's N 64-column tiles into chunks of ceil(N / 2) rounded up to even, at
  least 6 (a remainder under 4 joins the split before it), so the input is 384 rows by
  640 columns (1280 for fp8, whose decisions take 128 columns), split at column 384
  (640 for fp8: ``SPLIT_AT``), with a third segment from column 192 at score 0 on every
  row: each row's events (the jumps and drops above) and its return lie inside the first
  split, before the eager tiles that end it, and the other split sees a constant score,
  but for row 96 (``JUMP_ROW``, a wave of its own), which jumps +160 over the 64 columns
  from the split: the second split starts it from a fresh max, so it stays finite, where
  the unsplit walk keeps the stale max (under a lazy vote, 160 < the threshold) and
  breaks (P = 2**160). So a kernel that does not split, or merges as if it had not,
  fails every lazy claim; under the eager vote ("tile") split and unsplit agree. The
  reference is the walk over each split's columns from a fresh max, merged as the
  kernels' combine does (a split's weight ``2^(m_s - m_max) l_s``, a split whose l is not
  > 0 skipped): ``split_reference``;
* ``window`` (the feature ``swa_attn_func`` asks of the family that claims it): ``window_left`` 256 with
  the window open to the right, so rows from 256 on lose the first columns, whose V is
  raised by 2 so that a window not applied shows; the reference masks those scores to
  -inf, and a row whose tile is wholly masked skips it.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass

import torch

import _mode_conformance as MODES
import _semantic_conformance as SEM

import fa_lab
from fa_lab import dispatch, paged, values
from fa_lab.capabilities import PAGED_CALLS
from fa_lab.kernels import FAMILIES
from fa_lab.policies import Policy
from fa_lab.trace import TraceRecorder, normalize_rows

THRESHOLD = 200.0
BOUND = 200.0
FLT_MAX = float(torch.finfo(torch.float32).max)
FLT_TINY = 2.0 ** -149
SEG = 128  # the first segment's columns
ROWS = 128
COLS = 512
#: How each backend reaches an implementation on CPU tensors.
BACKEND = {impl: b for b, impl in dispatch.IMPLEMENTATION.items() if b != "triton"}
#: Features the reference checks (module docstring); any other a family may claim would be
#: listed, with why it is not run here, in ``UNCOVERED`` (none is).
FEATURES = (None, "bias", "alibi_slopes", "sink", "varlen", "trace", "num_kv_splits", "paged",
            "window")
UNCOVERED: dict = {}
#: split-K's input (module docstring): rows, columns, the third segment's first column,
#: the splits asked for, where the kernels split and ``split_reference`` merges, and the
#: row that jumps there.
SPLIT_ROWS, THIRD, SPLITS, JUMP_ROW, JUMP = 384, 192, 2, 96, 160.0
SPLIT_COLS = {"fp8": 1280}  # (by the input's dtype; 640 otherwise)
SPLIT_AT = {"fp8": 640}  # (by the input's dtype; 384 otherwise)
#: The page cache: 64-row pages; logical page t lives in physical page PAGES[t] of
#: PAGE_BLOCKS (4 and 6 unused, NaN).
PAGE, PAGE_BLOCKS, PAGES = 64, 10, (5, 0, 9, 2, 7, 3, 8, 1)
#: The feature of a family whose own entry point takes a sliding window.
WINDOW = "window"
WINDOW_LEFT = 256
#: Non-routed families run through the entry point of a feature they claim: feature ->
#: the entry point's name in ``fa_lab`` (it finds the family by the feature).
ENTRY_POINTS = {WINDOW: "swa_attn_func"}
#: The pseudo-feature of an implementation whose Caps.head_dims_v let Dv differ from D:
#: its claims also run with v's head dim the smallest Dv below D.
HEAD_DIMS_V = "head_dims_v"
#: The policy's numeric parameters, each run at a second value besides THRESHOLD and BOUND
#: (a claim of every implementation that runs a value reading it): 150 makes rows 2, 34
#: and 64 (+160) vote, and lets capped skip row 33's drop (160).
PARAMETERS = {"threshold": 150.0, "rebase_bound": 150.0}
#: The fp8 P headroom (``Policy.p_headroom``, log2 units: P lifted by 2**H before its e4m3
#: cast, l summing the lifted P), claimed by every implementation that takes fp8 inputs
#: and a policy, run on fp8 inputs under the eager vote at a value past log2(448): a row's
#: P of 1 becomes 1024, saturates to 448 in O while l keeps 1024, so the output shrinks by
#: 448/1024, which an implementation that ignores the headroom does not give.
FP8_PARAMETERS = {"p_headroom": 10.0}
#: Python rules (``Policy.from_rule``), claimed by an implementation whose ``Caps.rules``
#: is set: name -> (the rule, the declarative policy the reference runs for it). Each
#: decides per 32-row wave at threshold THRESHOLD (a NaN jump votes).
def _wave_rule(target):
    def rule(m, mt, thr):
        vote = ~(mt - m <= thr)
        return torch.where(vote.any(-1, keepdim=True), target(m, mt), m)
    return rule


RULES = {"wave_max": (_wave_rule(torch.fmax), Policy("wave", "max", threshold=THRESHOLD, name="r_max")),
         "wave_tile": (_wave_rule(lambda m, mt: mt),
                       Policy("wave", "tile", threshold=THRESHOLD, name="r_tile"))}
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
    ``Semantics`` field they claim (``_semantic_conformance``), and every choice of its
    own (``Caps.modes``, ``_mode_conformance``), with no feature."""
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
            for param, value in PARAMETERS.items():
                if _reader(param, caps) is not None:
                    out.append(Claim(name, impl, param, value, None))
            if caps.rules:
                out.extend(Claim(name, impl, "rule", r, None) for r in RULES)
            if "fp8" in caps.dtypes and "tile" in caps.votes:
                out.extend(Claim(name, impl, p, v, None) for p, v in FP8_PARAMETERS.items())
    return out + SEM.claims(families, Claim) + MODES.claims(families, Claim)


def _reader(param: str, caps):
    """(field, value): the first value ``caps`` runs that reads the policy parameter
    ``param`` (a lazy vote for the threshold, capped for the bound), or None."""
    for field, claimed in (("vote", caps.votes), ("rebase", caps.rebases)):
        for value in sorted(claimed, key=values.names(field).index):
            if param in values.get(field, value).uses:
                return field, value
    return None


def policy_for(claim: Claim, caps) -> Policy:
    """A policy setting ``claim``'s value, with the other field chosen among the values
    the implementation claims so that the value shows in the output; a parameter's claim
    (``PARAMETERS``) sets it on the policy of the first value that reads it."""
    if claim.field == "rule":
        return Policy.from_rule(RULES[claim.value][0], name=f"conf_rule_{claim.value}",
                                threshold=THRESHOLD)
    if claim.field in FP8_PARAMETERS:
        base = policy_for(Claim(claim.family, claim.impl, "vote", "tile", None), caps)
        with warnings.catch_warnings():  # (past log2(448) it warns that P saturates: the point)
            warnings.simplefilter("ignore", UserWarning)
            return dataclasses.replace(base, **{claim.field: claim.value},
                                       name=f"{base.name}_{claim.field}_{claim.value:g}")
    if claim.field in PARAMETERS:
        field, value = _reader(claim.field, caps)
        base = policy_for(Claim(claim.family, claim.impl, field, value, claim.feature), caps)
        return dataclasses.replace(base, **{claim.field: claim.value},
                                   name=f"{base.name}_{claim.field}_{claim.value:g}")
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
    log2 units (-inf: masked), ``v`` [C, D]; P is cast as the kernels cast it (fp8:
    saturating at 448). ``sink2`` [H] adds 2^sink2 to each row's denominator. Returns out
    [H, R, D]."""
    O, l, m = walk(s2, v, policy, fp8=fp8)
    if sink2 is not None:
        l = _fit(l + _fit(torch.exp2(sink2[:, None] - m)))
    return O * _rcp(l)[..., None]


def _rcp(l):
    return torch.where(l > 0, 1.0 / l, torch.zeros_like(l))


def split_reference(s2: torch.Tensor, v: torch.Tensor, policy: Policy, *, fp8: bool,
                    at: int) -> torch.Tensor:
    """split-K's reference: ``walk`` over columns [0, at) and [at, C) from a fresh max
    each, merged as the kernels' combine does: a split whose l is not > 0 (0 or NaN) is
    skipped, the others weigh ``2^(m_s - m_max) l_s`` on their normalised output."""
    parts = [walk(s2[..., a:b], v[a:b], policy, fp8=fp8) for a, b in ((0, at), (at, s2.shape[-1]))]
    m_max = parts[0][2]
    for _, _, m_s in parts[1:]:
        m_max = torch.fmax(m_max, m_s)
    den, acc = torch.zeros_like(m_max), 0.0
    for O, l, m_s in parts:
        w = torch.where(l > 0, _fit(torch.exp2(m_s - m_max)) * l, torch.zeros_like(l))
        den, acc = den + w, acc + w[..., None] * (O * _rcp(l)[..., None])
    return acc * _rcp(den)[..., None]


def walk(s2: torch.Tensor, v: torch.Tensor, policy: Policy, *, fp8: bool):
    """``reference``'s walk: (O [H, R, D], l [H, R], m [H, R]) after the last tile. A row
    whose tile is wholly masked (tile max -inf) neither votes nor moves, and adds 0."""
    for field, table in (("vote", REFERENCE_VOTES), ("rebase", REFERENCE_REBASES)):
        if getattr(policy, field) not in table:
            raise AssertionError(f"the fp64 reference has no rule for {field}="
                                 f"{getattr(policy, field)!r}: define it in "
                                 "tests/kernels/_conformance.py before claiming it")
    H, R, C = s2.shape
    headroom = 0.0 if isinstance(policy.p_headroom, bool) else float(policy.p_headroom)
    m = torch.full((H, R), -math.inf, dtype=torch.float64)
    l = torch.zeros(H, R, dtype=torch.float64)
    O = torch.zeros(H, R, v.shape[-1], dtype=torch.float64)
    for c0 in range(0, C, 64):
        x = s2[..., c0:c0 + 64]
        mt = x.amax(-1)
        move = REFERENCE_VOTES[policy.vote](m, mt, policy) & (mt > -math.inf)
        target, ok = REFERENCE_REBASES[policy.rebase](m, mt, policy)
        move = move & ok
        m_new = torch.where(move, target, m)
        corr = torch.where(move, _fit(torch.exp2(m - m_new)), torch.ones_like(m))
        P = _fit(torch.exp2(x - m_new[..., None] + headroom)).masked_fill(x == -math.inf, 0.0)
        Pc = P.clamp(max=448.0) if fp8 else P
        l = _fit(l * corr + P.sum(-1))
        O = _fit(O * corr[..., None] + Pc @ v[c0:c0 + 64])
        m = m_new
    return O, l, m


# ---------------------------------------------------------------------------------------
# The input and the run


def targets(rows: int = ROWS) -> torch.Tensor:
    """[rows, 2]: each row's score (log2 units) over the first and the second segment."""
    t = torch.zeros(rows, 2, dtype=torch.float64)
    for r, (a, b) in {0: (0, 240), 1: (250, 0), 2: (0, 160), 32: (0, 240), 33: (160, 0),
                      34: (0, 160), 64: (0, 160)}.items():
        t[r] = torch.tensor([a, b], dtype=torch.float64)
    return t


def make_case(dtype: str, D: int, rows: int, cols: int, third: int | None = None,
              jump_at: int | None = None):
    """q [1, rows, 1, D], k and v [1, cols, 1, D] of ``dtype`` whose scores are
    ``targets()`` per segment, with the softmax scale and descales the call uses;
    ``third``: from that column on every row scores 0 (split-K's input); ``jump_at``: row
    ``JUMP_ROW`` scores ``JUMP`` over the 64 columns from it."""
    c = (1.0 / math.sqrt(D)) * math.log2(math.e)
    a = 16.0
    t = targets(rows)
    q = torch.zeros(1, rows, 1, D, dtype=torch.float64)
    q[0, :, 0, 0], q[0, :, 0, 1] = t[:, 0] / (a * c), t[:, 1] / (a * c)
    k = torch.zeros(1, cols, 1, D, dtype=torch.float64)
    k[0, :SEG, 0, 0] = a
    k[0, SEG:third, 0, 1] = a
    if third is not None:
        k[0, third:, 0, 2] = a  # q's dim 2 is 0: score 0
    if jump_at is not None:
        k[0, jump_at:jump_at + 64, 0, 3] = a
        q[0, JUMP_ROW, 0, 3] = JUMP / (a * c)
    g = torch.Generator().manual_seed(7)
    v = 0.5 + torch.rand(1, cols, 1, D, generator=g, dtype=torch.float64)
    tdt = torch.float8_e4m3fn if dtype == "fp8" else getattr(torch, {"bf16": "bfloat16",
                                                                     "f16": "float16"}[dtype])
    if dtype == "fp8":  # q's entries up to 250 / (16 c) exceed e4m3's 448 at c < 0.035: none here
        assert float(q.abs().max()) < 448
    return q.to(tdt), k.to(tdt), v.to(tdt), c


def offsets(rows: int, cols: int) -> torch.Tensor:
    """[rows, cols] fp64: i + cols - rows - j, row i's distance past key j on the
    bottom-right diagonal (negative: masked under causal)."""
    return torch.arange(rows, dtype=torch.float64)[:, None] + (cols - rows) - torch.arange(cols)


def causal_mask(rows: int, cols: int) -> torch.Tensor:
    """[rows, cols] fp64: -inf past the bottom-right diagonal, 0 elsewhere (added to s2)."""
    return torch.where(offsets(rows, cols) < 0, -math.inf, 0.0)


def _dtype(caps) -> str:
    return "bf16" if "bf16" in caps.dtypes else sorted(caps.dtypes)[0]


def page_cache(k: torch.Tensor, v: torch.Tensor, layout: str = "linear"):
    """k and v [1, C, Hkv, D] (C a multiple of ``PAGE``) as a page cache of ``PAGE_BLOCKS``
    pages (logical page t at physical page ``PAGES[t]``, the unused pages NaN) in
    ``layout`` ("linear": [PAGE_BLOCKS, PAGE, Hkv, D]; "vectorized": k [PAGE_BLOCKS, Hkv,
    D/kVS, PAGE, kVS], v [PAGE_BLOCKS, Hkv, PAGE/kVS, D, kVS]), the int32 block table
    [1, pages] and seqlen_k [1]."""
    n = k.shape[1] // PAGE
    assert n == len(PAGES), "the case's columns fill the page table"
    caches = []
    for t in (k, v):
        cache = torch.full((PAGE_BLOCKS, PAGE, *t.shape[2:]), math.nan).to(t.dtype).to(t.device)
        for page, phys in enumerate(PAGES):
            cache[phys] = t[0, page * PAGE:(page + 1) * PAGE]
        caches.append(cache)
    if layout == "vectorized":
        caches = _vectorized(*caches)
    elif layout != "linear":
        raise AssertionError(f"the conformance page cache has no layout {layout!r}: add it here")
    table = torch.tensor([PAGES], dtype=torch.int32, device=k.device)
    return (*caches, table, torch.tensor([k.shape[1]], dtype=torch.int32, device=k.device))


def _vectorized(kc: torch.Tensor, vc: torch.Tensor):
    """A linear cache [NB, P, Hkv, D] in the vectorized 5-D layout (``fa_lab.paged``):
    k [NB, Hkv, D/kVS, P, kVS], v [NB, Hkv, P/kVS, D, kVS], kVS = 16 bytes / element."""
    nb, ps, hkv, d = kc.shape
    kvs = paged.vector_size(kc.dtype)
    k5 = kc.reshape(nb, ps, hkv, d // kvs, kvs).permute(0, 2, 3, 1, 4).contiguous()
    v5 = vc.reshape(nb, ps // kvs, kvs, hkv, vc.shape[-1]).permute(0, 3, 1, 4, 2).contiguous()
    return k5, v5


def paged_call(caps, q, k, v):
    """The paged call the implementation's ``Caps.paged_call`` form takes, over
    ``page_cache`` of k and v in the form's first layout, for one sequence of q [1, R, H, D]:
    (args, the keyword arguments, causal). Non-causal where the form takes it, else
    bottom-right causal; q packed [R, H, D] with cu_seqlens where the form is packed."""
    form = PAGED_CALLS[caps.paged_call]
    kc, vc, table, seqlen_k = page_cache(k, v, form.layouts[0])
    kw = {"block_table": table, "seqlen_k": seqlen_k, "kv_cache_layout": form.layouts[0]}
    if not form.packed:
        return (q, kc, vc), kw, False not in form.causal
    rows, cols = q.shape[1], k.shape[1]
    kw.update(cu_seqlens_q=torch.tensor([0, rows], dtype=torch.int32, device=q.device),
              cu_seqlens_kv=torch.tensor([0, cols], dtype=torch.int32, device=q.device),
              max_seqlen_q=rows)
    return (q[0], kc, vc), kw, False not in form.causal


def _run_entry_point(claim: Claim, q, k, v, policy, backend, rows):
    """A non-routed family through the entry point of the feature it serves
    (``ENTRY_POINTS``): out [rows, D]."""
    served = [f for f in ENTRY_POINTS if f in FAMILIES[claim.family].caps(claim.impl).features]
    if not served or dispatch.serving(served[0]).name != claim.family:
        raise AssertionError(f"family {claim.family!r} is not routed and serves no feature of "
                             "ENTRY_POINTS: add its entry point there")
    left = WINDOW_LEFT if claim.feature == WINDOW else COLS
    if claim.feature != "trace":
        out = getattr(fa_lab, ENTRY_POINTS[served[0]])(
            q, k, v, window_left=left, window_right=COLS, causal=False, rescale=policy,
            backend=backend)
        return out.cpu().double()[0, :, 0]
    # swa_attn_func records no trace: the same plan it makes, run with a recorder
    call = fa_lab.api.check_call(q, k, v, causal=False, rescale=policy, backend=backend)._with(
        kernel_asked=claim.family, options={"window_left": left, "window_right": COLS,
                                            "rescale": policy})
    recorder = TraceRecorder(normalize_rows(range(rows), 0, 0, (1, 1, rows)), group_size=1)
    dispatch.run(dispatch.plan(call), recorder)
    return recorder.build(kernel=claim.family, policy=policy, log2_per_unit=1.0,
                          threshold_units=policy.threshold).out.cpu().double()


def run_and_reference(claim: Claim, device: str = "cpu"):
    """(the implementation's out, the reference's out), both [tokens, H, D] fp64 on the
    CPU; ``device="cuda"`` runs the compiled ports (the faithful one as backend="triton")."""
    fam = FAMILIES[claim.family]
    caps = fam.caps(claim.impl)
    policy = policy_for(claim, caps)
    ref_policy = RULES[claim.value][1] if claim.field == "rule" else policy
    dtype, D = _dtype(caps), min(caps.head_dims)
    if claim.field in FP8_PARAMETERS:  # a claim on fp8 inputs, whatever else the family takes
        dtype, D = "fp8", 128 if 128 in caps.head_dims else min(caps.head_dims)
    backend = "triton" if device != "cpu" and claim.impl == "faithful" else BACKEND[claim.impl]
    routed = fam.routed
    split = claim.feature == "num_kv_splits"
    rows, cols = ((SPLIT_ROWS, SPLIT_COLS.get(dtype, 640)) if split
                  else (ROWS if routed else COLS, COLS))
    split_at = SPLIT_AT.get(dtype, 384)
    q, k, v, c = (make_case(dtype, D, rows, cols, THIRD, split_at) if split
                  else make_case(dtype, D, rows, cols))
    if claim.feature == HEAD_DIMS_V:
        v = v[..., :min(d for d in caps.head_dims_v if d < D)].contiguous()
    if claim.feature == WINDOW:
        v = v.double()
        v[:, :SEG] += 2.0
        v = v.to(q.dtype)
    q, k, v = q.to(device), k.to(device), v.to(device)
    fp8 = dtype == "fp8"
    kw = dict(causal=False, rescale=policy, backend=backend)
    if fp8:
        kw.update(q_descale=1.0, k_descale=1.0, v_descale=1.0)
    mods, bias2, sink2 = {}, None, None
    pos = offsets(rows, cols)
    if claim.feature == "paged":  # the form the implementation's paged kernel takes
        args, mods, kw["causal"] = paged_call(caps, q, k, v)
    else:
        args = (q, k, v)
    if claim.feature == "bias":
        g = torch.Generator().manual_seed(3)
        bias = (torch.rand(rows, cols, generator=g) - 0.5).to(torch.bfloat16)
        mods["bias"], bias2 = bias.to(device), bias.double() * math.log2(math.e)
    elif claim.feature == "alibi_slopes":
        mods["alibi_slopes"] = torch.tensor([2.0 ** -9], device=device)
        bias2 = -(2.0 ** -9) * pos.abs() * math.log2(math.e)
    elif claim.feature == "sink":
        mods["sink"] = torch.tensor([1.5], device=device)
        sink2 = torch.tensor([1.5 * math.log2(math.e)], dtype=torch.float64)
    elif claim.feature == WINDOW:  # row i sees keys from i - WINDOW_LEFT on
        bias2 = torch.where(pos > WINDOW_LEFT, -math.inf, 0.0)
    if kw["causal"]:  # bottom-right: row i sees keys up to i + cols - rows
        bias2 = causal_mask(rows, cols) + (0.0 if bias2 is None else bias2)

    def ref_one(qs, ks, vs):
        qd, kd = qs.cpu().double()[0, :, 0], ks.cpu().double()[0, :, 0]
        s2 = (qd @ kd.T) * c
        if bias2 is not None:
            s2 = s2 + bias2
        vd = vs.cpu().double()[0, :, 0]
        if split:
            return split_reference(s2[None], vd, ref_policy, fp8=fp8, at=split_at)[0]
        return reference(s2[None], vd, ref_policy, fp8=fp8, sink2=sink2)[0]

    with warnings.catch_warnings():
        warnings.simplefilter("error", fa_lab.RoutingWarning)
        warnings.filterwarnings("ignore", r"p_headroom=.* exceeds log2\(448\)", UserWarning)
        if not routed:
            return _run_entry_point(claim, q, k, v, policy, backend, rows), ref_one(q, k, v)
        if split:
            mods["num_kv_splits"] = SPLITS
        planned = fa_lab.api.plan(*args, kernel=claim.family, **kw, **mods)
        assert (planned.family, planned.backend) == (claim.family, backend), (
            f"{claim}: planned {planned.family}/{planned.backend}")
        if claim.feature == "varlen":
            qq, kk, vv = torch.cat([q, q], 1)[0], torch.cat([k, k], 1)[0], torch.cat([v, v], 1)[0]
            cq = torch.tensor([0, rows, 2 * rows], dtype=torch.int32, device=device)
            ck = torch.tensor([0, cols, 2 * cols], dtype=torch.int32, device=device)
            out = fa_lab.flash_attn_func(qq, kk, vv, cu_seqlens_q=cq, cu_seqlens_kv=ck,
                                         max_seqlen_q=rows, max_seqlen_kv=cols,
                                         kernel=claim.family, **kw)
            ref = ref_one(q, k, v)
            return out.cpu().double()[:, 0], torch.cat([ref, ref])
        if claim.feature == "trace":
            tr = fa_lab.trace(q, k, v, rows=range(rows), kernel=claim.family, **kw)
            return tr.out.cpu().double(), ref_one(q, k, v)
        out = fa_lab.flash_attn_func(*args, kernel=claim.family, **kw, **mods)
        out = out[None] if out.dim() == 3 else out  # a packed call's [rows, H, D]
        return out.cpu().double()[0, :, 0], ref_one(q, k, v)


def check(claim: Claim, device: str = "cpu") -> None:
    """Run ``claim`` and compare with the reference: the same NaN and inf rows, and finite
    outputs within the input format's error relative to the reference's (at least 1; a
    row of zeros, where an overflowed l meets a saturated O, included). AssertionError
    naming the claim."""
    if MODES.is_mode(claim):
        out, ref = MODES.run_and_reference(claim, device)
    elif (claim.field in values.POLICY_FIELDS or claim.field in PARAMETERS
          or claim.field in FP8_PARAMETERS or claim.field == "rule"):
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
    fp8 = claim.field in FP8_PARAMETERS or FAMILIES[claim.family].caps(claim.impl).dtypes <= {"fp8"}
    tol = 0.1 if fp8 else 0.02
    err = ((out - ref).abs() / ref.abs().clamp(min=1.0)).where(fin, torch.zeros_like(out))
    if float(err.max()) > tol:
        r = int(err.amax(-1).argmax())
        bad.append(f"row {r} differs by {float(err[r].max()):.3g} (tolerance {tol})")
    if bad:
        raise AssertionError(f"{claim} does not run the value as declared: " + "; ".join(bad))
