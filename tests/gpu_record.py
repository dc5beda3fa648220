"""``make test-gpu``: every GPU-marked test on this machine's GPU, and the record of the run.

CPU CI cannot see device bugs, so a change to ``fa_lab/``, ``kernels/`` or ``tests/`` counts
as verified only by a record of this command whose tree hashes equal the committed trees
and which has no failure (``--check`` compares a record with a checkout).

The run has two phases:

1. the GPU tests that may share the GPU, with ``--workers`` pytest-xdist workers;
2. the ``gpu_alone`` tests (GPU time ratios, or memory-heavy), one at a time, alone.

The record (JSON, written atomically) holds the GPU, the versions, the date, each phase's
command, time and exit status, every test's outcome and time, and the git tree hashes of
``fa_lab/``, ``kernels/`` and ``tests/`` as they were on disk. The hashes are computed from
the files themselves the way git hashes a tree (``tree_hash``), so they need no git
repository: a GPU machine gets a copy of the working tree without one. Where git is at
hand the record also says whether those directories matched ``HEAD``.

A run that does not fit one sitting (a lent machine's calls are time-limited) splits into
shards: ``--shard I/N`` runs the I-th of N disjoint sets of test files, chosen from the
collected GPU tests and balanced by the per-file times of the committed record, and
``--merge`` joins the N shard records into one. A shard record alone vouches for nothing;
the merged record does when its shards ran the same trees on the same GPU and together
cover exactly the tests every shard collected.

    python3 tests/gpu_record.py [--record PATH] [--workers 8] [--shard I/N]
    python3 tests/gpu_record.py --merge PART1 PART2 ... --record PATH
    python3 tests/gpu_record.py --check PATH     # does PATH vouch for this checkout's HEAD?
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import hashlib
import json
import os
import platform
import stat
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The directories whose trees a record vouches for.
TREES = ("fa_lab", "kernels", "tests")
#: pytest's marker expressions for the two phases.
SHARED = "gpu and not gpu_alone"
ALONE = "gpu and gpu_alone"


# --- git's tree hash, from the files on disk ------------------------------------------------

def ignore_patterns(root: Path = ROOT) -> list[str]:
    """The name patterns of ``root/.gitignore`` that apply below the top level (patterns
    anchored at the root, ``/x``, cannot match inside the hashed directories)."""
    out = []
    for line in (root / ".gitignore").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "/", "!")):
            out.append(line.rstrip("/"))
    return out


def _ignored(name: str, patterns) -> bool:
    return any(fnmatch.fnmatch(name, p) for p in patterns)


def _blob(path: Path) -> bytes:
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).digest()


def tree_hash(path: Path, patterns=None) -> str:
    """The hash git gives the directory ``path`` as committed (``git rev-parse HEAD:dir``
    on a clean checkout): files that ``.gitignore``'s name patterns leave out and empty
    directories are not part of it, as in git."""
    patterns = ignore_patterns() if patterns is None else patterns
    digest = _tree(Path(path), patterns)
    if digest is None:
        raise ValueError(f"{path} holds no file git would track")
    return digest.hex()


def _tree(path: Path, patterns) -> bytes | None:
    entries = []
    for child in path.iterdir():
        if _ignored(child.name, patterns):
            continue
        if child.is_symlink():
            target = os.readlink(child).encode()
            entries.append((child.name, b"120000", hashlib.sha1(b"blob %d\0" % len(target) + target).digest()))
        elif child.is_dir():
            sub = _tree(child, patterns)
            if sub is not None:
                entries.append((child.name + "/", b"40000", sub))
        else:
            mode = b"100755" if child.stat().st_mode & stat.S_IXUSR else b"100644"
            entries.append((child.name, mode, _blob(child)))
    if not entries:
        return None
    # git orders entries by name, a directory's name taken with a trailing "/"
    body = b"".join(mode + b" " + name.rstrip("/").encode() + b"\0" + sha
                    for name, mode, sha in sorted(entries, key=lambda e: e[0].encode()))
    return hashlib.sha1(b"tree %d\0" % len(body) + body).digest()


def trees(root: Path = ROOT) -> dict[str, str]:
    return {name: tree_hash(root / name) for name in TREES}


def git_state(root: Path = ROOT) -> dict | None:
    """HEAD, its trees and whether the hashed directories are clean there; None without git."""
    def git(*args):
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              check=True).stdout.strip()
    try:
        head = git("rev-parse", "HEAD")
        committed = {name: git("rev-parse", f"HEAD:{name}") for name in TREES}
        dirty = git("status", "--porcelain", "--", *TREES)
    except (OSError, subprocess.CalledProcessError):
        return None
    return {"head": head, "trees": committed, "clean": not dirty}


# --- the run --------------------------------------------------------------------------------

def gpu_info() -> dict:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("make test-gpu needs a CUDA/ROCm GPU: torch.cuda.is_available() is False")
    props = torch.cuda.get_device_properties(0)
    info = {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
            "multiprocessors": props.multi_processor_count, "count": torch.cuda.device_count()}
    try:
        info["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, check=True).stdout.split("\n")[0].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return info


def versions() -> dict:
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "hip": torch.version.hip}
    try:
        import triton
        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    return out


def junit_rows(path: Path, phase: int) -> list[dict]:
    """One row per test case of a junit file: its id (``tests/x.py::name``), outcome, time."""
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        for tag, word in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            node = case.find(tag)
            if node is not None:
                outcome = word
                message = (node.get("message") or "").splitlines()[:1]
                break
        else:
            message = []
        parts = case.get("classname", "").split(".")
        # junit's classname is the dotted module path, then any test classes
        rows.append({"test": _test_id(parts, case.get("name")), "phase": phase, "outcome": outcome,
                     "seconds": round(float(case.get("time") or 0.0), 2),
                     **({"message": message[0][:300]} if message else {})})
    return rows


def _test_id(parts: list[str], name: str) -> str:
    """``tests.kernels.test_x.TestY`` + ``test_z`` -> ``tests/kernels/test_x.py::TestY::test_z``."""
    for i in range(len(parts), 0, -1):
        if (ROOT / Path(*parts[:i])).with_suffix(".py").exists():
            return "/".join(parts[:i]) + ".py::" + "::".join([*parts[i:], name])
    return ".".join(parts) + "::" + name


def _pytest(python: str, marker: str, targets, *extra) -> list[str]:
    return [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marker, *extra,
            f"--rootdir={ROOT}", "-c", str(ROOT / "pyproject.toml"), *map(str, targets)]


def run_phase(marker: str, workers: int, phase: int, python: str, env: dict, cwd: Path,
              targets=None) -> dict:
    """One pytest run of the tests marked ``marker`` in ``targets`` (default: all of
    ``tests/``), from ``cwd`` (see importable_env) with the checkout as pytest's rootdir, so
    test ids read as they do in the checkout."""
    targets = [ROOT / "tests"] if targets is None else [ROOT / t for t in targets]
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = _pytest(python, marker, targets, "--durations=15", f"--junitxml={junit}",
                      "-o", "junit_family=xunit2")
        if workers > 1:
            cmd[3:3] = ["-n", str(workers)]
        print("$", " ".join(cmd), flush=True)
        t0 = time.perf_counter()
        code = subprocess.run(cmd, cwd=cwd, env=env).returncode
        seconds = time.perf_counter() - t0
        rows = junit_rows(junit, phase) if junit.exists() else []
    # 5: pytest collected nothing for this marker, which is no failure
    return {"phase": phase, "marker": marker, "workers": workers, "command": " ".join(cmd[1:]),
            "seconds": round(seconds, 1), "exit": code, "ok": code in (0, 5), "rows": rows}


# --- shards ---------------------------------------------------------------------------------

def collect(marker: str, python: str, env: dict, cwd: Path) -> list[str]:
    """The ids of the tests marked ``marker``, as pytest collects them here."""
    got = subprocess.run(_pytest(python, marker, [ROOT / "tests"], "--collect-only"),
                         cwd=cwd, env=env, capture_output=True, text=True)
    if got.returncode not in (0, 5):
        raise SystemExit(f"collecting the {marker!r} tests failed:\n{got.stdout[-3000:]}{got.stderr[-2000:]}")
    return sorted(line.strip() for line in got.stdout.splitlines() if "::" in line)


def file_weights(record: Path, phase: int = 1) -> dict[str, float]:
    """Seconds per test file in phase ``phase`` of ``record`` (empty where there is none)."""
    try:
        rows = json.loads(Path(record).read_text())["tests"]
    except (OSError, ValueError, KeyError):
        return {}
    out: dict[str, float] = {}
    for r in rows:
        if r.get("phase") == phase:
            f = r["test"].split("::")[0]
            out[f] = out.get(f, 0.0) + r["seconds"]
    return out


def plan_shards(shared_ids, n: int, weights, workers: int, alone_seconds: float) -> list[dict]:
    """Split the shared tests' files into ``n`` shards of about equal expected wall time: a
    file weighs its recorded seconds over ``workers`` (a file the record lacks weighs as much
    as the heaviest known one), and the ``gpu_alone`` phase, which runs one test at a time,
    goes to the last shard with its ``alone_seconds``. Deterministic for the same input."""
    files = sorted({i.split("::")[0] for i in shared_ids})
    unknown = max(weights.values(), default=60.0)
    load = [0.0] * n
    load[-1] = alone_seconds * workers
    shards = [{"index": k + 1, "of": n, "files": []} for k in range(n)]
    for f in sorted(files, key=lambda f: (-weights.get(f, unknown), f)):
        k = min(range(n), key=lambda k: (load[k], k))
        load[k] += weights.get(f, unknown)
        shards[k]["files"].append(f)
    for sh in shards:
        sh["files"].sort()
    return shards


def collection_digest(shared_ids, alone_ids) -> str:
    text = "\n".join(["shared", *shared_ids, "alone", *alone_ids])
    return hashlib.sha256(text.encode()).hexdigest()


def summarize(rows) -> dict:
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    return dict(sorted(counts.items()))


def atomic_write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    os.chmod(tmp, 0o666 & ~_umask())
    os.replace(tmp, path)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def importable_env(python: str) -> tuple[dict, Path]:
    """The environment in which ``python`` imports fa_lab (and fa_lab.kernels, which lives in
    kernels/) from this checkout. Where it already does (an editable install), the current
    one; else a tree of links in a temporary folder, put first on PYTHONPATH: ``fa_lab/``
    holding a link to each of the checkout's fa_lab entries and ``kernels`` as
    ``fa_lab/kernels``. No package is built or installed, so a GPU machine with no network
    and no build tools runs the checkout as it is. Returns the environment and the folder
    to run from: ``python -m`` puts the working folder first on sys.path, where the
    checkout's own ``fa_lab/`` (which holds no ``kernels``) would hide the links, so runs
    through the links start from the links' own folder."""
    env = dict(os.environ)
    probe = [python, "-c", "import fa_lab.kernels, fa_lab, pathlib; "
             "print(pathlib.Path(fa_lab.__file__).resolve())"]
    got = subprocess.run(probe, cwd=tempfile.gettempdir(), capture_output=True, text=True, env=env)
    if got.returncode == 0 and Path(got.stdout.strip()).parent == ROOT / "fa_lab":
        return env, ROOT
    links = Path(tempfile.mkdtemp(prefix="fa_lab-links-")) / "fa_lab"
    links.mkdir()
    for entry in (ROOT / "fa_lab").iterdir():
        if entry.name != "kernels":
            (links / entry.name).symlink_to(entry)
    (links / "kernels").symlink_to(ROOT / "kernels")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(links.parent), env.get("PYTHONPATH")]))
    got = subprocess.run(probe, cwd=links.parent, capture_output=True, text=True, env=env)
    if got.returncode != 0 or Path(got.stdout.strip()).parent != ROOT / "fa_lab":
        raise SystemExit(f"fa_lab does not import from {ROOT} even through {links}: {got.stderr}")
    print(f"fa_lab runs from {ROOT} through the links in {links.parent}", flush=True)
    return env, links.parent


def record_run(record: Path, workers: int, python: str = sys.executable,
               shard: tuple[int, int] | None = None, weights_from: Path | None = None) -> dict:
    gpu = gpu_info()
    env, cwd = importable_env(python)
    if workers > 1 and subprocess.run([python, "-c", "import xdist"]).returncode:
        print("pytest-xdist is not installed: the shared phase runs in one process", flush=True)
        workers = 1
    started = datetime.datetime.now(datetime.timezone.utc)
    hashes = trees()
    state = git_state()
    part = None
    if shard is None:
        phases = [run_phase(SHARED, workers, 1, python, env, cwd),
                  run_phase(ALONE, 1, 2, python, env, cwd)]
    else:
        index, n = shard
        shared_ids, alone_ids = collect(SHARED, python, env, cwd), collect(ALONE, python, env, cwd)
        past = weights_from or ROOT / "data" / "results" / "gpu_record.json"
        plan = plan_shards(shared_ids, n, file_weights(past), max(workers, 1),
                           sum(file_weights(past, phase=2).values()))
        part = {**plan[index - 1], "collected": collection_digest(shared_ids, alone_ids),
                "collected_ids": shared_ids + alone_ids}
        phases = []
        if part["files"]:
            phases.append(run_phase(SHARED, workers, 1, python, env, cwd, targets=part["files"]))
        if index == n:
            phases.append(run_phase(ALONE, 1, 2, python, env, cwd))
    rows = [r for p in phases for r in p.pop("rows")]
    after = trees()
    out = {
        "name": "make test-gpu",
        "date": started.isoformat(timespec="seconds"),
        "gpu": gpu,
        "versions": versions(),
        "trees": hashes,
        "trees_unchanged_during_run": after == hashes,
        "git": state,
        **({"shard": part} if part else {}),
        "phases": phases,
        "seconds": round((datetime.datetime.now(datetime.timezone.utc) - started).total_seconds(), 1),
        "summary": summarize(rows),
        "passed": bool(rows) and all(p["ok"] for p in phases)
                  and not any(r["outcome"] in ("failed", "error") for r in rows),
        "tests": sorted(rows, key=lambda r: r["test"]),
    }
    atomic_write_json(record, out)
    return out


def merge(parts) -> dict:
    """One record from the records of all N shards of one run: they must name the same trees,
    GPU, versions and collection, and be shards 1..N once each. Refuses anything else."""
    recs = [json.loads(Path(p).read_text()) for p in parts]
    if not recs or any("shard" not in r for r in recs):
        raise ValueError("--merge takes the records of a sharded run (each made with --shard)")
    n = recs[0]["shard"]["of"]
    if sorted(r["shard"]["index"] for r in recs) != list(range(1, n + 1)) \
            or any(r["shard"]["of"] != n for r in recs):
        raise ValueError(f"--merge needs shards 1..{n} once each, got "
                         + ", ".join(f"{r['shard']['index']}/{r['shard']['of']}" for r in recs))
    for key in ("trees", "versions"):
        if any(r[key] != recs[0][key] for r in recs):
            raise ValueError(f"the shards ran different {key}: they are not one run")
    for key in ("collected",):
        if any(r["shard"][key] != recs[0]["shard"][key] for r in recs):
            raise ValueError("the shards collected different tests: they are not one run")
    if any(r["gpu"]["name"] != recs[0]["gpu"]["name"] for r in recs):
        raise ValueError("the shards ran on different GPUs")
    recs.sort(key=lambda r: r["shard"]["index"])
    files = [f for r in recs for f in r["shard"]["files"]]
    if len(files) != len(set(files)):
        raise ValueError("two shards ran the same test file")
    rows = [t for r in recs for t in r["tests"]]
    missing = sorted(set(recs[0]["shard"]["collected_ids"]) - {t["test"] for t in rows})
    if missing:
        raise ValueError(f"{len(missing)} collected tests ran in no shard, e.g. {missing[:3]}")
    phases = [{**p, "shard": r["shard"]["index"]} for r in recs for p in r["phases"]]
    return {
        "name": "make test-gpu",
        "date": min(r["date"] for r in recs),
        "gpu": recs[0]["gpu"],
        "versions": recs[0]["versions"],
        "trees": recs[0]["trees"],
        "trees_unchanged_during_run": all(r["trees_unchanged_during_run"] for r in recs),
        "git": recs[0]["git"],
        "shards": [{**{k: v for k, v in r["shard"].items() if k != "collected_ids"},
                    "date": r["date"], "seconds": r["seconds"]} for r in recs],
        "phases": phases,
        "seconds": round(sum(r["seconds"] for r in recs), 1),
        "summary": summarize(rows),
        "passed": all(r["passed"] for r in recs),
        "tests": sorted(rows, key=lambda t: t["test"]),
    }


def check(record_path: Path, root: Path = ROOT) -> list[str]:
    """Why the record at ``record_path`` does not vouch for ``root``'s HEAD (empty: it does)."""
    rec = json.loads(Path(record_path).read_text())
    state = git_state(root)
    problems = []
    if state is None:
        return ["no git checkout here to compare with"]
    for name in TREES:
        if rec["trees"].get(name) != state["trees"][name]:
            problems.append(f"{name}/ at HEAD is {state['trees'][name][:12]}, the record ran "
                            f"{str(rec['trees'].get(name))[:12]}")
    if not rec.get("passed"):
        problems.append(f"the run did not pass: {rec.get('summary')}")
    if "shard" in rec:
        problems.append(f"it is shard {rec['shard']['index']} of {rec['shard']['of']}: "
                        "merge the shards' records (--merge) into one")
    if not rec.get("trees_unchanged_during_run", False):
        problems.append("the files changed while the tests ran")
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default = Path(os.environ.get("FA_LAB_RESULTS", "fa_lab_results")) / "gpu_record.json"
    ap.add_argument("--record", type=Path, default=default, help=f"where to write it (default {default})")
    ap.add_argument("--workers", type=int, default=8, help="xdist workers for the shared phase")
    ap.add_argument("--check", type=Path, metavar="RECORD",
                    help="only check that RECORD vouches for this checkout's HEAD")
    ap.add_argument("--shard", metavar="I/N", type=_shard,
                    help="run only the I-th of N shards of the tests (see --merge)")
    ap.add_argument("--merge", type=Path, nargs="+", metavar="PART",
                    help="join the records of shards 1..N into the record --record")
    args = ap.parse_args(argv)
    if args.merge:
        out = merge(args.merge)
        atomic_write_json(args.record, out)
        print(f"{len(args.merge)} shards: {out['summary']} in {out['seconds']} s; "
              f"passed {out['passed']}; record {args.record}")
        return 0 if out["passed"] else 1
    if args.check is not None:
        problems = check(args.check)
        for p in problems:
            print(f"{args.check}: {p}", file=sys.stderr)
        if not problems:
            print(f"{args.check} vouches for HEAD's {', '.join(TREES)}")
        return 1 if problems else 0
    out = record_run(args.record, args.workers, shard=args.shard)
    print(f"{out['gpu']['name']}: {out['summary']} in {out['seconds']} s; trees "
          + ", ".join(f"{k} {v[:12]}" for k, v in out["trees"].items()) + f"; record {args.record}")
    return 0 if out["passed"] else 1


def _shard(text: str) -> tuple[int, int]:
    try:
        index, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard takes I/N, e.g. 1/2, not {text!r}") from None
    if not 1 <= index <= n:
        raise argparse.ArgumentTypeError(f"--shard {text}: I must be in 1..N")
    return index, n


if __name__ == "__main__":
    sys.exit(main())
