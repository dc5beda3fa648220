"""Triton ports of the gfx950 attention kernels (installed as ``fa_lab.kernels``).

One package per kernel family, beside the model it ports (``fa_lab/models/<family>.py``):
``swp_bf16/`` and ``swp_fp8/`` hold the family's faithful port (``faithful``) and its fast
kernels (``fast``; bf16 also ``splitk``, ``varlen`` and the faithful split-K ``combine``);
``generic.py`` and ``swa.py`` are faithful ports. Faithful kernels reproduce the model's
schedule and every rescale decision; fast kernels keep the policy's semantics but choose
their own tiling, for throughput only. ``_triton/`` holds the pieces they share.
"""

from __future__ import annotations

if __name__ != "fa_lab.kernels":
    raise ImportError(
        f"this folder is fa_lab's Triton kernels, importable only as fa_lab.kernels "
        f"(pip install -e .), not as {__name__!r}; FlyDSL's own `kernels` package is a "
        "different thing")

import importlib  # noqa: E402
import re  # noqa: E402

import torch  # noqa: E402

#: The faithful port of each kernel name the api routes to.
FAITHFUL = {"swp_bf16": "swp_bf16.faithful", "swp_fp8": "swp_fp8.faithful",
            "generic": "generic", "swa": "swa"}


#: The oldest Triton the kernels run on (pyproject.toml's floor, which ``make test`` tests
#: with ``make test-triton-floor``): older ones lack Gluon and TMA APIs the kernels use.
TRITON_FLOOR = (3, 6)
INSTALL = f"pip install 'triton>={TRITON_FLOOR[0]}.{TRITON_FLOOR[1]}'"


def unavailable() -> str | None:
    """Why the Triton kernels cannot run here, or None: Triton does not import, or it is
    older than ``TRITON_FLOOR`` (the kernels themselves are imported lazily)."""
    try:
        import triton
    except ImportError:
        return f"Triton is not installed ({INSTALL})"
    version = getattr(triton, "__version__", "")
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None or tuple(int(x) for x in m.groups()) < TRITON_FLOOR:
        return f"Triton {version or '(no version)'} is older than the kernels need ({INSTALL})"
    return None


def available() -> bool:
    """True when the Triton kernels can run here (``unavailable()`` is None)."""
    return unavailable() is None


def attention_module(name: str, backend: str, device: torch.device):
    """The faithful Triton port of kernel ``name`` ("swp_bf16", "swp_fp8", "generic",
    "swa"; ``FAITHFUL``) for ``backend`` 'triton' or 'interpret', after checking that the
    tensors can run there."""
    if backend == "triton" and device.type != "cuda":
        raise ValueError(f"backend='triton' needs CUDA/ROCm tensors, got tensors on {device}; "
                         "use backend='interpret' (Triton's CPU interpreter) or 'emulator'")
    if backend == "interpret" and device.type != "cpu":
        raise ValueError(f"backend='interpret' runs on CPU tensors, got tensors on {device}")
    why = unavailable()
    if why:
        raise RuntimeError(f"backend={backend!r} cannot run: {why}")
    if name not in FAITHFUL:
        raise NotImplementedError(f"no Triton port of {name} yet; use backend='emulator'")
    return importlib.import_module(f"{__name__}.{FAITHFUL[name]}")


def exact_dots(enabled: bool = True):
    """Context manager: inside it, the compiled faithful ports (swp_bf16, generic, swa) sum
    every dot exactly, as the models do, instead of on the tensor cores; slow, for runs
    that must match the model bit for bit (see ``_triton/dots.py``)."""
    why = unavailable()
    if why:
        raise RuntimeError(f"exact_dots cannot run: {why}")
    from ._triton.dots import exact_dots as context

    return context(enabled)
