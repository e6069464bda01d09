"""Run by tests/test_dist_stress.py under ``python -m jaxkv.launch -n N``: every process runs the
same seeded random sequence of KVStore calls on a ``dist_sync`` store, with no waits between
them, and checks every value it reads against a NumPy model of the store.

    stress_job.py SEED OPS DIR [BOUND]

The calls: ``init``, ``push``, ``push_each`` (one key at a time, push then pull into outs, in
each process's own shuffled order), ``pull``, ``pushpull``, ``set_optimizer`` (and back to the
default assign), ``save``, ``load``, ``barrier``, ``row_sparse_pull`` (into dense and into
row-sparse outs), a push of row-sparse values (``row_push``), and a refused push (a
wrong shape), drawn from ``random.Random(SEED)``, the same in every process. Values are small
integers and the optimizer is ``optax.sgd(1.0, momentum=1.0)``, so every sum and update is exact
in float32 in any order, and the model's values are compared exactly. ``BOUND`` (optional) is
MXNet's big-array bound: values with at least that many elements are split across the
processes, so pulls all-gather them too. Checkpoints go to ``DIR/save-<i>``.

Each process prints ``rank R ok OPS ops CHECKS checks SEQUENCE`` at the end; a wrong value
raises, naming the op, the call and the key, and so does a host value put on several
processes' devices outside a collective turn (JAX's check of it is a collective).
"""

import copy
import os
import random
import sys

SEED, OPS, DIRECTORY = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
VERBOSE = bool(os.environ.get("JAXKV_STRESS_VERBOSE"))  # each call, to stderr
if len(sys.argv) > 4:
    os.environ["MXNET_KVSTORE_BIGARRAY_BOUND"] = sys.argv[4]

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxkv  # noqa: E402
import jaxkv.mx as mx  # noqa: E402

# Rows divisible by 2 and 3 processes, so that big values split evenly. "e" is big enough
# (96 KiB) that its sum across processes is still running when the next call starts.
SHAPES = {"a": (6, 3), "b": (5,), "c": (3, 2), "e": (384, 64)}
SUBSETS = [("a",), ("b",), ("c",), ("e",), ("a", "b"), ("c", "e"), ("a", "b", "c", "e")]
OPTIMIZER = optax.sgd(1.0, momentum=1.0)  # integer updates: exact in float32
WEIGHTS = {
    "init": 3,
    "push": 6,
    "push_each": 4,
    "pull": 3,
    "pushpull": 3,
    "set_optimizer": 1,
    "save": 2,
    "load": 1,
    "barrier": 1,
    "row_sparse_pull": 2,
    "row_push": 2,
    "bad_push": 1,
}


class Model:
    """What the store should hold: values, optimizer groups and each key's momentum."""

    def __init__(self):
        self.values = {}  # key -> float32 array
        self.groups = {}  # key -> its optimizer group (a sorted tuple), if it has one
        self.trace = {}  # key -> float32 momentum, for keys in a group
        self.optimizer = False

    def row_push(self, key, rows, total):
        """A push of row-sparse values: assign makes the rows not pushed zero (MXNet replaces
        the stored value); an optimizer updates only the rows pushed (lazily)."""
        if not self.optimizer:
            self.values[key] = np.zeros(SHAPES[key], np.float32)
            self.values[key][rows] = total
            return
        if key not in self.groups:
            self.groups[key], self.trace[key] = (key,), np.zeros(SHAPES[key], np.float32)
        self.trace[key][rows] = total + self.trace[key][rows]
        self.values[key][rows] = self.values[key][rows] - self.trace[key][rows]

    def push(self, keys, total):
        if not self.optimizer:
            for k in keys:
                self.values[k] = total[k]
            return
        group = tuple(sorted(keys))
        for k in keys:
            if k not in self.groups:
                self.groups[k], self.trace[k] = group, np.zeros(SHAPES[k], np.float32)
            self.trace[k] = total[k] + self.trace[k]
            self.values[k] = self.values[k] - self.trace[k]


def pushable(model, keys):
    """Whether an optax push of ``keys`` is allowed: exactly one group, or all without one."""
    if not model.optimizer:
        return True
    groups = {model.groups.get(k) for k in keys}
    if groups == {None}:
        return True
    return len(groups) == 1 and next(iter(groups)) == tuple(sorted(keys))


def _in_turns_only():
    """JAX puts a host value on several processes' devices only after an all-gather that
    checks every process gives the same one: a collective. Outside a collective turn it could
    meet an earlier computation's collectives still running in another process (gloo: "Received
    data size doesn't match expected size", once in a few 3-process runs); here every such
    check must come in a turn, which fails at once where one does not."""
    from jax.experimental import multihost_utils

    from jaxkv._src.processes import order

    real = multihost_utils.assert_equal

    def checked(*args, **kwargs):
        assert order.in_turn(), "a host value put across processes outside a collective turn"
        return real(*args, **kwargs)

    multihost_utils.assert_equal = checked


def main():
    _in_turns_only()
    rng = random.Random(SEED)
    mine = random.Random(f"{SEED} {jax.process_index()}")  # this process's own push orders
    kv = jaxkv.create("dist_sync")  # jaxkv's own store: row_sparse_pull fills dense outs too
    rank, processes, local = kv.rank, kv.num_workers, jax.local_devices()
    # Each step's values: the same draw in every process, scaled per process and device.
    ranks = sum(r + 1 for r in range(processes))
    devices = sum(d + 1 for d in range(len(local)))
    model, saves, checks, seen = Model(), [], 0, []

    def check(what, key, got, want):
        nonlocal checks
        got = np.asarray(got)
        if got.shape != want.shape or not np.array_equal(got, want):
            raise AssertionError(
                f"rank {rank} op {len(seen)} ({' '.join(seen[-6:])}): {what} of key {key!r}: "
                f"expected {want.ravel()[:8].tolist()}, given {got.ravel()[:8].tolist()}"
            )
        checks += 1

    def draw(keys):
        """Per key, the integer base value, this process's per-device pushes and the total."""
        base = {k: np.float32(rng.randint(-2, 2)) * np.ones(SHAPES[k], np.float32) for k in keys}
        for k in keys:
            base[k] = base[k] + np.arange(base[k].size, dtype=np.float32).reshape(SHAPES[k]) % 3
        pushes = {
            k: [
                mx.nd.array(base[k] * (rank + 1) * (d + 1), ctx=mx.cpu(d))
                for d in range(len(local))
            ]
            for k in keys
        }
        total = {k: base[k] * np.float32(ranks * devices) for k in keys}
        return pushes, total

    def outs(keys):
        return [[mx.nd.zeros(SHAPES[k], mx.cpu(d)) for d in range(len(local))] for k in keys]

    for _ in range(OPS):
        ready = sorted(model.values)
        fresh = [k for k in SHAPES if k not in model.values]
        op = rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()))[0]
        if op != "init" and not ready:
            op = "init"
        if op == "init" and not fresh:
            op = "push"
        if op == "load" and not saves:
            op = "save"
        subsets = [s for s in SUBSETS if all(k in model.values for k in s)]
        if op == "row_sparse_pull" and not [k for k in ready if len(SHAPES[k]) == 2]:
            op = "pull"
        tables = [k for k in ready if len(SHAPES[k]) == 2 and pushable(model, (k,))]
        if op == "row_push" and not tables:
            op = "pull"
        if op in ("push", "pushpull"):
            subsets = [s for s in subsets if pushable(model, s)]
            if not subsets:
                op = "pull"
        # One key at a time: each key its own optimizer group.
        each = [s for s in subsets if all(pushable(model, (k,)) for k in s)]
        if op == "push_each" and not each:
            op = "pull"
        seen.append(op)
        if VERBOSE:
            os.write(2, f"rank {rank} op {len(seen)} {op}\n".encode())
        if op == "init":
            k = rng.choice(fresh)
            value = np.full(SHAPES[k], rng.randint(-3, 3), np.float32)
            # Only rank 0's value counts.
            kv.init(k, mx.nd.array(value + 100 * rank))
            model.values[k] = value
        elif op in ("push", "pushpull"):
            keys = list(rng.choice(subsets))
            pushes, total = draw(keys)
            model.push(keys, total)
            if op == "push":
                kv.push(keys, [pushes[k] for k in keys])
            else:
                got = outs(keys)
                kv.pushpull(keys, [pushes[k] for k in keys], out=got)
                for k, o in zip(keys, got):
                    for x in o:
                        check("pushpull", k, x.asnumpy(), model.values[k])
        elif op == "push_each":
            # As Gluon's Trainer: push(i) then pull(i, out) per key, in this process's own order
            # (held, then matched by key across the processes).
            keys = list(rng.choice(each))
            pushes, total = draw(keys)
            for k in keys:
                model.push([k], total)
            got = dict(zip(keys, outs(keys)))
            order = list(keys)
            mine.shuffle(order)
            for k in order:
                kv.push(k, pushes[k], priority=-keys.index(k))
                kv.pull(k, out=got[k], priority=-keys.index(k))
            for k in keys:
                for x in got[k]:
                    check("push one key at a time", k, x.asnumpy(), model.values[k])
        elif op == "pull":
            keys = list(rng.choice(subsets))
            if rng.random() < 0.5:
                for k, x in zip(keys, kv.pull(keys)):
                    check("pull", k, x, model.values[k])
            else:
                got = outs(keys)
                kv.pull(keys, out=got)
                for k, o in zip(keys, got):
                    for x in o:
                        check("pull into outs", k, x.asnumpy(), model.values[k])
        elif op == "set_optimizer":
            if model.optimizer:
                kv.set_updater(None)  # assign again; optimizer states stay
                model.optimizer = False
            else:
                kv.set_optimizer(OPTIMIZER)  # another updater before it: states start afresh
                model.optimizer, model.groups, model.trace = True, {}, {}
        elif op == "save":
            path = os.path.join(DIRECTORY, f"save-{len(saves)}")
            kv.save(path)
            saves.append((path, copy.deepcopy(model)))
        elif op == "load":
            path, saved = rng.choice(saves)
            if saved.groups and not model.optimizer:
                try:
                    kv.load(path)
                except jaxkv.KVStoreError as e:
                    assert "set_optimizer" in str(e), e
                else:
                    raise AssertionError(f"rank {rank}: load of {path} without optimizer passed")
            else:
                optimizer = model.optimizer
                kv.load(path)
                model = copy.deepcopy(saved)
                model.optimizer = optimizer
        elif op == "barrier":
            kv.barrier()
        elif op == "row_sparse_pull":
            k = rng.choice([k for k in ready if len(SHAPES[k]) == 2])
            rows = sorted(rng.sample(range(SHAPES[k][0]), rng.randint(0, SHAPES[k][0])))
            want = np.zeros(SHAPES[k], np.float32)
            want[rows] = model.values[k][rows]
            if rng.random() < 0.5:
                check("row_sparse_pull", k, kv.row_sparse_pull(k, row_ids=mx.nd.array(rows)), want)
            elif rng.random() < 0.5:
                got = outs([k])[0]
                kv.row_sparse_pull(k, out=got, row_ids=mx.nd.array(rows))
                for x in got:
                    check("row_sparse_pull into outs", k, x.asnumpy(), want)
            else:  # row-sparse outs, each device asking for its own rows
                got = [
                    mx.nd.sparse.zeros("row_sparse", SHAPES[k], ctx=mx.cpu(d))
                    for d in range(len(local))
                ]
                asked = [rows[d:] for d in range(len(local))]
                kv.row_sparse_pull(k, out=got, row_ids=[mx.nd.array(a) for a in asked])
                for x, a in zip(got, asked):
                    kept = np.zeros(SHAPES[k], np.float32)
                    kept[a] = model.values[k][a]
                    check("row_sparse_pull into row-sparse outs", k, x.asnumpy(), kept)
        elif op == "row_push":
            k = rng.choice(tables)
            rows = sorted(rng.sample(range(SHAPES[k][0]), rng.randint(1, min(5, SHAPES[k][0]))))
            base = (
                np.float32(rng.randint(-2, 2))
                + np.arange(len(rows) * SHAPES[k][1], dtype=np.float32).reshape(
                    len(rows), SHAPES[k][1]
                )
                % 3
            )
            values = [
                mx.nd.sparse.row_sparse_array(
                    (base * (rank + 1) * (d + 1), np.array(rows)), shape=SHAPES[k], ctx=mx.cpu(d)
                )
                for d in range(len(local))
            ]
            kv.push(k, values)
            model.row_push(k, rows, base * np.float32(ranks * devices))
        elif op == "bad_push":
            k = rng.choice(ready)
            try:
                kv.push(k, mx.nd.zeros((7, 7)))
            except jaxkv.KVStoreError:
                pass
            else:
                raise AssertionError(f"rank {rank}: a push of shape (7, 7) to {k!r} passed")
    # Whatever is left in flight, then every key once more.
    for k in sorted(model.values):
        check("final pull", k, kv.pull(k), model.values[k])
    kv.barrier()
    os.write(1, f"rank {rank} ok {OPS} ops {checks} checks {' '.join(seen)}\n".encode())


if __name__ == "__main__":
    main()
