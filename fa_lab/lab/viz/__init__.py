"""Figures of the lab (plotly): a trace's lanes and waves, outputs' non-finite maps, the
bug report's tables as curves, and PNG export.

- ``style``: the colours, symbols and fixed ranges every figure shares.
- ``tracedata``: a trace's values as tables (running max, deficit, labels, checks).
- ``heatmap``: the step-by-step heatmap of a wave and the ballot at one step.
- ``lanes``: one lane's running max, tile max, l and events over the steps; lanes compared.
- ``outputs``: what became of each row (NaN, inf, LSE) and outputs against a reference.
- ``tables``: the bug report's bf16 and fp8 tables as curves.
- ``training``: a training run's first non-finite step per policy and logit scale; the
  scores a run meets against the fixed max's edges.
- ``zoo``: the failure zoo's mechanism strips and a hazard's boundary against its formula.
- ``export``: static PNG export (kaleido).
"""

from .style import (TRACE_VALUES, LABEL_COLORS, OTHER_COLOR, IMPL_COLORS, POLICY_SYMBOLS, NONFINITE_COLOR,
                    FIXED_RANGES, EVENT_COLORS, policy_color, impl_color, policy_symbol)
from .tracedata import fmt_number, step_axis_title, deficit, trace_values, value_title
from .heatmap import running_max_heatmap, FP32_LOG2_MAX, wave_ballot
from .lanes import break_window, lane_lines, row_compare
from .outputs import (ROW_STATES, ROW_FATES, row_fates, nonfinite_map, lse_rows,
                      output_difference_rows)
from .tables import bf16_table_curves, fp8_table_curves
from .zoo import CELL_KINDS, QUANTITIES, boundary_curves, mechanism_strip
from .training import first_nonfinite_steps, score_growth
from .export import to_png

__all__ = ["TRACE_VALUES", "fmt_number", "LABEL_COLORS", "OTHER_COLOR", "IMPL_COLORS", "POLICY_SYMBOLS", "NONFINITE_COLOR", "FIXED_RANGES",
           "EVENT_COLORS", "policy_color", "impl_color", "policy_symbol", "step_axis_title",
           "deficit", "trace_values", "value_title", "running_max_heatmap", "FP32_LOG2_MAX",
           "wave_ballot", "break_window", "lane_lines", "row_compare", "ROW_STATES", "ROW_FATES",
           "row_fates", "nonfinite_map", "lse_rows", "output_difference_rows", "bf16_table_curves",
           "fp8_table_curves", "CELL_KINDS", "QUANTITIES", "boundary_curves", "mechanism_strip",
           "first_nonfinite_steps", "score_growth", "to_png"]
