"""Search for inputs on which a rescale policy gives a non-finite output, and shrink them.

    from fa_lab.studies import adversary
    res = adversary.search("lazy_unfixed", budget_s=30, seed=0)
    res.found, res.shrunk.size, res.repro        # the smallest failing input and one line
    adversary.save_regression(res, "tests/regressions/lazy_unfixed.npz")

    fa-lab attack POLICY [--budget 60] [--space scores|values] [--mods bias,alibi,sink]
                         [--seed 0] [--json] [--baseline eager] [--random-starts]
                         [--optimizer cma|es] [--regression FILE.npz]

**What counts as a failure**: the model (``backend="emulator"``, the bf16/f16
DUALWAVE_SWP kernel) returns a row with a non-finite element where an fp64 reference
(``reference.attention(dtype=float64)``, given the same score modifiers) is finite, or,
with ``tolerance``, a finite row whose max error exceeds ``tolerance * max|ref row|``.

**Rows that are not judged.** A row is judged only where the attention it asks for is
defined: the reference's output row *and* its LSE are finite. A row with no finite logit
(every key masked by a -inf bias or by the causal diagonal, and no sink) has softmax
0 / 0. The reference writes 0 there by convention with LSE = -inf, and no kernel owes it
anything: DUALWAVE_SWP returns 0 in causal builds (the causal floor keeps its base finite)
and NaN in non-causal ones. Such rows are reported (``Verdict.undefined_rows``), never
counted as the policy's failure. With a sink the same row *is* defined (all weight on the
sink, output 0) and is judged.

**The search space** (``SPACES``) is named and bounded. An input is a ``Candidate``:

* family ``"onehot"``: rows built from per-row score sequences, as PR #1033's one-hot fp8
  test builds them (and ``experiments.drag_case``): row ``r`` has ``Q[r, d_r] = 8`` on its
  own dimension, so ``K[:, d_r]`` *is* its score sequence. A *trigger* row's per-tile peak
  rises by ``rise`` per tile; ``1 + n_victims`` *victim* rows start at ``start`` and fall
  by ``fall`` per tile (plus ``wobble`` alternating and ``noise``); the peak sits at column
  ``peak_col`` of each tile and the rest of the tile ``background`` below it. The rows'
  places in the wave (``trigger_row``, ``victim_row``), the KV length (``n_tiles``,
  ``trim``), Sq (``n_rows``), ``causal``, D and the dtype are searched too.
* family ``"random"``: the seed's recipe at small sizes: q, v ~ N(0, 1),
  k = N(0, 1) * ``k_scale``.
* V is all ones, random signs or N(0, 1), times ``2**v_log2``: ``"scores"`` keeps
  ``v_log2 <= 2`` (the values users have); ``"values"`` lets it reach 2^126, which finds the
  limit of *every* online softmax's unnormalised fp32 accumulator.
* **Score modifiers**, only when asked (``mods=``, ``--mods``; ``MODS``), as
  ``flash_attn_func`` takes them (natural-log units):

  - ``bias`` [Sq, Skv] in q's dtype: an additive mask (``mask``) of the kinds users pass,
    key padding on the right (``pad_right``: the last ``mask_len`` keys), left padding
    (``pad_left``: the first ``mask_len`` keys), a block-diagonal document mask
    (``block_diag``: documents of ``mask_len`` keys, the rows split among them in
    proportion) or a block-sparse mask (``block_sparse``: blocks of 16 rows x ``mask_len``
    keys, each visible with probability ``mask_density``), with masked entries ``-inf`` or
    ``torch.finfo(dtype).min`` (``mask_value``), plus N(0, ``bias_scale``^2) on every entry;
  - ``alibi_slopes`` [1]: ``alibi_slope`` (0: not passed);
  - ``sink`` [1]: one extra logit ``sink_logit`` (``sink`` False: not passed).

  Without a modifier its fields are pinned "off", so a space without mods is exactly the
  space it was before modifiers existed. A modifier the model of the kernel cannot run
  under the policy is refused before any work (``check_mods``).

**The optimiser** starts from a few structured starting points (a drag case, staircases,
the seed's recipe; ``structured=False`` skips them) and four random draws, then climbs
from the best of them (``optimizer=``, ``--optimizer``; ``OPTIMIZERS``):

* ``"cma"`` (the default): mixed-integer CMA-ES (the ``cma`` package) with restarts. Every
  field the space searches is one coordinate in its own units, bounded by its range and
  scaled by its width: numbers as they are, ints rounded, a choice (family, dtype, D,
  causal, V's kind, the mask's kind) as the index of its value; ints and choices are
  ``cma``'s integer variables, so their steps never shrink below one value. The seed is
  not a coordinate: each candidate draws its own, so a run climbs towards the settings
  where failing draws are likely rather than polishing one lucky draw. A run ends on
  CMA-ES's own termination or after 8 generations without a gain of 0.5; the restarts
  alternate between a fresh random point and the best input so far with the population
  doubled (IPOP).
* ``"es"``: a (1 + λ) evolution strategy with restarts that mutates a few fields at a time
  (choices included) with a step that grows on success and shrinks on failure.

Both maximise the same fitness: ``fa_lab.studies.onset``'s tile-level estimate of how close the
worst row comes to 2^128 (``128 - margin``: continuous, cheap), so the search climbs
towards overflow before any row overflows; every candidate is then judged by the model
itself. Both are deterministic for a seed (given ``max_evals``: the wall-clock budget
decides how far a run gets), and neither touches numpy's global random state.

**Shrinking** a failing input: greedy passes that try fewer tiles, fewer rows, no trim,
non-causal, D = 64, bf16, no noise, no wobble, no extra victims, a flat tile, V = ones, no
modifier (each one off), and the smallest magnitudes (bisection: also the padding length)
and simplest row placement, keeping each change only if the model still fails. The result
is what ``save_regression`` checks in, modifiers included.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

#: The candidate fields: (kind, choices or (low, high)).
FIELDS = {
    "family": ("choice", ("onehot", "random")),
    "dtype": ("choice", ("bf16", "f16")),
    "D": ("choice", (64, 128)),
    "causal": ("choice", (False, True)),
    "n_rows": ("int", (32, 64)),
    "n_tiles": ("int", (4, 48)),
    "trim": ("int", (0, 63)),
    "trigger_row": ("int", (0, 63)),
    "victim_row": ("int", (0, 63)),
    "n_victims": ("int", (0, 8)),
    "start": ("float", (-200.0, 2000.0)),
    "fall": ("float", (0.0, 200.0)),
    "rise": ("float", (0.0, 200.0)),
    "wobble": ("float", (0.0, 50.0)),
    "noise": ("float", (0.0, 20.0)),
    "peak_col": ("int", (0, 63)),
    "background": ("float", (0.0, 64.0)),
    "k_scale": ("float", (1.0, 128.0)),
    "v_kind": ("choice", ("ones", "signed", "randn")),
    "v_log2": ("float", (0.0, 2.0)),
    "seed": ("int", (0, 2 ** 31 - 1)),
    # score modifiers (pinned off unless the space asks for them: MODS)
    "mask": ("choice", ("none", "pad_right", "pad_left", "block_diag", "block_sparse")),
    "mask_len": ("int", (1, 512)),
    "mask_density": ("float", (0.1, 0.9)),
    "mask_value": ("choice", ("-inf", "min")),
    "bias_scale": ("float", (0.0, 16.0)),
    "alibi_slope": ("float", (0.0, 1.0)),
    "sink": ("choice", (False, True)),
    "sink_logit": ("float", (-16.0, 16.0)),
}

#: The score modifiers a search can draw, by ``flash_attn_func``'s argument name (the
#: features of ``fa_lab.capabilities``), and the candidate fields each one owns.
MODS = {
    "bias": ("mask", "mask_len", "mask_density", "mask_value", "bias_scale"),
    "alibi_slopes": ("alibi_slope",),
    "sink": ("sink", "sink_logit"),
}
#: Other spellings accepted for a modifier (the issue's ``--mods bias,alibi,sink``).
MOD_ALIASES = {"alibi": "alibi_slopes"}
_MOD_OF = {f: mod for mod, fs in MODS.items() for f in fs}


def parse_mods(mods) -> tuple:
    """``mods`` (a comma-separated string, or an iterable of names; ``None`` or empty: no
    modifier) as a tuple of ``MODS`` names in ``MODS`` order. ``alibi`` means
    ``alibi_slopes``. TypeError/ValueError naming ``mods`` otherwise."""
    if mods is None:
        return ()
    if isinstance(mods, str):
        names = [x.strip() for x in mods.split(",") if x.strip()]
    else:
        try:
            names = list(mods)
        except TypeError:
            raise TypeError(f"mods must be a comma-separated str or a list of str, "
                            f"got {type(mods).__name__}") from None
        bad = [x for x in names if not isinstance(x, str)]
        if bad:
            raise TypeError(f"mods must name modifiers as str, got {type(bad[0]).__name__}")
    out = set()
    for x in names:
        name = MOD_ALIASES.get(x, x)
        if name not in MODS:
            raise ValueError(f"mods: unknown score modifier {x!r}; choose from "
                             f"{', '.join(MODS)} (alibi means alibi_slopes)")
        out.add(name)
    return tuple(m for m in MODS if m in out)


@dataclass(frozen=True)
class Space:
    """A named, bounded search space: ``bounds`` overrides ``FIELDS``' ranges; ``mods``
    (``MODS`` names) are the score modifiers it draws, and the fields of every other
    modifier are pinned to their "off" default (``Candidate``'s)."""

    name: str
    bounds: dict
    description: str = ""
    mods: tuple = ()

    def kind(self, f):
        return FIELDS[f][0]

    def range(self, f):
        mod = _MOD_OF.get(f)
        if mod is not None and mod not in self.mods:
            off = getattr(Candidate(), f)
            return (off,) if self.kind(f) == "choice" else (off, off)
        return self.bounds.get(f, FIELDS[f][1])

    def with_mods(self, mods) -> Space:
        """This space, also drawing the score modifiers ``mods`` (``parse_mods``); named
        ``"<name>+<mod>+..."``."""
        mods = parse_mods(mods)
        if not mods:
            return self
        both = tuple(m for m in MODS if m in mods or m in self.mods)
        base = self.name.split("+")[0]
        return dataclasses.replace(self, name="+".join((base, *both)), mods=both,
                                   description=f"{self.description}; modifiers: {', '.join(both)}")

    def to_dict(self) -> dict:
        return {"name": self.name, "description": self.description, "mods": list(self.mods),
                "fields": {f: list(self.range(f)) for f in FIELDS}}


SPACES = {
    "scores": Space("scores", {}, "score structure only: |V| <= 4, bf16/f16, one wave or two"),
    "values": Space("values", {"v_log2": (0.0, 126.0)},
                    "as 'scores', and V up to 2^126 (still finite in bf16 and in the reference)"),
}


@dataclass(frozen=True)
class Candidate:
    """One input of the search space (see the module docstring); ``build`` makes it."""

    family: str = "onehot"
    dtype: str = "bf16"
    D: int = 64
    causal: bool = False
    n_rows: int = 32
    n_tiles: int = 8
    trim: int = 0
    trigger_row: int = 0
    victim_row: int = 1
    n_victims: int = 0
    start: float = 100.0
    fall: float = 40.0
    rise: float = 10.0
    wobble: float = 0.0
    noise: float = 0.0
    peak_col: int = 0
    background: float = 0.0
    k_scale: float = 32.0
    v_kind: str = "ones"
    v_log2: float = 0.0
    seed: int = 0
    mask: str = "none"
    mask_len: int = 64
    mask_density: float = 0.5
    mask_value: str = "-inf"
    bias_scale: float = 0.0
    alibi_slope: float = 0.0
    sink: bool = False
    sink_logit: float = 0.0

    @property
    def mods(self) -> tuple:
        """The score modifiers this input passes (``MODS`` names)."""
        used = {"bias": self.mask != "none" or self.bias_scale > 0,
                "alibi_slopes": self.alibi_slope > 0, "sink": bool(self.sink)}
        return tuple(m for m in MODS if used[m])

    def mod_summary(self) -> dict:
        """The modifiers it passes, each with the fields that define it."""
        out = {}
        if "bias" in self.mods:
            b = {"mask": self.mask}
            if self.mask != "none":
                b.update(mask_len=self.mask_len, mask_value=self.mask_value)
                if self.mask == "block_sparse":
                    b["mask_density"] = self.mask_density
            out["bias"] = {**b, "bias_scale": self.bias_scale}
        if "alibi_slopes" in self.mods:
            out["alibi_slopes"] = {"alibi_slope": self.alibi_slope}
        if "sink" in self.mods:
            out["sink"] = {"sink_logit": self.sink_logit}
        return out

    @property
    def seqlen_q(self) -> int:
        return self.n_rows

    @property
    def seqlen_kv(self) -> int:
        return max(1, 64 * self.n_tiles - self.trim)

    @property
    def size(self) -> dict:
        return {"Sq": self.seqlen_q, "Skv": self.seqlen_kv, "D": self.D,
                "tiles": math.ceil(self.seqlen_kv / 64)}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


ONEHOT_ONLY = ("trigger_row", "victim_row", "n_victims", "start", "fall", "rise", "wobble",
               "noise", "peak_col", "background")
RANDOM_ONLY = ("k_scale",)


def canonical(c: Candidate) -> Candidate:
    """The same input with the fields it does not use at their defaults (so equal inputs
    compare equal and a repro names only what matters)."""
    base = Candidate()
    unused = list(RANDOM_ONLY if c.family == "onehot" else ONEHOT_ONLY)
    if c.mask == "none":
        unused += ["mask_len", "mask_density", "mask_value"]
    elif c.mask != "block_sparse":
        unused.append("mask_density")
    if not c.sink:
        unused.append("sink_logit")
    vals = {f: getattr(base, f) for f in unused}
    random_bias = c.bias_scale > 0 or c.mask == "block_sparse"
    if c.family == "onehot" and c.noise == 0 and c.v_kind == "ones" and not random_bias:
        vals["seed"] = base.seed
    return dataclasses.replace(c, **vals)


def _dtype(name):
    return {"bf16": torch.bfloat16, "f16": torch.float16}[name]


def build(c: Candidate):
    """The candidate's (q, k, v), [1, Sq, 1, D] and [1, Skv, 1, D], in its dtype."""
    from fa_lab.kernels.swp_bf16.model import softmax_scale_log2

    dt = _dtype(c.dtype)
    Sq, Skv, D = c.seqlen_q, c.seqlen_kv, c.D
    g = torch.Generator().manual_seed(int(c.seed))
    if c.family == "random":
        q = torch.randn(1, Sq, 1, D, generator=g)
        k = torch.randn(1, Skv, 1, D, generator=g) * c.k_scale
    else:
        qv = 8.0
        qs = float(torch.tensor(qv * softmax_scale_log2(D)).to(dt))
        q = torch.zeros(1, Sq, 1, D)
        k = torch.zeros(1, Skv, 1, D)
        t = torch.arange(Skv) // 64
        col = torch.arange(Skv) % 64
        off = torch.where(col == c.peak_col, 0.0, -c.background)
        rows = _rows(c)
        # dim 0: the trigger; dims 1..: the victims
        q[0, rows[0], 0, 0] = qv
        k[0, :, 0, 0] = (c.rise * t + off) / qs
        for i, r in enumerate(rows[1:]):
            seq = c.start - c.fall * t + c.wobble * (1 - 2 * (t % 2))
            if c.noise:
                seq = seq + c.noise * torch.randn(int(t.max()) + 1, generator=g)[t]
            q[0, r, 0, 1 + i] = qv
            k[0, :, 0, 1 + i] = (seq + off) / qs
    if c.v_kind == "ones":
        v = torch.ones(1, Skv, 1, D)
    elif c.v_kind == "signed":
        v = torch.randint(0, 2, (1, Skv, 1, D), generator=g).float() * 2 - 1
    else:
        v = torch.randn(1, Skv, 1, D, generator=g)
    v = v * 2.0 ** c.v_log2
    return q.to(dt), k.to(dt), v.to(dt)


def _rows(c: Candidate) -> list[int]:
    """The trigger's row, then the victims' (distinct, within Sq and D - 1 dims)."""
    trig = c.trigger_row % c.n_rows
    out = [trig]
    r = c.victim_row % c.n_rows
    for _ in range(min(1 + c.n_victims, c.D - 1)):
        while r in out:
            r = (r + 1) % c.n_rows
        out.append(r)
        r = (r + 5) % c.n_rows
    return out


#: Rows per block of a ``block_sparse`` mask (its keys per block: ``mask_len``).
SPARSE_BLOCK_ROWS = 16


def mask_of(c: Candidate) -> torch.Tensor:
    """[Sq, Skv] bool: the entries the candidate's ``mask`` hides (all False for "none")."""
    Sq, Skv, L = c.seqlen_q, c.seqlen_kv, max(1, int(c.mask_len))
    rows, cols = torch.arange(Sq)[:, None], torch.arange(Skv)[None, :]
    if c.mask == "none":
        return torch.zeros(Sq, Skv, dtype=torch.bool)
    if c.mask == "pad_right":
        return (cols >= Skv - L).expand(Sq, Skv)
    if c.mask == "pad_left":
        return (cols < L).expand(Sq, Skv)
    if c.mask == "block_diag":
        n_docs = -(-Skv // L)
        return (rows * n_docs // Sq) != (cols // L)
    if c.mask == "block_sparse":
        g = torch.Generator().manual_seed(int(c.seed) + 1)
        shown = torch.rand(-(-Sq // SPARSE_BLOCK_ROWS), -(-Skv // L), generator=g) < c.mask_density
        return ~shown[rows // SPARSE_BLOCK_ROWS, cols // L]
    raise ValueError(f"mask={c.mask!r}; choose one of {FIELDS['mask'][1]}")


def build_mods(c: Candidate) -> dict:
    """The candidate's score modifiers as ``flash_attn_func`` keyword arguments (only those
    it passes): ``bias`` [Sq, Skv] in its dtype (the mask's entries at ``-inf`` or
    ``finfo(dtype).min``, plus ``bias_scale`` x N(0, 1) from its own stream of ``seed``),
    ``alibi_slopes`` [1] and ``sink`` [1] in fp32."""
    out = {}
    if "bias" in c.mods:
        dt = _dtype(c.dtype)
        bias = torch.zeros(c.seqlen_q, c.seqlen_kv)
        if c.bias_scale > 0:
            g = torch.Generator().manual_seed(int(c.seed) + 2)
            bias = torch.randn(c.seqlen_q, c.seqlen_kv, generator=g) * c.bias_scale
        fill = float("-inf") if c.mask_value == "-inf" else torch.finfo(dt).min
        out["bias"] = bias.masked_fill(mask_of(c), fill).to(dt)
    if "alibi_slopes" in c.mods:
        out["alibi_slopes"] = torch.tensor([float(c.alibi_slope)], dtype=torch.float32)
    if "sink" in c.mods:
        out["sink"] = torch.tensor([float(c.sink_logit)], dtype=torch.float32)
    return out


#: The kernel under attack: DUALWAVE_SWP, also for eager (which upstream routes short
#: calls away from, to the generic kernel).
KERNEL = "swp_bf16"


def check_mods(policy, mods, *, threshold=None) -> tuple:
    """Refuse, before any work, what the search could not run: ``policy`` with
    ``threshold`` on the model of the kernel under attack (``KERNEL``, backend
    ``"emulator"``), then each score modifier of ``mods`` there, through the same checks a
    call makes (``api.check_call``, ``dispatch.plan``, ``fa_lab.capabilities``).
    A modifier's refusal is a ValueError naming ``mods``. Returns ``parse_mods(mods)``."""
    from fa_lab import api, dispatch

    mods = parse_mods(mods)
    Sq, Skv, D = 32, 320, 64
    q = torch.zeros(1, Sq, 1, D, dtype=torch.bfloat16)
    k = torch.zeros(1, Skv, 1, D, dtype=torch.bfloat16)
    kw = {"causal": False, "rescale": policy, "rescale_threshold": threshold,
          "backend": "emulator", "kernel": KERNEL}
    dispatch.plan(api.check_call(q, k, k, **kw))
    probe = {"bias": torch.zeros(Sq, Skv, dtype=torch.bfloat16),
             "alibi_slopes": torch.zeros(1), "sink": torch.zeros(1)}
    for m in mods:
        try:
            dispatch.plan(api.check_call(q, k, k, **kw, **{m: probe[m]}))
        except (ValueError, TypeError) as e:
            raise ValueError(f"mods: {m} cannot be searched: {e}") from None
    return mods


# ---- judging one input ----------------------------------------------------------------------

@dataclass
class Verdict:
    """The model's verdict on one candidate: ``failed``, the failing rows, the predictor's
    fitness (how close the closest judged row comes to 2^128, log2 units: ``_nearness``;
    above 128 once a row failed), whether the reference is finite on every row, the rows
    it leaves undefined (not judged: see the module docstring), the largest relative error
    on the rows both finite, and the seconds."""

    failed: bool
    bad_rows: list
    fitness: float
    ref_finite: bool
    max_err: float
    seconds: float
    undefined_rows: list = field(default_factory=list)


def judged_rows(ref: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """[Sq] bool: the rows of a [1, Sq, 1, D] reference output (and its [1, 1, Sq] LSE) whose
    attention is defined, so a policy's output there is judged: output row and LSE finite.
    A row with no finite logit (fully masked, no sink) has LSE -inf and is not judged."""
    return torch.isfinite(ref).all(-1)[0, :, 0] & torch.isfinite(lse)[0, 0, :]


def judge(c: Candidate, policy, *, threshold=None, tolerance=None, baseline=None) -> Verdict:
    """Run the model and the fp64 reference on ``c`` (its score modifiers too) under
    ``policy``. A row fails where the model's output is non-finite and the row is judged
    (``judged_rows``); with ``tolerance``, also where a finite row's max error exceeds
    ``tolerance * max|ref row|``. With ``baseline`` (a policy), a row counts only where the
    baseline's output is finite: the failure is the policy's own, not one every kernel
    shares."""
    from fa_lab import api, reference
    from fa_lab.studies import onset

    t0 = time.perf_counter()
    q, k, v = build(c)
    mods = build_mods(c)
    kw = {"causal": c.causal, "rescale": policy, "rescale_threshold": threshold,
          "kernel": KERNEL, **mods}
    out = api.flash_attn_func(q, k, v, backend="emulator", **kw)
    ref, lse = reference.attention(q, k, v, causal=c.causal, dtype=torch.float64, **mods)
    ref_ok = judged_rows(ref, lse)
    out_ok = torch.isfinite(out.float()).all(-1)[0, :, 0]
    bad = (~out_ok & ref_ok)
    if baseline is not None:
        base = api.flash_attn_func(q, k, v, backend="emulator", causal=c.causal,
                                   rescale=baseline, kernel=KERNEL, **mods)
        bad = bad & torch.isfinite(base.float()).all(-1)[0, :, 0]
    err = (out.double() - ref).abs().amax(-1)[0, :, 0]
    scale = ref.abs().amax(-1)[0, :, 0].clamp_min(1e-300)
    rel = torch.where(out_ok & ref_ok, err / scale, torch.zeros_like(err))
    if tolerance is not None:
        bad = bad | (rel > tolerance)
    rows = ref_ok
    near = _nearness(q, k, v, kw)
    if baseline is not None:  # climb where the policy nears 2^128 and the baseline does not:
        nb = _nearness(q, k, v, {**kw, "rescale": baseline, "rescale_threshold": None})
        rows = rows & (nb < onset.OVERFLOW_LOG2)   # rows the baseline is predicted to lose
        fb = float(nb[rows].max()) if rows.any() else -1e3      # are not the policy's
    fit = float(near[rows].max()) if rows.any() else -1e3
    if baseline is not None:
        fit -= 2.0 * max(0.0, fb - (onset.OVERFLOW_LOG2 - 8.0))
    if bool(bad.any()):
        fit = max(fit, onset.OVERFLOW_LOG2) + 1.0
    return Verdict(failed=bool(bad.any()), bad_rows=bad.nonzero().flatten().tolist(), fitness=fit,
                   ref_finite=bool(ref_ok.all()), max_err=float(rel.max()),
                   seconds=time.perf_counter() - t0,
                   undefined_rows=(~ref_ok).nonzero().flatten().tolist())


def _nearness(q, k, v, kw) -> torch.Tensor:
    """[Sq]: the predictor's estimate of how close each row comes to 2^128 (log2 units,
    within -1e3 .. 1e3); a row it predicts non-finite for another reason (a base of -inf)
    counts as reaching it. The sink is left out: folded in after the last tile by an
    upward-only rebase, it changes no row from finite to non-finite or back."""
    from fa_lab.studies import onset

    try:
        pred = onset.predict(q, k, v, level="tile", **{n: x for n, x in kw.items() if n != "sink"})
    except (NotImplementedError, ValueError):
        return torch.full((q.shape[1],), -1e3)
    near = onset.OVERFLOW_LOG2 - pred.margin[0, :, 0]
    near = torch.where(pred.bad[0, :, 0], near.clamp(min=onset.OVERFLOW_LOG2), near)
    return near.clamp(min=-1e3, max=1e3)


# ---- the search -----------------------------------------------------------------------------

def _clip(space: Space, f, x):
    kind = space.kind(f)
    if kind == "choice":
        return x if x in space.range(f) else space.range(f)[0]
    lo, hi = space.range(f)
    x = min(max(x, lo), hi)
    return round(x) if kind == "int" else float(x)


def _fields(space: Space) -> list:
    """The fields ``space`` searches: every field but those of modifiers it does not draw
    (so a space without modifiers draws exactly the random numbers it drew before they
    existed)."""
    return [f for f in FIELDS if _MOD_OF.get(f) in (None, *space.mods)]


def random_candidate(space: Space, rng: np.random.Generator) -> Candidate:
    """A uniform draw from ``space`` (near a drag case: 32 rows, no trim, non-causal, most
    of the time; each modifier it draws is left off a third of the time)."""
    vals = {}
    for f in _fields(space):
        kind, r = space.kind(f), space.range(f)
        if kind == "choice":
            vals[f] = r[rng.integers(len(r))]
        elif kind == "int":
            vals[f] = int(rng.integers(r[0], r[1] + 1))
        else:
            vals[f] = float(rng.uniform(r[0], r[1]))
    # most random draws have no one-hot structure worth the name: start near a drag case
    vals["n_rows"] = 32 if rng.random() < 0.7 else vals["n_rows"]
    vals["trim"] = 0 if rng.random() < 0.5 else vals["trim"]
    vals["causal"] = bool(vals["causal"]) if rng.random() < 0.3 else False
    for m in space.mods:
        if rng.random() < 1 / 3:
            vals.update({f: getattr(Candidate(), f) for f in MODS[m]})
    return Candidate(**vals)


def mutate(c: Candidate, space: Space, rng: np.random.Generator, sigma: float) -> Candidate:
    """Perturb a few fields: numbers by a Gaussian step of ``sigma`` times their range,
    choices by a new draw."""
    vals = c.to_dict()
    names = _fields(space)
    n = max(1, int(rng.poisson(2.0)))
    for f in rng.choice(names, size=min(n, len(names)), replace=False):
        kind, r = space.kind(f), space.range(f)
        if kind == "choice":
            vals[f] = r[rng.integers(len(r))]
        elif kind == "float" and r[0] >= 0 and rng.random() < 0.5:
            # magnitudes span decades: half the steps are multiplicative
            vals[f] = _clip(space, f, max(vals[f], 1e-3) * math.exp(3 * sigma * rng.normal()))
        else:
            step = rng.normal() * sigma * (r[1] - r[0])
            vals[f] = _clip(space, f, vals[f] + step)
    return Candidate(**vals)


#: Structured starting points: a drag case (``experiments.drag_case``), staircases (a
#: trigger that votes at every tile, a victim that falls a little at each) with falls a
#: factor 2 apart over the longest walk, and the seed's recipe.
STARTS = (
    Candidate(),
    *(Candidate(fall=f, rise=9.0, n_tiles=48, start=0.0) for f in (3.0, 6.0, 12.0, 24.0)),
    Candidate(family="random", n_tiles=16, k_scale=64.0, D=128),
)
#: Structured starting points with score modifiers, tried first when the space draws the
#: modifiers they need: a causal document mask of one-tile documents on small random
#: scores (rows of one wave see different tiles, so the ballot fires on tiles some rows
#: cannot see), left padding of one tile on the seed's recipe, the seed's recipe under a
#: steep ALiBi slope, and the drag case with a sink.
MOD_STARTS = (
    (("bias",), Candidate(family="random", causal=True, n_tiles=8, k_scale=1.0,
                          mask="block_diag", mask_len=64)),
    (("bias",), Candidate(family="random", n_tiles=8, k_scale=8.0, mask="pad_left",
                          mask_len=64)),
    (("alibi_slopes",), Candidate(family="random", n_tiles=8, k_scale=16.0, alibi_slope=0.25)),
    (("sink",), Candidate(sink=True, sink_logit=4.0)),
)


@dataclass
class Attack:
    """``search``'s answer. ``found``: a failing input was found; ``first`` is it as found,
    ``shrunk`` after shrinking (``Candidate``s). ``best``: the highest-fitness input when
    nothing was found (the near miss). Times are seconds; ``evals`` counts model runs;
    ``optimizer`` names the optimiser that searched (``OPTIMIZERS``)."""

    policy: str
    space: dict
    budget_s: float
    seed: int
    threshold: float | None
    found: bool = False
    evals: int = 0
    search_s: float = 0.0
    time_to_first_s: float | None = None
    evals_to_first: int | None = None
    first: Candidate | None = None
    shrunk: Candidate | None = None
    shrink_evals: int = 0
    shrink_s: float = 0.0
    best: Candidate | None = None
    best_fitness: float = -math.inf
    bad_rows: list = field(default_factory=list)
    trace: list = field(default_factory=list)
    history: list = field(default_factory=list)
    structured: bool = True
    baseline: str | None = None
    optimizer: str = "cma"

    @property
    def repro(self) -> str:
        c = self.shrunk or self.best
        if c is None:
            return ""
        thr = "" if self.threshold is None else f", threshold={self.threshold!r}"
        base = "" if self.baseline is None else f", baseline={self.baseline!r}"
        return (f"fa_lab.studies.adversary.judge(fa_lab.studies.adversary.Candidate(**{_short(c)}), "
                f"{self.policy!r}{thr}{base}).failed")

    @property
    def mods(self) -> list:
        """The score modifiers the search drew (``MODS`` names)."""
        return list(self.space.get("mods", []))

    def to_dict(self) -> dict:
        d = {"policy": self.policy, "found": self.found, "space": self.space, "mods": self.mods,
             "budget_s": self.budget_s, "seed": self.seed, "threshold": self.threshold,
             "evals": self.evals, "search_s": self.search_s,
             "time_to_first_s": self.time_to_first_s, "evals_to_first": self.evals_to_first,
             "shrink_evals": self.shrink_evals, "structured": self.structured,
             "baseline": self.baseline, "optimizer": self.optimizer, "shrink_s": self.shrink_s,
             "best_fitness": self.best_fitness, "bad_rows": self.bad_rows, "repro": self.repro,
             "trace": self.trace, "history": self.history}
        for key in ("first", "shrunk", "best"):
            c = getattr(self, key)
            d[key] = None if c is None else {**c.to_dict(), "size": c.size}
        d["size"] = (self.shrunk or self.best).size if (self.shrunk or self.best) else None
        c = self.shrunk or self.best
        d["input_mods"] = None if c is None else c.mod_summary()
        return d


def _short(c: Candidate) -> dict:
    """The candidate's fields that differ from the defaults (a short repro)."""
    base = Candidate()
    return {k: v for k, v in c.to_dict().items() if getattr(base, k) != v}


# ---- the optimisers -------------------------------------------------------------------------

#: ``search``'s optimisers: mixed-integer CMA-ES with restarts (the ``cma`` package) or
#: the (1 + lambda) evolution strategy with restarts, both over every field.
OPTIMIZERS = ("cma", "es")


def _es_loop(res, sp, rng, evaluate, out_of_budget, *, lam, report):
    """The (1 + lambda) evolution strategy with restarts, from ``res.best``: ``mutate``
    perturbs a few fields at a time (choices included), the step grows on success and
    shrinks on failure, and 12 generations without progress restart it from a fresh
    random point or from the best so far. Returns (candidate, verdict) of the first
    failure, or None when the budget is spent."""
    parent, pfit, sigma, stall = res.best, res.best_fitness, 0.15, 0
    while not out_of_budget():
        best_child = None
        for _ in range(lam):
            c, v = evaluate(mutate(parent, sp, rng, sigma))
            if v.failed:
                return c, v
            if best_child is None or v.fitness > best_child[1].fitness:
                best_child = (c, v)
            if out_of_budget():
                break
        if best_child is None:
            break
        if best_child[1].fitness >= pfit:
            parent, pfit = best_child[0], best_child[1].fitness
            sigma, stall = min(0.5, sigma * 1.5), 0
        else:
            sigma, stall = max(0.01, sigma * 0.8), stall + 1
        if stall > 12:  # restart: from a fresh random point, or from the best so far
            parent = random_candidate(sp, rng) if rng.random() < 0.5 else res.best
            pfit, sigma, stall = -math.inf, 0.2, 0
        report(f"sigma {sigma:.3f}")
    return None


def _cma_fields(space: Space) -> list:
    """The fields CMA-ES moves: every field ``space`` searches with more than one value,
    but the seed (a draw per candidate, not a coordinate)."""
    return [f for f in _fields(space) if f != "seed" and (
        len(space.range(f)) > 1 if space.kind(f) == "choice"
        else space.range(f)[1] > space.range(f)[0])]


def _import_cma():
    with _quiet():  # cma warns on import when matplotlib is absent
        import cma
    return cma


def _cma_run(center, sp, rng, evaluate, out_of_budget, *, sigma0, popsize, report,
             stall_gens=8, min_gain=0.5):
    """One run of mixed-integer CMA-ES (``cma.CMAEvolutionStrategy``, ask and tell) over
    ``_cma_fields``, from ``center``. Each field is one coordinate in its own units,
    bounded by the space's range (``bounds``), with ``CMA_stds`` the range's width, so
    ``sigma0`` is a fraction of every range: a number as it is, an int rounded, a choice
    as the index of its value (ints and choices are ``integer_variables``, so their steps
    never shrink below one). The seed is drawn anew for each candidate: a run climbs
    towards the settings where failing inputs are likely, not one lucky draw. The normal
    draws come from ``rng`` (``randn``); ``cma``'s integer handling draws from numpy's
    global random state, so the run seeds it from ``rng`` and puts the caller's state back
    when it ends (the search stays deterministic, and the caller's draws unchanged). The
    run ends on CMA-ES's own termination, ``stall_gens`` generations without a fitness
    ``min_gain`` above the run's best, the budget, or a failure (returned as
    (candidate, verdict))."""
    cma = _import_cma()
    dims = _cma_fields(sp)
    kinds = [sp.kind(f) for f in dims]
    ranges = [sp.range(f) for f in dims]
    lo = np.array([0.0 if k == "choice" else float(r[0]) for k, r in zip(kinds, ranges)])
    hi = np.array([float(len(r) - 1) if k == "choice" else float(r[1])
                   for k, r in zip(kinds, ranges)])

    def coord(f, k, r):
        x = getattr(center, f)
        if k == "choice":
            return float(r.index(x)) if x in r else 0.0
        return float(x)

    def candidate(x):
        vals = {}
        for f, k, r, xi, a, b in zip(dims, kinds, ranges, x, lo.tolist(), hi.tolist()):
            xi = min(max(float(xi), a), b)          # a Python float: round() gives an int
            vals[f] = r[round(xi)] if k == "choice" else round(xi) if k == "int" else xi
        vals["seed"] = int(rng.integers(0, 2 ** 31 - 1))
        return dataclasses.replace(center, **vals)

    if not dims:
        c, v = evaluate(candidate([]))
        return (c, v) if v.failed else None
    x0 = np.clip([coord(f, k, r) for f, k, r in zip(dims, kinds, ranges)], lo, hi)
    opts = {"bounds": [lo.tolist(), hi.tolist()], "CMA_stds": (hi - lo).tolist(),
            "integer_variables": [i for i, k in enumerate(kinds) if k != "float"],
            "popsize": popsize, "randn": lambda *shape: rng.standard_normal(shape),
            "seed": np.nan, "verbose": -9, "verb_log": 0, "verb_disp": 0}
    outer = np.random.get_state()
    np.random.seed(int(rng.integers(0, 2 ** 32)))
    try:
        with _quiet():
            es = cma.CMAEvolutionStrategy(x0.tolist(), sigma0, opts)
        best, stall = -math.inf, 0
        while stall < stall_gens:
            with _quiet():
                if es.stop():
                    break
                xs = es.ask()
            fits = []
            for x in xs:
                if out_of_budget():
                    return None
                c, v = evaluate(candidate(x))
                if v.failed:
                    return c, v
                fits.append(-v.fitness)     # cma minimises
            with _quiet():
                es.tell(xs, fits)
            if -min(fits) > best + min_gain:
                best, stall = -min(fits), 0
            else:
                stall += 1
            report(f"cma sigma {es.sigma:.3f}, popsize {len(xs)}")
        return None
    finally:
        np.random.set_state(outer)


@contextlib.contextmanager
def _quiet():
    """A context in which ``cma``'s warnings (flat fitness, bounds, no matplotlib) are not
    shown."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _cma_loop(res, sp, rng, evaluate, out_of_budget, *, lam, report):
    """Mixed-integer CMA-ES with restarts (``_cma_run``). The first run starts at
    ``res.best`` (the best starting point, sigma0 0.2, CMA-ES's default population
    4 + 3 ln n); then the restarts alternate between a fresh random point
    (``random_candidate``, sigma0 0.3, the default population) and the best input so far
    (sigma0 0.1, the population doubled at each such restart up to 64, as IPOP-CMA-ES
    does). ``lam`` is not used. Returns (candidate, verdict) of the first failure, or None
    when the budget is spent."""
    pop0 = 4 + int(3 * math.log(max(1, len(_cma_fields(sp)))))
    k, pop_local = 0, pop0
    while not out_of_budget():
        if k == 0:
            center, sigma0, pop = res.best, 0.2, pop0
        elif k % 2:
            center, sigma0, pop = random_candidate(sp, rng), 0.3, pop0
        else:
            pop_local = min(64, 2 * pop_local)
            center, sigma0, pop = res.best, 0.1, pop_local
        found = _cma_run(center, sp, rng, evaluate, out_of_budget, sigma0=sigma0,
                         popsize=pop, report=report)
        if found is not None:
            return found
        k += 1
    return None


def search(policy, *, space="scores", mods=None, budget_s: float = 60.0, seed: int = 0,
           threshold=None, tolerance=None, shrink: bool = True, max_evals: int | None = None,
           lam: int = 6, structured: bool = True, baseline=None, progress=None,
           optimizer: str = "cma") -> Attack:
    """Look for an input of ``space`` on which ``policy`` (a name or ``fa_lab.Policy``)
    fails (see the module docstring), for at most ``budget_s`` seconds of search (the
    shrinking that follows a find has its own budget of as much again). Stops at the first
    failure. ``space``: a ``SPACES`` name or a ``Space``; ``mods``: score modifiers it also
    draws (``parse_mods``: "bias", "alibi" / "alibi_slopes", "sink"; a comma-separated str
    or a list), refused before any work when unknown or when the model cannot run them
    under ``policy`` (``check_mods``). ``structured``: begin with the structured starting
    points (``MOD_STARTS`` the space can draw, then ``STARTS``: a drag case, a staircase,
    the seed's recipe) before random ones (False: random starts only, which measures the
    optimiser alone); ``baseline``: a policy that must stay finite on the same input
    (``judge``); ``progress``: a callable(str) for reports; ``optimizer``: what climbs the
    fitness after the starting points (``OPTIMIZERS``: ``"cma"``, mixed-integer CMA-ES with
    restarts, or ``"es"``, the (1 + ``lam``) evolution strategy; see the module
    docstring), refused with a ValueError naming ``optimizer`` before any work when
    unknown; ``lam``: children per generation of ``"es"``. For a given seed (and
    ``max_evals``) the search is deterministic under either optimiser."""
    from fa_lab import policies

    if not isinstance(optimizer, str):
        raise TypeError(f"optimizer must be a str, one of {OPTIMIZERS}, "
                        f"got {type(optimizer).__name__}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r}; choose one of {OPTIMIZERS}")
    if isinstance(space, str):
        if space not in SPACES:
            raise ValueError(f"space={space!r}; choose one of {tuple(SPACES)}")
        sp = SPACES[space]
    elif isinstance(space, Space):
        sp = space
    else:
        raise TypeError(f"space must be a name in {tuple(SPACES)} or a Space, "
                        f"got {type(space).__name__}")
    sp = sp.with_mods(check_mods(policy, (*sp.mods, *parse_mods(mods)), threshold=threshold))
    if baseline is not None:
        check_mods(baseline, sp.mods)
    pol = policies.as_policy(policy) if isinstance(policy, str) else policy
    name = pol.name if isinstance(pol, policies.Policy) else str(policy)
    res = Attack(policy=name, space=sp.to_dict(), budget_s=float(budget_s), seed=int(seed),
                 threshold=None if threshold is None else float(threshold), structured=structured,
                 baseline=None if baseline is None else getattr(baseline, "name", str(baseline)),
                 optimizer=optimizer)
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()

    def out_of_budget():
        return (time.perf_counter() - t0 >= budget_s
                or (max_evals is not None and res.evals >= max_evals))

    def evaluate(c):
        c = canonical(Candidate(**{f: _clip(sp, f, x) for f, x in c.to_dict().items()}))
        v = judge(c, pol, threshold=threshold, tolerance=tolerance, baseline=baseline)
        res.evals += 1
        if v.fitness > res.best_fitness:
            res.best_fitness, res.best = v.fitness, c
            res.history.append({"evals": res.evals, "t": time.perf_counter() - t0,
                                "fitness": v.fitness})
        return c, v

    found = None
    mod_starts = [c for need, c in MOD_STARTS if set(need) <= set(sp.mods)]
    starts = [*((*mod_starts, *STARTS) if structured else ()),
              *(random_candidate(sp, rng) for _ in range(4))]
    for c in starts:
        if out_of_budget():
            break
        c, v = evaluate(c)
        if v.failed:
            found = (c, v)
            break
    if found is None and res.best is not None:
        def report(msg):
            if progress is not None:
                progress(f"{name}: {res.evals} evals, best fitness {res.best_fitness:.1f}, {msg}")

        loop = _es_loop if optimizer == "es" else _cma_loop
        found = loop(res, sp, rng, evaluate, out_of_budget, lam=lam, report=report)
    res.search_s = time.perf_counter() - t0
    if found is None:
        return res
    c, v = found
    res.found, res.first = True, c
    res.time_to_first_s, res.evals_to_first = res.search_s, res.evals
    if shrink:
        t1 = time.perf_counter()
        res.shrunk, res.shrink_evals = shrink_candidate(c, pol, threshold=threshold,
                                                        tolerance=tolerance, baseline=baseline,
                                                        budget_s=max(10.0, budget_s))
        res.shrink_s = time.perf_counter() - t1
    else:
        res.shrunk = c
    final = judge(res.shrunk, pol, threshold=threshold, tolerance=tolerance, baseline=baseline)
    res.bad_rows = final.bad_rows
    res.trace = trace_rows(res.shrunk, pol, final.bad_rows[:1], threshold=threshold)
    return res


# ---- shrinking ------------------------------------------------------------------------------

def _loop_steps(n_tiles: int, trim: int = 0) -> int:
    """The bf16 kernel's lazy decisions for a block of this KV length (N - 4)."""
    t = math.ceil(max(1, 64 * n_tiles - trim) / 64)
    return max(4, t + t % 2) - 4


def _simpler(c: Candidate):
    """Candidate simplifications, most valuable first (each a new Candidate): fewer KV
    tiles (also with the per-tile fall scaled up so the total drop is kept), fewer rows,
    each score modifier off (then a plainer one), then simpler structure, then rounder
    numbers."""
    rep = dataclasses.replace
    fewer = sorted({5, 6, max(4, c.n_tiles // 2), c.n_tiles - 1} - {c.n_tiles})
    for n in fewer:
        if n < 4 or n >= c.n_tiles:
            continue
        yield rep(c, n_tiles=n)
        old, new = _loop_steps(c.n_tiles, c.trim), _loop_steps(n, c.trim)
        if c.family == "onehot" and new > 0 and old > new:
            yield rep(c, n_tiles=n, fall=min(FIELDS["fall"][1][1], math.ceil(c.fall * old / new)))
    if c.trim != 63:
        yield rep(c, trim=63)
    if c.n_rows != 32:
        yield rep(c, n_rows=32, trigger_row=c.trigger_row % 32, victim_row=c.victim_row % 32)
    if c.n_rows != 32:
        yield rep(c, n_rows=32, trigger_row=c.trigger_row % 32, victim_row=c.victim_row % 32)
    for f, simple in (("sink", False), ("alibi_slope", 0.0), ("bias_scale", 0.0),
                      ("mask", "none"), ("mask_value", "-inf"), ("sink_logit", 0.0)):
        if getattr(c, f) != simple:
            yield rep(c, **{f: simple})
    if c.mask in ("block_diag", "block_sparse") and c.mask_len != 64:
        yield rep(c, mask_len=64)
    for f, digits in (("alibi_slope", 2), ("bias_scale", 0), ("mask_density", 1)):
        x = getattr(c, f)
        if x != round(x, digits):
            yield rep(c, **{f: float(round(x, digits))})
    for f, simple in (("causal", False), ("D", 64), ("dtype", "bf16"), ("noise", 0.0),
                      ("wobble", 0.0), ("n_victims", 0), ("background", 0.0), ("peak_col", 0),
                      ("v_kind", "ones"), ("trigger_row", 0), ("victim_row", 1), ("seed", 0)):
        if getattr(c, f) != simple:
            yield rep(c, **{f: simple})
    if c.family == "random" and c.k_scale != round(c.k_scale):
        yield rep(c, k_scale=float(round(c.k_scale)))
    for f in ("start", "fall", "rise", "v_log2", "k_scale"):
        x = getattr(c, f)
        if x != round(x):
            yield rep(c, **{f: float(round(x))})


def _bisect_down(c: Candidate, f: str, fails, lo: float = 0.0, steps: int = 8):
    """The smallest value of numeric field ``f`` in [lo, current] that still fails,
    by bisection on integers (assumes failing is monotone in ``f``; checks the answer)."""
    num = int if FIELDS[f][0] == "int" else float
    hi = getattr(c, f)
    if hi <= lo:
        return c
    if fails(dataclasses.replace(c, **{f: num(lo)})):
        return dataclasses.replace(c, **{f: num(lo)})
    a, b = lo, hi
    for _ in range(steps):
        if b - a <= 1:
            break
        mid = num(math.floor((a + b) / 2))
        if fails(dataclasses.replace(c, **{f: mid})):
            b = mid
        else:
            a = mid
    top = dataclasses.replace(c, **{f: num(math.ceil(b))})
    return top if fails(top) else c


def shrink_candidate(c: Candidate, policy, *, threshold=None, tolerance=None, baseline=None,
                     budget_s: float = 30.0) -> tuple[Candidate, int]:
    """Greedy shrinking: keep any simplification (``_simpler``) under which ``policy``
    still fails, then bisect the magnitudes (fall, start, v_log2, k_scale, and a padding
    mask's length) down, until a pass changes nothing or the budget is spent. Returns
    (candidate, model runs)."""
    t0 = time.perf_counter()
    n = 0
    cache = {}

    def fails(x: Candidate) -> bool:
        nonlocal n
        x = canonical(x)
        key = tuple(x.to_dict().values())
        if key not in cache:
            n += 1
            cache[key] = judge(x, policy, threshold=threshold, tolerance=tolerance,
                               baseline=baseline).failed
        return cache[key]

    c = canonical(c)
    for _ in range(100):
        changed = False
        for s in _simpler(c):
            if time.perf_counter() - t0 > budget_s:
                return c, n
            s = canonical(s)
            if s != c and fails(s):
                c, changed = s, True
                break
        if changed:
            continue
        before = c
        for f in ("fall", "v_log2", "k_scale", "start", "rise"):
            if time.perf_counter() - t0 > budget_s:
                return c, n
            lo = FIELDS[f][1][0] if f != "start" else 0.0
            if f == "k_scale" and c.family != "random":
                continue
            if f in ("start", "rise", "fall") and c.family == "random":
                continue
            c = canonical(_bisect_down(c, f, fails, lo=max(lo, 0.0)))
        if c.mask in ("pad_left", "pad_right") and time.perf_counter() - t0 <= budget_s:
            c = canonical(_bisect_down(c, "mask_len", fails, lo=1))
        if c == before:
            break
    return c, n


def trace_rows(c: Candidate, policy, rows, *, threshold=None) -> list[dict]:
    """The step-by-step trace (``fa_lab.trace``) of the given rows of candidate ``c``, as
    plain records (step, phase, m, mt, vote, fire, dragged, corr, l, o_finite)."""
    from fa_lab import api

    if not rows:
        return []
    q, k, v = build(c)
    tr = api.trace(q, k, v, rows=list(rows), causal=c.causal, rescale=policy,
                   rescale_threshold=threshold, backend="emulator", kernel=KERNEL,
                   **build_mods(c))
    cols = ["lane", "row", "step", "phase", "m", "mt", "vote", "fire", "dragged", "corr", "l",
            "o_finite", "l_finite"]
    return tr.steps[[x for x in cols if x in tr.steps.columns]].to_dict("records")


# ---- regression files -----------------------------------------------------------------------

_INT_VIEWS = {2: (torch.int16, np.uint16), 4: (torch.int32, np.uint32)}


def _bits(x: torch.Tensor) -> np.ndarray:
    """A 16- or 32-bit tensor's exact bit patterns (numpy has no bfloat16)."""
    ti, ni = _INT_VIEWS[x.element_size()]
    return x.contiguous().view(ti).numpy().view(ni)


def _from_bits(a: np.ndarray, dtype) -> torch.Tensor:
    return torch.from_numpy(a.view(np.int16).copy()).view(dtype)


def tensor_digest(*ts: torch.Tensor) -> str:
    """sha256 of the tensors' bytes (shape and dtype included)."""
    import hashlib

    h = hashlib.sha256()
    for t in ts:
        h.update(f"{tuple(t.shape)}{t.dtype}".encode())
        h.update(_bits(t).tobytes())
    return h.hexdigest()


def save_regression(res: Attack, path, *, expect: str | None = None) -> Path:
    """Write the shrunk input (or, with nothing found, the best one) as a compressed .npz
    with a JSON ``meta`` (policy, threshold, dtype, causal, the candidate, the names of its
    score modifiers, the failing rows, ``expect``: "nonfinite" or "finite", and the sha256
    of q, k, v and the modifiers' tensors). A one-hot input with V = ones has its q, k, v
    stored as their bit patterns (mostly zeros: a few KB). Any other input (dense random
    draws in q, k or V: tens or hundreds of KB) is stored as its candidate only, and so are
    the modifiers of every input (a bias with a random part is as dense):
    ``load_regression`` rebuilds them from the candidate and checks the digest."""
    c = res.shrunk if res.found else res.best
    if c is None:
        raise ValueError("the attack has no input to save")
    if expect is None:
        expect = "nonfinite" if res.found else "finite"
    q, k, v = build(c)
    mods = build_mods(c)
    sparse = c.family == "onehot" and c.v_kind == "ones"
    meta = {"policy": res.policy, "threshold": res.threshold, "baseline": res.baseline,
            "dtype": c.dtype, "causal": c.causal, "expect": expect, "candidate": c.to_dict(),
            "size": c.size, "bad_rows": res.bad_rows, "space": res.space["name"],
            "budget_s": res.budget_s, "seed": res.seed, "found": res.found,
            "stored": "tensors" if sparse else "candidate",
            "mods": list(mods), "sha256": tensor_digest(q, k, v, *mods.values())}
    arrays = {"q": _bits(q), "k": _bits(k), "v": _bits(v)} if sparse else {}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, meta=np.array(json.dumps(meta)), **arrays)
    return path


def load_regression(path, *, with_mods: bool = False):
    """(q, k, v, meta) of a regression file, q/k/v in the dtype it names (rebuilt from the
    candidate where only that is stored; either way checked against the digest).
    ``with_mods``: (q, k, v, meta, mods), ``mods`` the score modifiers as
    ``flash_attn_func`` keyword arguments (empty for an input without any)."""
    with np.load(path) as z:
        meta = json.loads(str(z["meta"]))
        dt = _dtype(meta["dtype"])
        c = Candidate(**meta["candidate"])
        if meta.get("stored", "tensors") == "tensors":
            q, k, v = (_from_bits(z[n], dt) for n in ("q", "k", "v"))
        else:
            q, k, v = build(c)
    mods = build_mods(c)
    if list(mods) != meta.get("mods", []) or tensor_digest(q, k, v, *mods.values()) != meta["sha256"]:
        raise ValueError(f"{path}: the input does not match its digest (a different torch "
                         "random stream rebuilt a 'random'-family candidate?)")
    return (q, k, v, meta, mods) if with_mods else (q, k, v, meta)


def run_regression(path, policy=None) -> dict:
    """Run a regression file's input (its score modifiers too) under its policy (or
    ``policy``): whether the model's output has a non-finite row among the judged rows
    (``judged_rows``), which rows, whether the fp64 reference is finite on every row, and
    the rows it leaves undefined."""
    from fa_lab import api, reference

    q, k, v, meta, mods = load_regression(path, with_mods=True)
    pol = meta["policy"] if policy is None else policy
    out = api.flash_attn_func(q, k, v, causal=meta["causal"], rescale=pol,
                              rescale_threshold=meta["threshold"] if policy is None else None,
                              backend="emulator", kernel=KERNEL, **mods)
    ref, lse = reference.attention(q, k, v, causal=meta["causal"], dtype=torch.float64, **mods)
    judged = judged_rows(ref, lse)
    bad = ~torch.isfinite(out.float()).all(-1)[0, :, 0] & judged
    return {"policy": getattr(pol, "name", pol), "nonfinite": bool(bad.any()),
            "bad_rows": bad.nonzero().flatten().tolist(), "ref_finite": bool(judged.all()),
            "undefined_rows": (~judged).nonzero().flatten().tolist(), "meta": meta}


def summary(res: Attack) -> str:
    """A few lines: what was found, how fast, how small."""
    if res.found:
        s = res.shrunk
        mods = "".join(f"; {m} {d}" for m, d in s.mod_summary().items())
        return (f"{res.policy}: FAILS. First failure after {res.time_to_first_s:.1f} s "
                f"({res.evals_to_first} model runs) in space {res.space['name']!r}; shrunk in "
                f"{res.shrink_evals} runs to Sq={s.seqlen_q} Skv={s.seqlen_kv} D={s.D} "
                f"({s.family}, {s.dtype}, causal={s.causal}{mods}); non-finite rows "
                f"{res.bad_rows}\n  repro: {res.repro}")
    return (f"{res.policy}: no failure found in {res.search_s:.1f} s ({res.evals} model runs, "
            f"budget {res.budget_s:g} s, space {res.space['name']!r}); best fitness "
            f"{res.best_fitness:.1f} (128 means a predicted overflow)")
