"""Dashboards: sliders and dropdowns that rerun the kernels and redraw ``fa_lab.lab.viz``
figures.

Each dashboard is two layers:

* a plain ``compute_*_view(...)`` function of the widget values (``views``) that checks
  them, runs ``fa_lab.flash_attn_func`` / ``fa_lab.trace`` (backend ``auto``: the exact
  model on CPU, the Triton kernels on a GPU) and returns a dict of data and figures. It
  needs no browser and is what the tests call;
* the widget wiring (``dashboards``: ``rescale_dashboard``, ``fp8_dashboard``,
  ``compare_dashboard``; ``decode``: ``decode_dashboard``, the kernel picker and the paged
  decode's partitions and merge), which reads the controls, calls that function and copies the new
  figures into ``FigureWidget``s in place (``transport``). A dashboard shows plain figures
  until its first redraw and makes its ``FigureWidget``s then, so that a lesson saved
  before anything moved does not carry plotly's widget code once per figure.

``cache`` keeps inputs, references, outputs and traces by their parameters, so a move
reruns only what depends on it; ``latency.benchmark`` measures a dashboard's redraw.
"""

from .cache import clear_cache
from .views import (BF16_POLICIES, FP8_POLICIES, CPU_DEFAULTS, FP8_CPU_DEFAULTS, LEFT_WIDTH,
                    FIGURE_WIDTH, MAIN_HEIGHT, TAB_HEIGHT, HEAT_VALUES, compared, fix_of, variant,
                    view_threshold,
                    default_device, block_trace, LANE_FIGURES, wave_rows, compute_rescale_view,
                    compute_fp8_view, compute_compare_view)
from .transport import (figure_changes, assign_figure, DashboardFigure, FIGURE_SIZES, LANE_TABS,
                        DRAWN_WAIT_S)
from .dashboards import (Dashboard, LIVE_FIGURES_ENV, rescale_dashboard, first_bad_row,
                         fp8_dashboard, compare_dashboard)
from .latency import benchmark
from .decode import KERNELS, compute_decode_view, decode_dashboard

__all__ = ["clear_cache", "BF16_POLICIES", "FP8_POLICIES", "CPU_DEFAULTS", "FP8_CPU_DEFAULTS", "LEFT_WIDTH",
           "FIGURE_WIDTH", "MAIN_HEIGHT", "TAB_HEIGHT", "HEAT_VALUES", "compared", "fix_of", "variant", "view_threshold",
           "default_device", "block_trace", "LANE_FIGURES", "wave_rows", "compute_rescale_view",
           "compute_fp8_view", "compute_compare_view", "figure_changes", "assign_figure",
           "DashboardFigure", "FIGURE_SIZES", "LANE_TABS", "DRAWN_WAIT_S", "Dashboard", "LIVE_FIGURES_ENV",
           "rescale_dashboard", "first_bad_row", "fp8_dashboard", "compare_dashboard", "benchmark",
           "KERNELS", "compute_decode_view", "decode_dashboard"]
