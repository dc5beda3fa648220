"""Measured runs, kept as JSON files in one directory (``data/results`` by default).

    from fa_lab import results
    results.list()                      # ['bench_h200', 'seed_bf16_h200', ...]
    obj = results.load("seed_bf16_h200")
    results.save("my_run", table, params={"S": 2048})   # -> <results dir>/my_run.json

A result's ``name`` is a plain file name without ``.json``: one path component, confined to
the results directory. An empty name, an absolute path, a path separator, ``.`` / ``..``
or a leading dot is refused with a ``ValueError`` naming ``name``.

Which directory: ``root=`` where given, else the environment variable
``FA_LAB_RESULTS_DIR`` where set, else ``RESULTS_DIR`` (``data/results`` in the checkout).

Writes are atomic: the JSON is serialised first (a value JSON cannot hold raises before any
file is touched), written to a temp file beside the target and renamed into place, so a
reader never sees half a file and a failed write leaves the old one. Every saved result
carries ``provenance`` (device, versions, date, command, git commit). NaN and inf become
``null`` so the files stay standard JSON.

Reading names the file on every failure: a missing result raises ``FileNotFoundError``
listing the results that exist; a truncated or otherwise invalid file raises ``ValueError``.
"""

from __future__ import annotations

import builtins
import datetime as _dt
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "data" / "results"
#: environment variable that points the results directory elsewhere (tests, scratch runs)
ENV_VAR = "FA_LAB_RESULTS_DIR"
SUFFIX = ".json"

__all__ = ["load", "list", "save", "path", "check_name", "results_dir", "read_json",
           "provenance", "atomic_write_bytes", "atomic_write_json", "RESULTS_DIR", "ENV_VAR"]


# ---- where ---------------------------------------------------------------------------------

def results_dir(root=None) -> Path:
    """The results directory: ``root``, else ``$FA_LAB_RESULTS_DIR``, else ``RESULTS_DIR``."""
    if root is not None:
        if not isinstance(root, (str, os.PathLike)):
            raise TypeError(f"root must be a path (str or os.PathLike), got {type(root).__name__}")
        return Path(root)
    env = os.environ.get(ENV_VAR)
    return Path(env) if env else Path(RESULTS_DIR)


def check_name(name) -> str:
    """``name`` without a trailing ``.json``, checked to be one plain file name.

    Raises ``TypeError`` for a non-string and ``ValueError`` (naming ``name``) for an empty
    name, an absolute path, a path separator, ``.``/``..``, a leading dot or a NUL."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    stem = name[:-len(SUFFIX)] if name.endswith(SUFFIX) else name
    why = None
    if not stem.strip():
        why = "is empty"
    elif os.path.isabs(name) or name.startswith(("/", "\\")):
        why = "is an absolute path"
    elif any(sep in name for sep in {"/", "\\", os.sep, os.altsep} - {None}):
        why = "contains a path separator"
    elif stem in (".", ".."):
        why = f"is {stem!r}"
    elif stem.startswith("."):
        why = "starts with '.'"
    elif "\x00" in name:
        why = "contains a NUL character"
    if why:
        raise ValueError(f"name={name!r} {why}: a result name is one plain file name (no "
                         f"directories), stored as <results dir>/<name>.json")
    return stem


def path(name, *, root=None) -> Path:
    """The file that holds result ``name``: ``<results dir>/<name>.json`` (checked)."""
    directory = results_dir(root)
    p = directory / f"{check_name(name)}{SUFFIX}"
    # defence in depth: the checked name is one component, so this always holds
    if p.parent.resolve() != directory.resolve():  # pragma: no cover
        raise ValueError(f"name={name!r} resolves outside the results directory {directory}")
    return p


# ---- read ----------------------------------------------------------------------------------

def read_json(file) -> object:
    """Parse a JSON file; a truncated or invalid one raises ``ValueError`` naming the file."""
    file = Path(file)
    try:
        text = file.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{file}: not valid JSON (not UTF-8 text: {e.reason} at byte "
                         f"{e.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        hint = " (truncated?)" if e.pos >= len(text.rstrip()) else ""
        raise ValueError(f"{file}: not valid JSON{hint}: {e.msg} at line {e.lineno} "
                         f"column {e.colno}") from None


def list(*, root=None) -> builtins.list[str]:  # noqa: A001 - the API's name
    """Names of the results in the results directory, sorted (``[]`` if it does not exist)."""
    directory = results_dir(root)
    if not directory.is_dir():
        return []
    return sorted(p.name[:-len(SUFFIX)] for p in directory.iterdir()
                  if p.name.endswith(SUFFIX) and not p.name.startswith(".") and p.is_file())


def load(name, *, root=None) -> dict:
    """The stored result ``name`` (a dict: name, provenance, params, rows, ...).

    A missing file raises ``FileNotFoundError`` naming it and listing the results that
    exist; an unreadable one ``ValueError`` naming it."""
    p = path(name, root=root)
    if not p.is_file():
        have = list(root=root)
        shown = ", ".join(have[:40]) + (f", ... ({len(have)} in all)" if len(have) > 40 else "")
        raise FileNotFoundError(f"no result {check_name(name)!r}: {p} does not exist; "
                                f"results in {p.parent}: {shown or '(none)'}")
    return read_json(p)


# ---- write ---------------------------------------------------------------------------------

def provenance(device="cpu", **extra) -> dict:
    """Who made a result: device, versions, date, command, git commit."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
    else:
        name = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:  # pragma: no cover - triton is a dependency
        triton_version = None
    # a copy without its own .git (a GPU machine's snapshot) names its commit in the environment
    commit = os.environ.get("FA_LAB_GIT_COMMIT")
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                           text=True, timeout=5)
        commit = commit or (r.stdout.strip() if r.returncode == 0 else None)
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "device": name,
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "git_commit": commit,
        **extra,
    }


def atomic_write_bytes(path: Path, data: bytes) -> Path:
    """Write ``data`` to a temp file beside ``path`` and rename it into place, so a reader
    never sees half a file and a failure leaves the old one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def atomic_write_json(path: Path, obj) -> Path:
    """``obj`` as indented JSON, written atomically (serialised first: a value JSON cannot
    hold raises before the file is touched)."""
    text = json.dumps(obj, indent=1, default=_json_default) + "\n"
    return atomic_write_bytes(path, text.encode())


def _json_default(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if hasattr(x, "item"):
        return x.item()
    raise TypeError(f"cannot store {type(x).__name__} as JSON")


def _clean_value(v):
    """NaN/inf floats become null, numpy/torch scalars plain numbers, recursively."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, Mapping):
        return {k: _clean_value(x) for k, x in v.items()}
    if isinstance(v, (builtins.list, tuple)):
        return [_clean_value(x) for x in v]
    if hasattr(v, "item") and not isinstance(v, (str, bytes)):
        try:
            return _clean_value(v.item())
        except (ValueError, RuntimeError):  # a multi-element array: left to json's default
            return v
    return v


def _clean(records):
    """Table rows with NaN/inf floats as null so the JSON stays standard."""
    return [{k: _clean_value(v) for k, v in r.items()} for r in records]


def save(name, payload, *, params: dict | None = None, device="cpu", root=None) -> Path:
    """Store ``payload`` as ``<results dir>/<name>.json`` atomically; returns the path.

    ``payload`` is a table (``pandas.DataFrame``: stored as ``{"name", "provenance",
    "params", "rows"}``) or a JSON-able mapping (stored as given, with ``name`` and
    ``provenance`` added where it has none, and ``params`` where given). ``device`` names
    the device in the provenance. ``name`` must be a plain file name (see ``check_name``)."""
    stem = check_name(name)
    if params is not None and not isinstance(params, Mapping):
        raise TypeError(f"params must be a dict or None, got {type(params).__name__}")
    if hasattr(payload, "to_dict") and hasattr(payload, "columns"):  # a DataFrame
        obj = {"name": stem, "provenance": provenance(device), "params": dict(params or {}),
               "rows": _clean(payload.to_dict("records"))}
    elif isinstance(payload, Mapping):
        obj = {"name": stem, **{k: v for k, v in payload.items() if k != "name"}}
        if "provenance" not in obj:
            obj["provenance"] = provenance(device)
        if params is not None:
            obj["params"] = dict(params)
        obj = _clean_value(obj)
    else:
        raise TypeError(f"payload must be a pandas DataFrame or a dict, got "
                        f"{type(payload).__name__}")
    return atomic_write_json(path(stem, root=root), obj)
