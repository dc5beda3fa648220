"""The split reduce of the paged-attention decode: ``compile_pa_decode_sw_reduce`` in ROCm/FlyDSL
``kernels/attention/pa_decode_swa.py`` (main 11c4174d, l.640-965; the path for at most 64
partitions, l.787-855), which ``pa_decode_tile`` launches when it runs more than one
partition (``pa_decode_tile.py`` l.1164-1196).

For one (seq, kv head, row), with partition p's ``pmax``, ``psum`` and its normalized
output ``pout`` (already rounded to the output dtype):

  gmax = maximum_p pmax                 (NaN-propagating ``maximumf``)
  scale_p = exp2((pmax_p - gmax) * f32(log2 e))
  gsum = sum_p psum_p * scale_p         (a lane butterfly, offsets W/2 .. 1, W = the next
                                          power of two >= NP; lanes past NP add 0)
  w_p = psum_p * scale_p * rcp(gsum if gsum > 0 else 1)
  out = sum_p pout_p * w_p              (fp32, in partition order from 0)

The reduce reads ``pmax`` as natural-log units. ``-inf`` everywhere (every partition
empty, e.g. a zero context) gives (-inf) - (-inf) = NaN weights, so NaN output; a
partition with a NaN ``pout`` poisons the sum even at weight 0 (0 * NaN). 985c653a also
clamped the exponent at -100 (natural units), a change that 11c4174d's reduce does not
hold, so neither version here has it.
"""

from __future__ import annotations

import torch

from fa_lab.numerics import exp2, f32

LOG2E = 1.4426950408889634
MAX_PARTITIONS = 64  # the one-wave path; more partitions take a block-wide path (not modelled)


def butterfly_sum(x: torch.Tensor) -> torch.Tensor:
    """Lane 0's sum of x [NP, ...] by the reduce's xor butterfly over W lanes."""
    n = x.shape[0]
    width = 1 if n <= 1 else 1 << (n - 1).bit_length()
    lanes = torch.cat([x, torch.zeros(width - n, *x.shape[1:])]) if width > n else x.clone()
    idx = torch.arange(width)
    for off in (32, 16, 8, 4, 2, 1):
        if off < width:
            lanes = lanes + lanes[idx ^ off]
    return lanes[0]


def split_reduce(pmax: torch.Tensor, psum: torch.Tensor, pout: torch.Tensor, *,
                 recorder: dict | None = None) -> torch.Tensor:
    """pmax, psum [NP, R], pout [NP, R, D] (fp32) -> the fp32 sum [R, D] before the
    output cast. ``recorder`` gets ``global_max`` [R], ``part_scale`` and ``weights``
    [NP, R], ``global_sum`` [R]."""
    gmax = pmax.amax(dim=0)
    part_scale = exp2((pmax - gmax) * f32(LOG2E))
    scaled = psum * part_scale
    gsum = butterfly_sum(scaled)
    inv = 1.0 / torch.where(gsum > 0, gsum, 1.0)
    weights = scaled * inv
    acc = torch.zeros(pout.shape[1:])
    for p in range(pout.shape[0]):
        acc = acc + pout[p] * weights[p][:, None]
    if recorder is not None:
        recorder.update(global_max=gmax, part_scale=part_scale, weights=weights, global_sum=gsum)
    return acc
