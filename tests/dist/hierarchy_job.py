"""Run by tests/test_dist.py through ``python -m jaxkv.launch``: a ``dist_sync`` store's pushes
sum within each process first, then across processes, and equal a plain NumPy sum.

Every rank draws the same pseudo-random plan (seeded), so each knows what the others push:
per step, each key gets values from some of this process's devices (none, one, several, the
same device twice), integer-valued so that every order of summation gives the same floats.
Prints ``rank R ok NAME`` per check; any failure raises, so the process exits non-zero.
"""

import os

import jax
import numpy as np
import optax

import jaxkv
import jaxkv.mx as mx

# A scalar, small ones, and one above the big-array bound (1e6 elements).
SHAPES = {"s": (), "v": (3,), "m": (5, 4), "big": (1020, 1000), "i": (6,)}
DTYPES = {"i": np.int32}


def check(name, got, want):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)
    print(f"rank {jax.process_index()} ok {name}", flush=True)


def plan(rng, workers, local):
    """For each rank, key: the devices (indices into the local devices) that push, and the
    values they push."""
    out = {}
    for rank in range(workers):
        for key, shape in SHAPES.items():
            n = int(rng.integers(1, 4))
            devices = [int(d) for d in rng.integers(0, local, n)]  # repeats allowed
            dtype = DTYPES.get(key, np.float32)
            values = [rng.integers(-8, 9, shape).astype(dtype) for _ in devices]
            out[rank, key] = (devices, values)
    return out


def run(kv, name, steps, workers, rank, local, updater=None, lr=0.5):
    keys = list(SHAPES)
    kv.init(keys, [mx.nd.zeros(SHAPES[k], dtype=DTYPES.get(k, np.float32)) for k in keys])
    if updater is not None:
        kv.set_optimizer(updater)
    model = {k: np.zeros(SHAPES[k], DTYPES.get(k, np.float32)) for k in keys}
    rng = np.random.default_rng(1234)
    for step in range(steps):
        p = plan(rng, workers, len(local))
        values = [
            [mx.nd.array(v, ctx=mx.cpu(d), dtype=v.dtype) for d, v in zip(*p[rank, k])]
            for k in keys
        ]
        kv.push(keys, values)
        for k in keys:
            total = sum(v for r in range(workers) for v in p[r, k][1])
            new = total if updater is None else model[k] - lr * total
            model[k] = new.astype(model[k].dtype)  # as optax's apply_updates: to the stored dtype
        outs = [
            [
                mx.nd.zeros(SHAPES[k], mx.cpu(i), DTYPES.get(k, np.float32))
                for i in range(len(local))
            ]
            for k in keys
        ]
        kv.pull(keys, out=outs)
        for k, os_ in zip(keys, outs):
            for o in os_:
                check(f"{name} step {step} key {k}", o.asnumpy(), model[k])


def main():
    os.environ["MXNET_KVSTORE_BIGARRAY_BOUND"] = str(1 << 40)  # every value whole
    kv = mx.kv.create("dist_sync")
    rank, workers, local = kv.rank, kv.num_workers, jax.local_devices()
    # One copy per process, on its first device.
    assert [d.process_index for d in kv.state.devices] == list(range(workers))
    assert not kv.state.is_sharded(SHAPES["big"])
    run(kv, "assign", 2, workers, rank, local)
    kv2 = mx.kv.create("dist_sync")
    run(kv2, "sgd", 2, workers, rank, local, updater=optax.sgd(0.5))
    # Float values pushed to an int key, and a float16 one to a float32 key, are cast first.
    kv3 = mx.kv.create("dist_sync")
    kv3.init(["f"], [mx.nd.zeros((4,))])
    kv3.push("f", [mx.nd.ones((4,), mx.cpu(i), dtype=np.float16) for i in range(len(local))])
    check("float16 pushed to float32", kv3.pull("f"), np.full(4, workers * len(local), np.float32))
    # By default (MXNet's bound, 1M elements) big values are split across the processes, and
    # sums stay exact.
    os.environ.pop("MXNET_KVSTORE_BIGARRAY_BOUND")
    kv4 = mx.kv.create("dist_sync")
    assert kv4.state.is_sharded(SHAPES["big"])
    run(kv4, "split", 2, workers, rank, local, updater=optax.sgd(0.5))
    # A functional store over every device of every process: the flat sum, same numbers.
    state = jaxkv.init(jaxkv.empty(jax.devices()), {"w": np.zeros((8, 3), np.float32)})
    state = jaxkv.push(state, "w", [jax.device_put(np.ones((8, 3), np.float32), d) for d in local])
    got = jaxkv.pull(state, "w", devices=local[:1])
    check("flat store", got, np.full((8, 3), workers * len(local), np.float32))
    # The same with the value split across every device: pulled whole onto this process's.
    state = jaxkv.init(jaxkv.empty(jax.devices(), bigarray_bound=4), {"w": np.zeros((12, 3))})
    assert state.is_sharded((12, 3))
    rows = [np.arange(36, dtype=np.float32).reshape(12, 3) + d.id for d in local]
    state = jaxkv.push(state, "w", [jax.device_put(r, d) for r, d in zip(rows, local)])
    want = sum(np.arange(36, dtype=np.float32).reshape(12, 3) + d.id for d in jax.devices())
    check("flat split store", jaxkv.pull(state, "w", devices=local), want)
    # A mean counts every process's values: here process r pushes from its first r + 1
    # devices (all of them from the last), so the counts differ across processes.
    state = jaxkv.init(jaxkv.empty(jax.devices(), reduce="mean"), {"m": np.zeros(3, np.float32)})
    mine = [jax.device_put(np.full(3, 2.0 * (rank + 1), np.float32), d) for d in local[: rank + 1]]
    state = jaxkv.push(state, "m", mine)
    counts = [min(r + 1, len(local)) for r in range(workers)]
    total = np.float32(sum(2.0 * (r + 1) * c for r, c in enumerate(counts)))  # exact
    want = total / np.float32(sum(counts))  # divided once, in float32
    # Within an ulp: XLA divides by a constant as a product with its reciprocal (as pmean's
    # division); exact where the count is a power of two.
    got = jaxkv.pull(state, "m", devices=local[:1])
    np.testing.assert_allclose(np.asarray(got), np.full(3, want), rtol=2**-23, atol=0)
    print(f"rank {rank} ok mean across processes", flush=True)
    # Each key divided by its own count: ["a", "a", "b"] from every process's first device
    # gives "a" two contributions per process and "b" one.
    state = jaxkv.init(
        jaxkv.empty(jax.devices(), reduce="mean"),
        {"a": np.zeros(3, np.float32), "b": np.zeros(3, np.float32)},
    )
    r1 = np.float32(rank + 1)
    values = [np.full(3, r1), np.full(3, 3 * r1), np.full(3, r1)]
    state = jaxkv.push(state, ["a", "a", "b"], [jax.device_put(v, local[0]) for v in values])
    ranks = np.arange(1, workers + 1, dtype=np.float32)
    want_a, want_b = np.float32(4 * ranks.sum()) / np.float32(2 * workers), ranks.mean()
    for k, want in (("a", want_a), ("b", want_b)):
        got = np.asarray(jaxkv.pull(state, k, devices=local[:1]))
        np.testing.assert_allclose(got, np.full(3, want), rtol=2**-22, atol=0, err_msg=k)
    print(f"rank {rank} ok mean per key across processes", flush=True)
    # A value spread over several processes' devices is refused: it is nobody's contribution.
    before = np.asarray(kv.pull("v"))
    whole = jax.device_put(np.ones(SHAPES["v"], np.float32), kv.state.sharding)
    try:
        kv.push("v", whole)
    except jaxkv.KVStoreError as e:
        assert "several processes" in str(e), e
        check("global value refused, nothing changed", kv.pull("v"), before)
    else:
        raise AssertionError("a global array was accepted")
    kv.barrier()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
