"""Sweeps over (policy × K scale × threshold × S × causal × dtype × H × seed × backend) on Dask.

    from fa_lab.studies import sweep
    grid = sweep.Grid({"policy": ["lazy", "lazy_unfixed"], "k_scale": [8, 16, 32],
                       "threshold": [4, 8], "S": [2048], "H": [4]})
    table = sweep.run(grid, name="bf16_cpu")        # a LocalCluster: 2 processes, 1 thread each
    table = sweep.load("bf16_cpu")                  # the tidy table, one row per point
    sweep.reference("bf16_seed_h200")               # one of the lab's reference sweeps

    fa-lab sweep GRID.yaml [--scheduler tcp://host:8786] [--name N] [--workers 2] [--out-dir D]

**A decode grid** (``kind: decode``, ``DecodeGrid``, ``fa-lab sweep --kind decode``) runs
the serving decode kernels (``pa_decode_tile``, ``pa_decode_swa``, ``mla_decode``) over
their own axes: upstream version, page size, partitions, query length, scale mode, window,
context and score spread; its points are checked by the kernels' entry points and its rows
(``DECODE_SCHEMA``) hold NaN rows, error and mass loss against fp64 and the safe region's
verdict (``decode_grid``, ``decode_point``; docs/sweeps.md). ``open_grid`` opens either kind.
Everything below holds for both kinds.

**The grid** is a product of named axes (``AXES``; ``seqlen``/``heads``/``batch``/
``head_dim`` are accepted for S/H/B/D). ``policy``, ``k_scale`` and ``S`` are required; the
others default to ``DEFAULTS``. A policy is a name, or any object that
``flash_attn_func(rescale=obj)`` takes (the table records ``getattr(p, "name", p)``).
Everything is checked before any task starts, and a bad grid raises ``GridError`` (a
ValueError) naming the axis: an unknown axis, an empty axis, a bad value, or a (policy,
dtype, backend) that fa_lab refuses. The check is fa_lab's own, with no work done:
``api.plan`` on uninitialised CPU tensors of each distinct call, then
``dispatch.plan`` (routing and the chosen kernel's capabilities: dtypes, head dims, the
policy's vote and rebase, Python rules); ``triton`` points are planned as ``interpret``,
the same kernels with the same capabilities on CPU tensors. A threshold on a policy that
has none (eager) is dropped and such points run once (``threshold_asked`` reads "n/a").

**Each point is one Dask task** (``client.submit``, collected with ``as_completed``), so
Dask reschedules the points of a worker that dies. Points that run on a GPU (``triton``
and ``fast`` by default, or ``device: cuda``) ask for the worker resource ``GPU=1``. With
``client=None`` the sweep starts a ``LocalCluster(n_workers=2, threads_per_worker=1,
processes=True)`` whose workers run one torch thread each (``OMP_NUM_THREADS=1`` in their
environment and a worker plugin calling ``torch.set_num_threads(1)``).

**A point** builds the seed's inputs for its seed (``experiments.bf16_inputs``: K =
round(N(0,1) * k_scale); ``experiments.fp8_inputs``: k = 0.1 k_scale N(0,1), V = ones,
quantised per tensor), runs its call as the grid's expansion planned it (the point
carries the family and resolved policy; ``api.plan_decided`` checks the arguments and the
backend's capabilities on the point's tensors and routes and resolves nothing again), as
``flash_attn_func(..., return_lse=True)`` would (bf16 on the emulator with a rescale
counter, as ``count_rescales``, so the counts come free), the fp32 reference, and
``compute_point`` returns one row:
NaN / inf / bad-row fractions, rel-L2 against fp32, the LSE state of the bad rows, rescale
counts, wall times and provenance (``SCHEMA`` lists every column).

**Results** are Parquet parts under ``<results folder>/atlas/<name>/`` (the results folder:
``out=``, ``$FA_LAB_RESULTS`` or ./fa_lab_results, as ``fa_lab.results``): one
``part-<point_id>.parquet`` per completed point (or per ``batch`` points), written by the
client as each task completes, to a temp file renamed into place, with the grid as run
beside them as ``_grid-<hash>.json`` (``pandas.read_parquet(folder)`` skips it). A rerun
skips the points whose rows exist; a killed sweep loses only the points in flight.
``load`` returns the pandas view and ``compact`` merges the parts into one file (for
committing a finished grid). The lab's reference sweeps (``data/atlas/<name>/``) are read
with ``reference(name)`` and listed by ``references()``; no run writes there unless
``out=`` names ``data/``.
"""

from .grid import (ROOT, ATLAS, REFERENCE_ATLAS_DIR, AXES, ALIASES, REQUIRED, DEFAULTS, DTYPES, BACKENDS,
                   GPU_BACKENDS, CPU_PROXY, DEVICES, BY_KV_LEN, VOLATILE, GridError,
                   SweepError, Grid, check_name)
from .kinds import KINDS, open_grid
from .point import FINITENESS_KEYS, COUNT_KEYS, compute_point
from .decode_grid import DecodeGrid
from .decode_point import compute_decode_point
from .store import (SCHEMA, DECODE_SCHEMA, sweep_dir, done_points, load, reference, references,
                    compact)
from .cluster import TorchThreads, WORKER_ENV, local_client, close_local, dashboard, run

__all__ = ["ROOT", "ATLAS", "REFERENCE_ATLAS_DIR", "AXES", "ALIASES", "REQUIRED", "DEFAULTS", "DTYPES", "BACKENDS",
           "GPU_BACKENDS", "CPU_PROXY", "DEVICES", "BY_KV_LEN", "VOLATILE", "GridError",
           "SweepError", "Grid", "check_name", "KINDS", "open_grid", "DecodeGrid",
           "compute_decode_point", "DECODE_SCHEMA", "FINITENESS_KEYS", "COUNT_KEYS", "compute_point",
           "SCHEMA", "sweep_dir", "done_points", "load", "reference", "references", "compact",
           "TorchThreads", "WORKER_ENV", "dashboard",
           "local_client", "close_local", "run"]
