"""jaxkv.nd.sparse: MXNet's row-sparse NDArray, checked against a NumPy model of the dense array.

A row-sparse array of ``shape`` with ``data`` and ``indices`` stands for the dense array that is
zero except ``dense[indices[i]] = data[i]``. Examples check each way MXNet makes one, its
attributes, copies between the 8 simulated CPU contexts, MXNet's storage types for arithmetic,
and the refusals; property tests (hypothesis, a small pool of shapes) check the same against the
NumPy model; the last tests check what the KVStore relies on inside ``jit`` (dense ``+=``
row-sparse, the in-place setters).
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxkv
import jaxkv.mx as mx
from jaxkv import nd
from jaxkv.nd import sparse

RowSparseNDArray = sparse.RowSparseNDArray

EXAMPLES = int(os.environ.get("HYPOTHESIS_MAX_EXAMPLES", 30))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None)
SHAPES = [(4, 4), (6, 2), (5,), (3, 2, 2), (1, 3)]


def model(shape, data, indices, dtype=np.float32):
    """The dense array a row-sparse array stands for."""
    dense = np.zeros(shape, dtype)
    dense[np.asarray(indices, np.int64)] = np.asarray(data, dtype)
    return dense


def check(rsp, dense, indices=None, ctx=None):
    """``rsp`` is row-sparse and stands for ``dense``; its ids are sorted and unique (and
    ``indices`` when given); its rows are ``dense``'s at those ids."""
    assert isinstance(rsp, RowSparseNDArray) and rsp.stype == "row_sparse"
    assert rsp.shape == dense.shape and rsp.dtype == dense.dtype
    ids = rsp.indices.asnumpy()
    assert ids.dtype == np.int64 and rsp.indices.dtype == np.int64
    assert (np.diff(ids) > 0).all()
    if indices is not None:
        np.testing.assert_array_equal(ids, indices)
    np.testing.assert_array_equal(rsp.data.asnumpy(), dense[ids])
    np.testing.assert_array_equal(rsp.asnumpy(), dense)
    rsp.check_format()
    if ctx is not None:
        assert rsp.context == ctx and rsp.indices.context == ctx and rsp.data.context == ctx


# --------------------------------------------------------------------------------------------
# Making one
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "as_data, as_ids",
    [
        pytest.param(lambda x: x.tolist(), lambda i: i.tolist(), id="lists"),
        pytest.param(lambda x: x, lambda i: i, id="numpy"),
        pytest.param(nd.array, nd.array, id="ndarrays-float32-ids"),
        pytest.param(nd.array, lambda i: nd.array(i, dtype="int64"), id="ndarrays-int64-ids"),
        pytest.param(jnp.asarray, lambda i: jnp.asarray(i, jnp.int32), id="jax"),
    ],
)
def test_row_sparse_array_from_data_and_indices(as_data, as_ids):
    data = np.array([[1, 2], [3, 4]], np.float32)
    ids = np.array([1, 4])
    a = sparse.row_sparse_array((as_data(data), as_ids(ids)), shape=(6, 2), ctx=jaxkv.cpu(3))
    check(a, model((6, 2), data, ids), [1, 4], jaxkv.cpu(3))
    # Without shape: as many rows as the largest id + 1, on the current context.
    with jaxkv.cpu(5):
        b = sparse.row_sparse_array((as_data(data), as_ids(ids)))
    check(b, model((5, 2), data, ids), [1, 4], jaxkv.cpu(5))


def test_unsorted_indices_are_sorted_with_their_rows():
    # MXNet requires sorted ids and does not sort them (check_format fails); jaxkv sorts.
    a = sparse.row_sparse_array(([[3, 3], [1, 1], [2, 2]], [5, 0, 2]), shape=(6, 2))
    check(a, model((6, 2), [[3, 3], [1, 1], [2, 2]], [5, 0, 2]), [0, 2, 5])
    np.testing.assert_array_equal(a.data.asnumpy(), [[1, 1], [2, 2], [3, 3]])
    on_device = sparse.row_sparse_array((nd.array([[3, 3], [1, 1]]), nd.array([5, 0])), (6, 2))
    np.testing.assert_array_equal(on_device.data.asnumpy(), [[1, 1], [3, 3]])


def test_dtypes_are_mxnets():
    ids = [0, 2]
    assert sparse.row_sparse_array(([[1], [2]], ids), shape=(3, 1)).dtype == np.float32
    assert sparse.row_sparse_array((np.ones((2, 1), np.float16), ids), (3, 1)).dtype == np.float16
    assert sparse.row_sparse_array((nd.ones((2, 1), dtype="int32"), ids), (3, 1)).dtype == np.int32
    a = sparse.row_sparse_array(([[1], [2]], ids), shape=(3, 1), dtype="int64")
    assert a.dtype == np.int64 and a.data.dtype == np.int64 and a.asnumpy().dtype == np.int64
    np.testing.assert_array_equal(a.asnumpy(), [[1], [0], [2]])
    assert sparse.zeros("row_sparse", (2, 2)).dtype == np.float32
    assert sparse.zeros("row_sparse", (2, 2), dtype="float16").dtype == np.float16


def test_other_forms_of_row_sparse_array():
    # A shape: an empty array (nothing stored).
    empty = sparse.row_sparse_array((3, 4, 2), ctx=jaxkv.cpu(1))
    check(empty, np.zeros((3, 4, 2), np.float32), [], jaxkv.cpu(1))
    assert empty.data.shape == (0, 4, 2)
    # A dense array (NDArray, NumPy, list): its non-zero rows.
    dense = np.array([[0, 0], [1, 0], [0, 0], [0, -2]], np.float32)
    for source in (nd.array(dense), dense, dense.tolist()):
        check(sparse.row_sparse_array(source, ctx=jaxkv.cpu(2)), dense, [1, 3], jaxkv.cpu(2))
    assert sparse.row_sparse_array(dense.astype(np.float16)).dtype == np.float16
    # Another row-sparse array: a copy, on the current context unless ctx (as MXNet's code).
    a = sparse.row_sparse_array(dense, ctx=jaxkv.cpu(4))
    b = sparse.row_sparse_array(a, dtype="float16")
    check(b, dense.astype(np.float16), [1, 3], jaxkv.cpu(0))
    c = nd.array(a, ctx=jaxkv.cpu(6))  # nd.array of a row-sparse array: row-sparse
    check(c, dense, [1, 3], jaxkv.cpu(6))
    check(sparse.array(a), dense, [1, 3], jaxkv.cpu(0))


def test_zeros_and_empty_take_stype():
    for z in (
        nd.zeros((3, 2), stype="row_sparse"),
        nd.zeros((3, 2), jaxkv.cpu(2), "float32", "row_sparse"),
        nd.empty((3, 2), jaxkv.cpu(2), stype="row_sparse"),
        sparse.zeros("row_sparse", (3, 2), jaxkv.cpu(2)),
        sparse.zeros(shape=(3, 2), ctx=jaxkv.cpu(2), stype="row_sparse"),  # MXNet's GPU test
        sparse.empty("row_sparse", (3, 2), ctx=jaxkv.cpu(2)),
    ):
        assert z.stype == "row_sparse" and z.data.shape == (0, 2)
        np.testing.assert_array_equal(z.asnumpy(), np.zeros((3, 2)))
    assert nd.zeros((2,), stype="row_sparse").shape == (2,)
    dense = sparse.zeros("default", (2, 2), dtype="int32")
    assert type(dense) is nd.NDArray and dense.dtype == np.int32 and dense.stype == "default"
    assert type(nd.zeros((2, 2), stype="default")) is nd.NDArray


def test_refusals_name_expected_and_given():
    make = sparse.row_sparse_array
    err = jaxkv.KVStoreError
    cases = [
        (lambda: make(([[1, 2]], [[0]]), shape=(3, 2)), r"1-D indices.*\(1, 1\)"),
        (lambda: make(([[1, 2]], [0.5]), shape=(3, 2)), r"whole-number row ids.*0\.5"),
        (lambda: make(([[1, 2]], ["a"]), shape=(3, 2)), r"integer row ids.*<U1"),
        (lambda: make(([[1, 2]], [3]), shape=(3, 2)), r"indices in \[0, 3\).*\[3\]"),
        (lambda: make(([[1, 2]], [-1]), shape=(3, 2)), r"indices in \[0, 3\).*\[-1\]"),
        (lambda: make(([[1, 2], [3, 4]], [1, 1]), shape=(3, 2)), r"unique.*\[1\]"),
        (lambda: make(([[1, 2]], [0, 1]), shape=(3, 2)), r"1 rows of data and 2 indices"),
        (lambda: make(([[1, 2, 3]], [0]), shape=(3, 2)), r"\(n, 2\).*given data of shape \(1, 3\)"),
        (lambda: make(([1, 2], [0, 1]), shape=(3, 2)), r"\(n, 2\).*given data of shape \(2,\)"),
        (lambda: make((np.zeros((0, 2)), [])), r"shape= when indices is empty"),
        (lambda: make((4,)), r"tuple of length 1"),
        (lambda: make((4, 2), shape=(4, 3)), r"expected shape \(4, 2\), given shape=\(4, 3\)"),
        (lambda: make(np.ones((2, 2)), shape=(3, 2)), r"expected shape \(2, 2\)"),
        (lambda: make((2**31, 2)), r"at most 2147483647 rows"),
        (lambda: nd.zeros((2**31, 2), stype="row_sparse"), r"at most 2147483647 rows"),
        (lambda: make(np.float32(3)), r"1 or more dimensions"),
        (lambda: make(([[1]], nd.sparse.zeros("row_sparse", (1, 1)))), r"1-D indices"),
        (lambda: make((nd.sparse.zeros("row_sparse", (1, 1)), [0])), r"dense data"),
    ]
    for call, message in cases:
        with pytest.raises(err, match=message):
            call()
    with pytest.raises(ValueError):  # shape refusals are also ValueErrors, as MXNet's
        make(([[1, 2]], [0, 1]), shape=(3, 2))
    for stype in ("csr", "dense"):
        with pytest.raises(err, match=r"'default' or 'row_sparse'.*'csr'"):
            sparse.zeros(stype, (2, 2))
        with pytest.raises(err, match=r"'default' or 'row_sparse'.*'csr'"):
            nd.zeros((2, 2)).tostype(stype)
        with pytest.raises(err, match=r"'default' or 'row_sparse'.*'csr'"):
            sparse.zeros("row_sparse", (2, 2)).tostype(stype)
    with pytest.raises(err, match="tostype"):
        sparse.array(nd.ones((2, 2)))
    with pytest.raises(err, match="nd.array"):
        sparse.array(np.ones((2, 2)))
    with pytest.raises(err, match="unexpected arguments"):
        sparse.zeros("row_sparse", (2, 2), foo=1)


# --------------------------------------------------------------------------------------------
# Attributes, conversions, copies
# --------------------------------------------------------------------------------------------
def test_attributes_and_repr():
    a = sparse.row_sparse_array(([[1, 2], [3, 4]], [1, 4]), shape=(6, 2), ctx=jaxkv.cpu(7))
    assert a.shape == (6, 2) and len(a) == 6 and a.ndim == 2 and a.ctx == jaxkv.cpu(7)
    assert isinstance(a, nd.NDArray) and isinstance(a, mx.nd.NDArray)  # as in MXNet
    assert repr(a) == "\n<RowSparseNDArray 6x2 @cpu(7)>"
    assert isinstance(a.indices, nd.NDArray) and a.indices.stype == "default"
    np.testing.assert_array_equal(np.asarray(a), a.asnumpy())
    np.testing.assert_array_equal(np.asarray(a.asjax()), a.asnumpy())
    assert a.asjax().sharding.device_set == {jaxkv.cpu(7).device}
    a.wait_to_read()
    assert sparse.row_sparse_array(([[5]], [0]), shape=(1, 1)).asscalar() == 5.0
    # .data and .indices are copies: changing them leaves the array alone (MXNet's deep copy).
    d = a.data
    d[:] = 0
    np.testing.assert_array_equal(a.data.asnumpy(), [[1, 2], [3, 4]])


def test_check_format_reports_mxnets_errors():
    devices = jax.devices("cpu")
    rows = jax.device_put(jnp.ones((2, 2)), devices[0])

    def made(ids, data=rows):
        return RowSparseNDArray(data, jnp.asarray(ids, jnp.int32), (4, 2))

    made([0, 3]).check_format()
    for ids in ([3, 0], [1, 1], [0, 4]):
        with pytest.raises(jaxkv.KVStoreError, match="non-negative, less than the size"):
            made(ids).check_format()
        made(ids).check_format(full_check=False)  # the O(1) check looks at shapes only
    with pytest.raises(jaxkv.KVStoreError, match="Shape mismatch of this row_sparse NDArray"):
        made([0]).check_format(full_check=False)


def test_tostype_round_trips():
    dense = nd.array([[0, 0, 0], [1, 2, 3], [0, 0, 0]], ctx=jaxkv.cpu(3))
    assert dense.stype == "default"
    rsp = dense.tostype("row_sparse")
    check(rsp, dense.asnumpy(), [1], jaxkv.cpu(3))
    back = rsp.tostype("default")
    assert type(back) is nd.NDArray and back.context == jaxkv.cpu(3)
    np.testing.assert_array_equal(back.asnumpy(), dense.asnumpy())
    again = rsp.tostype("row_sparse")
    assert again is not rsp
    check(again, dense.asnumpy(), [1], jaxkv.cpu(3))
    copy = dense.tostype("default")
    assert copy is not dense and type(copy) is nd.NDArray
    # NaN is not zero: its row is kept, as MXNet's cast_storage keeps it.
    nan = nd.array([[0, np.nan], [0, 0]]).tostype("row_sparse")
    assert nan.indices.asnumpy().tolist() == [0]
    # All rows zero, and every row non-zero.
    assert nd.zeros((3, 2)).tostype("row_sparse").data.shape == (0, 2)
    assert nd.ones((3, 2)).tostype("row_sparse").indices.asnumpy().tolist() == [0, 1, 2]


def test_copies_between_contexts():
    a = sparse.row_sparse_array(([[1, 2]], [2]), shape=(3, 2), ctx=jaxkv.cpu(1))
    b = a.copyto(jaxkv.cpu(6))
    check(b, a.asnumpy(), [2], jaxkv.cpu(6))
    assert a.as_in_context(jaxkv.cpu(1)) is a
    check(a.as_in_context(jaxkv.cpu(2)), a.asnumpy(), [2], jaxkv.cpu(2))
    # Into a row-sparse array: its dtype and device stay.
    out = sparse.zeros("row_sparse", (3, 2), ctx=jaxkv.cpu(4), dtype="float16")
    assert a.copyto(out) is out
    check(out, a.asnumpy().astype(np.float16), [2], jaxkv.cpu(4))
    # Into a dense array: the dense value.
    dense = nd.ones((3, 2), jaxkv.cpu(5))
    assert a.copyto(dense) is dense and dense.context == jaxkv.cpu(5)
    np.testing.assert_array_equal(dense.asnumpy(), a.asnumpy())
    # A dense array into a row-sparse one: its non-zero rows.
    nd.array([[0, 0], [7, 7], [0, 0]]).copyto(out)
    check(out, np.array([[0, 0], [7, 7], [0, 0]], np.float16), [1], jaxkv.cpu(4))
    c = a.copy()
    c *= 3
    np.testing.assert_array_equal(a.data.asnumpy(), [[1, 2]])
    assert a.copyto(a) is a
    with pytest.raises(jaxkv.ShapeError, match=r"\(3, 2\).*\(2, 2\)"):
        a.copyto(nd.zeros((2, 2)))
    with pytest.raises(jaxkv.KVStoreError, match="Context or an NDArray"):
        a.copyto("cpu(1)")
    assert a.astype("float16").dtype == np.float16 and a.astype("float32", copy=False) is a


def test_assignment():
    a = sparse.zeros("row_sparse", (3, 2), ctx=jaxkv.cpu(2))
    a[:] = sparse.row_sparse_array(([[1, 1]], [0]), shape=(3, 2), ctx=jaxkv.cpu(0))
    check(a, model((3, 2), [[1, 1]], [0]), [0], jaxkv.cpu(2))
    a[:] = np.array([[0, 0], [0, 0], [5, 0]])
    check(a, model((3, 2), [[5, 0]], [2]), [2], jaxkv.cpu(2))
    a[:] = 4  # a scalar: every row holds it, as MXNet's _set_value
    check(a, np.full((3, 2), 4, np.float32), [0, 1, 2], jaxkv.cpu(2))
    a[:] = a
    a[:] = 0
    assert a.indices.asnumpy().tolist() == [0, 1, 2] and not a.asnumpy().any()
    with pytest.raises(jaxkv.ShapeError, match=r"\(3, 2\), given shape \(2, 2\)"):
        a[:] = nd.ones((2, 2))
    with pytest.raises(jaxkv.KVStoreError, match="scalar"):
        a[:] = "1"


def test_what_mxnet_does_not_support_is_refused():
    a = nd.ones((4, 2)).tostype("row_sparse")
    assert a[:] is a
    for call in (
        lambda: a[1],
        lambda: a[1:2],
        lambda: a.reshape((2, 4)),
        lambda: a.size,
        lambda: a.__setitem__(0, 1),
        lambda: a.__setitem__(slice(0, 1), 1),
    ):
        with pytest.raises(jaxkv.KVStoreError, match="row-sparse"):
            call()
        with pytest.raises(NotImplementedError):  # MXNet raises NotImplementedError for these
            call()


# --------------------------------------------------------------------------------------------
# Arithmetic: MXNet's storage types
# --------------------------------------------------------------------------------------------
A = model((4, 3), [[1, 2, 3], [4, 5, 6]], [0, 2])
B = model((4, 3), [[2, 2, 2], [-1, 0, 1]], [2, 3])
D = np.arange(12, dtype=np.float32).reshape(4, 3) - 5


def _a():
    return sparse.row_sparse_array(A, ctx=jaxkv.cpu(1))


def _b():
    return sparse.row_sparse_array(B, ctx=jaxkv.cpu(1))


@pytest.mark.parametrize(
    "op, expected, stype",
    [
        (lambda: _a() + _b(), A + B, "row_sparse"),
        (lambda: _a() - _b(), A - B, "row_sparse"),
        (lambda: _a() * _b(), A * B, "row_sparse"),
        (lambda: _a() * 2, A * 2, "row_sparse"),
        (lambda: 2 * _a(), A * 2, "row_sparse"),
        (lambda: _a() * np.float64(0.5), A * 0.5, "row_sparse"),
        (lambda: _a() / 2, A / 2, "row_sparse"),
        (lambda: _a() * nd.array(D, ctx=jaxkv.cpu(1)), A * D, "row_sparse"),
        (lambda: nd.array(D, ctx=jaxkv.cpu(1)) * _a(), A * D, "row_sparse"),
        (lambda: -_a(), -A, "row_sparse"),
        (lambda: abs(-_a()), A, "row_sparse"),
        (lambda: _a() + 0, A, "row_sparse"),
        (lambda: _a() + 1, A + 1, "default"),
        (lambda: _a() - 2, A - 2, "default"),
        (lambda: 2 - _a(), 2 - A, "default"),
        (lambda: 0 - _a(), -A, "default"),
        (lambda: _a() + nd.array(D, ctx=jaxkv.cpu(1)), A + D, "default"),
        (lambda: nd.array(D, ctx=jaxkv.cpu(1)) + _a(), A + D, "default"),
        (lambda: nd.array(D, ctx=jaxkv.cpu(1)) - _a(), D - A, "default"),
        (lambda: D + _a(), A + D, "default"),
        (lambda: _a() / nd.array(D + 10, ctx=jaxkv.cpu(1)), A / (D + 10), "default"),
        (lambda: 1 / (_a() + 1), 1 / (A + 1), "default"),
        (lambda: _a() ** 2, A**2, "default"),
        (lambda: _a() * nd.array(D[0], ctx=jaxkv.cpu(1)), A * D[0], "default"),  # broadcast
        (lambda: sparse.add(_a(), _b()), A + B, "row_sparse"),
        (lambda: sparse.subtract(_a(), 1), A - 1, "default"),
        (lambda: sparse.multiply(_a(), 3), A * 3, "row_sparse"),
        (lambda: sparse.divide(_a(), 4), A / 4, "row_sparse"),
    ],
)
def test_arithmetic_keeps_mxnets_storage_types(op, expected, stype):
    got = op()
    assert got.stype == stype and got.context == jaxkv.cpu(1)
    np.testing.assert_allclose(got.asnumpy(), expected, rtol=1e-6)
    if stype == "row_sparse":
        got.check_format()


def test_row_sets_of_results_are_mxnets():
    assert (_a() + _b()).indices.asnumpy().tolist() == [0, 2, 3]  # union
    assert (_a() * _b()).indices.asnumpy().tolist() == [0, 2, 3]  # MXNet's RspRspOp: union
    assert (_a() * 2).indices.asnumpy().tolist() == [0, 2]
    other = sparse.row_sparse_array(B, ctx=jaxkv.cpu(6))  # another device: brought over
    assert (_a() + other).context == jaxkv.cpu(1)


def test_integer_rows_keep_their_dtype():
    a = sparse.row_sparse_array(([[7, -7]], [1]), shape=(2, 2), dtype="int32")
    half = a / 2  # MXNet casts the scalar to the dtype and keeps it: 7 / 2 = 3
    assert half.dtype == np.int32 and half.data.asnumpy().tolist() == [[3, -3]]
    assert (a * 2.9).data.asnumpy().tolist() == [[14, -14]]  # 2.9 cast to int32: 2


def test_in_place_operations():
    a = _a()
    before = a
    a += _b()
    assert a is before and a.stype == "row_sparse" and a.context == jaxkv.cpu(1)
    check(a, A + B, [0, 2, 3])
    a *= 2
    a /= 2
    a -= _b()
    check(a, A, [0, 2, 3])  # the union's rows stay (some now zero), as MXNet's elemwise_sub
    a -= nd.array(A)  # dense: the result's non-zero rows (none)
    check(a, np.zeros_like(A), [])
    # A dense array += a row-sparse one stays dense: what an MXNet updater does.
    stored = nd.ones((4, 3), jaxkv.cpu(1))
    stored += _a()
    assert type(stored) is nd.NDArray
    np.testing.assert_array_equal(stored.asnumpy(), A + 1)


def test_retain():
    # MXNet's sparse_retain: every id asked for is stored (once, sorted), zero where the
    # array stores no such row; an array that stores no row gives an empty result.
    a = _a()  # ids [0, 2]
    kept = sparse.retain(a, nd.array([2, 3, 2]))
    check(kept, A * (np.arange(4) == 2)[:, None], [2, 3], jaxkv.cpu(1))
    assert a.retain(nd.array([3, 0, 1], dtype="int64")).indices.asnumpy().tolist() == [0, 1, 3]
    assert sparse.retain(a, []).data.shape == (0, 3)
    empty = sparse.zeros("row_sparse", (4, 3), ctx=jaxkv.cpu(2))
    check(sparse.retain(empty, [1, 2]), np.zeros((4, 3), np.float32), [], jaxkv.cpu(2))
    with pytest.raises(jaxkv.KVStoreError, match="RowSparseNDArray"):
        sparse.retain(nd.ones((2, 2)), [0])
    with pytest.raises(jaxkv.KVStoreError, match=r"row ids in \[0, 4\).*\[4\]"):
        sparse.retain(a, [1, 4])


# --------------------------------------------------------------------------------------------
# int64 ids on the dense side (JAX's 64-bit types off)
# --------------------------------------------------------------------------------------------
def test_int64_arrays_report_int64():
    ids = nd.array([0, 3, 2**31 - 1], dtype="int64")
    assert ids.dtype == np.int64 and ids.asnumpy().dtype == np.int64
    assert ids.asnumpy().tolist() == [0, 3, 2**31 - 1]
    assert ids.asjax().dtype == jnp.int32  # held as int32
    two = nd.array(np.arange(4), dtype="int64").reshape((2, 2))  # MXNet's test reshapes ids
    assert two.dtype == np.int64 and two.asnumpy().tolist() == [[0, 1], [2, 3]]
    assert two[1].dtype == np.int64 and two.copy().dtype == np.int64
    assert two.copyto(jaxkv.cpu(3)).dtype == np.int64
    assert (two + 1).dtype == np.int64 and two.astype("float32").dtype == np.float32
    assert nd.array(two).dtype == np.int64 and nd.array(two, dtype="float32").dtype == np.float32
    assert (
        nd.zeros(3, dtype="int64").dtype == np.int64
        and nd.full(2, 7, dtype="uint64").dtype == np.uint64
    )
    assert nd.ones(2).astype("int64").dtype == np.int64
    assert np.asarray(two).dtype == np.int64
    assert nd.arange(0, 3, dtype="int64").asnumpy().tolist() == [0, 1, 2]
    assert nd.array([1.0], dtype="float64").dtype == np.float32  # floats are not declared
    with pytest.raises(jaxkv.KVStoreError, match=r"int64.*int32.*2147483648"):
        nd.array([2**31], dtype="int64")
    with pytest.raises(jaxkv.KVStoreError, match=r"int64.*int32"):
        nd.full(2, -(2**40), dtype="int64")


# --------------------------------------------------------------------------------------------
# What the KVStore relies on: in-place setters, and row-sparse arrays inside jit
# --------------------------------------------------------------------------------------------
def test_internal_setters(devices):
    out = sparse.zeros("row_sparse", (5, 2), ctx=jaxkv.cpu(3))
    rows = jax.device_put(jnp.ones((2, 2), jnp.float16), devices[3])
    ids = jax.device_put(jnp.asarray([1, 4], jnp.int32), devices[3])
    out.set_rows(rows, ids, devices[3])  # rows cast to the out's dtype (float32)
    check(out, model((5, 2), np.ones((2, 2)), [1, 4]), [1, 4], jaxkv.cpu(3))
    out.set_value(jax.device_put(jnp.eye(5, 2), devices[3]), devices[3])  # a dense value
    check(out, np.eye(5, 2, dtype=np.float32), [0, 1], jaxkv.cpu(3))
    with pytest.raises(jaxkv.ShapeError, match=r"\(n, 2\).*\(2, 3\)"):
        out.set_rows(jnp.ones((2, 3)), ids, devices[3])
    # _data: the dense value; assigning it stores its non-zero rows.
    np.testing.assert_array_equal(np.asarray(out.asjax()), np.eye(5, 2))
    out._data = jnp.zeros((5, 2)).at[2].set(1)
    check(out, model((5, 2), [[1, 1]], [2]), [2], jaxkv.cpu(3))


def test_row_preserving_operations_never_build_the_dense_array(monkeypatch):
    a = _a()

    def refuse(self):
        raise AssertionError("densified")

    monkeypatch.setattr(RowSparseNDArray, "as_dense", refuse)
    for b in (a * 2, a / 2, -a, abs(a), a + _b(), a - _b(), a * _b(), a.copy(), a + 0):
        assert b.stype == "row_sparse"
    a.copyto(jaxkv.cpu(4)).astype("float16").retain([0])
    _ = (a.shape, a.dtype, a.context, a.data, a.indices, a.asnumpy(), repr(a), len(a))
    a *= 3
    a[:] = _b()


def test_inside_jit(devices):
    rows = jnp.asarray([[1.0, 2.0], [3.0, 4.0]])
    ids = jnp.asarray([0, 2], jnp.int32)
    stored = jnp.ones((3, 2))

    @jax.jit
    def mxnet_updater(rows, ids, stored):
        # What an MXNet updater does with a row-sparse push: stored += input * 2.
        local = nd.NDArray(stored)
        pushed = RowSparseNDArray(rows, ids, (3, 2))
        assert "traced" in repr(pushed)
        local += pushed * 2
        return local.asjax()

    expected = np.ones((3, 2)) + 2 * model((3, 2), rows, ids)
    np.testing.assert_array_equal(mxnet_updater(rows, ids, stored), expected)

    @jax.jit
    def row_sparse_ops(rows, ids, dense):
        a = RowSparseNDArray(rows, ids, (3, 2))
        total = a + a  # the union's rows are unknown under a trace: every row is kept
        s = nd.NDArray(dense).tostype("row_sparse")
        kept = sparse.retain(a, jnp.asarray([2], jnp.int32))
        return total.row_ids, total.asjax(), s.row_ids, kept.asjax()

    total_ids, total, s_ids, kept = row_sparse_ops(rows, ids, jnp.eye(3, 2))
    assert total_ids.tolist() == [0, 1, 2] and s_ids.tolist() == [0, 1, 2]
    np.testing.assert_array_equal(total, 2 * model((3, 2), rows, ids))
    np.testing.assert_array_equal(kept, model((3, 2), [[3, 4]], [2]))


def test_mx_drop_in_names():
    import jaxkv.nd.sparse as by_import

    assert mx.nd.sparse is sparse is by_import
    assert mx.nd.sparse.RowSparseNDArray is RowSparseNDArray
    a = mx.nd.sparse.row_sparse_array(([[1, 2]], [1]), shape=(2, 2), ctx=mx.cpu(1))
    assert a.context == mx.cpu(1)
    with pytest.raises(mx.MXNetError):
        mx.nd.sparse.zeros("csr", (2, 2))


# --------------------------------------------------------------------------------------------
# Properties against the NumPy model
# --------------------------------------------------------------------------------------------
@st.composite
def definitions(draw, shape=None):
    """(shape, data, ids, ctx id): unique ids in any order, small whole-number values."""
    shape = shape or draw(st.sampled_from(SHAPES))
    ids = draw(st.lists(st.integers(0, shape[0] - 1), unique=True, max_size=shape[0]))
    size = int(np.prod((len(ids), *shape[1:])))
    values = draw(st.lists(st.integers(-4, 4), min_size=size, max_size=size))
    data = np.asarray(values, np.float32).reshape((len(ids), *shape[1:]))
    return shape, data, np.asarray(ids, np.int64), draw(st.integers(0, 7))


@SETTINGS
@given(definitions(), st.sampled_from(["list", "numpy", "ndarray", "jax"]))
def test_definition_matches_the_model(definition, form):
    shape, data, ids, c = definition
    as_form = {
        # An empty list has no row shape (MXNet refuses it too): lists only with rows.
        "list": lambda x: x.tolist() if len(x) else x,
        "numpy": lambda x: x,
        "ndarray": lambda x: nd.array(x, dtype=x.dtype),
        "jax": lambda x: jnp.asarray(x, jnp.int32 if x.dtype == np.int64 else None),
    }[form]
    a = sparse.row_sparse_array((as_form(data), as_form(ids)), shape=shape, ctx=jaxkv.cpu(c))
    check(a, model(shape, data, ids), np.sort(ids), jaxkv.cpu(c))


@SETTINGS
@given(definitions(), st.integers(0, 7))
def test_dense_round_trip_matches_the_model(definition, c):
    shape, data, ids, c0 = definition
    dense = model(shape, data, ids)
    rsp = nd.array(dense, ctx=jaxkv.cpu(c0)).tostype("row_sparse")
    nonzero = np.flatnonzero(dense.reshape(shape[0], -1).any(axis=1))
    check(rsp, dense, nonzero, jaxkv.cpu(c0))
    moved = rsp.copyto(jaxkv.cpu(c))
    check(moved, dense, nonzero, jaxkv.cpu(c))
    back = moved.tostype("default")
    assert back.context == jaxkv.cpu(c)
    np.testing.assert_array_equal(back.asnumpy(), dense)


@SETTINGS
@given(st.sampled_from(SHAPES).flatmap(lambda s: st.tuples(definitions(s), definitions(s))))
def test_arithmetic_matches_the_model(pair):
    (shape, data_a, ids_a, c), (_, data_b, ids_b, c_b) = pair
    dense_a, dense_b = model(shape, data_a, ids_a), model(shape, data_b, ids_b)
    a = sparse.row_sparse_array((data_a, ids_a), shape=shape, ctx=jaxkv.cpu(c))
    b = sparse.row_sparse_array((data_b, ids_b), shape=shape, ctx=jaxkv.cpu(c_b))
    union = np.union1d(ids_a, ids_b)
    check(a + b, dense_a + dense_b, union, jaxkv.cpu(c))
    check(a - b, dense_a - dense_b, union, jaxkv.cpu(c))
    check(a * b, dense_a * dense_b, union, jaxkv.cpu(c))
    check(a * 3, dense_a * 3, np.sort(ids_a), jaxkv.cpu(c))
    check(a * nd.array(dense_b, ctx=jaxkv.cpu(c)), dense_a * dense_b, np.sort(ids_a))
    dense_sum = a + nd.array(dense_b, ctx=jaxkv.cpu(c))
    assert dense_sum.stype == "default"
    np.testing.assert_array_equal(dense_sum.asnumpy(), dense_a + dense_b)
    kept = sparse.retain(a, ids_b)  # MXNet's: every id asked for (when a stores any row)
    check(
        kept,
        np.where(
            np.isin(np.arange(shape[0]), ids_b).reshape(-1, *[1] * (len(shape) - 1)), dense_a, 0
        ),
        np.unique(ids_b) if len(ids_a) else [],
        jaxkv.cpu(c),
    )
    a += b
    check(a, dense_a + dense_b, union, jaxkv.cpu(c))
