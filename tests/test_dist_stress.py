"""Many processes calling one ``dist_sync`` store with no waits between calls: 2 and 3
processes run the same seeded random sequence of ``init``, ``push``, ``pull``, ``pushpull``,
``set_optimizer``, ``save``, ``load``, ``barrier`` and ``row_sparse_pull``
(tests/dist/stress_job.py) and check every value against a NumPy model. Values are whole or
split across the processes.

Each process's collectives must run in one order in every process: a push still summing across
processes when the next call's broadcast or all-gather starts made gloo abort ("Received data
size doesn't match expected size") or hang. ``JAXKV_STRESS=deep`` (``make test-deep``) runs
many more seeds and calls; ``JAXKV_STRESS_SEEDS`` / ``JAXKV_STRESS_OPS`` set them directly.
"""

import os

import pytest
from _jobs import launch
from _variants import covering

pytest.importorskip("orbax.checkpoint")

DEEP = os.environ.get("JAXKV_STRESS") == "deep"
SEEDS = int(os.environ.get("JAXKV_STRESS_SEEDS") or (8 if DEEP else 1))
OPS = int(os.environ.get("JAXKV_STRESS_OPS") or (300 if DEEP else 60))
BOUND = "12"  # elements: the keys "a" and "e" are then split across the processes


# make test-whole: 2 processes with values whole, 3 with big values split; make test-deep: every
# seed, process count and way.
@pytest.mark.parametrize(
    ("seed", "n", "way"), covering(range(SEEDS), [2, 3], ["whole", "split"], strength=1)
)
def test_a_random_sequence_of_calls_gives_the_models_values(tmp_path, seed, n, way):
    split = way == "split"
    seed = 1000 * n + 2 * seed + split + 2  # another sequence for each case
    args = [str(seed), str(OPS), str(tmp_path)] + ([BOUND] if split else [])
    run = launch(n, "stress_job.py", *args, timeout=120 + 2 * OPS)
    assert run.returncode == 0, f"stress_job.py {' '.join(args)}:\n{run.stdout}{run.stderr}"
    # "[RANK] rank RANK ok ...": the launcher's prefix, then the job's line.
    lines = [line.split()[1:] for line in run.stdout.splitlines() if " ok " in line]
    assert sorted(int(line[1]) for line in lines) == list(range(n)), run.stdout + run.stderr
    # Every process ran the same calls and checked as many values.
    assert len({tuple(line[2:]) for line in lines}) == 1, run.stdout
    assert int(lines[0][5]) > 0 and int(lines[0][3]) == OPS
