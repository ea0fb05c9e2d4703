# Two commands on a fresh machine:  make demo   and   make test
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint check bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[all,dev]'
	touch $(STAMP)

## Run the demo pipeline on embedded defaults (in-memory broker, SQLite).
demo: $(STAMP)
	$(BIN)/msgpatterns demo $(ARGS)

## Run the whole test suite (services marked tests skip when unreachable, unless
## MSGPATTERNS_REQUIRE_SERVICES=1).
test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

## ruff and mypy --strict.
lint: $(STAMP)
	$(BIN)/ruff check src tests examples benchmarks
	$(BIN)/mypy

check: lint test

## Benchmarks print ratios against a baseline measured in the same run.
bench: $(STAMP)
	for b in benchmarks/bench_*.py; do $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
