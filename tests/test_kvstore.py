"""The imperative KVStore: MXNet's API and semantics, refusals, donation, optimizers, saving
and loading (threads: tests/test_threads.py)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _devices import cpu_store

import jaxkv
from jaxkv import nd

SHAPE = (2, 3)


@pytest.fixture
def kv():
    store = cpu_store("local")
    store.init([3, 5], [nd.ones(SHAPE) * 2, nd.zeros(SHAPE)])
    return store


def values(store):
    return {k: np.asarray(v) for k, v in zip(store.keys(), store.pull(store.keys()))}


def test_types_are_reported_as_given_and_unknown_ones_refused():
    for name in (
        "local",
        "device",
        "nccl",
        "local_allreduce_cpu",
        "local_allreduce_device",
        "local_update_cpu",
        "dist_sync",
        "dist_device_sync",
    ):
        assert jaxkv.create(name).type == name
    with pytest.raises(jaxkv.KVStoreError, match="'bogus'.*expected one of.*'local'"):
        jaxkv.create("bogus")
    with pytest.raises(jaxkv.KVStoreError, match="dist_sync"):
        jaxkv.create("dist_async")


def test_rank_workers_and_capabilities(kv):
    assert (kv.rank, kv.num_workers) == (0, 1)
    assert kv.is_capable("optimizer")
    with pytest.raises(jaxkv.KVStoreError, match="capability"):
        kv.is_capable("teleport")
    kv.barrier()
    kv._barrier()


def test_pull_returns_arrays_without_out(kv):
    v = kv.pull(3)
    assert isinstance(v, jax.Array)
    np.testing.assert_array_equal(v, np.full(SHAPE, 2.0))
    a, b = kv.pull([3, 5])
    np.testing.assert_array_equal(b, np.zeros(SHAPE))


def test_outs_are_filled_on_their_own_devices(kv):
    outs = [nd.zeros(SHAPE, jaxkv.cpu(i)) for i in range(8)]
    kv.pull(3, out=outs)
    for i, o in enumerate(outs):
        assert o.context == jaxkv.cpu(i)
        np.testing.assert_array_equal(o.asnumpy(), np.full(SHAPE, 2.0))
    half = nd.zeros(SHAPE, jaxkv.cpu(2), dtype=np.float16)
    kv.pull(3, out=half)
    assert half.dtype == np.float16 and half.context == jaxkv.cpu(2)


def test_a_store_over_contexts_sums_over_those_devices_only():
    store = jaxkv.KVStore("local", devices=[jaxkv.cpu(1), jaxkv.cpu(2)])
    assert store.state.devices == (jax.devices("cpu")[1], jax.devices("cpu")[2])
    store.init(3, nd.zeros(SHAPE))
    store.push(3, [nd.ones(SHAPE, jaxkv.cpu(i)) for i in (1, 2)])
    np.testing.assert_array_equal(store.pull(3), np.full(SHAPE, 2.0))


def test_lists_of_lists_and_duplicates(kv):
    grads = [
        [nd.ones(SHAPE, jaxkv.cpu(i)) for i in range(4)],
        [nd.ones(SHAPE, jaxkv.cpu(i)) * 2 for i in range(3)],
    ]
    kv.push([3, 5], grads)
    outs = [[nd.zeros(SHAPE, jaxkv.cpu(i)) for i in range(2)] for _ in range(2)]
    kv.pull([3, 5], out=outs)
    np.testing.assert_array_equal(outs[0][1].asnumpy(), np.full(SHAPE, 4.0))
    np.testing.assert_array_equal(outs[1][0].asnumpy(), np.full(SHAPE, 6.0))
    kv.push([5, 5, 3], [nd.ones(SHAPE), nd.ones(SHAPE), nd.ones(SHAPE)])
    a, b = nd.zeros(SHAPE), nd.zeros(SHAPE)
    kv.pull([5, 5], out=[a, b])
    np.testing.assert_array_equal(a.asnumpy(), np.full(SHAPE, 2.0))
    np.testing.assert_array_equal(b.asnumpy(), np.full(SHAPE, 2.0))


def test_device_counts_may_vary_per_key_and_per_push(kv):
    # MXNet 1.9.1 crashes here; jaxkv sums whatever devices each push comes from.
    for n in (4, 1, 8, 2):
        kv.push(3, [nd.ones(SHAPE, jaxkv.cpu(i)) for i in range(n)])
        np.testing.assert_array_equal(kv.pull(3), np.full(SHAPE, float(n)))


@pytest.mark.parametrize("style", ["inplace", "pure", "returns_ndarray"])
def test_updaters_in_both_styles(kv, style):
    def inplace(key, inp, stored):
        stored += inp * 2

    def pure(key, inp, stored):
        return stored.asjax() + 2 * inp.asjax()

    def returns_ndarray(key, inp, stored):
        return stored + inp * 2

    kv.set_updater({"inplace": inplace, "pure": pure, "returns_ndarray": returns_ndarray}[style])
    for _ in range(3):
        kv.push(3, [nd.ones(SHAPE, jaxkv.cpu(i)) for i in range(4)])
    np.testing.assert_array_equal(kv.pull(3), np.full(SHAPE, 2.0 + 3 * 8))


def test_str_keys_reach_the_updater_as_str():
    kv = cpu_store("device")
    seen = []
    kv.init(["a", "b"], [nd.zeros(SHAPE), nd.zeros(SHAPE)])
    kv._set_updater(lambda key, inp, stored: seen.append(key) or stored + inp)
    kv.push(["b", "a"], [nd.ones(SHAPE), nd.ones(SHAPE)])
    assert sorted(seen) == ["a", "b"]
    with pytest.raises(jaxkv.KeyTypeError):
        kv.push(1, nd.ones(SHAPE))


def test_pushpull_in_place_and_with_out(kv):
    v = nd.ones(SHAPE) * 3
    kv.pushpull(3, v)  # no out: the pulled value lands in v itself
    np.testing.assert_array_equal(v.asnumpy(), np.full(SHAPE, 3.0))
    kv.set_updater(lambda k, i, s: s + i)
    outs = [nd.zeros(SHAPE, jaxkv.cpu(i)) for i in range(2)]
    kv.pushpull(3, [nd.ones(SHAPE, jaxkv.cpu(i)) for i in range(2)], out=outs)
    for o in outs:
        np.testing.assert_array_equal(o.asnumpy(), np.full(SHAPE, 5.0))
    np.testing.assert_array_equal(kv.pushpull(5, jnp.ones(SHAPE)), np.ones(SHAPE))


def test_broadcast_initialises_and_fills_outs(kv):
    outs = [nd.zeros(SHAPE, jaxkv.cpu(i)) for i in range(3)]
    kv.broadcast(9, nd.ones(SHAPE) * 7, out=outs)
    for o in outs:
        np.testing.assert_array_equal(o.asnumpy(), np.full(SHAPE, 7.0))
    with pytest.raises(jaxkv.DuplicateKeyError):
        kv.broadcast(9, nd.ones(SHAPE), out=outs)
    before = values(kv)
    with pytest.raises(jaxkv.ShapeError):
        kv.broadcast(11, nd.ones(SHAPE), out=nd.zeros((3, 3)))
    assert 11 not in kv.keys()
    assert values(kv).keys() == before.keys()


def test_row_sparse_pull(kv):
    kv.init(7, nd.array(np.arange(6.0).reshape(3, 2)))
    out = nd.zeros((3, 2), jaxkv.cpu(1))
    kv.row_sparse_pull(7, out=out, row_ids=nd.array([2], dtype=np.int64))
    np.testing.assert_array_equal(out.asnumpy(), [[0, 0], [0, 0], [4, 5]])
    assert out.context == jaxkv.cpu(1)
    rows = kv.row_sparse_pull(7, row_ids=[0])
    np.testing.assert_array_equal(rows, [[0, 1], [0, 0], [0, 0]])
    with pytest.raises(jaxkv.KVStoreError, match="row_ids"):
        kv.row_sparse_pull(7, out=out)
    # Ids that are not rows are refused, and no out is touched (the first out's ids are fine).
    other = nd.full((3, 2), -1.0, jaxkv.cpu(2))
    for bad in ([-1], [3], [0, -3]):
        with pytest.raises(jaxkv.KVStoreError, match=r"key 7: row_ids expected.*\[0, 3\)"):
            kv.row_sparse_pull(7, out=[out, other], row_ids=[nd.array([0]), nd.array(bad)])
        np.testing.assert_array_equal(out.asnumpy(), [[0, 0], [0, 0], [4, 5]])
        np.testing.assert_array_equal(other.asnumpy(), np.full((3, 2), -1.0))


# -- refusals: the store is left exactly as it was -------------------------------------------
@pytest.mark.parametrize(
    "call, error, pattern",
    [
        (lambda kv: kv.push(4, nd.ones(SHAPE)), jaxkv.UnknownKeyError, "key 4"),
        (lambda kv: kv.pull(4, out=nd.zeros(SHAPE)), jaxkv.UnknownKeyError, "key 4"),
        (lambda kv: kv.init(3, nd.ones(SHAPE)), jaxkv.DuplicateKeyError, "duplicate init"),
        (lambda kv: kv.init([8, 8], [nd.ones(SHAPE)] * 2), jaxkv.DuplicateKeyError, "key 8"),
        (
            lambda kv: kv.push([5, 3], [nd.ones(SHAPE), nd.ones((3, 2))]),
            jaxkv.ShapeError,
            r"key 3.*\(3, 2\).*\(2, 3\)",
        ),
        (
            lambda kv: kv.pull([5, 3], out=[nd.zeros(SHAPE), nd.zeros((6,))]),
            jaxkv.ShapeError,
            r"key 3: out has shape \(6,\), expected .*\(2, 3\)",
        ),
        (lambda kv: kv.pull(3, out=jnp.zeros(SHAPE)), jaxkv.KVStoreError, "return value"),
        (lambda kv: kv.push("a", nd.ones(SHAPE)), jaxkv.KeyTypeError, "int keys"),
        (lambda kv: kv.set_optimizer(object()), jaxkv.KVStoreError, "optax"),
        (lambda kv: kv.save_optimizer_states("/tmp/x"), jaxkv.KVStoreError, "set_optimizer"),
    ],
)
def test_refusals_change_nothing(kv, call, error, pattern):
    outs = [nd.zeros(SHAPE)]
    kv.pull(3, out=outs)
    before = values(kv)
    with pytest.raises(error, match=pattern):
        call(kv)
    after = values(kv)
    assert after.keys() == before.keys()
    for k in before:
        np.testing.assert_array_equal(after[k], before[k])


def test_a_failed_pull_does_not_poison_a_later_init(kv):
    with pytest.raises(KeyError):
        kv.pull(42, out=nd.zeros(SHAPE))
    kv.init(42, nd.ones(SHAPE))  # MXNet 1.9.1 reports a duplicate init here
    np.testing.assert_array_equal(kv.pull(42), np.ones(SHAPE))


# -- donation and what the store hands out ---------------------------------------------------
def test_the_store_donates_but_never_invalidates_what_it_handed_out(kv):
    kv.set_updater(lambda k, i, s: s + i)
    pulled = kv.pull(3)
    out = nd.zeros(SHAPE, jaxkv.cpu(1))
    kv.pull(3, out=out)
    snapshot = kv.state
    held = snapshot[3]
    kv.push(3, nd.ones(SHAPE))
    kv.push(3, nd.ones(SHAPE))
    assert not held.is_deleted() and not pulled.is_deleted() and not out.asjax().is_deleted()
    np.testing.assert_array_equal(held, np.full(SHAPE, 2.0))
    np.testing.assert_array_equal(out.asnumpy(), np.full(SHAPE, 2.0))
    np.testing.assert_array_equal(kv.pull(3), np.full(SHAPE, 4.0))
    # No value of this store is split across devices: it keeps its values at every push and
    # lends them to the outs of a pull, with no copy.
    inner = kv._state[3]
    kv.push(3, nd.ones(SHAPE))
    assert not inner.is_deleted()


def test_a_store_with_split_values_donates_them_and_copies_into_outs():
    big = (64, 512)  # above the big-array bound: split across the 8 devices
    kv = cpu_store("local")
    kv.init([3, 5], [nd.ones(big), nd.zeros(SHAPE)])
    kv.set_updater(jaxkv.pure_updater(lambda k, i, s: s + i))  # traced: its pushes donate
    out = nd.zeros(SHAPE, jaxkv.cpu(1))
    kv.pull(5, out=out)  # a copy: this store donates its values
    snapshot = kv.state
    kv.push([3, 5], [nd.ones(big), nd.ones(SHAPE)])  # keeps what `state` handed out
    assert not snapshot[3].is_deleted() and not out.asjax().is_deleted()
    inner = jax.tree_util.tree_leaves(kv._state)  # the store's own buffers, held by nothing else
    kv.push([3, 5], [nd.ones(big), nd.ones(SHAPE)])
    nd.waitall()  # a push is held until something reads
    assert all(x.is_deleted() for x in inner)
    np.testing.assert_array_equal(kv.pull(3), np.full(big, 3.0))
    np.testing.assert_array_equal(out.asnumpy(), np.zeros(SHAPE))


def test_state_moves_between_imperative_and_functional(kv):
    state = jaxkv.push(kv.state, 5, jnp.ones(SHAPE) * 4)
    kv.state = state
    np.testing.assert_array_equal(kv.pull(5), np.full(SHAPE, 4.0))
    with pytest.raises(jaxkv.KVStoreError, match="KVState"):
        kv.state = {"not": "a state"}


# -- optimizers and saving -------------------------------------------------------------------
@pytest.mark.standard_promotion  # Adam
def test_set_optimizer_matches_optax(kv):
    opt = optax.adam(0.1)
    kv.set_optimizer(opt)
    grads = [jnp.full(SHAPE, 0.5), jnp.full(SHAPE, -1.0)]
    params = jnp.full(SHAPE, 2.0)
    opt_state = opt.init(params)
    for g in grads:
        kv.push(3, g)
        updates, opt_state = opt.update(g, opt_state, params)
        params = optax.apply_updates(params, updates)
    np.testing.assert_allclose(kv.pull(3), params, rtol=1e-6)


@pytest.mark.standard_promotion  # Adam
def test_save_and_load_round_trip(kv, tmp_path):
    kv.set_optimizer(optax.adam(0.1))
    kv.push([3, 5], [jnp.ones(SHAPE), jnp.ones(SHAPE)])
    kv.save(tmp_path / "store.npz")
    kv.save_optimizer_states(str(tmp_path / "opt.npz"))
    expected = values(kv)
    expected_opt = jax.tree_util.tree_leaves(kv.state.opt_states[(3, 5)])
    kv.push([3, 5], [jnp.ones(SHAPE), jnp.ones(SHAPE)])

    fresh = cpu_store("local")
    fresh.set_optimizer(optax.adam(0.1))
    fresh.load(tmp_path / "store.npz")
    for k, v in values(fresh).items():
        np.testing.assert_array_equal(v, expected[k])
    kv.load_optimizer_states(str(tmp_path / "opt.npz"))
    for a, b in zip(jax.tree_util.tree_leaves(kv.state.opt_states[(3, 5)]), expected_opt):
        np.testing.assert_array_equal(a, b)
    # Both stores continue identically from the loaded state.
    kv.load(tmp_path / "store.npz")
    for store in (kv, fresh):
        store.push([3, 5], [jnp.ones(SHAPE), jnp.ones(SHAPE)])
    np.testing.assert_array_equal(kv.pull(3), fresh.pull(3))
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_load_refuses_corrupt_files_and_changes_nothing(kv, tmp_path):
    path = tmp_path / "store.npz"
    kv.save(path)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 3] ^= 0xFF
    path.write_bytes(bytes(raw))
    before = values(kv)
    kv.push(3, jnp.zeros(SHAPE))
    before = values(kv)
    with pytest.raises(jaxkv.KVStoreError):
        kv.load(path)
    for k, v in values(kv).items():
        np.testing.assert_array_equal(v, before[k])
    with pytest.raises(jaxkv.KVStoreError, match="expected a store with an optimizer"):
        kv.save_optimizer_states(str(path), dump_optimizer=True)


def test_a_refused_pushpull_does_not_push(kv):
    with pytest.raises(jaxkv.ShapeError):
        kv.pushpull(5, nd.ones(SHAPE), out=nd.zeros((3, 2)))
    with pytest.raises(jaxkv.KVStoreError, match="return value"):
        kv.pushpull(5, nd.ones(SHAPE), out=jnp.zeros(SHAPE))
    np.testing.assert_array_equal(kv.pull(5), np.zeros(SHAPE))


def test_setting_the_same_updater_again_does_not_recompile(kv, compiles):
    def update(key, inp, stored):
        stored += inp

    kv.set_updater(update)
    kv.push(3, nd.ones(SHAPE))
    with compiles() as c:
        kv.set_updater(None)
        kv.set_updater(update)
        kv.push(3, nd.ones(SHAPE))
    assert c.count == 0
    np.testing.assert_array_equal(kv.pull(3), np.full(SHAPE, 4.0))


@pytest.mark.parametrize("layout", ["auto", "flat", "keys"])
def test_a_push_of_other_keys_keeps_a_handed_out_optimizer_state_valid(layout, monkeypatch):
    """Found by the deep stateful run: keys inited after ``kv.state`` was read (held apart
    until a push settles them into buckets) were pushed with donation, and the push, which
    settled the state flat, donated every leaf: the optimizer state of the keys handed out
    was deleted under the caller."""
    monkeypatch.setenv("MXNET_KVSTORE_BIGARRAY_BOUND", "16")
    kv = jaxkv.KVStore("local", layout=layout)
    kv.set_optimizer(optax.sgd(0.1, momentum=0.9))
    kv.init([0, 1], [nd.ones((16, 8)), nd.ones((8, 4))])  # split across the devices
    kv.push([0, 1], [nd.ones((16, 8)), nd.ones((8, 4))])
    snapshot = kv.state
    kv.init([2, 3], [nd.ones((2,)), nd.ones((3,))])  # small: bucketed where the layout is
    kv.push([2, 3], [nd.ones((2,)), nd.ones((3,))])
    kv.push([2, 3], [nd.ones((2,)), nd.ones((3,))])
    nd.waitall()
    leaves = jax.tree_util.tree_leaves(snapshot)
    assert not any(x.is_deleted() for x in leaves)
    momentum = jax.tree_util.tree_leaves(dict(snapshot.opt_states))
    assert [float(np.asarray(m).ravel()[0]) for m in momentum] == [1.0, 1.0]
    np.testing.assert_allclose(jaxkv.pull(snapshot, 0), np.full((16, 8), 0.9), rtol=1e-6)
    np.testing.assert_allclose(kv.pull(2), np.full((2,), 1 - 0.1 - 0.19), rtol=1e-6)
