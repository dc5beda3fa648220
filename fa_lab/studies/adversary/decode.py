"""The attack's search space for the paged-attention decode (``fa_lab.decode.pa_decode_tile``,
the ``pa_decode`` family): what a candidate call is, how it is built, and how it is judged.

A ``DecodeCandidate`` is one decode call (``DECODE_FIELDS``, ``DECODE_SPACE``):

* **contexts and partition boundaries**: sequence 0's context is ``256 (tiles - 1) +
  last`` tokens, so ``last`` walks the last 256-token tile from empty (0: the context ends
  on a tile boundary, or is empty when ``tiles`` is 1) to full; sequence i's is sequence
  0's plus ``i * ctx_step`` (clamped to 0 .. 1280); ``empty_seq`` makes the first or last
  sequence's context 0; ``num_partitions`` (1..8) cuts the tiles into partitions, some of
  them empty;
* **the query**: ``query_length`` (1..16, the MTP positions), ``group`` query heads per kv
  head and ``num_kv_heads``; ``head_dim``; row r = qi * group + g sees the tokens before
  ``ctx - (QL - 1) + qi``, so with MTP the last tile can be fully masked for some rows;
* **page tables**: pages of 16 or 64 tokens, shuffled or in order, ``spare_pages`` unused
  table entries per sequence, V transposed or not;
* **what the cache holds past each context** (``tail``, ``cases.TAILS``): fresh values,
  stale values at e4m3's largest magnitude, or NaN (K, V and per-token scales), in the
  last tile's tail and in the pages no sequence uses;
* **scales**: per tensor or per token, K's spread (``k_log2``), and one outlier token of
  sequence 0 (``outlier_at``) whose K or V is ``2^outlier_log2`` times the rest before
  quantization (a per-token scale outlier, or a per-tensor scale that flushes the rest).

* **the kernel**: ``window`` 0 runs ``pa_decode_tile``; a window W > 0 runs the
  sliding-window kernel (``pa_decode_ps_launch(sliding_window=W)``, pages of 1024, one
  256-token tile per partition from the window's first, ``num_partitions`` of them: fewer
  than the visible tiles drop the newest). The ``decode`` spaces pin it at 0;
  ``decode_swa`` draws it from 1..1000.

**What fails** (``DECODE_CLASSES``): ``nonfinite``, a row that sees at least one token
(its fp64 reference is defined) comes out NaN or inf with every slot past the contexts
finite; ``stale_nan``, a row that is finite when those slots hold finite stale values and
NaN when they hold NaN (the kernel multiplies the last tile's tail of V by P = 0, and
0 * NaN is NaN); ``empty``, a row that sees no token comes out anything but 0. The
default is ``nonfinite``: the decode on a cache it owns in full.

**Fitness** (how near a finite candidate comes to the sentinel paths): the fewest valid
tokens any row that sees a token has in some tile of a non-empty partition, negated
(-256 .. -1; -257 when no row sees a token), and 100 plus the share of such rows once one
has a fully masked tile (the -1e30 sentinel's path: ``masked * scale - m`` can cancel to 0
there); 129 once a class asked for fails. Where some exp2 the kernel takes (P's or the
correction's, the model's recorder: ``exp2_arg``) has a positive argument x, the fitness
is at least 100 + 28 x / 128: fp32's exp2 overflows from x = 128 on, and every exp2 of
an online softmax should stay at or below 0. Among calls equally near, the one whose rows'
running maxima lie furthest from 0 (log2 units, after each partition's first tile)
scores higher, by up to 0.9 at |m| = 128; the tie-breaker never reorders two token counts.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from fa_lab.kernels import pa_decode
from fa_lab.kernels.pa_decode import model

cases = pa_decode.cases

from .judge import Verdict

#: The candidate fields: (kind, choices or (low, high)).
DECODE_FIELDS = {
    "n_seqs": ("int", (1, 3)),
    "tiles": ("int", (1, 5)),
    "last": ("int", (0, 256)),
    "ctx_step": ("int", (-512, 512)),
    "empty_seq": ("choice", ("none", "first", "last")),
    "query_length": ("int", (1, 16)),
    "group": ("int", (1, 8)),
    "num_kv_heads": ("int", (1, 2)),
    "head_dim": ("choice", (64, 128)),
    "block_size": ("choice", model.BLOCK_SIZES),
    "num_partitions": ("int", (1, 8)),
    "per_token": ("choice", (False, True)),
    "trans_v": ("choice", (True, False)),
    "shuffle": ("choice", (True, False)),
    "spare_pages": ("int", (0, 4)),
    "tail": ("choice", cases.TAILS),
    "k_log2": ("float", (-4.0, 4.0)),
    "outlier_log2": ("float", (0.0, 16.0)),
    "outlier_at": ("float", (0.0, 1.0)),
    "outlier_in": ("choice", ("v", "k")),
    "window": ("int", (0, 0)),
    "seed": ("int", (0, 2 ** 31 - 1)),
}
MAX_CONTEXT = 5 * model.TILE_TOK


def tiled_contexts(c, tile: int, cap: int) -> list[int]:
    """The contexts of a decode candidate ``c`` (fields ``tiles``, ``last``, ``ctx_step``,
    ``n_seqs``, ``empty_seq``) over tiles of ``tile`` tokens: the first sequence ends
    ``last`` tokens into its ``tiles``-th tile, each next one ``ctx_step`` further, every
    length clipped to [0, ``cap``]; ``empty_seq`` empties the first or the last."""
    c0 = tile * (c.tiles - 1) + c.last
    ctx = [min(max(c0 + i * c.ctx_step, 0), cap) for i in range(c.n_seqs)]
    if c.empty_seq != "none":
        ctx[0 if c.empty_seq == "first" else -1] = 0
    return ctx
DECODE_CLASSES = ("nonfinite", "stale_nan", "empty")
#: The whole space's name (``fa-lab attack VERSION --space decode``).
DECODE_SPACE_NAME = "decode"


@dataclass(frozen=True)
class DecodeSpace:
    """The decode's search space: ``bounds`` overrides ``DECODE_FIELDS``' ranges."""

    name: str = DECODE_SPACE_NAME
    bounds: tuple = ()
    description: str = ("paged-attention decode calls: 1..3 sequences of up to 5 tiles, "
                        "MTP query lengths 1..16, 1..8 partitions, pages of 16/64 in shuffled "
                        "tables, empty contexts, finite, stale or NaN cache tails, per-tensor "
                        "or per-token scales with an outlier token")

    def kind(self, f):
        return DECODE_FIELDS[f][0]

    def range(self, f):
        return dict(self.bounds).get(f, DECODE_FIELDS[f][1])

    def to_dict(self) -> dict:
        return {"name": self.name, "description": self.description, "mods": [], "zoo": False,
                "fields": {f: list(self.range(f)) for f in DECODE_FIELDS}}


DECODE_SPACE = DecodeSpace()
#: The named decode spaces: the whole space, and the same with outliers in V only (per-token
#: V scale outliers; no key whose score dwarfs the rest), where no row's scores can all sit
#: far below zero.
DECODE_SPACES = {
    "decode": DECODE_SPACE,
    "decode_v_outliers": DecodeSpace("decode_v_outliers", (("outlier_in", ("v",)),),
                                     DECODE_SPACE.description + "; outliers in V only"),
    "decode_swa": DecodeSpace("decode_swa", (("window", (1, 1000)),),
                              "sliding-window decode calls (pa_decode_ps_launch with a window "
                              "of 1..1000, pages of 1024): 1..3 sequences of up to 5 tiles, "
                              "MTP query lengths 1..16, 1..8 partitions (fewer than the visible "
                              "tiles drop the newest), empty contexts, finite, stale or NaN "
                              "cache tails, per-tensor or per-token scales with an outlier token"),
}


@dataclass(frozen=True)
class DecodeCandidate:
    """One decode call of the space (see the module docstring); ``build`` makes it."""

    n_seqs: int = 1
    tiles: int = 1
    last: int = 200
    ctx_step: int = 0
    empty_seq: str = "none"
    query_length: int = 1
    group: int = 4
    num_kv_heads: int = 1
    head_dim: int = 64
    block_size: int = 16
    num_partitions: int = 1
    per_token: bool = False
    trans_v: bool = True
    shuffle: bool = True
    spare_pages: int = 2
    tail: str = "finite"
    k_log2: float = 0.0
    outlier_log2: float = 0.0
    outlier_at: float = 0.5
    outlier_in: str = "v"
    window: int = 0
    seed: int = 0

    @property
    def contexts(self) -> list[int]:
        return tiled_contexts(self, model.TILE_TOK, MAX_CONTEXT)

    @property
    def size(self) -> dict:
        size = {"contexts": self.contexts, "QL": self.query_length,
                "Hq": self.group * self.num_kv_heads, "Hkv": self.num_kv_heads,
                "D": self.head_dim, "page": self.page, "NP": self.num_partitions,
                "scales": "per_token" if self.per_token else "per_tensor"}
        if self.window:
            size["window"] = self.window
        return size

    @property
    def page(self) -> int:
        """The page size built: ``block_size``, or the sliding-window kernel's 1024."""
        return pa_decode.swa.PAGE if self.window else self.block_size

    def mod_summary(self) -> dict:
        return {}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def canonical(c: DecodeCandidate) -> DecodeCandidate:
    """The same call with the fields it does not use at their defaults."""
    base = DecodeCandidate()
    vals = {}
    if c.outlier_log2 == 0:
        vals.update(outlier_at=base.outlier_at, outlier_in=base.outlier_in)
    if c.n_seqs == 1:
        vals["ctx_step"] = base.ctx_step
    if c.window:
        vals["block_size"] = base.block_size   # the sliding-window kernel's pages are 1024
    return dataclasses.replace(c, **vals)


def build(c: DecodeCandidate) -> cases.Case:
    """The candidate's call (``cases.Case``: ``Case.args()`` is ``pa_decode_tile``'s)."""
    outlier = None if c.outlier_log2 == 0 else (c.outlier_in, c.outlier_at, 2.0 ** c.outlier_log2)
    # the sliding-window kernel reads a table entry even for an empty context: a table of
    # empty contexts keeps one column there
    spare = max(c.spare_pages, 1) if c.window and max(c.contexts) == 0 else c.spare_pages
    return cases.make(c.contexts, query_length=c.query_length,
                      num_q_heads=c.group * c.num_kv_heads, num_kv_heads=c.num_kv_heads,
                      head_dim=c.head_dim, block_size=c.page, per_token=c.per_token,
                      k_mult=2.0 ** c.k_log2, seed=int(c.seed), shuffle=c.shuffle,
                      spare_pages=spare, trans_v=c.trans_v, tail=c.tail, outlier=outlier)


def run(c: DecodeCandidate, upstream: str, *, tail: str | None = None, recorder=None):
    """The model's output [num_seqs * QL, Hq, D] (fp32) of ``c`` under the decode version
    ``upstream`` (``tail`` overrides the candidate's)."""
    from fa_lab import decode

    case = build(c if tail is None else dataclasses.replace(c, tail=tail))
    if c.window:
        out = torch.empty_like(case.query)
        decode.pa_decode_ps_launch(out, case.query, case.key_cache, case.value_cache,
                                   case.context_lengths, None, None, None, case.key_scale,
                                   case.value_scale, sliding_window=c.window,
                                   block_tables=case.block_tables,
                                   max_context_partition_num=c.num_partitions,
                                   upstream=upstream, recorder=recorder)
        return out.float(), case
    out = decode.pa_decode_tile(*case.args(), num_partitions=c.num_partitions,
                                upstream=upstream, recorder=recorder)
    return out.float(), case


def check_decode_classes(classes) -> tuple:
    """``classes`` (None: ``("nonfinite",)``; a comma-separated str or names) as a tuple of
    ``DECODE_CLASSES``; ValueError/TypeError naming ``classes``."""
    if classes is None:
        return ("nonfinite",)
    names = [x.strip() for x in classes.split(",")] if isinstance(classes, str) else list(classes)
    if not names or not all(isinstance(x, str) for x in names):
        raise TypeError(f"classes must name classes of failure as str, got {classes!r}")
    bad = [x for x in names if x not in DECODE_CLASSES]
    if bad:
        raise ValueError(f"classes: unknown decode class {bad[0]!r}; choose from "
                         f"{', '.join(DECODE_CLASSES)}")
    return tuple(x for x in DECODE_CLASSES if x in names)


def closest_masked_tile(c: DecodeCandidate) -> tuple[int, float]:
    """(fewest valid tokens, share of rows at 0): over every row that sees a token and
    every tile of its non-empty partitions, the fewest tokens the row sees in one tile,
    and the share of such rows that have a tile with none (-1 and 0 when no row sees a
    token)."""
    fewest, rows_at_zero, rows = model.TILE_TOK + 1, 0, 0
    group = c.group
    swa = pa_decode.swa
    for ctx in c.contexts:
        bounds = model.row_bounds(ctx, c.query_length, group)
        if c.window:   # each partition runs one tile of the window (None: nothing)
            tiles = [t for t in swa.partition_tiles(ctx, c.query_length, c.window,
                                                    c.num_partitions) if t is not None]
        else:
            tiles = [t for t0, t1 in model.partition_tiles(ctx, c.num_partitions)
                     for t in range(t0, t1)]
        for b in bounds:
            if b <= 0:
                continue
            rows += 1
            lo = b - 1 - c.window if c.window else 0
            counts = [min(max(min(b, model.TILE_TOK * (t + 1)) - max(lo, model.TILE_TOK * t), 0),
                          model.TILE_TOK) for t in tiles]
            fewest = min(fewest, min(counts))
            rows_at_zero += min(counts) == 0
    return (-1, 0.0) if rows == 0 else (fewest, rows_at_zero / rows)


#: The fitness's tie-breaker at |m| = 128 (below 1: it never reorders two token counts).
RANGE_WEIGHT = 0.9


def max_range(rec: dict) -> float:
    """The largest |m| / 128 (at most 1) over the recorder's finite ``first_max``: how near
    a row's running max comes to fp32's exp2 range (0 when no row sees a token, or where the
    kernel's model records no ``first_max``: the sliding-window decode)."""
    m = rec.get("first_max")
    if m is None:
        return 0.0
    m = m[torch.isfinite(m)]
    return 0.0 if m.numel() == 0 else min(float(m.abs().max()) / 128.0, 1.0)


def _bad(out: torch.Tensor) -> torch.Tensor:
    return ~torch.isfinite(out).all(-1)


def judge(c: DecodeCandidate, upstream: str, *, classes=None, quick: bool = False) -> Verdict:
    """Run the decode model under ``upstream`` and the fp64 reference (``cases.reference``)
    on ``c`` and count the rows that show any of ``classes`` (``DECODE_CLASSES``; see the
    module docstring). ``bad_rows``: [token row, query head] pairs. ``quick`` (the
    search's): where no output row is non-finite and ``empty`` is not asked for, nothing
    can fail and the reference is not run (``max_err`` 0 and ``undefined_rows`` empty are
    then not measured; the verdict's ``failed`` and ``fitness`` are the full judge's)."""
    classes = check_decode_classes(classes)
    t0 = time.perf_counter()
    rec: dict = {}
    out, case = run(c, upstream, recorder=rec)
    bad_now = _bad(out)
    if quick and "empty" not in classes and not bool(bad_now.any()):
        ref = None
        defined = torch.ones_like(bad_now)
    else:
        ref = cases.reference(case, sliding_window=c.window)
        defined = torch.isfinite(ref).all(-1)
    rows = {"nonfinite": bad_now & defined, "stale_nan": torch.zeros_like(defined),
            "empty": ~defined & (bad_now | (out != 0).any(-1))}
    if c.tail == "nan" and bool(rows["nonfinite"].any()):
        # split the NaN rows: those the NaN past the contexts makes, and those it does not
        clean, _ = run(c, upstream, tail="stale")
        rows["stale_nan"] = rows["nonfinite"] & ~_bad(clean)
        rows["nonfinite"] = rows["nonfinite"] & _bad(clean)
    bad = torch.zeros_like(defined)
    found = []
    for name in classes:
        if bool(rows[name].any()):
            found.append(name)
            bad |= rows[name]
    fewest, share = closest_masked_tile(c)
    if found:
        fit = 129.0
    elif fewest < 0:  # no row sees a token: as far from a masked tile as a call can be
        fit = -float(model.TILE_TOK + 1)
    else:
        fit = 100.0 + share if fewest == 0 else -float(fewest)
        fit += RANGE_WEIGHT * max_range(rec)
        x = rec.get("exp2_arg", torch.empty(0))      # the sliding-window model records none
        x = x[torch.isfinite(x)]
        if x.numel() and float(x.max()) > 0:
            fit = max(fit, 100.0 + 28.0 * min(float(x.max()), 128.0) / 128.0)
    both = defined & ~bad_now
    ov = out.double()[both]
    err = (ov - ref[both]).abs().amax(-1) / ref[both].abs().amax(-1).clamp_min(1e-300) \
        if ref is not None and both.any() else torch.zeros(1)
    return Verdict(failed=bool(found), bad_rows=bad.nonzero().tolist(), fitness=fit,
                   ref_finite=bool(defined.all()), max_err=float(err.max()),
                   seconds=time.perf_counter() - t0,
                   undefined_rows=(~defined).nonzero().tolist(), classes=found)


def repro_line(c: DecodeCandidate, upstream: str, classes=("nonfinite",)) -> str:
    """One line of Python that rebuilds ``c``, judges it and prints whether it fails."""
    base = DecodeCandidate()
    short = {k: v for k, v in c.to_dict().items() if getattr(base, k) != v}
    cls = "" if tuple(classes) == ("nonfinite",) else f", classes={tuple(classes)!r}"
    return (f"from fa_lab.studies.adversary import decode; "
            f"print(decode.judge(decode.DecodeCandidate(**{short}), {upstream!r}{cls}).failed)")


def is_decode_target(name) -> bool:
    """Whether ``name`` names a decode version (``fa_lab.upstream.DECODE_VERSIONS``), the
    targets of this space."""
    from fa_lab.upstream import DECODE_VERSIONS

    return isinstance(name, str) and name in DECODE_VERSIONS


def describe(upstream: str) -> str:
    from fa_lab.upstream import DECODE_VERSIONS

    v = DECODE_VERSIONS[upstream]
    return f"pa_decode_tile at ROCm/FlyDSL {v.commit}: {v.description}"

