"""MXNet's embedding-loop calls played on an imperative store and on a NumPy model of MXNet's
lazy momentum SGD under a ``FactorScheduler``, call by call, every read and out checked:
tests/test_held_rows_order.py (one process) and tests/dist/held_order_job.py (each process its
own values and rows, the model given their sum).

A call is ``(what, x, y)``: ``("push", key, value)``, ``("push rows", ids, value)``,
``("row_sparse_pull", pushed, ids)`` (this process's pushed ids, or ``ids``), ``("pull", key,
out)`` (``out``: 0 or 1, one of two outs per key used again, or ``None``, a new one), ``("pull
list", out_a, out_b)``, ``("read out", key, out)``, ``("read", key, None)``."""

import numpy as np

import jaxkv.mx as mx

ROWS, W = 16, 4
DENSE = {"a": (W,), "b": (2, 3)}


class Model:
    """MXNet's SGD with momentum (lazy: only a row-sparse push's rows), its num_update and a
    FactorScheduler, call by call."""

    def __init__(self, lr, mu, step, factor):
        self.lr, self.mu, self.step, self.factor = lr, mu, step, factor
        self.w = {"e": np.zeros((ROWS, W))} | {k: np.zeros(s) for k, s in DENSE.items()}
        self.mom = {k: np.zeros_like(v) for k, v in self.w.items()}
        self.count: dict[str, int] = {}
        self.num_update = 0

    def push(self, key, g, ids=None):
        self.count[key] = self.count.get(key, 0) + 1
        self.num_update = max(self.num_update, self.count[key])
        lr = self.lr * self.factor ** max(0, (self.num_update - 1) // self.step)
        at = slice(None) if ids is None else ids
        self.mom[key][at] = self.mu * self.mom[key][at] - lr * g
        self.w[key][at] = self.w[key][at] + self.mom[key][at]


def store(kv, model):
    """``kv`` (an MXNet store) given the model's optimizer and keys, the held inits run."""
    sched = mx.lr_scheduler.FactorScheduler(step=model.step, factor=model.factor, base_lr=model.lr)
    kv.set_optimizer(mx.optimizer.SGD(momentum=model.mu, lazy_update=True, lr_scheduler=sched))
    kv.init("e", mx.nd.zeros((ROWS, W)).tostype("row_sparse"))
    for k, s in DENSE.items():
        kv.init(k, mx.nd.zeros(s))
    kv.pull("a")  # (the held inits run: a push of rows keeps no held init)
    return kv


def own_ids(ids, rank, ranks):
    """A process's ids of a push of rows: ``ids`` (every process's), and across processes one
    of its own."""
    return ids if ranks == 1 else sorted({*ids, (5 * rank + 3) % ROWS})


def play(kv, model, calls, close, rank=0, ranks=1):
    """Make ``calls`` on ``kv`` (process ``rank`` of ``ranks``: its values its rank's multiple)
    and on ``model`` (their sum), checking each read, each out and the values at the end with
    ``close(got, want, what)``."""
    scale, total = rank + 1, sum(range(1, ranks + 1))
    owed = []  # (out, the value it must hold when read, the call)
    pushed = own_ids([0], rank, ranks)
    pool = {(k, i): mx.nd.zeros(s) for k, s in DENSE.items() for i in (0, 1)}
    last = {}  # an out of the pool -> the value of the last pull into it
    for n, (what, x, y) in enumerate(calls):
        at = f"call {n}: {what} {x} {y}"
        if what == "push":
            kv.push(x, mx.nd.ones(DENSE[x]) * y * scale)
            model.push(x, y * total)
        elif what == "push rows":
            pushed = own_ids(x, rank, ranks)
            data = np.full((len(pushed), W), y * scale, np.float32)
            kv.push("e", mx.nd.sparse.row_sparse_array((data, np.array(pushed)), shape=(ROWS, W)))
            g = np.zeros((ROWS, W))
            for r in range(ranks):
                g[own_ids(x, r, ranks)] += y * (r + 1)
            union = sorted({i for r in range(ranks) for i in own_ids(x, r, ranks)})
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
        elif what == "pull list":  # "a" and "b" into an out of each
            kv.pull(["a", "b"], out=[pool["a", x], pool["b", y]])
            last["a", x], last["b", y] = model.w["a"].copy(), model.w["b"].copy()
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
