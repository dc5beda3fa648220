"""What each implementation of each kernel family can run: the one home of capabilities.

An implementation is ``"model"`` (fa_lab/models, the definition), ``"faithful"`` (the Triton
ports that keep the model's schedule, compiled or interpreted) or ``"fast"`` (Triton
kernels, and on Hopper a Gluon kernel, with their own tiling and the same policy semantics). ``fa_lab.dispatch`` reads
this table to route and refuse calls; the Triton kernels read it to refuse a policy a
direct caller hands them (``check_policy``), so the two can never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

from .policies import Policy

ALL_VOTES = frozenset({"tile", "wave", "row"})
ALL_REBASES = frozenset({"max", "tile", "capped"})
HALF = frozenset({"bf16", "f16"})
FP8 = frozenset({"fp8"})
#: Optional features a call may ask for.
FEATURES = ("bias", "alibi_slopes", "sink", "num_kv_splits", "varlen", "trace")
_SWP_FEATURES = frozenset(FEATURES)


@dataclass(frozen=True)
class Caps:
    """dtypes ("bf16", "f16", "fp8"), head dims, features (``FEATURES``), the policy
    fields it runs, and whether it runs Python rules (``Policy.from_rule``)."""

    dtypes: frozenset
    head_dims: tuple
    features: frozenset
    votes: frozenset
    rebases: frozenset
    rules: bool = False


#: (family, implementation) -> Caps.
CAPS: dict[tuple[str, str], Caps] = {
    ("swp_bf16", "model"): Caps(HALF, (64, 128), _SWP_FEATURES, ALL_VOTES, ALL_REBASES, rules=True),
    ("swp_bf16", "faithful"): Caps(HALF, (64, 128), _SWP_FEATURES, ALL_VOTES, ALL_REBASES),
    ("swp_bf16", "fast"): Caps(HALF, (64, 128), frozenset({"num_kv_splits", "varlen"}),
                               frozenset({"tile", "wave"}), frozenset({"max", "tile"})),
    ("swp_fp8", "model"): Caps(FP8, (128,), frozenset({"trace"}), ALL_VOTES, ALL_REBASES,
                               rules=True),
    ("swp_fp8", "faithful"): Caps(FP8, (128,), frozenset({"trace"}), ALL_VOTES, ALL_REBASES),
    ("swp_fp8", "fast"): Caps(FP8, (128,), frozenset(), frozenset({"tile", "wave"}), ALL_REBASES),
    ("generic", "model"): Caps(HALF, (64, 128), frozenset({"varlen", "trace"}),
                               frozenset({"tile"}), frozenset({"max"})),
    ("generic", "faithful"): Caps(HALF, (64, 128), frozenset({"varlen", "trace"}),
                                  frozenset({"tile"}), frozenset({"max"})),
    ("swa", "model"): Caps(frozenset({"bf16"}), (128,), frozenset({"trace"}),
                           frozenset({"wave"}), frozenset({"max", "tile"})),
    ("swa", "faithful"): Caps(frozenset({"bf16"}), (128,), frozenset({"trace"}),
                              frozenset({"wave"}), frozenset({"max", "tile"})),
}


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
    return None


def check_policy(policy, family: str, impl: str) -> None:
    """For a kernel's own entry point: ``policy`` must be a resolved ``fa_lab.Policy`` that
    ``(family, impl)`` runs; TypeError/ValueError naming the field otherwise."""
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a fa_lab.Policy, got {type(policy).__name__}")
    why = policy_refusal(CAPS[(family, impl)], policy, f"the {impl} {family} kernel")
    if why:
        raise ValueError(why)
    policy.codes  # noqa: B018 -- refuses a policy that is not resolved for a call
