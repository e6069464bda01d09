"""What a pull hands out: the stored arrays themselves, or copies on exactly the devices asked for,
for replicated and sharded values of several dtypes; and row_sparse_pull's row selection."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _devices import SPLIT_BOUND, cpu_empty

import jaxkv


@pytest.fixture
def state():
    # "e" has 16K elements with rows divisible by 8: stored sharded, one eighth per device.
    return jaxkv.init(
        cpu_empty(bigarray_bound=SPLIT_BOUND),
        {
            "w": jnp.arange(6.0).reshape(2, 3),
            "e": jnp.arange(16384, dtype=jnp.float32).reshape(64, 256),
            "h": (jnp.arange(8 * 2048) % 251).astype(jnp.bfloat16).reshape(8, 2048),
            "i": jnp.arange(16384, dtype=jnp.int8).reshape(128, 128),
        },
    )


def test_without_devices_pull_returns_the_stored_arrays(state):
    assert jaxkv.pull(state, "w") is state["w"]
    assert jaxkv.pull(state, ["e", "w", "e"]) == [state["e"], state["w"], state["e"]]
    assert not state["e"].sharding.is_fully_replicated


def test_the_store_devices_get_replicated_values_as_they_are(state, devices):
    assert jaxkv.pull(state, "w", devices=devices) is state["w"]
    assert jaxkv.pull(state, "w", devices=list(state.devices)) is state["w"]
    reordered = jaxkv.pull(state, "w", devices=devices[::-1])
    np.testing.assert_array_equal(reordered, state["w"])


@pytest.mark.parametrize("key", ["w", "e", "h", "i"])
@pytest.mark.parametrize("where", [[0], [3], [1, 5], list(range(8))])
def test_pulls_land_on_exactly_the_devices_asked_for(state, devices, key, where):
    target = [devices[i] for i in where]
    out = jaxkv.pull(state, key, devices=target if len(target) > 1 else target[0])
    assert out.sharding.device_set == set(target)
    assert out.sharding.is_fully_replicated
    assert out.dtype == state[key].dtype
    np.testing.assert_array_equal(np.asarray(out), np.asarray(state[key]))
    for shard in out.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(state[key]))


def test_contexts_name_devices_too(state, devices):
    out = jaxkv.pull(state, "e", devices=[jaxkv.cpu(2), jaxkv.cpu(4)])
    assert out.sharding.device_set == {devices[2], devices[4]}
    np.testing.assert_array_equal(np.asarray(out), np.asarray(state["e"]))


@pytest.mark.parametrize("bad", [[], "cpu", [0, 1], "dup"])
def test_devices_must_be_distinct_devices(state, devices, bad):
    if bad == "dup":
        bad = [devices[1], devices[1]]
    with pytest.raises(jaxkv.KVStoreError, match="devices: expected a device or a list of"):
        jaxkv.pull(state, "w", devices=bad)


def test_pulls_to_devices_inside_jit_are_refused(state, devices):
    with pytest.raises(jaxkv.KVStoreError, match="expected an eager call"):
        jax.jit(lambda s: jaxkv.pull(s, "w", devices=devices[:2]))(state)


def test_pulled_copies_are_independent_of_the_store(state, devices):
    out = jaxkv.pull(state, "e", devices=devices[:2])
    new = jaxkv.push(state, "e", jnp.zeros((64, 256)), donate=True)
    np.testing.assert_array_equal(np.asarray(out)[1], np.arange(256, 512))
    assert not np.asarray(jaxkv.pull(new, "e")).any()


# -- row_sparse_pull --------------------------------------------------------------------------
@pytest.fixture
def table():
    return jaxkv.init(cpu_empty(), {"e": jnp.arange(1.0, 13.0).reshape(4, 3)})


def rows_of(values, keep, rows=4):
    out = np.zeros_like(np.asarray(values))
    for r in keep:
        out[r] = np.asarray(values)[r]
    return out


@pytest.mark.parametrize(
    "ids, keep",
    [
        ([3], [3]),
        ([0], [0]),
        ([], []),
        ([2, 2, 0], [0, 2]),
        ([[1], [3]], [1, 3]),
        (np.array([3.0, 1.0], np.float32), [1, 3]),
        (np.array([1, 2], np.uint8), [1, 2]),
        (jnp.array([0, 3]), [0, 3]),
        (2, [2]),
    ],
)
def test_row_sparse_pull_keeps_exactly_the_rows_asked_for(table, ids, keep):
    out = jaxkv.row_sparse_pull(table, "e", ids)
    np.testing.assert_array_equal(np.asarray(out), rows_of(table["e"], keep))
    assert out.sharding.is_fully_replicated and out.dtype == table["e"].dtype


@pytest.mark.parametrize("ids", [[4], [-1], [0, 5], [0.5], [2, 3.25], np.array([True])])
def test_row_ids_that_name_no_row_are_refused(table, ids):
    with pytest.raises(jaxkv.KVStoreError, match=r"row_ids expected integers in \[0, 4\)"):
        jaxkv.row_sparse_pull(table, "e", ids)


def test_row_sparse_pull_of_a_scalar_is_refused():
    s = jaxkv.init(cpu_empty(), {"s": jnp.float32(1)})
    with pytest.raises(jaxkv.ShapeError, match="expects a value with rows, given a scalar"):
        jaxkv.row_sparse_pull(s, "s", [0])


def test_row_sparse_pull_of_a_sharded_value_to_devices(state, devices):
    out = jaxkv.row_sparse_pull(state, "e", [63, 0, 9], devices=[devices[6]])
    assert out.sharding.device_set == {devices[6]}
    np.testing.assert_array_equal(np.asarray(out), rows_of(state["e"], [0, 9, 63]))


def test_row_sparse_pull_inside_jit_keeps_the_traced_rows(table):
    pick = jax.jit(lambda s, ids: jaxkv.row_sparse_pull(s, "e", ids))
    np.testing.assert_array_equal(pick(table, jnp.array([3, 0])), rows_of(table["e"], [0, 3]))
    np.testing.assert_array_equal(pick(table, jnp.array([[1, 1]])), rows_of(table["e"], [1]))


def test_row_sparse_pull_of_a_vector_keeps_its_elements():
    s = jaxkv.init(cpu_empty(), {"v": jnp.arange(1.0, 6.0)})
    np.testing.assert_array_equal(jaxkv.row_sparse_pull(s, "v", [4, 1]), [0, 2, 0, 0, 5])


def test_row_sparse_pull_of_a_closed_over_store_with_traced_ids(table):
    pick = jax.jit(lambda ids: jaxkv.row_sparse_pull(table, "e", ids))
    np.testing.assert_array_equal(pick(jnp.array([2])), rows_of(table["e"], [2]))
    np.testing.assert_array_equal(pick(jnp.array([-1, 4, 0])), rows_of(table["e"], [0]))
