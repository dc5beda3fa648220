"""Rescale policies as data: the one home of the lab's central object.

A ``Policy`` says how a lazy online-softmax rescale decides (``docs/semantics.md`` §9):

* ``vote``: who decides whether a row rescales at a tile ("tile", eager; "wave", FlyDSL's
  32-row ballot; "row", FlashAttention-4's), and ``rebase``: what a moving row's running
  max becomes ("max", "tile", "capped"). Each value, its meaning and the parameters it
  reads are declared once, in ``fa_lab.values``; a parameter none of the policy's values
  reads (``threshold`` under vote "tile", ``rebase_bound`` under a rebase but "capped")
  is refused.
* ``threshold`` (log2 units; fp8 compares scaled differences), ``rebase_bound`` (capped
  only) and ``p_headroom`` (fp8 only: True for PR #1020's lift of P before its e4m3 cast,
  or a number of log2 units; the online-softmax model adds it before whatever cast
  ``semantics.p_cast`` names, as FlashAttention-4's ``max_offset``).
* ``name``, ``description`` and ``color`` for tables, legends and dropdowns.
* ``semantics``: the kernel semantics around the decision (``fa_lab.semantics``: masking,
  empty rows, exponent clamps, the P cast, the epilogue, tiling). The defaults are
  DUALWAVE_SWP's; each kernel family states in its capabilities which fields it runs
  (``fa_lab.capabilities.Caps.semantics``: the online-softmax family runs them all), and
  a family that lacks one refuses the policy, naming the field.

``Policy.from_rule(rule, name=...)`` wraps a Python rule ``rule(m, mt, threshold) ->
m_new`` over one wave's rows (``[..., 32]`` tensors); rows whose max changes rescale by
``exp2(m - m_new)``. Rules run on the models only.

``register`` adds a policy to the registry that the dashboards, the CLI and the
comparison tables read. Kernels read a policy through ``codes``: the one integer
encoding, derived here, so no module outside this one compares a policy's name.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import warnings
from dataclasses import dataclass
from typing import Callable

from fa_lab import values
from fa_lab.checks import caller_stacklevel
from fa_lab.numerics import E4M3_MAX
from fa_lab.semantics import Semantics

#: DUALWAVE_SWP_RESCALE_THRESHOLD upstream, in log2 units.
DEFAULT_THRESHOLD = 8.0
#: The seed's proposed cap on a downward rebase, in log2 units.
DEFAULT_REBASE_BOUND = 16.0
#: Upstream's fp8 threshold rule after PR #1020 (see ``threshold_by_kv_len``).
BY_KV_LEN = "by_kv_len"

#: The vote and rebase values, in the order of their kernel codes (``Policy.codes``), as
#: ``fa_lab.values`` declares them.
VOTES = values.names("vote")
REBASES = values.names("rebase")

#: Colours for registered policies that bring none (colour-blind-safe, after the built-ins').
_PALETTE = ("#e6ab02", "#17becf", "#a6761d", "#66a61e", "#8c564b", "#bcbd22", "#e377c2",
            "#7f7f7f")


def threshold_by_kv_len(seqlen_kv: int) -> float:
    """Upstream fp8 threshold after PR #1020: 6 for Skv <= 4096, else 4."""
    return 6.0 if seqlen_kv <= 4096 else 4.0


def check_number(name: str, value, *, allow_none: bool = True, positive: bool = False):
    """A finite real number >= 0 (> 0 with ``positive``) as float, or None; raises
    TypeError/ValueError naming ``name``."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")
    return float(value)


class RuleError(RuntimeError):
    """A policy's Python rule (``Policy.from_rule``) raised: the message names the policy and
    where (the loop step, the rows, the batch and head); the rule's own exception is its
    ``__cause__``."""


@dataclass(frozen=True)
class Codes:
    """A policy as the Triton kernels take it: small ints and fp32-ready numbers.
    ``vote`` and ``rebase`` index ``VOTES`` and ``REBASES``; ``bound`` is 0 unless capped."""

    vote: int
    rebase: int
    threshold: float
    bound: float
    headroom: float

    @property
    def lazy(self) -> bool:
        return self.vote != values.code("vote", "tile")


@dataclass(frozen=True)
class Policy:
    """One rescale policy. ``threshold`` may be ``"by_kv_len"`` (fp8: upstream's rule)
    and ``p_headroom`` True (fp8: PR #1020's lift) until a call resolves them to numbers
    (``resolve``); a resolved policy is what models and kernels receive."""

    vote: str | None = "wave"
    rebase: str | None = "max"
    threshold: float | str = DEFAULT_THRESHOLD
    rebase_bound: float | None = None
    p_headroom: bool | float = 0.0
    name: str = "custom"
    description: str = ""
    color: str | None = None
    rule: Callable | None = None
    semantics: Semantics = Semantics()

    def __post_init__(self):
        if not isinstance(self.semantics, Semantics):
            raise TypeError(f"semantics must be a fa_lab.semantics.Semantics, got "
                            f"{type(self.semantics).__name__}")
        if not isinstance(self.name, str) or not self.name.strip() or "," in self.name:
            raise ValueError(f"name must be a non-empty str without commas, got {self.name!r}")
        if not isinstance(self.description, str):
            raise TypeError(f"description must be a str, got {type(self.description).__name__}")
        if self.color is not None and not (isinstance(self.color, str) and self.color.startswith("#")
                                           and len(self.color) in (4, 7)):
            raise ValueError(f"color must be None or a '#rrggbb' string, got {self.color!r}")
        if self.rule is not None:
            if not callable(self.rule):
                raise TypeError(f"rule must be callable, got {type(self.rule).__name__}")
            if self.vote is not None or self.rebase is not None or self.rebase_bound is not None:
                raise ValueError("a rule policy decides by its rule: vote, rebase and "
                                 "rebase_bound must be None (use Policy.from_rule)")
        else:
            values.get("vote", self.vote)
            values.get("rebase", self.rebase)
            if "rebase_bound" in self.parameters:
                check_number("rebase_bound", self.rebase_bound, allow_none=False)
        if self.threshold != BY_KV_LEN:
            check_number("threshold", self.threshold, allow_none=False)
        if self.rule is None:
            # a parameter no value of this policy reads is refused, not dropped
            unread = values.ignored({"vote": self.vote, "rebase": self.rebase}, {
                "rebase": self.rebase != "max", "rebase_bound": self.rebase_bound is not None,
                "threshold": self.threshold != DEFAULT_THRESHOLD})
            if unread:
                raise ValueError(unread[0])
        if not isinstance(self.p_headroom, bool):
            check_number("p_headroom", self.p_headroom, allow_none=False)
            if self.p_headroom > math.log2(E4M3_MAX):
                # past log2(448) even an eager row's largest P (1) is lifted above e4m3's
                # range: the kernel runs it, but every row's largest P is clipped or NaN
                warnings.warn(f"p_headroom={self.p_headroom!r} exceeds log2(448) = "
                              f"{math.log2(E4M3_MAX):.4f}: every row's largest P is lifted past "
                              "e4m3's range, so it saturates to 448 (fp8_saturate=True) or "
                              "becomes NaN (False), and the output is biased low",
                              UserWarning, stacklevel=3)

    @classmethod
    def from_rule(cls, rule: Callable, *, name: str, threshold: float = DEFAULT_THRESHOLD,
                  description: str = "", color: str | None = None) -> "Policy":
        """A policy decided by ``rule(m, mt, threshold) -> m_new``: ``m`` and ``mt`` are one
        wave's running and tile maxima at one loop step (fp8: one tile pair), ``[..., 32]``
        fp32 tensors in log2 units (fp8: ``m * ls`` and ``mt * ls``; the kernel scales the
        difference instead, ``(mt - m) * ls``, which can round differently right at the
        threshold), ``threshold`` in log2 units; rows where ``m_new != m`` rescale by
        ``exp2(m - m_new)``. The models run it; the Triton kernels refuse it."""
        return cls(vote=None, rebase=None, threshold=threshold, name=name,
                   description=description or f"Python rule {getattr(rule, '__name__', rule)!s}",
                   color=color, rule=rule)

    @property
    def lazy(self) -> bool:
        """True where rows may keep a stale running max (every vote but 'tile'; a rule)."""
        return self.rule is not None or "threshold" in self.parameters

    @functools.cached_property
    def parameters(self) -> frozenset:
        """The parameters this policy's vote and rebase read (``fa_lab.values``: e.g.
        ``threshold`` for a lazy vote, ``rebase_bound`` for rebase "capped"); a rule reads
        its threshold (computed once per policy)."""
        if self.rule is not None:
            return frozenset({"threshold"})
        return frozenset(values.get("vote", self.vote).uses) | frozenset(
            values.get("rebase", self.rebase).uses)

    @functools.cached_property
    def semantic_fields(self) -> tuple[str, ...]:
        """The ``semantics`` fields this policy sets away from their defaults: what a kernel
        must implement, beyond vote/rebase/threshold, to run it (computed once per policy)."""
        return self.semantics.changed()

    @property
    def codes(self) -> Codes:
        """The kernels' encoding of a resolved declarative policy (the semantics fields are
        refused, or not, by the kernel's capabilities: ``capabilities.check_policy``)."""
        if self.rule is not None:
            raise ValueError(f"policy {self.name!r} is a Python rule; it runs on the models only "
                             "(backend='emulator')")
        if self.threshold == BY_KV_LEN or isinstance(self.p_headroom, bool) and self.p_headroom:
            raise ValueError(f"policy {self.name!r} is not resolved for a call (policies.resolve)")
        return Codes(values.code("vote", self.vote), values.code("rebase", self.rebase),
                     float(self.threshold),
                     float(self.rebase_bound or 0.0), float(self.p_headroom))

    def describe(self) -> str:
        parts = [self.name]
        if self.lazy:
            parts.append(f"thr={self.threshold:g}" if self.threshold != BY_KV_LEN else "thr=by_kv_len")
        if self.rebase_bound is not None:
            parts.append(f"bound={self.rebase_bound:g}")
        if not isinstance(self.p_headroom, bool) and self.p_headroom:
            parts.append(f"H={self.p_headroom:.3f}")
        return " ".join(parts)


#: The registry, in display order: name -> Policy.
_REGISTRY: dict[str, Policy] = {}
#: The registered names that are a library's presets (``register(..., preset=True)``).
_PRESET_NAMES: set[str] = set()
_BUILTINS = (
    Policy("tile", "max", name="eager", color="#1b9e77",
           description="rescale every tile to fmax(m, tile max): the reference online softmax"),
    Policy("wave", "max", name="lazy", color="#1f77b4",
           description="wave ballot, then every row rebases to fmax(m, tile max) (PR #1033, fixed)"),
    Policy("wave", "tile", name="lazy_unfixed", color="#d62728",
           description="wave ballot, then every row rebases to its own tile max "
                       "(upstream main before #1033)"),
    Policy("wave", "capped", rebase_bound=DEFAULT_REBASE_BOUND, name="lazy_capped", color="#7b4fb8",
           description="wave ballot, own tile max, but downward rebases larger than "
                       "rebase_bound skipped (the seed's proposal)"),
    Policy("row", "max", name="fa4_row", color="#e7298a",
           description="FlashAttention-4: each row rebases to fmax(m, tile max) only if it "
                       "jumped past the threshold itself"),
)
BUILTIN_NAMES = tuple(p.name for p in _BUILTINS)


def register(policy: Policy, *, replace: bool = False, preset: bool = False) -> Policy:
    """Make ``policy`` appear wherever policies are listed (dashboards, CLI, tables); gives
    it a colour of its own if it has none. ``preset``: one of a library's named presets
    (the failure zoo's): listed and selectable like any policy, but not among the user's
    own (``user_names``), which views compare on every redraw. Returns the registered
    value."""
    if not isinstance(preset, bool):
        raise TypeError(f"preset must be a bool, got {type(preset).__name__}")
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a fa_lab.Policy, got {type(policy).__name__}")
    if policy.name in _REGISTRY:
        if policy.name in BUILTIN_NAMES:
            raise ValueError(f"{policy.name!r} is a built-in policy; choose another name")
        if not replace:
            raise ValueError(f"a policy named {policy.name!r} is already registered (replace=True "
                             "to replace it)")
    if policy.color is None:
        used = {p.color for p in _REGISTRY.values()}
        free = [c for c in _PALETTE if c not in used] or list(_PALETTE)
        policy = dataclasses.replace(policy, color=free[0])
    _REGISTRY[policy.name] = policy
    (_PRESET_NAMES.add if preset else _PRESET_NAMES.discard)(policy.name)
    return policy


def unregister(name: str) -> None:
    """Remove a user policy (built-ins stay)."""
    if name in BUILTIN_NAMES:
        raise ValueError(f"{name!r} is a built-in policy and cannot be unregistered")
    if name not in _REGISTRY:
        raise KeyError(f"no policy named {name!r} is registered")
    del _REGISTRY[name]
    _PRESET_NAMES.discard(name)


for _p in _BUILTINS:
    register(_p)


#: Modules that register a library's presets when imported (the failure zoo's
#: ``"<entry>:<variant>"``). They sit above the core, which never imports them: the registry
#: imports them the first time it needs them (a name it lacks, or the list of names), so a
#: preset works by name wherever a policy does.
PRESET_MODULES = ["fa_lab.zoo"]
_presets_loaded = False


def _load_presets() -> None:
    global _presets_loaded
    if _presets_loaded:
        return
    _presets_loaded = True
    for module in PRESET_MODULES:
        importlib.import_module(module)


def get(name: str) -> Policy:
    """The registered policy ``name``; ValueError listing the registered names."""
    if not isinstance(name, str):
        raise TypeError(f"rescale must be a policy name (str) or a fa_lab.Policy, got "
                        f"{type(name).__name__}")
    if name not in _REGISTRY and not _presets_loaded:
        _load_presets()
    if name not in _REGISTRY:
        raise ValueError(f"rescale={name!r} is not a registered policy; choose one of "
                         f"{list(_REGISTRY)} or pass a fa_lab.Policy")
    return _REGISTRY[name]


def names() -> tuple[str, ...]:
    """Registered policy names, built-ins first, in registration order (presets included)."""
    _load_presets()
    return tuple(_REGISTRY)


def registered() -> tuple[Policy, ...]:
    _load_presets()
    return tuple(_REGISTRY.values())


def user_names() -> tuple[str, ...]:
    """The registered names that are neither built-ins nor presets: the user's own."""
    _load_presets()
    return tuple(n for n in _REGISTRY if n not in BUILTIN_NAMES and n not in _PRESET_NAMES)


def as_policy(rescale) -> Policy:
    """A name or a Policy, as a Policy."""
    if isinstance(rescale, Policy):
        return rescale
    policy = _REGISTRY.get(rescale) if isinstance(rescale, str) else None
    return policy if policy is not None else get(rescale)


def color(policy) -> str | None:
    """The colour of a policy, or of a registered policy's name (None for other names,
    such as the labels of implementations)."""
    if isinstance(policy, Policy):
        return policy.color if policy.color is not None else color(policy.name)
    if isinstance(policy, str) and policy not in _REGISTRY:
        _load_presets()
    p = _REGISTRY.get(policy) if isinstance(policy, str) else None
    return None if p is None else p.color


@dataclass(frozen=True)
class Request:
    """A call's rescale arguments as given: the policy is resolved from them once the
    kernel family is known (``fa_lab.dispatch.plan``). ``lazy_flag`` is
    ``dualwave_swp_lazy_rescale`` (None: not given, the upstream version's default)."""

    rescale: object = None
    lazy_flag: bool | None = None
    rescale_threshold: float | str | None = None
    rebase_bound: float | None = None
    p_headroom: bool | float | None = None

    def explicit(self, *, fp8: bool, reads_flag: bool = True) -> bool:
        """Whether the caller asked for a rescale (routing must honour it, or say why
        not): a policy, a threshold or a headroom, or the lazy flag where the kernel
        reads it (``reads_flag``: the version's fp8 kernel may ignore it)."""
        return (self.rescale is not None or self.rescale_threshold is not None
                or self.p_headroom is not None
                or (self.lazy_flag is not None and (not fp8 or reads_flag)))

    def wanted(self, default: Policy) -> Policy:
        """The policy asked for, before it is resolved against a call."""
        return default if self.rescale is None else as_policy(self.rescale)

    def resolve(self, *, fp8: bool, seqlen_kv: int, default: Policy,
                headroom_any_dtype: bool = False) -> Policy:
        """The resolved policy for a call (``resolve``), ``default`` where none was named.
        Resolution is a pure function of these values: a repeated call takes it from a
        cache (keyed by the Policy objects, so a re-registered name resolves anew)."""
        rescale = self.rescale
        if rescale is not None and not isinstance(rescale, Policy):
            rescale = as_policy(rescale)
        args = (fp8, seqlen_kv, rescale, self.lazy_flag is not False, self.rescale_threshold,
                self.rebase_bound, self.p_headroom, default, headroom_any_dtype)
        try:  # typed: True and 1 (a headroom) are equal and hash alike, and mean different things
            key = ((bool, fp8), (type(seqlen_kv), seqlen_kv), (type(rescale), rescale),
                   (bool, args[3]), (type(args[4]), args[4]), (type(args[5]), args[5]),
                   (type(args[6]), args[6]), (type(default), default),
                   (type(headroom_any_dtype), headroom_any_dtype))
            policy, said = _resolve_cached(key)
        except TypeError:  # an argument of a type resolve() refuses (or cannot hash): let it say so
            return _resolve(*args)
        for message, category in said:  # what resolving said, said again on every call
            warnings.warn(message, category, stacklevel=caller_stacklevel())
        return policy

    def given(self) -> str:
        """The arguments given, as the caller wrote them."""
        names = ("rescale", "dualwave_swp_lazy_rescale", "rescale_threshold", "rebase_bound",
                 "p_headroom")
        vals = (getattr(self.rescale, "name", self.rescale), self.lazy_flag,
                self.rescale_threshold, self.rebase_bound, self.p_headroom)
        return ", ".join(f"{n}={v!r}" for n, v in zip(names, vals) if v is not None)


def _resolve(fp8, seqlen_kv, rescale, lazy_flag, threshold, bound, headroom, default, any_dtype):
    return resolve(fp8=fp8, seqlen_kv=seqlen_kv, rescale=rescale, dualwave_swp_lazy_rescale=lazy_flag,
                   rescale_threshold=threshold, rebase_bound=bound, p_headroom=headroom,
                   default=default, headroom_any_dtype=any_dtype)


@functools.lru_cache(maxsize=512)
def _resolve_cached(key):
    """(the resolved policy, the warnings resolving it gave: (message, category) each)."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        policy = _resolve(*(a for _, a in key))
    return policy, tuple((str(w.message), w.category) for w in said)


def resolve(
    *,
    fp8: bool,
    seqlen_kv: int,
    rescale=None,
    dualwave_swp_lazy_rescale: bool = True,
    rescale_threshold: float | str | None = None,
    rebase_bound: float | None = None,
    p_headroom: bool | float | None = None,
    default: Policy | None = None,
    headroom_any_dtype: bool = False,
) -> Policy:
    """Fold the user's rescale arguments into one resolved policy, or raise naming the
    argument. ``default`` is the policy a bare call runs (the upstream version's; lazy or
    eager by ``dualwave_swp_lazy_rescale`` when not given). ``headroom_any_dtype``: the
    kernel lifts P before whatever cast its semantics name (the online-softmax family), so
    a numeric ``p_headroom`` applies to every dtype; PR #1020's lift (True) stays fp8's."""
    if not isinstance(dualwave_swp_lazy_rescale, bool):
        raise TypeError("dualwave_swp_lazy_rescale must be a bool, "
                        f"got {type(dualwave_swp_lazy_rescale).__name__}")
    if rescale is None:
        policy = default if default is not None else get("lazy" if dualwave_swp_lazy_rescale else "eager")
    else:
        policy = as_policy(rescale)
        if not dualwave_swp_lazy_rescale and policy.lazy:
            raise ValueError(f"rescale={policy.name!r} contradicts dualwave_swp_lazy_rescale=False")

    if rescale_threshold is not None:
        if not policy.lazy:
            raise ValueError(f"rescale_threshold has no effect with rescale={policy.name!r} "
                             "(eager rescales every tile)")
        if isinstance(rescale_threshold, str):
            if rescale_threshold != BY_KV_LEN:
                raise ValueError(f"rescale_threshold must be a number or {BY_KV_LEN!r}, "
                                 f"got {rescale_threshold!r}")
        else:
            check_number("rescale_threshold", rescale_threshold)
        policy = dataclasses.replace(policy, threshold=rescale_threshold)
    if policy.threshold == BY_KV_LEN:
        if not fp8:
            raise ValueError("rescale_threshold='by_kv_len' is the fp8 kernel's rule (PR #1020); "
                             "give a number for bf16/f16")
        policy = dataclasses.replace(policy, threshold=threshold_by_kv_len(seqlen_kv))

    if rebase_bound is not None:
        bound = check_number("rebase_bound", rebase_bound)
        if "rebase_bound" not in policy.parameters:
            readers = [v.name for v in values.of("rebase") if "rebase_bound" in v.uses]
            raise ValueError(f"rebase_bound applies to policies with rebase in {readers}, "
                             f"not {policy.name!r}")
        policy = dataclasses.replace(policy, rebase_bound=bound)

    if p_headroom is not None:
        if not fp8 and (isinstance(p_headroom, bool) or not headroom_any_dtype):
            raise ValueError("p_headroom applies to fp8 inputs only (PR #1020 lifts the fp8 P "
                             "before its cast)")
        if not isinstance(p_headroom, bool):
            check_number("p_headroom", p_headroom)
        policy = dataclasses.replace(policy, p_headroom=p_headroom)
    if isinstance(policy.p_headroom, bool):
        lift = 0.0
        if policy.p_headroom:
            if not fp8:
                raise ValueError(f"policy {policy.name!r} lifts P (p_headroom), which applies "
                                 "to fp8 inputs only")
            # A lazy row's largest P is 2**THR before the lift, so the lift is
            # log2(448) - THR; an eager row's largest P is 1.
            lift = math.log2(E4M3_MAX) - (float(policy.threshold) if policy.lazy else 0.0)
            lift = max(lift, 0.0)
        policy = dataclasses.replace(policy, p_headroom=lift)
    elif policy.p_headroom and not fp8 and not headroom_any_dtype:
        raise ValueError(f"policy {policy.name!r} has p_headroom={policy.p_headroom}, which "
                         "applies to fp8 inputs only")
    return dataclasses.replace(policy, threshold=float(policy.threshold))

