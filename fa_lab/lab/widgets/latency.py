"""How long a dashboard takes to redraw after a control moves (``benchmark``)."""

from __future__ import annotations

import math
import statistics
import time


from .dashboards import Dashboard


def benchmark(dashboard: Dashboard, control: str, values, *, repeat: int = 1,
              clock=time.perf_counter) -> dict:
    """Move ``control`` through ``values`` (each a fresh setting, so nothing comes from the
    cache unless a value repeats) and time each redraw (compute + FigureWidget update).
    ``clock``: ``time.perf_counter`` (wall time, default) or ``time.process_time`` (CPU
    time of this process: with one torch thread, what the redraw costs on an idle core,
    whatever else the machine is running). Returns the median, min and max seconds and
    the individual times."""
    if control not in dashboard.controls:
        raise ValueError(f"control={control!r}; the dashboard has {sorted(dashboard.controls)}")
    times, figures = [], []
    w = dashboard.controls[control]
    for _ in range(repeat):
        for v in values:
            t0 = clock()
            w.value = v  # the observer redraws synchronously
            elapsed = clock() - t0
            if math.isnan(dashboard.last_seconds) or dashboard.last["params"].get(control) != \
                    dashboard.argument(control, v):
                raise RuntimeError(f"redraw failed for {control}={v!r}: {dashboard.summary.value}")
            times.append(elapsed)
            # the share until the main figure was sent (wall time), scaled to this clock
            share = dashboard.figures_seconds / dashboard.last_seconds
            figures.append(elapsed * min(1.0, share))
    return {"control": control, "median_s": statistics.median(times), "min_s": min(times),
            "max_s": max(times), "times_s": times,
            "figures_median_s": statistics.median(figures)}
