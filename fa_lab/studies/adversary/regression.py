"""A found failure as a regression file (``.npz``: the inputs bit for bit, the policy and
what was expected), loaded and rerun later."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import numpy as np
import torch

from fa_lab import results

from .optimize import Attack
from .space import Candidate, KERNEL, _dtype, build, build_mods, kernel_for
from .judge import judge, judged_rows


_INT_VIEWS = {2: (torch.int16, np.uint16), 4: (torch.int32, np.uint32)}


def _bits(x: torch.Tensor) -> np.ndarray:
    """A 16- or 32-bit tensor's exact bit patterns (numpy has no bfloat16)."""
    ti, ni = _INT_VIEWS[x.element_size()]
    return x.contiguous().view(ti).numpy().view(ni)


def _from_bits(a: np.ndarray, dtype) -> torch.Tensor:
    return torch.from_numpy(a.view(np.int16).copy()).view(dtype)


def tensor_digest(*ts: torch.Tensor) -> str:
    """sha256 of the tensors' bytes (shape and dtype included)."""
    import hashlib

    h = hashlib.sha256()
    for t in ts:
        h.update(f"{tuple(t.shape)}{t.dtype}".encode())
        h.update(_bits(t).tobytes())
    return h.hexdigest()


def save_regression(res: Attack, path, *, expect: str | None = None) -> Path:
    """Write the shrunk input (or, with nothing found, the best one) as a compressed .npz
    with a JSON ``meta`` (policy, threshold, dtype, causal, the candidate, the names of its
    score modifiers, the failing rows, ``expect``: "nonfinite" or "finite", and the sha256
    of q, k, v and the modifiers' tensors). A one-hot input with V = ones has its q, k, v
    stored as their bit patterns (mostly zeros: a few KB). Any other input (dense random
    draws in q, k or V: tens or hundreds of KB) is stored as its candidate only, and so are
    the modifiers of every input (a bias with a random part is as dense):
    ``load_regression`` rebuilds them from the candidate and checks the digest."""
    c = res.shrunk if res.found else res.best
    if c is None:
        raise ValueError("the attack has no input to save")
    if expect is None:
        expect = "nonfinite" if res.found else "finite"
    q, k, v = build(c)
    mods = build_mods(c)
    sparse = c.family == "onehot" and c.v_kind == "ones"
    meta = {"policy": res.policy, "threshold": res.threshold, "baseline": res.baseline,
            "classes": list(res.classes),
            "dtype": c.dtype, "causal": c.causal, "expect": expect, "candidate": c.to_dict(),
            "size": c.size, "bad_rows": res.bad_rows, "space": res.space["name"],
            "budget_s": res.budget_s, "seed": res.seed, "found": res.found,
            "stored": "tensors" if sparse else "candidate",
            "mods": list(mods), "sha256": tensor_digest(q, k, v, *mods.values())}
    arrays = {"q": _bits(q), "k": _bits(k), "v": _bits(v)} if sparse else {}
    buf = io.BytesIO()
    np.savez_compressed(buf, meta=np.array(json.dumps(meta)), **arrays)
    return results.atomic_write_bytes(Path(path), buf.getvalue())


#: The keys of a regression file's ``meta`` that loading and running it read.
META_KEYS = ("policy", "threshold", "dtype", "causal", "expect", "candidate", "sha256")


def load_regression(path, *, with_mods: bool = False):
    """(q, k, v, meta) of a regression file, q/k/v in the dtype it names (rebuilt from the
    candidate where only that is stored; either way checked against the digest).
    ``with_mods``: (q, k, v, meta, mods), ``mods`` the score modifiers as
    ``flash_attn_func`` keyword arguments (empty for an input without any)."""
    q, k, v, meta, c = _read(Path(path))
    mods = build_mods(c)
    if list(mods) != meta.get("mods", []) or tensor_digest(q, k, v, *mods.values()) != meta["sha256"]:
        raise ValueError(f"{path}: the input does not match its digest (a different torch "
                         "random stream rebuilt a 'random'-family candidate?)")
    return (q, k, v, meta, mods) if with_mods else (q, k, v, meta)


def _read(path: Path):
    """(q, k, v, meta, candidate) of a regression file; whatever is wrong with the file
    raises ``ValueError`` naming it and what is wrong."""
    if not path.is_file():
        raise FileNotFoundError(f"no regression file {str(path)!r}")
    try:
        z = np.load(path, allow_pickle=False)
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as e:
        raise ValueError(f"{path}: not a regression file (.npz): {e}") from None
    with z:
        if "meta" not in z.files:
            raise ValueError(f"{path}: not a regression file: no 'meta' (it holds "
                             f"{', '.join(z.files) or 'nothing'})")
        try:
            meta = json.loads(str(z["meta"]))
        except (ValueError, zipfile.BadZipFile, EOFError) as e:
            raise ValueError(f"{path}: its 'meta' is not valid JSON: {e}") from None
        missing = [k for k in META_KEYS if not isinstance(meta, dict) or k not in meta]
        if missing:
            raise ValueError(f"{path}: its 'meta' lacks {', '.join(map(repr, missing))}")
        try:
            dt = _dtype(meta["dtype"])
            c = Candidate(**meta["candidate"])
        except (TypeError, ValueError, KeyError) as e:
            raise ValueError(f"{path}: its 'meta' holds a bad dtype or candidate: {e}") from None
        if meta.get("stored", "tensors") == "tensors":
            gone = [n for n in ("q", "k", "v") if n not in z.files]
            if gone:
                raise ValueError(f"{path}: stores its tensors, but lacks {', '.join(gone)}")
            try:
                q, k, v = (_from_bits(z[n], dt) for n in ("q", "k", "v"))
            except (ValueError, zipfile.BadZipFile, EOFError) as e:
                raise ValueError(f"{path}: a tensor does not read: {e}") from None
        else:
            q, k, v = build(c)
    return q, k, v, meta, c


def run_regression(path, policy=None) -> dict:
    """Run a regression file's input (its score modifiers too) under its policy (or
    ``policy``): whether the model's output has a non-finite row among the judged rows
    (``judged_rows``), which rows, whether the fp64 reference is finite on every row, and
    the rows it leaves undefined. A zoo preset's input is judged by its classes of failure
    (``judge``: ``failed`` and ``classes`` too)."""
    from fa_lab import api, reference

    q, k, v, meta, mods = load_regression(path, with_mods=True)
    pol = meta["policy"] if policy is None else policy
    if kernel_for(pol) != KERNEL:  # a zoo preset: judged on the online family, by class
        v_ = judge(Candidate(**meta["candidate"]), pol, classes=meta.get("classes"),
                   threshold=meta["threshold"] if policy is None else None)
        return {"policy": getattr(pol, "name", pol), "nonfinite": "nonfinite" in v_.classes,
                "failed": v_.failed, "classes": v_.classes, "bad_rows": v_.bad_rows,
                "ref_finite": v_.ref_finite, "undefined_rows": v_.undefined_rows, "meta": meta}
    out = api.flash_attn_func(q, k, v, causal=meta["causal"], rescale=pol,
                              rescale_threshold=meta["threshold"] if policy is None else None,
                              backend="emulator", kernel=KERNEL, **mods)
    ref, lse = reference.attention(q, k, v, causal=meta["causal"], dtype=torch.float64, **mods)
    judged = judged_rows(ref, lse)
    bad = ~torch.isfinite(out.float()).all(-1)[0, :, 0] & judged
    return {"policy": getattr(pol, "name", pol), "nonfinite": bool(bad.any()),
            "bad_rows": bad.nonzero().flatten().tolist(), "ref_finite": bool(judged.all()),
            "undefined_rows": (~judged).nonzero().flatten().tolist(), "meta": meta}
