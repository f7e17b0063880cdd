# make serve   - install the runtime into .venv (first time: no test tools) and serve the built-in
#                smollm2-135m-instruct on 127.0.0.1:50051
#                (MODEL=tiny-llama for the random test model, MODEL=/path/to/hf-dir for a checkpoint)
# make test    - add the test tools to .venv (first time; NVIDIA Dynamo too: make install-dynamo) and run the test suite
# make test-fast - the unit tier only (pytest -m unit: no process, no socket, <= 60 s): run it on every edit
#                  (tiers and folders: tests/README.md)
# make test-unit - the same as test-fast
# make bench   - the benchmarks under bench/ (tables on stdout, JSON under bench/results/)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=
MODEL ?= smollm2-135m-instruct

.PHONY: install install-dev install-dynamo serve test test-fast test-unit lint bench proto clean

# Two stamps, one venv: .installed is the runtime (pyproject.toml's dependencies: what `pagedkv serve` imports),
# .installed-dev adds the dev extra (pytest, hypothesis, ruff, the client libraries the tests drive) to the same
# venv, so `make test` after `make serve` installs only what is missing.
install: $(VENV)/.installed

install-dev: $(VENV)/.installed-dev

# torch is pinned to the CPU build that this project's machines carry; an unpinned torch pulls a CUDA build.
# xgrammar (structured outputs, executor_svc/grammar.py) goes in with --no-deps: its wheel requires triton (~1 GB,
# for its GPU kernels, which pagedkv never calls: it applies the bitmask itself), and xgrammar imports and works
# without it. Its real runtime dependencies (apache-tvm-ffi, pydantic; numpy, torch and transformers are there
# anyway) are in pyproject.toml's dependencies.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e .
	$(PY) -m pip install -q --no-deps xgrammar==0.2.9
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed pyproject.toml
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

# NVIDIA Dynamo, for `pagedkv dynamo-worker` and tests/e2e/test_dynamo_fleet.py: ai-dynamo and ai-dynamo-runtime go in
# with --no-deps: ai-dynamo requires aisimulate, a stub sdist whose install downloads its wheel from pypi.nvidia.com
# (not a package registry these machines reach), and only Dynamo's planner, profiler and simulator use it, never its
# frontend, KV router or dynamo.common.backend. Their other dependencies are pyproject.toml's dynamo extra (pydantic
# <= 2.13.5: the runtime's bound; every other package here takes it). They share .venv: pip check then misses only
# aisimulate (and xgrammar's triton). ~80 MB of wheels, ~310 MB installed.
install-dynamo: $(VENV)/.installed-dynamo

$(VENV)/.installed-dynamo: $(VENV)/.installed-dev
	$(PY) -m pip install -q -e '.[dev,dynamo]'
	$(PY) -m pip install -q --no-deps ai-dynamo==1.6.1 ai-dynamo-runtime==1.6.1
	touch $@

serve: install
	$(VENV)/bin/pagedkv serve --model $(MODEL) $(ARGS)

test: install-dev install-dynamo
	$(PY) -m pytest -q --durations=30 $(ARGS)

test-fast: install-dev
	$(PY) -m pytest -q -m unit $(ARGS)

test-unit: test-fast

lint: install-dev
	$(VENV)/bin/ruff check .

bench: install
	$(PY) bench/e2e_vs_hf.py $(ARGS)

proto: install-dev
	$(PY) -m pagedkv.proto_gen

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
