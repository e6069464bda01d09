"""jaxkv/_src/mxnet/sparse.py: the bounds of row ids and tables, which rows a result stores,
and the order of the operands of row-sparse arithmetic."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv._src.mxnet import ndarray, sparse

MAX_ROWS = 2**31 - 1  # the rows an int32 id can name


def _rsp(rows, ids, n=5, ctx=None):
    width = np.asarray(rows, np.float32).reshape(len(ids), -1).shape[1] if len(ids) else 2
    return sparse.row_sparse_array((rows, ids), shape=(n, width), ctx=ctx)


def _dense(n, rows, ids, width=2):
    out = np.zeros((n, width), np.float32)
    out[list(ids)] = rows
    return out


def _ids(a):
    return np.asarray(a.row_ids).tolist()


@pytest.mark.parametrize("rows", [MAX_ROWS, 1])
def test_a_table_of_up_to_the_int32_rows_is_accepted(rows):
    assert sparse.zeros("row_sparse", (rows, 2)).shape == (rows, 2)
    assert sparse.row_sparse_array((rows, 2)).shape == (rows, 2)
    last = sparse.row_sparse_array(([[1.0, 2.0]], [rows - 1]), shape=(rows, 2))
    assert _ids(last) == [rows - 1]


def test_a_table_of_one_more_row_than_int32_ids_name_is_refused():
    with pytest.raises(
        jaxkv.ShapeError, match=r"at most 2147483647 rows, given shape \(2147483648"
    ):
        sparse.zeros("row_sparse", (MAX_ROWS + 1, 2))
    with pytest.raises(jaxkv.ShapeError, match=r"expected 1 or more dimensions, given shape \(\)"):
        sparse.zeros("row_sparse", ())


@pytest.mark.parametrize(("ids", "ok"), [([0, 4], True), ([5], False), ([-1], False)])
def test_row_ids_lie_in_zero_to_the_row_count(ids, ok):
    rows = np.ones((len(ids), 2), np.float32)
    if ok:
        a = _rsp(rows, ids, n=5)
        assert _ids(a) == ids
        return
    with pytest.raises(jaxkv.KVStoreError, match=rf"indices in \[0, 5\) for shape \(5, 2\).*{ids}"):
        _rsp(rows, ids, n=5)


def test_without_a_shape_the_table_ends_at_the_largest_id():
    a = sparse.row_sparse_array(([[1.0], [2.0]], [3, 0]))
    assert a.shape == (4, 1)
    np.testing.assert_array_equal(a.asnumpy(), [[2.0], [0.0], [0.0], [1.0]])


def test_ids_are_sorted_with_their_rows_and_a_repeat_anywhere_is_refused():
    a = _rsp([[4.0, 4.0], [1.0, 1.0], [3.0, 3.0]], [4, 1, 3])
    assert _ids(a) == [1, 3, 4]
    np.testing.assert_array_equal(a.data.asnumpy(), [[1, 1], [3, 3], [4, 4]])
    for ids in ([2, 0, 2], [0, 4, 4]):  # repeats apart, and at the end once sorted
        with pytest.raises(jaxkv.KVStoreError, match=r"unique indices.*given repeated ids \[\d\]"):
            _rsp(np.ones((3, 2), np.float32), ids)
    with pytest.raises(jaxkv.KVStoreError, match=r"whole-number row ids, given \[1.5\]"):
        _rsp([[1.0, 1.0]], [1.5])
    assert _ids(_rsp([[1.0, 1.0]], np.array([2.0], np.float32))) == [2]  # whole floats are ids


def test_a_dense_array_keeps_exactly_its_rows_holding_a_value_other_than_zero():
    dense = np.zeros((6, 3), np.float32)
    dense[1, 2] = 5.0  # one non-zero in the last column: kept
    dense[3, 0] = np.nan  # NaN is not zero, as in MXNet
    dense[4] = -0.0  # negative zero is zero
    a = sparse.from_dense(jnp.asarray(dense))
    assert _ids(a) == [1, 3]
    every = sparse.from_dense(jnp.ones((3, 2)))  # every row kept
    assert _ids(every) == [0, 1, 2]
    none = sparse.from_dense(jax.device_put(jnp.zeros((3, 2)), jax.devices("cpu")[3]))
    assert _ids(none) == [] and none.context == jaxkv.cpu(3)  # empty, yet where its input was


@pytest.mark.parametrize(
    ("asked", "ids", "rows"),
    [
        ([4], [4], [[0, 0]]),  # above the last stored id: a zero row, no error
        ([0], [0], [[0, 0]]),  # below the first
        ([3, 1, 3], [1, 3], [[1, 1], [3, 3]]),  # sorted, once each
        ([2, 3], [2, 3], [[2, 2], [3, 3]]),  # the last stored id
        ([], [], np.zeros((0, 2))),
    ],
)
def test_retain_stores_every_id_asked_with_zeros_where_none_was_stored(asked, ids, rows):
    a = _rsp([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]], [1, 2, 3])
    kept = sparse.retain(a, np.asarray(asked, np.int64))
    assert _ids(kept) == ids
    np.testing.assert_array_equal(kept.data.asnumpy(), rows)
    assert kept.shape == (5, 2)


def test_retain_refuses_an_id_past_the_table_and_stores_nothing_from_an_empty_array():
    a = _rsp([[1.0, 1.0]], [1])
    with pytest.raises(jaxkv.KVStoreError, match=r"row ids in \[0, 5\) for shape \(5, 2\).*\[5\]"):
        sparse.retain(a, [4, 5])
    assert _ids(sparse.retain(sparse.zeros("row_sparse", (5, 2)), [1, 2])) == []


@pytest.mark.parametrize(
    ("ids_a", "ids_b"), [([0, 2], [2, 4]), ([1], [3]), ([0, 1, 2], [1]), ([], [2])]
)
def test_two_row_sparse_arrays_combine_over_the_union_of_their_rows(ids_a, ids_b):
    rows_a = np.arange(1, 1 + 2 * len(ids_a), dtype=np.float32).reshape(-1, 2)
    rows_b = np.arange(10, 10 + 2 * len(ids_b), dtype=np.float32).reshape(-1, 2)
    a = _rsp(rows_a.reshape(len(ids_a), 2), ids_a)
    b = _rsp(rows_b, ids_b)
    da, db = _dense(5, rows_a, ids_a), _dense(5, rows_b, ids_b)
    union = sorted(set(ids_a) | set(ids_b))
    for got, want in [(a + b, da + db), (a - b, da - db), (b - a, db - da), (a * b, da * db)]:
        assert isinstance(got, sparse.RowSparseNDArray)
        assert _ids(got) == union
        np.testing.assert_array_equal(got.asnumpy(), want)


def test_a_zero_scalar_keeps_the_rows_except_zero_minus_the_array():
    a = _rsp([[1.0, 2.0]], [3])
    dense = a.asnumpy()
    for got in (a + 0, 0 + a, a - 0):
        assert isinstance(got, sparse.RowSparseNDArray) and _ids(got) == [3]
        np.testing.assert_array_equal(got.asnumpy(), dense)
    negated = 0 - a  # dense, and negated: not a copy of a
    assert negated.stype == "default"
    np.testing.assert_array_equal(negated.asnumpy(), -dense)
    shifted = 1 - a
    assert shifted.stype == "default"
    np.testing.assert_array_equal(shifted.asnumpy(), 1 - dense)
    halved = 2 / _rsp([[4.0, 8.0]], [0], n=1)  # reflected: 2 / a, not a / 2
    np.testing.assert_array_equal(halved.asnumpy(), [[0.5, 0.25]])


@pytest.mark.parametrize(("ids", "ok"), [([0, 3], True), ([3, 0], False), ([1, 1], False),
                                         ([0, 4], False), ([-1, 2], False)])  # fmt: skip
def test_check_format_accepts_ids_sorted_unique_and_inside_the_table(ids, ok):
    rows = jax.device_put(jnp.ones((2, 2)), jax.devices("cpu")[0])
    a = sparse.RowSparseNDArray(rows, jnp.asarray(ids, jnp.int32), (4, 2))
    a.check_format(full_check=False)  # shapes only
    if ok:
        a.check_format()
        return
    with pytest.raises(jaxkv.KVStoreError, match=r"less than the size of first dimension \(4\)"):
        a.check_format()


def test_set_rows_refuses_rows_and_ids_that_do_not_pair_and_changes_nothing():
    a = _rsp([[1.0, 1.0]], [2])
    rows0, ids0 = a.row_values, a.row_ids

    def unchanged():
        return a.row_values is rows0 and a.row_ids is ids0

    for rows, ids in [(jnp.ones((2, 2)), jnp.arange(1)), (jnp.ones((1, 3)), jnp.arange(1))]:
        with pytest.raises(jaxkv.ShapeError, match=r"expected rows of shape \(n, 2\) and n ids"):
            a.set_rows(rows, ids, None)
        assert unchanged()
    with pytest.raises(jaxkv.ShapeError, match=r"expected a value of shape \(5, 2\), given"):
        a[:] = np.ones((4, 2), np.float32)
    assert unchanged()
    with pytest.raises(sparse.NotSupportedForSparseNDArray, match=r"only \[:\]"):
        a[1] = 0.0
    assert unchanged()


def test_a_scalar_assigned_fills_every_row_on_the_arrays_device():
    a = _rsp([[1.0, 1.0]], [2], n=3, ctx=jaxkv.cpu(5))
    a[:] = 7
    assert _ids(a) == [0, 1, 2] and a.context == jaxkv.cpu(5)
    np.testing.assert_array_equal(a.asnumpy(), np.full((3, 2), 7.0))
    a[:] = ndarray.array([[0, 0], [0, 1], [0, 0]], ctx=jaxkv.cpu(2))  # a dense value's rows
    assert _ids(a) == [1] and a.context == jaxkv.cpu(5)


def test_astype_without_a_copy_is_the_array_itself_only_in_its_own_dtype():
    a = _rsp([[1.5, 2.5]], [0], n=2)
    assert a.astype("float32", copy=False) is a
    assert a.astype("float32") is not a
    b = a.astype("int32", copy=False)
    assert b is not a and b.dtype == np.int32 and b.data.asnumpy().tolist() == [[1, 2]]
    assert _rsp([[3.0]], [0], n=1).asscalar() == 3.0
    with pytest.raises(jaxkv.ShapeError, match=r"size 1, given shape \(2, 1\)"):
        _rsp([[3.0]], [0], n=2).asscalar()


def test_a_row_sparse_array_made_on_the_host_is_put_when_first_read():
    """``row_sparse_array((data, indices))`` of host data keeps both on the host (a push takes
    them as its own arguments) until read on the device: then both, sorted, on its context."""
    data = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    a = sparse.row_sparse_array((data, [4, 1]), shape=(6, 2), ctx=jaxkv.cpu(2))
    data[:] = 0  # a copy of its own
    rows, ids = a.host_parts()
    assert ids.tolist() == [1, 4] and rows.tolist() == [[3.0, 4.0], [1.0, 2.0]]
    assert a.context == jaxkv.cpu(2) and a.dtype == np.float32 and a.shape == (6, 2)
    assert a.row_values.devices() == a.row_ids.devices() == {jax.devices("cpu")[2]}
    assert a.host_parts() is None  # put once
    np.testing.assert_array_equal(a.indices.asnumpy(), [1, 4])
    np.testing.assert_array_equal(a.asnumpy()[[1, 4]], [[3.0, 4.0], [1.0, 2.0]])
