"""Run by tests/test_dist_loops.py under ``python -m jaxkv.launch -n N --devices-per-process 1``: an
embedding table's loop as MXNet code runs it on a ``dist_sync`` store (issue 38).

Each process pushes its own row-sparse gradient of a different number of distinct rows every
step (lazy Adam under a warm-up cosine schedule, a dense key pushed beside it) and pulls its rows
back with ``row_sparse_pull``. Every process checks, after each step, its pulled rows against a
one-process store given every process's gradients (each process draws the others' too), that
once the count is padded nothing compiles, and at the end the whole table. Then a float16 table
under ``multi_precision=True``: a float32 master copy, cast back (as one process computes it).
With an argument, MXNet's ``MXNET_KVSTORE_BIGARRAY_BOUND``: 0 keeps the table whole in every
process, a small one splits it over the processes (its rows routed to their owners). Prints
``rank R ok <check>`` per check and ``rank R done``.
"""

import logging
import os
import sys

import jax
import numpy as np

import jaxkv
import jaxkv.mx as mx
from jaxkv._src.processes import order

R, W, STEPS = 3000, 8, 8
RANK = jax.process_index()


class Compiles(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record):
        if "Compiling" in record.getMessage():
            self.count += 1


def schedule():
    return mx.lr_scheduler.CosineScheduler(
        max_update=40, base_lr=0.05, final_lr=1e-3, warmup_steps=3, warmup_begin_lr=0.01
    )


def batch(step, rank):
    rng = np.random.default_rng(1000 * step + rank)
    n = int(rng.integers(129, 144))  # one padded size: 144
    ids = np.sort(rng.choice(R, n, replace=False))
    return ids, rng.normal(size=(n, W)).astype(np.float32)


def store(kind, devices=None):
    kv = mx.kv.create(kind) if devices is None else jaxkv.KVStore(kind, devices=devices)
    kv.set_optimizer(mx.optimizer.Adam(learning_rate=None, lr_scheduler=schedule(), wd=1e-3))
    start = np.random.default_rng(5).normal(size=(R, W)).astype(np.float32)
    kv.init("emb", mx.nd.array(start).tostype("row_sparse"))
    kv.init("bias", mx.nd.zeros((W,)))
    return kv


def main():
    if len(sys.argv) > 1 and sys.argv[1] != "0":
        os.environ["MXNET_KVSTORE_BIGARRAY_BOUND"] = sys.argv[1]
    counter = Compiles()
    logging.getLogger("jax").addHandler(counter)
    logging.getLogger("jax").propagate = False
    jax.config.update("jax_log_compiles", True)
    kv = store("dist_sync")
    # The reference: one process's store of its own device, given every process's rows (their
    # sum: ids the two share are summed as the dist_sync store sums them).
    ref = store("device", jax.local_devices()[:1])
    out = mx.nd.sparse.zeros("row_sparse", (R, W))
    ref_out = mx.nd.sparse.zeros("row_sparse", (R, W))
    counted = []
    # The collective turns each step takes (each waits for the one before to finish): the dense
    # key's pull into an out is a copy of this process's shards, no turn of its own.
    turns: list[list[str]] = []
    take_turn = order._Order.turn

    def turn(self, what, watch):
        turns[-1].append(what)
        return take_turn(self, what, watch)

    order._Order.turn = turn
    bias_out, ref_bias = mx.nd.zeros((W,)), mx.nd.zeros((W,))
    on_host = []  # whether each step's gradient, made on the host, stayed there
    for step in range(STEPS):
        turns.append([])
        ids, g = batch(step, RANK)
        before = counter.count
        kv.push("bias", mx.nd.ones((W,)), priority=-1)
        grad = mx.nd.sparse.row_sparse_array((g, ids), shape=(R, W))
        kv.push("emb", grad)
        kv.row_sparse_pull("emb", out=out, row_ids=mx.nd.array(ids))
        got = out.data.asnumpy()
        on_host.append(grad.host_parts() is not None)
        counted.append(counter.count - before)
        both = np.zeros((R, W), np.float32)
        for rank in range(jax.process_count()):
            i, x = batch(step, rank)
            both[i] += x
        touched = np.unique(np.concatenate([batch(step, r)[0] for r in range(jax.process_count())]))
        ref.push("bias", mx.nd.ones((W,)) * 2, priority=-1)
        ref.push("emb", mx.nd.sparse.row_sparse_array((both[touched], touched), shape=(R, W)))
        ref.row_sparse_pull("emb", out=ref_out, row_ids=mx.nd.array(ids))
        np.testing.assert_allclose(got, ref_out.data.asnumpy(), rtol=2e-6, atol=2e-7)
        np.testing.assert_array_equal(out.indices.asnumpy(), ids)
        kv.pull("bias", out=bias_out, priority=-1)
        ref.pull("bias", out=ref_bias, priority=-1)
        np.testing.assert_allclose(bias_out.asnumpy(), ref_bias.asnumpy(), rtol=2e-6, atol=2e-7)
    order._Order.turn = take_turn
    print(f"rank {RANK} ok rows after every step", flush=True)
    # A push, then the row push and pull (its agreement, then its computation): no turn for
    # the pull of the dense key (a copy on this process's devices).
    assert all(len(t) <= 3 and "copy" not in t for t in turns[3:]), turns
    print(f"rank {RANK} ok the dense pull takes no turn", flush=True)
    # The gradient's ids and rows, made on the host, go to the devices only as the push's
    # computation's arguments (padded there, in its one put of them): never put for itself.
    assert all(on_host), on_host
    print(f"rank {RANK} ok the pushed rows stay on the host", flush=True)
    # The processes agree each step's count (the largest of theirs): its first count runs as
    # it is, every later one padded to 144; from the step after the first padded one, nothing
    # compiles but, once, the push kept between host agreements (rows.inband: from the third
    # step, after two host agreements of the same push; its agreement rides in its
    # computation, a program of its own) and, the same step, the flattening of the dense
    # push it makes (rows.ops._flat_summed: one small program, compiled once).
    agreed = [max(batch(s, r)[0].size for r in range(jax.process_count())) for s in range(STEPS)]
    padded_from = next((s for s in range(STEPS) if agreed[s] != agreed[0]), STEPS)
    later = counted[padded_from + 1 :]
    assert sum(later) <= 2 and later[-3:] == [0, 0, 0], (counted, agreed)
    if jax.process_count() == 2:  # (agreed 141, then 142: padded from the second step)
        assert counted[2] <= 2 and counted[3:] == [0] * (STEPS - 3), counted
    print(f"rank {RANK} ok no compile after warm-up", flush=True)
    np.testing.assert_allclose(
        np.asarray(kv.pull("emb")), np.asarray(ref.pull("emb")), rtol=2e-6, atol=2e-7
    )
    np.testing.assert_allclose(
        np.asarray(kv.pull("bias")), np.asarray(ref.pull("bias")), rtol=2e-6, atol=2e-7
    )
    print(f"rank {RANK} ok the whole table", flush=True)
    pulled, again = bias_out.asnumpy(), mx.nd.zeros((W,))
    kv.push("bias", mx.nd.ones((W,)))
    kv.pull("bias", out=again)
    assert not np.array_equal(again.asnumpy(), pulled)
    np.testing.assert_array_equal(bias_out.asnumpy(), pulled)  # a copy: no push changes it
    print(f"rank {RANK} ok a pulled out is a copy", flush=True)

    # float16 rows under multi_precision: a float32 master copy, cast back.
    rows = np.array([0, 2])
    g = (np.arange(6, dtype=np.float32).reshape(2, 3) + 1) / 8

    def half(kind, devices=None, scale=1):
        kv = mx.kv.create(kind) if devices is None else jaxkv.KVStore(kind, devices=devices)
        kv.set_optimizer(mx.optimizer.create("adam", multi_precision=True, learning_rate=0.1))
        kv.init("h", mx.nd.ones((4, 3), dtype="float16").tostype("row_sparse"))
        for _ in range(3):
            value = (g * scale).astype(np.float16)
            kv.push("h", mx.nd.sparse.row_sparse_array((value, rows), shape=(4, 3)))
        out = mx.nd.sparse.zeros("row_sparse", (4, 3), dtype="float16")
        kv.row_sparse_pull("h", out=out, row_ids=mx.nd.array([0, 1, 2, 3]))
        return out.asnumpy()

    across = half("dist_sync")
    alone = half("device", jax.local_devices()[:1], scale=jax.process_count())  # every sum
    assert across.dtype == np.float16
    np.testing.assert_array_equal(across, alone)
    print(f"rank {RANK} ok float16 rows under multi_precision", flush=True)
    print(f"rank {RANK} done", flush=True)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
