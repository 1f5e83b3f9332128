VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(PY):
	python3 -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[torch,hf,dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m slackswap.demo

test: $(STAMP)
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks

bench: $(STAMP)
	$(PY) benchmarks/paper_table.py --json benchmarks/results/paper_table.json

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
