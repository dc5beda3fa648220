"""Gluon pieces shared by the kernel families (no public kernel of its own here).

- ``hopper``: FlashAttention-3's warp-specialised forward for sm_90 (TMA, wgmma,
  mbarriers), with the fast kernels' policy semantics for bf16/f16 and for fp8; its launch
  configurations (``HopperConfig``) and their tuning. The families' host sides are
  ``swp_bf16.hopper`` and ``swp_fp8.hopper``.
"""
