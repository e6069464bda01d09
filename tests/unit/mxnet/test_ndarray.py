"""jaxkv/_src/mxnet/ndarray.py: the bounds of int64 values held as int32, the dtype an array
reports, the refusals of creation and of ``a[:] = v``, and waitall raising a failed
computation's error once."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jaxkv
from jaxkv._src.mxnet import ndarray

I32 = np.iinfo(np.int32)


@pytest.mark.parametrize("values", [[I32.max], [I32.min], [I32.min, 0, I32.max]])
def test_int64_values_at_the_int32_bounds_are_held_exactly(values):
    a = ndarray.array(values, dtype="int64")
    assert a.dtype == np.int64 and a.asjax().dtype == np.int32
    np.testing.assert_array_equal(a.asnumpy(), np.asarray(values, np.int64))


@pytest.mark.parametrize("values", [[I32.max + 1], [I32.min - 1], [0, I32.max + 1]])
def test_int64_values_one_past_the_int32_bounds_are_refused(values):
    with pytest.raises(jaxkv.KVStoreError, match=r"expected values in \[-2147483648, 2147483647\]"):
        ndarray.array(values, dtype="int64")
    with pytest.raises(jaxkv.KVStoreError, match="given values in"):
        ndarray.full((2,), values[-1], dtype="int64")


def test_uint64_values_are_bounded_by_uint32_and_an_empty_array_needs_no_bound():
    top = np.iinfo(np.uint32).max
    assert ndarray.array([top], dtype="uint64").asnumpy().tolist() == [top]
    with pytest.raises(jaxkv.KVStoreError, match=r"\[0, 4294967295\].*\[4294967296, 4294967296\]"):
        ndarray.array([top + 1], dtype="uint64")
    empty = ndarray.array([], dtype="int64")  # no min or max to check
    assert empty.shape == (0,) and empty.dtype == np.int64


def test_only_64_bit_integers_are_declared_over_what_is_held():
    assert ndarray.declared_dtype("int64") == np.int64
    assert ndarray.declared_dtype("uint64") == np.uint64
    assert ndarray.declared_dtype("int32") is None  # held as asked: nothing to declare
    assert ndarray.declared_dtype("float64") is None  # float32 held: its values are not exact
    assert ndarray.declared_dtype(None) is None
    assert ndarray.array([1.5], dtype="float64").dtype == np.float32
    a = ndarray.array([3, 1], dtype="int64")
    assert (a + 1).dtype == np.int64 and a[0].dtype == np.int64 and a.copy().dtype == np.int64
    assert a.astype("float32").dtype == np.float32  # the declaration no longer fits
    assert a.asnumpy().dtype == np.int64 and np.asarray(a).dtype == np.int64


def test_negating_an_int64_array_keeps_reporting_int64():
    a = ndarray.array([1, -2], dtype="int64")
    assert (-a).dtype == np.int64
    assert abs(a).dtype == np.int64


@pytest.mark.parametrize(("shape", "ok"), [((), True), ((1,), True), ((1, 1), True), ((2,), False)])
def test_asscalar_takes_exactly_one_element(shape, ok):
    a = ndarray.full(shape, 7.0)
    if ok:
        assert a.asscalar() == 7.0
    else:
        with pytest.raises(jaxkv.ShapeError, match=r"expected an array of size 1, given shape"):
            a.asscalar()


def test_slice_assignment_broadcasts_keeps_device_and_refuses_other_shapes():
    a = ndarray.zeros((2, 3), ctx=jaxkv.cpu(3))
    a[:] = np.array([1.0, 2.0, 3.0], np.float32)  # broadcasts along the rows
    np.testing.assert_array_equal(a.asnumpy(), [[1, 2, 3], [1, 2, 3]])
    assert a.context == jaxkv.cpu(3)
    before = a.asjax()
    with pytest.raises(jaxkv.ShapeError, match=r"shape \(2, 3\).*given shape \(2,\)"):
        a[:] = np.array([1.0, 2.0], np.float32)
    assert a.asjax() is before  # refused: the handle still holds what it held
    a[1] = 9.0  # any other index sets that part only
    np.testing.assert_array_equal(a.asnumpy(), [[1, 2, 3], [9, 9, 9]])


def test_reflected_operators_put_the_other_operand_first():
    a = ndarray.array([1.0, 2.0, 4.0])
    np.testing.assert_array_equal((10 - a).asnumpy(), [9, 8, 6])
    np.testing.assert_array_equal((a - 10).asnumpy(), [-9, -8, -6])
    np.testing.assert_array_equal((8 / a).asnumpy(), [8, 4, 2])
    np.testing.assert_array_equal((a / 8).asnumpy(), [0.125, 0.25, 0.5])
    np.testing.assert_array_equal((a**2).asnumpy(), [1, 4, 16])


def test_in_place_operators_rebind_the_handle_in_its_own_dtype():
    a = ndarray.array([5, -5], dtype="int32")
    handle = a
    a /= 2  # true division, then back to int32: truncated toward zero
    assert a is handle and a.dtype == np.int32
    np.testing.assert_array_equal(a.asnumpy(), [2, -2])
    a -= 3
    a *= 2
    np.testing.assert_array_equal(a.asnumpy(), [-2, -10])


def test_a_replicated_array_lives_on_its_lowest_numbered_device(devices):
    mesh = Mesh(np.array([devices[5], devices[1], devices[3]]), ("x",))
    data = jax.device_put(jnp.ones(2), NamedSharding(mesh, PartitionSpec()))
    assert ndarray.NDArray(data).context == jaxkv.cpu(1)


def test_creators_take_mxnets_harmless_arguments_and_refuse_the_others():
    assert ndarray.zeros(2, out=None).shape == (2,)
    assert ndarray.ones(2, stype="default").shape == (2,)
    assert ndarray.empty(3, stype=None).asnumpy().tolist() == [0, 0, 0]
    with pytest.raises(jaxkv.KVStoreError, match=r"stype='default'.*\['out'\]"):
        ndarray.zeros(2, out=ndarray.zeros(2))
    with pytest.raises(jaxkv.KVStoreError, match="given stype='csr'"):
        ndarray.zeros(2, stype="csr")
    with pytest.raises(jaxkv.KVStoreError, match="given stype='csr'"):
        ndarray.array([1.0]).tostype("csr")
    with pytest.raises(jaxkv.KVStoreError, match="expected a jaxkv.Context.*given 'cpu'"):
        ndarray.zeros(2, ctx="cpu")
    with pytest.raises(jaxkv.KVStoreError, match="expected a Context or an NDArray"):
        ndarray.zeros(2).copyto(3)


def test_shapes_sizes_and_lengths():
    assert ndarray.as_shape(3) == (3,) and ndarray.as_shape([2, 1]) == (2, 1)
    a = ndarray.zeros((2, 0, 3))
    assert len(a) == 2 and a.size == 0 and a.ndim == 3
    b = ndarray.arange(6).reshape(2, 3)
    assert b.shape == (2, 3) and b.reshape((3, 2)).shape == (3, 2)
    np.testing.assert_array_equal(b.asnumpy(), np.arange(6, dtype=np.float32).reshape(2, 3))


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((3,), [0, 1, 2]),  # no stop: [0, start)
        ((1, 4), [1, 2, 3]),
        ((0, 5, 2), [0, 2, 4]),
        ((2,), [0, 1]),
    ],
)
def test_arange_spans_start_to_stop_exclusive(args, expected):
    assert ndarray.arange(*args).asnumpy().tolist() == expected
    got = ndarray.arange(*args, repeat=2).asnumpy().tolist()
    assert got == [v for v in expected for _ in range(2)]


def test_copies_keep_their_own_buffer_and_the_same_context_is_not_copied():
    a = ndarray.array([1.0, 2.0], ctx=jaxkv.cpu(2))
    assert a.as_in_context(jaxkv.cpu(2)) is a
    b = a.as_in_context(jaxkv.cpu(4))
    assert b.context == jaxkv.cpu(4)
    target = ndarray.zeros(2, ctx=jaxkv.cpu(6))
    assert a.copyto(target) is target
    assert target.context == jaxkv.cpu(6) and target.asnumpy().tolist() == [1.0, 2.0]
    a += 1  # the copies do not follow
    assert b.asnumpy().tolist() == [1.0, 2.0] and target.asnumpy().tolist() == [1.0, 2.0]


def test_an_array_made_on_the_host_goes_to_its_device_only_when_read_there():
    """``nd.array`` of host data keeps its own copy on the host until read as a ``jax.Array``
    (row ids read back on the host never reach the device): the same values, dtype, shape
    and device either way, and the source written afterwards changes nothing."""
    source = np.arange(6, dtype=np.float64).reshape(2, 3)
    a = ndarray.array(source, ctx=jaxkv.cpu(3))
    source[:] = -1  # the array holds a copy of its own
    assert a.host_value() is not None  # still on the host
    assert a.shape == (2, 3) and a.dtype == np.float32 and a.context == jaxkv.cpu(3)
    got = a.asnumpy()
    got[:] = 7  # a copy: the array's host value is not handed out
    np.testing.assert_array_equal(a.asnumpy(), np.arange(6, dtype=np.float32).reshape(2, 3))
    assert a.host_value() is not None  # reading on the host put nothing on the device
    x = a.asjax()  # read as a jax.Array: put on its device, once
    assert a.host_value() is None and a.asjax() is x
    assert x.devices() == {jax.devices("cpu")[3]} and x.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(x), np.arange(6, dtype=np.float32).reshape(2, 3))
    b = ndarray.array([1, 2], dtype="int64")
    np.testing.assert_array_equal((b + 1).asnumpy(), [2, 3])  # arithmetic reads the device value
    assert b.dtype == np.int64


def test_waitall_raises_a_failed_computations_error_once():
    """MXNet's engine rethrows a failed operation's error at one waitall and clears it: the
    failed array, still alive, does not make every later waitall raise; a new failure does."""
    mesh = Mesh(np.array(jax.devices("cpu")[:4]), ("kv",))
    failing = [3]  # (the device whose part fails)

    def fails_on_a_device(i):
        if i in failing:
            raise ValueError("a failed computation")

    def body(b):
        jax.debug.callback(fails_on_a_device, jax.lax.axis_index("kv"))
        return b + 1

    run = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=PartitionSpec("kv"), out_specs=PartitionSpec("kv"))
    )
    kept = []  # (alive: the errors are the waitalls' to raise)
    for _ in range(2):
        kept.append(run(jnp.arange(8.0)))
        with pytest.raises(Exception, match="a failed computation"):
            ndarray.waitall()
        ndarray.waitall()  # (raised once)
        assert not kept[-1].is_deleted()
    failing.clear()  # the same computation, succeeding: its results and a waitall as ever
    np.testing.assert_array_equal(np.asarray(run(jnp.arange(8.0))), np.arange(8.0) + 1)
    ndarray.waitall()
