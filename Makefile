# Two commands on a fresh machine:  make demo   and   make test
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint docs check bench soak clean

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

## ruff, mypy --strict and the import-layer contract (import-linter, pyproject.toml).
lint: $(STAMP)
	$(BIN)/ruff check src tests examples benchmarks
	$(BIN)/mypy
	$(BIN)/lint-imports

## The documentation site (MkDocs, API reference from the docstrings); --strict fails
## on a broken link or a reference that does not resolve. Output in build/site.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

check: lint docs test

## Reliability soak: >= 100,000 generated schedules (every checker and guard under
## duplicates, reordering, lost acks, crashes, store errors); prints the totals per
## combination. Long: run it on purpose, not in CI (CI runs the `ci` profile).
## `make soak SOAK=quick` checks the target itself in seconds.
SOAK ?= soak
soak: $(STAMP)
	MSGPATTERNS_SOAK=$(SOAK) $(BIN)/python -m pytest -q -p no:cacheprovider --timeout=0 \
		tests/reliability/test_reliability_schedules.py $(PYTEST_ARGS)

## Benchmarks print ratios against a baseline measured in the same run.
bench: $(STAMP)
	for b in benchmarks/bench_*.py; do $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
