"""Run by tests/test_dist.py through ``python -m jaxkv.launch``: a functional push of rows
across processes kept between host agreements (``rows/inband.py``), against the same calls
agreed on the host each time.

Each process pushes its own rows of a table split over every process's devices (optax's Adam,
lazy, the table donated) and pulls the ids it pushed (``pushpull_rows``), a count that varies,
grows past its class once, and comes back; one process's bad id is refused mid-loop; then the
processes push two keys of one shape, one each, and pull a kept table's rows. The whole
sequence runs twice, with pushes kept and without, from the same state: every pulled row and
the tables must be equal to the bit, and every refusal the same. Prints ``rank R ok CHECK``
per check.
"""

import os
import sys

os.environ.setdefault("JAXKV_COLLECTIVE_TIMEOUT", "30")  # (a process waiting alone: ended soon)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxkv  # noqa: E402
from jaxkv._src.processes import host  # noqa: E402
from jaxkv._src.rows import inband  # noqa: E402
from same_calls import assert_same  # noqa: E402  (tests/dist)

ROWS, WIDTH, STEPS, GROWN = 128, 4, 14, 8  # (the step whose counts outgrow the class)


def ok(name):
    print(f"rank {jax.process_index()} ok {name}", flush=True)


def batch(rng, step):
    # (the first two: the most of the others, so that the class they keep fits them all)
    n = 40 if step == GROWN else 20 if step < 2 else int(rng.integers(10, 21))
    ids = rng.integers(0, ROWS, n).astype(np.int32)  # (repeats: summed)
    return ids, rng.normal(size=(n, WIDTH)).astype(np.float32)


def sequence(kept):
    """The calls, with pushes kept or not: what every call returned or raised, and how many
    host all-gathers each step of the loop made."""
    inband.ENABLED = kept
    rank, last = jax.process_index(), jax.process_count() - 1
    table = np.arange(ROWS * WIDTH, dtype=np.float32).reshape(ROWS, WIDTH) / 64
    state = jaxkv.init(jaxkv.empty(jax.devices(), bigarray_bound=64), {"t": table, "u": table})
    adam = optax.adam(0.1)
    rng = np.random.default_rng(100 + rank)
    seen, gathers = [], []
    count, gather = [], host._mine
    host._mine = lambda x: count.append(1) or gather(x)

    def step(i):
        nonlocal state
        before = len(count)
        ids, rows = batch(rng, i)
        state, got = jaxkv.pushpull_rows(
            state, "t", ids, jnp.asarray(rows), updater=adam, donate=True
        )
        seen.append(np.asarray(got))
        gathers.append(len(count) - before)

    try:
        for i in range(STEPS):
            step(i)
        # one process's bad id: refused everywhere, nothing changed
        table_before = np.asarray(jaxkv.pull(state, "t", devices=jax.local_devices()[0]))
        bad = np.array([ROWS if rank == last else 0], np.int32)
        try:
            jaxkv.pushpull_rows(state, "t", bad, jnp.ones((1, WIDTH)), updater=adam, donate=True)
        except jaxkv.KVStoreError as e:
            seen.append(str(ROWS) in str(e) if rank == last else "refused on process" in str(e))
        else:
            raise AssertionError("one process's bad id was not refused")
        seen.append(np.asarray(jaxkv.pull(state, "t", devices=jax.local_devices()[0])))
        assert np.array_equal(seen[-1], table_before)
        for i in range(STEPS, STEPS + 3):
            step(i)
        # two keys of one shape, one per process: refused everywhere, naming both
        mine = "t" if rank == 0 else "u"
        try:
            jaxkv.pushpull_rows(
                state, mine, [1, 2], jnp.ones((2, WIDTH)), updater=adam, donate=True
            )
        except jaxkv.KVStoreError as e:
            seen.append("process 0: 't'" in str(e) and "process 1: 'u'" in str(e))
        else:
            raise AssertionError("pushes of two keys, one per process, were not refused")
        for i in range(STEPS + 3, STEPS + 6):
            step(i)
        # a pull of the table while its push is kept
        seen.append(np.asarray(jaxkv.pull_rows(state, "t", np.arange(rank, ROWS, 3))))
        step(STEPS + 6)
        seen.append(np.asarray(jaxkv.pull(state, "t", devices=jax.local_devices()[0])))
        seen.append(np.asarray(jaxkv.pull(state, "u", devices=jax.local_devices()[0])))
    finally:
        host._mine = gather
        inband.ENABLED = True
    return seen, gathers


def main():
    kept, some_steps = sequence(kept=True)
    host_agreed, every_step = sequence(kept=False)
    assert_same(kept, host_agreed)
    ok("kept pushes give every row host-agreed ones give, to the bit, and the same refusals")
    assert every_step == [1] * len(every_step), every_step
    # kept from the third push on; after the refusal, the two keys and the pull: agreed twice
    # again; where the counts grew: one host agreement, kept again at once
    want = [1, 1] + [0] * (STEPS - 2)
    want[GROWN] = 1
    want += [1, 1, 0]  # after the refusal (its class the largest yet: the grown one)
    want += [1, 1, 0]  # after the two keys
    want += [1]  # after the pull
    assert some_steps == want, (some_steps, want)
    ok("kept pushes make no host all-gather")
    # a key made beside a table padded by rows (66 rows, blocks of 17 on 4 devices) after a push
    # of its rows: JAX 0.8's device_put refused the push's result (state/buckets.py, put)
    padded = np.ones((66, WIDTH), np.float32)
    state = jaxkv.init(jaxkv.empty(jax.devices(), bigarray_bound=64), {"p": padded})
    state = jaxkv.push_rows(
        state, "p", [jax.process_index()], np.ones((1, WIDTH), np.float32), updater=optax.sgd(1.0)
    )
    state = jaxkv.init(state, {"q": np.full((2, 2), 3.0, np.float32)})
    padded[: jax.process_count()] = 0.0
    first = jax.local_devices()[0]
    assert np.array_equal(np.asarray(jaxkv.pull(state, "p", devices=first)), padded)
    assert np.array_equal(np.asarray(jaxkv.pull(state, "q", devices=first)), np.full((2, 2), 3.0))
    ok("a key made beside a pushed table padded by rows")
    print(f"rank {jax.process_index()} done", flush=True)


if __name__ == "__main__":
    sys.exit(main())
