"""jaxkv/_src/state/placement.py: fresh copies, per-device blocks stacked in mesh order, values
replicated on exactly the devices asked for, and host copies only of values split over devices."""

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxkv
from jaxkv._src.jax_internals import single_device_sharding
from jaxkv._src.state import buckets, placement

D = 4  # the stores' devices
W = np.arange(16, dtype=np.float32).reshape(8, 2)  # 16 elements: sharded with a bound of 8
A = np.arange(3, dtype=np.float32) + 100
B = np.arange(4, dtype=np.float32).reshape(2, 2) + 200


def _state(devices, layout="auto"):
    """Keys 'a' and 'b' (small) and 'w' (sharded). In the auto layout on CPU, 'a' and 'b'
    share a bucket and 'w' keeps an array of its own; with ``layout='flat'`` all three lie in
    one bucket split over the devices."""
    empty = jaxkv.empty(devices[:D], bigarray_bound=8, layout=layout)
    return jaxkv.init(empty, {"w": jnp.asarray(W), "a": jnp.asarray(A), "b": jnp.asarray(B)})


@pytest.fixture(scope="module")
def state():
    return _state(jax.devices("cpu"))


def _pointers(x):
    return {s.device: s.data.unsafe_buffer_pointer() for s in x.addressable_shards}


def _no_shared_buffer(x, y):
    px, py = _pointers(x), _pointers(y)
    assert all(px[d] != py[d] for d in px.keys() & py.keys())


def test_copies_are_fresh_buffers_with_the_same_values_and_shardings(state):
    values = [state["w"], state["a"]]
    out = placement.copies(values)
    for x, y in zip(values, out):
        assert y.sharding == x.sharding
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
        _no_shared_buffer(x, y)


def test_a_spare_made_beside_a_value_is_its_copy_once_then_copies_are_made(state):
    values = [state["w"], state["a"]]
    made = [jnp.copy(v) for v in values[:1]]  # (a computation's second result, say)
    placement.spare(values[:1], made)
    first = placement.copies(values)
    assert first[0] is made[0]  # the spare, with no computation
    _no_shared_buffer(values[1], first[1])  # the other value copied as before
    np.testing.assert_array_equal(np.asarray(first[1]), np.asarray(values[1]))
    again = placement.copies(values[:1])  # given once: a second out gets a fresh copy
    assert again[0] is not made[0]
    _no_shared_buffer(values[0], again[0])
    np.testing.assert_array_equal(np.asarray(again[0]), np.asarray(values[0]))


def test_a_spare_is_forgotten_with_its_value(state):
    value = jnp.copy(state["w"])
    placement.spare([value], [jnp.copy(value)])
    key = id(value)
    assert key in placement._SPARES
    del value
    gc.collect()
    assert key not in placement._SPARES  # (the spare freed with it: no copy outlives its value)


def test_a_pull_s_outs_copy_only_the_keys_kept_as_arrays_of_their_own(state):
    flat = state.flat_layout
    index = [state.index(k) for k in ["w", "a", "w", "b"]]
    assert [flat.where[i][0] for i in index] == [-1, 0, -1, 0]  # "w" alone, "a" and "b" in bucket 0
    held = state.stored_values
    lent = placement.for_outs(state, index, lend=True)
    assert all(x is held[i] for x, i in zip(lent, index))
    out = placement.for_outs(state, index, lend=False)
    for x, i, own in zip(out, index, [True, False, True, False]):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(held[i]))
        if own:  # a copy: a later push may donate the stored array
            assert x is not held[i] and x.sharding == held[i].sharding
            _no_shared_buffer(x, held[i])
        else:  # the bucket's view is already a fresh array
            assert x is held[i]
    assert out[0] is not out[2]


def test_a_pull_s_outs_under_one_array_per_key_are_all_copies(devices):
    state = _state(devices, layout="keys")
    assert state.flat_layout is None
    index = [state.index("a"), state.index("w")]
    for x, i in zip(placement.for_outs(state, index, lend=False), index):
        assert x is not state.stored_values[i]
        _no_shared_buffer(x, state.stored_values[i])


@pytest.mark.parametrize("agreed", [False, True])
def test_put_places_each_value_with_its_own_sharding(devices, agreed):
    mesh = Mesh(np.array(devices[:D]), ("i",))
    shardings = [
        NamedSharding(mesh, P()),
        NamedSharding(mesh, P("i")),
        single_device_sharding(devices[6]),
    ]
    values = [A, W, B]
    out = placement.put(values, shardings, agreed=agreed)
    for x, v, s in zip(out, values, shardings):
        assert x.sharding == s
        np.testing.assert_array_equal(np.asarray(x), v)


@pytest.mark.parametrize("layout", ["auto", "flat"])
def test_replicated_copies_keep_the_keys_order_whether_split_or_not(devices, layout):
    state = _state(devices, layout)
    keys = ["w", "a", "b", "w"]
    split = [buckets.is_split(state, state.index(k)) for k in keys]
    assert split == ([True, False, False, True] if layout == "auto" else [True] * 4)
    out = placement.replicated_copies(state, keys)
    for x, k in zip(out, keys):
        np.testing.assert_array_equal(np.asarray(x), {"w": W, "a": A, "b": B}[k])
        assert x.is_fully_replicated and x.sharding.device_set == set(state.devices)
    if layout == "auto":
        for x, k in zip(out, keys):
            _no_shared_buffer(x, state[k])


def test_replicated_copies_of_a_split_bucket_s_keys_are_fresh_buffers(devices):
    state = _state(devices, layout="flat")
    assert buckets.is_split(state, state.index("a"))
    (x,) = placement.replicated_copies(state, ["a"])
    np.testing.assert_array_equal(np.asarray(x), A)
    assert x is not state["a"]
    _no_shared_buffer(x, state["a"])


def test_place_constrains_each_leaf_where_the_store_keeps_its_shape(state):
    tree = {"big": jnp.zeros((8, 2)), "rows": jnp.zeros((6, 3)), "small": jnp.zeros(3)}
    out = jax.jit(lambda t: placement.place(state, t))(tree)
    # 16 elements over 4 devices: sharded; 18 elements but 6 rows do not divide by 4: replicated
    assert out["big"].sharding.spec == P("kv")
    assert out["rows"].sharding.is_fully_replicated and out["small"].sharding.is_fully_replicated
    assert out["big"].sharding.mesh == state.mesh


def test_stacked_lays_each_device_s_block_at_its_mesh_position_and_zeros_where_absent(devices):
    # Devices in reverse order: mesh position p holds device 3 - p.
    state = jaxkv.empty(devices[D - 1 :: -1])
    stored = jnp.zeros((2, 3))
    given = {
        devices[1]: np.full((2, 3), 1.0, np.float32),
        devices[3]: np.full((2, 3), 3.0, np.float32),
    }
    blocks = {d: jax.device_put(b, d) for d, b in given.items()}
    out = placement.stacked(state, stored, blocks, jnp.float32)
    assert out.shape == (2 * D, 3) and out.sharding == placement.stacked_sharding(state.mesh)
    expected = np.zeros((D, 2, 3), np.float32)
    for d, b in given.items():
        expected[state.devices.index(d)] = b
    np.testing.assert_array_equal(np.asarray(out), expected.reshape(2 * D, 3))
    for s in out.addressable_shards:  # the blocks used in place, on their own devices
        if s.device in blocks:
            assert s.data.unsafe_buffer_pointer() == blocks[s.device].unsafe_buffer_pointer()


def test_stacked_takes_a_list_in_mesh_order_and_scalars_as_one_element(devices):
    state = jaxkv.empty(devices[:D])
    blocks = [jax.device_put(np.float32(p + 1), d) for p, d in enumerate(state.devices)]
    out = placement.stacked(state, jnp.zeros(()), blocks, jnp.float32)
    assert out.shape == (D,)
    np.testing.assert_array_equal(np.asarray(out), np.arange(1, D + 1, dtype=np.float32))


@pytest.mark.parametrize("count", [1, 2, 3])
def test_replicate_puts_values_on_exactly_the_devices_asked_for(state, devices, count):
    target = tuple(devices[7 - count + 1 :][::-1])  # devices outside the store, out of order
    out = placement.replicate([state["w"], state["a"]], target)
    for x, v in zip(out, [W, A]):
        np.testing.assert_array_equal(np.asarray(x), v)
        assert x.sharding.device_set == set(target) and x.is_fully_replicated
        if count == 1:
            assert x.sharding == single_device_sharding(target[0])
        else:
            assert tuple(x.sharding.mesh.devices.flat) == target


def test_replicate_refuses_traced_values_naming_the_devices(devices):
    def body(x):
        with pytest.raises(
            jaxkv.KVStoreError, match=r"devices=\[.*id=5.*\]: expected an eager call"
        ):
            placement.replicate([x], (devices[5],))
        return x

    jax.make_jaxpr(body)(jnp.zeros(2))


@pytest.mark.parametrize(
    ("count", "spec", "shape"),
    [(2, P("i"), (4, 3)), (4, P("i"), (8, 3)), (4, P(None, "i"), (3, 8))],
)
def test_host_copy_of_a_value_split_over_cpu_devices_is_its_aligned_whole(
    devices, count, spec, shape
):
    mesh = Mesh(np.array(devices[:count]), ("i",))
    value = np.arange(np.prod(shape), dtype=np.float32).reshape(shape) - 5
    x = jax.device_put(value, NamedSharding(mesh, spec))
    host = placement.host_copy(x)
    assert isinstance(host, np.ndarray) and host.ctypes.data % 64 == 0
    np.testing.assert_array_equal(host, value)


@pytest.mark.parametrize(
    "place",
    [
        lambda d: d[2],  # one device
        lambda d: NamedSharding(Mesh(np.array(d[:4]), ("i",)), P()),  # whole on each device
        lambda d: NamedSharding(Mesh(np.array(d[:1]), ("i",)), P("i")),  # split over one
    ],
)
def test_host_copy_is_none_for_a_value_not_split_over_several_devices(devices, place):
    assert placement.host_copy(jax.device_put(W, place(devices))) is None


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((3, 5), np.float32), ((7,), np.float64), ((1,), np.int8), ((2, 3), np.int8)],
)
def test_host_empty_is_64_byte_aligned_and_exactly_the_size_asked_for(shape, dtype):
    made = [placement.host_empty(shape, np.dtype(dtype)) for _ in range(16)]
    for x in made:
        assert x.shape == shape and x.dtype == dtype and x.flags.writeable
        assert x.ctypes.data % 64 == 0
    x, y = made[:2]
    x[...] = 1
    y[...] = 2
    assert (x == 1).all()  # no two share memory
