"""How a kernel family says what it can run: ``Caps``, ``Implementation`` and ``Family``.

A kernel family (``kernels/<family>/``, installed as ``fa_lab.kernels.<family>``) declares
itself in its package's ``__init__`` as one ``Family``: its implementations and what each
can run. An implementation is ``"model"`` (the exact PyTorch model, the definition),
``"faithful"`` (the Triton port that keeps the model's schedule, compiled or interpreted)
or ``"fast"`` (Triton kernels, and on Hopper a Gluon kernel, with their own tiling and the
same policy semantics). ``fa_lab.dispatch`` builds its table from the registered families
(``fa_lab.kernels.FAMILIES``) to route and refuse calls; the Triton kernels read the same
``Caps`` to refuse a policy a direct caller hands them (``check_policy``), so the two can
never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from fa_lab import values
from fa_lab.policies import Policy
from fa_lab.routing import Rule

#: The implementations a family may have, in the order the backends prefer them.
IMPLEMENTATIONS = ("model", "faithful", "fast")
HALF = frozenset({"bf16", "f16"})
FP8 = frozenset({"fp8"})
#: Optional features a call may ask for. ``"window"`` is a sliding window (``window_left``,
#: ``window_right``), which ``swa_attn_func`` asks of the family that claims it.
FEATURES = ("bias", "alibi_slopes", "sink", "num_kv_splits", "varlen", "trace", "paged", "window")
#: How errors name a dtype of ``Caps.dtypes``.
DTYPE_NAMES = {"bf16": "bfloat16", "f16": "float16", "fp8": "float8_e4m3fn"}


@dataclass(frozen=True)
class PagedCall:
    """The form of the paged call a family's kernel takes (``Caps.paged_call`` names one of
    ``PAGED_CALLS``): ``packed``: q packed varlen ``[total_q, H, D]`` with ``cu_seqlens_q``,
    ``cu_seqlens_kv`` and ``max_seqlen_q`` (else dense ``[B, Sq, H, D]``); ``causal``: the
    ``causal`` values it takes (True: bottom-right); ``layouts``: the ``kv_cache_layout``
    values it takes (``fa_lab.paged``); ``what``: whose call it is and what checks it."""

    packed: bool
    causal: tuple
    layouts: tuple
    what: str


#: The paged call forms by name. Every form reads 64-row pages through ``block_table``
#: with ``seqlen_k`` per sequence.
PAGED_CALLS = {
    "dense": PagedCall(False, (False, True), ("linear", "vectorized"),
                       "FlyDSL main's paged DUALWAVE_SWP: dense q (fa_lab.paged.check)"),
    "packed_causal": PagedCall(True, (True,), ("vectorized",),
                               "FlyDSL #1066's paged fp8 prefill: packed q, seqlen_k equal to "
                               "cu_seqlens_kv's lengths (fa_lab.paged.check_fp8)"),
}


@dataclass(frozen=True)
class Caps:
    """dtypes ("bf16", "f16", "fp8"), head dims, features (``FEATURES``), the vote and
    rebase values it runs (``votes``, ``rebases``: each by name, as ``fa_lab.values``
    declares it; no wildcard, so a newly declared value runs nowhere until an
    implementation lists it), whether it runs Python rules (``Policy.from_rule``), the
    ``fa_lab.semantics`` fields it runs away from their defaults (``semantics``: a policy
    that sets any other is refused, naming it), whether a numeric P offset
    (``p_headroom``) applies to every dtype (``headroom_any_dtype``; else fp8 only), the
    V/output head dims it takes (``head_dims_v``; None: Dv must equal D), and, where it
    claims the "paged" feature, the form of paged call it takes (``paged_call``, a name of
    ``PAGED_CALLS``: "dense" unless it says otherwise), and ``modes``: the values of the
    choices of its own it runs, beyond the policy's (a family with an entry point of its
    own: a decode's scale mode, upstream version and partition count, MLA's P headroom, the
    backward's softmax), as (choice, value) pairs; each is a claim the conformance test
    runs against fp64, as each vote and rebase value is."""

    dtypes: frozenset
    head_dims: tuple
    features: frozenset
    votes: frozenset
    rebases: frozenset
    rules: bool = False
    semantics: frozenset = frozenset()
    headroom_any_dtype: bool = False
    head_dims_v: tuple | None = None
    paged_call: str = "dense"
    modes: frozenset = frozenset()

    def __post_init__(self):
        unknown = sorted(set(self.features) - set(FEATURES))
        if unknown:
            raise ValueError(f"Caps.features names {unknown}, which are not features; the "
                             f"features are {FEATURES}")
        if self.paged_call not in PAGED_CALLS:
            raise ValueError(f"Caps.paged_call={self.paged_call!r} is not a paged call form; "
                             f"the forms are {tuple(PAGED_CALLS)}")
        if self.paged_call != "dense" and "paged" not in self.features:
            raise ValueError(f"Caps.paged_call={self.paged_call!r} names a paged call form, but "
                             "the features do not claim 'paged'")
        if not isinstance(self.modes, frozenset) or not all(
                isinstance(m, tuple) and len(m) == 2 and isinstance(m[0], str) for m in self.modes):
            raise TypeError("Caps.modes must be a frozenset of (choice name, value) pairs")
        # the vote and rebase values an implementation runs, each by name: a declared value
        # (fa_lab.values) that is not listed here is refused, never run as another
        for field, names in (("vote", self.votes), ("rebase", self.rebases)):
            if not isinstance(names, frozenset):
                raise TypeError(f"Caps.{field}s must be a frozenset of {field} names, got "
                                f"{type(names).__name__}")
            for name in names:
                values.get(field, name)


@dataclass(frozen=True)
class Implementation:
    """One implementation of a family: ``module``, its module under the family's package
    (with ``forward``); ``caps``, what it runs; ``varlen``, a module with a one-launch
    ``forward_varlen`` (None: varlen calls run one dense call per sequence); ``policy``:
    whether ``forward`` takes ``policy=`` (False for a kernel with one fixed, eager rule)."""

    module: str
    caps: Caps
    varlen: str | None = None
    policy: bool = True


@dataclass(frozen=True)
class Family:
    """A kernel family: everything dispatch knows of it (dispatch names no family).

    ``name`` (the package's), one line on what it is, its implementations by kind
    (``IMPLEMENTATIONS``; the model is required; each ``Caps`` says the dtypes, head
    dims, features and policy values it runs); ``routed``: whether ``flash_attn_func``
    routes to it (False: an entry point of its own calls it, as ``swa_attn_func`` does the
    SWA kernel); ``rule``: upstream's routing to the FlyDSL kernel it models
    (``fa_lab.routing.Rule``: upstream's kernel name, which calls upstream sends there, why
    it cannot run a call asked for by name). A family without a rule is fa_lab's own
    (``upstream`` False): it runs where ``kernel=`` or a policy's semantics ask for it.
    ``unconsulted(call, policy)``: why a lazy ``policy`` would never be consulted on
    ``call`` (a message), or None; dispatch warns with it. ``raw_units``: its traces
    record maxima in raw fp8-product units (``trace`` scales them by the call's log2 scale)
    rather than log2 units. ``check_args``: for a family with an entry point of its own,
    the check of that entry point's own arguments (``check_args(q, k, v, **arguments)``,
    raising naming the argument; returns the policy it runs), or None."""

    name: str
    description: str
    implementations: dict
    routed: bool = True
    rule: Rule | None = None
    unconsulted: Callable | None = None
    raw_units: bool = False
    check_args: Callable | None = None

    def __post_init__(self):
        unknown = set(self.implementations) - set(IMPLEMENTATIONS)
        if unknown or "model" not in self.implementations:
            raise ValueError(f"family {self.name!r}: implementations must include 'model' and be "
                             f"among {IMPLEMENTATIONS}, got {sorted(self.implementations)}")
        for kind, impl in self.implementations.items():
            if not isinstance(impl, Implementation):
                raise TypeError(f"family {self.name!r}: {kind} must be an Implementation")
        if self.rule is not None and not isinstance(self.rule, Rule):
            raise TypeError(f"family {self.name!r}: rule must be a fa_lab.routing.Rule or None")

    @property
    def upstream(self) -> bool:
        """Whether the family models one of upstream FlyDSL's kernels (it has a ``rule``)."""
        return self.rule is not None

    def caps(self, kind: str) -> Caps:
        return self.implementations[kind].caps


def policy_refusal(caps: Caps, policy: Policy, where: str) -> str | None:
    """Why ``where`` (e.g. "the swp_bf16 kernel on backend='fast'") cannot run
    ``policy``, naming the field; None when it can."""
    if policy.rule is not None:
        if not caps.rules:
            return (f"policy {policy.name!r} is a Python rule (Policy.from_rule), which {where} "
                    "cannot run; rules run on the models (backend='emulator')")
        return None
    if policy.vote not in caps.votes:
        return (f"policy {policy.name!r} has vote={policy.vote!r}, which {where} lacks "
                f"(it has vote in {sorted(caps.votes)})")
    if policy.rebase not in caps.rebases:
        return (f"policy {policy.name!r} has rebase={policy.rebase!r}, which {where} lacks "
                f"(it has rebase in {sorted(caps.rebases)})")
    return semantics_refusal(caps, policy, where) if policy.semantic_fields else None


def semantics_refusal(caps: Caps, policy: Policy, where: str) -> str | None:
    """Why ``where`` cannot run ``policy``'s semantics: the ``fa_lab.semantics`` fields it
    sets away from their defaults that ``caps`` does not run, by name; None when it can."""
    missing = [f for f in policy.semantic_fields if f not in caps.semantics]
    if not missing:
        return None
    return (f"{where} cannot run policy {policy.name!r}: it sets semantics field(s) "
            f"{', '.join(missing)}, which only the online-softmax family runs (kernel='online', "
            "fa_lab.kernels.online)")


def cleared(policy: Policy) -> set:
    """The (family, implementation) pairs ``policy`` has been checked for: a resolved
    policy and a family's capabilities never change, so one check holds for the policy
    object's life. ``fa_lab.dispatch.plan`` adds the pair it planned, so the entry point it
    then calls does not decide again; a direct caller's first call checks."""
    return policy.__dict__.setdefault("_cleared_for", set())


def check_semantics(policy, family: Family, impl: str) -> None:
    """For a model's own entry point: ValueError naming the semantics fields of ``policy``
    that ``family``'s implementation ``impl`` does not run (``semantics_refusal``)."""
    if isinstance(policy, Policy) and (family.name, impl) in cleared(policy):
        return
    why = semantics_refusal(family.caps(impl), policy, f"the {impl} {family.name} kernel")
    if why:
        raise ValueError(why)


def check_policy(policy, family: Family, impl: str) -> None:
    """For a kernel's own entry point: ``policy`` must be a resolved ``fa_lab.Policy`` that
    ``family``'s implementation ``impl`` runs; TypeError/ValueError naming the field
    otherwise."""
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a fa_lab.Policy, got {type(policy).__name__}")
    done = cleared(policy)
    if (family.name, impl) in done:
        return
    why = policy_refusal(family.caps(impl), policy, f"the {impl} {family.name} kernel")
    if why:
        raise ValueError(why)
    policy.codes  # noqa: B018 -- refuses a policy that is not resolved for a call
    done.add((family.name, impl))
