"""Run by tests/test_dist_loops.py through ``python -m jaxkv.launch``: one worker of a dist_sync job
training with MXNet's optimizers and a learning-rate schedule, keys pushed one at a time in each
process's own order; every process must hold the numbers one process alone computes.

Each check prints ``ok <name>``; any failure raises, so the worker exits non-zero.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv
import jaxkv._src.core.updater
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


# Arguments per optimizer beyond the schedule (momentum where it has one, weight decay).
KWARGS = {
    "sgd": {"momentum": 0.9, "wd": 0.01},
    "adam": {"learning_rate": None, "wd": 0.01},
    "nag": {"momentum": 0.9},
    "signum": {"momentum": 0.9},
    # LARS's momentum correction follows the rate from one update to the next of any key: with
    # keys in each process's own order, the processes would correct different keys (refused).
    "lars": {"momentum": 0.9, "eta": 0.01, "momentum_correction": False},
    "lbsgd": {"momentum": 0.9},
    "rmsprop": {"centered": True},
    "ftml": {"learning_rate": None},
    "lamb": {"learning_rate": None},
    "nadam": {"learning_rate": None},
    "adamax": {"learning_rate": None},
}


# LBSGD reads the learning rate before it counts the update (MXNet's order), so under a schedule
# the key pushed first in a step gets the rate of the step before: processes pushing in their
# own orders would work out different rates (refused); Nadam's m_schedule is one product over
# every update of any key, in order. These push in one order everywhere.
SAME_ORDER = {"lbsgd", "nadam"}


def make(name):
    """The optimizer ``name`` with a schedule (SGLD's noise seeded alike in every process)."""
    mx.random.seed(7)
    sched = mx.lr_scheduler.FactorScheduler(step=2, factor=0.5, base_lr=0.1)
    return mx.optimizer.create(name, lr_scheduler=sched, **KWARGS.get(name, {}))


def train(kv, name, rank, workers, local, steps, shapes):
    opt = make(name)
    kv.set_optimizer(opt)
    init = {
        k: np.random.default_rng(k).uniform(-1, 1, s).astype(np.float32) for k, s in shapes.items()
    }
    for k in shapes:
        kv.init(k, mx.nd.array(init[k]))
    # The reference: the same optimizer run on the summed gradients in this process alone.
    ref = make(name)
    tx = ref.transformation()
    weights = {k: jnp.asarray(v) for k, v in init.items()}
    states = {k: tx.init(weights[k]) for k in shapes}

    @jax.jit  # compiled as the store's push is (XLA's fusions round as the store's do)
    def update(g, state, w, scalars):
        u, state = tx.update(g, state, w, scalars=scalars)
        return jaxkv._src.core.updater.apply_updates(w, u), state

    own = rank % 2 == 1 and name not in SAME_ORDER
    order = sorted(shapes, reverse=True) if own else sorted(shapes)
    for step in range(steps):
        outs = {}
        for k in order:  # each process in its own order, one key at a time
            parts = [grad(step, k, rank, d) for d in range(len(local))]
            kv.push(k, [mx.nd.array(x, ctx=mx.cpu(d)) for d, x in enumerate(parts)])
            outs[k] = mx.nd.zeros(shapes[k])
            kv.pull(k, out=outs[k])
        rows = ref.next_update(sorted(shapes))
        for i, k in enumerate(sorted(shapes)):
            parts = [grad(step, k, r, d) for r in range(workers) for d in range(len(local))]
            g = jnp.asarray(np.sum(parts, axis=0))  # exact: see grad
            weights[k], states[k] = update(g, states[k], weights[k], rows[i])
        for k in sorted(shapes):
            check(f"{name} step {step} key {k}", outs[k].asnumpy(), weights[k])
        assert opt.num_update == ref.num_update, (opt.num_update, ref.num_update)
    print(f"rank {rank} ok {name} with a schedule, keys in each process's own order", flush=True)


def main():
    names = sys.argv[2].split(",")
    rank, workers, local = jax.process_index(), jax.process_count(), jax.local_devices()
    for name in names:
        kv = mx.kv.create("dist_sync")
        assert (kv.rank, kv.num_workers) == (rank, workers)
        if name in ("sgd", "adam"):
            train(kv, name, rank, workers, local, STEPS, SHAPES)
        else:  # every other optimizer: fewer keys (2-D: GroupAdaGrad's) and steps
            train(kv, name, rank, workers, local, 3, {0: SHAPES[0], 2: SHAPES[2]})
    kv = mx.kv.create("dist_sync")
    kv.init(0, mx.nd.array(np.ones(SHAPES[0], np.float32)))
    name = names[0]
    # Processes that change the learning rate differently are refused, before anything moves.
    if name == "sgd":
        plain = mx.optimizer.SGD(learning_rate=0.1)
        kv.set_optimizer(plain)
        plain.set_learning_rate(0.1 * (rank + 1))
        before = kv.pull(0)

        def refused(what, push):
            """``push`` (then a read) is refused on every process, uncounted, nothing moved."""
            try:
                push()
                mx.nd.waitall()
            except jaxkv.KVStoreError as e:
                assert "the same numbers" in str(e), e
                assert plain.num_update == 0 and plain._index_update_count == {}  # not counted
                check(f"different learning rates refused{what}", kv.pull(0), before)
            else:
                raise AssertionError(f"different learning rates were accepted{what}")

        refused("", lambda: kv.push(0, mx.nd.ones(SHAPES[0])))
        # The same for the pushes that are not held: a pushpull, and a row-sparse push.
        out = mx.nd.zeros(SHAPES[0])
        refused(" in a pushpull", lambda: kv.pushpull(0, mx.nd.ones(SHAPES[0]), out=out))
        rows = mx.nd.sparse.row_sparse_array((np.ones((2, 3), np.float32), [0, 2]), shape=SHAPES[0])
        refused(" in a row-sparse push", lambda: kv.push(0, rows))
        plain.set_learning_rate(0.1)  # alike again: both pushes go through
        kv.pushpull(0, mx.nd.ones(SHAPES[0]), out=out)
        kv.push(0, rows)
        check("alike learning rates pushed", plain.num_update, 2)
    kv.barrier()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
