# The README's commands. Each works on a fresh machine with only python3: it makes .venv first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: test test-deep demo lint format bench conformance mutation clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[test,bench]'
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/ruff check jaxkv tests examples benchmarks conformance
	rm -f .coverage .coverage.*
	$(BIN)/coverage run -m pytest -q
	$(BIN)/coverage combine -q
	$(BIN)/coverage report

# The property tests with thousands of examples: run before a change to the arithmetic lands.
test-deep: $(STAMP)
	HYPOTHESIS_PROFILE=deep $(BIN)/python -m pytest -q -p no:cacheprovider tests/test_stateful.py

demo: $(STAMP)
	$(BIN)/python examples/demo.py

lint: $(STAMP)
	$(BIN)/ruff check jaxkv tests examples benchmarks conformance
	$(BIN)/ruff format --check jaxkv tests examples benchmarks conformance

format: $(STAMP)
	$(BIN)/ruff format jaxkv tests examples benchmarks conformance
	$(BIN)/ruff check --fix jaxkv tests examples benchmarks conformance

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info .coverage .coverage.*

bench: $(STAMP)
	bash conformance/setup_mxnet.sh >/dev/null
	$(BIN)/python benchmarks/bench.py

# Differential tests against real Apache MXNet 1.9.1, installed in its own venv.
conformance: $(STAMP)
	bash conformance/setup_mxnet.sh
	$(BIN)/python conformance/harness.py --n 500

# Mutation tests (Cosmic Ray, in a venv of its own) of the store's arithmetic and checks; not
# part of `make test`. Takes about 35 minutes on 2 cores: see docs/testing.md.
# MUTATION_ARGS="--modules _ops,_state" runs only some modules; "--resume" continues a run;
# "--retest" runs the survivors again after tests were added.
MVENV := .venv-mutation
$(MVENV)/.installed: mutation/requirements.txt
	$(PYTHON) -m venv $(MVENV)
	$(MVENV)/bin/pip install -q -r mutation/requirements.txt
	touch $@

mutation: $(STAMP) $(MVENV)/.installed
	nice -n 10 $(MVENV)/bin/python mutation/run.py $(MUTATION_ARGS)
