"""Run by tests/test_dist_loops.py through ``python -m jaxkv.launch``: rows of a table across processes.

Every process pushes its own rows (one pair per local device) and pulls its own, functionally
(``jaxkv.push_rows`` / ``pull_rows`` on a store over every process's devices) and through a
``dist_sync`` KVStore (row-sparse values, ``mx.optimizer.SGD`` with ``lazy_update``, and
``row_sparse_pull`` into row-sparse outs). Every process draws every process's pairs from one
seed, so each checks the whole table against a NumPy model. Prints ``ok <name>`` per check.

    rows_job.py BOUND [ROWS]   (BOUND: MXNet's big-array bound, 0 keeps the tables whole
                                everywhere; ROWS: the table's rows, 64 by default; 66 do not
                                divide by 4 devices: the table is split padded by rows)
"""

import os
import sys

if sys.argv[1] != "0":
    os.environ["MXNET_KVSTORE_BIGARRAY_BOUND"] = sys.argv[1]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxkv  # noqa: E402
import jaxkv.mx as mx  # noqa: E402

ROWS = int(sys.argv[2]) if len(sys.argv) > 2 else 64
WIDTH, N, LR = 4, 5, 0.5


def check(name, got, want):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, err_msg=name)
    print(f"rank {jax.process_index()} ok {name}", flush=True)


def pairs(seed, workers, local):
    """Every process's pairs: ``[process][device] -> (ids, rows)``, ids with repeats."""
    rng = np.random.default_rng(seed)
    return [
        [
            (
                rng.integers(0, ROWS, N).astype(np.int32),
                rng.integers(-3, 4, (N, WIDTH)).astype(np.float32),
            )
            for _ in range(local)
        ]
        for _ in range(workers)
    ]


def lazy_sgd(table, every):
    summed = {}
    for per_process in every:
        for ids, rows in per_process:
            for i, r in zip(ids.tolist(), rows):
                summed[i] = summed.get(i, 0) + r
    out = table.copy()
    for i, g in summed.items():
        out[i] = out[i] - LR * g
    return out


def main():
    rank, workers = jax.process_index(), jax.process_count()
    local = jax.local_devices()
    table = np.arange(ROWS * WIDTH, dtype=np.float32).reshape(ROWS, WIDTH) / 8
    bound = int(sys.argv[1]) or None
    tag = "split" if bound else "whole"

    # Functional: a store over every process's devices.
    state = jaxkv.init(jaxkv.empty(jax.devices(), bigarray_bound=bound), {"t": table})
    every = pairs(1, workers, len(local))
    mine = every[rank]
    ids = [jax.device_put(i, d) for (i, _), d in zip(mine, local)]
    rows = [jax.device_put(r, d) for (_, r), d in zip(mine, local)]
    state = jaxkv.push_rows(state, "t", ids, rows, updater=optax.sgd(LR))
    model = lazy_sgd(table, every)
    got = jaxkv.pull_rows(state, "t", [i for i, _ in mine])
    for (i, _), g, d in zip(mine, got, local):
        assert g.devices() == {d}, (g.devices(), d)
        check(f"{tag} functional pull per device", g, model[i])
    one = jaxkv.pull_rows(state, "t", np.arange(ROWS - rank - 1, -1, -1))
    check(f"{tag} functional pull of one array", one, model[::-1][rank:])
    # one pair from this process (all its rows from its first device), assign
    flat_ids = np.concatenate([i for i, _ in mine])
    flat_rows = np.concatenate([r for _, r in mine])
    state = jaxkv.push_rows(state, "t", flat_ids, jnp.asarray(flat_rows))
    summed = {}
    for per_process in every:
        for i, r in zip(
            np.concatenate([i for i, _ in per_process]).tolist(),
            np.concatenate([r for _, r in per_process]),
        ):
            summed[i] = summed.get(i, 0) + r
    for i, g in summed.items():
        model[i] = g
    check(f"{tag} functional assign of one pair per process", jaxkv.pull(state, "t", devices=local[0]), model)
    # pushpull_rows of the ids it pushes, one pair per process: one agreement (one host
    # all-gather) and one computation, the rows coming back on every device of the process
    from jaxkv._src.processes import host

    gathers, gather = [], host._mine
    host._mine = lambda x: gathers.append(1) or gather(x)
    every = pairs(3, workers, 1)
    ids, rows = every[rank][0]
    state, got = jaxkv.pushpull_rows(state, "t", ids, jnp.asarray(rows), updater=optax.sgd(LR))
    host._mine = gather
    model = lazy_sgd(model, every)
    assert len(gathers) == 1, f"{len(gathers)} host all-gathers"
    assert got.devices() == set(local), got.devices()
    check(f"{tag} functional pushpull of the pushed ids", got, model[ids])
    check(f"{tag} ... the table after it", jaxkv.pull(state, "t", devices=local[0]), model)
    # no ids on any process: nothing read, nothing changed (one padded id, selecting nothing)
    none = np.zeros(0, np.int32)
    got = jaxkv.pull_rows(state, "t", [none] * len(local))
    assert [g.shape for g in got] == [(0, WIDTH)] * len(local), [g.shape for g in got]
    state = jaxkv.push_rows(state, "t", none, jnp.zeros((0, WIDTH)), updater=optax.sgd(LR))
    check(f"{tag} functional pull and push of no rows", jaxkv.pull(state, "t", devices=local[0]), model)
    # one process's bad ids: every process refuses (none waits for the others), nothing changes
    bad = np.array([ROWS if rank == workers - 1 else 0], np.int32)
    one = jnp.ones((1, WIDTH))
    for name, call in (
        ("push_rows", lambda: jaxkv.push_rows(state, "t", bad, one, updater=optax.sgd(LR))),
        ("pull_rows", lambda: jaxkv.pull_rows(state, "t", bad)),
        ("pushpull_rows", lambda: jaxkv.pushpull_rows(state, "t", [0], one, pull_ids=bad)),
    ):
        try:
            call()
        except jaxkv.KVStoreError as e:
            mine = rank == workers - 1
            assert (str(ROWS) in str(e)) if mine else ("refused on process" in str(e)), str(e)
        else:
            raise AssertionError(f"{name} with process {workers - 1}'s bad ids was not refused")
    check(f"{tag} one process's bad ids refused everywhere", jaxkv.pull(state, "t", devices=local[0]), model)
    # rows of two keys of one shape, one per process (one program on every process is asked):
    # every process refuses, naming each one's key, where the two would have met in one sum
    state = jaxkv.init(state, {"u": table})
    theirs = "t" if rank == 0 else "u"
    for name, call in (
        ("push_rows", lambda: jaxkv.push_rows(state, theirs, [0], one, updater=optax.sgd(LR))),
        ("pull_rows", lambda: jaxkv.pull_rows(state, theirs, [rank])),
        ("pushpull_rows", lambda: jaxkv.pushpull_rows(state, theirs, [0], one)),
    ):
        try:
            call()
        except jaxkv.KVStoreError as e:
            assert "process 0: 't'" in str(e) and "process 1: 'u'" in str(e), str(e)
        else:
            raise AssertionError(f"{name} of another key on each process was not refused")
    check(f"{tag} rows of another key on each process refused everywhere", jaxkv.pull(state, "t", devices=local[0]), model)
    check(f"{tag} ... the other key unchanged", jaxkv.pull(state, "u", devices=local[0]), table)

    # Imperative: a dist_sync store, row-sparse values, MXNet's lazy SGD.
    kv = mx.kv.create("dist_sync")
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=LR, lazy_update=True))
    kv.init("e", mx.nd.array(table).tostype("row_sparse"))
    every = pairs(2, workers, len(local))
    mine = every[rank]
    values = []
    for (i, r), d in zip(mine, local):
        order = np.unique(i)
        data = np.stack([r[i == k].sum(axis=0) for k in order])  # distinct ids, as MXNet needs
        values.append(
            mx.nd.sparse.row_sparse_array(
                (data, order), shape=(ROWS, WIDTH), ctx=mx.cpu(local.index(d))
            )
        )
    kv.push("e", values)
    model = lazy_sgd(table, every)
    outs = [
        mx.nd.sparse.zeros("row_sparse", (ROWS, WIDTH), ctx=mx.cpu(j)) for j in range(len(local))
    ]
    asked = [mx.nd.array(np.array([rank, ROWS - 1, rank]), dtype="int64") for _ in outs]
    kv.row_sparse_pull("e", out=outs, row_ids=asked)
    for o in outs:
        assert o.indices.asnumpy().tolist() == sorted({rank, ROWS - 1}), o.indices.asnumpy()
        check(
            f"{tag} row_sparse_pull after lazy sgd",
            o.data.asnumpy(),
            model[sorted({rank, ROWS - 1})],
        )
    dense = mx.nd.zeros((ROWS, WIDTH))
    kv.pull("e", out=dense)
    check(f"{tag} the whole table after lazy sgd", dense.asnumpy(), model)
    # one process's bad ids into row-sparse outs: every process refuses
    outs = [mx.nd.sparse.zeros("row_sparse", (ROWS, WIDTH), ctx=mx.cpu(j)) for j in range(len(local))]
    bad = [mx.nd.array([ROWS if rank == workers - 1 else 0]) for _ in outs]
    try:
        kv.row_sparse_pull("e", out=outs, row_ids=bad)
    except jaxkv.KVStoreError as e:
        assert (str(ROWS) in str(e)) if rank == workers - 1 else ("refused on process" in str(e))
    else:
        raise AssertionError("row_sparse_pull with one process's bad ids was not refused")
    kv.pull("e", out=dense)
    check(f"{tag} one process's bad row_sparse_pull refused everywhere", dense.asnumpy(), model)
    # no ids into row-sparse outs, from the table and from a small key kept in a bucket
    kv.init("s", mx.nd.ones((3, 2)))
    for k, shape in (("e", (ROWS, WIDTH)), ("s", (3, 2))):
        outs = [mx.nd.sparse.zeros("row_sparse", shape, ctx=mx.cpu(j)) for j in range(len(local))]
        kv.row_sparse_pull(k, out=outs, row_ids=[mx.nd.array([], dtype="int64") for _ in outs])
        for o in outs:
            assert o.indices.asnumpy().size == 0, o.indices.asnumpy()
            check(f"{tag} row_sparse_pull of no rows", o.asnumpy(), np.zeros(shape))
    kv.barrier()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
