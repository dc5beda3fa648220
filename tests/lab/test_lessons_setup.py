"""``lessons.setup``: the lessons compute on one CPU thread, whatever started their kernel,
unless ``OMP_NUM_THREADS`` chooses; a GPU run is left alone. And what importing ``fa_lab.lab``
does for a lesson kernel's start (the grammar jsonschema would import)."""

import pytest
import torch

for _extra in ("plotly", "ipywidgets", "anywidget"):  # fa_lab.lab needs the [lab] extra
    pytest.importorskip(_extra, reason="fa_lab.lab needs the [lab] extra")

from fa_lab.lab import lessons  # noqa: E402


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_one_thread_on_the_cpu(threads, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert lessons.setup(device="cpu") == ("cpu", False)
    assert torch.get_num_threads() == 1


def test_omp_num_threads_chooses(threads, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    lessons.setup(device="cpu")
    assert torch.get_num_threads() == 2


def test_a_gpu_run_keeps_its_threads(threads, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    lessons.setup(device="cuda")
    assert torch.get_num_threads() == 2


def test_the_lab_keeps_jsonschema_from_the_iri_grammar(monkeypatch):
    """fa_lab.lab marks rfc3987_syntax absent while jsonschema is not in yet (then jsonschema
    skips its two "iri" formats, as without the package), and leaves things alone after;
    nbformat still validates a notebook and plotly still renders one."""
    import sys

    import nbformat
    import plotly.graph_objects as go
    import plotly.io as pio

    import fa_lab.lab as lab

    monkeypatch.delitem(sys.modules, "jsonschema", raising=False)
    monkeypatch.delitem(sys.modules, "rfc3987_syntax", raising=False)
    lab._skip_iri_grammar()
    assert sys.modules["rfc3987_syntax"] is None
    monkeypatch.setitem(sys.modules, "jsonschema", object())
    monkeypatch.delitem(sys.modules, "rfc3987_syntax")
    lab._skip_iri_grammar()
    assert "rfc3987_syntax" not in sys.modules
    monkeypatch.undo()
    nbformat.validate(nbformat.v4.new_notebook())
    assert "text/html" in pio.renderers["notebook_connected"].to_mimebundle(go.Figure().to_dict())
