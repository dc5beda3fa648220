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

``choose_kernel`` keeps that routing and refuses to drop anything the caller asked for: an
explicit ``rescale=`` that the routed kernel lacks (a lazy policy on a sequence routed to
the eager-only generic kernel) selects DUALWAVE_SWP instead; an explicit ``kernel=`` that
cannot honour the request raises, naming both. Varlen, split-K and paged calls are not
routed here (upstream sends short varlen calls to the generic kernel too).
"""

from __future__ import annotations

from .policies import POLICIES_BF16, POLICIES_FP8

#: The kernels fa_lab models, by the names the api and the models use.
KERNELS = ("swp_bf16", "swp_fp8", "generic")
#: The rescale policies each kernel implements.
KERNEL_POLICIES = {
    "swp_bf16": tuple(POLICIES_BF16),
    "swp_fp8": tuple(POLICIES_FP8),
    "generic": ("eager",),
}
DUALWAVE_ARCH = "gfx950"
DUALWAVE_HEAD_DIMS = (64, 128)
#: _DENSE_DUALWAVE_MIN_SEQ, _DENSE_DUALWAVE_LARGE_BATCH, _DENSE_DUALWAVE_MIN_SEQ_LARGE_BATCH
DENSE_DUALWAVE_MIN_SEQ = 256
DENSE_DUALWAVE_LARGE_BATCH = 8
DENSE_DUALWAVE_MIN_SEQ_LARGE_BATCH = 192


def _check_positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def _check_bool(name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def _features(has_bias, has_alibi, has_sink) -> list[str]:
    for name, flag in (("has_bias", has_bias), ("has_alibi", has_alibi), ("has_sink", has_sink)):
        _check_bool(name, flag)
    return [name for name, flag in (("bias", has_bias), ("alibi_slopes", has_alibi),
                                    ("sink", has_sink)) if flag]


def can_dualwave(head_dim: int = 128, arch: str = DUALWAVE_ARCH) -> bool:
    """The bf16/f16 DUALWAVE_SWP kernel exists for D in {64, 128} on gfx950 only."""
    _check_positive_int("head_dim", head_dim)
    if not isinstance(arch, str):
        raise TypeError(f"arch must be a str such as 'gfx950', got {type(arch).__name__}")
    return head_dim in DUALWAVE_HEAD_DIMS and arch.startswith(DUALWAVE_ARCH)


def dense_routes_to_dualwave(batch: int, seqlen_q: int, has_bias: bool = False,
                             has_alibi: bool = False, has_sink: bool = False, *,
                             head_dim: int = 128, arch: str = DUALWAVE_ARCH) -> bool:
    """True where upstream sends a dense bf16/f16 call to DUALWAVE_SWP, False where it
    sends it to the generic kernel. A bias, ALiBi or sink without DUALWAVE_SWP support
    (other D or arch) is an error upstream, and a ValueError here."""
    _check_positive_int("batch", batch)
    _check_positive_int("seqlen_q", seqlen_q)
    features = _features(has_bias, has_alibi, has_sink)
    able = can_dualwave(head_dim, arch)
    if features:
        if not able:
            raise ValueError(f"{features[0]} needs the gfx950 DUALWAVE_SWP kernel (D 64 or 128 on "
                             f"gfx950); got head_dim={head_dim}, arch={arch!r}")
        return True
    if not able:
        return False
    if batch >= DENSE_DUALWAVE_LARGE_BATCH:
        return seqlen_q >= DENSE_DUALWAVE_MIN_SEQ_LARGE_BATCH
    return seqlen_q >= DENSE_DUALWAVE_MIN_SEQ


def choose_kernel(*, batch: int, seqlen_q: int, fp8: bool, rescale: str | None = None,
                  kernel: str | None = None, has_bias: bool = False, has_alibi: bool = False,
                  has_sink: bool = False, head_dim: int = 128, arch: str = DUALWAVE_ARCH) -> str:
    """The kernel ("swp_bf16", "swp_fp8" or "generic") that runs a dense call.

    ``rescale``: the policy the caller asked for explicitly (None: whatever the routed
    kernel does by default). ``kernel``: an explicit kernel choice, which wins over the
    routing but must be able to do what was asked.
    """
    _check_positive_int("batch", batch)
    _check_positive_int("seqlen_q", seqlen_q)
    _check_bool("fp8", fp8)
    _check_positive_int("head_dim", head_dim)
    if not isinstance(arch, str):
        raise TypeError(f"arch must be a str such as 'gfx950', got {type(arch).__name__}")
    features = _features(has_bias, has_alibi, has_sink)
    if kernel is not None and (not isinstance(kernel, str) or kernel not in KERNELS):
        raise ValueError(f"kernel={kernel!r} is not a kernel fa_lab routes; choose one of {KERNELS} "
                         "(the SWA kernel is called through fa_lab.models.swa)")
    if rescale is not None and not isinstance(rescale, str):
        raise TypeError(f"rescale must be a policy name (str) or None, got {type(rescale).__name__}")
    dtype = "float8_e4m3fn" if fp8 else "bf16/f16"
    valid = POLICIES_FP8 if fp8 else POLICIES_BF16
    if rescale is not None and rescale not in valid:
        raise ValueError(f"rescale={rescale!r} is not a {dtype} policy; choose one of {sorted(valid)}")

    if fp8:
        if kernel is not None and kernel != "swp_fp8":
            raise ValueError(f"kernel={kernel!r} does not take float8_e4m3fn inputs; "
                             "fp8 runs on kernel='swp_fp8'")
        if features:
            raise ValueError(f"{features[0]} is not supported with fp8 inputs "
                             "(the fp8 kernel folds in no bias, ALiBi or sink)")
        if not arch.startswith(DUALWAVE_ARCH):
            raise ValueError(f"fp8 inputs need the gfx950 fp8 kernel, got arch={arch!r}")
        if head_dim != 128:
            raise ValueError(f"the fp8 kernel takes head_dim 128, got {head_dim}")
        return "swp_fp8"

    if kernel == "swp_fp8":
        raise ValueError("kernel='swp_fp8' takes float8_e4m3fn inputs only; bf16/f16 run on "
                         "'swp_bf16' or 'generic'")
    if kernel is not None:
        if rescale is not None and rescale not in KERNEL_POLICIES[kernel]:
            raise ValueError(f"kernel={kernel!r} has no rescale={rescale!r} (it implements "
                             f"{list(KERNEL_POLICIES[kernel])}); drop one of the two, or use "
                             "kernel='swp_bf16'")
        if kernel == "generic" and features:
            raise ValueError(f"kernel='generic' folds in no {features[0]}; use kernel='swp_bf16'")
        if kernel == "swp_bf16" and not can_dualwave(head_dim, arch):
            raise ValueError(f"kernel='swp_bf16' (DUALWAVE_SWP) needs D 64 or 128 on gfx950; got "
                             f"head_dim={head_dim}, arch={arch!r}")
        return kernel

    routed = "swp_bf16" if dense_routes_to_dualwave(batch, seqlen_q, has_bias, has_alibi,
                                                   has_sink, head_dim=head_dim, arch=arch) else "generic"
    if rescale is not None and rescale not in KERNEL_POLICIES[routed]:
        # The eager-only generic kernel cannot honour a lazy policy: DUALWAVE_SWP can.
        if not can_dualwave(head_dim, arch):
            raise ValueError(f"rescale={rescale!r} needs the DUALWAVE_SWP kernel (D 64 or 128 on "
                             f"gfx950); got head_dim={head_dim}, arch={arch!r}, where only the "
                             "eager generic kernel runs")
        return "swp_bf16"
    return routed
