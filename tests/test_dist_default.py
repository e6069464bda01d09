"""A store made with no arguments in a joined job spans every process's devices: each process's
data reaches every replica (tests/dist/default_store_job.py)."""

import json

import pytest
from _jobs import launch


# 3 processes in make test-whole, 2 in make test-deep (as tests/test_dist.py's jobs).
@pytest.mark.parametrize("n", [pytest.param(2, marks=pytest.mark.deep), 3])
def test_the_default_store_spans_every_process(n):
    run = launch(n, "default_store_job.py", per_process=2)
    assert run.returncode == 0, run.stdout + run.stderr
    for name in (
        "empty() spans every process",
        "one process's devices when asked",
        "processes with different bounds refused",
    ):
        assert run.stdout.count(f"ok {name}") == n, run.stdout + run.stderr
    assert run.stdout.count("ok a push sums every process's devices") == n, run.stdout


# 3 processes (2048 rows split padded) and 4 (evenly); 2 in make test-deep.
@pytest.mark.parametrize("n", [pytest.param(2, marks=pytest.mark.deep), 3, 4])
def test_a_dist_sync_store_keeps_1_over_p_of_big_values_and_their_state(n):
    """Adam over one 8M-element key and 20 small ones: at most 1.1/P of the store's bytes per
    process, by default (MXNet's bound, 1M elements)."""
    run = launch(n, "bytes_job.py", 2048, per_process=1, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    held = [
        float(line.split(" held ")[1].split()[0])
        for line in run.stdout.splitlines()
        if " ok held " in line
    ]
    assert len(held) == n, run.stdout + run.stderr
    assert max(held) <= 1.1 / n, held


# make test-whole: onto 3 processes (which do not divide the big key's rows); onto 1 and 4 in
# make test-deep (tests/test_checkpoint_dist.py loads a 2-process checkpoint on 1 and 4 too).
@pytest.mark.parametrize(
    "n", [3, pytest.param(1, marks=pytest.mark.deep), pytest.param(4, marks=pytest.mark.deep)]
)
def test_a_dist_sync_store_saved_by_its_processes_restores_onto_other_process_counts(tmp_path, n):
    """Saved by 2 processes, each writing its own half of the big key and of its Adam state;
    loaded exactly by a job of ``n`` processes, each then holding its own part."""
    directory = tmp_path / "ckpt"
    run = launch(2, "bytes_job.py", 2048, directory, "save", per_process=1, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    with open(directory / "manifest.json") as f:
        manifest = json.loads(json.load(f)["manifest"])
    assert manifest["processes"] == 2
    assert {f["process"] for f in manifest["files"].values()} == {0, 1}
    run = launch(n, "bytes_job.py", 2048, directory, "load", per_process=1, timeout=300)
    assert run.returncode == 0, f"{n} processes:\n{run.stdout}{run.stderr}"
    held = [
        float(line.split(" held ")[1].split()[0])
        for line in run.stdout.splitlines()
        if " ok held " in line
    ]
    assert len(held) == n and max(held) <= 1.1 / n, run.stdout
