"""The gfx950 fp8 BN128 forward (``fa_lab.models.swp_fp8``) in Triton.

- ``faithful``: the faithful port of ``DualwaveFp8SoftmaxHelper``, row for row.
- ``fast``: the fast kernel (the fp8 policies' semantics, its own tiling).
"""
