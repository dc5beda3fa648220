"""The gfx950 fp8 BN128 forward: its exact model and its Triton ports.

- ``model``: the exact PyTorch model (the definition; ``docs/semantics.md`` §3).
- ``faithful``: the faithful port of ``DualwaveFp8SoftmaxHelper``, row for row.
- ``fast``: the fast kernel (the fp8 policies' semantics, its own tiling).
"""

from fa_lab.capabilities import FP8, Caps, Family, Implementation
from fa_lab.routing import FP8_DUALWAVE

#: The vote and rebase values each implementation runs, by name (``fa_lab.values``).
_VOTES, _REBASES = frozenset({"tile", "wave", "row"}), frozenset({"max", "tile", "capped"})
_FAST_VOTES = frozenset({"tile", "wave"})

FAMILY = Family(
    "swp_fp8", "the fp8 (e4m3) DUALWAVE_SWP kernel: raw-domain maxima, 128-column decisions",
    {"model": Implementation("model", Caps(FP8, (128,), frozenset({"trace"}), _VOTES, _REBASES,
                                           rules=True)),
     "faithful": Implementation("faithful", Caps(FP8, (128,), frozenset({"trace"}), _VOTES,
                                                 _REBASES)),
     "fast": Implementation("fast", Caps(FP8, (128,), frozenset(), _FAST_VOTES, _REBASES))},
    rule=FP8_DUALWAVE, raw_units=True)
