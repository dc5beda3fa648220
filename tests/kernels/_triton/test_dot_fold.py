"""The faithful ports' compiled dots keep ``O + dot(P, V)`` as two operations.

Triton folds ``o + tl.dot(a, b)`` into ``tl.dot(a, b, acc=o)``, which adds O inside the
tensor core's sum instead of after it. Measured on an H200 that moved 19 of 1.5M non-finite
outputs against the model (data/results/agree_faithful_h200.json); ``_triton.dots.dot16``
therefore starts its tensor-core dot from a run-time zero (loaded from the scratch
pointer). This compiles a small kernel for sm_90 (no GPU needed: Triton's front end and
TTGIR passes run on the CPU) and reads the TTGIR: with ``dot16`` the add survives after
the dot; with a plain ``tl.dot`` (the control) it is folded into the dot's accumulator.
"""

import re

import triton
import triton.language as tl

from _shared import sm90_target
from fa_lab.kernels._triton.dots import DOT_TENSOR_CORES, dot16

CONTROL = 9


@triton.jit
def _fold_probe(A, B, O, Z, Out, MODE: tl.constexpr):
    r = tl.arange(0, 64)
    idx = r[:, None] * 64 + r[None, :]
    a = tl.load(A + idx)
    b = tl.load(B + idx)
    o = tl.load(O + idx)
    if MODE == 9:  # the control: a plain dot, which Triton may fold o into
        d = tl.dot(a.to(tl.bfloat16), b, out_dtype=tl.float32)
    else:
        d = dot16(a, b, Z, MODE)  # Z: the scratch pointer, whose first float is the zero
    tl.store(Out + idx, o + d)


def ttgir(mode: int) -> str:
    from triton.compiler import ASTSource

    src = ASTSource(fn=_fold_probe,
                    signature={"A": "*fp32", "B": "*bf16", "O": "*fp32", "Z": "*fp32",
                               "Out": "*fp32", "MODE": "constexpr"},
                    constexprs={"MODE": mode})
    return triton.compile(src, target=sm90_target(),
                          options={"num_warps": 4, "enable_fp_fusion": False}).asm["ttgir"]


def dot_accumulator_and_adds(ir: str):
    """(the accumulator operand of the one dot, the addf lines after it)."""
    lines = ir.splitlines()
    dots = [i for i, line in enumerate(lines) if re.search(r"\b(tt\.dot|ttng\.warp_group_dot)\b", lines[i])]
    assert len(dots) == 1, dots
    operands = re.search(r"(?:tt\.dot|warp_group_dot)\s+(%[\w.#]+),\s*(%[\w.#]+),\s*(%[\w.#]+)",
                         lines[dots[0]])
    adds = [line for line in lines[dots[0]:] if "arith.addf" in line]
    return operands.group(3), adds


def is_o(name: str) -> bool:
    """Triton names SSA values after the Python variable (``o`` here), through layout
    conversions too (``%o_14`` loaded, ``%o_16`` converted)."""
    return re.fullmatch(r"%o_\d+", name) is not None


def add_of_o(line: str) -> bool:
    m = re.search(r"arith\.addf\s+(%[\w.#]+),\s*(%[\w.#]+)", line)
    return m is not None and (is_o(m.group(1)) or is_o(m.group(2)))


def test_dot16_keeps_the_add_after_the_tensor_core_sum():
    acc, adds = dot_accumulator_and_adds(ttgir(DOT_TENSOR_CORES))
    assert not is_o(acc), acc
    assert any(add_of_o(line) for line in adds), adds


def test_control_plain_dot_is_folded():
    acc, adds = dot_accumulator_and_adds(ttgir(CONTROL))
    assert is_o(acc), acc  # O went into the tensor core's accumulator
    assert not any(add_of_o(line) for line in adds), adds
