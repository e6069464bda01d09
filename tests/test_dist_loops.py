"""Many processes: MXNet code's loops on a dist_sync store (row-sparse tables, the embedding
loop, MXNet's optimizers with a schedule), each process in its own order. In make test-whole, not in
the selection the other JAX versions run (tests/test_dist.py is)."""

import os

import pytest
from _jobs import expect_ok, launch

from jaxkv._src.mxnet.optimizers.optimizer import MXNET_OPTIMIZERS


@pytest.mark.parametrize(("bound", "rows"), [(0, 64), (64, 64), (64, 66)])
def test_rows_across_processes(bound, rows):
    """Each process pushes and pulls its own rows of one table (kept whole on every device, or
    split over every process's devices by MXNet's bound; 66 rows do not divide by the 4
    devices, so blocks of 17 rows, padded): functionally, and through a dist_sync KVStore's
    row-sparse values with MXNet's lazy SGD; every process checks the whole table."""
    run = launch(2, "rows_job.py", bound, rows)
    tag = "split" if bound else "whole"
    expect_ok(
        run,
        2,
        (
            "functional pull per device",
            "functional pull of one array",
            "functional assign of one pair per process",
            "functional pushpull of the pushed ids",
            "... the table after it",
            "row_sparse_pull after lazy sgd",
            "the whole table after lazy sgd",
            "functional pull and push of no rows",
            "row_sparse_pull of no rows",
            "one process's bad ids refused everywhere",
            "rows of another key on each process refused everywhere",
            "... the other key unchanged",
            "one process's bad row_sparse_pull refused everywhere",
        ),
        tag,
    )


# The table whole (bound 0) at 2 processes and split (bound 1000) at 3; split at 2 in make
# test-deep.
@pytest.mark.parametrize(
    ("n", "bound"), [(2, 0), pytest.param(2, 1000, marks=pytest.mark.deep), (3, 1000)]
)
def test_an_embedding_loop_across_processes(n, bound):
    """MXNet code's embedding loop on dist_sync, one device per process (issue 38): each
    process pushes its own varying number of rows under lazy Adam with a schedule and pulls its
    rows back; every step equals a one-process store given both processes' rows, nothing
    compiles after warm-up, and float16 rows under multi_precision update a float32 master
    copy; the table kept whole in every process, and split across them (bound 1000), over 2
    and 3 processes."""
    run = launch(n, "embedding_job.py", bound, per_process=1)
    expect_ok(
        run,
        n,
        (
            "rows after every step",
            "the dense pull takes no turn",
            "the pushed rows stay on the host",
            "no compile after warm-up",
            "the whole table",
            "a pulled out is a copy",
            "float16 rows under multi_precision",
        ),
    )


def test_calls_held_before_a_push_of_rows_are_agreed_with_it():
    """Across processes, the calls a store holds before a push of rows (a dense key's push) are
    agreed with it in its row_sparse_pull's one host all-gather: the embedding loop makes one a
    step, with a NumPy model's numbers; one process's refused push of rows, one process's
    refused row_sparse_pull (the pushes before it held still), different held calls and
    different learning rates are refused on every process with the store as it was (the held
    push run once later, or dropped), and the next step is right; a wrong sum in jaxkv's own
    computation (no host callback) raises SumError at the read on every process."""
    run = launch(2, "kept_job.py", per_process=1)
    expect_ok(
        run,
        2,
        (
            "one host all-gather a step",
            "one process's bad push of rows refused, the held push run once",
            "one process's bad push of rows changed no row",
            "the next step after a refused push",
            "one process's bad row_sparse_pull refused, the held pushes run once",
            "the push of rows before a refused pull run once",
            "the next step after a refused pull",
            "different held calls refused, nothing run",
            "the next step after different held calls",
            "different learning rates refused, nothing run",
            "the next step after different learning rates",
            "pushes before and after a push of rows in call order (row_sparse_pull)",
            "pushes before and after a push of rows in call order (a read)",
            "a wrong sum raised at the read on every process",
        ),
    )


# make test-whole: 2 processes, one sequence; make test-deep: 3 processes, a longer one drawn anew.
@pytest.mark.parametrize(
    ("n", "steps", "seed"), [(2, 30, 1), pytest.param(3, 60, None, marks=pytest.mark.deep)]
)
def test_random_embedding_loop_calls_across_processes_give_the_values_of_call_order(n, steps, seed):
    """Random sequences of MXNet's embedding-loop calls on dist_sync (dense pushes, held pulls
    into new outs and outs used again, pushes of rows keeping the pushes held before them, the
    same key pushed again, row_sparse_pull of the pushed ids or others, reads), each process
    its own values and rows: every read and out is a NumPy model's of lazy momentum SGD under
    a schedule, call by call, on every process's values summed (tests/dist/held_order_job.py;
    it catches the kept calls run after the ones held since)."""
    seed = seed if seed is not None else int.from_bytes(os.urandom(4), "little")
    run = launch(n, "held_order_job.py", steps, seed, per_process=1, timeout=600)
    assert run.returncode == 0, f"seed {seed}: {run.stdout}{run.stderr}"
    expect_ok(run, n, ("random calls",))


# make test-whole: SGD (with the refusals of processes whose learning rates differ), Adam, and the
# optimizers whose numbers depend on more than the summed gradient and the weight (SGLD's noise,
# LARS's norms, DCASGD's previous weight) or whose state or shape differs (GroupAdaGrad's 2-D
# rows, Ftrl's weight rewritten from its state), in one job; make test-deep: every other.
QUICK = ["sgd", "adam", "sgld", "lars", "dcasgd", "groupadagrad", "ftrl"]
DEEP = [n for n in MXNET_OPTIMIZERS if n not in QUICK]


@pytest.mark.parametrize(
    "names",
    [",".join(QUICK), pytest.param(",".join(DEEP), marks=pytest.mark.deep)],
    ids=["sgd-and-six", "the-others"],
)
def test_mxnet_optimizers_with_a_schedule_across_processes(names):
    """MXNet's optimizers with a learning-rate schedule, keys pushed one at a time in each
    process's own order: every process holds what one process alone computes from the sums;
    processes whose optimizers work out different numbers are refused before anything moves."""
    run = launch(2, "mx_optimizer_job.py", "2", names, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    for rank in range(2):
        for name in names.split(","):
            assert f"rank {rank} ok {name} with a schedule" in run.stdout
        if names.startswith("sgd,"):
            for refused in ("", " in a pushpull", " in a row-sparse push"):
                assert f"rank {rank} ok different learning rates refused{refused}" in run.stdout
            assert f"rank {rank} ok alike learning rates pushed" in run.stdout
        assert f"rank {rank} done" in run.stdout
