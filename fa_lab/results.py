"""Results files: a user's runs in a results folder, the lab's reference data read apart.

    from fa_lab import results
    results.save("my_run", table, params={"S": 2048})   # -> ./fa_lab_results/my_run.json
    results.load("my_run")                              # a run of yours
    results.list()                                      # ['my_run', ...]
    results.reference("seed_bf16_h200")                 # the lab's reference data
    results.references()                                # ['bench_h200', 'seed_bf16_h200', ...]

**Two places.** ``data/results/`` in the checkout (``REFERENCE_DIR``) holds the lab's
reference data: the measurements the lessons, the README and the tests read. Nothing in
fa_lab writes there unless told to (``root=``, ``--out-dir``). A user's runs (``save``,
and every ``fa-lab`` command) go to the *results folder*: ``root=`` where given, else
``$FA_LAB_RESULTS`` where set, else ``./fa_lab_results/`` under the working directory
(``results_dir``; git-ignored). ``load`` and ``list`` read the results folder,
``reference`` and ``references`` the reference data. A results folder holds JSON results
as ``<name>.json`` and sweeps as ``atlas/<name>/`` (``fa_lab.studies.sweep``), as
``data/`` holds ``results/`` and ``atlas/``.

A result's ``name`` is a plain file name without ``.json``: one path component, confined to
its folder. An empty name, an absolute path, a path separator, ``.`` / ``..`` or a leading
dot is refused with a ``ValueError`` naming ``name``.

**Writes are atomic** (``atomic_write_bytes``, the package's one writer of files): the
bytes are made first (a value JSON cannot hold raises before any file is touched), written
to a hidden temp file beside the target and renamed into place, so a reader never sees half
a file and a failed write leaves the old one. The file is created with mode 0666 less the
process's umask, as ``open`` would. Every saved result carries ``provenance`` (device,
versions, date, command, git commit). NaN and inf become ``null`` so the files stay
standard JSON.

**Reading names the file on every failure**: a missing result raises ``FileNotFoundError``
listing the results that exist; a truncated or invalid file, or one that is not a JSON
object, raises ``ValueError``. A loaded result is a ``Result`` (a dict) whose missing keys
raise a ``KeyError`` naming the file and the keys it has.
"""

from __future__ import annotations

import builtins
import datetime as _dt
import json
import math
import os
import platform
import secrets
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

# The folder whose data/ holds the lab's reference data and whose notebooks/ the lessons: the
# checkout, or, for a package installed from a wheel (no checkout around it), the copy of
# both that the wheel carries (fa_lab/_course, setup.py).
ROOT = next((d for d in (Path(__file__).resolve().parent.parent,
                         Path(__file__).resolve().parent / "_course")
             if (d / "data" / "results").is_dir()), Path(__file__).resolve().parent.parent)
#: The lab's reference results (read by the lessons; written only when asked for by path).
REFERENCE_DIR = ROOT / "data" / "results"
#: Environment variable that chooses the results folder.
ENV_VAR = "FA_LAB_RESULTS"
#: The results folder under the working directory when neither root= nor ENV_VAR says.
DEFAULT_DIRNAME = "fa_lab_results"
SUFFIX = ".json"
#: The longest file name (bytes) most file systems take (NAME_MAX).
NAME_MAX = 255
#: What ``atomic_write_bytes``'s hidden temp name adds to the target's: ".", "." and 12
#: hex digits, ".tmp".
TEMP_EXTRA = 18
#: The longest result name (bytes, without ``.json``) whose temp file name still fits.
MAX_NAME_BYTES = NAME_MAX - TEMP_EXTRA - len(SUFFIX)

__all__ = ["load", "list", "save", "path", "reference", "references", "check_name", "check_folder",
           "check_writable", "check_same_run",
           "results_dir", "read_json", "Result", "provenance", "atomic_write_bytes",
           "atomic_write_json", "REFERENCE_DIR", "ENV_VAR", "DEFAULT_DIRNAME", "NAME_MAX",
           "TEMP_EXTRA", "MAX_NAME_BYTES"]


# ---- where ---------------------------------------------------------------------------------

def results_dir(root=None) -> Path:
    """The results folder: ``root``, else ``$FA_LAB_RESULTS``, else ``./fa_lab_results``
    (under the working directory at the time of the call)."""
    if root is not None:
        if not isinstance(root, (str, os.PathLike)):
            raise TypeError(f"root must be a path (str or os.PathLike), got {type(root).__name__}")
        return Path(root)
    env = os.environ.get(ENV_VAR)
    return Path(env) if env else Path.cwd() / DEFAULT_DIRNAME


def check_folder(root=None, *, what: str = "the results folder") -> Path:
    """The results folder (``results_dir(root)``), checked before any work: it, or the
    nearest folder above it that exists, must be a writable folder. A file in the way
    raises ``NotADirectoryError``, a folder this process may not write ``PermissionError``,
    each naming the path and where the folder came from (``root``/``--out-dir`` or
    ``$FA_LAB_RESULTS``)."""
    directory = results_dir(root)
    origin = ("" if root is not None else f" (from ${ENV_VAR})" if os.environ.get(ENV_VAR)
              else "")
    return check_writable(directory, f"{what} {directory}{origin}")


def check_writable(directory, what: str) -> Path:
    """``directory``, or the nearest existing folder above it, is a folder this process
    can write: else ``NotADirectoryError``/``PermissionError`` naming ``what`` and the
    path at fault."""
    directory = Path(directory)
    p = directory
    while not p.exists() and p != p.parent:
        p = p.parent
    if not p.is_dir():
        where = "it" if p == directory else str(p)
        raise NotADirectoryError(f"{what} cannot be made: {where} is a file, not a folder")
    if not os.access(p, os.W_OK | os.X_OK):
        raise PermissionError(f"{what} cannot be written: no permission to write in {p}")
    return directory


def check_same_run(name, params: Mapping, *, root=None, ignore=()) -> None:
    """Refuse, before any work, to overwrite result ``name`` with another run's: where the
    file exists and its ``params`` differ from ``params`` (``ignore``: keys that do not
    change the result), ``FileExistsError`` names the file and the options that differ. A
    rerun with the same options overwrites."""
    p = path(name, root=root)
    if not p.is_file():
        return
    try:
        old = read_json(p)
    except ValueError:
        old = None
    new = json.loads(json.dumps(dict(params), default=_json_default))
    had = old.get("params") if isinstance(old, dict) else None
    if not isinstance(had, dict):
        raise FileExistsError(f"{p} exists and holds no run's params: not overwritten; pass "
                              "another name (--name) or remove the file")
    keys = sorted((set(had) | set(new)) - set(ignore), key=str)
    differ = [k for k in keys if had.get(k) != new.get(k)]
    if differ:
        shown = "; ".join(f"{k}: {had.get(k)!r} there, {new.get(k)!r} now" for k in differ[:6])
        raise FileExistsError(f"{p} holds a run with other options ({shown}): not "
                              "overwritten; pass another name (--name) or remove the file")


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
    elif len(os.fsencode(stem)) > MAX_NAME_BYTES:
        why = (f"is {len(os.fsencode(stem))} bytes long: a result name takes at most "
               f"{MAX_NAME_BYTES} (the file system's {NAME_MAX}, less {SUFFIX!r} and the "
               f"{TEMP_EXTRA} the atomic write's temp name adds)")
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


class Result(dict):
    """A loaded result: a dict that knows its file (``path``), so a key it lacks raises a
    ``KeyError`` naming the file and the keys it has, instead of a bare key."""

    path: Path | None = None

    def __missing__(self, key):
        raise KeyError(f"{self.path}: no key {key!r} in this result (it has "
                       f"{', '.join(map(str, self)) or 'no keys'}): not the kind of result "
                       f"expected, or written by an older fa_lab")


def _as_result(obj, file: Path) -> Result:
    if not isinstance(obj, dict):
        raise ValueError(f"{file}: not a result: a result file holds a JSON object, this one "
                         f"a JSON {type(obj).__name__}")
    r = Result(obj)
    r.path = file
    return r


def list(*, root=None) -> builtins.list[str]:  # noqa: A001 - the API's name
    """Names of the results in the results folder, sorted (``[]`` if it does not exist)."""
    directory = results_dir(root)
    if not directory.is_dir():
        return []
    return sorted(p.name[:-len(SUFFIX)] for p in directory.iterdir()
                  if p.name.endswith(SUFFIX) and not p.name.startswith(".") and p.is_file())


def load(name, *, root=None) -> Result:
    """The stored result ``name`` in the results folder (a ``Result``: name, provenance,
    params, rows, ...).

    A missing file raises ``FileNotFoundError`` naming it and listing the results that
    exist; an unreadable one, or one that is not a JSON object, ``ValueError`` naming it."""
    p = path(name, root=root)
    if not p.is_file():
        have = list(root=root)
        shown = ", ".join(have[:40]) + (f", ... ({len(have)} in all)" if len(have) > 40 else "")
        hint = ""
        if root is None and (REFERENCE_DIR / p.name).is_file():
            hint = f" (the lab's reference data has one: results.reference({check_name(name)!r}))"
        raise FileNotFoundError(f"no result {check_name(name)!r}: {p} does not exist; "
                                f"results in {p.parent}: {shown or '(none)'}{hint}")
    return _as_result(read_json(p), p)


def reference(name) -> Result:
    """The lab's reference result ``name`` (``data/results/<name>.json``), as ``load``."""
    return load(name, root=REFERENCE_DIR)


def references() -> builtins.list[str]:
    """Names of the lab's reference results, sorted."""
    return list(root=REFERENCE_DIR)


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


def atomic_write_bytes(path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically: a hidden temp file beside it (mode 0666 less
    the umask, as ``open`` makes files), then a rename into place, so a reader never sees
    half a file and a failure leaves the old one. The package's one file writer."""
    path = Path(path)
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data must be bytes, got {type(data).__name__}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"  # TEMP_EXTRA more bytes
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def atomic_write_json(path, obj) -> Path:
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


def _clean_value(v, where: str = "payload"):
    """NaN/inf floats become null, numpy/torch scalars plain numbers, recursively; an
    array of more than one element raises TypeError naming its key (``where``)."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, Mapping):
        return {k: _clean_value(x, f"{where}[{k!r}]") for k, x in v.items()}
    if isinstance(v, (builtins.list, tuple)):
        return [_clean_value(x, f"{where}[{i}]") for i, x in enumerate(v)]
    if hasattr(v, "item") and not isinstance(v, (str, bytes)):
        try:
            return _clean_value(v.item(), where)
        except (ValueError, RuntimeError):  # a multi-element array or tensor
            shape = tuple(getattr(v, "shape", ()))
            raise TypeError(f"cannot store {type(v).__name__} of shape {shape} as JSON at "
                            f"{where}: convert it first (.tolist(), or a number)") from None
    return v


def _clean(records):
    """Table rows with NaN/inf floats as null so the JSON stays standard."""
    return [{k: _clean_value(v, f"rows[{i}][{k!r}]") for k, v in r.items()}
            for i, r in enumerate(records)]


def save(name, payload, *, params: dict | None = None, device="cpu", root=None) -> Path:
    """Store ``payload`` as ``<results dir>/<name>.json`` atomically; returns the path
    (the results folder: ``root``, ``$FA_LAB_RESULTS`` or ``./fa_lab_results``).

    ``payload`` is a table (``pandas.DataFrame``: stored as ``{"name", "provenance",
    "params", "rows"}``) or a JSON-able mapping (stored as given, with ``name`` and
    ``provenance`` added where it has none, and ``params`` where given). ``device`` names
    the device in the provenance. ``name`` must be a plain file name (see ``check_name``)."""
    stem = check_name(name)
    check_folder(root)
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
