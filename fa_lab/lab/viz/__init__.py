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
- ``decode``: the paged decode's partitions, their (max, sum) and the merge's weights.
- ``export``: static PNG export (kaleido).

Each figure is reached through its module (``viz.heatmap.running_max_heatmap``); the
package names its modules and re-exports none of their contents.
"""

from . import decode, export, heatmap, lanes, outputs, style, tables, tracedata, training, zoo

__all__ = ["style", "tracedata", "heatmap", "lanes", "outputs", "tables", "training", "zoo",
           "decode", "export"]
