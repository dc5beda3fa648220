"""The gfx950 fp8 BN128 forward: its exact model and its Triton ports.

- ``model``: the exact PyTorch model (the definition; ``docs/semantics.md`` §3).
- ``faithful``: the faithful port of ``DualwaveFp8SoftmaxHelper``, row for row (dense, D 128).
- ``faithful_split``: the faithful port of ``split`` (and the family's faithful entry point,
  handing dense D = 128 calls to ``faithful``).
- ``fast``: the fast kernel (the fp8 policies' semantics, its own tiling).
- ``split``: FlyDSL #1097's path on the model: head dims (D, Dv), split-K and its combine,
  the LSE with the P headroom removed; varlen runs one dense call per sequence.
- ``paged``: FlyDSL #1066's paged prefill on the model: the same pair loop over a page
  cache (packed q, causal, threshold 8 by default; ``fa_lab.paged.check_fp8``) for its
  paired-page BN128 kernel; ``paged_tile``: its per-tile kernel (D = 192, odd page
  counts), the bf16 schedule on fp8 scores with no P headroom.
- ``faithful_paged``, ``faithful_paged_tile``: their faithful ports, pages read through
  the block table inside the kernel.
- ``paged_cases``: paged fp8 inputs (a shuffled page-64 table, what the cache holds past
  ``seqlen_k``) and their fp64 reference, for the tests, the onset bound and the attack.
"""

from fa_lab.capabilities import FP8, Caps, Family, Implementation
from fa_lab.routing import FP8_DUALWAVE

#: The vote and rebase values each implementation runs, by name (``fa_lab.values``).
_VOTES, _REBASES = frozenset({"tile", "wave", "row"}), frozenset({"max", "tile", "capped"})
_FAST_VOTES = frozenset({"tile", "wave"})
#: The model and the faithful port run #1097's head dims and features (``split``,
#: ``faithful_split``); the fast kernel the dense D = 128 body.
_MODEL_HEAD_DIMS, _MODEL_HEAD_DIMS_V = (128, 192), (64, 96, 128, 160, 192)
_MODEL_FEATURES = frozenset({"trace", "num_kv_splits", "varlen", "paged"})
#: #1066's paged call: packed q, causal, the vectorized cache (``fa_lab.paged.check_fp8``).
_PAGED_CALL = "packed_causal"

FAMILY = Family(
    "swp_fp8", "the fp8 (e4m3) DUALWAVE_SWP kernel: raw-domain maxima, 128-column decisions",
    {"model": Implementation("model", Caps(FP8, _MODEL_HEAD_DIMS, _MODEL_FEATURES, _VOTES, _REBASES,
                                           rules=True, head_dims_v=_MODEL_HEAD_DIMS_V,
                                           paged_call=_PAGED_CALL)),
     "faithful": Implementation("faithful_split", Caps(FP8, _MODEL_HEAD_DIMS, _MODEL_FEATURES,
                                                       _VOTES, _REBASES,
                                                       head_dims_v=_MODEL_HEAD_DIMS_V,
                                                       paged_call=_PAGED_CALL)),
     "fast": Implementation("fast", Caps(FP8, (128,), frozenset(), _FAST_VOTES, _REBASES))},
    rule=FP8_DUALWAVE, raw_units=True)

from . import paged, paged_cases, paged_tile  # noqa: E402,F401 -- the paged prefill's face for the layers above
