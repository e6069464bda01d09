"""Where a store keeps each value: sharded by rows from exactly the big-array bound on (when the
rows divide by the devices), split padded in a bucket of its own where they do not, replicated
below the bound; and which devices and bounds a store accepts."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _devices import cpu_empty, held_per_device

import jaxkv


def sharded(state, key):
    return not state[key].sharding.is_fully_replicated


ROWS, PADDED, WHOLE = "rows", "padded", "whole"


@pytest.mark.parametrize(
    "shape, bound, expected",
    [
        ((8, 2), 16, ROWS),  # exactly the bound
        ((8, 2), 17, WHOLE),  # one element short
        ((16,), 16, ROWS),
        ((24, 1), 16, ROWS),
        ((12, 2), 16, PADDED),  # 12 rows do not divide by 8 devices
        ((4, 4), 16, PADDED),  # nor do 4
        ((2, 8, 8), 16, PADDED),
        ((8, 8, 8), 16, ROWS),
        ((), 1, WHOLE),  # a scalar has no rows
        ((8,), 1, ROWS),
        ((8,), None, WHOLE),  # no bound: everything replicated
        ((1024, 64), None, WHOLE),
    ],
)
def test_values_are_sharded_from_the_bound_on(devices, shape, bound, expected):
    s = jaxkv.init(cpu_empty(bigarray_bound=bound), {"k": jnp.ones(shape)})
    assert s.is_sharded(shape) is (expected == ROWS)
    assert s.splits(shape) is (expected != WHOLE)
    held = held_per_device(s, "k")
    assert set(held) == set(devices)
    if expected == ROWS:
        assert sharded(s, "k")
        rows = shape[0] // 8
        assert [x.data.shape[0] for x in s["k"].addressable_shards] == [rows] * 8
    elif expected == PADDED:  # its flattened value's padded eighth on each device
        assert set(held.values()) == {-(-int(np.prod(shape)) // 8) * 4}
    else:
        assert not sharded(s, "k") and set(held.values()) == {4 * int(np.prod(shape))}
    np.testing.assert_array_equal(np.asarray(s["k"]), np.ones(shape))


def test_a_one_device_store_shards_nothing(devices):
    s = jaxkv.init(jaxkv.empty([devices[3]], bigarray_bound=1), {"k": jnp.ones((8, 8))})
    assert s["k"].sharding.device_set == {devices[3]}
    assert not s.is_sharded((8, 8))


def test_the_rows_divide_by_the_store_devices_not_all_devices(devices):
    s = jaxkv.init(jaxkv.empty(devices[:3], bigarray_bound=4), {"k": jnp.ones((6, 2))})
    assert sharded(s, "k")
    assert [x.data.shape for x in s["k"].addressable_shards] == [(2, 2)] * 3
    s = jaxkv.init(jaxkv.empty(devices[:3], bigarray_bound=4), {"k": jnp.ones((8, 2))})
    assert not sharded(s, "k")


def test_optimizer_state_follows_its_value(devices):
    s = jaxkv.init(cpu_empty(bigarray_bound=64), {"w": jnp.ones((16, 4)), "b": jnp.ones(4)})
    sgd = optax.sgd(0.5, momentum=0.5)
    s = jaxkv.push(s, ["w", "b"], [jnp.ones((16, 4)), jnp.ones(4)], updater=sgd)
    b_trace, w_trace = jax.tree_util.tree_leaves(s.opt_states[("b", "w")])
    assert w_trace.shape == (16, 4) and not w_trace.sharding.is_fully_replicated
    assert b_trace.sharding.is_fully_replicated
    np.testing.assert_array_equal(np.asarray(s["w"]), np.full((16, 4), 0.5))


def test_stores_take_devices_or_contexts(devices):
    assert jaxkv.empty().devices == tuple(jax.local_devices())
    assert jaxkv.empty([jaxkv.cpu(2), devices[5]]).devices == (devices[2], devices[5])
    assert jaxkv.empty(d for d in devices[:2]).devices == tuple(devices[:2])


@pytest.mark.parametrize(
    "devs, pattern",
    [
        ([], "expected a non-empty list of JAX devices, given"),
        ([0, 1], "non-empty list of JAX devices"),
        ("dup", "expected distinct devices"),
    ],
)
def test_stores_refuse_what_is_not_distinct_devices(devices, devs, pattern):
    if devs == "dup":
        devs = [devices[0], devices[1], devices[0]]
    with pytest.raises(jaxkv.KVStoreError, match=pattern):
        jaxkv.empty(devs)


@pytest.mark.parametrize("bound", [0, -5, 2.5, "16", True])
def test_the_bound_is_a_positive_int_or_none(bound):
    with pytest.raises(
        jaxkv.KVStoreError, match="bigarray_bound: expected a positive int, None or 'default'"
    ):
        cpu_empty(bigarray_bound=bound)
    assert cpu_empty(bigarray_bound=1).bigarray_bound == 1
    assert cpu_empty(bigarray_bound=None).bigarray_bound is None


def test_the_default_bound_is_16k_elements(devices, monkeypatch):
    monkeypatch.delenv("JAXKV_BIGARRAY_BOUND", raising=False)
    s = jaxkv.init(
        cpu_empty(), {"at": jnp.zeros((8, 2048)), "below": jnp.zeros((8, 2047), jnp.int8)}
    )
    assert s.bigarray_bound == 16384 == cpu_empty(bigarray_bound="default").bigarray_bound
    assert sharded(s, "at") and not sharded(s, "below")
    assert s.placement.is_sharded((8, 2048)) and not s.placement.is_sharded((8, 2047))


@pytest.mark.parametrize("text, bound", [("64", 64), (" 100000 ", 100000), ("none", None)])
def test_the_environment_sets_the_default_bound(devices, monkeypatch, text, bound):
    monkeypatch.setenv("JAXKV_BIGARRAY_BOUND", text)
    s = jaxkv.init(cpu_empty(), {"k": jnp.zeros((8, 8))})
    assert s.bigarray_bound == bound
    assert sharded(s, "k") == (bound == 64) == s.placement.is_sharded((8, 8))
    assert cpu_empty(bigarray_bound=16).bigarray_bound == 16  # given: the environment unread


@pytest.mark.parametrize("text", ["0", "-3", "16k", "1e4"])
def test_a_default_bound_that_is_not_a_count_is_refused_naming_the_variable(monkeypatch, text):
    monkeypatch.setenv("JAXKV_BIGARRAY_BOUND", text)
    with pytest.raises(jaxkv.KVStoreError, match="JAXKV_BIGARRAY_BOUND: expected a positive"):
        cpu_empty()


@pytest.mark.parametrize("kind", ["2bit", "fp16", "bf16"])
def test_compressed_stores_hold_only_floating_point_values(kind):
    params = {"type": kind}
    state = cpu_empty(compression=params)
    with pytest.raises(jaxkv.KVStoreError, match="expects a floating-point value"):
        jaxkv.init(state, {"i": jnp.zeros(3, jnp.int32)})
    for dtype in (jnp.float32, jnp.float16, jnp.bfloat16):
        s = jaxkv.init(state, {"f": jnp.zeros(3, dtype)})
        assert s["f"].dtype == dtype


def test_a_two_device_store_shards_big_values(devices):
    s = jaxkv.init(jaxkv.empty(devices[4:6], bigarray_bound=8), {"k": jnp.arange(8.0)})
    assert sharded(s, "k") and s.is_sharded((8,))
    assert [np.asarray(x.data).tolist() for x in s["k"].addressable_shards] == [
        [0.0, 1.0, 2.0, 3.0],
        [4.0, 5.0, 6.0, 7.0],
    ]


def test_empty_takes_its_devices_by_name_and_its_options_only_by_name(devices):
    s = jaxkv.empty(devices=devices[:2], bigarray_bound=None)
    assert s.devices == tuple(devices[:2]) and s.bigarray_bound is None
    with pytest.raises(TypeError):
        jaxkv.empty(devices[:2], 4)
