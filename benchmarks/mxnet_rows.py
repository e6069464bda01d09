"""MXNet 1.9.1's row_sparse path, timed: a table of R x 64 float32 (initialised with ones: MXNet's
lazy SGD needs every row stored), SGD(lazy_update=True) on the store, and per step each of D cpu
contexts pushes a row_sparse gradient of N random rows and pulls its own N rows with
row_sparse_pull into a row_sparse out.

`make bench` runs it with the python of conformance/setup_mxnet.sh's venv. Prints one line per
table size:  mxnet-rows R=<rows> D=<d> N=<n> median_ms=<x>
Usage: python mxnet_rows.py [R ...] (default 1000000)
"""

import sys
import time

import mxnet as mx
import numpy as np

WIDTH, D, N, STEPS = 64, 8, 1000, 31  # as benchmarks/rows.py: a step is milliseconds


def run(rows: int) -> None:
    kv = mx.kv.create("local")
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1, lazy_update=True))
    kv.init("w", mx.nd.ones((rows, WIDTH)).tostype("row_sparse"))
    rng = np.random.default_rng(0)
    ctxs = [mx.cpu(d) for d in range(D)]
    outs = [mx.nd.sparse.zeros("row_sparse", (rows, WIDTH), ctx=c) for c in ctxs]

    def batch():
        ids = [np.sort(rng.choice(rows, N, replace=False)) for _ in ctxs]
        grads = [
            mx.nd.sparse.row_sparse_array(
                (np.full((N, WIDTH), 0.01, np.float32), i), shape=(rows, WIDTH), ctx=c
            )
            for i, c in zip(ids, ctxs)
        ]
        return grads, [mx.nd.array(i, ctx=c, dtype="int64") for i, c in zip(ids, ctxs)]

    batches = [batch() for _ in range(4)]

    def step(k: int) -> None:
        grads, ids = batches[k % len(batches)]
        kv.push("w", grads)
        kv.row_sparse_pull("w", out=outs, row_ids=ids)
        mx.nd.waitall()

    step(0)
    step(1)
    times = []
    for k in range(STEPS):
        t = time.perf_counter()
        step(k)
        times.append(time.perf_counter() - t)
    print(f"mxnet-rows R={rows} D={D} N={N} median_ms={np.median(times) * 1e3:.2f}", flush=True)


if __name__ == "__main__":
    for r in sys.argv[1:] or ["1000000"]:
        run(int(r))
