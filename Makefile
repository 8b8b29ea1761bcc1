# The two commands: `make run` (embedded pipeline) and `make test` (whole suite).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
CONFIG ?= config/local.yaml
# PERFORMANCE.md: glibc trimming the heap after every large protobuf parse halves throughput.
export MALLOC_TRIM_THRESHOLD_ ?= 268435456

.PHONY: run test bench lint venv clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,dev]'
	touch $@

venv: $(BIN)/.installed

run: venv
	$(BIN)/spanprof run -c $(CONFIG)

test: venv
	$(BIN)/python -m pytest -q

bench: venv
	$(BIN)/python bench/bench_pipeline.py
	$(BIN)/python bench/bench_kafka.py
	$(BIN)/python bench/accuracy.py
	$(BIN)/python bench/bench_storage.py

lint: venv
	$(BIN)/ruff check pipeline processors tests bench
	$(BIN)/mypy pipeline processors

clean:
	rm -rf $(VENV) data .pytest_cache
