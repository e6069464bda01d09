"""Run by tests/test_dist_loops.py under ``python -m jaxkv.launch -n N --devices-per-process 1``:
random sequences of MXNet's embedding-loop calls on a ``dist_sync`` store give, on every
process, the values of the calls run one by one in call order with every process's values
summed: a NumPy model of MXNet's lazy momentum SGD under a ``FactorScheduler``.

Every process draws the same sequence (one seed) and pushes values of its own (its rank's
multiple; its own rows of the table beside rows every process pushes): dense pushes, held pulls
into new outs and into outs used again (a pull into an out a held pull owes runs what is held
up to it), pushes of rows (which keep the pushes held before them, agreed with their
``row_sparse_pull``), the same key pushed again after them, ``row_sparse_pull`` of this
process's pushed ids or of others, and reads. Every read and every out is checked against the
model. Prints ``rank R ok random calls`` and ``rank R done``.

    held_order_job.py STEPS SEED
"""

import sys

import jax
import numpy as np

import jaxkv.mx as mx

ROWS, W = 16, 4
DENSE = {"a": (W,), "b": (2, 3)}
LR, MU, STEP, FACTOR = 0.5, 0.9, 6, 0.8
RANK = jax.process_index()
ALL = jax.process_count()


class Model:
    """MXNet's SGD with momentum (lazy: only a row-sparse push's rows), its num_update and a
    FactorScheduler, call by call, on the sum of every process's values."""

    def __init__(self):
        self.w = {"e": np.zeros((ROWS, W))} | {k: np.zeros(s) for k, s in DENSE.items()}
        self.mom = {k: np.zeros_like(v) for k, v in self.w.items()}
        self.count: dict[str, int] = {}
        self.num_update = 0

    def push(self, key, g, ids=None):
        self.count[key] = self.count.get(key, 0) + 1
        self.num_update = max(self.num_update, self.count[key])
        lr = LR * FACTOR ** max(0, (self.num_update - 1) // STEP)
        at = slice(None) if ids is None else ids
        self.mom[key][at] = MU * self.mom[key][at] - lr * g
        self.w[key][at] = self.w[key][at] + self.mom[key][at]


def own_ids(rng_ids, rank):
    """A process's ids of a push of rows: the drawn ids every process pushes, and one of its
    own (rank-dependent)."""
    return sorted({*rng_ids, (5 * rank + 3) % ROWS})


def draw(rng, steps):
    """The calls of ``steps`` loop steps, varied as tests/test_held_rows_order.py's."""
    calls = []
    for _ in range(steps):
        for _ in range(rng.integers(0, 5)):
            kind = rng.integers(0, 5)
            key = ["a", "a", "b"][rng.integers(0, 3)]
            if kind < 2:
                calls.append(("push", key, float(rng.choice([1.0, -2.0, 3.0]))))
            elif kind < 4:
                calls.append(("pull", key, [None, 0, 1][rng.integers(0, 3)]))
            else:
                calls.append(("read out", key, int(rng.integers(0, 2))))
        if rng.integers(0, 5):
            ids = sorted(rng.choice(ROWS, rng.integers(1, 4), replace=False).tolist())
            calls.append(("push rows", ids, float(rng.choice([1.0, -0.5]))))
        for _ in range(rng.integers(0, 3)):
            key = ["a", "a", "b"][rng.integers(0, 3)]
            calls.append(("push", key, float(rng.choice([1.0, -2.0, 3.0]))))
        end = rng.integers(0, 4)
        if end == 0:
            calls.append(("read", ["a", "b", "e"][rng.integers(0, 3)], None))
        elif end < 3:
            ids = sorted(rng.choice(ROWS, rng.integers(1, 4), replace=False).tolist())
            calls.append(("row_sparse_pull", end == 1, ids))
    return calls


def main(steps, seed):
    kv = mx.kv.create("dist_sync")
    sched = mx.lr_scheduler.FactorScheduler(step=STEP, factor=FACTOR, base_lr=LR)
    kv.set_optimizer(mx.optimizer.SGD(momentum=MU, lazy_update=True, lr_scheduler=sched))
    kv.init("e", mx.nd.zeros((ROWS, W)).tostype("row_sparse"))
    for k, s in DENSE.items():
        kv.init(k, mx.nd.zeros(s))
    model = Model()
    owed = []  # (out, the value it must hold when read, the call)
    pool = {(k, i): mx.nd.zeros(s) for k, s in DENSE.items() for i in (0, 1)}
    last = {}  # an out of the pool -> the value of the last pull into it
    pushed = own_ids([0], RANK)
    # float32 against float64: momentum swings a weight by tens and back over a sequence (the
    # summed pushes reach 18), so its rounding reaches 2e-5 (seen: -1.01969 for -1.01967); a
    # call run out of order is off by a push's update, 1e-2 and more
    close = lambda got, want, what: np.testing.assert_allclose(  # noqa: E731
        got, want, rtol=1e-4, atol=2e-4, err_msg=what
    )
    for n, (what, x, y) in enumerate(draw(np.random.default_rng(seed), steps)):
        at = f"call {n}: {what} {x} {y}"
        if what == "push":
            kv.push(x, mx.nd.ones(DENSE[x]) * y * (RANK + 1))
            model.push(x, y * sum(range(1, ALL + 1)))
        elif what == "push rows":
            pushed = own_ids(x, RANK)
            data = np.full((len(pushed), W), y * (RANK + 1), np.float32)
            kv.push("e", mx.nd.sparse.row_sparse_array((data, np.array(pushed)), shape=(ROWS, W)))
            g = np.zeros((ROWS, W))
            for r in range(ALL):
                g[own_ids(x, r)] += y * (r + 1)
            union = sorted({i for r in range(ALL) for i in own_ids(x, r)})
            model.push("e", g[union], union)
        elif what == "row_sparse_pull":
            ids = pushed if x else y
            out = mx.nd.sparse.zeros("row_sparse", (ROWS, W))
            kv.row_sparse_pull("e", out=out, row_ids=mx.nd.array(ids))
            owed.append((out, model.w["e"][ids].copy(), at))
        elif what == "pull" and y is not None:
            kv.pull(x, out=pool[x, y])
            last[x, y] = model.w[x].copy()
        elif what == "pull":
            out = mx.nd.zeros(DENSE[x])
            kv.pull(x, out=out)
            owed.append((out, model.w[x].copy(), at))
        elif what == "read out":
            close(pool[x, y].asnumpy(), last.get((x, y), np.zeros(DENSE[x])), at)
        else:
            close(np.asarray(kv.pull(x)), model.w[x], at)
    for out, want, at in owed:
        close(out.data.asnumpy() if out.stype == "row_sparse" else out.asnumpy(), want, at)
    for (k, i), want in last.items():
        close(pool[k, i].asnumpy(), want, f"the last pull of {k} into out {i}")
    for k, w in model.w.items():
        close(np.asarray(kv.pull(k)), w, f"{k} at the end")
    print(f"rank {RANK} ok random calls", flush=True)
    print(f"rank {RANK} done", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
    sys.stdout.flush()
