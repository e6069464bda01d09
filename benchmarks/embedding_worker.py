"""The embedding loop of an MXNet recommendation model (issue 38), written once against an
``mx`` module: jaxkv's drop-in (``jaxkv.mx``) or Apache MXNet 1.9.1's own.

A ``row_sparse`` table of R x 64 float32 (random rows: MXNet's lazy Adam needs every row
stored) and a dense 256 x 64 key beside it, ``Adam(lazy_update=True)`` under a
``CosineScheduler`` with warm-up (a new learning rate at every step), and at every step a
batch of 1,200-1,300 distinct rows (a different count each step): the dense key pushed with a
priority, the table's row-sparse gradient pushed, its rows pulled back with
``row_sparse_pull``, the dense key pulled. A ``device`` store in one process (its one device),
or ``dist_sync`` (each process one device; MXNet: workers and servers).

    python embedding_worker.py jaxkv|mxnet device|dist_sync [--rows R] [--steps S]
        [--beside N] [--pieces] [--count-syncs]

``--beside N``: N keys of 16 x 16 float32 beside the table and the dense key (a model's other
parameters), initialized, pushed and pulled once as a list before the loop, which touches
none of them: a step should cost the keys it touches (jaxkv then keeps the small keys in flat
buckets).

Prints ``embedding <name> kind=<kind> rank=<r> first_ms=<x> median_ms=<x> compiles=<n>
rows_sum=<x> host_ms=<x>``: the first step (start-up: compiles), the median of the steps after
the 10 warm-up steps, the compiles after warm-up (jaxkv; -1 for MXNet), a checksum of the last
step's pulled rows (float64 sum), which both libraries must agree on, and the median CPU time
a step of the thread that runs the loop (``time.thread_time``: the host's part of the step;
the computations run on XLA's threads, or MXNet's engine's).

``--pieces`` times each call of the step on its own (``time.perf_counter`` around each) and
prints ``pieces <name> kind=<kind> rank=<r> step_ms=<x> sparse_ms=<x> ...``: each piece's median
over the steps after warm-up (the row_sparse gradient made, the dense push, the table's push,
the ids' NDArray made, ``row_sparse_pull``, the dense pull, the two waits) and the median step.
A run of its own: the timing perturbs the step. ``--count-syncs`` (jaxkv) adds
``host_syncs=<x>`` to the first line: the host collectives among processes per step after
warm-up (the all-gathers and broadcasts of ``jaxkv._src.processes.host``, each a point where
every process waits for the others; a private name: ``-1`` where it is gone).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import numpy as np
from compiles import Compiles  # benchmarks/compiles.py

WIDTH, DENSE, BESIDE = 64, (256, 64), (16, 16)
WARM = 10
LOW, HIGH = 1200, 1300


PIECES = ("sparse", "push_dense", "push_emb", "row_ids", "row_sparse_pull", "pull_dense", "wait")


def _count_host_syncs() -> list[int] | None:
    """Counts jaxkv's host collectives among processes (each reads its result with
    ``host._mine``): a list whose length is the count, or None where that name is gone."""
    try:
        from jaxkv._src.processes import host
    except ImportError:
        return None
    mine = getattr(host, "_mine", None)
    if mine is None:
        return None
    calls: list[int] = []

    def counted(x):
        calls.append(1)
        return mine(x)

    host._mine = counted
    return calls


def run(
    mx,
    name: str,
    kind: str,
    rows: int,
    steps: int,
    pieces: bool = False,
    count_syncs: bool = False,
    beside: int = 0,
) -> None:
    counter = None
    if name == "jaxkv":
        import jax

        counter = Compiles()
        logger = logging.getLogger("jax")
        logger.addHandler(counter)
        logger.propagate = False  # counted, not printed
        jax.config.update("jax_log_compiles", True)
    kv = mx.kv.create(kind)
    rank = kv.rank
    sched = mx.lr_scheduler.CosineScheduler(
        max_update=1000, base_lr=0.01, final_lr=1e-4, warmup_steps=5, warmup_begin_lr=1e-3
    )
    kv.set_optimizer(mx.optimizer.Adam(learning_rate=None, lazy_update=True, lr_scheduler=sched))
    start = np.random.default_rng(1234).normal(size=(rows, WIDTH)).astype(np.float32)
    kv.init("emb", mx.nd.array(start).tostype("row_sparse"))
    kv.init("dense", mx.nd.zeros(DENSE))
    del start
    if beside:
        names = [f"w{k:04d}" for k in range(beside)]
        kv.init(names, [mx.nd.zeros(BESIDE) for _ in names])
        kv.push(names, [mx.nd.ones(BESIDE) for _ in names])
        kv.pull(names, out=[mx.nd.zeros(BESIDE) for _ in names])
    rng = np.random.default_rng(rank)
    out = mx.nd.sparse.zeros("row_sparse", (rows, WIDTH))
    dense_out = mx.nd.zeros(DENSE)
    dense_grad = mx.nd.ones(DENSE) * 0.01
    syncs = _count_host_syncs() if count_syncs and name == "jaxkv" else None
    times, cpu, parts, compiled_before, synced_before = [], [], [], 0, 0
    for step in range(steps):
        n = int(rng.integers(LOW, HIGH + 1))
        ids = np.sort(rng.choice(rows, n, replace=False))
        grad = rng.normal(size=(n, WIDTH)).astype(np.float32) / 100
        if step == WARM:
            compiled_before = counter.count if counter is not None else 0
            synced_before = len(syncs) if syncs is not None else 0
        if pieces:
            times.append(_pieces_step(mx, kv, rows, ids, grad, dense_grad, out, dense_out, parts))
            continue
        t, c = time.perf_counter(), time.thread_time()
        g = mx.nd.sparse.row_sparse_array((grad, ids), shape=(rows, WIDTH))
        kv.push("dense", dense_grad, priority=-1)
        kv.push("emb", g, priority=0)
        kv.row_sparse_pull("emb", out=out, row_ids=mx.nd.array(ids))
        kv.pull("dense", out=dense_out, priority=-1)
        out.data.wait_to_read()
        dense_out.wait_to_read()
        times.append(time.perf_counter() - t)
        cpu.append(time.thread_time() - c)
    compiles = -1 if counter is None else counter.count - compiled_before  # (the timed steps')
    got = out.data.asnumpy().astype(np.float64)
    extra = f" host_ms={np.median(cpu[WARM:]) * 1e3:.3f}" if cpu[WARM:] else ""
    if count_syncs and name == "jaxkv":
        per_step = -1 if syncs is None else (len(syncs) - synced_before) / (steps - WARM)
        extra += f" host_syncs={per_step:g}"
    print(
        f"embedding {name} kind={kind} rank={rank} first_ms={times[0] * 1e3:.1f} "
        f"median_ms={np.median(times[WARM:]) * 1e3:.3f} compiles={compiles} "
        f"rows_sum={float(got.sum()):.9g}{extra}",
        flush=True,
    )
    if pieces:
        med = np.median(np.array(parts[WARM:]), axis=0) * 1e3
        cells = " ".join(f"{p}_ms={x:.3f}" for p, x in zip(PIECES, med))
        print(
            f"pieces {name} kind={kind} rank={rank} step_ms={np.median(times[WARM:]) * 1e3:.3f} "
            f"{cells}",
            flush=True,
        )


def _pieces_step(mx, kv, rows, ids, grad, dense_grad, out, dense_out, parts) -> float:
    """The step with each call timed on its own (``PIECES``, in order): its time."""
    clock = time.perf_counter
    t0 = clock()
    g = mx.nd.sparse.row_sparse_array((grad, ids), shape=(rows, WIDTH))
    t1 = clock()
    kv.push("dense", dense_grad, priority=-1)
    t2 = clock()
    kv.push("emb", g, priority=0)
    t3 = clock()
    row_ids = mx.nd.array(ids)
    t4 = clock()
    kv.row_sparse_pull("emb", out=out, row_ids=row_ids)
    t5 = clock()
    kv.pull("dense", out=dense_out, priority=-1)
    t6 = clock()
    out.data.wait_to_read()
    dense_out.wait_to_read()
    t7 = clock()
    marks = (t0, t1, t2, t3, t4, t5, t6, t7)
    parts.append([b - a for a, b in zip(marks, marks[1:])])
    return t7 - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=["jaxkv", "mxnet"])
    parser.add_argument("kind", choices=["device", "dist_sync"])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--beside", type=int, default=0, help="small keys beside the table")
    parser.add_argument("--pieces", action="store_true", help="time each call of the step")
    parser.add_argument(
        "--count-syncs", action="store_true", help="jaxkv: host collectives per step"
    )
    args = parser.parse_args()
    if args.name == "mxnet":
        import mxnet as mx  # a scheduler or server runs its role here, then exits
    else:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        import jaxkv.mx as mx
    run(mx, args.name, args.kind, args.rows, args.steps, args.pieces, args.count_syncs, args.beside)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
