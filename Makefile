# Quick start: `make demo` renders sample_inputs/job.yaml to out/demo.mp4; `make test` runs the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# all: byte-compile the whole install once (below). lazy (.ci/run, whose venv lives for one run): no compile step;
# `make test` lets each process write the bytecode of what it imports, so only the modules a run imports (a small
# part of the install) are compiled, each once.
BYTECODE ?= all

.PHONY: setup demo test bench soak train eval clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torchaudio's wheel must match torch's build: pin the pair, then install the project. --no-compile, then
	# compileall on every core: pip byte-compiles the ~12,000 files it installs one after another. Bytecode is
	# written here because where PYTHONDONTWRITEBYTECODE is set (CI machines, containers) every process would
	# otherwise compile what it imports from source again. -qq, and its status ignored: a file that does not parse
	# under this Python (torch ships a 3.12-only test file) fails at import anyway. Timings: bench/results.md.
	$(PY) -m pip install -q --no-compile "torch==2.14.1" "torchaudio==2.11.0"
	$(PY) -m pip install -q --no-compile -e ".[test,service]"
	if [ "$(BYTECODE)" = all ]; then \
		$(PY) -m compileall -qq -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" avatar_cli || true; \
	fi
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	mkdir -p out
	$(VENV)/bin/avatar render sample_inputs/job.yaml -o out/demo.mp4 --force

# Two test processes (pytest-xdist): many tests wait on subprocesses, torch imports and rank rendezvous, so the
# CPU-bound ones overlap them; --durations names the slowest, to keep CI's 15 minutes in view. --dist loadgroup:
# as the default `load`, but the tests of one xdist_group (tests/test_plan.py's full-size budgets) run in one process.
# One torch thread per process (OMP_NUM_THREADS=1: the renders run in the test processes or inherit it): two test
# processes and their renders with a thread per core each ran 4+ threads on 2 cores (bench/results.md).
# PYTHONDONTWRITEBYTECODE emptied: a module imported without bytecode (BYTECODE=lazy) is compiled once, not in
# every process that imports it.
test: $(STAMP)
	PYTHONDONTWRITEBYTECODE= OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadgroup --durations=25

bench: $(STAMP)
	$(PY) bench/run.py

# 30 minutes of video with RSS sampled every 10 s (about 25 minutes on 2 cores); the plot needs matplotlib.
soak: $(STAMP)
	$(PY) -m pip install -q "matplotlib>=3.8"
	$(PY) bench/soak.py

# Train the shipped model from scratch (about 90 minutes on 2 CPU cores; resumable).
train: $(STAMP)
	$(VENV)/bin/avatar train --out avatar_cli/weights/mini --work train_work

eval: $(STAMP)
	$(VENV)/bin/avatar eval

clean:
	rm -rf out .pytest_cache
