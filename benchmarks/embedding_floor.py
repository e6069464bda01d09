"""The embedding loop's floor: benchmarks/embedding_worker.py's loop written by hand in JAX, one
jitted step, no store, the same data and the same numbers.

    python embedding_floor.py device [--rows R] [--steps S] [--pad 128] [--apart]
    python -m jaxkv.launch -n 2 --devices-per-process 1 --no-prefix \\
        embedding_floor.py dist_sync [--rows R] [--steps S] [--split]

The loop (embedding_worker.py's ``run``): a table of R x 64 float32 (the same random rows) and a
dense 256 x 64 key of zeros, MXNet's lazy Adam (beta1 0.9, beta2 0.999, epsilon 1e-8, no weight
decay, rescale_grad 1) under MXNet's ``CosineScheduler(max_update=1000, base_lr=0.01,
final_lr=1e-4, warmup_steps=5, warmup_begin_lr=1e-3)``, computed here in plain Python as
MXNet's does; every key is updated once a step, so each key's update count t is the step's
number and the step size is ``lr * sqrt(1 - beta2**t) / (1 - beta1**t)`` (float64 on the
host, then float32), ``w -= lr_t * m / (sqrt(v) + eps)`` on the pushed rows only for the table,
on the whole dense key. Per step the same 1,200-1,300 sorted distinct ids and gradient rows
(``np.random.default_rng(rank)``), the dense gradient 0.01 everywhere.

The step (``device``): one ``jax.jit``; the table and its moments are one donated
``(R, 3, 64)`` array (w, m, v of a row side by side: one gather and one scatter of 768 bytes a
row), the dense key's one donated ``(3, 256, 64)``; the ids padded to the next multiple of
``--pad`` (128: two sizes for 1,200-1,300 rows, both compiled in the first steps) with R, R + 1,
..., out of range and distinct: the gather fills those rows (``mode="fill"``), the scatter drops
them (``mode="drop"``), both told the ids are sorted and unique; before the gather, one
element of each cache line of the rows is read (``_touched``: the CPU overlaps those misses,
which a gather of whole rows takes one row at a time), as jaxkv's push does. The padded ids
and gradient rows, the two step sizes and an int32 zero are NumPy arguments of the jitted
function (JAX's fast path on CPU: no ``device_put`` of their own). It returns the pushed rows'
new weights (the pull: cut to the count on the host, ``np.asarray(rows)[:n]``) and the dense
key's. ``--apart``: w, m and v as three donated ``(R, 64)`` tables, the layout jaxkv's store
keeps (the value and each optimizer slot an array of its own): the floor of that layout, three
touches, gathers and scatters of 256 bytes a row. Tried: the table as its (R, 96) uint64 bits
(half the elements to gather and scatter): no faster; the touch in the ``dist_sync`` step
(below; huge pages there, the launcher's default): no faster in 2 pairs of jobs, within their
spread.

``dist_sync`` (2 processes of one device each, under ``python -m jaxkv.launch``: ``import
jaxkv`` joins the job, gloo between the processes; nothing else of jaxkv is used): one
``jax.jit`` of a ``shard_map`` over the processes' devices. Each process holds a whole copy of
the table (its block of a ``(2, R, 3, 64)`` array) and of the dense key, and hands the step its
padded gradient rows with their ids' bits as a 65th column (one array,
``jax.make_array_from_process_local_data``). The step makes one all-gather (the packed rows and
the dense gradient together), sums the rows several processes pushed into the first one's
(``jnp.searchsorted`` of each process's sorted ids in the earlier processes'; the later copies
dropped), applies lazy Adam to those rows in every copy, sums the dense gradients in rank order,
and returns each process's own rows. Every process pads to the same size, the next multiple of
``--pad`` above the loop's largest count (1,408), its padding R + rank x 1,408 + i (distinct
across the processes), so that they need no exchange of their counts: no host synchronisation
but the read of the pulled rows. Tried (this machine, 100,000 rows): an all-gather each for
ids, rows and (``psum``) the dense gradients, and ``jnp.unique`` for the union of the ids:
10-13 ms a step; one all-gather: 8-9 ms; with ``jnp.searchsorted`` for ``jnp.unique`` (a sort
of 2,816 ids, 0.7 ms alone): 5-6 ms.

``--split`` (``dist_sync``): the table split across the processes, as a ``dist_sync`` store
(and MXNet's 2 servers) keeps it: each process holds its block of R / P rows of w, m and v,
three arrays (jaxkv's layout), and the step is one ``jax.jit`` of a ``shard_map`` with two
collectives: one all-to-all takes each owner the rows pushed to it (the ids' bits as a 65th
column, 1,408 slots per owner: room for every row a process pushes, so that no count is
exchanged), followed by the process's dense gradient; the owner sums the rows several
processes pushed (``jnp.searchsorted``, as above) and updates them, and one all-to-all brings
each process its rows back. So the floor of jaxkv's own layout across processes: what one
computation a step with two all-to-alls costs. Measured 2026-12-06 (this machine, loaded by
two test runs; 3 interleaved rounds of 60 steps, the slower process's median): jaxkv 18.9,
12.1, 12.1 ms; MXNet 1.9.1 (2 workers, 2 servers) 8.6, 6.8, 8.7; this floor with the whole
table 6.3, 2.9, 4.8; ``--split`` 5.9, 5.6, 9.1: every checksum equal. The split layout is not
what keeps jaxkv from MXNet's time; the collectives and host turns of a step are (jaxkv makes
a host all-gather and three computations, five collectives: docs/design.md, "Many
processes").

MXNet's float32 arithmetic, bit for bit: every product is rounded before the sum that uses it,
as MXNet's CPU kernels do (XLA would fuse it into an FMA, one rounding): its bits or-ed with an
int32 zero handed in as an argument, which XLA cannot see is zero (free in a fused loop); the
second moment ``((1 - beta2) * g) * g`` as MXNet's lazy kernel computes it. The step sizes are
the float32 nearest to MXNet's float64 numbers, as jaxkv's row-sparse push computes them (MXNet
parses them from their decimal string, an ulp off for about 1 rate in 100; the checksums of 60
steps agree with MXNet's and jaxkv's all the same).

Prints embedding_worker.py's line: ``embedding floor kind=<kind> rank=<r> first_ms=<x>
median_ms=<x> compiles=<n> rows_sum=<x> host_ms=<x>``: the first step (compiles), the median of
the steps after the 10 warm-up steps, the compiles after them, the float64 sum of the last
step's pulled rows, which must equal jaxkv's and MXNet's, and the median CPU time a step of the
thread that runs the loop (as embedding_worker.py's).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
from functools import partial

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from compiles import Compiles  # noqa: E402  (benchmarks/compiles.py)

WIDTH, DENSE = 64, (256, 64)
WARM = 10
LOW, HIGH = 1200, 1300
B1, B2, EPS = 0.9, 0.999, 1e-8


def cosine_lr(t: int) -> float:
    """MXNet 1.9.1's ``CosineScheduler(max_update=1000, base_lr=0.01, final_lr=1e-4,
    warmup_steps=5, warmup_begin_lr=1e-3)`` at update ``t`` (linear warm-up)."""
    max_update, base_lr, final_lr, warmup, begin = 1000, 0.01, 1e-4, 5, 1e-3
    if t < warmup:
        return begin + (base_lr - begin) * float(t) / float(warmup)
    t = min(t, max_update)  # MXNet keeps the last rate past max_update
    return (
        final_lr
        + (base_lr - final_lr) * (1 + math.cos(math.pi * (t - warmup) / (max_update - warmup))) / 2
    )


def step_size(t: int) -> np.float32:
    """MXNet's Adam step size at the key's t-th update, float64 then float32."""
    lr = cosine_lr(t)
    return np.float32(lr * (math.sqrt(1.0 - B2**t) / (1.0 - B1**t)))


def _adam(w, m, v, g, lr, z):
    """MXNet's adam_update kernel (float32, no weight decay, rescale_grad 1, no clipping), each
    product rounded on its own (``z``: an int32 zero XLA cannot see)."""

    def r(x):
        bits = jax.lax.bitcast_convert_type(x, jnp.int32)
        return jax.lax.bitcast_convert_type(bits | z, jnp.float32)

    one = np.float32(1.0)
    b1, b2 = np.float32(B1), np.float32(B2)
    m = r(b1 * m) + r((one - b1) * g)
    v = r(b2 * v) + r(r((one - b2) * g) * g)
    w = w - r(lr * m) / (jnp.sqrt(v) + np.float32(EPS))
    return w, m, v


def _touched(table, ids, z):
    """``ids`` (sorted, distinct), once one element of each 64-byte cache line of those rows of
    the ``(R, 3, 64)`` table has been read (one gather of 12 elements a row, whose misses the
    CPU overlaps; the whole rows' gather then reads them from the caches): the ids or-ed with
    a zero made of the touched elements and ``z``, so that XLA runs the touch first and keeps
    it (what jaxkv's push does, ``jaxkv/_src/rows/kernels.py``). This machine, one device:
    1.36-1.59 ms a step without it, 0.86-1.03 ms with it."""
    lined = table.reshape(table.shape[0], -1, 16)  # (a bitcast: no copy)
    lines = jax.lax.gather(
        lined,
        ids[:, None],
        jax.lax.GatherDimensionNumbers(
            offset_dims=(1,), collapsed_slice_dims=(0, 2), start_index_map=(0,)
        ),
        slice_sizes=(1, lined.shape[1], 1),
        indices_are_sorted=True,
        unique_indices=True,
        mode="fill",
        fill_value=0,
    )
    return ids | ((lines == 0).any(axis=1).astype(ids.dtype) & z)


def _gather(table, ids, z):
    """The rows ``ids`` (sorted, unique, padded with R: filled with zeros) of ``table``, touched
    first."""
    return table.at[_touched(table, ids, z)].get(
        mode="fill", fill_value=0, indices_are_sorted=True, unique_indices=True
    )


def _scatter(table, ids, rows):
    """``table`` with its rows ``ids`` set to ``rows`` (the padding's dropped)."""
    return table.at[ids].set(rows, mode="drop", indices_are_sorted=True, unique_indices=True)


def _rows_update(table, ids, grad, lr, z):
    """Lazy Adam on the rows ``ids`` (sorted, unique, padded with R) of a ``(R, 3, 64)`` table
    (w, m, v of a row side by side): the new table and the rows' new weights."""
    got = _gather(table, ids, z)
    w, m, v = _adam(got[:, 0], got[:, 1], got[:, 2], grad, lr, z)
    return _scatter(table, ids, jnp.stack([w, m, v], axis=1)), w


def _rows_update_apart(tables, ids, grad, lr, z):
    """``_rows_update`` on w, m and v kept as three ``(R, 64)`` tables (``--apart``: the layout
    jaxkv's store keeps, the value and each optimizer slot an array of its own): three touches,
    gathers and scatters of 256 bytes a row."""
    new = _adam(*[_gather(t, ids, z) for t in tables], grad, lr, z)
    return tuple(_scatter(t, ids, x) for t, x in zip(tables, new)), new[0]


def _dense_update(dense, grad, lr, z):
    w, m, v = _adam(dense[0], dense[1], dense[2], grad, lr, z)
    return jnp.stack([w, m, v]), w


def _union(ids, grads, alive, past):
    """Each process's sorted ids and gradient rows (``alive``: its rows that hold an id) as one
    set of distinct ids and their summed rows: the rows several processes pushed summed into
    the first one's (``jnp.searchsorted`` of each process's ids in the earlier processes'), the
    later copies, and the rows that hold no id, given distinct ids from ``past`` on (dropped)."""
    ids, grads, alive = list(ids), list(grads), list(alive)
    pad = ids[0].shape[0]
    for j in range(1, len(ids)):  # process j's rows that an earlier process pushed too
        for i in range(j):
            at = jnp.minimum(jnp.searchsorted(ids[i], ids[j]), pad - 1)
            hit = (ids[i][at] == ids[j]) & alive[i][at] & alive[j]
            grads[i] = grads[i].at[jnp.where(hit, at, pad)].add(grads[j], mode="drop")
            alive[j] = alive[j] & ~hit
    beyond = past + jnp.arange(len(ids) * pad, dtype=jnp.int32)  # distinct, dropped
    return jnp.where(jnp.concatenate(alive), jnp.concatenate(ids), beyond), jnp.concatenate(grads)


def _dist_body(rows, state, dense, packed, dense_grad, lr, z):
    """One process's step inside ``shard_map`` over axis ``p``: every process's ids, rows and
    dense gradient in one all-gather; the rows several processes pushed summed into the first
    one's (the others dropped); lazy Adam on them in this process's copy of the table; its own
    rows pulled. ``packed``: this process's ``(1, pad, 65)`` padded gradient rows with their
    ids' bits in the last column (sorted, distinct, the padding out of range and distinct
    across the processes)."""
    mine = packed[0]
    pad = mine.shape[0]
    flat = jnp.concatenate([mine.ravel(), dense_grad[0].ravel()])
    every = jax.lax.all_gather(flat, "p")  # (processes, pad * 65 + 256 * 64): one collective
    procs = every.shape[0]
    blocks = every[:, : pad * (WIDTH + 1)].reshape(procs, pad, WIDTH + 1)
    ids = [jax.lax.bitcast_convert_type(blocks[j, :, WIDTH], jnp.int32) for j in range(procs)]
    grads = [blocks[j, :, :WIDTH] for j in range(procs)]
    alive = [jnp.ones(pad, bool) for _ in range(procs)]
    union, summed = _union(ids, grads, alive, rows + procs * pad)
    dense_sum = every[0, pad * (WIDTH + 1) :]
    for k in range(1, procs):
        dense_sum = dense_sum + every[k, pad * (WIDTH + 1) :]  # in rank order
    table = state[0]
    got = table.at[union].get(mode="fill", fill_value=0, unique_indices=True)
    w, m, v = _adam(got[:, 0], got[:, 1], got[:, 2], summed, lr, z)
    table = table.at[union].set(jnp.stack([w, m, v], axis=1), mode="drop", unique_indices=True)
    own = jax.lax.bitcast_convert_type(mine[:, WIDTH], jnp.int32)
    pulled = table.at[own, 0].get(
        mode="fill", fill_value=0, indices_are_sorted=True, unique_indices=True
    )
    d, dense_w = _dense_update(dense[0], dense_sum.reshape(DENSE), lr, z)
    return table[None], d[None], pulled[None], dense_w[None]


def _split_body(rows, tables, dense, packed, dense_grad, lr, z):
    """``--split``: one process's step inside ``shard_map`` over axis ``p``, the table split
    across the processes as a ``dist_sync`` store (and MXNet's servers) keeps it: this
    process's block of ``rows / P`` rows of w, m and v (``tables``, three arrays, jaxkv's
    layout). Two collectives: one all-to-all takes each owner its rows (the ids' bits as a
    65th column, ``C`` = ``pad`` slots per owner, room for every row a process pushes, so no
    count is exchanged) and, after them, this process's dense gradient; the owner sums the
    rows several processes pushed into the first one's (``jnp.searchsorted`` in the earlier
    processes' ids, which arrive sorted), updates them, and one all-to-all brings each process
    its rows back. ``packed``: as ``_dist_body``'s."""
    w, m, v = (t[0] for t in tables)
    mine = packed[0]
    pad = mine.shape[0]
    procs = jax.lax.axis_size("p")
    block = w.shape[0]
    ids = jax.lax.bitcast_convert_type(mine[:, WIDTH], jnp.int32)
    valid = (ids >= 0) & (ids < rows)
    owner = jnp.where(valid, ids // block, procs)
    to = owner[:, None] == jnp.arange(procs, dtype=owner.dtype)[None, :]
    slot = jnp.sum(jnp.where(to, jnp.cumsum(to.astype(jnp.int32), axis=0), 0), axis=1) - 1
    dest = jnp.where(valid, owner * pad + slot, procs * pad)  # this process's rows' slots
    local = jnp.where(valid, ids - owner * block, block)  # (block: selects no row)
    bits = jax.lax.bitcast_convert_type(mine[:, :WIDTH], jnp.int32)
    bits = jnp.concatenate([bits, local[:, None]], axis=1)
    sent = jnp.full((procs * pad, WIDTH + 1), block, jnp.int32).at[dest].set(bits, mode="drop")
    grad_bits = jax.lax.bitcast_convert_type(dense_grad[0], jnp.int32)
    extra = jnp.concatenate([grad_bits, jnp.zeros((DENSE[0], 1), jnp.int32)], axis=1)
    sent = jnp.concatenate(
        [sent.reshape(procs, pad, WIDTH + 1), jnp.broadcast_to(extra, (procs, *extra.shape))],
        axis=1,
    )
    got = jax.lax.all_to_all(sent.reshape(-1, WIDTH + 1), "p", 0, 0, tiled=True)
    got = got.reshape(procs, pad + DENSE[0], WIDTH + 1)
    here = [got[j, :pad, WIDTH] for j in range(procs)]  # each sender's ids, sorted, padded
    grads = [jax.lax.bitcast_convert_type(got[j, :pad, :WIDTH], jnp.float32) for j in range(procs)]
    union, summed = _union(here, grads, [x < block for x in here], block)
    old = [t.at[union].get(mode="fill", fill_value=0, unique_indices=True) for t in (w, m, v)]
    new = _adam(*old, summed, lr, z)
    w, m, v = (t.at[union].set(x, mode="drop", unique_indices=True) for t, x in zip((w, m, v), new))
    asked = jnp.concatenate(here)  # every sender's ids here, in its slots
    back = w.at[asked].get(mode="fill", fill_value=0)
    back = jax.lax.all_to_all(back, "p", 0, 0, tiled=True)  # each process's rows, in its slots
    pulled = back.at[dest].get(mode="fill", fill_value=0)
    dense_sum = jax.lax.bitcast_convert_type(got[0, pad:, :WIDTH], jnp.float32)
    for k in range(1, procs):  # in rank order
        dense_sum = dense_sum + jax.lax.bitcast_convert_type(got[k, pad:, :WIDTH], jnp.float32)
    d, dense_w = _dense_update(dense[0], dense_sum, lr, z)
    return (w[None], m[None], v[None]), d[None], pulled[None], dense_w[None]


def _padded(n: int, pad: int) -> int:
    """The next multiple of ``pad`` at or above ``n``."""
    return -(-n // pad) * pad


def run(
    kind: str, rows: int, steps: int, pad: int, apart: bool = False, split_table: bool = False
) -> None:
    counter = Compiles()
    logger = logging.getLogger("jax")
    logger.addHandler(counter)
    logger.propagate = False  # counted, not printed
    jax.config.update("jax_log_compiles", True)
    rank = jax.process_index()
    start = np.random.default_rng(1234).normal(size=(rows, WIDTH)).astype(np.float32)
    table = np.zeros((rows, 3, WIDTH), np.float32)
    table[:, 0] = start
    del start
    z = np.int32(0)
    if kind == "device":
        dev = jax.devices()[0]
        if apart:
            state = tuple(jax.device_put(np.ascontiguousarray(table[:, j]), dev) for j in range(3))
        else:
            state = jax.device_put(table, dev)
        dense = jax.device_put(np.zeros((3, *DENSE), np.float32), dev)
        dense_grad = jax.device_put(np.full(DENSE, np.float32(0.01)), dev)  # pushed every step
        del table
        update = _rows_update_apart if apart else _rows_update

        @partial(jax.jit, donate_argnums=(0, 1))
        def step(state, dense, ids, grad, dense_grad, lr, z):
            state, pulled = update(state, ids, grad, lr, z)
            dense, dense_w = _dense_update(dense, dense_grad, lr, z)
            return state, dense, pulled, dense_w

    else:
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        mesh = Mesh(np.array(jax.devices()), ("p",))
        split = NamedSharding(mesh, P("p"))
        procs = jax.process_count()

        def local(x: np.ndarray):
            """A global (processes, ...) array whose block on this process is ``x``."""
            return jax.make_array_from_process_local_data(split, x[None], (procs, *x.shape))

        if split_table:
            if rows % procs:
                sys.exit(f"--split: expected rows that divide by {procs} processes, given {rows}")
            block = rows // procs
            mine = slice(rank * block, (rank + 1) * block)
            state = tuple(local(np.ascontiguousarray(table[mine, j])) for j in range(3))
        else:
            state = local(table)
        dense = local(np.zeros((3, *DENSE), np.float32))
        dense_grad = local(np.full(DENSE, np.float32(0.01)))  # pushed every step
        del table

        spec = P("p")
        mapped = jax.shard_map(
            partial(_split_body if split_table else _dist_body, rows),
            mesh=mesh,
            in_specs=(spec, spec, spec, spec, P(), P()),
            out_specs=(spec, spec, spec, spec),
        )
        inner = jax.jit(mapped, donate_argnums=(0, 1))

        def step(state, dense, ids, grad, dense_grad, lr, z):
            packed = np.empty((len(ids), WIDTH + 1), np.float32)
            packed[:, :WIDTH] = grad
            packed[:, WIDTH] = ids.view(np.float32)
            return inner(state, dense, local(packed), dense_grad, lr, z)

    rng = np.random.default_rng(rank)
    times, cpu, compiled_before, got = [], [], 0, None
    size = _padded(HIGH, pad) if kind != "device" else 0
    for k in range(steps):
        n = int(rng.integers(LOW, HIGH + 1))
        ids = np.sort(rng.choice(rows, n, replace=False))
        grad = rng.normal(size=(n, WIDTH)).astype(np.float32) / 100
        if k == WARM:
            compiled_before = counter.count
        lr = step_size(k + 1)
        t, c = time.perf_counter(), time.thread_time()
        p = size or _padded(n, pad)
        start = rows + rank * p - n  # the padding: R + rank * p, R + rank * p + 1, ...
        ids_p = np.arange(start, start + p, dtype=np.int32)
        ids_p[:n] = ids
        grad_p = np.zeros((p, WIDTH), np.float32)
        grad_p[:n] = grad
        state, dense, pulled, dense_w = step(state, dense, ids_p, grad_p, dense_grad, lr, z)
        if kind == "device":
            got = np.asarray(pulled)[:n]
            jax.block_until_ready(dense_w)
        else:
            got = np.asarray(pulled.addressable_shards[0].data)[0, :n]
            jax.block_until_ready(dense_w)
        times.append(time.perf_counter() - t)
        cpu.append(time.thread_time() - c)
    print(
        f"embedding floor kind={kind} rank={rank} first_ms={times[0] * 1e3:.1f} "
        f"median_ms={np.median(times[WARM:]) * 1e3:.3f} compiles={counter.count - compiled_before} "
        f"rows_sum={float(got.astype(np.float64).sum()):.9g} "
        f"host_ms={np.median(cpu[WARM:]) * 1e3:.3f}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=["device", "dist_sync"])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--pad", type=int, default=128)
    parser.add_argument(
        "--apart",
        action="store_true",
        help="device: w, m and v as three (R, 64) tables, as jaxkv keeps them (the floor of "
        "that layout), not one (R, 3, 64)",
    )
    parser.add_argument(
        "--split",
        action="store_true",
        help="dist_sync: the table split across the processes as a dist_sync store keeps it "
        "(w, m and v apart; two all-to-alls), not a whole copy in each",
    )
    args = parser.parse_args()
    if args.apart and args.kind != "device":
        parser.error("--apart: device only")
    if args.split and args.kind != "dist_sync":
        parser.error("--split: dist_sync only")
    if args.kind == "dist_sync":
        import jaxkv  # noqa: F401  (joins the launched job: jax.distributed, gloo)
    run(args.kind, args.rows, args.steps, args.pad, args.apart, args.split)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
