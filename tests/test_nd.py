"""jaxkv.nd NDArrays and contexts: MXNet's creation functions, handles, in-place updates."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import nd


def test_contexts_name_local_devices(devices):
    assert jaxkv.cpu(3).device == devices[3]
    assert jaxkv.Context("cpu", 2) == jaxkv.cpu(2)
    assert jaxkv.Context(jaxkv.cpu(1)) == jaxkv.cpu(1)
    assert repr(jaxkv.cpu(5)) == "cpu(5)"
    assert len({jaxkv.cpu(0), jaxkv.cpu(0), jaxkv.cpu(1)}) == 2
    with pytest.raises(jaxkv.KVStoreError, match=r"cpu\(8\) does not exist.*8 cpu device"):
        jaxkv.cpu(8)
    with pytest.raises(jaxkv.KVStoreError, match=r"gpu\(0\) does not exist.*0 gpu"):
        jaxkv.gpu(0)
    with pytest.raises(jaxkv.KVStoreError, match="device type"):
        jaxkv.Context("tpu", 0)


def test_default_context_and_with_blocks():
    assert nd.zeros(2).context == jaxkv.cpu(0)
    with jaxkv.cpu(4):
        assert nd.ones((2, 2)).context == jaxkv.cpu(4)
        assert jaxkv.current_context() == jaxkv.cpu(4)
    assert jaxkv.current_context() == jaxkv.cpu(0)


@pytest.mark.parametrize("make, fill", [(nd.zeros, 0), (nd.ones, 1), (nd.empty, 0)])
def test_creation_defaults_are_mxnets(make, fill):
    a = make((2, 3))
    assert a.shape == (2, 3) and a.dtype == np.float32 and a.context == jaxkv.cpu(0)
    np.testing.assert_array_equal(a.asnumpy(), np.full((2, 3), fill))
    b = make(4, jaxkv.cpu(2), dtype="int32")  # ctx positional, shape as an int
    assert b.shape == (4,) and b.dtype == np.int32 and b.context == jaxkv.cpu(2)


def test_full_and_array():
    f = nd.full((2,), 7, ctx=jaxkv.cpu(1))
    np.testing.assert_array_equal(f.asnumpy(), [7.0, 7.0])
    a = nd.array(np.arange(3, dtype=np.int32))  # MXNet: float32 unless source is an NDArray
    assert a.dtype == np.float32
    b = nd.array(nd.ones(2, dtype="int32"), ctx=jaxkv.cpu(3))
    assert b.dtype == np.int32 and b.context == jaxkv.cpu(3)
    assert nd.array([[1, 2]], dtype="float16").dtype == np.float16
    # MXNet's zeros and empty take stype='row_sparse' (tests/test_nd_sparse.py); ones and full
    # make dense arrays only, and no creator makes 'csr'.
    for make in (lambda: nd.ones((2, 2), stype="row_sparse"), lambda: nd.full(2, 1, stype="rsp")):
        with pytest.raises(jaxkv.KVStoreError, match="stype.*tostype"):
            make()
    with pytest.raises(jaxkv.KVStoreError, match="'default' or 'row_sparse'.*'csr'"):
        nd.zeros((2, 2), stype="csr")


def test_arithmetic_and_in_place_updates_rebind_the_handle():
    a = nd.ones((2, 2), jaxkv.cpu(1))
    b = (a * 2 + 1 - a / 2) ** 2
    np.testing.assert_allclose(b.asnumpy(), np.full((2, 2), 6.25))
    np.testing.assert_array_equal((3 - a).asnumpy(), np.full((2, 2), 2.0))
    np.testing.assert_array_equal((-a).asnumpy(), np.full((2, 2), -1.0))
    before = a.asjax()
    a += 4
    a *= 2
    a -= 1
    a /= 9
    np.testing.assert_array_equal(a.asnumpy(), np.ones((2, 2)))
    np.testing.assert_array_equal(before, np.ones((2, 2)))  # arrays are immutable
    assert a.context == jaxkv.cpu(1)


def test_slice_assignment_keeps_shape_dtype_and_device():
    a = nd.zeros((2, 3), jaxkv.cpu(2), dtype="int32")
    a[:] = 5
    np.testing.assert_array_equal(a.asnumpy(), np.full((2, 3), 5))
    a[:] = nd.ones((2, 3), jaxkv.cpu(0)) * 2.7  # cast to int32, moved to cpu(2)
    assert a.dtype == np.int32 and a.context == jaxkv.cpu(2)
    np.testing.assert_array_equal(a.asnumpy(), np.full((2, 3), 2))
    a[0] = 9
    np.testing.assert_array_equal(a.asnumpy()[0], [9, 9, 9])
    with pytest.raises(jaxkv.ShapeError, match=r"\(2, 3\)"):
        a[:] = np.ones((3, 3))


def test_copies_between_contexts():
    a = nd.ones((2,), jaxkv.cpu(0))
    b = a.copyto(jaxkv.cpu(5))
    assert b.context == jaxkv.cpu(5)
    assert a.as_in_context(jaxkv.cpu(0)) is a
    c = nd.zeros((2,), jaxkv.cpu(6))
    assert a.copyto(c) is c and c.context == jaxkv.cpu(6)
    np.testing.assert_array_equal(c.asnumpy(), [1.0, 1.0])
    d = a.copy()
    d += 1
    np.testing.assert_array_equal(a.asnumpy(), [1.0, 1.0])


def test_conversions_and_repr():
    a = nd.array([[1, 2], [3, 4]], ctx=jaxkv.cpu(1))
    assert isinstance(a.asjax(), jax.Array)
    np.testing.assert_array_equal(np.asarray(a), [[1, 2], [3, 4]])
    assert jnp.sum(a.asjax()) == 10
    assert nd.array([5]).asscalar() == 5.0
    assert repr(a).endswith("<NDArray 2x2 @cpu(1)>")
    a.wait_to_read()
    nd.waitall()
    assert len(a) == 2 and a.size == 4 and a.ndim == 2 and a[1].asnumpy().tolist() == [3, 4]


def test_mx_drop_in_names():
    import jaxkv.mx as mx

    assert mx.nd is nd and mx.cpu(1) == jaxkv.cpu(1)
    assert mx.Context("cpu", 1) == mx.context.current_context().__class__("cpu", 1)
    kv = mx.kv.create("local")
    assert isinstance(kv, mx.kv.KVStore) and kv.type == "local"
    with pytest.raises(mx.MXNetError):
        mx.kv.create("nope")


def test_an_element_comes_as_shape_one_as_in_mxnet():
    """MXNet 1.9.1 (recorded): ``nd.array([1, 2, 3])[1]``, ``[-1]`` and ``[1:2]`` have shape
    ``(1,)``; ``nd.ones((2, 3))[1]`` has ``(3,)``, ``[1, 2]`` and ``[1][2]`` have ``(1,)``."""
    x = nd.array([1, 2, 3])
    assert x[1].shape == x[-1].shape == x[1:2].shape == (1,)
    assert x[1].asnumpy().tolist() == [2.0]
    y = nd.array(np.arange(6).reshape(2, 3), dtype="int64")
    assert y[1].shape == (3,)
    assert y[1, 2].shape == y[1][2].shape == (1,)
    assert y[1, 2].asnumpy().tolist() == [5] and y[1, 2].dtype == np.int64
