VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# pytest-xdist workers: one per core (at most 8); WORKERS=0 runs the suite in one process
WORKERS ?= auto
XDIST := -n $(WORKERS) --maxprocesses=8

.PHONY: demo test test-fast lint bench clean

$(PY):
	python3 -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[torch,hf,trainers,dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m slackswap.demo

test: $(STAMP)
	$(PY) -m pytest $(XDIST)

test-fast: $(STAMP)
	$(PY) -m pytest $(XDIST) -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) benchmarks/paper_table.py --budgets 0.2,0.3,0.4,0.5,0.6 --time-limit 60 --json benchmarks/results/paper_table.json --results

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
