"""The values of every policy field, each declared once: its name, what it means and the
parameters it reads.

A ``fa_lab.Policy`` picks one value for ``vote`` and one for ``rebase``; its
``fa_lab.semantics.Semantics`` picks one for each field that takes a fixed set. Every list
of those values in the package derives from the declarations here: the policies' and the
semantics' validation, the kernels' integer codes (``Policy.codes``: a value's position in
its field), the dashboards' controls, the onset bound. A kernel family says which values
each implementation runs, by name, in its ``fa_lab.capabilities.Caps``; a decision site
that meets a value it has no code for raises ``unknown`` (naming the value and the
implementation), never runs another value in its place.

Adding a value is its ``Value`` line here (appended to its field: the Triton kernels
branch on the codes of the values before it), the code that runs it at each decision site
that should run it, and its name in the ``Caps`` of the implementations that now do
(``docs/architecture.md``, "Add a policy value"); ``tests/kernels/test_conformance.py``
then runs it on every implementation that claims it against an fp64 reference.

``uses`` names the parameters a value reads: a ``Policy`` field (``threshold``,
``rebase_bound``, ``rebase``) or a ``Semantics`` field (``floor_value``). A parameter that
none of a policy's values reads must keep its default; a policy that sets it is refused,
naming the parameter (``ignored``), so no argument is silently dropped. ``drags`` (a vote)
says that rows which did not vote move with those that did; ``lowers`` (a rebase) that a
moving row's running max may go down (the onset bound reads both).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Value:
    """One value of one policy field (module docstring)."""

    field: str
    name: object
    meaning: str
    uses: tuple = ()
    drags: bool = False
    lowers: bool = False


def _declare(field: str, *values: tuple) -> tuple[Value, ...]:
    return tuple(Value(field, *v) if isinstance(v, tuple) else v for v in values)


#: field -> its values, in the order of their kernel codes. ``vote`` and ``rebase`` are
#: ``Policy`` fields; the rest are ``Semantics`` fields (``docs/semantics.md`` §9, §10).
DECLARED: dict[str, tuple[Value, ...]] = {
    "vote": (
        Value("vote", "tile", "every row moves its running max to fmax(m, tile max) at every "
              "tile: the eager, reference online softmax"),
        Value("vote", "wave", "a row votes when its tile max jumped more than the threshold "
              "above m (NaN votes); every row of a wave in which some row voted moves "
              "(FlyDSL's DUALWAVE_SWP ballot)", ("threshold", "rebase"), drags=True),
        Value("vote", "row", "a row moves when its own tile max jumped more than the threshold "
              "above m (NaN votes): FlashAttention-4's per-row decision",
              ("threshold", "rebase")),
    ),
    "rebase": (
        Value("rebase", "max", "a moving row's max becomes fmax(m, tile max): never down "
              "(PR #1033, the fix)"),
        Value("rebase", "tile", "a moving row's max becomes its own tile max, down too "
              "(upstream main before PR #1033)", lowers=True),
        Value("rebase", "capped", "a moving row's max becomes its own tile max unless that is "
              "more than rebase_bound below m (or NaN below), when the row keeps m (the "
              "seed's proposal)", ("rebase_bound",), lowers=True),
    ),
    "wave_rows": _declare(
        "wave_rows",
        (16, "16 consecutive query rows of one head share a ballot"),
        (32, "32 consecutive query rows share a ballot (a gfx950 wave's, FlyDSL's)"),
        (64, "64 consecutive query rows share a ballot"),
    ),
    "o_gate": _declare(
        "o_gate",
        ("always", "every row multiplies O by its factor f at every tile (f = 1 if it kept m)"),
        ("row", "a row multiplies O by f only where its own f < 1 (NaN or f >= 1: not applied)"),
        ("wave", "every row of a wave in which some row has f < 1 multiplies O by its f"),
    ),
    "mask_domain": _declare(
        "mask_domain",
        ("scaled", "mask_value and m_init are in the log2 units maxima are compared in",
         ("mask_value", "m_init")),
        ("raw", "mask_value and m_init are raw logits, scaled by softmax_scale * log2 e",
         ("mask_value", "m_init")),
    ),
    "tile_max_floor": _declare(
        "tile_max_floor",
        ("never", "a tile's max is never floored"),
        ("causal", "a causal call floors every tile max at floor_value", ("floor_value",)),
        ("always", "every tile max is floored at floor_value", ("floor_value",)),
    ),
    "empty_row_guard": _declare(
        "empty_row_guard",
        ("none", "a row whose max is still empty computes as any other"),
        ("zero_base", "exponents use 0 in place of an empty max (FA4's safe max)"),
        ("skip", "a row with an empty max skips the tile: P = 0, m, l and O unchanged"),
    ),
    "epilogue_guard": _declare(
        "epilogue_guard",
        ("zero", "the output scale is 1/l for l > 0, else 0 (a NaN l too)"),
        ("one", "the output scale is 1 where l is 0 or NaN, else 1/l"),
        ("none", "the output scale is 1/l (an empty row gives 0 * inf = NaN)"),
    ),
    "clamp_exp_diff": _declare(
        "clamp_exp_diff",
        (False, "exponent differences go to exp2 as computed"),
        (True, "fmax(diff, -inf) before every exp2: a NaN difference becomes -inf, its exp2 0"),
    ),
    "p_cast": _declare(
        "p_cast",
        ("input", "P is rounded to the inputs' format before the PV product (none for fp32)",
         ("p_saturate",)),
        ("none", "P stays fp32 for the PV product"),
        ("bf16", "P is rounded to bf16", ("p_saturate",)),
        ("f16", "P is rounded to f16", ("p_saturate",)),
        ("e4m3", "P is rounded to fp8 e4m3", ("p_saturate",)),
        ("e5m2", "P is rounded to fp8 e5m2", ("p_saturate",)),
    ),
    "p_saturate": _declare(
        "p_saturate",
        (False, "a P past its format's largest finite value becomes inf (NaN for e4m3)"),
        (True, "a P past its format's largest finite value is clamped to it (satfinite)"),
    ),
    "max_lag": _declare(
        "max_lag",
        (False, "a tile's P is computed against the running max its own tile set"),
        (True, "a tile's P is computed against the max from before the tile; the rescale "
               "that follows covers it"),
    ),
    "kv_order": _declare(
        "kv_order",
        ("ascending", "the KV tiles are visited first to last"),
        ("descending", "the last (partial) KV tile is visited first, as FlashAttention's"),
    ),
    "l_sums_cast": _declare(
        "l_sums_cast",
        (False, "l sums P as computed, before its cast"),
        (True, "l sums P after its cast, the values the PV product used"),
    ),
    "q_prescale": _declare(
        "q_prescale",
        (False, "scores are f32(q . k) times the scale"),
        (True, "q is multiplied by the scale and rounded to its format before q . k"),
    ),
    "ftz": _declare(
        "ftz",
        (False, "exp2 keeps its subnormal results"),
        (True, "exp2's subnormal results are flushed to zero"),
    ),
    "softcap_form": _declare(
        "softcap_form",
        ("tanh", "a softcap's tanh computed exactly"),
        ("exp_ratio", "tanh(u) as (e^u - e^-u) / (e^u + e^-u): inf / inf = NaN once |u| > ~88.7"),
        ("exp_sum", "tanh(u) as 1 - 2 / (e^(2u) + 1): saturates at +-1"),
    ),
    "mask_stage": _declare(
        "mask_stage",
        ("scores", "masked and out-of-range scores become mask_value before the max and exp2"),
        ("p", "the max and exp2 see every score of the tile (a cache tail's too); P is "
              "multiplied by the visibility afterwards"),
    ),
    "p_before_vote": _declare(
        "p_before_vote",
        (False, "P is taken against the max the row holds after its decision"),
        (True, "P is taken against fmax(m, tile max) before the vote decides; a row that "
               "keeps its max keeps that P, unrescaled"),
    ),
    "merge_empty": _declare(
        "merge_empty",
        ("empty", "a merge of partials that are all empty gives output 0 and LSE -inf"),
        ("nan", "a merge of partials that are all empty gives NaN (e^(-inf - -inf))"),
    ),
    "lse_base": _declare(
        "lse_base",
        ("e", "the partials write natural-log LSEs, which the merge reads as such"),
        ("2", "the partials write log2 LSEs, which the merge reads as natural logs"),
    ),
    "v_tail": _declare(
        "v_tail",
        ("zero", "V rows past the sequence's end inside its last tile load as zero"),
        ("cache", "V rows past the end inside the last tile hold whatever the cache holds"),
    ),
}

#: The fields of ``fa_lab.Policy`` whose values are declared here (the rest are
#: ``Semantics`` fields).
POLICY_FIELDS = ("vote", "rebase")


def of(field: str) -> tuple[Value, ...]:
    """The declared values of ``field``, in code order; ValueError naming an unknown field."""
    if field not in DECLARED:
        raise ValueError(f"no policy field {field!r} takes a declared set of values; the fields "
                         f"are {list(DECLARED)}")
    return DECLARED[field]


def names(field: str) -> tuple:
    """The names of ``field``'s values, in code order."""
    return tuple(v.name for v in of(field))


def get(field: str, name) -> Value:
    """The declaration of ``field``'s value ``name``; ValueError naming both otherwise."""
    for v in of(field):
        if v.name == name and type(v.name) is type(name):
            return v
    raise ValueError(f"{field} must be one of {names(field)}, got {name!r}")


def code(field: str, name) -> int:
    """The kernels' integer code of a value: its position among ``field``'s values."""
    return of(field).index(get(field, name))


def unknown(field: str, name, where: str) -> ValueError:
    """The error a decision site raises for a value it has no code for: ``where`` names
    the site (e.g. "the swp_bf16 model"); the caller raises it."""
    return ValueError(f"{where} has no code for {field}={name!r} (a value fa_lab.values "
                      "declares, which this implementation does not run; its Caps must not "
                      "list it)")


def branch(field: str, name, where: str, cases: dict):
    """``cases[name]``: a decision site's case for each value it implements, by name; the
    ``unknown`` error, naming the value and ``where``, for any other (no case runs for a
    value it was not written for)."""
    if name not in cases:
        raise unknown(field, name, where)
    return cases[name]


def ignored(chosen: dict, given: dict) -> list[str]:
    """The parameters in ``given`` (name -> whether it is set away from its default) that
    none of the ``chosen`` values (field -> value name) reads, each as a sentence naming
    the parameter, the values chosen and the values that would read it."""
    used = {p for f, n in chosen.items() for p in get(f, n).uses}
    out = []
    for param, is_set in given.items():
        if not is_set or param in used:
            continue
        readers = [v for f in chosen for v in of(f) if param in v.uses]
        now = ", ".join(f"{f}={chosen[f]!r}" for f in dict.fromkeys(v.field for v in readers))
        out.append(f"{param} has no effect with {now or 'these values'}: only "
                   f"{' or '.join(f'{v.field}={v.name!r}' for v in readers)} read it")
    return out
