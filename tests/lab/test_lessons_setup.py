"""``lessons.setup``: the lessons compute on one CPU thread, whatever started their kernel,
unless ``OMP_NUM_THREADS`` chooses; a GPU run is left alone."""

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



@pytest.mark.slow
def test_lesson_setup_keeps_jsonschemas_iri_grammar_out():
    """lessons.setup() keeps rfc3987_syntax (an IRI grammar built at import, seconds of CPU) out of
    the process, so a lesson's first figure (plotly -> nbformat -> jsonschema) does not build
    it; jsonschema still imports and validates."""
    import subprocess
    import sys

    code = ("import sys; from fa_lab.lab import lessons; lessons.setup(); import jsonschema; "
            "jsonschema.validate({'a': 1}, {'type': 'object'}, "
            "format_checker=jsonschema.FormatChecker()); "
            "assert sys.modules['rfc3987_syntax'] is None; print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
