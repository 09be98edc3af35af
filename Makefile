# The three commands a newcomer needs: set up, run, test.
VENV ?= .venv
TORCH ?= torch==2.13.0
# the interpreter `make setup` and `make lock` make their environments with (Python 3.11 or newer)
PYTHON ?= python3
PY := $(VENV)/bin/python
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false

.PHONY: setup lock quickstart test-data test test-fast repro gpu-carry

setup:  ## a virtual environment of requirements.lock's exact versions (torch first: its CPU build here, CUDA on GPU hosts),
        ## byte-compiled at install: where PYTHONDONTWRITEBYTECODE is set (as in CI here), a module left uncompiled is
        ## compiled anew by every process that imports it (the train stage's imports: 16.3 s against 6.7 on 2 cores)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install $(TORCH)
	$(PY) -m pip install -r requirements.lock
	$(PY) -m pip install --no-deps -e '.[dev]'
	$(PY) -m pipeline offline-plots

lock:  ## requirements.lock anew: the newest versions pyproject.toml admits, resolved in a fresh environment
	rm -rf .lock-venv && $(PYTHON) -m venv .lock-venv
	.lock-venv/bin/python -m pip install $(TORCH)
	.lock-venv/bin/python -m pip install '.[dev]'
	{ echo "# Exact versions of everything but torch ($(TORCH), installed first), written by \`make lock\`."; \
	  .lock-venv/bin/python -m pip freeze --exclude torch --exclude attention-pipeline; } > requirements.lock.tmp
	mv requirements.lock.tmp requirements.lock && rm -rf .lock-venv

quickstart:  ## the whole pipeline on the bundled corpus, as a Prefect flow over dvc.yaml, in minutes on a CPU
            ## (ARGS: overrides, e.g. ARGS="-S train.max_steps=400")
	$(PY) -m pipeline quickstart $(ARGS)

test-data:  ## the real text the tests read (WMT14 test sets and samples, Multi30k; about 50 MB), fetched from its
            ## public repositories, pinned by commit and checked by sha256, into .test-data (none needed where ../shared/data is)
	$(PY) -m corpora.shared

# The modules that run the whole pipeline on one shared copy of the project, in name order (tests/conftest.py: repo)
CHAIN := $(sort $(wildcard tests/test_pipeline*.py))

test:  ## lint, then the whole suite, as CI runs it: CHAIN and the rest side by side, one thread each (a process
       ## mostly waits on subprocess start-ups, so one alone keeps about one core busy; two threads each would
       ## oversubscribe 2 cores); each lists its 10 slowest, so a CI log shows where the time goes
	$(VENV)/bin/ruff check .
	@log=$$(mktemp); \
	OMP_NUM_THREADS=1 $(PY) -m pytest -q --durations=10 $(CHAIN) >$$log 2>&1 & chain=$$!; \
	trap 'kill $$chain 2>/dev/null' INT TERM; \
	OMP_NUM_THREADS=1 $(PY) -m pytest -q --durations=10 $(addprefix --ignore=,$(CHAIN)); rest=$$?; \
	wait $$chain; ok=$$?; echo "== the pipeline modules, $(CHAIN):"; cat $$log; rm -f $$log; \
	test $$rest -eq 0 -a $$ok -eq 0

test-fast:  ## everything but the tests marked slow (the whole flow, torchrun): under two minutes
	$(PY) -m pytest -q -m "not slow"

repro:  ## the pipeline with params.yaml as it stands, straight through DVC
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VENV)/bin/dvc repro

gpu-carry:  ## what bench/gpu/check.sh needs on a GPU machine beyond the checkout, to carry there: .whl, the clean stage's
            ## sacremoses (requirements.lock's) as a wheel; .test-data, the text its parts read (../shared/data's, else fetched)
	@pin=$$(grep -i '^sacremoses==' requirements.lock) || { echo "gpu-carry: requirements.lock pins no sacremoses" >&2; exit 1; }; \
	rm -rf .whl && $(PY) -m pip download -q --no-deps --only-binary=:all: -d .whl "$$pin"
	@if [ -d ../shared/data ]; then \
	  rm -rf .test-data && mkdir -p .test-data/wmt14 && \
	  cp -r ../shared/data/wmt14/train-sample ../shared/data/wmt14/newstest2013 ../shared/data/wmt14/newstest2014-full \
	    .test-data/wmt14/ && cp -r ../shared/data/multi30k .test-data/; \
	else $(PY) -m corpora.shared --out .test-data; fi
	du -sh .whl .test-data
