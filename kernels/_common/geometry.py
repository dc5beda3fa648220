"""Work decomposition shared by the gfx950 forward kernels (docs/semantics.md §1.2).

A workgroup owns BLOCK_M = 256 query rows, 8 waves of 32 rows; KV is walked in tiles of
BLOCK_N = 64 columns, N of them, N even and at least 4. Causal blocks stop at the diagonal,
so each block may have its own N: the models run blocks with equal N together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BLOCK_M = 256
WAVE_ROWS = 32
BLOCK_N = 64
# The first PV step (before the rescale) consumes this many of the 64 P columns.
PV_SPLIT = 16


def tiles_for_block(q0: int, seqlen_q: int, seqlen_kv: int, causal: bool) -> int:
    """N for the block starting at query row q0: ceil(Skv/64) (cut at the causal
    diagonal), rounded up to even, at least 4. Tiles past Skv are all padding."""
    t = math.ceil(seqlen_kv / BLOCK_N)
    if causal:
        t = min(t, math.ceil(max(0, q0 + BLOCK_M + seqlen_kv - seqlen_q) / BLOCK_N))
    return max(4, t + t % 2)


@dataclass(frozen=True)
class BlockGroup:
    """Query blocks that share a tile count, run together. ``rows`` are the global
    (padded) query-row indices of those blocks, in order: waves are consecutive 32s."""

    n_tiles: int
    rows: torch.Tensor


def block_groups(seqlen_q: int, seqlen_kv: int, causal: bool, device) -> list[BlockGroup]:
    n_blocks = math.ceil(seqlen_q / BLOCK_M)
    by_n: dict[int, list[int]] = {}
    for b in range(n_blocks):
        by_n.setdefault(tiles_for_block(b * BLOCK_M, seqlen_q, seqlen_kv, causal), []).append(b)
    groups = []
    for n, blocks in sorted(by_n.items()):
        rows = torch.cat([torch.arange(b * BLOCK_M, (b + 1) * BLOCK_M) for b in blocks])
        groups.append(BlockGroup(n_tiles=n, rows=rows.to(device)))
    return groups


def padded_rows(seqlen_q: int) -> int:
    return math.ceil(seqlen_q / BLOCK_M) * BLOCK_M


def masked_columns(rows: torch.Tensor, col0: int, seqlen_q: int, seqlen_kv: int,
                   causal: bool, width: int = BLOCK_N) -> torch.Tensor:
    """Bool [R, width]: True where a score is -inf (padding columns, and columns past the
    bottom-right-aligned causal diagonal)."""
    cols = torch.arange(col0, col0 + width, device=rows.device)
    mask = (cols >= seqlen_kv).expand(rows.numel(), width)
    if causal:
        mask = mask | (cols[None, :] > rows[:, None] + (seqlen_kv - seqlen_q))
    return mask


def wave_any(flags: torch.Tensor) -> torch.Tensor:
    """The wave ballot: True for every row of a 32-row wave where any row is True.
    ``flags`` has rows in its last dimension, whole waves in order."""
    shape = flags.shape
    waves = flags.reshape(*shape[:-1], shape[-1] // WAVE_ROWS, WAVE_ROWS).any(-1, keepdim=True)
    return waves.expand(*shape[:-1], shape[-1] // WAVE_ROWS, WAVE_ROWS).reshape(shape)
