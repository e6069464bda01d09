"""Run by tests/test_dist.py through ``python -m jaxkv.launch``: one worker of a dist_sync job
training with MXNet's optimizers and a learning-rate schedule, keys pushed one at a time in each
process's own order; every process must hold the numbers one process alone computes.

Each check prints ``ok <name>``; any failure raises, so the worker exits non-zero.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxkv
import jaxkv.mx as mx

SHAPES = {0: (4, 3), 1: (5,), 2: (6, 2)}
STEPS = 4


def check(name, got, want):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)
    print(f"rank {jax.process_index()} ok {name}", flush=True)


def grad(step, key, rank, device):
    """Multiples of 1/8 below 2: float32 adds any number of them exactly, in any order."""
    rng = np.random.default_rng([step, key, rank, device])
    return (rng.integers(-16, 16, SHAPES[key]) / 8).astype(np.float32)


def make(name):
    sched = mx.lr_scheduler.FactorScheduler(step=2, factor=0.5, base_lr=0.1)
    if name == "sgd":
        return mx.optimizer.SGD(momentum=0.9, wd=0.01, lr_scheduler=sched)
    return mx.optimizer.Adam(learning_rate=None, wd=0.01, lr_scheduler=sched)


def main():
    name = sys.argv[2]
    kv = mx.kv.create("dist_sync")
    rank, workers = kv.rank, kv.num_workers
    local = jax.local_devices()
    opt = make(name)
    kv.set_optimizer(opt)
    init = {
        k: np.random.default_rng(k).uniform(-1, 1, s).astype(np.float32) for k, s in SHAPES.items()
    }
    for k in SHAPES:
        kv.init(k, mx.nd.array(init[k]))
    # The reference: the same optimizer run on the summed gradients in this process alone.
    ref = make(name)
    tx = ref.transformation()
    weights = {k: jnp.asarray(v) for k, v in init.items()}
    states = {k: tx.init(weights[k]) for k in SHAPES}
    order = sorted(SHAPES) if rank % 2 == 0 else sorted(SHAPES, reverse=True)
    for step in range(STEPS):
        outs = {}
        for k in order:  # each process in its own order, one key at a time
            parts = [grad(step, k, rank, d) for d in range(len(local))]
            kv.push(k, [mx.nd.array(x, ctx=mx.cpu(d)) for d, x in enumerate(parts)])
            outs[k] = mx.nd.zeros(SHAPES[k])
            kv.pull(k, out=outs[k])
        sums = {k: outs[k] for k in SHAPES}  # (read below, after the reference's update)
        pushed = {}
        for k in sorted(SHAPES):
            parts = [grad(step, k, r, d) for r in range(workers) for d in range(len(local))]
            pushed[k] = parts
        rows = ref.next_update(sorted(SHAPES))
        for i, k in enumerate(sorted(SHAPES)):
            g = jnp.asarray(np.sum(pushed[k], axis=0))  # exact: see grad
            u, states[k] = tx.update(g, states[k], weights[k], scalars=rows[i])
            weights[k] = optax.apply_updates(weights[k], u)
        for k in sorted(SHAPES):
            check(f"{name} step {step} key {k}", sums[k].asnumpy(), weights[k])
        assert opt.num_update == ref.num_update == step + 1
    print(f"rank {rank} ok {name} with a schedule, keys in each process's own order", flush=True)
    # Processes that change the learning rate differently are refused, before anything moves.
    if name == "sgd":
        plain = mx.optimizer.SGD(learning_rate=0.1)
        kv.set_optimizer(plain)
        plain.set_learning_rate(0.1 * (rank + 1))
        before = kv.pull(0)
        kv.push(0, mx.nd.ones(SHAPES[0]))
        try:
            mx.nd.waitall()
        except jaxkv.KVStoreError as e:
            assert "the same numbers" in str(e), e
            assert plain.num_update == 0 and plain._index_update_count == {}  # not counted
            check("different learning rates refused", kv.pull(0), before)
        else:
            raise AssertionError("different learning rates were accepted")
    kv.barrier()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
