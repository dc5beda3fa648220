"""Input checks shared by the api, the models' direct entry points and the Triton ports:
every error is a ValueError/TypeError that names the argument, raised before any work."""

from __future__ import annotations

import argparse
import math
import numbers
import operator
import sys
import warnings
from pathlib import Path

import numpy as np
import torch


def check_int(name: str, value, *, lo: int | None = None) -> int:
    """A whole number (a Python int, a numpy integer or a 0-d integer tensor; never a bool)
    as int, at least ``lo``; TypeError/ValueError naming ``name``. The one grammar every
    integer argument shares (``trace``'s ``rows`` too)."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        out = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if lo is not None and out < lo:
        raise ValueError(f"{name} must be >= {lo}, got {out}")
    return out


def check_positive(name: str, value) -> float:
    """A finite real number > 0 (a Python or numpy number; never a bool or a string) as
    float; TypeError/ValueError naming ``name``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


TRUE_WORDS = ("true", "1", "yes", "on")
FALSE_WORDS = ("false", "0", "no", "off")


class BoolValueError(argparse.ArgumentTypeError, ValueError):
    """A word that is not a boolean (argparse reports its message as the flag's error)."""


def parse_bool(text) -> bool:
    """The one boolean grammar of the command line: true/false, 1/0, yes/no, on/off in any
    case (and real bools); anything else (``ture``, ``maybe``, ``2``) raises, so a typo
    never means False."""
    if isinstance(text, bool):
        return text
    word = str(text).strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise BoolValueError(f"expected a boolean (true/false, 1/0, yes/no, on/off), got {text!r}")


def check_descale(name: str, x) -> float:
    """A per-tensor fp8 descale: a float or a one-element floating tensor, finite and > 0;
    TypeError/ValueError naming ``name``."""
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ValueError(f"{name} must be a per-tensor scale (one element), got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point scale, got {x.dtype}")
        x = float(x.reshape(()).item())
    elif isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"{name} must be a float or a one-element tensor, got {type(x).__name__}")
    x = float(x)
    if not math.isfinite(x) or x <= 0:
        raise ValueError(f"{name} must be finite and > 0, got {x!r}")
    return x


def _dtype_names(dtypes) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def check_qkv(q, k, v, *, dtypes, head_dims, kernel: str = "the kernel",
              names=("q", "k", "v"), min_kv: int = 1,
              v_head_dims=None) -> tuple[int, int, int, int, int, int]:
    """q [B, Sq, H, D], k and v [B, Skv, Hkv, D]: tensors, rank, dtypes (one of ``dtypes``,
    all alike), device, shapes, GQA grouping and head dim (any where ``head_dims`` is None).
    ``names`` are what the errors call the three (a kernel taking fp8 says q8, k8, v8);
    ``min_kv`` is the fewest keys taken (0 for a model that defines an empty cache's rows).
    ``v_head_dims``: the V head dims Dv taken where Dv may differ from D (None: v's shape
    must equal k's). Returns (B, Sq, H, D, Skv, Hkv)."""
    qn, kn, vn = names
    for name, t in zip(names, (q, k, v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, S, H, D], got shape {tuple(t.shape)}")
    for name, t in zip(names, (q, k, v)):
        if t.dtype not in dtypes:
            raise TypeError(f"{name} has dtype {t.dtype}; {kernel} takes {_dtype_names(dtypes)}")
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but {qn} has {q.dtype}; all three must match")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but {qn} is on {q.device}")
    B, Sq, H, D = q.shape
    if v_head_dims is not None and k.shape[:3] == v.shape[:3] and v.shape[3] != k.shape[3]:
        if v.shape[3] not in v_head_dims:
            raise ValueError(f"{vn} head dim Dv={v.shape[3]} is not supported; Dv takes "
                             f"{' or '.join(map(str, v_head_dims))}")
    elif k.shape != v.shape:
        raise ValueError(f"{kn} {tuple(k.shape)} and {vn} {tuple(v.shape)} must have the same shape")
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"{kn} and {vn} must be [B={B}, Skv, Hkv, D={D}]; {kn} has batch "
                         f"{k.shape[0]} and head dim {k.shape[3]}")
    Skv, Hkv = k.shape[1], k.shape[2]
    if min(B, Sq, H, Hkv) < 1 or Skv < min_kv:
        keys = "" if min_kv == 1 else f" (keys >= {min_kv})"
        raise ValueError(f"empty input: {qn} {tuple(q.shape)}, {kn} {tuple(k.shape)}; batch, "
                         f"sequence lengths and heads must be >= 1{keys}")
    if H % Hkv:
        raise ValueError(f"{qn} heads H={H} must be a multiple of the kv heads Hkv={Hkv} (GQA/MQA)")
    if head_dims is not None and D not in head_dims:
        raise ValueError(f"head dim D={D} is not supported; {kernel} takes D = "
                         f"{' or '.join(map(str, head_dims))}")
    return B, Sq, H, D, Skv, Hkv


def check_device(name: str, device) -> str:
    """``cpu`` or ``cuda[:N]`` (a str or a torch.device) that exists on this machine, as a
    str; ValueError/TypeError naming ``name`` (a CUDA device on a machine without one
    says so, instead of torch's error at the first tensor)."""
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"{name} must be 'cpu' or 'cuda[:N]', got {type(device).__name__}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"{name}={device!r}: expected cpu or cuda[:N]") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}={device!r}: expected cpu or cuda[:N]")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name}={device!r} asks for a CUDA GPU and none is available on "
                             "this machine (torch.cuda.is_available() is False); use 'cpu'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"{name}={device!r}: this machine has {torch.cuda.device_count()} "
                             f"CUDA device(s), cuda:0..cuda:{torch.cuda.device_count() - 1}")
    return str(device)


def nonfinite_inputs(q=None, k=None, v=None, *, shown: int = 4) -> str | None:
    """Where q, k and v ([B, S, H, D]) hold NaN or inf, in words, or None: for each, the
    count and the first ``shown`` (batch, row, head) of q or (batch, key, head) of k and v
    holding one. Such a value reaches the output whatever the policy does; ``trace``,
    ``onset.predict`` and the dashboards say so, so that the policy is not blamed."""
    said = []
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            continue
        bad = ~torch.isfinite(t.float())
        n = int(bad.sum())
        if not n:
            continue
        nan = int(torch.isnan(t.float()).sum())
        where = bad.any(-1).nonzero()
        first = ", ".join(str(tuple(w)) for w in where[:shown].tolist())
        more = f", ... ({where.shape[0]} in all)" if where.shape[0] > shown else ""
        axis = "row" if name == "q" else "key"
        said.append(f"{name} has {n} non-finite value{'s' if n > 1 else ''} ({nan} NaN, "
                    f"{n - nan} inf) at (batch, {axis}, head) {first}{more}")
    if not said:
        return None
    return ("; ".join(said) + ": the inputs carry them into the output, whatever the policy "
            "does")


def warn_nonfinite_inputs(q, k, v) -> str | None:
    """``nonfinite_inputs``, also given as a RuntimeWarning at the user's line."""
    note = nonfinite_inputs(q, k, v)
    if note is not None:
        warnings.warn(note, RuntimeWarning, stacklevel=caller_stacklevel())
    return note


def check_mod(name, x, shapes, dtype, device) -> None:
    """A score modifier (bias, ALiBi slopes, sink): a tensor of ``dtype`` with one of
    ``shapes`` on ``device`` (q's), as upstream takes them."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {x.dtype}")
    if tuple(x.shape) not in [tuple(s) for s in shapes]:
        want = " or ".join(str(list(s)) for s in shapes)
        raise ValueError(f"{name} has shape {list(x.shape)}; expected {want}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but q is on {device}")


#: More heads than any attention model has: a longer head axis (dim 2) is a sequence.
MAX_HEADS = 256

#: From this many, a head axis longer than the sequence axis in q and k alike reads as a
#: sequence (SDPA's [B, H, S, D]); below it, short sequences over many heads stay quiet.
SDPA_MIN_LEN = 64


def layout_problem(q_shape, k_shape) -> str | None:
    """Why q [B, S, H, D] and k (v alike) of these shapes look like another layout, or
    None. Two signs, each a shape no legitimate call has:

    * a head axis (dim 2) longer than ``MAX_HEADS``;
    * SDPA's [B, H, S, D] read as [B, S, H, D]: dim 1 alike in q and k (SDPA's heads,
      read as the two sequence lengths) and shorter than dim 2, alike in q and k and at
      least ``SDPA_MIN_LEN`` (SDPA's sequence, read as the heads). A true call with equal
      lengths and equal head counts has more heads than tokens only for a handful of
      tokens, or with an odd model; GQA (fewer kv heads) and decoding (one query over a
      long KV) never match.
    """
    q_shape, k_shape = tuple(q_shape), tuple(k_shape)
    if len(q_shape) != 4 or len(k_shape) != 4:
        return None
    (_, Sq, H, _), (_, Skv, Hkv, _) = q_shape, k_shape
    if max(H, Hkv) > MAX_HEADS:
        return (f"read as [B, S, H, D], q {list(q_shape)} and k {list(k_shape)} have "
                f"{max(H, Hkv)} heads (dim 2), more than any model's {MAX_HEADS}")
    if Sq == Skv < H == Hkv and H >= SDPA_MIN_LEN:
        return (f"read as [B, S, H, D], q {list(q_shape)} and k {list(k_shape)} have "
                f"{H} heads over {Sq} tokens: dim 1 short and equal in q and k, dim 2 long, "
                "as SDPA's [B, H, S, D]")
    return None


def layout_hint(problem: str) -> str:
    return (f"{problem}. fa_lab takes [B, S, H, D] (sequence in dim 1, heads in dim 2), as "
            "FlyDSL; for tensors in [B, H, S, D] pass q.transpose(1, 2), k.transpose(1, 2) and "
            "v.transpose(1, 2)")


def caller_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` made by the function that calls this one,
    naming the first frame outside fa_lab: the user's line, however deep in fa_lab (an api
    call, a sweep's planning) the warning is given, so a user can filter it by module."""
    package = str(Path(__file__).resolve().parent)
    frame, level = sys._getframe(2), 2
    while frame is not None and str(Path(frame.f_code.co_filename).resolve()).startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def warn_layout(q, k) -> None:
    """Warn (UserWarning, at the caller's line) where q and k look like another layout
    than [B, S, H, D] (``layout_problem``): the call runs as given."""
    problem = layout_problem(q.shape, k.shape)
    if problem is not None:
        warnings.warn(layout_hint(problem), UserWarning, stacklevel=caller_stacklevel())
