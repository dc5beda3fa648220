"""The gfx950 attention kernel families (installed as ``fa_lab.kernels``).

One package per family, each holding its exact model (``model``, the definition), its
Triton ports (``faithful``: the model's schedule and every rescale decision; ``fast``:
the policy's semantics with its own tiling, for throughput) and, in its ``__init__``, the
``Family`` that says what each implementation runs (``fa_lab.capabilities``). ``FAMILIES``
holds them (``register``); ``fa_lab.dispatch`` builds its table from it. Adding a family is
a folder and a line in ``_PACKAGES`` (docs/architecture.md, "Add a kernel family"). ``_common/`` holds what the models share, ``_triton/`` the
Triton pieces the ports share. Importing a family's package imports neither its model nor
Triton: modules load when first used.
"""

from __future__ import annotations

if __name__ != "fa_lab.kernels":
    raise ImportError(
        f"this folder is fa_lab's Triton kernels, importable only as fa_lab.kernels "
        f"(pip install -e .), not as {__name__!r}; FlyDSL's own `kernels` package is a "
        "different thing")

import importlib  # noqa: E402
import re  # noqa: E402

#: The registered families' packages, one line each.
_PACKAGES = (
    "swp_bf16",
    "swp_fp8",
    "generic",
    "swa",
    "online",
    "bwd",
    "pa_decode",
    "mla_decode",
)
#: name -> ``fa_lab.capabilities.Family``.
FAMILIES = {}
#: name -> the family's package (its implementations are modules in it).
PACKAGES = {}
#: Called with no argument after every ``register``/``unregister`` (``fa_lab.dispatch``
#: rebuilds its table).
_LISTENERS = []


def register(package: str):
    """Register the family that package ``package`` (an importable name) declares as
    ``FAMILY``; its name must be the package's last component. What each line of
    ``_PACKAGES`` does for a folder here; a family kept elsewhere registers the same way.
    Returns the ``Family``."""
    family = importlib.import_module(package).FAMILY
    name = package.rpartition(".")[2]
    if family.name != name:
        raise ImportError(f"{package} declares a family named {family.name!r}, not {name!r}")
    if name in FAMILIES and PACKAGES[name] != package:
        raise ValueError(f"a family named {name!r} is already registered (from {PACKAGES[name]})")
    FAMILIES[name] = family
    PACKAGES[name] = package
    for listener in _LISTENERS:
        listener()
    return family


def unregister(name: str) -> None:
    """Remove a family that ``register`` added."""
    if name not in FAMILIES:
        raise KeyError(f"no kernel family {name!r} is registered")
    del FAMILIES[name], PACKAGES[name]
    for listener in _LISTENERS:
        listener()


for _name in _PACKAGES:
    register(f"{__name__}.{_name}")


def module(family: str, kind: str = "model"):
    """The module of ``family``'s implementation ``kind`` ("model", "faithful", "fast")."""
    if family not in FAMILIES:
        raise ValueError(f"no kernel family {family!r}; the families are {list(FAMILIES)}")
    impls = FAMILIES[family].implementations
    if kind not in impls:
        raise NotImplementedError(f"the {family} family has no {kind} implementation; it has "
                                  f"{list(impls)}")
    return importlib.import_module(f"{PACKAGES[family]}.{impls[kind].module}")


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


def port_backend(backend: str, device, backends: tuple) -> str:
    """The backend a family's own entry point (``fa_lab.decode``, ``fa_lab.mla``) runs on
    tensors on ``device`` (a ``torch.device``): ``backend`` among ``backends`` ("auto": the compiled faithful port on GPU tensors where
    Triton runs, else the model), after checking the tensors can run there: "triton" needs
    GPU tensors, "interpret" CPU tensors, and both need Triton (``unavailable``)."""
    if not isinstance(backend, str) or backend not in backends:
        raise ValueError(f"backend must be one of {backends}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and available() else "emulator"
    if backend == "interpret" and device.type != "cpu":
        raise ValueError(f"backend='interpret' runs on CPU tensors, got tensors on {device}")
    if backend == "triton" and device.type != "cuda":
        raise ValueError(f"backend='triton' needs GPU tensors, got tensors on {device}; "
                         "use backend='interpret' (Triton's CPU interpreter) or 'emulator'")
    if backend in ("interpret", "triton") and not available():
        raise RuntimeError(f"backend={backend!r} cannot run: {unavailable()}")
    return backend


def exact_dots(enabled: bool = True):
    """Context manager: inside it, the compiled faithful ports (swp_bf16, generic, swa) sum
    every dot exactly, as the models do, instead of on the tensor cores; slow, for runs
    that must match the model bit for bit (see ``_triton/dots.py``)."""
    why = unavailable()
    if why:
        raise RuntimeError(f"exact_dots cannot run: {why}")
    from ._triton.dots import exact_dots as context

    return context(enabled)
