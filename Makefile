# The two commands: `make run` (embedded pipeline) and `make test` (whole suite).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
CONFIG ?= config/local.yaml
# PERFORMANCE.md: glibc trimming the heap after every large protobuf parse halves throughput.
export MALLOC_TRIM_THRESHOLD_ ?= 268435456

.PHONY: run test bench fuzz faults lint venv clean chromium

# rustup's cargo, for the native trace path (pipeline/native, built by pip install)
export PATH := $(HOME)/.cargo/bin:$(PATH)
NATIVE := pipeline/native/Cargo.toml

$(BIN)/.installed: pyproject.toml $(NATIVE) $(wildcard pipeline/native/src/*.rs)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,dev]'
	touch $@

venv: $(BIN)/.installed

run: venv
	$(BIN)/spanprof run -c $(CONFIG)

# lint first: CI (.ci/run) runs this target. Two worker processes (a test file stays on
# one), then the tests marked serial alone: they compare profiles with the clients' clocks
TEST_WORKERS ?= 2
test: venv lint chromium
	cargo test -q --release --manifest-path $(NATIVE)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not serial"
	$(BIN)/python -m pytest -q -m serial

# the web UI's browser tests (tests/ui) and bench_ui drive Debian's Chromium
chromium:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
		{ echo "chromium missing: apt-get install -y chromium" >&2; exit 1; }

bench: venv chromium
	$(BIN)/python bench/bench_pipeline.py
	$(BIN)/python bench/bench_pipeline.py --no-queue
	$(BIN)/python bench/bench_pipeline.py --intake
	@# issue #16's two latency/memory figures: RSS at 10 k spans/s past the 60 s grace,
	@# and the acknowledgement p99 at half that load
	$(BIN)/python bench/bench_latency.py --seconds 60
	$(BIN)/python bench/bench_latency.py --seconds 60 --spans-per-s 5000 --samples-per-s 10000
	$(BIN)/python bench/bench_kafka.py
	$(BIN)/python bench/accuracy.py
	$(BIN)/python bench/bench_storage.py
	$(BIN)/python bench/bench_backfill.py
	$(BIN)/python bench/bench_security.py
	$(BIN)/python bench/bench_ui.py
	@# the gateway against the OpenTelemetry Collector, same load, one core each (last line:
	@# the cpu/span ratio); the harness lives beside the project on the team's machines
	@if [ -x ../shared/bench/collector/run ]; then SPANPROF_PYTHON=$(BIN)/python ../shared/bench/collector/run; \
	else echo "collector comparison: ../shared/bench/collector/run not found, skipped"; fi

# the long fuzz run (hypothesis profile "fuzz": >= 1 M inputs over every decoder and endpoint)
fuzz: venv
	SPANPROF_FUZZ=1 $(BIN)/python -m pytest -q tests/fuzz

# faults under load (disk full, ClickHouse down, SIGKILL, poison): acknowledged = stored = attributed
faults: venv
	$(BIN)/python bench/faults.py
	$(BIN)/python bench/faults.py --queue

lint: venv
	$(BIN)/ruff check pipeline processors tests bench
	cargo clippy -q --release --manifest-path $(NATIVE) -- -D warnings
	$(BIN)/mypy pipeline processors

clean:
	rm -rf $(VENV) data .pytest_cache
