"""The gfx950 generic forward (upstream's short-sequence kernel, eager only): its exact
model and its faithful Triton port.

- ``model``: the exact PyTorch model (the definition; ``docs/semantics.md`` §4).
- ``faithful``: the faithful port.
"""

from fa_lab.capabilities import HALF, Caps, Family, Implementation
from fa_lab.routing import GENERIC

_CAPS = Caps(HALF, (64, 128), frozenset({"varlen", "trace"}), frozenset({"tile"}), frozenset({"max"}))
FAMILY = Family("generic", "the generic kernel: bf16/f16, eager, short sequences",
                {"model": Implementation("model", _CAPS, policy=False),
                 "faithful": Implementation("faithful", _CAPS, policy=False)},
                rule=GENERIC)
