"""How long a dashboard takes to redraw after a control moves.

    .venv/bin/python benchmarks/bench_widgets.py [--S 1024] [--H 1] [--moves 5] [--cpu-time]

Builds each dashboard at the given size, moves one control at a time through fresh values
(so nothing comes from the cache) and prints the median / min / max redraw time: the
compute callback plus the updates of the FigureWidgets on screen (the main figure and the
open tab), which is what the kernel does for a user who lets go of a slider. The browser's
share (messages, plotly's redraw) is measured by tests/lab/test_browser.py. Beside it, one plain forward of the same inputs, measured in the
same run, so that the ratio stays meaningful on a loaded machine. The target: a median
under 0.3 s on 2 CPU cores at the default size.

``--cpu-time`` runs torch on one thread and counts this process's CPU time instead of
wall time: what a redraw costs on one idle core, even while other work shares the machine
(on two idle cores it is at most that).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch

from fa_lab import flash_attn_func
from fa_lab.lab import widgets
from fa_lab.studies.experiments import bf16_inputs


def forward_seconds(S, H, D=128, repeat=5, clock=time.perf_counter) -> float:
    q, k, v = bf16_inputs(1, S, H, D, 32)
    flash_attn_func(q, k, v, causal=False)
    times = []
    for _ in range(repeat):
        t0 = clock()
        flash_attn_func(q, k, v, causal=False)
        times.append(clock() - t0)
    return statistics.median(times)


def run(S: int, H: int, moves: int, clock=time.perf_counter) -> list[dict]:
    rows = []
    fwd = forward_seconds(S, H, clock=clock)

    def report(name, r):
        r = dict(r, dashboard=name, forward_s=fwd, ratio=r["median_s"] / fwd)
        rows.append(r)
        print(f"{name:8s} {r['control']:12s} median {r['median_s'] * 1e3:7.1f} ms   "
              f"min {r['min_s'] * 1e3:7.1f}   max {r['max_s'] * 1e3:7.1f}   "
              f"= {r['ratio']:5.1f} forwards; main figure sent after "
              f"{r['figures_median_s'] * 1e3:6.1f} ms", flush=True)

    def bench(dash, control, values):
        return widgets.benchmark(dash, control, values, clock=clock)

    d = widgets.rescale_dashboard(S=S, H=H)
    k0 = d.controls["k_scale"].value
    report("bf16", bench(d, "k_scale", [k0 + 1 + i for i in range(moves)]))
    t0 = d.controls["threshold"].value
    report("bf16", bench(d, "threshold", [t0 - 0.5 * (i + 1) for i in range(moves)]))
    r0 = d.controls["row"].value
    report("bf16", bench(d, "row", [(r0 + 1 + 7 * i) % S for i in range(moves)]))
    n = d.controls["tile"].max + 1
    report("bf16", bench(d, "tile", [(d.controls["tile"].value + 1 + i) % n for i in range(moves)]))
    report("bf16", bench(d, "policy", ["lazy", "eager", "lazy_unfixed", "fa4_row", "lazy"][:moves]))

    f = widgets.fp8_dashboard(S=S, H=H)
    report("fp8", bench(f, "k_scale", [round(5000 * 1.1 ** (i + 1)) for i in range(moves)]))
    f.controls["policy"].value = "lazy_capped"  # the only policy with a rebase bound
    report("fp8", bench(f, "rebase_bound", [10 + i for i in range(moves)]))

    c = widgets.compare_dashboard(S=S, H=H)
    report("compare", bench(c, "k_scale", [40 + i for i in range(moves)]))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--S", type=int, default=widgets.CPU_DEFAULTS["S"])
    p.add_argument("--H", type=int, default=widgets.CPU_DEFAULTS["H"])
    p.add_argument("--moves", type=int, default=5)
    p.add_argument("--load", type=int, default=0,
                   help="CPU-bound processes to run beside the benchmark (busy loops)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's choice)")
    p.add_argument("--cpu-time", action="store_true",
                   help="one torch thread, CPU time of this process instead of wall time")
    a = p.parse_args(argv)
    clock = time.perf_counter
    if a.cpu_time:
        torch.set_num_threads(1)
        clock = time.process_time
    elif a.threads:
        torch.set_num_threads(a.threads)
    print(f"S={a.S} H={a.H} D=128, torch threads {torch.get_num_threads()}, "
          f"device {widgets.default_device()}, {'CPU' if a.cpu_time else 'wall'} time, "
          f"{a.load} CPU-bound processes beside")
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
               for _ in range(a.load)]
    try:
        run(a.S, a.H, a.moves, clock)
    finally:
        for b in burners:
            b.kill()
            b.wait()


if __name__ == "__main__":
    main()
