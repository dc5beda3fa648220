"""Triton pieces shared by the kernel families (no kernel of its own here).

- ``util``: one kernel definition, compiled or through Triton's CPU interpreter
  (``launch``), explicit roundings, maxNum, launch checks.
- ``dots``: how the faithful ports take their 16-bit dot products (the DOT_MODE switch,
  ``exact_dots``).
- ``trace_plan``: the traced mode of a faithful port, host side.
- ``faithful``: device helpers the faithful ports share (the wave ballot, the split PV
  product, the per-step trace record).
- ``fast``: what the fast kernels share: launch configurations and autotuning, the tile
  loaders and votes, the bf16/f16 KV walk and its host-side arguments.
- ``tuner``: the pick of a launch per shape, candidates ranked in alternated rounds (the
  fast Triton kernels' and the Gluon kernel's).
"""
