"""The gfx950 MLA decode forward, fp8 Q and fp8 KV, 128 heads: its exact model and its
faithful Triton port. ``flash_attn_func`` does not route to it; ``fa_lab.mla`` has
upstream's launcher, ``flydsl_mla_fwd_decode``.

Upstream: ROCm/FlyDSL ``main`` 11c4174d, ``kernels/attention/mla_fwd_decode_m16x8_fp8_fp8.py``
(the kernel) and ``kernels/attention/mla_fwd_decode.py`` (the launcher).

- ``model``: the exact PyTorch model (the definition; ``docs/semantics.md`` §14).
- ``faithful``: the faithful port, one program per (work item, group of heads).
- ``bound``: the P cast's safe region (``fa_lab.studies.onset.bound("mla_decode")``).
"""

from fa_lab.capabilities import FP8, Caps, Family, Implementation

from . import bound  # noqa: F401 -- the family's face for the studies above it

#: The upstream versions the model follows: name -> (repository, commit, files). The kernel
#: is unchanged where it is carried (ROCm/aiter holds only its HIP ancestors and the reduce).
VERSIONS = {
    "main-11c4174d": ("ROCm/FlyDSL", "11c4174d82b7491c2d08d5828a254183f2a8b959",
                      ("kernels/attention/mla_fwd_decode_m16x8_fp8_fp8.py",
                       "kernels/attention/mla_fwd_decode.py")),
}

# Eager (every tile rebases to fmax(m, tile max)); no trace; QK head dim 576.
# The decode kernel takes no rescale policy: its online softmax rescales at every tile by
# construction, so it claims no vote or rebase value. What it does claim (``modes``, each
# run against fp64 by the conformance test): P's e4m3 cast lifted by 2**p_headroom (0:
# upstream's cast of P as it is; 4: a lift, #1020's fix in the prefill kernel), and one
# or two KV splits per sequence merged by the reduce.
_MODES = frozenset({("p_headroom", 0.0), ("p_headroom", 4.0),
                    ("num_kv_splits", 1), ("num_kv_splits", 2)})
_CAPS = Caps(FP8, (576,), frozenset(), frozenset(), frozenset(), modes=_MODES)
FAMILY = Family("mla_decode", "the MLA decode kernel: fp8 Q and KV, 128 heads, latent 512 + rope 64, "
                "P cast to e4m3 without headroom",
                {"model": Implementation("model", _CAPS),
                 "faithful": Implementation("faithful", _CAPS)},
                routed=False)
