"""``fa_lab.compare``: run one call on two backends and report how the outputs differ.

The question a kernel engineer asks of a model and a kernel (or two kernels) on the same
inputs: do they fail at the same places, and how close are they elsewhere?

    c = fa_lab.compare(q, k, v, causal=False, rescale="lazy")
    print(c)            # non-finite masks side by side, rel-L2 where both are finite
    assert c.same_masks

Any two of ``flash_attn_func``'s backends work. By default the model (``emulator``) is
compared with the other backend these tensors run on here (``default_b``): ``interpret``
on a CPU, ``flydsl`` on an MI355X with FlyDSL installed, ``triton`` on another GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

KINDS = {"nan": torch.isnan,
         "+inf": lambda x: x == math.inf,
         "-inf": lambda x: x == -math.inf}


@dataclass(frozen=True)
class MaskDiff:
    """One kind of non-finite value (NaN, +inf or -inf) in a and in b."""

    kind: str
    in_a: int
    in_b: int
    differ: int  # positions non-finite of this kind in exactly one of them


@dataclass(frozen=True)
class TensorDiff:
    """How two tensors of one shape differ: masks, then values where both are finite."""

    name: str
    elements: int
    masks: tuple[MaskDiff, ...]
    both_finite: int
    rel_l2: float  # over positions finite in both; NaN when there are none
    max_abs: float

    @property
    def same_masks(self) -> bool:
        return all(m.differ == 0 for m in self.masks)

    def lines(self) -> list[str]:
        out = [f"{self.name}: {self.elements:,} elements"]
        for m in self.masks:
            out.append(f"  {m.kind:>4}: a {m.in_a:,}  b {m.in_b:,}  differ at {m.differ:,}")
        out.append(f"  where both finite ({self.both_finite:,}): rel-L2 {self.rel_l2:.3e}, "
                   f"max |a - b| {self.max_abs:.3e}")
        return out


@dataclass(frozen=True)
class Comparison:
    a: str
    b: str
    out: TensorDiff
    lse: TensorDiff | None
    kwargs: dict = field(default_factory=dict)

    @property
    def same_masks(self) -> bool:
        return self.out.same_masks and (self.lse is None or self.lse.same_masks)

    def __str__(self) -> str:
        lines = [f"compare a={self.a} b={self.b}"] + self.out.lines()
        if self.lse is not None:
            lines += self.lse.lines()
        return "\n".join(lines)


def tensor_diff(name: str, a: torch.Tensor, b: torch.Tensor) -> TensorDiff:
    """Masks and values of a and b (same shape; b is moved to a's device)."""
    if a.shape != b.shape:
        raise ValueError(f"{name}: shapes differ, a {tuple(a.shape)} b {tuple(b.shape)}")
    a = a.double()
    b = b.to(a.device).double()
    masks = []
    for kind, fn in KINDS.items():
        ma, mb = fn(a), fn(b)
        masks.append(MaskDiff(kind, int(ma.sum()), int(mb.sum()), int((ma ^ mb).sum())))
    both = torch.isfinite(a) & torch.isfinite(b)
    n = int(both.sum())
    if n:
        da, db = a[both], b[both]
        norm = float(torch.linalg.vector_norm(db))
        diff = float(torch.linalg.vector_norm(da - db))
        rel = diff / norm if norm > 0 else (0.0 if diff == 0 else math.inf)
        max_abs = float((da - db).abs().max())
    else:
        rel = max_abs = math.nan
    return TensorDiff(name, a.numel(), tuple(masks), n, rel, max_abs)


def _device_refusal(backend: str, device: torch.device) -> None:
    """Raise now what ``backend`` would raise about where it runs: tensors on ``device``,
    FlyDSL importable, Triton new enough."""
    from fa_lab.kernels import unavailable

    if backend == "flydsl":
        from fa_lab import flydsl
        flydsl.check_device(device)
        flydsl.upstream_function()
    elif backend == "triton" and device.type != "cuda":
        raise ValueError(f"backend 'triton' needs GPU tensors, got tensors on {device}")
    elif backend == "interpret" and device.type != "cpu":
        raise ValueError(f"backend 'interpret' runs on CPU tensors, got tensors on {device}")
    if backend in ("interpret", "triton", "fast") and unavailable():
        raise ValueError(f"backend {backend!r} cannot run here: {unavailable()}")


def _real_tensor(x) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type != "meta"


def _runs_here(backend: str, device: torch.device) -> str | None:
    """Why ``backend`` cannot run tensors on ``device`` here, or None."""
    try:
        _device_refusal(backend, device)
    except Exception as e:  # noqa: BLE001 - the reason is the answer
        return str(e)
    return None


def default_b(device, a: str = "emulator") -> str:
    """The backend ``compare`` sets beside ``a`` when ``b`` is not given: the first of
    these that runs tensors on ``device`` here and is not ``a``. CPU: ``interpret`` (the
    Triton ports under Triton's interpreter), then ``emulator``; GPU: ``flydsl`` (an
    MI355X with FlyDSL importable), ``triton``, then ``emulator``. ValueError saying why
    each fell through when none does."""
    device = torch.device(device)
    order = ("interpret", "emulator") if device.type == "cpu" else ("flydsl", "triton", "emulator")
    why = []
    for backend in order:
        if backend == a:
            continue
        reason = _runs_here(backend, device)
        if reason is None:
            return backend
        why.append(f"{backend!r}: {reason}")
    raise ValueError(f"b=None: no backend beside a={a!r} runs tensors on {device} here ("
                     + "; ".join(why) + "); pass b= a backend this machine runs")


def compare(q, k, v, *, a: str = "emulator", b: str | None = None, lse: bool = True,
            **kwargs) -> Comparison:
    """Run ``flash_attn_func(q, k, v, backend=a, **kwargs)`` and the same with
    ``backend=b``; compare out (and LSE when ``lse``). Whether both backends can run here is
    checked before either runs, so a missing FlyDSL or GPU costs no model time.

    Parameters
    ----------
    q, k, v : torch.Tensor
        As ``flash_attn_func``.
    a : str
        The first backend (``fa_lab.api.BACKENDS``); default ``"emulator"``.
    b : str or None
        The second backend, not ``a``; None: the other backend these tensors run on here
        (``default_b``; on CPU tensors with Triton installed, the interpreted Triton ports).
    lse : bool
        Compare the LSE too; default True.
    **kwargs
        Any other ``flash_attn_func`` argument but ``backend`` and ``return_lse``.

    Returns
    -------
    Comparison
        Per tensor, where each is NaN, +inf and -inf on either side and where the masks
        differ, and rel-L2 and max |a - b| where both are finite; ``same_masks``.

    Examples
    --------
    >>> import fa_lab
    >>> from fa_lab.studies.experiments import bf16_inputs
    >>> q, k, v = bf16_inputs(1, 1024, 1, 64, k_scale=48)
    >>> c = fa_lab.compare(q[:, :256], k, v, a="emulator", b="interpret", causal=False,
    ...                    rescale="lazy_unfixed")
    >>> c.same_masks                       # the port's NaN and inf masks are the model's
    True
    >>> c.out.masks[0].kind, c.out.masks[0].in_a > 0
    ('nan', True)
    """
    from fa_lab.api import BACKENDS, flash_attn_func

    if not isinstance(a, str) or a not in BACKENDS:
        raise ValueError(f"a={a!r}; choose one of {BACKENDS}")
    if not isinstance(lse, bool):
        raise TypeError(f"lse must be a bool, got {type(lse).__name__}")
    if "backend" in kwargs or "return_lse" in kwargs:
        raise TypeError("compare sets backend (a, b) and return_lse (lse) itself")
    if b is None:
        if not _real_tensor(q):     # flash_attn_func names the bad argument
            flash_attn_func(q, k, v, backend=a, **kwargs)
        b = default_b(q.device, a)
    if not isinstance(b, str) or b not in BACKENDS:
        raise ValueError(f"b={b!r}; choose one of {BACKENDS}")
    if a == b:
        raise ValueError(f"a and b are both {a!r}; compare two different backends")
    if _real_tensor(q):
        for backend in (a, b):
            _device_refusal(backend, q.device)
    res_a = flash_attn_func(q, k, v, backend=a, return_lse=lse, **kwargs)
    res_b = flash_attn_func(q, k, v, backend=b, return_lse=lse, **kwargs)
    out_a, lse_a = res_a if lse else (res_a, None)
    out_b, lse_b = res_b if lse else (res_b, None)
    return Comparison(a, b, tensor_diff("out", out_a, out_b),
                      tensor_diff("lse", lse_a, lse_b) if lse else None,
                      {k_: v_ for k_, v_ in kwargs.items() if not isinstance(v_, torch.Tensor)})
