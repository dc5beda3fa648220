"""The attack's search space for the paged fp8 prefill (FlyDSL #1066,
``fa_lab.kernels.swp_fp8.paged``, a bare call as ``flash_attn_func`` runs it) and its search.

    from fa_lab.studies.adversary import paged_fp8
    res = paged_fp8.search("flydsl-6aeb4321", budget_s=60, seed=0, classes="stale_nan,empty")
    res.found, res.shrunk.size, res.repro

A ``PagedCandidate`` (``PAGED_FIELDS``) is one packed causal call over a page-64 cache
(``kernels/swp_fp8/paged_cases.make``):

* **contexts and page boundaries**: sequence 0 holds ``128 (pairs - 1) + last`` keys, so
  ``last`` walks its last tile pair from one key (an odd page count: the pair's partner
  page is read past the context) to full; sequence i adds ``i * ctx_step`` (clamped to
  0 .. 384); ``empty_seq`` gives the first or last sequence no key (an empty context);
  a call of several sequences is sized by the longest context rounded up to a pair
  (``max_seqlen_kv``), as the paired-page kernel needs; one sequence is sized by its own
  length (upstream builds it without varlen), so an odd page count there runs the
  per-tile kernel, which the search runs too (its region: ``onset.paged_fp8_tile``);
* **the query**: ``q_len`` packed query rows per sequence (``q_step`` more for each next
  one), causal bottom-right: more rows than keys leave rows that see nothing, whose tile
  maxima are floored (``descale_log2`` lifts q's descale, and with it the kernel's ls,
  towards the floor's overflow);
* **page tables**: shuffled or in order, ``spare`` unused entries per sequence;
* **what the cache holds where no key is** (``tail``): fresh values, stale ones at e4m3's
  largest magnitude, or NaN: the last page's tail, the partner page, the padding pairs'
  reads, the pages no table names;
* **scales**: K's spread (``k_log2``) and one outlier key of sequence 0 whose K or V is
  ``2^outlier_log2`` times the rest before the per-tensor quantization (its scale then
  flushes the others).

**What fails** (``PAGED_CLASSES``): ``nonfinite``, a row that sees a key is NaN or inf with
every slot without a key finite; ``stale_nan``, a row finite when those slots hold stale
finite values and NaN when they hold NaN (P = 0 times NaN in P V); ``empty``, a row that
sees no key gives anything but 0; ``silent``, a finite row off the fp64 reference by more
than ``SILENT_TOL`` x max|V|.

**Fitness**: the paged region's (``onset.bound("swp_fp8_paged")``) structural closeness: 50
once a row group reads V past its context, 25 once a row sees no key, plus how near ls
comes to the causal floor's overflow (0 .. 20); 129 once a class asked for fails.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from fa_lab.kernels import swp_fp8

from . import climb
from .judge import SILENT_TOL, Verdict
from .optimize import Attack

cases = swp_fp8.paged_cases

PAGED_FIELDS = {
    "n_seqs": ("int", (1, 3)),
    "pairs": ("int", (1, 3)),
    "last": ("int", (1, 128)),
    "ctx_step": ("int", (-256, 256)),
    "empty_seq": ("choice", ("none", "first", "last")),
    "q_len": ("int", (1, 96)),
    "q_step": ("int", (-48, 48)),
    "heads": ("choice", (1, 2)),
    "shuffle": ("choice", (True, False)),
    "spare": ("int", (0, 3)),
    "tail": ("choice", cases.TAILS),
    "k_log2": ("float", (-3.0, 5.0)),
    "descale_log2": ("float", (0.0, 14.0)),
    "outlier_log2": ("float", (0.0, 14.0)),
    "outlier_at": ("float", (0.0, 1.0)),
    "outlier_in": ("choice", ("v", "k")),
    "seed": ("int", (0, 2 ** 31 - 1)),
}
MAX_CONTEXT = 384
PAGED_CLASSES = ("nonfinite", "stale_nan", "empty", "silent")
PAGED_SPACE_NAME = "paged_fp8"
SPACE = {"name": PAGED_SPACE_NAME, "mods": [], "zoo": False,
         "description": "paged fp8 prefill calls: 1..3 packed causal sequences over a shuffled "
                        "page-64 table, odd page counts, empty contexts, rows that see no key, "
                        "finite, stale or NaN slots without a key, an outlier key or value",
         "fields": {f: list(r) for f, (_, r) in PAGED_FIELDS.items()}}


@dataclass(frozen=True)
class PagedCandidate:
    """One paged fp8 call of the space (module docstring); ``build`` makes it."""

    n_seqs: int = 1
    pairs: int = 1
    last: int = 100
    ctx_step: int = 0
    empty_seq: str = "none"
    q_len: int = 16
    q_step: int = 0
    heads: int = 2
    shuffle: bool = True
    spare: int = 1
    tail: str = "finite"
    k_log2: float = 0.0
    descale_log2: float = 0.0
    outlier_log2: float = 0.0
    outlier_at: float = 0.5
    outlier_in: str = "v"
    seed: int = 0

    @property
    def lens_k(self) -> list[int]:
        c0 = 128 * (self.pairs - 1) + self.last
        lens = [min(max(c0 + i * self.ctx_step, 0), MAX_CONTEXT) for i in range(self.n_seqs)]
        if self.empty_seq != "none" and self.n_seqs > 1:
            lens[0 if self.empty_seq == "first" else -1] = 0
        if max(lens) == 0:   # the kernel needs a key somewhere: the other end keeps c0
            lens[-1 if self.empty_seq == "first" else 0] = c0
        return lens

    @property
    def lens_q(self) -> list[int]:
        return [min(max(self.q_len + i * self.q_step, 1), 128) for i in range(self.n_seqs)]

    @property
    def size(self) -> dict:
        return {"lens_q": self.lens_q, "lens_k": self.lens_k, "H": self.heads, "page": cases.PAGE,
                "tail": self.tail}

    def mod_summary(self) -> dict:
        return {}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def canonical(c: PagedCandidate) -> PagedCandidate:
    """The same call with the fields it does not use at their defaults."""
    base, vals = PagedCandidate(), {}
    if c.outlier_log2 == 0:
        vals.update(outlier_at=base.outlier_at, outlier_in=base.outlier_in)
    if c.n_seqs == 1:
        vals.update(ctx_step=base.ctx_step, q_step=base.q_step, empty_seq=base.empty_seq)
    return dataclasses.replace(c, **vals)


def build(c: PagedCandidate, *, tail: str | None = None):
    """The candidate's call (``paged_cases.Case``; a call of several sequences sized by the
    longest context rounded up to a tile pair, one sequence by its own length)."""
    outlier = None if c.outlier_log2 == 0 else (c.outlier_in, c.outlier_at, 2.0 ** c.outlier_log2)
    probe = cases.make(c.lens_q, c.lens_k, H=c.heads, k_mult=2.0 ** c.k_log2, seed=int(c.seed),
                       shuffle=c.shuffle, spare=c.spare, tail=tail or c.tail, outlier=outlier)
    if c.descale_log2:
        qd = probe.call["q_descale"] * 2.0 ** c.descale_log2
        probe = cases.make(c.lens_q, c.lens_k, H=c.heads, k_mult=2.0 ** c.k_log2,
                           seed=int(c.seed), shuffle=c.shuffle, spare=c.spare,
                           tail=tail or c.tail, outlier=outlier, q_descale=qd)
    if len(c.lens_k) > 1:
        # one sequence builds without varlen: its own lengths are the build's (check_fp8)
        probe.call["max_seqlen_kv"] = 128 * math.ceil(max(c.lens_k) / 128)
    return probe


def run(c: PagedCandidate, version: str, *, tail: str | None = None):
    """The model's output [total_q, H, 128] (fp32) and the case, under the paged version."""
    import warnings

    import fa_lab

    case = build(c, tail=tail)
    with warnings.catch_warnings():   # the causal floor's warning: the judge counts the rows
        warnings.simplefilter("ignore", RuntimeWarning)
        out = fa_lab.flash_attn_func(case.q8, case.k5, case.v5, **case.call, backend="emulator",
                                     upstream=_owner(version))
    return out.float(), case


def _owner(version: str) -> str:
    from fa_lab import upstream

    return next(v.name for v in upstream.VERSIONS.values() if v.fp8_paged == version)


def check_classes(classes) -> tuple:
    """``classes`` (None: ``("nonfinite",)``; a comma-separated str or names) as a tuple of
    ``PAGED_CLASSES``; ValueError/TypeError naming ``classes``."""
    if classes is None:
        return ("nonfinite",)
    names = [x.strip() for x in classes.split(",")] if isinstance(classes, str) else list(classes)
    if not names or not all(isinstance(x, str) for x in names):
        raise TypeError(f"classes must name classes of failure as str, got {classes!r}")
    bad = [x for x in names if x not in PAGED_CLASSES]
    if bad:
        raise ValueError(f"classes: unknown paged fp8 class {bad[0]!r}; choose from "
                         f"{', '.join(PAGED_CLASSES)}")
    return tuple(x for x in PAGED_CLASSES if x in names)


def _bad(out):
    return ~torch.isfinite(out).all(-1)


def judge(c: PagedCandidate, version: str = "flydsl-6aeb4321", *, classes=None) -> Verdict:
    """Run the paged model under ``version`` and the fp64 reference on ``c``; count the
    [packed row, head] pairs that show any of ``classes`` (module docstring)."""
    from fa_lab.studies import onset

    classes = check_classes(classes)
    t0 = time.perf_counter()
    out, case = run(c, version)
    ref = cases.reference(case)
    defined = torch.isfinite(ref).all(-1)
    bad_now = _bad(out)
    vmax = max((float(v.float().abs().max()) for _, v in case.dense if v.numel()), default=0.0)
    err = (out.double() - ref).abs().amax(-1)
    rows = {"nonfinite": bad_now & defined, "stale_nan": torch.zeros_like(defined),
            "empty": ~defined & (bad_now | (out != 0).any(-1)),
            "silent": defined & ~bad_now & (err > SILENT_TOL * vmax * case.call["v_descale"])}
    if c.tail == "nan" and bool(rows["nonfinite"].any()):
        clean, _ = run(c, version, tail="stale")
        rows["stale_nan"] = rows["nonfinite"] & ~_bad(clean)
        rows["nonfinite"] = rows["nonfinite"] & _bad(clean)
    bad, found = torch.zeros_like(defined), []
    for name in classes:
        if bool(rows[name].any()):
            found.append(name)
            bad |= rows[name]
    if found:
        fit = 129.0
    else:   # either kernel: the region answers the per-tile call's measure too
        region = onset.bound(f"swp_fp8_paged:{version}")
        m = onset.paged_fp8.measure(case.q8, case.k5, case.v5, **case.call)
        tail_case = cases.make(c.lens_q, c.lens_k, H=c.heads, seed=0, tail="nan", spare=c.spare)
        if "max_seqlen_kv" in case.call:
            tail_case.call["max_seqlen_kv"] = case.call["max_seqlen_kv"]
        reads_past = bool(onset.paged_fp8.measure(tail_case.q8, tail_case.k5, tail_case.v5,
                                                  **tail_case.call).read_past)
        floor = region.margins(m).get("fp8 causal floor overflows", math.inf)
        fit = (50.0 * reads_past + 25.0 * any(p.empty_rows for p in m.parts)
               + max(0.0, 20.0 - max(floor, 0.0)))
    both = defined & ~bad_now
    rel = err[both] / ref[both].abs().amax(-1).clamp_min(1e-300) if both.any() else torch.zeros(1)
    return Verdict(failed=bool(found), bad_rows=bad.nonzero().tolist(), fitness=fit,
                   ref_finite=bool(defined.all()), max_err=float(rel.max()),
                   seconds=time.perf_counter() - t0,
                   undefined_rows=(~defined).nonzero().tolist(), classes=found)


class PagedAttack(Attack):
    """``Attack`` against a paged fp8 version: ``repro`` rebuilds the shrunk call."""

    @property
    def repro(self) -> str:
        c = self.shrunk or self.best
        if c is None:
            return ""
        base = PagedCandidate()
        short = {k: v for k, v in c.to_dict().items() if getattr(base, k) != v}
        cls = "" if tuple(self.classes) == ("nonfinite",) else f", classes={tuple(self.classes)!r}"
        return (f"from fa_lab.studies.adversary import paged_fp8; print(paged_fp8.judge("
                f"paged_fp8.PagedCandidate(**{short}), {self.policy!r}{cls}).failed)")


def _clip(f, x):
    kind, r = PAGED_FIELDS[f]
    if kind == "choice":
        return x if x in r else r[0]
    x = min(max(x, r[0]), r[1])
    return int(round(x)) if kind == "int" else float(x)


def random_candidate(rng: np.random.Generator) -> PagedCandidate:
    """A uniform draw (``outlier_log2`` and ``descale_log2`` 0 half of the time each)."""
    vals = {}
    for f, (kind, r) in PAGED_FIELDS.items():
        if kind == "choice":
            vals[f] = r[rng.integers(len(r))]
        elif kind == "int":
            vals[f] = int(rng.integers(r[0], r[1] + 1))
        else:
            vals[f] = float(rng.uniform(r[0], r[1]))
    for f in ("outlier_log2", "descale_log2"):
        if rng.random() < 0.5:
            vals[f] = 0.0
    return PagedCandidate(**vals)


def mutate(c: PagedCandidate, rng: np.random.Generator, sigma: float) -> PagedCandidate:
    """A few fields moved: numbers by a Gaussian step of ``sigma`` times their range,
    choices redrawn; the seed redrawn."""
    vals = c.to_dict()
    names = [f for f in PAGED_FIELDS if f != "seed"]
    for f in rng.choice(names, size=min(max(1, int(rng.poisson(2.0))), len(names)), replace=False):
        kind, r = PAGED_FIELDS[f]
        vals[f] = (r[rng.integers(len(r))] if kind == "choice"
                   else _clip(f, vals[f] + rng.normal() * sigma * (r[1] - r[0])))
    vals["seed"] = int(rng.integers(0, 2 ** 31 - 1))
    return PagedCandidate(**vals)


#: The shrinker's simplifications, in order: (field, value or values of the current one).
_SIMPLER = (("n_seqs", 1), ("empty_seq", "none"), ("heads", 1), ("outlier_log2", 0.0),
            ("k_log2", 0.0), ("descale_log2", 0.0), ("shuffle", False), ("spare", 0),
            ("ctx_step", 0), ("q_step", 0), ("pairs", lambda v: list(range(1, v))),
            ("q_len", lambda v: [x for x in (1, 2, 4, 8, 16, 32, 64) if x < v]))


def shrink(c: PagedCandidate, version: str, classes, *, budget_s: float = 20.0):
    """Greedy passes over ``_SIMPLER``, each change kept while the call still fails."""
    t0, evals, changed = time.perf_counter(), 0, True
    while changed and time.perf_counter() - t0 < budget_s:
        changed = False
        for f, simpler in _SIMPLER:
            cur = getattr(c, f)
            for val in (simpler(cur) if callable(simpler) else [simpler]):
                if val == cur or time.perf_counter() - t0 >= budget_s:
                    continue
                cand = canonical(dataclasses.replace(c, **{f: val}))
                evals += 1
                if judge(cand, version, classes=classes).failed:
                    c, changed = cand, True
                    break
    return c, evals


def search(version: str = "flydsl-6aeb4321", *, budget_s: float = 60.0, seed: int = 0,
           classes=None, max_evals: int | None = None, random_starts: int = 6, lam: int = 4,
           shrink_found: bool = True) -> PagedAttack:
    """Look for a call of the space on which the paged version fails for ``classes``
    (default ``nonfinite``): ``random_starts`` uniform draws, then a (1 + ``lam``) evolution
    strategy from the fittest; stops at the first failure and shrinks it. Every argument
    is checked before any work."""
    from fa_lab import upstream

    if version not in upstream.FP8_PAGED_VERSIONS:
        raise ValueError(f"version={version!r}: the paged fp8 space attacks one of "
                         f"{tuple(upstream.FP8_PAGED_VERSIONS)}")
    classes = check_classes(classes)
    climb.check_numbers(budget_s=budget_s, seed=seed, random_starts=random_starts, lam=lam)
    res = PagedAttack(policy=version, space=dict(SPACE), budget_s=float(budget_s), seed=int(seed),
                      threshold=None, structured=False, optimizer="es", classes=classes)
    found = climb.run_search(
        res, draw=random_candidate, mutate=mutate, canonical=canonical,
        judge=lambda c: judge(c, version, classes=classes), budget_s=budget_s, seed=seed,
        max_evals=max_evals, random_starts=random_starts, lam=lam, restart_after=None)
    climb.finish(res, found, shrink_found=shrink_found,
                 shrink_fn=lambda c: shrink(c, version, classes,
                                            budget_s=min(20.0, max(5.0, budget_s))),
                 judge_full=lambda c: judge(c, version, classes=classes))
    return res
    res.found, res.first = True, found
    res.time_to_first_s, res.evals_to_first = res.search_s, res.evals
    t1 = time.perf_counter()
    res.shrunk, res.shrink_evals = (shrink(found, version, classes,
                                           budget_s=min(20.0, max(5.0, budget_s)))
                                    if shrink_found else (found, 0))
    res.shrink_s = time.perf_counter() - t1
    final = judge(res.shrunk, version, classes=classes)
    res.bad_rows, res.found_classes = final.bad_rows, final.classes
    return res
