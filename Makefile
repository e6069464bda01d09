# The README's commands. Each works on a fresh machine with only python3: it makes .venv first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: test test-whole test-layouts test-deep test-oldest test-newest _test-newest wheel-check demo lint format bench \
	conformance mutation clean docs

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[test,bench,examples]'
	touch $(STAMP)

# Test runs use WORKERS processes (pytest-xdist; the multi-process tests start their own).
WORKERS ?= 2
XDIST   := -n $(WORKERS)
# The exhaustive variants of a test (marked deep: tests/_variants.py) run in make test-deep only;
# the variants every other target runs cover each value of each axis (most, each pair of them).
QUICK   := -m "not deep"

# make test: the suite but its costliest files (WHOLE_TESTS, and the tests marked whole), which
# make test-whole runs; CI runs both.
test: $(STAMP)
	$(BIN)/ruff check jaxkv tests examples benchmarks conformance
	$(BIN)/lint-imports --no-cache  # the layers of jaxkv/_src (pyproject.toml, [tool.importlinter])
	$(BIN)/mypy jaxkv
	rm -f .coverage .coverage.*
	$(BIN)/coverage run -m pytest -q $(XDIST) $(NOT_WHOLE)
	$(BIN)/coverage combine -q
	$(BIN)/coverage report

# The costliest files, each test a job of launched processes or a whole program: the
# multi-process stress test, the launcher's tests, multi-process checkpoints, the kill -9 matrix
# (7 launched jobs, 2 to 4 minutes; tests/test_checkpoint_manager.py, in make test, kills a job
# of 2 processes and resumes it too), split buckets, the flat store's own suite (make
# test-layouts runs flat stores), the GPT example, the demo and the notebooks; and the
# multi-process tests whose JAX calls test_dist.py (in make test) makes too (joining, gloo's
# sums, the launcher: one array per key in every layout), each ~1 minute: the default store over
# every process, compression and the flax example across processes, MXNet code's row-sparse,
# embedding and optimizer loops across processes, and the push's options through every path
# across processes (tests/test_push_parity.py runs them in one). With them, the tests marked
# whole (pyproject.toml) in the other files: a job of 2 processes killed and resumed (the kill -9
# matrix does more), a mask by path, a tree on the user's mesh and the flax example's script
# across processes, the lent arrays' costs.
WHOLE_TESTS := tests/test_dist_stress.py tests/test_dist_sums.py tests/test_launch.py \
	tests/test_launch_cause.py tests/test_launch_hang.py \
	tests/test_launch_hosts.py tests/test_launch_env.py tests/test_launch_output.py \
	tests/test_checkpoint_dist.py tests/test_kill_matrix.py \
	tests/test_split_buckets.py tests/test_flat_store.py tests/test_demo.py tests/test_notebook.py \
	tests/test_notebook_flax.py \
	tests/test_example_gpt.py tests/test_dist_loops.py \
	tests/test_dist_default.py tests/test_dist_compression.py tests/test_example_processes.py \
	tests/test_push_parity_dist.py
NOT_WHOLE := $(foreach f,$(WHOLE_TESTS),--ignore $(f)) -m "not deep and not whole"

test-whole: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider $(XDIST) $(QUICK) $(WHOLE_TESTS)
	$(BIN)/python -m pytest -q -p no:cacheprovider $(XDIST) -m "whole and not deep" \
	  $(foreach f,$(WHOLE_TESTS),--ignore $(f))

# The selection that test-layouts, test-oldest and test-newest run: make test's without the
# property tests against the NumPy model (the state machine, the rows and the per-key ones),
# still every module of jaxkv/_src exercised (tests/unit mirrors them). make test-deep runs
# everything on the oldest and newest JAX.
PROPERTY_TESTS := tests/test_stateful.py tests/test_rows.py tests/test_per_key.py
SELECTION  := $(foreach f,$(PROPERTY_TESTS),--ignore $(f)) $(NOT_WHOLE)
# What test-oldest and test-newest run: the selection (make test-deep: everything).
VERSIONS_SUITE ?= $(SELECTION)

# The suite again in the layouts the default run seldom makes, and with the public fallbacks:
# CI runs it after make test.
test-layouts: $(STAMP)
	@echo "== the selection (SELECTION) again with every private JAX name off"
	@echo "   (JAXKV_NO_FAST_PATHS=1), and every store in the per-key layout (JAXKV_LAYOUT=keys;"
	@echo "   the default, auto, makes the tests' small values flat on CPU). Not the launcher's own"
	@echo "   tests: the two-host ones need the private hook that binds gloo toward the"
	@echo "   coordinator, and the others run no store code"
	JAXKV_NO_FAST_PATHS=1 JAXKV_LAYOUT=keys $(BIN)/python -m pytest -q -p no:cacheprovider \
	  $(XDIST) $(SELECTION) \
	  --deselect tests/test_fast.py::test_the_public_fallbacks_give_the_same_results
	@echo "== the property model, the in-trace and training tests, the checkpoints and MXNet's"
	@echo "   own tests and tutorials with every store flat (JAXKV_LAYOUT=flat), big values too"
	JAXKV_LAYOUT=flat $(BIN)/python -m pytest -q -p no:cacheprovider $(XDIST) $(QUICK) $(FLAT_TESTS)

# What make test-layouts runs again with JAXKV_LAYOUT=flat.
FLAT_TESTS := tests/test_stateful.py tests/test_in_trace.py tests/test_in_trace_mixed.py \
	tests/test_training.py tests/test_block_updaters.py tests/test_checkpoint.py \
	tests/test_checkpoint_dist.py tests/test_mxnet_unittests.py tests/test_seeds.py \
	tests/test_sharded.py tests/test_mxnet_sparse_unittests.py tests/test_trees.py tests/test_mean.py

# The suite with the oldest JAX pyproject.toml claims: its "jax>=X.Y[.Z]" floor, pinned as
# jax==X.Y[.Z].* (and jaxlib; "0.8.1" pins jax==0.8.1.*), in a venv of its own.
OLDEST_JAX := $(shell sed -n 's/^ *"jax>=\([0-9.]*\)".*/\1/p' pyproject.toml)
OVENV := .venv-oldest
$(OVENV)/.installed: pyproject.toml
	@test -n "$(OLDEST_JAX)" || { echo 'no "jax>=X.Y" line in pyproject.toml'; exit 1; }
	$(PYTHON) -m venv --clear $(OVENV)
	echo '*' > $(OVENV)/.gitignore
	$(OVENV)/bin/pip install -q -e '.[test]' 'jax==$(OLDEST_JAX).*' 'jaxlib==$(OLDEST_JAX).*'
	touch $@

test-oldest: $(OVENV)/.installed
	@$(OVENV)/bin/python -c 'import jax; print("== JAX", jax.__version__, "(the oldest claimed)")'
	$(OVENV)/bin/python -m pytest -q -p no:cacheprovider $(XDIST) $(VERSIONS_SUITE)

# The suite with the newest JAX on the index, which needs Python >= 3.12: NEWEST_PYTHON if set,
# else the first of python3.14 .. python3.12 and python3 on PATH that runs and is >= 3.12, else
# the newest that pyenv installed. Without any, says so and succeeds; so too where the package
# indexes that pip reaches offer no jaxlib at all for that Python (asked three times, a minute
# apart: a registry out of reach or a mirror without it), quoting pip. Any other failure fails.
NVENV := .venv-newest
NEWEST_ASK_PAUSE ?= 60
test-newest:
	@py="$(NEWEST_PYTHON)"; \
	if [ -z "$$py" ]; then \
	  for p in $$(command -v python3.14 python3.13 python3.12 python3 2>/dev/null) \
	      $$(ls -d "$${PYENV_ROOT:-$$HOME/.pyenv}"/versions/3.*/bin/python3 2>/dev/null \
	         | sort -rV); do \
	    if "$$p" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then \
	      py=$$p; break; \
	    fi; \
	  done; \
	fi; \
	if [ -z "$$py" ]; then \
	  echo "test-newest: SKIPPED: no Python >= 3.12 on this machine (python3.12 or newer on"; \
	  echo "PATH, or under pyenv), and JAX 0.11+ needs one; NEWEST_PYTHON=... names one."; \
	  exit 0; \
	fi; \
	for try in 1 2 3; do \
	  asked=$$("$$py" -m pip index versions jaxlib 2>&1) && break; \
	  case "$$asked" in *"No matching distribution found for jaxlib"*) ;; *) break;; esac; \
	  [ $$try = 3 ] || { echo "test-newest: no jaxlib on the index for $$py; asking again in" \
	    "$(NEWEST_ASK_PAUSE) s"; sleep $(NEWEST_ASK_PAUSE); }; \
	done; \
	case "$$asked" in *"No matching distribution found for jaxlib"*) \
	  echo "test-newest: SKIPPED: the package indexes pip reaches offer no jaxlib for $$py"; \
	  echo "(asked three times, a minute apart); pip said:"; echo "$$asked" | sed 's/^/    /'; \
	  exit 0;; \
	esac; \
	$(MAKE) --no-print-directory _test-newest NEWEST_PYTHON="$$py"

$(NVENV)/.installed: pyproject.toml
	$(NEWEST_PYTHON) -m venv --clear $(NVENV)
	echo '*' > $(NVENV)/.gitignore
	$(NVENV)/bin/pip install -q -e '.[test,examples]'
	touch $@

_test-newest: $(NVENV)/.installed
	$(NVENV)/bin/pip install -q -U jax jaxlib
	@$(NVENV)/bin/python -c 'import jax, sys; print("== JAX", jax.__version__, "(the newest)")'
	$(NVENV)/bin/python -m pytest -q -p no:cacheprovider $(XDIST) $(VERSIONS_SUITE)

# Builds the sdist and wheel, installs the wheel (not editable) into a fresh venv in a temporary
# directory and runs the README's examples with it, outside the source tree.
wheel-check: $(STAMP)
	bash tools/wheel_check.sh $(BIN)/python

# The property tests with thousands of examples, the multi-process stress test with many long
# sequences of calls, and the launcher naming the first process to fail ten times over each way
# it fails: run before a change to the arithmetic, to collectives or to the launcher lands.
# Each stateful run draws its store's layout (auto, flat or keys), so both layouts are covered.
# Then every exhaustive variant (marked deep) that make test leaves out, and the whole suite with
# the oldest and the newest JAX (CI runs the selection with each).
DEEP_FILES := tests/test_stateful.py tests/test_dist_stress.py tests/test_dist_sums.py \
	tests/test_launch_cause.py
test-deep: $(STAMP)
	HYPOTHESIS_PROFILE=deep JAXKV_STRESS=deep $(BIN)/python -m pytest -q -p no:cacheprovider \
	  $(DEEP_FILES)
	$(BIN)/python -m pytest -q -p no:cacheprovider $(XDIST) -m deep \
	  $(foreach f,$(DEEP_FILES),--ignore $(f))
	$(MAKE) --no-print-directory test-oldest test-newest VERSIONS_SUITE=

demo: $(STAMP)
	$(BIN)/python examples/demo.py

# The HTML documentation, docs/_build/html: the README, the guides, the troubleshooting page and
# the API reference (autodoc over every public name; docs/conf.py). Offline: no intersphinx.
# -W: any warning fails (a broken link or reference, a docstring Sphinx cannot read); -E: every
# page is read again, so a warning of an unchanged page is not skipped.
DOCS_STAMP := $(VENV)/.docs-installed
$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(BIN)/pip install -q -e '.[docs]'
	touch $@

docs: $(DOCS_STAMP)
	$(BIN)/sphinx-build -E -W --keep-going -n -q -b html -d docs/_build/doctrees docs docs/_build/html
	@echo "== docs/_build/html/index.html"

lint: $(STAMP)
	$(BIN)/ruff check jaxkv tests examples benchmarks conformance
	$(BIN)/ruff format --check jaxkv tests examples benchmarks conformance
	$(BIN)/lint-imports --no-cache

format: $(STAMP)
	$(BIN)/ruff format jaxkv tests examples benchmarks conformance
	$(BIN)/ruff check --fix jaxkv tests examples benchmarks conformance

clean:
	rm -rf $(VENV) $(OVENV) $(NVENV) .venv-mxnet .pytest_cache .mypy_cache .hypothesis *.egg-info .coverage \
	  .coverage.* docs/_build

bench: $(STAMP)
	bash conformance/setup_mxnet.sh >/dev/null
	$(BIN)/python benchmarks/bench.py

# Differential tests against real Apache MXNet 1.9.1, installed in its own venv: MXNet records
# its optimizers, schedules and learning-rate changes again (the committed records must come out
# unchanged), jaxkv replays them, then random KVStore programs run through both.
RECORDS := conformance/record_optimizers.py conformance/record_schedules.py \
	conformance/record_lr_training.py $(sort $(wildcard conformance/record_opt_*.py)) \
	conformance/record_resume.py conformance/record_adam_rates.py conformance/record_casts.py
REPLAYS := tests/test_mx_optimizer.py tests/test_mx_lr_scheduler.py tests/test_mx_lr_training.py \
	$(sort $(wildcard tests/test_mx_opt_*.py)) tests/test_embedding_loop.py
# Every replay by default; CI, which has just run make test (the replays but their variants
# marked deep), sets REPLAYS_MARK='-m deep' to replay only those.
REPLAYS_MARK ?=
conformance: $(STAMP)
	bash conformance/setup_mxnet.sh
	set -e; for r in $(RECORDS); do echo "== $$r"; "$$(bash conformance/setup_mxnet.sh)" $$r; done
	git diff --exit-code --stat -- conformance/data || { echo "MXNet's records differ from \
	  the committed ones (git diff conformance/data)"; exit 1; }
	$(BIN)/python -m pytest -q -p no:cacheprovider $(XDIST) $(REPLAYS_MARK) $(REPLAYS)
	$(BIN)/python conformance/harness.py --n 500

# Mutation tests (Cosmic Ray, in a venv of its own) of the store's arithmetic and checks; not
# part of `make test`. Takes about 35 minutes on 2 cores: see docs/testing.md.
# MUTATION_ARGS="--modules core/ops,state/kvstate" runs only some modules; "--resume" continues a run;
# "--retest" runs the survivors again after tests were added.
MVENV := .venv-mutation
$(MVENV)/.installed: mutation/requirements.txt
	$(PYTHON) -m venv $(MVENV)
	$(MVENV)/bin/pip install -q -r mutation/requirements.txt
	touch $@

mutation: $(STAMP) $(MVENV)/.installed
	nice -n 10 $(MVENV)/bin/python mutation/run.py $(MUTATION_ARGS)
