"""The gfx950 DUALWAVE_SWP bf16/f16 forward: its exact model and its Triton ports.

- ``model``: the exact PyTorch model (the definition; ``docs/semantics.md`` §2).
- ``faithful``: the faithful port, decision for decision (``forward``, ``forward_varlen``).
- ``combine``: the faithful port's split-K ranges and the pass that combines the splits.
- ``fast``: the fast kernel (the policy's semantics, its own tiling); ``num_kv_splits`` > 1
  hands off to ``splitk``; on Hopper at head dim 128 dense calls go to ``hopper`` (Gluon).
- ``splitk``: the fast kernel's split-K (the model's split boundaries) and its combine.
- ``varlen``: the fast kernel on packed (varlen) batches, in one launch.
"""

from fa_lab.capabilities import FEATURES, HALF, Caps, Family, Implementation

#: The vote and rebase values each implementation runs, by name (``fa_lab.values``).
_VOTES, _REBASES = frozenset({"tile", "wave", "row"}), frozenset({"max", "tile", "capped"})
_FAST_VOTES, _FAST_REBASES = frozenset({"tile", "wave"}), frozenset({"max", "tile"})

FAMILY = Family(
    "swp_bf16", "DUALWAVE_SWP: bf16/f16, the lazy wave-ballot rescale (upstream's long-sequence kernel)",
    {"model": Implementation("model", Caps(HALF, (64, 128), frozenset(FEATURES), _VOTES, _REBASES,
                                           rules=True)),
     "faithful": Implementation("faithful", Caps(HALF, (64, 128), frozenset(FEATURES), _VOTES,
                                                 _REBASES), varlen="faithful"),
     "fast": Implementation("fast", Caps(HALF, (64, 128), frozenset({"num_kv_splits", "varlen"}),
                                         _FAST_VOTES, _FAST_REBASES), varlen="varlen")})
