"""Pushes sum exactly whatever the layout of their values: one value per device in mesh order or
not, some devices only, several values on one device, devices outside the store, mixed dtypes,
scalars, and many keys of several sizes and dtypes summed together in one push.

Every value is distinct per element and per device (whole numbers, so float sums are exact), so a
block summed twice, dropped, misplaced or read at the wrong offset changes the result.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _devices import SPLIT_BOUND, cpu_empty

import jaxkv


def per_device(devices, shape, dtype=np.float32, scale=1):
    """Device i's value: ``(i + 1) * scale + arange`` in ``shape``, on device i."""
    base = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    return [
        jax.device_put(jnp.asarray((i + 1) * scale + base, dtype), d) for i, d in enumerate(devices)
    ]


def host_sum(values, dtype=np.float64):
    return sum(np.asarray(v, dtype) for v in values)


def pulled(state, key):
    return np.asarray(jaxkv.pull(state, key))


@pytest.mark.parametrize("order", ["mesh", "reversed", "some", "one pair swapped"])
@pytest.mark.parametrize("shape", [(), (3,), (2, 5)])
def test_one_value_per_device_in_any_order_is_summed(devices, order, shape):
    s = jaxkv.init(cpu_empty(), {"w": jnp.zeros(shape)})
    values = per_device(devices, shape)
    if order == "reversed":
        values = values[::-1]
    elif order == "some":
        values = [values[6], values[1], values[4]]
    elif order == "one pair swapped":
        values[2], values[3] = values[3], values[2]
    new = jaxkv.push(s, "w", values)
    np.testing.assert_array_equal(pulled(new, "w"), host_sum(values))
    assert new["w"].shape == shape
    assert new["w"].sharding.is_fully_replicated


def test_values_of_mixed_dtypes_are_cast_to_the_stored_dtype_then_summed(devices):
    s = jaxkv.init(cpu_empty(), {"w": jnp.zeros(4, jnp.float32)})
    dtypes = [jnp.float32, jnp.float16, jnp.int16, jnp.bfloat16] * 2
    values = [
        jax.device_put(jnp.arange(4, dtype=dt) * (i + 1), d)
        for i, (dt, d) in enumerate(zip(dtypes, devices))
    ]
    new = jaxkv.push(s, "w", values)
    np.testing.assert_array_equal(pulled(new, "w"), np.arange(4) * 36.0)
    assert new["w"].dtype == jnp.float32


def test_values_of_one_other_dtype_are_summed_in_the_stored_dtype(devices):
    """int8 values whose sum overflows int8 but not the stored float32."""
    s = jaxkv.init(cpu_empty(), {"w": jnp.zeros(2, jnp.float32)})
    values = [jax.device_put(jnp.full(2, 100, jnp.int8), d) for d in devices]
    new = jaxkv.push(s, "w", values)
    np.testing.assert_array_equal(pulled(new, "w"), [800.0, 800.0])


def test_several_values_on_one_device_and_off_store_values_are_summed(devices):
    s = jaxkv.init(jaxkv.empty(devices[:4]), {"w": jnp.zeros(3)})
    a, b, c = per_device(devices[:3], (3,))
    off = jax.device_put(jnp.array([10.0, 20.0, 30.0]), devices[6])  # not a store device
    for values in ([a, a, b], [a, off], [off], [b, a, a, c, off]):
        new = jaxkv.push(s, "w", values)
        np.testing.assert_array_equal(pulled(new, "w"), host_sum(values))
        assert new["w"].sharding.device_set == set(devices[:4])


def test_one_value_is_stored_as_given_on_the_store_devices(devices):
    s = jaxkv.init(jaxkv.empty(devices[2:6]), {"w": jnp.zeros((2, 2), jnp.float16)})
    value = jnp.array([[1.5, 2], [3, 4]], jnp.float16)
    new = jaxkv.push(s, "w", jax.device_put(value, devices[7]))
    np.testing.assert_array_equal(pulled(new, "w"), [[1.5, 2], [3, 4]])
    assert new["w"].dtype == jnp.float16
    assert new["w"].sharding.device_set == set(devices[2:6])


def test_duplicate_keys_in_one_push_are_summed_together(devices):
    s = jaxkv.init(cpu_empty(), {0: jnp.zeros(2), 1: jnp.zeros(2)})
    a = per_device(devices, (2,))
    b = per_device(devices[:3], (2,), scale=100)
    new = jaxkv.push(s, [0, 1, 0], [a, jnp.ones(2), b])
    np.testing.assert_array_equal(pulled(new, 0), host_sum(a + b))
    np.testing.assert_array_equal(pulled(new, 1), [1.0, 1.0])


# Sizes around the fusion limits: small values are summed together through one flat buffer per
# dtype; values of 16K elements and more (first dimension divisible by the devices) are
# reduce-scattered, together below 256K elements and one by one above.
SHAPES = {
    "scalar": ((), jnp.float32),
    "small": ((3, 2), jnp.float32),
    "small16": ((5,), jnp.float16),
    "odd": ((7,), jnp.int32),
    "small-b": ((4,), jnp.float32),
    "mid": ((8, 2048), jnp.float32),  # 16K elements: reduce-scattered with others
    "mid-b": ((16, 1030), jnp.float32),
    "mid16": ((2048, 8), jnp.float16),
    "uneven": ((7, 2341), jnp.float32),  # 16K+ elements, but 7 rows: summed whole
    "nine": ((9, 2048), jnp.float32),  # nor 9 rows, though its columns divide by 8
    "flat": ((16384,), jnp.float32),
    "big": ((8, 32768), jnp.float32),  # 256K elements: reduce-scattered alone
    "big-b": ((32, 8200), jnp.float32),
    "big-odd": ((9, 29128), jnp.float32),  # 256K+ elements, 9 rows: summed whole
}


@pytest.mark.parametrize("bound", [None, 1 << 14], ids=["replicated", "sharded"])
def test_many_keys_of_many_sizes_and_dtypes_sum_exactly_in_one_push(devices, bound):
    state = jaxkv.init(
        cpu_empty(bigarray_bound=bound),
        {k: jnp.zeros(shape, dtype) for k, (shape, dtype) in SHAPES.items()},
    )
    values, expected = {}, {}
    for n, (k, (shape, dtype)) in enumerate(sorted(SHAPES.items())):
        if np.issubdtype(dtype, np.floating) and np.finfo(dtype).bits == 16:
            # exact in float16: small whole numbers, one per element, distinct per device
            base = np.arange(int(np.prod(shape))).reshape(shape) % 8
            vs = [jax.device_put(jnp.asarray(base + i, dtype), d) for i, d in enumerate(devices)]
        else:
            vs = per_device(devices, shape, dtype, scale=n + 1)
        values[k] = vs
        expected[k] = host_sum(vs)
    new = jaxkv.push(state, list(values), list(values.values()))
    for k, (shape, dtype) in SHAPES.items():
        got = pulled(new, k)
        assert got.dtype == np.dtype(dtype) and got.shape == shape, k
        np.testing.assert_array_equal(got.astype(np.float64), expected[k], err_msg=k)


def test_a_per_device_push_to_a_sharded_value_keeps_it_sharded(devices):
    s = jaxkv.init(cpu_empty(bigarray_bound=SPLIT_BOUND), {"e": jnp.zeros((64, 512))})
    values = per_device(devices, (64, 512))
    new = jaxkv.push(s, "e", values)
    np.testing.assert_array_equal(pulled(new, "e"), host_sum(values))
    assert not new["e"].sharding.is_fully_replicated
    assert [x.data.shape for x in new["e"].addressable_shards] == [(8, 512)] * 8


def test_a_store_over_some_devices_sums_only_their_values(devices):
    store = devices[1:4]
    s = jaxkv.init(jaxkv.empty(store), {"w": jnp.zeros(6), "v": jnp.zeros((3, 8))})
    w = per_device(store, (6,))
    v = per_device(store[::-1], (3, 8), scale=7)
    new = jaxkv.push(s, ["w", "v"], [w, v])
    np.testing.assert_array_equal(pulled(new, "w"), host_sum(w))
    np.testing.assert_array_equal(pulled(new, "v"), host_sum(v))


@pytest.mark.parametrize(
    "shapes",
    [
        {"p": (3,), "q": (2, 2)},  # two small values: summed together
        {"p": (8, 2048), "q": (16384,)},  # two values of 16K elements: reduce-scattered together
        {"p": (8, 2048), "q": (4, 3), "r": (16, 1024), "s": ()},  # two of each
    ],
    ids=["two small", "two mid", "two of each"],
)
def test_exactly_two_keys_summed_together(devices, shapes):
    state = jaxkv.init(cpu_empty(bigarray_bound=None), {k: jnp.zeros(s) for k, s in shapes.items()})
    values = {
        k: per_device(devices, s, scale=10 * n + 1) for n, (k, s) in enumerate(shapes.items())
    }
    new = jaxkv.push(state, list(values), list(values.values()))
    for k, vs in values.items():
        np.testing.assert_array_equal(pulled(new, k), host_sum(vs), err_msg=k)
