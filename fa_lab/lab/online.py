"""Lesson 01's tiled online softmax, for its exercises: a learner's ``update(state, s, v)``
run over every tile of one head ([S, D] tensors), the state finished into the output and its
LSE, and the fp64 reference the checks in ``fa_lab.lab.exercises`` hold it against."""

from __future__ import annotations

import math

import torch


def empty_state(rows, d, dtype=torch.float64):
    """The state (m, l, O) of ``rows`` rows before any tile: m = -inf, l = 0, O = 0."""
    return (torch.full((rows,), -math.inf, dtype=dtype), torch.zeros(rows, dtype=dtype),
            torch.zeros(rows, d, dtype=dtype))


def run_tiles(update, q, k, v, block_n=64):
    """``update`` over every tile of k and v: the final state of the rows of q [R, D]."""
    c = math.log2(math.e) / math.sqrt(q.shape[-1])
    state = empty_state(q.shape[0], v.shape[1], q.dtype)
    for j in range(0, k.shape[0], block_n):
        state = update(state, (q @ k[j:j + block_n].T) * c, v[j:j + block_n])
    return state


def finish(state):
    """out = O / l, and the LSE in natural log: m ln 2 + ln l."""
    m, l, O = state
    return O / l[:, None], (m + torch.log2(l)) * math.log(2)


def reference_one_head(q, k, v):
    """``fa_lab.reference.attention`` (non-causal, fp64) for one head given as [S, D]."""
    from fa_lab import reference

    out, lse = reference.attention(q[None, :, None], k[None, :, None], v[None, :, None],
                                   causal=False, dtype=torch.float64)
    return out[0, :, 0], lse[0, 0]


def online_problem(rows=256, keys=2048, d=128, k_scale=4.0, seed=1):
    """Lesson 01's inputs (fp64, one head, [S, D]) and their fp64 reference output and LSE."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, d, generator=g, dtype=torch.float64)
    k = torch.randn(keys, d, generator=g, dtype=torch.float64) * k_scale
    v = torch.randn(keys, d, generator=g, dtype=torch.float64)
    return (q, k, v, *reference_one_head(q, k, v))
