"""Run by tests/test_dist.py under ``python -m jaxkv.launch -n 2 --devices-per-process 1``:
MXNet's embedding loop on a ``dist_sync`` store whose push of rows is kept between host
agreements (``rows/inband.py``), with the dense key's push held before it, against the same
calls agreed on the host each time.

A table split over the processes (lazy Adam under a schedule: new numbers at every step) and a
dense key; at every step each process pushes the dense key (held), pushes its own rows and
``row_sparse_pull``s them. Kept, the push agrees the dense push held before it in its own
computation (their digest in its words) and makes it in that computation too (its gradients
riding behind the words, summed in process order on every process): no host all-gather and
one computation a step. Mid-loop one process's ``row_sparse_pull`` is refused,
then the processes hold different calls before the push, then their weight decays differ:
every process refuses each, with the store as it was, and the loop goes on. The whole sequence
runs twice, kept and not, from the same state: every pulled row, the dense key and the table
must be equal to the bit, and every refusal the same. Then a functional pushpull_rows pulling
other ids than it pushes while a push without a pull is kept, and pushes where one process
alone may not donate (a held pull, a lent table, ``kv.state`` kept) or reads its own way
(``asnumpy`` or ``nd.waitall``): every process must still run one program. Prints
``rank R ok CHECK``.
"""

import os
import sys

os.environ["MXNET_KVSTORE_BIGARRAY_BOUND"] = "16"  # (the 64 x 4 table split, the bias whole)
os.environ.setdefault("JAXKV_COLLECTIVE_TIMEOUT", "30")  # (a process waiting alone: ended soon)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxkv  # noqa: E402
import jaxkv.mx as mx  # noqa: E402
from jaxkv._src.processes import host, order  # noqa: E402
from jaxkv._src.rows import inband  # noqa: E402
from jaxkv._src.state import placement  # noqa: E402
from same_calls import assert_same  # noqa: E402  (tests/dist)

R, W, STEPS, GROWN = 64, 4, 10, 6  # (the step whose counts outgrow the class)
RANK, LAST, ALL = jax.process_index(), jax.process_count() - 1, jax.process_count()


def ok(name):
    print(f"rank {RANK} ok {name}", flush=True)


def refused(call, says):
    """What ``call()`` raised: whether its message holds ``says``; fails where it does not
    raise."""
    try:
        call()
    except jaxkv.KVStoreError as e:
        return says in str(e)
    raise AssertionError(f"not refused (expected {says!r})")


def sequence(kept):
    """MXNet's loop and its refusals, with pushes kept or not: every pulled row and value, each
    refusal's verdict, and the host all-gathers of each step."""
    inband.ENABLED = kept
    kv = mx.kv.create("dist_sync")
    sched = mx.lr_scheduler.FactorScheduler(step=1, factor=0.9, base_lr=0.1)
    opt = mx.optimizer.Adam(learning_rate=None, lazy_update=True, lr_scheduler=sched)
    kv.set_optimizer(opt)
    start = np.arange(R * W, dtype=np.float32).reshape(R, W) / 64
    kv.init("emb", mx.nd.array(start).tostype("row_sparse"))
    kv.init("bias", mx.nd.zeros((W,)))
    out = mx.nd.sparse.zeros("row_sparse", (R, W))
    bias = mx.nd.zeros((W,))
    rng = np.random.default_rng(7 + RANK)
    seen, gathers, turns, stepped = [], [], [], []
    count, gather = [], host._mine
    host._mine = lambda x: count.append(1) or gather(x)
    turn = order._Order.turn

    def counted(self, what, watch):  # (each computation or host collective across processes)
        turns[-1].append(what)
        return turn(self, what, watch)

    order._Order.turn = counted
    copied, pulled, copy = [], [], placement._copies

    def copying(values):  # (each copy computation of stored values)
        copied.append(len(values))
        return copy(values)

    placement._copies = copying

    def step(i):
        # (the first two: the most of the others, so that the class they keep fits them all)
        n = 20 if i == GROWN else 10 if i < 2 else int(rng.integers(4, 11))
        ids = np.sort(rng.choice(R, n, replace=False)).astype(np.int32)
        g = rng.normal(size=(n, W)).astype(np.float32)
        before = len(count)
        turns.append([])
        # (process 0 pushes two values, summed before the others': as many as it has)
        dense = [mx.nd.ones((W,)) * (i + 1)] + ([mx.nd.ones((W,)) * 0.5] if RANK == 0 else [])
        kv.push("bias", dense, priority=-1)
        kv.push("emb", mx.nd.sparse.row_sparse_array((g, ids), shape=(R, W)))
        kv.row_sparse_pull("emb", out=out, row_ids=mx.nd.array(ids))
        seen.append(out.data.asnumpy())
        made = len(copied)
        kv.pull("bias", out=bias, priority=-1)
        seen.append(bias.asnumpy())
        pulled.append(len(copied) - made)
        gathers.append(len(count) - before)
        stepped.append(list(turns[-1]))

    def bad_pull():
        kv.push("bias", mx.nd.ones((W,)))
        kv.push("emb", mx.nd.sparse.row_sparse_array((np.ones((1, W), np.float32), [5]), (R, W)))
        ids = [R + 3] if RANK == LAST else [5]
        kv.row_sparse_pull("emb", out=out, row_ids=mx.nd.array(ids))

    def different():
        if RANK == 0:
            kv.push("bias", mx.nd.ones((W,)))
        kv.push("emb", mx.nd.sparse.row_sparse_array((np.ones((1, W), np.float32), [3]), (R, W)))
        kv.row_sparse_pull("emb", out=out, row_ids=mx.nd.array([3]))

    try:
        for i in range(STEPS):
            step(i)
        seen.append(refused(bad_pull, "row_ids" if RANK == LAST else "refused on"))
        for i in range(STEPS, STEPS + 3):  # (the refused pull's held pushes run at the first)
            step(i)
        seen.append(refused(different, "process 0: init [], push ['bias']"))
        for i in range(STEPS + 3, STEPS + 6):
            step(i)
        counted = opt.num_update
        opt.wd = 0.01 * RANK  # (numbers that differ: every process refuses)
        seen.append(refused(lambda: step(STEPS + 6), "the same numbers"))
        assert opt.num_update == counted, (opt.num_update, counted)
        opt.wd = 0.0
        for i in range(STEPS + 7, STEPS + 10):
            step(i)
        seen.append(np.asarray(kv.pull("emb")))
        seen.append(np.asarray(kv.pull("bias")))
    finally:
        host._mine = gather
        order._Order.turn = turn
        placement._copies = copy
        inband.ENABLED = True
    return seen, gathers, stepped[:STEPS], pulled[:STEPS]


def pulls_held_before(who=None):
    """MXNet's loop with the dense key pulled before the push of rows (a held pull the push
    keeps, which must read the value before the push): agreed on the host each step, with no
    kept push tried first (a push kept with calls it can neither make nor run after it would
    start every step with a computation that cannot agree). The turns of each step."""
    kv = mx.kv.create("dist_sync")
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1, lazy_update=True))
    kv.init("emb2", mx.nd.zeros((R, W)).tostype("row_sparse"))
    kv.init("bias2", mx.nd.zeros((W,)))
    out, bias = mx.nd.sparse.zeros("row_sparse", (R, W)), mx.nd.zeros((W,))
    turns, turn = [], order._Order.turn

    def counted(self, what, watch):
        turns[-1].append(what)
        return turn(self, what, watch)

    order._Order.turn = counted
    try:
        for i in range(5):
            turns.append([])
            ids = np.array([RANK, 10 + i], np.int32)
            kv.push("bias2", mx.nd.ones((W,)))
            if who is None or RANK == who:  # (a pull of a whole value: each process's own)
                kv.pull("bias2", out=bias)
            kv.push("emb2", mx.nd.sparse.row_sparse_array((np.ones((2, W), np.float32), ids), (R, W)))
            kv.row_sparse_pull("emb2", out=out, row_ids=mx.nd.array(ids))
            out.data.asnumpy()
            want = np.full(W, -0.1 * ALL * (i + 1), np.float32)
            np.testing.assert_array_equal(np.asarray(kv.pull("bias2")), want)
            if who is None or RANK == who:
                np.testing.assert_array_equal(bias.asnumpy(), want)
    finally:
        order._Order.turn = turn
    return turns


def functional_pull_of_other_ids():
    """A functional push of rows without a pull, kept; then a pushpull_rows of a list of pairs
    pulling other ids than it pushes: the rows pulled, as pull_rows gives them after the push
    (not the kept class's nothing)."""
    table = np.arange(R * W, dtype=np.float32).reshape(R, W)
    state = jaxkv.init(jaxkv.empty(jax.devices(), bigarray_bound=16), {"t": table})
    sgd = optax.sgd(1.0)
    for _ in range(3):  # (agreed twice, then kept)
        state = jaxkv.push_rows(state, "t", [RANK], jnp.ones((1, W)), updater=sgd)
    others = [np.array([10 + RANK, 40], np.int32)]
    state, got = jaxkv.pushpull_rows(
        state, "t", [np.array([RANK], np.int32)], [jnp.ones((1, W))], pull_ids=others, updater=sgd
    )
    want = jaxkv.pull_rows(state, "t", others[0])
    assert len(got) == 1, got
    assert np.array_equal(np.asarray(got[0]), np.asarray(want)), (got, want)
    table[: jax.process_count()] -= 4.0
    assert np.array_equal(np.asarray(want), table[others[0]]), want


def held_on_one(split):
    """MXNet's loop on a table ``split`` over the processes (its push kept) or whole (agreed on
    the host each step), where process 0 alone holds what the store handed out: ``kv.state``,
    kept past the next pushes, or (a whole table) the stored table lent to a dense pull's out.
    That process may not donate its table to the push, the others may: every process must
    still run one program (JAX 0.12 pairs the collectives of one compiled program alone; a
    donating one is another). Returns whether what process 0 holds kept its values, and the
    table against the NumPy model."""
    n = R if split else 3  # (3 x 4: under the bound of 16, whole on every process)
    kv = mx.kv.create("dist_sync")
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.5, lazy_update=True))
    kv.init("t3", mx.nd.zeros((n, W)).tostype("row_sparse"))
    out, lent = mx.nd.sparse.zeros("row_sparse", (n, W)), mx.nd.zeros((n, W))
    model, kept = np.zeros((n, W), np.float32), None
    for i in range(6):
        rows = [np.unique(np.array([r % n, (r + 2 * i + 1) % n], np.int32)) for r in range(ALL)]
        ids = rows[RANK]
        g = np.full((ids.size, W), i + 1, np.float32)
        kv.push("t3", mx.nd.sparse.row_sparse_array((g, ids), (n, W)))
        kv.row_sparse_pull("t3", out=out, row_ids=mx.nd.array(ids))
        out.data.asnumpy()
        for r in rows:
            model[r] -= 0.5 * (i + 1)
        if i == 2:
            if split:  # (every process reads it: only process 0 keeps it)
                state = kv.state
                if RANK == 0:
                    kept = (state, [np.asarray(x.addressable_data(0)) for x in state.leaves])
                del state
            elif RANK == 0:  # (a pull of a whole value: this process's own, lent)
                kv.pull("t3", out=lent)
                kept = (None, lent.asnumpy().copy())
            else:
                mx.nd.waitall()
    same = True
    if kept is not None and split:
        state, was = kept
        now = [np.asarray(x.addressable_data(0)) for x in state.leaves]
        same = all(np.array_equal(x, w) for x, w in zip(now, was))
    elif kept is not None:
        same = np.array_equal(lent.asnumpy(), kept[1])
    return same, np.array_equal(np.asarray(kv.pull("t3")), model)


def dense_state_on_one():
    """Dense pushes of a value split over the processes (SGD with momentum: a state to donate),
    where process 0 alone takes ``kv.state`` and keeps it: that process may not donate what it
    handed out, the others may, and every process must still run one program. Returns whether
    what process 0 holds kept its values, and whether every pull matched the NumPy model."""
    kv = mx.kv.create("dist_sync")
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.5, momentum=0.9))
    kv.init("d", mx.nd.zeros((8, W)))  # (32 elements: split, over the bound of 16)
    out = mx.nd.zeros((8, W))
    w, mom, kept, right = np.zeros((8, W), np.float32), np.zeros((8, W), np.float32), None, True
    for i in range(5):
        kv.push("d", mx.nd.ones((8, W)) * (i + 1))
        kv.pull("d", out=out)
        mom = np.float32(0.9) * mom - np.float32(0.5) * np.float32(ALL * (i + 1))
        w = w + mom
        right = right and np.allclose(out.asnumpy(), w, rtol=1e-6)
        if i == 1 and RANK == 0:  # (after a read every process made: nothing held)
            state = kv.state
            kept = (state, [np.asarray(x.addressable_data(0)) for x in state.leaves])
    same = True
    if kept is not None:
        now = [np.asarray(x.addressable_data(0)) for x in kept[0].leaves]
        same = all(np.array_equal(x, was) for x, was in zip(now, kept[1]))
    return same, right


def state_on_one_after_inits():
    """Keys inited one at a time (whole: under the bound, so the store lays them out only
    when asked), Adam, and process 0 alone taking ``kv.state`` before each push of one key
    while the others read with ``nd.waitall()``: the same held calls run on every process,
    and taking the state must not lay out one process's store alone (its next push of one
    key would be another program than the others'). Returns whether every pull matched the
    NumPy model, and whether each state process 0 took held the values pulled before it."""
    kv = mx.kv.create("dist_sync")
    kv.set_optimizer(mx.optimizer.Adam(learning_rate=0.1))
    kv.init("s8", mx.nd.zeros((8,)))
    kv.init("s12", mx.nd.zeros((3, W)))  # (8 and 12 elements: whole; "s12" never pushed)
    out = mx.nd.zeros((8,))
    w, m, v = (np.zeros(8, np.float32) for _ in range(3))
    right, held = True, True
    for i in range(3):
        if RANK == 0:
            state = kv.state
            held = held and np.allclose(np.asarray(jaxkv.pull(state, "s8")), w)
            held = held and not np.asarray(jaxkv.pull(state, "s12")).any()
        else:
            mx.nd.waitall()
        t = i + 1
        kv.push("s8", mx.nd.ones((8,)) * t)  # (a push of one key: held until the read)
        kv.pull("s8", out=out)
        g = np.full(8, ALL * t, np.float32)
        m = np.float32(0.9) * m + np.float32(0.1) * g
        v = np.float32(0.999) * v + np.float32(0.001) * g * g
        lr = np.float32(0.1 * np.sqrt(1 - 0.999**t) / (1 - 0.9**t))
        w = w - lr * m / (np.sqrt(v) + np.float32(1e-8))
        right = right and np.allclose(out.asnumpy(), w, rtol=1e-5, atol=1e-6)
    return right, held


def reads_differ():
    """MXNet's loop on keys of new shapes (every computation traced at its first call, during
    the loop), each process reading its pulled values its own way: process 0 with
    ``out.asnumpy()``, the others after ``nd.waitall()``. The held calls are the same, so is
    every computation; only what called it first differs, and every process must still compile
    one program. Returns whether every pull matched the NumPy model."""
    kv = mx.kv.create("dist_sync")
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.5, momentum=0.9))
    shapes = {"r7": (7,), "r9": (9, W)}  # (whole; split: 36 elements, over the bound of 16)
    for k, shape in shapes.items():
        kv.init(k, mx.nd.zeros(shape))
    outs = {k: mx.nd.zeros(shape) for k, shape in shapes.items()}
    w = {k: np.zeros(shape, np.float32) for k, shape in shapes.items()}
    mom = {k: np.zeros(shape, np.float32) for k, shape in shapes.items()}
    right = True
    for i in range(3):
        for k, shape in shapes.items():
            kv.push(k, mx.nd.ones(shape) * (i + 1))
            kv.pull(k, out=outs[k])
        if RANK != 0:
            mx.nd.waitall()
        for k in shapes:
            mom[k] = np.float32(0.9) * mom[k] - np.float32(0.5) * np.float32(ALL * (i + 1))
            w[k] = w[k] + mom[k]
            right = right and np.allclose(outs[k].asnumpy(), w[k], rtol=1e-6)
    return right


def main():
    kept, some_steps, kept_turns, kept_copies = sequence(kept=True)
    host_agreed, every_step, agreed_turns, agreed_copies = sequence(kept=False)
    assert_same(kept, host_agreed)
    ok("kept pushes give every row and value host-agreed ones give, to the bit, and the same refusals")
    # The first step agrees the held inits too; the one after the refused pull runs its held
    # pushes alone first (one more agreement each: held, then the push of rows kept with them).
    agreed = [3] + [1] * (STEPS - 1) + [4] + [1] * 2 + [1] * 3 + [1] * 3
    assert every_step == agreed, every_step
    # Kept from the third push on; where the counts grew: one host agreement, kept again at
    # once; after each refusal: agreed twice again, then kept.
    want = [3, 1] + [0] * (STEPS - 2) + [4, 1, 0] + [1, 1, 0] + [1, 1, 0]
    want[GROWN] = 1
    assert some_steps == want, (some_steps, want)
    ok("kept pushes make no host all-gather, the dense push held before them agreed in them")
    # Kept, the dense key's push is made in the push of rows' computation: one computation a
    # step across processes; agreed on the host: the agreement, the dense push, the rows'.
    steady = [t for i, t in enumerate(kept_turns) if i >= 2 and i != GROWN]
    assert all(t == ["push_rows"] for t in steady), kept_turns
    assert all(t.count("push") == 1 for t in agreed_turns[1:]), agreed_turns
    # Its computation makes a spare copy of the dense values too (placement.spare): the pull's
    # out gets it, with no copy computation; pushed on its own, a copy is made at the pull.
    assert all(n == 0 for i, n in enumerate(kept_copies) if i >= 2 and i != GROWN), kept_copies
    assert all(n == 1 for n in agreed_copies), agreed_copies
    ok("kept pushes make the dense push held before them in their own computation")
    functional_pull_of_other_ids()
    ok("a pull of other ids than a kept push's")
    turns = pulls_held_before()
    assert all(t.count("push_rows") == 1 for t in turns), turns
    ok("a push of rows after a held pull is not kept")
    turns = pulls_held_before(who=0)  # (the same keys held on every process: no refusal)
    assert all(t.count("push_rows") == 1 for t in turns), turns
    ok("a push of rows after a held pull on one process only is kept on none")
    for split in (True, False):
        assert held_on_one(split) == (True, True), split
    ok("a table one process alone may not donate: one program everywhere, nothing lost")
    assert dense_state_on_one() == (True, True)
    ok("kv.state held by one process alone: one program everywhere, nothing lost")
    assert state_on_one_after_inits() == (True, True)
    ok("kv.state taken by one process alone after held inits: one program everywhere")
    assert reads_differ()
    ok("each process reading its own way: one program everywhere")
    print(f"rank {RANK} done", flush=True)


if __name__ == "__main__":
    sys.exit(main())
