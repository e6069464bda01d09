"""The imperative store's pulls into outs: every out gets its key's value on its own device and in
its own dtype, outs that cannot be filled are refused before anything changes, and what the store
handed out stays valid across later pushes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _devices import cpu_store

import jaxkv
from jaxkv import nd

BIG = (64, 512)  # 32K elements, rows divisible by 8: stored sharded


@pytest.fixture
def kv():
    store = cpu_store("device")
    store.init(
        ["a", "b", "c", "s"],
        [
            nd.array(np.arange(6.0).reshape(2, 3)),
            nd.array(np.arange(BIG[0] * BIG[1], dtype=np.float32).reshape(BIG)),
            nd.array(-np.arange(BIG[0] * BIG[1], dtype=np.float32).reshape(BIG)),
            nd.array(np.full(BIG, 7.0, np.float32)),
        ],
    )
    return store


def expected(key):
    n = BIG[0] * BIG[1]
    return {
        "a": np.arange(6.0).reshape(2, 3),
        "b": np.arange(n, dtype=np.float32).reshape(BIG),
        "c": -np.arange(n, dtype=np.float32).reshape(BIG),
        "s": np.full(BIG, 7.0, np.float32),
    }[key]


def test_one_pull_of_many_replicated_and_sharded_keys_fills_every_out(kv, devices):
    keys = ["s", "a", "c", "b"]
    outs = [[nd.zeros(expected(k).shape, jaxkv.cpu(i)) for i in (0, 5)] for k in keys]
    kv.pull(keys, out=outs)
    for k, pair in zip(keys, outs):
        for o, i in zip(pair, (0, 5)):
            np.testing.assert_array_equal(o.asnumpy(), expected(k), err_msg=k)
            assert o.context == jaxkv.cpu(i)
            assert o._data.sharding.device_set == {devices[i]}


def test_outs_keep_their_dtype(kv):
    out16 = nd.zeros((2, 3), dtype=np.float16)
    out64 = nd.zeros(BIG, dtype=np.int32)
    kv.pull(["a", "b"], out=[out16, out64])
    assert out16.dtype == np.float16 and out64.dtype == np.int32
    np.testing.assert_array_equal(out16.asnumpy(), expected("a").astype(np.float16))
    np.testing.assert_array_equal(out64.asnumpy(), expected("b").astype(np.int32))


def test_outs_on_devices_outside_the_store_are_filled_there(devices):
    kv = jaxkv.KVStore("device", devices=devices[:2])
    kv.init([1, 2], [nd.ones((2, 2)) * 3, nd.array(np.arange(16384.0).reshape(64, 256))])
    outs = [nd.zeros((2, 2), jaxkv.cpu(6)), nd.zeros((64, 256), jaxkv.cpu(7))]
    kv.pull([1, 2], out=outs)
    assert outs[0].context == jaxkv.cpu(6) and outs[1].context == jaxkv.cpu(7)
    np.testing.assert_array_equal(outs[0].asnumpy(), np.full((2, 2), 3.0))
    np.testing.assert_array_equal(outs[1].asnumpy(), np.arange(16384.0).reshape(64, 256))


def test_duplicate_keys_fill_all_their_outs(kv):
    first, second = nd.zeros(BIG, jaxkv.cpu(1)), nd.zeros(BIG, jaxkv.cpu(2))
    kv.pull(["c", "c"], out=[first, second])
    for o in (first, second):
        np.testing.assert_array_equal(o.asnumpy(), expected("c"))


@pytest.mark.parametrize(
    "out, error, pattern",
    [
        (lambda: jnp.zeros((2, 3)), jaxkv.KVStoreError, "out expected a jaxkv.nd.NDArray, given"),
        (lambda: np.zeros((2, 3)), jaxkv.KVStoreError, "given ndarray"),
        (lambda: nd.zeros((3, 2)), jaxkv.ShapeError, r"out has shape \(3, 2\), expected the"),
        (lambda: nd.zeros((2, 3, 1)), jaxkv.ShapeError, r"stored shape \(2, 3\)"),
    ],
)
def test_outs_that_cannot_be_filled_are_refused_first(kv, out, error, pattern):
    good = nd.zeros((2, 3))
    with pytest.raises(error, match=pattern):
        kv.pull(["a", "a"], out=[good, out()])
    with pytest.raises(error, match=pattern):
        kv.pull("a", out=[good, good, out()])  # one key, its outs checked one by one
    assert not good.asnumpy().any()  # nothing filled
    before = np.asarray(kv.pull("a"))
    with pytest.raises(error, match=pattern):
        kv.pushpull("a", nd.ones((2, 3)) * 9, out=[good, out()])
    np.testing.assert_array_equal(np.asarray(kv.pull("a")), before)  # nothing pushed


def test_what_the_store_handed_out_survives_later_pushes(kv):
    state = kv.state
    kv.push(["a", "b"], [nd.ones((2, 3)), nd.ones(BIG)])
    kv.push(["a", "b"], [nd.ones((2, 3)) * 2, nd.ones(BIG) * 2])
    np.testing.assert_array_equal(np.asarray(state["a"]), expected("a"))
    np.testing.assert_array_equal(np.asarray(state["b"]), expected("b"))
    np.testing.assert_array_equal(np.asarray(kv.pull("a")), np.full((2, 3), 2.0))
    # A state handed back in is the store's again and stays valid too.
    kv.state = state
    kv.push("b", nd.ones(BIG) * 5)
    np.testing.assert_array_equal(np.asarray(state["b"]), expected("b"))
    np.testing.assert_array_equal(np.asarray(kv.pull("b")), np.full(BIG, 5.0))


def test_pushes_of_keys_never_handed_out_still_update(kv):
    pulled = kv.pull("a")
    handed = kv.state  # holds every key's current value
    kv.push("s", nd.ones(BIG))  # "s" was handed out: not donated
    del handed
    kv.push("s", nd.ones(BIG) * 3)
    kv.push(["a", "s"], [nd.ones((2, 3)), nd.ones(BIG) * 4])
    np.testing.assert_array_equal(np.asarray(kv.pull("s")), np.full(BIG, 4.0))
    np.testing.assert_array_equal(np.asarray(pulled), expected("a"))


def test_pull_without_out_returns_copies_on_every_store_device(kv, devices):
    a, b = kv.pull(["a", "b"])
    for x, k in ((a, "a"), (b, "b")):
        assert x.sharding.device_set == set(devices) and x.sharding.is_fully_replicated
        np.testing.assert_array_equal(np.asarray(x), expected(k))
    kv.push("b", nd.zeros(BIG))
    np.testing.assert_array_equal(np.asarray(b), expected("b"))
    assert isinstance(kv.pull("a"), jax.Array)


def test_a_one_device_store_fills_outs_on_any_device(devices):
    kv = jaxkv.KVStore("local", devices=[devices[3]])
    kv.init("w", nd.array(np.arange(4.0)))
    outs = [nd.zeros(4, jaxkv.cpu(i)) for i in (3, 0, 7)]
    kv.pull("w", out=outs)
    for o, i in zip(outs, (3, 0, 7)):
        assert o.context == jaxkv.cpu(i)
        np.testing.assert_array_equal(o.asnumpy(), np.arange(4.0))
