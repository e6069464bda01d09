"""jaxkv/_src/mxnet/kvstore_rows.py: the distinct ids each out asks for, which rows a
row-sparse push changes, and which out receives which rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv._src.mxnet import kvstore_rows, sparse
from jaxkv._src.rows import sizes
from jaxkv.mx import optimizer

N, W = 6, 2  # the table: N rows of W
TABLE = np.arange(1, N * W + 1, dtype=np.float32).reshape(N, W)


@pytest.fixture
def state(devices):
    return jaxkv.init(jaxkv.empty(devices[:2]), {"t": jnp.asarray(TABLE)})


def _rsp(ids, device=0, scale=1.0, n=N):
    rows = (np.asarray(ids, np.float32)[:, None] + 1) * np.ones(W, np.float32) * scale
    return sparse.row_sparse_array((rows, ids), shape=(n, W), ctx=jaxkv.cpu(device))


def _summed(values):
    """The dense sum of row-sparse values: a NumPy model."""
    return sum(v.asnumpy() for v in values)


@pytest.mark.parametrize(
    ("ids", "want"),
    [([3, 3], [3]), ([2, 1], [1, 2]), ([1, 2, 2], [1, 2]), ([0, 5], [0, 5]), ([4], [4]), ([], [])],
)
def test_the_ids_an_out_asks_for_are_sorted_and_distinct(ids, want):
    assert kvstore_rows._distinct("t", np.asarray(ids, np.int64), N).tolist() == want


@pytest.mark.parametrize("bad", [N, -1])
def test_an_id_outside_the_table_is_refused_naming_the_key(bad):
    with pytest.raises(
        jaxkv.KVStoreError, match=rf"key 't': row_ids .*\[0, {N}\), given \[{bad}\]"
    ):
        kvstore_rows._distinct("t", [bad], N)


def test_wanted_checks_each_outs_ids_alone(state):
    got = kvstore_rows.wanted(state, "t", [[3, 1, 3], np.array([N - 1]), jnp.array([0, 0])])
    assert [x.tolist() for x in got] == [[1, 3], [N - 1], [0]]


def test_a_value_of_another_shape_is_refused_before_anything_runs(state):
    wrong = _rsp([1], n=N + 1)
    for call in (
        lambda: kvstore_rows.push(state, "t", [_rsp([0]), wrong], None, True, False),
        lambda: kvstore_rows.held(state, "t", [wrong], None, False),
    ):
        with pytest.raises(jaxkv.ShapeError, match=r"key 't'.*shape \(7, 2\).*shape \(6, 2\)"):
            call()
    np.testing.assert_array_equal(np.asarray(state["t"]), TABLE)


@pytest.mark.parametrize("lazy", [True, False])
def test_without_an_updater_the_value_becomes_the_summed_rows(state, lazy):
    # Row 2 is pushed by both devices: summed; rows not pushed become zero, as MXNet replaces.
    values = [_rsp([0, 2], device=0), _rsp([2, 5], device=1, scale=10)]
    new = kvstore_rows.push(state, "t", values, None, lazy, False)
    want = _summed(values)
    assert want[2, 0] == 3 + 30 and not want[[1, 3, 4]].any()
    np.testing.assert_array_equal(np.asarray(new["t"]), want)


def test_a_dense_value_among_row_sparse_ones_is_summed_by_its_non_zero_rows(state):
    dense = np.zeros((N, W), np.float32)
    dense[4] = 7.0
    values = [_rsp([1]), jnp.asarray(dense)]
    new = kvstore_rows.push(state, "t", values, None, True, False)
    np.testing.assert_array_equal(np.asarray(new["t"]), _rsp([1]).asnumpy() + dense)


@pytest.mark.parametrize("lazy", [True, False])
def test_a_lazy_push_changes_only_the_pushed_rows_and_a_standard_one_every_row(state, lazy):
    lr, wd = 0.5, 0.25  # weight decay tells the two apart: it reaches every row only if not lazy
    tx = optimizer.SGD(learning_rate=lr, wd=wd, lazy_update=lazy).transformation(row_sparse=True)
    values = [_rsp([1, 4], device=0), _rsp([4], device=1)]
    new = np.asarray(kvstore_rows.push(state, "t", values, tx, lazy, False)["t"])
    g = _summed(values)
    f32 = np.float32
    dense_rule = (f32(1) - f32(lr) * f32(wd)) * TABLE - f32(lr) * g  # MXNet's row-sparse SGD
    if lazy:
        want = TABLE.copy()
        want[[1, 4]] = dense_rule[[1, 4]]
    else:
        want = dense_rule
    np.testing.assert_allclose(new, want, rtol=1e-6)


def test_a_held_push_keeps_the_rows_as_they_were_when_held(state):
    value = _rsp([0, 3])
    pushed = value.asnumpy()
    held = kvstore_rows.held(state, "t", [value], None, False)
    value[:] = 99.0  # the caller changes its array before the push runs
    new = kvstore_rows.run_held(state, held)
    np.testing.assert_array_equal(np.asarray(new["t"]), pushed)
    assert held.ids[0].tolist() == [0, 3]


ASKED = {
    "even": [[5, 0, 5], [3, 1]],  # two distinct ids each: one computation for both outs
    "uneven": [[2], [0, 4, 5]],
    "one": [[4, 2]],
}


@pytest.mark.parametrize("asked", list(ASKED))
@pytest.mark.parametrize("where", [(0, 1), (6, 3)])  # the store's devices, or others
def test_each_out_receives_its_own_rows_on_its_own_device(state, asked, where):
    row_ids = ASKED[asked]
    outs = [sparse.zeros("row_sparse", (N, W), ctx=jaxkv.cpu(d)) for d in where[: len(row_ids)]]
    got = kvstore_rows.pull_into(state, "t", outs, row_ids)
    assert len(got) == len(outs)
    for (out, rows, ids), o, x in zip(got, outs, row_ids):
        want = sorted(set(x))
        assert out is o and ids.tolist() == want
        np.testing.assert_array_equal(np.asarray(rows), TABLE[want])
        assert rows.devices() == {o.jax_device()}
        assert isinstance(ids, np.ndarray)  # put with the rows when the out is read
        o.set_rows_lazily(rows, rows.shape[0], ids)
        assert o.row_values.devices() == o.row_ids.devices() == {o.jax_device()}
        np.testing.assert_array_equal(np.asarray(o.row_ids), want)


@pytest.mark.parametrize(
    ("split", "where", "asked"),
    [
        (False, (0, 1), "even"),  # one computation
        (False, (0, 1), "uneven"),
        (False, (0, 1), "one"),
        (True, (0, 1), "even"),  # one computation, the pushed rows routed to their owners
        (True, (6, 3), "even"),  # outs off the store's devices: the push, then the pull
    ],
)
def test_a_held_push_then_pull_gives_what_the_push_then_the_pull_give(devices, split, where, asked):
    bound = N * W if split else None  # split: the table's rows divided between the devices
    state = jaxkv.init(jaxkv.empty(devices[:2], bigarray_bound=bound), {"t": jnp.asarray(TABLE)})
    assert state.is_sharded((N, W)) == split
    tx = optimizer.SGD(learning_rate=0.5).transformation(row_sparse=True)
    values = [_rsp([1, 2], device=0), _rsp([2, 3], device=1)]
    want_table = TABLE - np.float32(0.5) * _summed(values)
    row_ids = ASKED[asked]
    outs = [sparse.zeros("row_sparse", (N, W), ctx=jaxkv.cpu(d)) for d in where[: len(row_ids)]]
    held = kvstore_rows.held(state, "t", values, tx, False)
    asked_ids = kvstore_rows.wanted(state, "t", row_ids)
    new, got = kvstore_rows.pushpull_into(state, held, outs, asked_ids)
    np.testing.assert_allclose(np.asarray(new["t"]), want_table, rtol=1e-6)
    for (out, rows, ids), o, x in zip(got, outs, row_ids):
        want = sorted(set(x))
        assert out is o and np.asarray(ids).tolist() == want
        rows = sizes.exact(rows)  # (a result for a padded count, cut when read)
        np.testing.assert_allclose(np.asarray(rows), want_table[want], rtol=1e-6)
        assert rows.devices() == {o.jax_device()}


def test_rows_made_on_the_host_are_arguments_on_one_device_and_put_once_on_several(devices):
    """A push of row-sparse values made from NumPy: into a store of one device the rows and
    ids are handed on as NumPy arrays (the push's computation takes them as arguments); into
    a store of several, each value's parts are put on its own device once (a push routes each
    device's rows from where they lie) and a value pushed again is not put again. The store's
    numbers are the same either way."""
    one = jaxkv.init(jaxkv.empty(devices[:1]), {"t": jnp.asarray(TABLE)})
    value = _rsp([1, 4])
    held = kvstore_rows.held(one, "t", [value], None, False)
    assert isinstance(held.rows[0], np.ndarray) and isinstance(held.row_ids[0], np.ndarray)
    assert value.host_parts() is not None  # nothing put
    np.testing.assert_array_equal(
        np.asarray(kvstore_rows.run_held(one, held)["t"]), _summed([value])
    )
    two = jaxkv.init(jaxkv.empty(devices[:2]), {"t": jnp.asarray(TABLE)})
    values = [_rsp([1, 4], device=0), _rsp([2], device=1)]
    held = kvstore_rows.held(two, "t", values, None, False)
    for v, r, d in zip(values, held.rows, devices[:2]):
        assert isinstance(r, jax.Array) and r.devices() == {d}
        assert v.host_parts() is None and v.row_values is r  # put once, on its own device
    again = kvstore_rows.held(two, "t", values, None, False)
    assert all(a is b for a, b in zip(again.rows, held.rows))
    np.testing.assert_array_equal(
        np.asarray(kvstore_rows.run_held(two, held)["t"]), _summed(values)
    )
