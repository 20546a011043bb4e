# llm-streams developer commands. `make run` and `make test` work on a fresh machine
# with Python 3.11+ (and Java 17 + Maven for the tests' Apache Kafka broker).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: run test unit lint format bench schemas clean

$(BIN)/llm-streams: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

run: $(BIN)/llm-streams
	$(BIN)/llm-streams demo

# Both print the coverage of streams/ (the workers the tests start as subprocesses too):
# the files not fully covered, then the total.
test: $(BIN)/llm-streams
	$(BIN)/python -m pytest --cov --cov-report=term

unit: $(BIN)/llm-streams
	$(BIN)/python -m pytest tests/unit --cov --cov-report=term

lint: $(BIN)/llm-streams
	$(BIN)/ruff check streams tests bench deploy examples
	$(BIN)/ruff format --check streams tests bench deploy examples
	$(BIN)/mypy

format: $(BIN)/llm-streams
	$(BIN)/ruff format streams tests bench examples
	$(BIN)/ruff check --fix streams tests bench examples

bench: $(BIN)/llm-streams
	$(BIN)/python bench/pipeline_overhead.py

# The record contract's JSON Schemas, then the chart's copies of them (and its values schema).
schemas: $(BIN)/llm-streams
	$(BIN)/python -m streams.contract.records schemas
	$(BIN)/python deploy/helm/render.py

clean:
	rm -rf $(VENV) var .pytest_cache .mypy_cache .ruff_cache
