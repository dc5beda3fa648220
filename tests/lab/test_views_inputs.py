"""The dashboards' views on inputs they cannot run as asked (issue 36): a CUDA device on a
machine without one is a clear error naming ``device``; inputs that hold inf or NaN are
named in the summary, so no policy is blamed for them."""

import pytest
import torch

for _extra in ("plotly", "ipywidgets", "anywidget"):  # fa_lab.lab needs the [lab] extra
    pytest.importorskip(_extra, reason="fa_lab.lab needs the [lab] extra")

from fa_lab.lab import widgets  # noqa: E402
from fa_lab.lab.widgets import views  # noqa: E402


@pytest.mark.parametrize("make", [
    lambda: views.compute_rescale_view(8, device="cuda", S=256, H=1, figures=False),
    lambda: views.compute_fp8_view(5000.0, device="cuda:0", S=256, H=1, figures=False),
    lambda: views.compute_compare_view(8, device="cuda", S=256, H=1, figures=False),
    lambda: widgets.rescale_dashboard(k_scale=8, device="cuda", S=256, H=1),
])
def test_a_cuda_view_on_a_machine_without_one_names_device(monkeypatch, make):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"^device='cuda(:0)?' asks for a CUDA GPU and none is "
                                         r"available on this machine"):
        make()


def test_a_view_names_infinite_inputs_in_its_summary():
    """K x 1e39 overflows bf16: k holds inf, which the summary names (not the policy)."""
    view = views.compute_rescale_view(1e39, S=256, H=1, D=64, figures=False, with_trace=False)
    note = view["nonfinite_inputs"]
    assert note.startswith("k has ") and "inf) at (batch, key, head) (0, 0, 0)" in note
    assert "Inputs: k has" in view["summary"]
    clean = views.compute_rescale_view(8, S=256, H=1, D=64, figures=False, with_trace=False)
    assert clean["nonfinite_inputs"] is None and "Inputs:" not in clean["summary"]
