"""Running a grid on Dask: a LocalCluster of single-threaded workers (or a given
scheduler), points not yet done submitted in batches, rows saved as they arrive, so a
killed worker or an interrupted sweep resumes where it stopped."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import signal
import sys
import threading
import uuid
from pathlib import Path

import pandas as pd
import torch

from fa_lab import results

from .grid import GridError, SweepError, _describe, check_name
from .kinds import open_grid
from .store import LAYOUTS, _write_part, done_points, load, name_key, stored_names, sweep_dir
from .point import compute_point
from .decode_grid import describe as _describe_decode
from .decode_point import compute_decode_point


try:
    from distributed.diagnostics.plugin import WorkerPlugin as _WorkerPlugin
except ImportError:  # pragma: no cover - distributed is a dependency
    _WorkerPlugin = object


class TorchThreads(_WorkerPlugin):
    """Worker plugin: one torch thread per worker, fa_lab imported up front, and a worker
    of a GPU host pinned to GPU (worker name mod GPU count)."""

    name = "fa-lab-torch-threads"

    def __init__(self, threads: int = 1):
        self.threads = threads

    def setup(self, worker):
        torch.set_num_threads(self.threads)
        import fa_lab.api  # noqa: F401 - the first task should not pay the import
        if torch.cuda.is_available():
            try:
                torch.cuda.set_device(int(worker.name) % torch.cuda.device_count())
            except (TypeError, ValueError):
                pass


WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}


def local_client(n_workers: int = 2, *, gpu: bool | None = None):
    """A ``Client`` on a new ``LocalCluster(n_workers, threads_per_worker=1,
    processes=True)`` whose workers run one torch thread; with ``gpu`` (default: where
    CUDA is present) each worker offers the resource ``GPU=1``. Close with
    ``close_local(client)``."""
    from distributed import Client, LocalCluster

    if gpu is None:
        gpu = torch.cuda.is_available()
    # a free port (two sweeps on one machine each get theirs), on loopback only: ":0" alone
    # listens on every interface, and the dashboard is open to the network
    dashboard = "127.0.0.1:0"
    with _workers_ignore_ctrl_c():
        cluster = LocalCluster(n_workers=n_workers, threads_per_worker=1, processes=True,
                               dashboard_address=dashboard, env=dict(WORKER_ENV),
                               resources={"GPU": 1} if gpu else None,
                               silence_logs=logging.ERROR)
    client = Client(cluster)
    client.register_plugin(TorchThreads(1))
    return client


@contextlib.contextmanager
def _workers_ignore_ctrl_c():
    """SIGINT ignored while the worker processes start, so they inherit that: Ctrl-C at a
    terminal reaches the whole process group, and only this process should act on it (stop
    the sweep, keep what was saved, close the cluster) while the workers wait to be closed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


class _ClosedCommFilter(logging.Filter):
    """Drops the log record of a result fetch whose connection closed under it. Stopping an
    interrupted sweep cancels its pending futures and closes the cluster while the client
    still waits on some of them; tornado then logs each such wait as an "Exception in
    callback" with a traceback, though the stop is what was asked for."""

    def filter(self, record):
        from distributed.comm.core import CommClosedError

        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, CommClosedError)


_CLOSED_COMM_FILTER = _ClosedCommFilter()
_CALLBACK_LOG = "tornado.application"


def _quiet_closed_comms(on: bool) -> None:
    """While an interrupted sweep stops: tornado's record of a fetch cut by the closing
    connection is dropped (``_ClosedCommFilter``); any other error is still logged."""
    log = logging.getLogger(_CALLBACK_LOG)
    if on:
        log.addFilter(_CLOSED_COMM_FILTER)
    else:
        log.removeFilter(_CLOSED_COMM_FILTER)


def close_local(client) -> None:
    cluster = client.cluster
    client.close()
    if cluster is not None:
        cluster.close()


def _needs_gpu(point: dict) -> bool:
    return point["device"] == "cuda"


def _check_gpu_workers(client, points, spelled) -> None:
    need = [p for p in points if _needs_gpu(p)]
    if not need:
        return
    workers = client.scheduler_info(n_workers=-1)["workers"] if _takes_n_workers(client) \
        else client.scheduler_info()["workers"]
    if not any(w.get("resources", {}).get("GPU", 0) >= 1 for w in workers.values()):
        raise GridError(spelled["backend"], f"{len(need)} point(s) run on CUDA (backend "
                        f"{need[0]['backend']!r}, device 'cuda') and ask for the worker resource "
                        "GPU=1, which no worker of this cluster offers (start workers with "
                        "--resources GPU=1)")


def _takes_n_workers(client) -> bool:
    import inspect

    return "n_workers" in inspect.signature(client.scheduler_info).parameters


def _as_grid(grid):
    """A ``Grid`` or ``DecodeGrid`` from a grid, a YAML path or a mapping (its ``kind:``)."""
    return open_grid(grid)


def _ship(policy):
    """What a worker receives for a policy: a built-in name stays a name; a name that
    only this process has registered goes as its object (workers have not registered it)."""
    from fa_lab import policies

    builtin = getattr(policies, "BUILTIN_NAMES", None)
    if isinstance(policy, str) and builtin is not None and policy not in builtin \
            and hasattr(policies, "get"):
        return policies.get(policy)
    return policy


def run(grid, *, client=None, out=None, name: str | None = None, workers: int = 2,
        progress: bool = True, counts: str = "auto", batch: int = 1,
        raise_errors: bool = True) -> pd.DataFrame:
    """Run the grid's points that have no row yet, one Dask task each, and return the
    sweep's whole table (``load``). ``client``: an existing cluster's ``Client`` (None:
    a LocalCluster of ``workers`` processes, closed afterwards). Results go to
    ``<out>/atlas/<name>/`` (``out``: the results folder, default ``$FA_LAB_RESULTS`` or
    ./fa_lab_results; ``name`` defaults to the grid's). With ``progress`` the sweep says on
    stderr where it runs and the Dask dashboard's address, and shows a progress bar. ``batch``:
    points per Parquet part (1: a killed sweep loses only what is in flight).
    ``counts``: see ``compute_point``. A point that raises is not written (a rerun retries
    it); after the others finish, ``SweepError`` lists the failures (``raise_errors``).
    The returned frame's ``attrs`` hold ``points``, ``skipped``, ``computed``, ``failed``
    and ``run_id``."""
    grid = _as_grid(grid)
    name = check_name(name or grid.name or "sweep")
    if counts not in ("auto", "always", "never"):
        raise ValueError(f"counts must be 'auto', 'always' or 'never', got {counts!r}")
    if grid.kind == "decode" and counts != "auto":
        raise ValueError(f"counts={counts!r}: a decode sweep counts no rescales (its kernels "
                         "take no rescale policy)")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a positive int, got {batch!r}")
    directory = results.check_writable(sweep_dir(name, out), f"the sweep's folder {sweep_dir(name, out)}")
    points = grid.points()  # every check, before any task
    done = done_points(name, out=out, kind=grid.kind)
    todo = [p for p in points if p["point_id"] not in done]
    redefined = _redefined(name, out, todo, grid.kind)
    what = "policy" if grid.kind == "policy" else "kernel"
    for pol, n in redefined.items():
        print(f"sweep {name}: {what} {pol!r} changed since the stored run: recomputing {n} "
              f"point{'s' if n > 1 else ''}", file=sys.stderr, flush=True)
    run_id = uuid.uuid4().hex
    failures = {}
    if todo:
        own = client is None
        if own and any(_needs_gpu(p) for p in todo) and not torch.cuda.is_available():
            raise GridError(grid.spelled["backend"], "points on CUDA (backend 'triton' or device "
                            "'cuda') need a GPU; this machine has none: pass client= (or "
                            "--scheduler) for a cluster with GPU workers")
        if own:
            client = local_client(workers)
        try:
            _check_gpu_workers(client, todo, grid.spelled)
            directory.mkdir(parents=True, exist_ok=True)
            _record_grid(directory, grid)
            if progress:
                print(f"sweep {name}: {len(todo)} of {len(points)} points to run, results in "
                      f"{directory}\n{dashboard(client)} (scheduler {client.scheduler.address})",
                      file=sys.stderr, flush=True)
            failures = _submit_and_collect(client, todo, name=name, run_id=run_id,
                                           directory=directory, counts=counts, batch=batch,
                                           progress=progress, kind=grid.kind)
        finally:
            if own:
                close_local(client)
            _quiet_closed_comms(False)
    table = load(name, out=out)
    table.attrs.update(points=len(points), skipped=len(points) - len(todo),
                       computed=len(todo) - len(failures), failed=len(failures), run_id=run_id,
                       redefined=redefined)
    if failures and raise_errors:
        raise SweepError(failures, table)
    return table


def _redefined(name: str, out, todo: list, kind: str = "policy") -> dict:
    """Policy (or decode kernel) name -> how many points to run have a stored row of the
    same name (axes, policy by name) under another point_id: computed with another
    definition of the policy (of the kernel's upstream version, or of its inputs)."""
    if not todo:
        return {}
    stored = stored_names(name, out=out)
    counts: dict = {}
    for p in todo:
        named = p if kind == "decode" else {**p, "policy": getattr(p["policy"], "name", p["policy"])}
        key = name_key(named, LAYOUTS[kind])
        if stored.get(key, set()) - {p["point_id"]}:
            counts[key[0]] = counts.get(key[0], 0) + 1
    return counts


def dashboard(client) -> str:
    """Where the cluster's Dask dashboard is, in words (its address, or why there is none)."""
    services = client.scheduler_info().get("services", {})
    local = getattr(client, "cluster", None) is not None
    if "dashboard" not in services or local and importlib.util.find_spec("bokeh") is None:
        return "Dask dashboard: none (it needs bokeh>=3.1 on the scheduler's machine)"
    return f"Dask dashboard: {client.dashboard_link}"


def _record_grid(directory: Path, grid) -> None:
    """The grid as run, as ``_grid-<hash>.json`` beside the parts (the leading ``_`` keeps
    Parquet readers of the folder off it)."""
    blob = json.dumps(grid.to_dict(), sort_keys=True, default=str, indent=1)
    path = directory / f"_grid-{hashlib.sha1(blob.encode()).hexdigest()[:12]}.json"
    if not path.exists():
        results.atomic_write_bytes(path, (blob + "\n").encode())


def _submit_and_collect(client, todo, *, name, run_id, directory, counts, batch, progress,
                        kind="policy"):
    from distributed import as_completed
    from tqdm.auto import tqdm

    futures = {}
    for p in todo:
        kw = {"resources": {"GPU": 1}} if _needs_gpu(p) else {}
        key = f"fa-lab-sweep-{name}-{p['point_id']}"
        if kind == "decode":
            fut = client.submit(compute_decode_point, p, key=key, **kw)
        else:
            shipped = {**p, "policy": _ship(p["policy"])}
            fut = client.submit(compute_point, shipped, counts=counts, key=key, **kw)
        futures[fut.key] = (fut, p)
    failures, buffer, nparts = {}, [], 0
    bar = tqdm(total=len(todo), desc=f"sweep {name}", unit="pt", disable=not progress)

    def flush():
        nonlocal nparts
        if not buffer:
            return
        fname = (f"part-{buffer[0]['point_id']}.parquet" if batch == 1 and len(buffer) == 1
                 else f"part-{run_id[:8]}-{nparts:06d}.parquet")
        _write_part(directory, fname, buffer, LAYOUTS[kind])
        nparts += 1
        buffer.clear()

    try:
        for fut, result in as_completed([f for f, _ in futures.values()], with_results=True,
                                        raise_errors=False):
            _, p = futures.pop(fut.key)
            # A point's row is a dict; raise_errors=False hands an error over as exc_info
            # (or the exception). The future's status is no test: a worker killed after its
            # result was fetched turns a finished future back to pending.
            if not isinstance(result, dict):
                exc = result[1] if isinstance(result, tuple) and len(result) == 3 else result
                said = (_describe_decode(p) if kind == "decode" else
                        f"{_describe(p)} k_scale={p['k_scale']} seed={p['seed']}")
                failures[p["point_id"]] = f"{said}: {type(exc).__name__}: {exc}"
            else:
                buffer.append({**result, "sweep": name, "run_id": run_id})
                if len(buffer) >= batch:
                    flush()
            fut.release()
            bar.update()
    finally:
        flush()
        bar.close()
        if futures:  # interrupted: stop what has not run
            _quiet_closed_comms(True)
            client.cancel([f for f, _ in futures.values()])
    return failures
