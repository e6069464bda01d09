"""Many processes: ``python -m jaxkv.launch`` runs dist_sync jobs over jax.distributed (gloo
collectives between local CPU processes), and stops a job whose process dies."""

import subprocess
import sys

import pytest
from _jobs import expect_ok, launch

# make test: 3 processes (values split over them unevenly, and more orders of arrival); 2 in
# make test-deep (most other jobs here run 2).
N_PROCESSES = [pytest.param(2, marks=pytest.mark.deep), 3]


@pytest.mark.parametrize("n", N_PROCESSES)
def test_dist_sync_job(n):
    run = launch(n, "kvstore_job.py", str(n))
    expect_ok(
        run,
        n,
        (
            "init from rank 0",
            "push sums over workers",
            "sharded value with sgd",
            "outs lent and kept",
            "broadcast f",
            "broadcast b",
            "broadcast i",
            "broadcast nan bits",
            "all-gather",
            "mismatched barriers refused",
        ),
    )


def test_a_dying_process_stops_the_job():
    run = launch(2, "failing_job.py", timeout=120)
    assert run.returncode == 3
    assert "process 1 exited with 3; stopping the others" in run.stderr


def test_launcher_refuses_no_processes():
    run = subprocess.run(
        [sys.executable, "-m", "jaxkv.launch", "-n", "0", "x.py"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode != 0 and "at least 1" in run.stderr


@pytest.mark.parametrize("n", N_PROCESSES)
def test_dist_sync_sums_within_each_process_then_across(n):
    """Pushes from any of a process's devices (several, one, the same one twice, none of the
    store's own) are summed there, then across processes; pulls to every device equal a NumPy
    sum, assigned or through sgd, with values kept whole or split by MXNet's bound."""
    run = launch(n, "hierarchy_job.py")
    expect_ok(
        run,
        n,
        (
            "assign step 1 key big",
            "sgd step 1 key i",
            "split step 1 key m",
            "float16 pushed to float32",
            "flat store",
            "flat split store",
            "mean across processes",
            "mean per key across processes",
            "global value refused",
        ),
    )


def test_pushes_of_different_keys_on_each_process_are_never_a_silent_sum():
    """The last process pushes another key of the same shape than the others (a program that
    differs between processes): where JAX makes one computation of both pushes, they meet in
    one sum and every process raises SumError at its next collective, naming its key (the
    checks of the sums compare the keys' digests); where it makes two (JAX 0.12 here), they
    never meet and the watchdog ends the job. Never a sum that mixes two keys with no error."""
    run = launch(2, "keys_job.py", timeout=180)
    if run.returncode == 0:
        expect_ok(run, 2, ("another key on one process refused everywhere",))
    else:
        assert run.returncode == 124, run.stdout + run.stderr
        assert "one of them is hung or far behind" in run.stderr, run.stderr
        assert " ok " not in run.stdout, run.stdout


@pytest.mark.parametrize("n", N_PROCESSES)
def test_dist_sync_matches_pushes_by_key(n):
    """Processes push the same keys one at a time, each in its own shuffled order: every
    process gets the sums MXNet's servers give (keys of one shape, and of several), and keys
    that differ between processes are refused on every process, naming each one's keys."""
    run = launch(n, "order_job.py")
    expect_ok(
        run,
        n,
        (
            "one shape step 2 key c",
            "shapes step 2 key f",
            "different keys refused",
            "unchanged after the refusal",
            "out keeps its value",
            "different pulls of split values refused",
            "split value t pulled in each process's order",
        ),
    )
    assert "held push failed" not in run.stdout + run.stderr, run.stdout + run.stderr


def test_pushes_of_rows_kept_between_host_agreements():
    """A functional push of rows across processes, kept (it starts with its computation, the
    processes' agreement riding in it): every pulled row and table to the bit as agreed on the
    host each time, the same refusals (one process's bad id, a key per process), and no host
    all-gather a step once kept (rows/inband.py). Run with every JAX version: JAX 0.12 pairs
    only one program's collectives across processes, where 0.8 and 0.10 pair any."""
    run = launch(2, "inband_job.py")
    expect_ok(
        run,
        2,
        (
            "kept pushes give every row host-agreed ones give, to the bit, and the same refusals",
            "kept pushes make no host all-gather",
            "a key made beside a pushed table padded by rows",
        ),
    )


def test_mxnet_pushes_of_rows_kept_with_the_calls_held_before_them():
    """MXNet's embedding loop on dist_sync (a dense key's push held before each push of rows):
    the push of rows kept between host agreements agrees the held push in its own computation
    and makes it there too (one computation a step); every pulled row, the dense key and the
    table to the bit as agreed on the host each time, the same refusals (one process's bad
    row_sparse_pull, different held calls, different numbers), no host all-gather a step once
    kept. And a functional pushpull_rows pulling other ids than it pushes while a push
    without a pull is kept gets its rows (it got none). Run with every JAX version."""
    run = launch(2, "inband_mx_job.py", per_process=1)
    expect_ok(
        run,
        2,
        (
            "kept pushes give every row and value host-agreed ones give, to the bit, and the "
            "same refusals",
            "kept pushes make no host all-gather, the dense push held before them agreed in them",
            "kept pushes make the dense push held before them in their own computation",
            "a pull of other ids than a kept push's",
            "a push of rows after a held pull is not kept",
            "a push of rows after a held pull on one process only is kept on none",
            "a table one process alone may not donate: one program everywhere, nothing lost",
            "kv.state held by one process alone: one program everywhere, nothing lost",
            "kv.state taken by one process alone after held inits: one program everywhere",
            "each process reading its own way: one program everywhere",
        ),
    )
