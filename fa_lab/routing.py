"""Which kernel a dense ``flydsl_flash_attn_func`` call runs, as pure functions.

Upstream (ROCm/FlyDSL ``main`` 11c4174d, kernels/attention/flash_attn_interface.py):

* fp8 (float8_e4m3fn) dense calls always run the fp8 DUALWAVE_SWP kernel; they need gfx950
  and take no bias, ALiBi or sink (l.1042-1054, l.745-760).
* bf16/f16 dense calls run DUALWAVE_SWP when it can (``can_dualwave``: D in {64, 128} on a
  gfx950, l.1056) and either a bias, ALiBi slopes or a sink is given (the generic kernel
  folds in none of them; without ``can_dualwave`` that is an error) or
  ``_dense_routes_to_dualwave(B, Sq)`` holds: Sq >= 192 when B >= 8, else Sq >= 256
  (l.67-70, l.1067-1074). Everything else runs the generic kernel.
* The generic kernel is eager only: upstream passes ``dualwave_swp_lazy_rescale`` to the
  DUALWAVE_SWP builders only, so on a short sequence the flag is dropped without a word.

These are pure functions of upstream's rules; ``fa_lab.dispatch.choose_kernel`` applies them
and refuses to drop anything the caller asked for (an explicit ``rescale=`` the routed kernel
lacks selects DUALWAVE_SWP; an explicit ``kernel=`` that cannot honour a request raises).
Varlen, split-K and paged calls are not routed here (upstream sends short varlen calls to
the generic kernel too).
"""

from __future__ import annotations

DUALWAVE_ARCH = "gfx950"
DUALWAVE_HEAD_DIMS = (64, 128)
#: _DENSE_DUALWAVE_MIN_SEQ, _DENSE_DUALWAVE_LARGE_BATCH, _DENSE_DUALWAVE_MIN_SEQ_LARGE_BATCH
DENSE_DUALWAVE_MIN_SEQ = 256
DENSE_DUALWAVE_LARGE_BATCH = 8
DENSE_DUALWAVE_MIN_SEQ_LARGE_BATCH = 192


def check_positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def check_bool(name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def features(has_bias, has_alibi, has_sink) -> list[str]:
    for name, flag in (("has_bias", has_bias), ("has_alibi", has_alibi), ("has_sink", has_sink)):
        check_bool(name, flag)
    return [name for name, flag in (("bias", has_bias), ("alibi_slopes", has_alibi),
                                    ("sink", has_sink)) if flag]


def can_dualwave(head_dim: int = 128, arch: str = DUALWAVE_ARCH) -> bool:
    """The bf16/f16 DUALWAVE_SWP kernel exists for D in {64, 128} on gfx950 only."""
    check_positive_int("head_dim", head_dim)
    check_arch(arch)
    return head_dim in DUALWAVE_HEAD_DIMS and arch.startswith(DUALWAVE_ARCH)


def dense_routes_to_dualwave(batch: int, seqlen_q: int, has_bias: bool = False,
                             has_alibi: bool = False, has_sink: bool = False, *,
                             head_dim: int = 128, arch: str = DUALWAVE_ARCH) -> bool:
    """True where upstream sends a dense bf16/f16 call to DUALWAVE_SWP, False where it
    sends it to the generic kernel. A bias, ALiBi or sink without DUALWAVE_SWP support
    (other D or arch) is an error upstream, and a ValueError here."""
    check_positive_int("batch", batch)
    check_positive_int("seqlen_q", seqlen_q)
    asked = features(has_bias, has_alibi, has_sink)
    able = can_dualwave(head_dim, arch)
    if asked:
        if not able:
            raise ValueError(f"{asked[0]} needs the gfx950 DUALWAVE_SWP kernel (D 64 or 128 on "
                             f"gfx950); got head_dim={head_dim}, arch={arch!r}")
        return True
    if not able:
        return False
    if batch >= DENSE_DUALWAVE_LARGE_BATCH:
        return seqlen_q >= DENSE_DUALWAVE_MIN_SEQ_LARGE_BATCH
    return seqlen_q >= DENSE_DUALWAVE_MIN_SEQ


def check_arch(arch) -> None:
    if not isinstance(arch, str):
        raise TypeError(f"arch must be a str such as 'gfx950', got {type(arch).__name__}")


def check_fp8(features: list[str], head_dim: int, arch: str) -> None:
    """fp8 dense calls run the fp8 DUALWAVE_SWP kernel: gfx950, D 128, no bias/ALiBi/sink."""
    if features:
        raise ValueError(f"{features[0]} is not supported with fp8 inputs "
                         "(the fp8 kernel folds in no bias, ALiBi or sink)")
    if not arch.startswith(DUALWAVE_ARCH):
        raise ValueError(f"fp8 inputs need the gfx950 fp8 kernel, got arch={arch!r}")
    if head_dim != 128:
        raise ValueError(f"the fp8 kernel takes head_dim 128, got {head_dim}")
