"""What the attack searches: the fields of a candidate input (scores, a mask, score
modifiers, and for the failure zoo's kernels KV caches, sentinels and outliers), the named
search spaces, and how a candidate becomes q, k, v and its mods."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch


#: The candidate fields: (kind, choices or (low, high)).
FIELDS = {
    "family": ("choice", ("onehot", "random", "scores")),
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
    "mask": ("choice", ("none", "pad_right", "pad_left", "block_diag", "block_sparse",
                        "pad_rows")),
    "mask_len": ("int", (1, 512)),
    "mask_density": ("float", (0.1, 0.9)),
    "mask_value": ("choice", ("-inf", "min")),
    "bias_scale": ("float", (0.0, 16.0)),
    "alibi_slope": ("float", (0.0, 1.0)),
    "sink": ("choice", (False, True)),
    "sink_logit": ("float", (-16.0, 16.0)),
    # the failure zoo's fields (pinned to their defaults unless the space draws them:
    # ``Space.zoo``): scores of a given spread, an outlier key, a huge negative offset of
    # every logit, and a KV cache whose slots past the sequence's length hold NaN
    "spread": ("float", (0.0, 64.0)),
    "jump": ("float", (-16.0, 64.0)),
    "jump_col": ("int", (0, 3071)),
    "shift": ("float", (-3e5, 0.0)),
    "seqused": ("float", (0.0, 1.0)),
    "cache": ("choice", ("finite", "nan")),
}

#: The zoo's fields (``FIELDS``), drawn only by a space with ``zoo=True``.
ZOO_FIELDS = ("spread", "jump", "jump_col", "shift", "seqused", "cache")
#: What the spaces drawn before the zoo's existed choose from (they pin these choices).
_CLASSIC = {"family": ("onehot", "random"),
            "mask": ("none", "pad_right", "pad_left", "block_diag", "block_sparse")}


#: The score modifiers a search can draw, by ``flash_attn_func``'s argument name (the
#: features of ``fa_lab.capabilities``), and the candidate fields each one owns.
MODS = {
    "bias": ("mask", "mask_len", "mask_density", "mask_value", "bias_scale"),
    "alibi_slopes": ("alibi_slope",),
    "sink": ("sink", "sink_logit"),
}


#: Other spellings accepted for a modifier (``--mods bias,alibi,sink``).
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
    zoo: bool = False

    def kind(self, f):
        return FIELDS[f][0]

    def range(self, f):
        mod = _MOD_OF.get(f)
        if (mod is not None and mod not in self.mods) or (f in ZOO_FIELDS and not self.zoo):
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
                "zoo": self.zoo, "fields": {f: list(self.range(f)) for f in FIELDS}}


SPACES = {
    "scores": Space("scores", dict(_CLASSIC),
                    "score structure only: |V| <= 4, bf16/f16, one wave or two"),
    "values": Space("values", {**_CLASSIC, "v_log2": (0.0, 126.0)},
                    "as 'scores', and V up to 2^126 (still finite in bf16 and in the reference)"),
    "zoo": Space("zoo", {"n_rows": (1, 64), "n_tiles": (1, 48)},
                 "the failure zoo's inputs: 'scores' with scores of a given spread, an outlier "
                 "key, logits shifted far below zero, a KV cache whose tail past the "
                 "sequence holds NaN (seqlen_kv down to 0), and -inf or finite masks that "
                 "hide keys, whole first tiles or whole rows; 1 to 64 rows, 1 to 48 tiles",
                 mods=("bias",), zoo=True),
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
    spread: float = 0.0
    jump: float = 0.0
    jump_col: int = 0
    shift: float = 0.0
    seqused: float = 1.0
    cache: str = "finite"

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
    def kv_used(self) -> int:
        """The sequence's valid keys: all ``seqlen_kv`` unless ``seqused`` < 1 makes the
        rest a KV cache's tail (then as few as 0)."""
        return self.seqlen_kv if self.seqused >= 1 else int(round(self.seqused * self.seqlen_kv))

    @property
    def size(self) -> dict:
        out = {"Sq": self.seqlen_q, "Skv": self.seqlen_kv, "D": self.D,
               "tiles": math.ceil(self.seqlen_kv / 64)}
        if self.kv_used != self.seqlen_kv:
            out["seqlen_kv"] = self.kv_used
        return out

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


ONEHOT_ONLY = ("trigger_row", "victim_row", "n_victims", "start", "fall", "rise", "wobble",
               "noise", "peak_col", "background")


RANDOM_ONLY = ("k_scale",)


SCORES_ONLY = ("spread",)


def canonical(c: Candidate) -> Candidate:
    """The same input with the fields it does not use at their defaults (so equal inputs
    compare equal and a repro names only what matters)."""
    base = Candidate()
    unused = list({"onehot": (*RANDOM_ONLY, *SCORES_ONLY), "random": (*ONEHOT_ONLY, *SCORES_ONLY),
                   "scores": (*ONEHOT_ONLY, *RANDOM_ONLY)}[c.family])
    if c.jump == 0:
        unused.append("jump_col")
    if c.kv_used == c.seqlen_kv:
        unused += ["seqused", "cache"]
    if c.mask == "none":
        unused += ["mask_len", "mask_density", "mask_value"]
    elif c.mask != "block_sparse":
        unused.append("mask_density")
    if not c.sink:
        unused.append("sink_logit")
    vals = {f: getattr(base, f) for f in unused}
    random_bias = c.bias_scale > 0 or c.mask == "block_sparse"
    plain = c.family == "onehot" and c.noise == 0 or c.family == "scores" and c.spread == 0
    if plain and c.v_kind == "ones" and not random_bias:
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
    elif c.family == "scores":
        q, k = _scores(c, g)
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
    if c.shift or c.jump:
        q, k = _offsets(c, q, k)
    if c.cache == "nan" and c.kv_used < Skv:
        k[:, c.kv_used:] = math.nan
        v[:, c.kv_used:] = math.nan
    return q.to(dt), k.to(dt), v.to(dt)


#: The value of Q on a row's own dimension (one-hot and scores families): exact in bf16 and
#: f16, and large enough that K's values stay well inside both ranges.
_QV = 8.0


def _scale_log2(D: int) -> float:
    from fa_lab.kernels.swp_bf16.model import softmax_scale_log2

    return softmax_scale_log2(D)


def _scores(c: Candidate, g):
    """The ``scores`` family: row r's scores are ``spread`` x N(0, 1) log2 units, drawn per
    (key, dimension): row r reads dimension r mod (D - 2) (rows past D - 2 share one), Q = 8
    there; the last two dimensions carry ``shift`` and ``jump`` (``_offsets``)."""
    Sq, Skv, D = c.seqlen_q, c.seqlen_kv, c.D
    dims = D - 2
    q = torch.zeros(1, Sq, 1, D)
    q[0, torch.arange(Sq), 0, torch.arange(Sq) % dims] = _QV
    k = torch.zeros(1, Skv, 1, D)
    k[0, :, 0, :dims] = c.spread * torch.randn(Skv, dims, generator=g) / (_QV * _scale_log2(D))
    return q, k


def _offsets(c: Candidate, q, k):
    """Every row's raw logit q.k shifted by ``shift`` (dimension D - 1) and key
    ``jump_col``'s score raised by ``jump`` log2 units (dimension D - 2), through Q = 8 on
    both dimensions for every row (their other values on those dimensions are replaced)."""
    D = c.D
    q, k = q.clone(), k.clone()
    q[0, :, 0, D - 2:] = _QV
    k[0, :, 0, D - 2:] = 0.0
    k[0, :, 0, D - 1] = c.shift / _QV
    k[0, min(c.jump_col, c.seqlen_kv - 1), 0, D - 2] = c.jump / (_QV * _scale_log2(D))
    return q, k


def _rows(c: Candidate) -> list[int]:
    """The trigger's row, then the victims' (distinct, within Sq and D - 1 dims: as many
    as the rows left beside the trigger allow)."""
    trig = c.trigger_row % c.n_rows
    out = [trig]
    r = c.victim_row % c.n_rows
    for _ in range(min(1 + c.n_victims, c.D - 1, c.n_rows - 1)):
        while r in out:
            r = (r + 1) % c.n_rows
        out.append(r)
        r = (r + 5) % c.n_rows
    return out


#: Rows per block of a ``block_sparse`` mask (its keys per block: ``mask_len``).
SPARSE_BLOCK_ROWS = 16


def mask_of(c: Candidate) -> torch.Tensor:
    """[Sq, Skv] bool: the entries the candidate's ``mask`` hides (all False for "none");
    ``pad_rows`` hides every key from the first ``mask_len`` query rows."""
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
    if c.mask == "pad_rows":
        return (rows < L).expand(Sq, Skv)
    raise ValueError(f"mask={c.mask!r}; choose one of {FIELDS['mask'][1]}")


def visible(c: Candidate) -> torch.Tensor:
    """[Sq, kv_used] bool: the keys each query row sees (the mask, the causal diagonal
    aligned to the sequence's end, the valid keys only)."""
    n = c.kv_used
    vis = ~mask_of(c)[:, :n]
    if c.causal:
        rows = torch.arange(c.seqlen_q)[:, None] + (n - c.seqlen_q)
        vis = vis & (torch.arange(n)[None, :] <= rows)
    return vis


def first_tile_visible(c: Candidate, block_n: int, kv_order: str = "ascending") -> torch.Tensor:
    """[Sq] bool: whether a row sees a key in the first tile of ``block_n`` columns a
    kernel visits (the last, partial tile with ``kv_order="descending"``); False for a row
    that sees nothing at all."""
    vis = visible(c)
    n = c.kv_used
    t0 = 0 if kv_order == "ascending" else max(0, -(-n // block_n) - 1)
    return vis[:, t0 * block_n:(t0 + 1) * block_n].any(-1)


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


def kernel_for(policy) -> str:
    """The family the attack runs ``policy`` on: ``KERNEL`` for the lab's FlyDSL policies,
    the family that runs a policy's own semantics (the online-softmax family) for one that
    sets ``fa_lab.semantics`` fields (the failure zoo's presets)."""
    from fa_lab import dispatch, policies

    return dispatch.semantic_family(policies.as_policy(policy)) or KERNEL


def check_space(policy, space) -> None:
    """A space that draws the zoo's inputs (KV caches, finite sentinels) runs on the
    online-softmax family only; ValueError naming ``space`` for any other policy."""
    if space.zoo and kernel_for(policy) == KERNEL:
        name = getattr(policy, "name", policy)
        raise ValueError(f"space={space.name!r} draws KV caches with a tail past the sequence, "
                         f"which only the online-softmax family takes; policy {name!r} runs on "
                         f"{KERNEL}: attack it on 'scores' or 'values'")


def check_mods(policy, mods, *, threshold=None) -> tuple:
    """Refuse, before any work, what the search could not run: ``policy`` with
    ``threshold`` on the model of the kernel under attack (``kernel_for``, backend
    ``"emulator"``), then each score modifier of ``mods`` there, through the same checks a
    call makes (``api.plan``: checks, routing, capabilities).
    A modifier's refusal is a ValueError naming ``mods``. Returns ``parse_mods(mods)``."""
    from fa_lab import api

    mods = parse_mods(mods)
    Sq, Skv, D = 32, 320, 64
    q = torch.zeros(1, Sq, 1, D, dtype=torch.bfloat16)
    k = torch.zeros(1, Skv, 1, D, dtype=torch.bfloat16)
    kw = {"causal": False, "rescale": policy, "rescale_threshold": threshold,
          "backend": "emulator", "kernel": kernel_for(policy)}
    api.plan(q, k, k, **kw)
    probe = {"bias": torch.zeros(Sq, Skv, dtype=torch.bfloat16),
             "alibi_slopes": torch.zeros(1), "sink": torch.zeros(1)}
    for m in mods:
        try:
            api.plan(q, k, k, **kw, **{m: probe[m]})
        except (ValueError, TypeError) as e:
            raise ValueError(f"mods: {m} cannot be searched: {e}") from None
    return mods
