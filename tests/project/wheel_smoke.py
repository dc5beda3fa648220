"""What a user runs first, in a venv that holds the built wheel and torch alone
(``make test-wheel``): fa_lab imports from that venv, without JupyterLab, widgets or
plotly, and a model call matches the fp32 reference. Run with that venv's python, outside
the checkout; ``make test-wheel`` then runs ``fa-lab table`` and ``fa-lab attack`` there."""

import importlib.util
import sys
from pathlib import Path

import torch

import fa_lab
from fa_lab import metrics, reference

here = Path(sys.prefix).resolve()
assert here in Path(fa_lab.__file__).resolve().parents, (
    f"fa_lab imported from {fa_lab.__file__}, not from the wheel in {here}")
lab_only = [m for m in ("jupyterlab", "ipywidgets", "ipykernel", "plotly", "anywidget")
            if importlib.util.find_spec(m) is not None]
assert not lab_only, f"the core install pulled in the [lab] extra's {lab_only}"

g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 512, 2, 128, generator=g).to(torch.bfloat16) for _ in range(3))
out = fa_lab.flash_attn_func(q, k, v)
ref, _ = reference.attention(q, k, v)
err = float(metrics.rel_l2(out, ref))
assert torch.isfinite(out.float()).all() and err < 1e-2, err
print(f"fa_lab {fa_lab.__version__} from {Path(fa_lab.__file__).parent}, torch "
      f"{torch.__version__}: flash_attn_func [1, 512, 2, 128] bf16, rel-L2 {err:.2e} "
      f"against fp32; no {', '.join(('jupyterlab', 'ipywidgets', 'plotly'))}")
