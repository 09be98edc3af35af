# The three commands a newcomer needs: set up, run, test.
VENV ?= .venv
PY := $(VENV)/bin/python
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false

.PHONY: setup quickstart test test-fast repro

setup:  ## a virtual environment with everything installed (torch first: CPU build here, CUDA build on GPU hosts)
	python3 -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[dev]'
	$(PY) -m pipeline offline-plots

quickstart:  ## the whole pipeline on the bundled corpus, as a Prefect flow over dvc.yaml, in minutes on a CPU
	$(PY) -m pipeline quickstart

test:  ## lint, then the whole suite, as CI runs it (the 20 slowest listed, so a CI log shows where the time goes)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q --durations=20

test-fast:  ## everything but the tests marked slow (the whole flow, torchrun): under two minutes
	$(PY) -m pytest -q -m "not slow"

repro:  ## the pipeline with params.yaml as it stands, straight through DVC
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VENV)/bin/dvc repro
