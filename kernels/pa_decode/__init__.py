"""FlyDSL's paged-attention fp8 decode (``pa_decode_tile.py``, the sliding-window kernel and
split reduce of ``pa_decode_swa.py``): KV pages of 16 or 64 tokens (1024 with a window)
gathered through ``block_tables``, 256-token tiles grouped into partitions, MTP query
lengths 1..16, per-tensor or per-token fp8 scales. ``flash_attn_func`` does not route to
it; ``fa_lab.decode`` calls it with upstream's names (``pa_decode_tile``,
``pa_decode_ps_launch``).

- ``model``: the exact PyTorch model (the definition; docs/semantics.md §13);
- ``reduce``: the split reduce that merges the partitions;
- ``swa``: the exact model of the sliding-window kernel (``compile_pa_decode_sw``);
- ``faithful``: the faithful Triton port (``faithful_swa``: the sliding-window kernel's,
  reached through ``faithful.forward_sw``; ``faithful_reduce``: the reduce's);
- ``bound``: when the finite mask sentinel turns into NaN, in closed form, and the
  decode's safe region (``fa_lab.studies.onset.bound("pa_decode")``);
- ``cases``: decode calls built from logical K/V, and their fp64 reference (the tests, the
  onset search and the attack's decode space use them through this face).
"""

from fa_lab.capabilities import FP8, Caps, Family, Implementation
from fa_lab.upstream import DECODE_VERSIONS

from . import bound, cases, swa, swa_bound  # noqa: F401 -- the family's face for the layers above it

# The decode kernel takes no rescale policy: each partition's softmax is eager by
# construction, so it claims no vote or rebase value. What it does claim (``modes``, each
# run against fp64 by the conformance test): both scale modes of the fp8 K/V cache, every
# upstream version of ``fa_lab.upstream.DECODE_VERSIONS`` (before and after 985c653a's
# sentinel fix), and one or several partitions (the split reduce).
_MODES = frozenset({("scale", "per_tensor"), ("scale", "per_token"),
                    ("num_partitions", 1), ("num_partitions", 2),
                    *(("upstream", name) for name in DECODE_VERSIONS)})
_CAPS = Caps(FP8, (64, 128, 256), frozenset({"trace"}), frozenset(), frozenset(), modes=_MODES)
FAMILY = Family("pa_decode", "paged-attention fp8 decode: pages of 16/64, 256-token partitions, "
                "MTP, per-tensor or per-token scales, the split reduce",
                {"model": Implementation("model", _CAPS), "faithful": Implementation("faithful", _CAPS)},
                routed=False)
