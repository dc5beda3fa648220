"""Shared test fixtures and markers.

GPU tests are marked ``gpu`` and skipped, with that reason, where no CUDA/ROCm device is
present; everything else runs on the CPU in CI. GPU tests that need the GPU to themselves
are also marked ``gpu_alone``: those that assert a ratio of measured GPU times (other
xdist workers' kernels would stretch a timed kernel by whatever runs beside it) and those
whose tensors fill much of the GPU's memory. With more than one pytest-xdist worker they
are skipped with that reason; ``make test-gpu`` runs them after the others, one at a time.
"""

import os

import pytest
import torch

HAS_GPU = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if not HAS_GPU:
        skip = pytest.mark.skip(reason="needs a CUDA/ROCm GPU (torch.cuda.is_available() is False)")
        marker = "gpu"
    elif int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:  # absent: no xdist
        skip = pytest.mark.skip(reason="times the GPU: needs it alone, not shared with other "
                                       "xdist workers (run without -n)")
        marker = "gpu_alone"
    else:
        return
    for item in items:
        if marker in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def release_gpu_memory(request):
    """After each GPU test, hand the memory torch's caching allocator keeps back to the
    device: ``make test-gpu`` shares one GPU between its xdist workers, so memory one worker
    no longer uses should not sit in its cache while another allocates or launches a kernel
    that reserves local (spill) memory. (CUDA contexts and those reservations themselves stay
    with each worker: the worker count bounds them.)"""
    yield
    if HAS_GPU and "gpu" in request.keywords:
        torch.cuda.empty_cache()


@pytest.fixture
def gen():
    g = torch.Generator()
    g.manual_seed(1234)
    return g


@pytest.fixture
def exact_dots():
    """For the test's duration the compiled faithful ports sum every dot exactly, as the
    models do (``fa_lab.kernels.exact_dots``): GPU tests that demand the model's exact
    NaN/inf masks use it; the tensor cores' own summation order is tested on its own."""
    from fa_lab.kernels import exact_dots as exact

    with exact():
        yield


@pytest.fixture(autouse=True, scope="session")
def scratch_results_folder(tmp_path_factory):
    """The tests' runs go to a scratch results folder (``$FA_LAB_RESULTS``) unless a test
    chooses one, so a test run writes nothing under the working directory; the tests of
    the default folder unset it in their own subprocesses."""
    from fa_lab import results

    old = os.environ.get(results.ENV_VAR)
    os.environ[results.ENV_VAR] = str(tmp_path_factory.mktemp("fa_lab_results"))
    yield
    if old is None:
        os.environ.pop(results.ENV_VAR, None)
    else:
        os.environ[results.ENV_VAR] = old
