"""The online-softmax family: one exact model of a FlashAttention-style forward that runs
every field of ``fa_lab.semantics.Semantics`` (masking values, empty-row guards, exponent
clamps, the P offset and cast, tiling and tile order, the V tail), so the failures the zoo
collects (``fa_lab.zoo``) run through ``flash_attn_func`` like any kernel's.

- ``model``: the exact PyTorch model (``docs/semantics.md`` §10); ``forward_varlen`` runs a
  packed batch one sequence at a time, a sequence with no keys included.

A policy that sets a semantics field away from its default routes here (the FlyDSL
families implement the defaults only); ``kernel="online"`` runs any declarative policy
here.
"""

import dataclasses

from fa_lab.capabilities import FP8, HALF, Caps, Family, Implementation
from fa_lab.semantics import Semantics

#: Every semantics field: this model runs them all.
_SEMANTICS = frozenset(f.name for f in dataclasses.fields(Semantics))

#: The vote and rebase values the model runs, by name (``fa_lab.values``).
_VOTES, _REBASES = frozenset({"tile", "wave", "row"}), frozenset({"max", "tile", "capped"})

FAMILY = Family(
    "online", "the online-softmax model: any Policy with any Semantics (the failure zoo's kernels)",
    {"model": Implementation("model", Caps(HALF | FP8, (64, 128),
                                           frozenset({"bias", "varlen", "trace"}), _VOTES,
                                           _REBASES, semantics=_SEMANTICS,
                                           headroom_any_dtype=True), varlen="model")},)
