"""Odd values pushed and initialised: other dtypes (refused by jaxkv, cast as MXNet 1.9.1 casts
them by the drop-in, against MXNet's records), values that are not arrays, keys of a million
characters and the size of every message."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxkv
import jaxkv.mx as mx

HERE = os.path.dirname(__file__)
with open(os.path.join(HERE, "..", "conformance", "data", "mxnet_casts.json")) as f:
    CASTS = json.load(f)


def _given(value_dtype):
    with np.errstate(over="ignore", invalid="ignore"):
        return np.array(CASTS["values"], np.float32).astype(value_dtype)


@pytest.mark.parametrize("store", ["local", "device"])
@pytest.mark.parametrize("n", [1, 2])
def test_the_drop_in_casts_a_pushed_value_as_mxnet_does(store, n, devices):
    """Every (key dtype, value dtype) MXNet recorded: the pull after one push from each of n
    devices equals MXNet's bit for bit, and where MXNet failed the push is refused."""
    for name, want in CASTS["pulls"].items():
        s, count, key_dtype, value_dtype = name.split()
        if (s, int(count)) != (store, n):
            continue
        kv = mx.kv.create(store)
        kv.init(0, mx.nd.zeros((len(CASTS["values"]),), dtype=key_dtype))
        pushed = [
            mx.nd.array(_given(value_dtype), ctx=mx.cpu(d), dtype=value_dtype) for d in range(n)
        ]
        if isinstance(want, str):
            if np.can_cast(value_dtype, key_dtype, "safe"):  # a widening: taken, exactly
                want = (_given(value_dtype).astype(key_dtype) * n).astype(np.float64).tolist()
            else:  # MXNet failed: refused, naming the key and dtypes
                with pytest.raises(jaxkv.DtypeError, match=f"key 0: {n} pushed values of dtype"):
                    kv.push(0, pushed)
                continue
        kv.push(0, pushed)
        out = mx.nd.zeros((len(CASTS["values"]),), dtype=key_dtype)
        kv.pull(0, out=out)
        got = out.asnumpy().astype(np.float64)
        assert out.dtype == np.dtype(key_dtype), name
        np.testing.assert_array_equal(got, np.array(want), err_msg=name)


def test_the_drop_in_casts_in_pushpull_and_in_lists_of_keys():
    kv = mx.kv.create("device")
    kv.init([3, 4], [mx.nd.zeros((2,), dtype="uint8"), mx.nd.zeros((2,))])
    out = [mx.nd.zeros((2,), dtype="uint8"), mx.nd.zeros((2,))]
    kv.pushpull([3, 4], [mx.nd.array([300.0, -1.7]), mx.nd.array([1.5, 2.5])], out=out)
    assert out[0].asnumpy().tolist() == [44, 255] and out[1].asnumpy().tolist() == [1.5, 2.5]
    value = mx.nd.array([600.0, 3.9])
    kv.pushpull(3, value)  # into the value itself, as MXNet's pushpull with no out
    assert value.asnumpy().tolist() == [88.0, 3.0]


@pytest.mark.parametrize("make", [lambda: jaxkv.create("local"), lambda: mx.kv.create("local")])
@pytest.mark.parametrize("out_dtype", ["int8", "uint8", "int16"])
def test_a_pull_into_an_out_of_another_dtype_casts_as_mxnet_copies(make, out_dtype):
    """A float value pulled (or pushpulled with no out) into an integer array of another
    dtype is cast as MXNet copies it (C's cast, as x86 runs it: toward zero through int32,
    then the low bits): -159.0 into int8 is 97, where XLA's cast clamps it to -128 (found by
    the deep stateful run, against its NumPy model)."""
    kv = make()
    values = np.array([-159.0, 300.0, 97.5, -1.7, 3.0, 70000.0], np.float32)
    want = np.trunc(values).astype(np.int32).astype(out_dtype)
    kv.init(0, mx.nd.array(values))
    out = mx.nd.zeros((6,), dtype=out_dtype)
    kv.pull(0, out=out)
    assert out.dtype == np.dtype(out_dtype)
    np.testing.assert_array_equal(out.asnumpy(), want)

    def add(key, inp, stored):  # MXNet's in-place updater
        stored += inp

    kv.set_updater(add)
    kv.init(1, mx.nd.array(values))
    handle = mx.nd.zeros((6,), dtype=out_dtype)
    kv.pushpull(1, handle)  # pushed (zeros, widened), then pulled into the handle itself
    np.testing.assert_array_equal(handle.asnumpy(), want)


@pytest.mark.parametrize("make", [jaxkv.create, lambda: None], ids=["KVStore", "core"])
@pytest.mark.parametrize(
    ("stored", "given"),
    [
        ("uint8", "float32"),  # 300 + 300 gave 254, MXNet 88
        ("int32", "float32"),  # 1.7 + 1.7 gave 2
        ("float16", "float32"),  # 70000 + 70000 gave inf
        ("float32", "int32"),  # above 2**24 an int32 is rounded
        ("int8", "uint8"),
        ("bfloat16", "float16"),
    ],
)
def test_a_value_the_key_cannot_hold_is_refused_naming_key_and_dtypes(make, stored, given):
    value = jnp.ones(2, given)
    want = rf"key 'w': the pushed value has dtype {given}, .* key's dtype {stored} .*"
    want += rf"astype\('{stored}'\)"
    kv = make()
    if kv is None:
        state = jaxkv.init(jaxkv.empty(), {"w": jnp.zeros(2, stored)})
        with pytest.raises(jaxkv.DtypeError, match=want):
            jaxkv.push(state, "w", value)
        with pytest.raises(jaxkv.DtypeError, match=want):  # inside the user's jit too
            jax.jit(lambda s, g: jaxkv.push(s, "w", g))(state, value)
        with pytest.raises(TypeError):  # a TypeError as well
            jaxkv.push(state, "w", [value, value])
        assert jaxkv.pull(state, "w").tolist() == [0, 0]
        return
    kv.init("w", jnp.zeros(2, stored))
    with pytest.raises(jaxkv.DtypeError, match=want):
        kv.push("w", value)
    with pytest.raises(jaxkv.DtypeError, match=want):
        kv.pushpull("w", value, out=mx.nd.zeros((2,), dtype=stored))
    assert kv.pull("w").tolist() == [0, 0]  # nothing changed


@pytest.mark.parametrize(
    ("stored", "given"),
    [
        ("float32", "float16"),
        ("float32", "bfloat16"),
        ("int32", "uint8"),
        ("int32", "int8"),
        ("float32", "uint8"),
        ("float16", "bool"),
        ("float32", "float64"),  # NumPy's float64 is JAX's float32 (x64 off)
        ("int32", "int64"),
    ],
)
def test_a_safe_widening_is_taken(stored, given):
    state = jaxkv.init(jaxkv.empty(), {"w": jnp.zeros(2, stored)})
    value = np.array([1, 0], given)
    state = jaxkv.push(state, "w", [value, value])
    assert jaxkv.pull(state, "w").dtype == jnp.dtype(stored)
    assert jaxkv.pull(state, "w").tolist() == [2, 0]


def test_a_python_number_is_taken_by_its_kind():
    state = jaxkv.init(
        jaxkv.empty(), {"i": jnp.zeros((), jnp.uint8), "h": jnp.zeros((), "float16")}
    )
    assert jaxkv.pull(jaxkv.push(state, "i", 3), "i") == 3
    assert jaxkv.pull(jaxkv.push(state, "h", 0.5), "h") == 0.5
    assert jaxkv.pull(jaxkv.push(state, "h", 2), "h") == 2
    with pytest.raises(jaxkv.DtypeError, match="key 'i'"):
        jaxkv.push(state, "i", 1.5)


def test_an_optax_updater_sees_the_refusal_first():
    state = jaxkv.init(jaxkv.empty(), {"w": jnp.zeros(2, jnp.int32)})
    with pytest.raises(jaxkv.DtypeError, match="key 'w'"):
        jaxkv.push(state, "w", jnp.ones(2), updater=optax.sgd(0.1))


NOT_ARRAYS = [None, "hello", {"a": 1}, object(), np.array(["a", "b"])]


@pytest.mark.parametrize("value", NOT_ARRAYS, ids=lambda v: type(v).__name__)
def test_a_value_that_is_not_an_array_is_refused_naming_the_key(value):
    kv, drop_in = jaxkv.create("local"), mx.kv.create("device")
    kv.init(7, mx.nd.zeros((2,)))
    drop_in.init(7, mx.nd.zeros((2,)))
    calls = {
        "init": lambda: kv.init(8, value),
        "push": lambda: kv.push(7, value),
        "pushpull": lambda: kv.pushpull(7, value, out=mx.nd.zeros((2,))),
        "pull": lambda: kv.pull(7, out=value),
        "drop-in push": lambda: drop_in.push(7, value),
        "drop-in init": lambda: drop_in.init(8, value),
    }
    for call, run in calls.items():
        if call == "pull" and value is None:
            continue  # pull(key, out=None) returns the value
        with pytest.raises(jaxkv.KVStoreError, match=r"key [78]") as e:
            run()
        assert len(str(e.value)) < 500, call
    state = jaxkv.init(jaxkv.empty(), {"w": jnp.zeros(2)})
    for run in (lambda: jaxkv.push(state, "w", value), lambda: jaxkv.init(state, "v", value)):
        with pytest.raises(jaxkv.KVStoreError, match="key '[wv]'"):
            run()
    assert kv.pull(7).tolist() == [0, 0] and drop_in.pull(7).tolist() == [0, 0]
    for store in (kv, drop_in):
        with pytest.raises(jaxkv.UnknownKeyError):
            store.pull(8)


def test_a_key_of_a_million_characters_is_shown_shortened():
    key = "k" * 1_000_000
    int_keys = jaxkv.init(jaxkv.empty(), {1: jnp.zeros(2)})
    str_keys = jaxkv.init(jaxkv.empty(), {"w": jnp.zeros(2)})
    kv = jaxkv.create("local")
    kv.init(1, mx.nd.zeros((2,)))
    for run in (
        lambda: jaxkv.push(int_keys, key, jnp.ones(2)),
        lambda: jaxkv.push(str_keys, key, jnp.ones(2)),
        lambda: jaxkv.pull(str_keys, key),
        lambda: kv.push(key, mx.nd.ones((2,))),
        lambda: jaxkv.init(str_keys, key, "not an array"),
    ):
        with pytest.raises(jaxkv.KVStoreError) as e:
            run()
        message = str(e.value)
        assert "(str of 1000000 characters)" in message
        assert len(message) < 1000, message[:300]


def test_no_message_exceeds_a_few_thousand_characters():
    error = jaxkv.KVStoreError("x" * 100_000)
    assert len(str(error)) <= 4000 and "characters]" in str(error)
    assert str(jaxkv.KVStoreError("short")) == "short"
    known = {f"key{i}": jnp.zeros(1) for i in range(50)}
    state = jaxkv.init(jaxkv.empty(), known)
    with pytest.raises(jaxkv.UnknownKeyError, match=r"and 42 more") as e:
        jaxkv.pull(state, "nope")
    assert len(str(e.value)) < 400
