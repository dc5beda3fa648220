"""Triton ports of the gfx950 attention kernels (installed as ``fa_lab.kernels``).

``attention/`` holds one module per kernel, beside the model it ports
(``fa_lab/models/<same name>.py``). Faithful kernels reproduce the model's schedule and
every rescale decision; fast kernels (``attention/fast_*.py``) keep the policy's semantics
but choose their own tiling, for throughput only.
"""

from __future__ import annotations

import importlib

import torch


def available() -> bool:
    """True when Triton imports (the kernels themselves are imported lazily)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def attention_module(name: str, backend: str, device: torch.device):
    """The Triton port ``fa_lab.kernels.attention.<name>`` for ``backend`` 'triton' or
    'interpret', after checking that the tensors can run there."""
    if backend == "triton" and device.type != "cuda":
        raise ValueError(f"backend='triton' needs CUDA/ROCm tensors, got tensors on {device}; "
                         "use backend='interpret' (Triton's CPU interpreter) or 'emulator'")
    if backend == "interpret" and device.type != "cpu":
        raise ValueError(f"backend='interpret' runs on CPU tensors, got tensors on {device}")
    if not available():
        raise RuntimeError("backend needs Triton, which is not installed (pip install 'triton>=3.4')")
    try:
        return importlib.import_module(f"fa_lab.kernels.attention.{name}")
    except ModuleNotFoundError as e:
        if e.name == f"fa_lab.kernels.attention.{name}":
            raise NotImplementedError(f"no Triton port of {name} yet; use backend='emulator'") from None
        raise


def exact_dots(enabled: bool = True):
    """Context manager: inside it, the compiled faithful ports (swp_bf16, generic, swa) sum
    every dot exactly, as the models do, instead of on the tensor cores; slow, for runs
    that must match the model bit for bit (see ``attention/_dots.py``)."""
    if not available():
        raise RuntimeError("exact_dots needs Triton, which is not installed (pip install 'triton>=3.4')")
    from .attention._dots import exact_dots as context

    return context(enabled)
