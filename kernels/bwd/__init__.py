"""FlyDSL's gfx950 backward kernels (the "SDPA parity" family): dQ and dK/dV, their exact
models and their faithful Triton port. Not routed: ``fa_lab.autograd`` runs them when a
``flash_attn_func`` output is differentiated.

Upstream (ROCm/FlyDSL; none of it is in the 11c4174d snapshot the forward families model):
``kernels/attention/flash_attn_gfx950_dq.py`` at 1fa54fa3, ``flash_attn_gfx950_dkdv.py`` at
0c57de98 and ``flash_attn_gfx950_helpers.py`` at 14b9edc7 (docs/semantics.md §12).

- ``common``: what both kernels share (scales, the delta preprocessing, arguments).
- ``dq``: the exact model of the dQ kernel.
- ``dkdv``: the exact model of the dK/dV kernel.
- ``model``: the backward pass as upstream's host runs it (delta, then both kernels).
- ``faithful``: the faithful Triton port of both kernels.
"""

from fa_lab.capabilities import HALF, Caps, Family, Implementation

# The backward reads the forward's LSE and output, whatever policy produced them: it makes
# no rescale decision of its own, so it claims no vote or rebase value. What it claims
# (``modes``, run against fp64 gradients by the conformance test): P recomputed from the
# forward's LSE, floored, so a row that saw no key (LSE -inf) gets zero gradients.
_CAPS = Caps(HALF, (64, 128), frozenset({"bias"}), frozenset(), frozenset(),
             modes=frozenset({("lse", "floored")}))
FAMILY = Family("bwd", "FlyDSL's gfx950 backward: dQ and dK/dV from the forward's LSE",
                {"model": Implementation("model", _CAPS),
                 "faithful": Implementation("faithful", _CAPS)}, routed=False)
