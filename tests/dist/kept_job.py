"""Run by tests/test_dist_loops.py under ``python -m jaxkv.launch -n 2 --devices-per-process 1``:
the calls a ``dist_sync`` store holds before a push of rows (a dense key's push), kept until the
push's ``row_sparse_pull`` and agreed with it in one host all-gather.

MXNet's lazy SGD, a row-sparse table and a dense key. The loop of an embedding table (push the
dense key, push the rows, ``row_sparse_pull`` them) makes one host all-gather a step, and its
numbers are those of a NumPy model. Then the failures, each refused on every process with the
store as it was (the kept push of the dense key held again, or dropped with the rest):
one process's push of rows refused (a wrong shape), one process's row_sparse_pull refused (the
pushes before it held still, on every process), the processes holding different calls
before the push, and their learning rates differing; and a wrong sum raised at the read. Prints ``rank R ok <check>`` per check
and ``rank R done``.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv
import jaxkv.mx as mx
from jaxkv._src.processes import host

R, W, LR = 32, 4, 0.5
RANK = jax.process_index()
ALL = jax.process_count()

gathers = []
_all_gather = host.all_gather


def _counted(x, what="all-gather"):
    gathers.append(what)
    return _all_gather(x, what)


host.all_gather = _counted  # (rows.ops and held call it through the module)


def check(name, got, want):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    print(f"rank {RANK} ok {name}", flush=True)


def rows(ids, shape=(R, W)):
    data = np.ones((len(ids), W), np.float32)
    return mx.nd.sparse.row_sparse_array((data, np.array(ids)), shape=shape)


def mine(step):
    """This process's ids at ``step``: its own two and one every process pushes."""
    return [RANK + 2 * step % 8, 16 + RANK, 30]


def refused(name, call, says):
    """``call()`` raises KVStoreError (SumError is one) saying ``says`` (this process's words)."""
    try:
        call()
    except jaxkv.KVStoreError as e:
        assert says in str(e), str(e)
    else:
        raise AssertionError(f"{name}: not refused")


def main():
    kv = mx.kv.create("dist_sync")
    opt = mx.optimizer.SGD(learning_rate=LR, lazy_update=True)
    kv.set_optimizer(opt)
    kv.init("emb", mx.nd.zeros((R, W)).tostype("row_sparse"))
    kv.init("bias", mx.nd.zeros((W,)))
    emb, bias = np.zeros((R, W), np.float32), np.zeros(W, np.float32)
    out = mx.nd.sparse.zeros("row_sparse", (R, W))

    def step(n):
        kv.push("bias", mx.nd.ones((W,)))
        kv.push("emb", rows(mine(n)))
        kv.row_sparse_pull("emb", out=out, row_ids=mx.nd.array(mine(n)))
        return out.data.asnumpy()

    def model(n):
        bias[:] -= LR * ALL
        for r in range(ALL):
            for i in [r + 2 * n % 8, 16 + r, 30]:
                emb[i] -= LR
        return emb[mine(n)]

    counts = []
    for n in range(4):
        before = len(gathers)
        check(f"rows of step {n}", step(n), model(n))
        counts.append(len(gathers) - before)
    assert counts[1:] == [1, 1, 1], counts  # (the first step's includes the held inits')
    print(f"rank {RANK} ok one host all-gather a step", flush=True)
    check("the dense key", np.asarray(kv.pull("bias")), bias)

    # One process's push of rows refused (a wrong shape): every process refuses at its next
    # call of the push, nothing of it counted; the push of "bias" before it is held still, and
    # runs once on every process at the next read.
    def push_then_pull():
        kv.push("bias", mx.nd.ones((W,)))
        shape = (R + 1, W) if RANK == ALL - 1 else (R, W)
        kv.push("emb", rows([1, 2], shape))
        kv.row_sparse_pull("emb", out=out, row_ids=mx.nd.array([1, 2]))

    words = "expected the stored shape" if RANK == ALL - 1 else "refused on process"
    refused("one process's bad push", push_then_pull, words)
    bias[:] -= LR * ALL
    check("one process's bad push of rows refused, the held push run once", np.asarray(kv.pull("bias")), bias)
    check("one process's bad push of rows changed no row", np.asarray(kv.pull("emb")), emb)
    check("the next step after a refused push", step(4), model(4))

    # One process's row_sparse_pull refused (an id out of range) after its push of rows, with
    # a push of "bias" held before them: every process refuses the pull, the pushes stay held
    # on every process (accepted calls: nothing lost), and run once at the next read.
    def pull_refused():
        kv.push("bias", mx.nd.ones((W,)))
        kv.push("emb", rows([5, 6]))
        ids = [5, R + 3] if RANK == ALL - 1 else [5, 6]
        kv.row_sparse_pull("emb", out=out, row_ids=mx.nd.array(ids))

    kept = out.data.asnumpy()
    words = "row_ids expected integers" if RANK == ALL - 1 else "row_sparse_pull was refused on"
    refused("one process's bad row_sparse_pull", pull_refused, words)
    np.testing.assert_array_equal(out.data.asnumpy(), kept)  # the out as it was
    bias[:] -= LR * ALL
    emb[[5, 6]] -= LR * ALL
    check("one process's bad row_sparse_pull refused, the held pushes run once", np.asarray(kv.pull("bias")), bias)
    check("the push of rows before a refused pull run once", np.asarray(kv.pull("emb")), emb)
    check("the next step after a refused pull", step(7), model(7))

    # The processes hold different calls before the push (process 0 a push of "bias"): every
    # process refuses, and nothing held is run.
    def different():
        if RANK == 0:
            kv.push("bias", mx.nd.ones((W,)))
        kv.push("emb", rows([3]))
        kv.row_sparse_pull("emb", out=out, row_ids=mx.nd.array([3]))

    # (every process names each one's calls, the process that held nothing too)
    refused("different held calls", different, "process 0: init [], push ['bias']")
    check("different held calls refused, nothing run", np.asarray(kv.pull("bias")), bias)
    check("different held calls changed no row", np.asarray(kv.pull("emb")), emb)
    check("the next step after different held calls", step(5), model(5))

    # Learning rates that differ: every process refuses, nothing counted or changed.
    opt.set_learning_rate(LR * (RANK + 1))
    counted = opt.num_update
    refused("different learning rates", lambda: step(6), "the same numbers")
    assert opt.num_update == counted, (opt.num_update, counted)
    opt.set_learning_rate(LR)
    check("different learning rates refused, nothing run", np.asarray(kv.pull("bias")), bias)
    check("different learning rates changed no row", np.asarray(kv.pull("emb")), emb)
    check("the next step after different learning rates", step(6), model(6))

    # A key pushed before the push of rows and again after it, before the row_sparse_pull (or
    # a read): its pushes run in call order, the kept one first (momentum SGD, whose value
    # depends on the order).
    for then in ("row_sparse_pull", "a read"):
        kv2 = mx.kv.create("dist_sync")
        kv2.set_optimizer(mx.optimizer.SGD(learning_rate=LR, momentum=0.9, lazy_update=True))
        kv2.init("emb", mx.nd.zeros((R, W)).tostype("row_sparse"))
        kv2.init("bias", mx.nd.zeros((W,)))
        kv2.pull("bias")  # (the held inits run: a push of rows keeps no held init)
        kv2.push("bias", mx.nd.ones((W,)))
        kv2.push("emb", rows([1, 2]))
        kv2.push("bias", mx.nd.ones((W,)) * 3)
        if then == "row_sparse_pull":
            kv2.row_sparse_pull("emb", out=out, row_ids=mx.nd.array([1, 2]))
        mom, want = np.zeros(W), np.zeros(W)
        for g in (1.0 * ALL, 3.0 * ALL):
            mom = 0.9 * mom - LR * g
            want = want + mom
        check(f"pushes before and after a push of rows in call order ({then})",
              np.asarray(kv2.pull("bias")), want)

    # A wrong sum (device 1's part of the big key's all-reduce off by 7, so every device's total
    # is): every process raises SumError, naming both devices, at its read of the pulled value
    # (jaxkv's own computation has no host callback: the verdict comes back as an output,
    # compared at the read). One program in every process: from JAX 0.12 the processes'
    # collectives meet only where their programs are the same (a psum that added 7 in process 1
    # alone hung both in the read until the collective timeout).
    real = jax.lax.psum
    big = (64, 512)

    def corrupted(x, axis, **kw):  # the big key's all-reduce, device 1's part off
        if getattr(x, "size", 0) == big[0] * big[1]:
            x = x + jnp.where(jax.lax.axis_index(axis) == 1, 7.0, 0.0).astype(x.dtype)
        return real(x, axis, **kw)

    jax.lax.psum = corrupted
    kv.init("big", mx.nd.zeros(big))
    kv.push("big", mx.nd.ones(big))
    got = mx.nd.zeros(big)
    kv.pull("big", out=got)
    refused("a wrong sum", got.asnumpy, "failed its checksum on device 0, device 1:")
    print(f"rank {RANK} ok a wrong sum raised at the read on every process", flush=True)
    print(f"rank {RANK} done", flush=True)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
