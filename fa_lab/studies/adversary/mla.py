"""The attack's search space for the MLA decode (``fa_lab.mla.mla_decode``, the ``mla_decode``
family: FlyDSL ``mla_fwd_decode_m16x8_fp8_fp8`` at main 11c4174d), its judge and its search.

    from fa_lab.studies.adversary import mla
    res = mla.search(budget_s=60, seed=0)                 # upstream: P cast as it is
    res.found, res.shrunk.size, res.repro
    mla.search(p_headroom=8, budget_s=60).found          # the lift: nothing in N runs

An ``MLACandidate`` (``MLA_FIELDS``) is one decode call of 128 heads, one token per sequence:

* **contexts and split boundaries**: sequence 0 holds ``64 (tiles - 1) + last`` keys (64-key
  tiles: ``last`` walks the last one from empty to full), sequence i ``i * ctx_step`` more
  (clamped to 0 .. ``MAX_CONTEXT``); ``empty_seq`` empties the first or last one;
  ``num_kv_splits`` (1..4) cuts each into chunks the reduce merges;
* **the scores** (log2 units, ``softmax_scale`` = f32(ln 2), so a score is the dot of Q's and
  K's 64 rope columns): ``"gaussian"``, N(0, ``spread``^2) per head and key; ``"peak"``, one
  key (at ``peak_at`` of the context) above the rest by ``spread`` (h + 1) / 128 for head h
  (so one call tries 128 gaps up to ``spread``), every key plus N(0, ``jitter``^2). Each value passes e4m3 on the way in, as the kernel's inputs do; the
  judge's reference takes the same fp8 values;
* **V** (the 512 latent columns): all ones, random signs or N(0, 1).

**What fails** (``MLA_CLASSES``): ``silent``, a finite row (sequence, head) off the fp64
reference by more than ``SILENT_TOL`` = 2^-3 of the sequence's max|V| (in every column);
``nonfinite``, a row whose sequence has a key comes out NaN or inf; ``empty``, a sequence
with no key gives anything but 0 (the kernel's empty item is NaN, §14.3). The default is
``silent`` and ``nonfinite``. The tolerance is the one the kernel with a lift cannot exceed
in this space: with P lifted by 2^H before its cast, a key's e4m3 P is off by at most 2^-4
of P (normal) or 2^-(10 + H) (subnormal or flushed), so a row is off by at most
(2^-4 + n 2^-(10 + H)) max|V| for n keys (docs/semantics.md §14.4), plus bf16's 2^-9 of
the output: under 0.07 max|V| for H = 8 and n <= ``MAX_CONTEXT`` = 512; without the lift
(H = 0) the bound is 2^-4 + n 2^-10, which the space exceeds from 65 keys on.

**Fitness**: the judged symptom's own measure: 90 x the largest error of a judged finite row
over ``SILENT_TOL``, plus 10 x the mean of the rows' errors over it (0 .. 100; the mean
tells apart calls whose largest error the bf16 output rounds to the same step); 129 once a
class asked for fails. Candidates are judged in
full (the reference is cheap: one fp64 product per sequence).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from fa_lab.kernels.mla_decode import VERSIONS
from fa_lab.kernels.mla_decode import model as M
from fa_lab.numerics import f32

from . import climb
from .decode import tiled_contexts
from .judge import Verdict
from .optimize import Attack

#: The candidate fields: (kind, choices or (low, high)).
MLA_FIELDS = {
    "n_seqs": ("int", (1, 2)),
    "tiles": ("int", (1, 8)),
    "last": ("int", (0, M.BLOCK_N)),
    "ctx_step": ("int", (-256, 256)),
    "empty_seq": ("choice", ("none", "first", "last")),
    "num_kv_splits": ("int", (1, 4)),
    "scores": ("choice", ("gaussian", "peak")),
    "spread": ("float", (0.0, 24.0)),
    "jitter": ("float", (0.0, 4.0)),
    "peak_at": ("float", (0.0, 1.0)),
    "values": ("choice", ("ones", "signs", "normal")),
    "seed": ("int", (0, 2 ** 31 - 1)),
}
MAX_CONTEXT = 8 * M.BLOCK_N
MLA_CLASSES = ("silent", "nonfinite", "empty")
#: A finite row off the fp64 reference by more than this share of max|V| is ``silent``.
SILENT_TOL = 2.0 ** -3
MLA_SPACE_NAME = "mla_decode"
#: The attack's target: the kernel (its one modelled version, ``VERSIONS``).
TARGET = "mla_decode"
SPACE = {"name": MLA_SPACE_NAME, "mods": [], "zoo": False,
         "description": "MLA decode calls (128 heads, fp8 Q and KV): 1..2 sequences of up to "
                        "8 64-key tiles, empty contexts, 1..4 KV splits, Gaussian or "
                        "one-peak scores up to 24 log2 units apart, V of ones, signs or N(0, 1)",
         "fields": {f: list(r) for f, (_, r) in MLA_FIELDS.items()}}


@dataclass(frozen=True)
class MLACandidate:
    """One MLA decode call of the space (module docstring); ``build`` makes it."""

    n_seqs: int = 1
    tiles: int = 4
    last: int = 64
    ctx_step: int = 0
    empty_seq: str = "none"
    num_kv_splits: int = 1
    scores: str = "gaussian"
    spread: float = 1.0
    jitter: float = 0.0
    peak_at: float = 0.0
    values: str = "normal"
    seed: int = 0

    @property
    def contexts(self) -> list[int]:
        return tiled_contexts(self, M.BLOCK_N, MAX_CONTEXT)

    @property
    def size(self) -> dict:
        return {"contexts": self.contexts, "splits": self.num_kv_splits, "scores": self.scores,
                "spread": self.spread, "values": self.values}

    def mod_summary(self) -> dict:
        return {}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def canonical(c: MLACandidate) -> MLACandidate:
    """The same call with the fields it does not use at their defaults."""
    base, vals = MLACandidate(), {}
    if c.scores == "gaussian":
        vals.update(jitter=base.jitter, peak_at=base.peak_at)
    if c.n_seqs == 1:
        vals["ctx_step"] = base.ctx_step
    return dataclasses.replace(c, **vals)


def build(c: MLACandidate):
    """The candidate's call: (query [S, 128, 576], kv_buffer [P, 1, 1, 576], kv_indptr,
    kv_page_indices, softmax_scale), float8_e4m3fn tensors, pages in position order."""
    g = torch.Generator().manual_seed(int(c.seed))
    ctx = c.contexts
    S, P, R = len(ctx), sum(ctx), M.QK_ROPE_HEAD_DIM
    q = torch.zeros(S, M.NUM_HEADS, M.QK_HEAD_DIM)
    kv = torch.zeros(P, M.QK_HEAD_DIM)
    if c.values == "ones":
        kv[:, :M.V_HEAD_DIM] = 1.0
    elif c.values == "signs":
        kv[:, :M.V_HEAD_DIM] = torch.randint(0, 2, (P, M.V_HEAD_DIM), generator=g) * 2.0 - 1.0
    else:
        kv[:, :M.V_HEAD_DIM] = torch.randn(P, M.V_HEAD_DIM, generator=g)
    start = 0
    for b, n in enumerate(ctx):
        keys = kv[start:start + n]
        if c.scores == "gaussian":  # rope dots of N(0,1) x N(0, (spread / 8)^2): std spread
            q[b, :, M.V_HEAD_DIM:] = torch.randn(M.NUM_HEADS, R, generator=g)
            keys[:, M.V_HEAD_DIM:] = torch.randn(n, R, generator=g) * (c.spread / math.sqrt(R))
        else:  # column 0 of the rope: the peak (head h's gap); the other 63: the jitter's dots
            q[b, :, M.V_HEAD_DIM] = c.spread * torch.arange(1, M.NUM_HEADS + 1) / M.NUM_HEADS
            q[b, :, M.V_HEAD_DIM + 1:] = torch.randn(M.NUM_HEADS, R - 1, generator=g)
            keys[:, M.V_HEAD_DIM + 1:] = (torch.randn(n, R - 1, generator=g)
                                          * (c.jitter / math.sqrt(R - 1)))
            if n:
                keys[min(int(c.peak_at * n), n - 1), M.V_HEAD_DIM] = 1.0
        start += n
    fp8 = torch.float8_e4m3fn
    indptr = torch.tensor([0, *np.cumsum(ctx).tolist()], dtype=torch.int32)
    return (q.to(fp8), kv.to(fp8).reshape(P, 1, 1, M.QK_HEAD_DIM), indptr,
            torch.arange(P, dtype=torch.int32), f32(math.log(2.0)))


def run(c: MLACandidate, p_headroom: float = 0.0, *, call=None) -> torch.Tensor:
    """The model's output [S, 128, 512] (bf16 as the call returns it, in fp32); ``call``:
    ``build(c)`` when already made."""
    from fa_lab import mla

    out, _ = mla.mla_decode(*(call or build(c)), num_kv_splits=c.num_kv_splits,
                            backend="emulator", p_headroom=p_headroom)
    return out.float()


def reference(c: MLACandidate, *, call=None):
    """Per sequence, the fp64 reference output [128, 512] (None for an empty one) and its
    max|V| (the latent columns' largest magnitude); ``call``: ``build(c)`` when made."""
    query, kv_buffer, indptr, _, scale = call or build(c)
    kv = kv_buffer.float().reshape(-1, M.QK_HEAD_DIM)
    ind = indptr.tolist()
    refs = []
    for b in range(len(ind) - 1):
        keys = kv[ind[b]:ind[b + 1]]
        if keys.shape[0] == 0:
            refs.append((None, 0.0))
            continue
        o, _ = M.reference(query[b].float(), keys, scale)
        refs.append((o, float(keys[:, :M.V_HEAD_DIM].abs().max())))
    return refs


def check_classes(classes) -> tuple:
    """``classes`` (None: ``("silent", "nonfinite")``; a comma-separated str or names) as a
    tuple of ``MLA_CLASSES``; ValueError/TypeError naming ``classes``."""
    if classes is None:
        return ("silent", "nonfinite")
    names = [x.strip() for x in classes.split(",")] if isinstance(classes, str) else list(classes)
    if not names or not all(isinstance(x, str) for x in names):
        raise TypeError(f"classes must name classes of failure as str, got {classes!r}")
    bad = [x for x in names if x not in MLA_CLASSES]
    if bad:
        raise ValueError(f"classes: unknown MLA decode class {bad[0]!r}; choose from "
                         f"{', '.join(MLA_CLASSES)}")
    return tuple(x for x in MLA_CLASSES if x in names)


def check_headroom(p_headroom) -> float:
    """``p_headroom`` as a float in 0 .. log2(448) (``fa_lab.mla.MAX_HEADROOM``)."""
    from fa_lab.mla import MAX_HEADROOM

    if isinstance(p_headroom, bool) or not isinstance(p_headroom, (int, float)):
        raise TypeError(f"p_headroom must be a number, got {p_headroom!r}")
    if not 0 <= p_headroom <= MAX_HEADROOM:
        raise ValueError(f"p_headroom must be in 0 .. log2(448) = {MAX_HEADROOM:.3f}, "
                         f"got {p_headroom!r}")
    return float(p_headroom)


def judge(c: MLACandidate, p_headroom: float = 0.0, *, classes=None) -> Verdict:
    """Run the MLA model with P lifted by 2^``p_headroom`` (0: upstream) and the fp64
    reference on ``c``; count the [sequence, head] rows that show any of ``classes``
    (module docstring). ``max_err``: the largest error of a judged finite row, in units of
    its sequence's max|V|."""
    classes = check_classes(classes)
    H = check_headroom(p_headroom)
    t0 = time.perf_counter()
    call = build(c)
    out = run(c, H, call=call)
    S = out.shape[0]
    finite = torch.isfinite(out).all(-1)
    defined = torch.zeros(S, M.NUM_HEADS, dtype=torch.bool)
    err = torch.zeros(S, M.NUM_HEADS, dtype=torch.float64)
    for b, (ref, vmax) in enumerate(reference(c, call=call)):
        if ref is None:
            continue
        defined[b] = True
        e = (out[b].double() - ref).abs().amax(-1) / max(vmax, 1e-300)
        err[b] = torch.where(finite[b], e, torch.zeros_like(e))
    rows = {"silent": defined & finite & (err > SILENT_TOL), "nonfinite": defined & ~finite,
            "empty": ~defined & (~finite | (out != 0).any(-1))}
    bad, found = torch.zeros_like(defined), []
    for name in classes:
        if bool(rows[name].any()):
            found.append(name)
            bad |= rows[name]
    worst = float(err.max()) if S else 0.0
    mean = float(err[defined].mean()) if bool(defined.any()) else 0.0
    fit = 129.0 if found else (90.0 * min(worst / SILENT_TOL, 1.0)
                               + 10.0 * min(mean / SILENT_TOL, 1.0))
    return Verdict(failed=bool(found), bad_rows=bad.nonzero().tolist(), fitness=fit,
                   ref_finite=bool(defined.all()), max_err=worst,
                   seconds=time.perf_counter() - t0,
                   undefined_rows=(~defined).nonzero().tolist(), classes=found)


def target_name(p_headroom: float) -> str:
    """The attack's name for the kernel with a lift: ``mla_decode`` (upstream) or
    ``mla_decode:p_headroom=H``."""
    return TARGET if p_headroom == 0 else f"{TARGET}:p_headroom={p_headroom:g}"


class MLAAttack(Attack):
    """``Attack`` on the MLA decode: ``repro`` rebuilds the shrunk call and judges it."""

    p_headroom: float = 0.0

    @property
    def repro(self) -> str:
        c = self.shrunk or self.best
        if c is None:
            return ""
        base = MLACandidate()
        short = {k: v for k, v in c.to_dict().items() if getattr(base, k) != v}
        cls = ("" if tuple(self.classes) == check_classes(None)
               else f", classes={tuple(self.classes)!r}")
        return (f"from fa_lab.studies.adversary import mla; print(mla.judge(mla.MLACandidate("
                f"**{short}), {self.p_headroom!r}{cls}).failed)")


def _clip(f, x):
    kind, r = MLA_FIELDS[f]
    if kind == "choice":
        return x if x in r else r[0]
    x = min(max(x, r[0]), r[1])
    return int(round(x)) if kind == "int" else float(x)


#: The share of numeric draws and steps that put a number at an end of its range.
AT_END = 0.25


def random_candidate(rng: np.random.Generator) -> MLACandidate:
    """A draw: each number uniform in its range or (``AT_END`` of the time) at one of its
    ends, each choice uniform."""
    vals = {}
    for f, (kind, r) in MLA_FIELDS.items():
        if kind == "choice":
            vals[f] = r[rng.integers(len(r))]
        elif f != "seed" and rng.random() < AT_END:
            vals[f] = r[int(rng.integers(2))]
        elif kind == "int":
            vals[f] = int(rng.integers(r[0], r[1] + 1))
        else:
            vals[f] = float(rng.uniform(r[0], r[1]))
    return MLACandidate(**vals)


def mutate(c: MLACandidate, rng: np.random.Generator, sigma: float) -> MLACandidate:
    """A few fields moved: numbers to an end (``AT_END`` of the time) or by a Gaussian step
    of ``sigma`` times their range, choices redrawn; the seed redrawn."""
    vals = c.to_dict()
    names = [f for f in MLA_FIELDS if f != "seed"]
    for f in rng.choice(names, size=min(max(1, int(rng.poisson(2.0))), len(names)), replace=False):
        kind, r = MLA_FIELDS[f]
        if kind == "choice":
            vals[f] = r[rng.integers(len(r))]
        elif rng.random() < AT_END:
            vals[f] = r[int(rng.integers(2))]
        else:
            vals[f] = _clip(f, vals[f] + rng.normal() * sigma * (r[1] - r[0]))
    vals["seed"] = int(rng.integers(0, 2 ** 31 - 1))
    return MLACandidate(**vals)


#: The shrinker's simplifications, in order: (field, value or values of the current one).
_SIMPLER = (("n_seqs", 1), ("empty_seq", "none"), ("num_kv_splits", 1), ("values", "ones"),
            ("jitter", 0.0), ("scores", "peak"), ("peak_at", 0.0),
            ("spread", lambda v: [float(math.ceil(v))] if v != math.ceil(v) else []),
            ("tiles", lambda v: list(range(1, v))),
            ("last", lambda v: [x for x in (0, 1, 2, 4, 8, 16, 32) if x < v]))


def shrink(c: MLACandidate, p_headroom: float, classes, *, budget_s: float = 20.0):
    """Greedy passes over ``_SIMPLER`` (``climb.shrink``), each change kept while the call
    still fails. Returns the shrunk candidate and the runs spent."""
    return climb.shrink(c, _SIMPLER, canonical=canonical, budget_s=budget_s,
                        fails=lambda x: judge(x, p_headroom, classes=classes).failed)


def search(p_headroom: float = 0.0, *, budget_s: float = 60.0, seed: int = 0, classes=None,
           max_evals: int | None = None, random_starts: int = 8, lam: int = 6,
           shrink_found: bool = True, progress=None) -> MLAAttack:
    """Look for a call of the space on which the MLA decode with P lifted by
    2^``p_headroom`` (0: upstream's cast) fails for ``classes`` (default ``silent`` and
    ``nonfinite``): ``climb.run_search``'s draws and evolution strategy, stopping at the
    first failure and shrinking it. Every argument is checked before any work."""
    H = check_headroom(p_headroom)
    classes = check_classes(classes)
    climb.check_numbers(budget_s=budget_s, seed=seed, random_starts=random_starts, lam=lam)
    res = MLAAttack(policy=target_name(H), space=dict(SPACE), budget_s=float(budget_s),
                    seed=int(seed), threshold=None, structured=False, optimizer="es",
                    classes=classes)
    res.p_headroom = H
    found = climb.run_search(
        res, draw=random_candidate, mutate=mutate,
        judge=lambda c: judge(c, H, classes=classes),
        canonical=lambda c: canonical(MLACandidate(**{f: _clip(f, x)
                                                      for f, x in c.to_dict().items()})),
        budget_s=budget_s, seed=seed, max_evals=max_evals, random_starts=random_starts,
        lam=lam, progress=progress)
    climb.finish(res, found, shrink_found=shrink_found,
                 shrink_fn=lambda c: shrink(c, H, classes, budget_s=min(20.0, max(5.0, budget_s))),
                 judge_full=lambda c: judge(c, H, classes=classes))
    return res


def summary(res: MLAAttack) -> str:
    """A few lines: what was found, how fast, how small; or how many runs found nothing."""
    if res.found:
        return (f"{res.policy}: FAILS ({', '.join(res.found_classes)}). First failure after "
                f"{res.time_to_first_s:.1f} s ({res.evals_to_first} model runs) in space "
                f"{MLA_SPACE_NAME!r}; shrunk in {res.shrink_evals} runs to {res.shrunk.size}; "
                f"{len(res.bad_rows)} rows [sequence, head] fail\n  repro: {res.repro_command}")
    return (f"{res.policy}: nothing in {res.evals} runs found a failure ({res.search_s:.1f} s, "
            f"budget {res.budget_s:g} s, space {MLA_SPACE_NAME!r}, classes "
            f"{', '.join(res.classes)}); best fitness {res.best_fitness:.1f} (100: an error of "
            f"{SILENT_TOL:g} max|V|; 129: a failure)")


def describe(p_headroom: float = 0.0) -> str:
    repo, commit, files = VERSIONS["main-11c4174d"]
    lift = "P cast to e4m3 as it is" if p_headroom == 0 else f"P lifted by 2^{p_headroom:g}"
    return f"mla_fwd_decode_m16x8_fp8_fp8 at {repo} {commit[:8]} ({lift})"


def record(runs, *, params: dict, provenance: dict | None = None) -> dict:
    """The attack record (``record.RECORD_KEYS``) of one or more runs of ``search`` with the
    same ``p_headroom``: ``runs`` is a list of ``(MLAAttack, wall_s)``."""
    from .record import summary_row

    if not runs:
        raise ValueError("runs is empty: a record holds at least one attack run")
    dicts = [{**attack.to_dict(), "p_headroom": attack.p_headroom, "wall_s": float(wall)}
             for attack, wall in runs]
    first = dicts[0]
    rec = {"policy": first["policy"], "found": first["found"], "repro": first["repro"],
           "size": first["size"], "mods": [], "description": describe(runs[0][0].p_headroom),
           "user_policy": False, "summary": [summary_row(d) for d in dicts], "runs": dicts,
           "params": dict(params)}
    if provenance is not None:
        rec["provenance"] = provenance
    return rec
