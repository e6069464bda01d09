"""Run by tests/test_dist.py through ``python -m jaxkv.launch``: one worker of a dist_sync job
whose processes push the same keys one at a time, each in its own order (as code iterating a
set of str keys does), then keys that differ between processes.

Each check prints ``rank R ok <name>``; any failure raises, so the worker exits non-zero.
"""

import os
import random

import jax
import numpy as np

import jaxkv
import jaxkv.mx as mx  # importing jaxkv joins the job


def check(name, got, want):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)
    print(f"rank {jax.process_index()} ok {name}", flush=True)


def main():
    kv = mx.kv.create("dist_sync")
    rank, workers = kv.rank, kv.num_workers
    local = len(jax.local_devices())
    ranks = sum(r + 1 for r in range(workers))
    for case, shapes in (
        ("one shape", {"a": (2, 3), "b": (2, 3), "c": (2, 3)}),
        ("shapes", {"d": (5,), "e": (3, 4), "f": (64, 8)}),
    ):
        keys = list(shapes)
        scale = {k: 10.0 ** (2 * i) for i, k in enumerate(keys)}  # 1, 100, 10000
        order = keys[::-1] if rank % 2 else keys
        for k in order:
            kv.init(k, mx.nd.zeros(shapes[k]))
        for step in range(3):
            order = list(keys)
            random.Random(1000 * step + rank).shuffle(order)  # each process its own order
            outs = {k: [mx.nd.zeros(shapes[k], mx.cpu(d)) for d in range(local)] for k in keys}
            for k in order:
                kv.push(
                    k,
                    [
                        mx.nd.ones(shapes[k], mx.cpu(d)) * scale[k] * (rank + 1)
                        for d in range(local)
                    ],
                )
                kv.pull(k, out=outs[k])
            for k in keys:
                for o in outs[k]:
                    check(
                        f"{case} step {step} key {k}",
                        o.asnumpy(),
                        np.full(shapes[k], scale[k] * ranks * local),
                    )
    # Processes that push different keys before a read: every one refuses, naming each
    # process's keys, and nothing changes.
    kv.push("a", mx.nd.ones((2, 3)) * 7)
    if rank == 0:
        kv.push("b", mx.nd.ones((2, 3)) * 7)
    out = mx.nd.zeros((2, 3))
    kv.pull("a", out=out)
    try:
        out.asnumpy()
    except jaxkv.KVStoreError as e:
        assert "process 0: init [], push ['a', 'b']" in str(e), e
        assert "process 1: init [], push ['a']" in str(e), e
        print(f"rank {rank} ok different keys refused", flush=True)
    else:
        raise AssertionError("different keys were pushed without an error")
    check("unchanged after the refusal", kv.pull("a"), np.full((2, 3), ranks * local))
    check("out keeps its value", out.asnumpy(), np.zeros((2, 3)))
    # Values split across the processes: a pull gathers them, so processes that pull
    # different ones are refused too (a pull of a whole value is each process's own).
    os.environ["MXNET_KVSTORE_BIGARRAY_BOUND"] = "12"
    split = mx.kv.create("dist_sync")
    split.init(["s", "t"], [mx.nd.zeros((96, 8)), mx.nd.zeros((96, 8))])
    mx.nd.waitall()
    split.push("s", mx.nd.ones((96, 8)))
    got = mx.nd.zeros((96, 8))
    if rank == 0:
        split.pull("s", out=got)
    try:
        mx.nd.waitall()
    except jaxkv.KVStoreError as e:
        assert "process 0: init [], push ['s'], pull of split values ['s']" in str(e), e
        assert "process 1: init [], push ['s'], pull of split values []" in str(e), e
        print(f"rank {rank} ok different pulls of split values refused", flush=True)
    else:
        raise AssertionError("different pulls of a split value passed without an error")
    # The same pulls, each process in its own order: they gather in key order in every one.
    outs = {k: mx.nd.ones((96, 8)) for k in ("s", "t")}
    for k in ("t", "s") if rank % 2 else ("s", "t"):
        split.pull(k, out=outs[k])
    for k in ("s", "t"):  # the refused push changed nothing
        check(
            f"split value {k} pulled in each process's order", outs[k].asnumpy(), np.zeros((96, 8))
        )
    kv.barrier()
    # A push left held as the process ends runs then, before JAX's shutdown: the processes
    # still sum it (the test finds no "held push failed" in the output).
    kv.push("a", mx.nd.ones((2, 3)))
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
