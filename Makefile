# make setup | make test | make lab | make table | make strip
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.fa_lab-installed

.PHONY: setup test lab table strip clean

setup: $(STAMP)

# torch is installed first and pinned: 2.13.0 resolves to the CPU wheel on the CI machine.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $@

# Idle OpenMP threads spin by default: on a small shared machine that doubles wall time.
test: setup
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q tests
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q --nbval-lax notebooks -p no:cacheprovider

# Jupyter refuses to run as root without --allow-root (containers, CI machines).
LAB_FLAGS ?= $(if $(filter 0,$(shell id -u)),--allow-root,)

lab: setup
	$(VENV)/bin/jupyter lab $(LAB_FLAGS) notebooks/

table: setup
	$(VENV)/bin/fa-lab table

strip:
	$(PY) -m nbstripout notebooks/*.ipynb 2>/dev/null || $(PY) scripts/strip_notebooks.py notebooks/*.ipynb

clean:
	rm -rf $(VENV) .pytest_cache
