"""jaxkv/_src/core/reduce.py: the reduction's name checked, each key's divisor, the division in
the sum's dtype, and the count of a mapped axis."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv._src.core import reduce as _reduce


def test_a_reduction_is_sum_or_mean():
    assert _reduce.check("mean") == "mean"
    with pytest.raises(jaxkv.KVStoreError, match=r"reduce: expected one of \['sum', 'mean'\]"):
        _reduce.check("max")
    state = jaxkv.empty(reduce="mean")
    assert _reduce.effective(state, None) == "mean"
    assert _reduce.effective(state, "sum") == "sum"


def test_each_key_gets_its_own_divisor():
    state = jaxkv.init(
        jaxkv.empty(), {"a": jnp.zeros(2), "b": jnp.zeros(2), "i": jnp.zeros(2, jnp.int32)}
    )
    assert _reduce.divisors(state, ["a", "b"], [2, 1], "mean") == (2, 1)
    assert _reduce.divisors(state, ["a", "b"], [2, 1], "mean", each=4) == (8, 4)
    assert _reduce.divisors(state, ["a", "b"], [1, 1], "mean") is None  # nothing divided
    assert _reduce.divisors(state, ["a", "b"], [2, 3], "sum") is None
    assert _reduce.divisors(state, ["i"], [1], "mean") is None  # one value: no division
    with pytest.raises(jaxkv.KVStoreError, match="key 'i': reduce='mean' expects a floating"):
        _reduce.divisors(state, ["a", "i"], [1, 2], "mean")


def test_the_division_is_in_the_sums_dtype_and_once_per_value():
    x16 = jnp.full(3, 3.0, jnp.float16)
    got = _reduce.divide([jnp.full(2, 6.0), x16, jnp.ones(2)], (3, 2, 1))
    np.testing.assert_array_equal(got[0], [2.0, 2.0])
    assert got[1].dtype == jnp.float16
    np.testing.assert_array_equal(got[1], np.full(3, 1.5, np.float16))
    assert _reduce.divide(["x"], None) == ["x"]


def test_a_mapped_axis_counts_its_devices(devices):
    mesh = jax.sharding.Mesh(np.array(devices).reshape(2, 4), ("a", "b"))
    spec = jax.sharding.PartitionSpec()

    def count(x):
        return x * _reduce.axis_count(("a",)) + _reduce.axis_count(("a", "b"))

    f = jax.shard_map(count, mesh=mesh, in_specs=spec, out_specs=spec)
    assert float(jax.jit(f)(jnp.float32(10.0))) == 28.0  # 10 * 2 + 8
