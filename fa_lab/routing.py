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

These are pure functions of upstream's rules. Each family that models one of upstream's
kernels carries its ``Rule`` (``fa_lab.capabilities.Family.rule``): upstream's name for the
kernel, whether upstream sends a call of a given ``Shape`` there (``takes``; exactly one
rule takes any call) and why the kernel cannot run a shape asked for by name
(``refuses``). ``fa_lab.dispatch`` applies the rules and knows no family by name; it
refuses to drop anything the caller asked for (an explicit ``rescale=`` the routed kernel
lacks selects the upstream kernel that has it; an explicit ``kernel=`` that cannot honour a
request raises). fa_lab models no short-sequence varlen, split-K or paged build: those calls
run DUALWAVE_SWP (upstream sends short varlen calls, and paged calls with Sq <= 256, to the
generic kernel's "light" builds; l.532-541).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

DUALWAVE_ARCH = "gfx950"
DUALWAVE_HEAD_DIMS = (64, 128)
#: _DENSE_DUALWAVE_MIN_SEQ, _DENSE_DUALWAVE_LARGE_BATCH, _DENSE_DUALWAVE_MIN_SEQ_LARGE_BATCH
DENSE_DUALWAVE_MIN_SEQ = 256
DENSE_DUALWAVE_LARGE_BATCH = 8
DENSE_DUALWAVE_MIN_SEQ_LARGE_BATCH = 192


#: The call features that make upstream's bf16/f16 routing pick DUALWAVE_SWP whatever the length.
SCORE_FEATURES = ("bias", "alibi_slopes", "sink")


@dataclass(frozen=True)
class Shape:
    """What routing reads of a call: ``dtype`` ("bf16", "f16" or "fp8"), ``features``
    (``fa_lab.capabilities.FEATURES`` the call uses) and the target ``arch``.
    ``fa_lab.dispatch.Call`` has the same attributes, so a checked call is its own shape."""

    batch: int
    seqlen_q: int
    head_dim: int
    dtype: str
    features: tuple = ()
    arch: str = DUALWAVE_ARCH


@dataclass(frozen=True)
class Rule:
    """Upstream's routing to one kernel: ``kernel``, upstream's name for it; ``takes(shape)``,
    whether upstream sends a call of that ``Shape`` there; ``refuses(shape)``, why the
    kernel cannot run it (a message, or None)."""

    kernel: str
    takes: Callable[[Shape], bool]
    refuses: Callable[[Shape], str | None]


def _able(head_dim: int, arch: str) -> bool:
    return head_dim in DUALWAVE_HEAD_DIMS and arch.startswith(DUALWAVE_ARCH)


def _long(batch: int, seqlen_q: int) -> bool:
    if batch >= DENSE_DUALWAVE_LARGE_BATCH:
        return seqlen_q >= DENSE_DUALWAVE_MIN_SEQ_LARGE_BATCH
    return seqlen_q >= DENSE_DUALWAVE_MIN_SEQ


def _dualwave_takes(s) -> bool:
    """bf16/f16 calls with a bias, ALiBi or sink, or long enough (``_long``) where the kernel
    exists; fa_lab's varlen, split-K and paged calls (it models those builds of DUALWAVE_SWP
    only)."""
    if s.dtype == "fp8":
        return False
    for f in s.features:
        if f in SCORE_FEATURES or f == "varlen" or f == "num_kv_splits" or f == "paged":
            return True
    return _able(s.head_dim, s.arch) and _long(s.batch, s.seqlen_q)


def _dualwave_refuses(s) -> str | None:
    if _able(s.head_dim, s.arch):
        return None
    asked = [f for f in s.features if f in SCORE_FEATURES]
    what = f"{asked[0]} needs the gfx950 DUALWAVE_SWP kernel" if asked else "DUALWAVE_SWP needs"
    return f"{what} (D 64 or 128 on gfx950); got head_dim={s.head_dim}, arch={s.arch!r}"


#: The Q/K head dims upstream's fp8 kernel builds (#1097 added 192).
FP8_HEAD_DIMS = (128, 192)


def _fp8_takes(s) -> bool:
    return s.dtype == "fp8"


def _fp8_refuses(s) -> str | None:
    asked = [f for f in s.features if f in SCORE_FEATURES]
    if asked:
        return (f"{asked[0]} is not supported with fp8 inputs (the fp8 kernel folds in no bias, "
                "ALiBi or sink)")
    if not s.arch.startswith(DUALWAVE_ARCH):
        return f"fp8 inputs need the gfx950 fp8 kernel, got arch={s.arch!r}"
    if s.head_dim not in FP8_HEAD_DIMS:
        return f"the fp8 kernel takes head_dim 128 or 192 (D = 128 or 192), got D={s.head_dim}"
    return None


def _generic_takes(s) -> bool:
    return s.dtype != "fp8" and not _dualwave_takes(s)


def _nothing(s) -> None:
    return None


#: flash_attn_interface.py's three dense kernels.
DUALWAVE = Rule("DUALWAVE_SWP", _dualwave_takes, _dualwave_refuses)
FP8_DUALWAVE = Rule("DUALWAVE_SWP fp8 (BN128)", _fp8_takes, _fp8_refuses)
GENERIC = Rule("generic", _generic_takes, _nothing)


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
    return _able(head_dim, arch)


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
    return able and _long(batch, seqlen_q)


def check_arch(arch) -> None:
    if not isinstance(arch, str):
        raise TypeError(f"arch must be a str such as 'gfx950', got {type(arch).__name__}")


def check_fp8(features: list[str], head_dim: int, arch: str) -> None:
    """fp8 dense calls run the fp8 DUALWAVE_SWP kernel: gfx950, D 128, no bias/ALiBi/sink."""
    why = _fp8_refuses(Shape(1, 1, head_dim, "fp8", tuple(features), arch))
    if why:
        raise ValueError(why)
