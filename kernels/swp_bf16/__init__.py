"""The gfx950 DUALWAVE_SWP bf16/f16 forward (``fa_lab.models.swp_bf16``) in Triton.

- ``faithful``: the faithful port, decision for decision (``forward``, ``forward_varlen``).
- ``combine``: the faithful port's split-K ranges and the pass that combines the splits.
- ``fast``: the fast kernel (the policy's semantics, its own tiling); ``num_kv_splits`` > 1
  hands off to ``splitk``.
- ``splitk``: the fast kernel's split-K (the model's split boundaries) and its combine.
- ``varlen``: the fast kernel on packed (varlen) batches, in one launch.
"""
