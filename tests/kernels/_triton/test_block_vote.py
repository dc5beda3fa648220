"""``_triton.fast.block_any``: the fast lazy kernels' block-wide "did any row vote?".

It must say exactly what ``tl.max(flags, 0) > 0`` says (checked in Triton's interpreter
for every single set row, none, all, and both block heights the kernels use), and it exists
because it crosses warps once: compiled for sm_90 on the CPU (no GPU needed), a probe
kernel holding a row vector in the tensor-core layout takes one CTA barrier fewer with
``block_any`` than with ``tl.max`` (the control) under Triton 3.6, the H200's, whose
``tl.max`` crosses warps twice; later Triton versions reduce in one exchange, and there the
two must tie.
"""

import re

import pytest
import torch
import triton
import triton.language as tl

from _shared import sm90_target
from fa_lab.kernels._triton.fast import block_any
from fa_lab.kernels._triton.util import launch


@triton.jit
def _vote_probe(Flags, Out, BLOCK_M: tl.constexpr, USE_BLOCK_ANY: tl.constexpr):
    rows = tl.arange(0, BLOCK_M)
    flags = tl.load(Flags + rows)
    if USE_BLOCK_ANY:
        fired = block_any(flags, BLOCK_M)
    else:  # the control
        fired = tl.max(flags, 0) > 0
    tl.store(Out, fired.to(tl.int32))


@pytest.mark.parametrize("block_m", [64, 128])
def test_block_any_is_the_blocks_or_interpreted(block_m):
    cases = [torch.zeros(block_m, dtype=torch.int32), torch.ones(block_m, dtype=torch.int32)]
    for i in range(block_m):
        one = torch.zeros(block_m, dtype=torch.int32)
        one[i] = 1
        cases.append(one)
    for flags in cases:
        got = torch.full((1,), -1, dtype=torch.int32)
        launch(_vote_probe, (1,), True, flags, got, BLOCK_M=block_m, USE_BLOCK_ANY=True)
        assert got.item() == int(flags.any()), flags.nonzero().flatten().tolist()


@triton.jit
def _vote_in_mma_layout(A, B, Out, USE_BLOCK_ANY: tl.constexpr):
    # a row vector as the fast kernels hold it: a row reduction of a tensor-core product
    r, c, d = tl.arange(0, 128), tl.arange(0, 64), tl.arange(0, 64)
    s = tl.dot(tl.load(A + r[:, None] * 64 + d[None, :]), tl.load(B + d[:, None] * 64 + c[None, :]))
    flags = tl.where(tl.sum(s, 1) < 256.0, 0, 1)
    if USE_BLOCK_ANY:
        fired = block_any(flags, 128)
    else:
        fired = tl.max(flags, 0) > 0
    if fired:
        tl.store(Out + r, tl.sum(s, 1))


def sm90_barriers(use_block_any: bool) -> int:
    from triton.compiler import ASTSource

    src = ASTSource(fn=_vote_in_mma_layout,
                    signature={"A": "*bf16", "B": "*bf16", "Out": "*fp32", "USE_BLOCK_ANY": "constexpr"},
                    constexprs={"USE_BLOCK_ANY": use_block_any})
    ptx = triton.compile(src, target=sm90_target(),
                         options={"num_warps": 8, "enable_fp_fusion": False}).asm["ptx"]
    assert "wgmma" in ptx  # (the row vector does sit in the tensor-core layout)
    return len(re.findall(r"\bbar\.sync|\bbarrier\.sync", ptx))


def test_block_any_takes_no_more_barriers_than_tl_max():
    ours, control = sm90_barriers(True), sm90_barriers(False)
    assert ours <= control
    if triton.__version__.startswith("3.6."):  # the H200's Triton: tl.max crosses warps twice
        assert ours == control - 1
