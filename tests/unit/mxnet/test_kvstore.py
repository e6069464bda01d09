"""jaxkv/_src/mxnet/kvstore.py: how many pushes a store holds, how a pull gathers split values
a chunk at a time, how row ids pair with outs, and the store's refusals, which change nothing."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxkv
from jaxkv._src.mxnet import kvstore, ndarray, sparse
from jaxkv._src.state import buckets, policy


def _store(devices, name="device", **kw):
    kv = kvstore.KVStore(name, devices=devices[:2], **kw)
    kv.init("a", ndarray.array([1.0, 2.0]))
    kv.run_held()
    return kv


def _value(kv, key="a"):
    return np.asarray(kv.pull(key)).tolist()


@pytest.mark.parametrize("name", list(kvstore.TYPES))
def test_each_of_mxnets_store_types_is_made(name, monkeypatch):
    if name.startswith("dist"):  # no cluster to join: a dist store of this process alone
        monkeypatch.setattr(kvstore.join, "join_cluster", lambda: None)
        monkeypatch.setattr(kvstore.join, "process_devices", lambda: jax.devices("cpu")[:1])
    assert kvstore.create(name).type == name


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("dist_async", "'dist_async': asynchronous updates.*not supported"),
        ("dist_device_async", "not supported; use dist_device_sync"),
        ("Local", r"unknown KVStore type 'Local': expected one of \['local'"),
        (3, "expected a str such as 'local', given 3"),
    ],
)
def test_other_store_types_are_refused(name, message):
    with pytest.raises(jaxkv.KVStoreError, match=message):
        kvstore.create(name)


def test_the_big_array_bound_comes_from_mxnets_variable(devices, monkeypatch):
    monkeypatch.delenv("MXNET_KVSTORE_BIGARRAY_BOUND", raising=False)
    monkeypatch.delenv("JAXKV_BIGARRAY_BOUND", raising=False)
    assert kvstore.KVStore("local", devices[:2])._stored.bigarray_bound == policy.BIGARRAY_BOUND
    monkeypatch.setenv("JAXKV_BIGARRAY_BOUND", "12")  # jaxkv's default, below MXNet's variable
    assert kvstore.KVStore("local", devices[:2])._stored.bigarray_bound == 12
    monkeypatch.setenv("MXNET_KVSTORE_BIGARRAY_BOUND", "6")
    assert kvstore.KVStore("local", devices[:2])._stored.bigarray_bound == 6
    monkeypatch.setenv("MXNET_KVSTORE_BIGARRAY_BOUND", "1e6")  # (MXNet reads an integer)
    with pytest.raises(jaxkv.KVStoreError, match="MXNET_KVSTORE_BIGARRAY_BOUND: .* given '1e6'"):
        kvstore.KVStore("local", devices[:2])


def test_the_fifth_held_push_of_a_key_runs_the_four_held_before_it(devices):
    kv = _store(devices)
    for n in range(1, kvstore._HELD_PUSHES + 1):
        kv.push("a", ndarray.full((2,), float(n)))
        assert len(kv._calls.queue.pushes) == n  # held, one generation per push of the key
    kv.push("a", ndarray.full((2,), 9.0))
    assert len(kv._calls.queue.pushes) == 1  # the four ran first: only the fifth is held
    assert _value(kv) == [9.0, 9.0]  # no updater: each push replaces the value


def test_a_pull_gathers_split_values_in_chunks_of_at_least_the_chunk_size(devices, monkeypatch):
    monkeypatch.setenv("MXNET_KVSTORE_BIGARRAY_BOUND", "4")  # (4,) float32 values are split
    kv = kvstore.KVStore("device", devices=devices[:2], layout="keys")
    keys = list(range(5))
    kv.init(keys, [ndarray.full((4,), float(k + 1)) for k in keys])
    kv.run_held()
    assert all(buckets.is_split(kv._stored, i) for i in keys)
    per_key = 16 * 2  # bytes of one value, counted once per device
    monkeypatch.setattr(kvstore, "_GATHER_CHUNK_BYTES", 2 * per_key)  # exactly two keys
    chunks = []
    gather = kvstore.placement.replicated_copies

    def recorded(state, chunk):
        chunks.append(list(chunk))
        return gather(state, chunk)

    monkeypatch.setattr(kvstore.placement, "replicated_copies", recorded)
    outs = [ndarray.zeros((4,), ctx=jaxkv.cpu(k % 2)) for k in keys]
    kv.pull(keys, out=outs)
    assert chunks == [[0, 1], [2, 3], [4]]  # the last chunk, though short, is handed out too
    for k, o in zip(keys, outs):
        assert o.asnumpy().tolist() == [k + 1.0] * 4 and o.context == jaxkv.cpu(k % 2)


@pytest.mark.parametrize(
    ("key", "outs", "row_ids", "want"),
    [
        ("a", [2], "r", [["r", "r"]]),  # one array: every out
        ("a", [2], ["r"], [["r", "r"]]),  # a list of one: every out
        ("a", [2], ["x", "y"], [["x", "y"]]),  # one per out
        (["a", "b"], [1, 1], ["x", "y"], [["x"], ["y"]]),  # one out per key: one per out
        (["a", "b"], [2, 1], ["x", "y"], [["x", "x"], ["y"]]),  # one per key, for its outs
        (["a", "b"], [2, 1], [["x", "y"], "z"], [["x", "y"], ["z"]]),  # nested per key
        (["a", "b"], [2, 2], ["w", "x", "y", "z"], [["w", "x"], ["y", "z"]]),  # flat, in order
        (["a", "b"], [1, 1], [[0, 1], [2]], [[[0, 1]], [[2]]]),  # one out each: ids are lists
    ],
)
def test_row_ids_pair_with_the_outs_as_mxnet_pairs_them(key, outs, row_ids, want):
    keys = key if isinstance(key, list) else [key]
    pairs = [(k, [f"{k}{j}" for j in range(n)]) for k, n in zip(keys, outs)]
    assert kvstore._row_ids_per_out(key, pairs, row_ids) == want


@pytest.mark.parametrize(
    ("key", "outs", "row_ids", "message"),
    [
        ("a", [2], ["x", "y", "z"], "key 'a': expected 2 row_ids .one per out., given 3"),
        (["a", "b"], [2, 1], [["x"], "z"], "key 'a': expected 2 row_ids .one per out., given 1"),
        (["a", "b"], [2, 2], ["x", "y", "z"], r"expected 4 row_ids .one per out., given 3"),
    ],
)
def test_row_ids_that_do_not_pair_with_the_outs_are_refused(key, outs, row_ids, message):
    keys = key if isinstance(key, list) else [key]
    pairs = [(k, [f"{k}{j}" for j in range(n)]) for k, n in zip(keys, outs)]
    with pytest.raises(jaxkv.ShapeError, match=message):
        kvstore._row_ids_per_out(key, pairs, row_ids)


def test_row_sparse_outs_are_left_out_only_where_mxnet_ignores_them():
    dense, rsp = ndarray.zeros(2), sparse.zeros("row_sparse", (2, 1))
    pairs = [("a", [dense, rsp]), ("b", [rsp])]
    assert kvstore._sparse_outs(pairs, ignore_sparse=False) is pairs
    assert kvstore._sparse_outs(pairs, ignore_sparse=True) == [("a", [dense])]  # b: none left
    assert kvstore._holds_row_sparse([dense, [dense, rsp]])
    assert not kvstore._holds_row_sparse([dense, [dense]])
    assert not kvstore._holds_ndarrays([]) and kvstore._holds_ndarrays([dense, [dense]])
    assert not kvstore._holds_ndarrays([dense, jnp.zeros(2)])


def test_an_mxnet_updater_gives_what_it_returns_or_else_the_stored_handle():
    def in_place(key, pushed, stored):
        stored += pushed * 2

    def returning(key, pushed, stored):
        return stored - pushed

    pushed, stored = jnp.array([1.0, 2.0]), jnp.array([10.0, 10.0])
    assert kvstore._from_mxnet_updater(in_place)("k", pushed, stored).tolist() == [12.0, 14.0]
    assert kvstore._from_mxnet_updater(returning)("k", pushed, stored).tolist() == [9.0, 8.0]
    tx = optax.sgd(0.1)
    assert kvstore._from_mxnet_updater(tx) is tx and kvstore._from_mxnet_updater(None) is None
    with pytest.raises(jaxkv.KVStoreError, match="expected a callable updater.*given 3"):
        kvstore._from_mxnet_updater(3)


def test_a_pull_into_outs_of_the_wrong_kind_or_shape_is_refused_and_changes_nothing(devices):
    kv = _store(devices)
    out = ndarray.zeros(3)
    with pytest.raises(jaxkv.ShapeError, match=r"key 'a': out has shape \(3,\), .*shape \(2,\)"):
        kv.pull("a", out=out)
    with pytest.raises(jaxkv.KVStoreError, match="key 'a': out expected a jaxkv.nd.NDArray"):
        kv.pull(["a"], out=[jnp.zeros(2)])
    assert out.asnumpy().tolist() == [0.0] * 3 and _value(kv) == [1.0, 2.0]
    half = ndarray.zeros(2, dtype="float16")  # an out keeps its own dtype
    kv.pull("a", out=half)
    assert half.asnumpy().tolist() == [1.0, 2.0]  # (the held pull runs)
    assert half.asjax().dtype == np.float16 and half.dtype == np.float16


def test_a_python_updater_that_fails_names_the_key_and_changes_nothing(devices):
    kv = _store(devices)

    def broken(key, pushed, stored):
        raise ValueError("boom")

    kv.set_updater(broken)
    with pytest.raises(jaxkv.KVStoreError, match=r"key 'a': the updater .*ValueError: boom"):
        kv.push("a", ndarray.ones(2))
    assert _value(kv) == [1.0, 2.0]
    kv.set_updater(lambda key, pushed, stored: ndarray.zeros(3))
    with pytest.raises(jaxkv.ShapeError, match=r"key 'a': the updater .*shape \(3,\), .*\(2,\)"):
        kv.push("a", ndarray.ones(2))
    assert _value(kv) == [1.0, 2.0]
    kv.set_updater(lambda key, pushed, stored: stored + pushed)  # and one that works
    kv.push("a", [ndarray.ones(2), ndarray.ones(2, ctx=jaxkv.cpu(1))])
    assert _value(kv) == [3.0, 4.0]


def test_a_refused_broadcast_leaves_its_key_uninitialised(devices):
    kv = _store(devices)
    with pytest.raises(jaxkv.ShapeError, match=r"key 'b': out has shape \(3,\).*\(2,\)"):
        kv.broadcast("b", ndarray.ones(2), out=ndarray.zeros(3))
    assert kv.keys() == ["a"]


def test_the_stores_other_refusals_change_nothing(devices):
    kv = _store(devices, name="local")
    state = kv.state
    with pytest.raises(jaxkv.KVStoreError, match="key 'a': row_sparse_pull expects row_ids"):
        kv.row_sparse_pull("a", out=ndarray.zeros(2))
    with pytest.raises(jaxkv.ShapeError, match=r"keys \['a'\]: expected 1 row_ids, given 2"):
        kv.row_sparse_pull(["a"], row_ids=[[0], [1]])
    with pytest.raises(jaxkv.KVStoreError, match="expected 'optimizer', given 'foo'"):
        kv.is_capable("foo")
    assert kv.is_capable("OPTIMIZER")
    with pytest.raises(jaxkv.KVStoreError, match="'device' or 'dist' store type.*given 'local'"):
        kv.set_gradient_compression({"type": "2bit"})
    with pytest.raises(jaxkv.KVStoreError, match="expected a store with an optimizer, given none"):
        kv.save_optimizer_states("unused.states", dump_optimizer=True)
    with pytest.raises(jaxkv.KVStoreError, match="expected a store with an optimizer, given none"):
        kv.save_optimizer_states("unused.states")
    with pytest.raises(jaxkv.KVStoreError, match="expected a jaxkv.KVState, given dict"):
        kv.state = {}
    with pytest.raises(jaxkv.KVStoreError, match="expected an optax.GradientTransformation"):
        kv.set_optimizer(lambda g: g)
    assert kv.state.compression == state.compression is None
    assert _value(kv) == [1.0, 2.0] and kv.keys() == ["a"]


def test_the_drop_in_refuses_a_dense_out_of_row_sparse_pull_as_mxnet_does(devices):
    """MXNet 1.9.1 (checked): 'Expected row_sparse storage type for row_sparse_pull values'.
    jaxkv.mx's store refuses it before anything changes; jaxkv.KVStore fills the dense out."""
    import jaxkv
    import jaxkv.mx as mx

    table = np.arange(8, dtype=np.float32).reshape(4, 2)
    drop_in = mx.kv.create("local")
    assert isinstance(drop_in, kvstore.DropInKVStore) and isinstance(drop_in, jaxkv.KVStore)
    own = jaxkv.create("local")
    for kv in (drop_in, own):
        kv.init("w", mx.nd.array(table).tostype("row_sparse"))
    ids = mx.nd.array([1])
    dense, rows = mx.nd.zeros((4, 2)), mx.nd.sparse.zeros("row_sparse", (4, 2))
    with pytest.raises(jaxkv.KVStoreError, match=r"'w'.*row_sparse outs.*dense"):
        drop_in.row_sparse_pull("w", out=[rows, dense], row_ids=[ids, ids])
    assert rows.row_values.shape[0] == 0  # refused before any out was filled
    np.testing.assert_array_equal(dense.asnumpy(), np.zeros((4, 2)))
    drop_in.row_sparse_pull("w", out=rows, row_ids=ids)
    np.testing.assert_array_equal(rows.asnumpy()[1], table[1])
    own.row_sparse_pull("w", out=dense, row_ids=ids)  # jaxkv's own store fills it
    np.testing.assert_array_equal(dense.asnumpy()[1], table[1])
    np.testing.assert_array_equal(dense.asnumpy()[[0, 2, 3]], 0)
