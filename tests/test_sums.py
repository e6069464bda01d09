"""Every route a pushed value takes to its sum, against NumPy.

A push lays out each key's per-device values (one value as is, one block per device in mesh
order or any order, several values on one device, values of mixed dtypes) and sums them with one
of several collectives chosen by size: small values fused into one ``psum``, mid-size ones
(16K-256K elements, first dimension divisible by D) fused into one reduce-scatter, big ones
reduce-scattered one by one. Several keys of each kind go through one call, so a mix-up between
keys shows. The data are small integers, so every sum is exact in any order.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _devices import cpu_empty, cpu_store

import jaxkv
import jaxkv._src.mxnet.kvstore
from jaxkv import nd

D = 8
SHAPES = {
    "scalar": (),
    "small": (3,),
    "odd": (9, 8),  # first dimension not divisible by 8: never split
    "mid_a": (64, 256),  # 16K elements: fused reduce-scatter
    "mid_b": (128, 256),
    "mid_c": (8, 2048),
    "big": (512, 512),  # 256K elements: reduce-scattered alone
}
HALF = {"mid_h": (64, 256), "small_h": (5,)}  # a second dtype in the same call


def add(key, pushed, stored):
    return stored + pushed


def values_for(rng, shapes, dtype, n):
    return {k: [rng.integers(-4, 5, s).astype(dtype) for _ in range(n)] for k, s in shapes.items()}


@pytest.fixture(scope="module")
def stores():
    """Stores over 8 devices with the default bound (big values sharded), with everything
    replicated, and with a bound of 16 (even tiny values sharded)."""
    out = {}
    bounds = {"default": cpu_empty().bigarray_bound, "replicated": None, "16": 16}
    for name, bound in bounds.items():
        state = cpu_empty(bigarray_bound=bound)
        init = {k: jnp.ones(s, jnp.float32) for k, s in SHAPES.items()}
        init.update({k: jnp.ones(s, jnp.bfloat16) for k, s in HALF.items()})
        out[name] = jaxkv.init(state, init)
    return out


@pytest.mark.parametrize("bound", ["default", "replicated", "16"])
@pytest.mark.parametrize("pattern", ["all in order", "some shuffled", "repeats"])
def test_every_key_gets_its_own_sum(stores, devices, bound, pattern):
    state = stores[bound]
    rng = np.random.default_rng(hash((bound, pattern)) % 2**32)
    if pattern == "all in order":
        where = list(range(D))
    elif pattern == "some shuffled":
        where = [5, 0, 3]
    else:
        where = [2, 2, 6]  # two values on one device: summed there in call order
    pushed = values_for(rng, SHAPES, np.float32, len(where))
    pushed.update(values_for(rng, HALF, jnp.bfloat16, len(where)))
    new = jaxkv.push(
        state,
        {k: [jax.device_put(x, devices[d]) for x, d in zip(xs, where)] for k, xs in pushed.items()},
        updater=add,
    )
    for k, xs in pushed.items():
        expected = 1 + np.sum([x.astype(np.float32) for x in xs], axis=0)
        got = np.asarray(new[k]).astype(np.float32)
        np.testing.assert_array_equal(got, expected, err_msg=f"key {k!r}")
        assert new[k].dtype == state[k].dtype
        assert new[k].sharding == state[k].sharding, k  # the store's layout is kept


def _documented(bound):
    """The keys a store over 8 devices with ``bound`` shards, by the documented rule: at least
    ``bound`` elements, not a scalar, rows dividing over the devices."""
    shapes = {**SHAPES, **HALF}
    return sorted(
        k
        for k, s in shapes.items()
        if bound is not None and s and math.prod(s) >= bound and s[0] % D == 0
    )


def test_sharded_and_replicated_layouts_are_as_documented(stores):
    for state in stores.values():  # (the default store's bound is whatever the default is)
        assert [k for k in state.keys() if state.is_sharded(state[k].shape)] == _documented(
            state.bigarray_bound
        )
    assert _documented(1 << 14) == ["big", "mid_a", "mid_b", "mid_c", "mid_h"]
    assert _documented(16) == ["big", "mid_a", "mid_b", "mid_c", "mid_h"]
    assert _documented(1 << 17) == ["big"] and _documented(None) == []


def test_mixed_dtypes_from_different_devices_are_cast_before_the_sum(devices):
    state = jaxkv.init(
        cpu_empty(bigarray_bound=16),
        {"f": jnp.zeros((8, 4)), "i": jnp.zeros(3, jnp.int32), "h": jnp.zeros(2, jnp.float16)},
    )
    f = [  # the first value's dtype is not the stored one
        jax.device_put(np.full((8, 4), 2, np.int16), devices[1]),
        jax.device_put(np.full((8, 4), 1.5, np.float32), devices[0]),
        jax.device_put(jnp.full((8, 4), 0.25, jnp.bfloat16), devices[2]),
    ]
    i = [
        jax.device_put(np.full(3, 7, np.int32), devices[3]),
        jax.device_put(np.full(3, 2, np.int8), devices[4]),
    ]
    h = [
        jax.device_put(np.full(2, 3, np.int8), devices[7]),
        jax.device_put(np.full(2, 0.5, np.float16), devices[6]),
    ]
    new = jaxkv.push(state, {"f": f, "i": i, "h": h})
    np.testing.assert_array_equal(np.asarray(new["f"]), np.full((8, 4), 3.75, np.float32))
    np.testing.assert_array_equal(np.asarray(new["i"]), np.full(3, 9, np.int32))
    np.testing.assert_array_equal(np.asarray(new["h"]), np.full(2, 3.5, np.float16))
    assert [new[k].dtype for k in ("f", "h", "i")] == [jnp.float32, jnp.float16, jnp.int32]


@pytest.mark.parametrize("chunk_bytes", [1, 64 << 20], ids=["one key per chunk", "one chunk"])
def test_a_pull_of_many_sharded_keys_fills_every_out(monkeypatch, chunk_bytes):
    monkeypatch.setenv("MXNET_KVSTORE_BIGARRAY_BOUND", "16")
    monkeypatch.setattr(jaxkv._src.mxnet.kvstore, "_GATHER_CHUNK_BYTES", chunk_bytes)
    kv = cpu_store("device")
    shapes = {3: (16, 4), 4: (8, 8), 5: (3,), 6: (32, 2), 7: (24,)}
    rng = np.random.default_rng(1)
    data = {k: rng.integers(-9, 10, s).astype(np.float32) for k, s in shapes.items()}
    kv.init(list(data), [nd.array(x) for x in data.values()])
    assert sum(kv.state.is_sharded(s) for s in shapes.values()) == 4
    keys = [3, 5, 4, 6, 7, 3]  # a repeat too
    outs = [[nd.full(shapes[k], -1.0, jaxkv.cpu(d)) for d in (1, 6)] for k in keys]
    kv.pull(keys, out=outs)
    for k, pair in zip(keys, outs):
        for o, d in zip(pair, (1, 6)):
            np.testing.assert_array_equal(o.asnumpy(), data[k], err_msg=f"key {k}")
            assert o.context == jaxkv.cpu(d)
