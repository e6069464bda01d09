"""The tests of placement under other default bounds (``JAXKV_BIGARRAY_BOUND``): a test that
assumes a value is split gives its store the bound it assumes (``_devices.SPLIT_BOUND``), and
one about the default asks the store's placement policy (``state.placement``), so that moving
the default breaks no test (those about the default's number set it themselves). In ``make
test-deep``: each bound is a run of ~35 test files."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# The tests that place values: sharded storage, split buckets, pushes inside the user's step,
# meshes of several axes, rows of a sharded table, checkpoints of split values.
FILES = [
    "tests/test_block_updaters.py",
    "tests/test_compression.py",
    "tests/test_edges_checkpoint.py",
    "tests/test_edges_placement.py",
    "tests/test_edges_layout.py",
    "tests/test_edges_outs.py",
    "tests/test_edges_pull.py",
    "tests/test_embedding_loop.py",
    "tests/test_flat_store.py",
    "tests/test_in_trace.py",
    "tests/test_in_trace_mixed.py",
    "tests/test_mean.py",
    "tests/test_mesh_axes.py",
    "tests/test_mesh_mixed_keys.py",
    "tests/test_mesh_sums.py",
    "tests/test_ops.py",
    "tests/test_optax_trees.py",
    "tests/test_padded_split.py",
    "tests/test_profiler.py",
    "tests/test_push_parity.py",
    "tests/test_rows.py",
    "tests/test_rows_updaters.py",
    "tests/test_sharded.py",
    "tests/test_split_buckets.py",
    "tests/test_sums.py",
    "tests/test_trees.py",
    "tests/test_updater_errors.py",
    "tests/test_user_mesh.py",
    "tests/test_checkpoint_manager.py",
    "tests/test_checkpoint_damage.py",
    "tests/unit/state",
    "tests/unit/core",
    "tests/unit/rows",
]


@pytest.mark.deep
@pytest.mark.parametrize("bound", ["65536", "4096"])
def test_the_tests_of_placement_pass_under_another_default_bound(bound):
    env = dict(os.environ, JAXKV_BIGARRAY_BOUND=bound)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not deep", *FILES],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout
