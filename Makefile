# make setup | make test | make test-quick | make test-wheel | make test-triton-floor | make test-gpu
# make lab | make table | make strip | make screenshots | make docs | make docs-test | make docs-clean
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.fa_lab-installed

.PHONY: setup ci-venvs test test-quick test-wheel test-triton-floor test-gpu merge-gpu-record check-gpu-record lab table strip \
	screenshots clean docs docs-test docs-clean

setup: $(STAMP)

# torch is installed first and pinned: 2.13.0 resolves to the CPU wheel on the CI machine.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[dev,docs]"
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $@

# Idle OpenMP threads spin by default: on a small shared machine that doubles wall time.
# FA_LAB_SOLUTIONS=1: the lessons run with the reference answers to their exercises
# (fa_lab/lab/solutions.py; notebooks/conftest.py sets it too, for nbval run by hand).
# The browser test's timings go to a scratch file, so a test run leaves the checkout as it
# found it; run tests/lab/test_browser.py alone to record data/results/browser_redraw.json.
# TEST_WORKERS pytest-xdist workers (one per core of the 2-core CI machine), each test file
# on one worker (--dist loadfile: a module's fixtures are built once) and one OpenMP
# thread each; --durations lists the slowest tests, so the log shows where the time goes.
TEST_WORKERS ?= 2
XDIST := $(if $(filter-out 0 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile,)
test: setup
	OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 \
		FA_LAB_BROWSER_RESULTS="$${TMPDIR:-/tmp}/fa_lab-browser_redraw.json" \
		$(PY) -m pytest -q $(XDIST) --durations=30 tests
	OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 FA_LAB_SOLUTIONS=1 \
		$(PY) -m pytest -q $(XDIST) --durations=10 --nbval-lax notebooks -p no:cacheprovider
	$(MAKE) test-wheel
	$(MAKE) test-triton-floor

# The inner loop: every CPU test but those marked slow (tests over about a second on 2 cores).
test-quick: setup
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -p no:cacheprovider -m "not slow" tests

# The library as a user installs it: the wheel, built from this checkout, in a fresh venv
# beside the pinned CPU torch and nothing else (no [lab] extra: no JupyterLab, widgets or
# plotly; packages from the package index only), then what a user runs first, in a scratch
# folder outside the checkout: import, a model call (tests/project/wheel_smoke.py), fa-lab
# table at a small size and fa-lab attack, whose results land in that folder; fa-lab lab
# says which extra it needs.
# The venv with torch alone is a step of its own ($(WHEEL_TORCH), whose stamp says the venv
# holds torch and nothing else), so make -j builds it beside make setup (make ci-venvs);
# test-wheel takes the stamp away before the wheel goes in, so a venv that a failed run left
# with fa_lab in it is never taken for a fresh one, and clears everything else in
# WHEEL_DIR (an earlier wheel, earlier results) first.
WHEEL_DIR ?= $(if $(TMPDIR),$(TMPDIR),/tmp)/fa_lab-wheel
WHEEL_TORCH := $(WHEEL_DIR)/venv/.torch-only
WHEEL_RUN := cd $(WHEEL_DIR) && OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE FA_LAB_RESULTS=
$(WHEEL_TORCH): Makefile
	rm -rf $(WHEEL_DIR)/venv
	$(PYTHON) -m venv $(WHEEL_DIR)/venv
	$(WHEEL_DIR)/venv/bin/python -m pip install -q "torch==2.13.0"
	touch $@

test-wheel: setup $(WHEEL_TORCH)
	find $(WHEEL_DIR) -mindepth 1 -maxdepth 1 ! -name venv -exec rm -rf {} +
	rm $(WHEEL_TORCH)
	$(PY) -m pip wheel -q --no-deps --no-build-isolation -w $(WHEEL_DIR) .
	$(WHEEL_DIR)/venv/bin/python -m pip install -q $(WHEEL_DIR)/fa_lab-*.whl
	$(WHEEL_RUN) venv/bin/python $(CURDIR)/tests/project/wheel_smoke.py
	$(WHEEL_RUN) venv/bin/fa-lab table --which bf16 --S 512 --H 1
	$(WHEEL_RUN) venv/bin/fa-lab attack lazy_unfixed --budget 5
	test -s $(WHEEL_DIR)/fa_lab_results/table_bf16_cpu_S512_H1.json
	test -s $(WHEEL_DIR)/fa_lab_results/attack_lazy_unfixed.json
	$(WHEEL_RUN) venv/bin/fa-lab lab 2>&1 | grep -F "pip install 'fa_lab[lab]'"
	rm -rf $(WHEEL_DIR)

# The oldest Triton that pyproject.toml admits (the lent H200's version) beside the newest
# that .venv gets: the tests that compile kernels for sm_90 or run them on Triton's
# interpreter run again in a venv of their own with that Triton, so an API the older
# version lacks fails here and not on a GPU. Every kernel and every entry point into it
# (dense, split-K, varlen, fp8, V^T, the API's backends, the sm_90 builds) is reached by
# the tests kept here; FLOOR_DESELECT leaves out the bench's slow end-to-end runs, which
# time those same entry points through fa_lab.studies.bench (test_fast_kernels.py and
# test_swp_bf16_fast_features.py run each of them), and the sweep's tests (Dask's
# orchestration; their kernel calls go through flash_attn_func, as the API tests' do) are
# not listed, nor are the valid- and invalid-input properties (backend="emulator" only, and
# refusals before any work). Three slow tests are left out too: one that never reaches Triton
# (the #1020 check calls backend="emulator") and two whose every kernel
# specialization (the kernel and its constexpr arguments) faster tests kept here launch as
# well (the fast kernels' split-K policies, the API's fast backend on the interpreter); the
# measurement is in docs/performance.md.
TRITON_FLOOR := 3.6.0
FLOOR_VENV   ?= .venv-triton$(TRITON_FLOOR)
FLOOR_STAMP  := $(FLOOR_VENV)/.fa_lab-installed
FLOOR_TESTS  := tests/kernels/_triton tests/kernels/test_fast_kernels.py \
	tests/kernels/*/test_*_faithful*.py tests/kernels/*/test_*_fast*.py \
	tests/kernels/swp_bf16/test_swp_bf16_hopper.py tests/kernels/swp_bf16/test_swp_bf16_model_features.py \
	tests/studies/test_bench.py tests/api/test_api_routing.py \
	tests/api/test_api_errors.py tests/api/test_policy_backends.py tests/api/test_edge_inputs.py \
	tests/api/test_flydsl_compare.py tests/api/test_api_backend_masks.py tests/api/test_policies.py
FLOOR_DESELECT := $(addprefix --deselect tests/studies/test_bench.py::,\
	test_split_k_runners_on_the_interpreter \
	test_run_times_split_k_and_varlen_beside_dense_end_to_end \
	test_run_checks_the_fast_kernels_against_fp32_on_the_interpreter) \
	$(addprefix --deselect ,tests/api/test_policies.py::test_pr1020_normalisation_holds_with_defaults \
	tests/kernels/swp_bf16/test_swp_bf16_fast_features.py::test_split_k_policy_semantics \
	tests/kernels/test_fast_kernels.py::test_api_fast_backend_runs_the_fast_kernels_interpreted)

# Two steps: $(FLOOR_BASE), torch, Triton, the test runner and fa_lab's dependencies (read
# from pyproject.toml, one a line, into pip's standard input), writes nothing in the
# checkout, so make -j builds it beside make setup (make ci-venvs); $(FLOOR_STAMP), which
# waits for make setup (both write fa_lab.egg-info here), then installs fa_lab itself
# (editable) and finds its dependencies there. A python without tomllib (3.10) gives an
# empty list: $(FLOOR_STAMP) installs them instead.
FLOOR_BASE := $(FLOOR_VENV)/.torch-installed
PROJECT_DEPS := import sys; sys.version_info < (3, 11) and sys.exit(); import tomllib; \
	print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))
$(FLOOR_BASE): pyproject.toml Makefile
	$(PYTHON) -m venv $(FLOOR_VENV)
	$(PYTHON) -c '$(PROJECT_DEPS)' | $(FLOOR_VENV)/bin/python -m pip install -q "torch==2.13.0" \
		"triton==$(TRITON_FLOOR)" pytest pytest-xdist hypothesis -r /dev/stdin
	touch $@

$(FLOOR_STAMP): $(FLOOR_BASE) pyproject.toml Makefile
	$(FLOOR_VENV)/bin/python -m pip install -q -e . "triton==$(TRITON_FLOOR)" pytest pytest-xdist \
		hypothesis
	touch $@

test-triton-floor: $(FLOOR_STAMP)
	OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 $(FLOOR_VENV)/bin/python -m pytest -q \
		$(XDIST) -p no:cacheprovider $(FLOOR_TESTS) $(FLOOR_DESELECT)

# .ci/run's first step, make -j 3 ci-venvs: make setup's venv, the wheel venv's torch, and
# the floor venv's torch, Triton and fa_lab's dependencies, installed at once. A pip install
# runs on one core, so one after the other they leave the second core of the 2-core CI
# machine idle; of the three only make setup writes in the checkout (fa_lab.egg-info), and
# make -j fails when any of them fails.
ci-venvs: setup $(FLOOR_BASE) $(WHEEL_TORCH)

# make test-gpu: every GPU-marked test on this machine's GPU, then the record of the run
# (tests/gpu_record.py): the shared tests with GPU_WORKERS xdist workers, the gpu_alone ones
# alone after them. It runs the machine's own python3 (GPU_PYTHON), whose torch has CUDA:
# make setup's venv pins the CPU build. RECORD chooses where the record goes (default
# fa_lab_results/gpu_record.json); the lab's committed record is GPU_RECORD, and
# make check-gpu-record says whether it vouches for HEAD's fa_lab/, kernels/ and tests/.
# Where one sitting is too short, GPU_SHARD=I/N runs the I-th of N shards, and
# make merge-gpu-record PARTS="p1.json p2.json" joins the N shard records into RECORD.
GPU_PYTHON  ?= python3
GPU_WORKERS ?= 8
GPU_RECORD  ?= data/results/gpu_record.json

test-gpu:
	OMP_WAIT_POLICY=PASSIVE $(GPU_PYTHON) tests/gpu_record.py --workers $(GPU_WORKERS) \
		$(if $(RECORD),--record $(RECORD)) $(if $(GPU_SHARD),--shard $(GPU_SHARD))

merge-gpu-record:
	$(PYTHON) tests/gpu_record.py --merge $(PARTS) --record $(or $(RECORD),$(GPU_RECORD))

check-gpu-record:
	$(PYTHON) tests/gpu_record.py --check $(GPU_RECORD)

# make lab: JupyterLab on notebooks/.
# * --allow-root is added when running as root (containers, CI machines); LAB_FLAGS adds to
#   the defaults, e.g. make lab LAB_FLAGS="--port 8899 --no-browser".
# * One OpenMP thread that sleeps when idle: on a small shared machine spinning OpenMP
#   threads multiply a dashboard's redraw time (benchmarks/bench_widgets.py, --load 1).
# * .jupyter/ joins Jupyter's config path: saving a lesson from the lab strips its outputs,
#   so autosave never dirties the tracked notebooks.
LAB_DEFAULTS := $(if $(filter 0,$(shell id -u)),--allow-root,)
LAB_FLAGS ?=
LAB_ENV := OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 \
	JUPYTER_CONFIG_PATH="$(CURDIR)/.jupyter$(if $(JUPYTER_CONFIG_PATH),:$(JUPYTER_CONFIG_PATH))"

lab: setup
	$(LAB_ENV) $(VENV)/bin/jupyter lab $(LAB_DEFAULTS) $(LAB_FLAGS) notebooks/

table: setup
	$(VENV)/bin/fa-lab table

# Outputs, execution counts and widget state out of every lesson; cell ids kept.
strip:
	@$(PY) -m nbstripout --version >/dev/null 2>&1 || { \
		echo "make strip needs nbstripout: $(PY) -m pip install nbstripout" >&2; exit 1; }
	$(PY) -m nbstripout --keep-id notebooks/*.ipynb

# The dashboards in headless Chromium at 1600x1000 (tests/lab/test_browser.py), saved to
# docs/img/ for the README; needs Debian's chromium.
screenshots: setup
	FA_LAB_SCREENSHOT_DIR=docs/img OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q tests/lab/test_browser.py

# make docs: the site in _build/html (open _build/html/index.html) from README.md, docs/*.md,
# the lessons (executed once, their outputs cached in _build/jupyter_cache-*; a change to
# fa_lab/, kernels/ or data/ starts a fresh cache) and the docstrings (docs/api.md).
# -W --keep-going: every warning fails the build, all of them listed; -n: every
# cross-reference must resolve. The page JavaScript that Sphinx would load from a CDN comes
# from the npm registry once, into _build/vendor-js/ (npm pack: no node_modules, no lock
# file): MathJax 3 for the math, and plotly.js's cartesian bundle (scatter, bar, heatmap:
# the traces the lab draws; a third of the full plotly.js) at the version the installed
# plotly bundles. The lessons' dashboards become static HTML (docs/widget_snapshot.py), so
# no widget runtime is fetched. The built site needs no network.
DOCS_OUT  := _build/html
VENDOR    := _build/vendor-js
VENDOR_OK := _build/vendor-js.stamp
MATHJAX      := 3.2.2
# DOCS_JOBS Sphinx processes (-j): each reads its share of the pages, so on the 2-core CI
# machine two lessons execute at once (jupyter-cache takes both into its one cache); one
# OpenMP thread per lesson kernel, as in make test.
DOCS_JOBS ?= 2
DOCS_ENV  := OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1

$(VENDOR_OK): Makefile $(STAMP)
	rm -rf $(VENDOR) && mkdir -p $(VENDOR)/npm $(VENDOR)/mathjax/output/chtml/fonts
	cd $(VENDOR)/npm && npm pack --silent mathjax@$(MATHJAX) plotly.js-cartesian-dist-min@$$($(abspath $(PY)) \
		-c "from plotly.offline import get_plotlyjs_version as v; print(v())") >/dev/null
	cd $(VENDOR)/npm && for t in *.tgz; do mkdir $${t%.tgz} && tar -xzf $$t -C $${t%.tgz}; done
	cp $(VENDOR)/npm/mathjax-$(MATHJAX)/package/es5/tex-chtml-full.js $(VENDOR)/mathjax/
	cp -r $(VENDOR)/npm/mathjax-$(MATHJAX)/package/es5/output/chtml/fonts/woff-v2 \
		$(VENDOR)/mathjax/output/chtml/fonts/
	cp $(VENDOR)/npm/plotly.js-cartesian-dist-min-*/package/plotly-cartesian.min.js $(VENDOR)/
	rm -rf $(VENDOR)/npm
	touch $@

# -E: every page is read again each time (the lessons' outputs come from the cache), so a
# second build reports every warning the first did, not only those of changed pages.
# autosummary never deletes a stub: docs/generated/ is rebuilt each time from docs/api.md.
docs: setup $(VENDOR_OK)
	rm -rf docs/generated
	$(DOCS_ENV) $(PY) -m sphinx -W --keep-going -n -q -E -b html -c docs -j $(DOCS_JOBS) \
		-d _build/doctrees . $(DOCS_OUT)

# The built site in headless Chromium, offline (tests/project/test_docs_site.py), its tests
# spread over TEST_WORKERS workers test by test (--dist worksteal): two of them visit every
# lesson, and each worker opens its own browser on the site.
docs-test: docs
	$(PY) -m pytest -q -p no:cacheprovider $(if $(filter-out 0 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) \
		--dist worksteal,) tests/project/test_docs_site.py

docs-clean:
	rm -rf _build docs/generated

clean:
	rm -rf $(VENV) .venv-triton*/ .pytest_cache
