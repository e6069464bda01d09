"""``mx.random`` and ``mx.nd.random_*`` through ``import jaxkv.mx as mx``, as MXNet 1.9.1's own
KVStore tests use them: ``mx.random.seed`` in every seeded test (with NumPy's integers), and
``nd.random_uniform(-0.6, 0.6, shape=s, ctx=...)``, ``nd.random_normal(shape=..., ctx=...)`` as
gradients (deep-copied, made row-sparse). The checks are MXNet's contract: after ``seed(s)`` the
same calls give the same numbers; shapes, dtypes, devices and distributions are MXNet's (the
streams themselves are not: MXNet's generators are its own)."""

import copy

import numpy as np
import pytest

import jaxkv
import jaxkv.mx as mx
from jaxkv._src.mxnet import random as _random


@pytest.fixture(autouse=True)
def _fresh_generators(monkeypatch):
    monkeypatch.setattr(_random, "_GENERATORS", _random._Generators())


DRAWS = {
    "uniform": lambda: mx.nd.random.uniform(-2, 3, shape=(3, 4)),
    "normal": lambda: mx.nd.random.normal(1, 2, shape=(3, 4)),
    "randint": lambda: mx.nd.random.randint(0, 1000, shape=(3, 4)),
    "randn": lambda: mx.nd.random.randn(3, 4),
    "shuffle": lambda: mx.nd.random.shuffle(mx.nd.arange(12).reshape((6, 2))),
    "random_uniform": lambda: mx.nd.random_uniform(-0.6, 0.6, shape=(3, 4)),
    "random_normal": lambda: mx.nd.random_normal(shape=(3, 4)),
    "mx.random.uniform": lambda: mx.random.uniform(shape=(3, 4)),
}


@pytest.mark.parametrize("draw", DRAWS.values(), ids=DRAWS.keys())
def test_after_seed_the_same_calls_give_the_same_numbers(draw):
    mx.random.seed(1234)
    first = [draw().asnumpy() for _ in range(3)]
    mx.random.seed(1234)
    again = [draw().asnumpy() for _ in range(3)]
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a, b)
    assert not all(np.array_equal(first[0], a) for a in first[1:])  # the stream moves on


def test_another_seed_gives_other_numbers():
    mx.random.seed(1)
    a = mx.nd.random.uniform(shape=100).asnumpy()
    mx.random.seed(2)
    assert not np.array_equal(a, mx.nd.random.uniform(shape=100).asnumpy())


def test_seed_takes_numpy_integers_as_mxnets_test_helpers_pass_them():
    seed = np.random.randint(0, np.iinfo(np.int32).max)  # common.py's with_seed()
    mx.random.seed(seed)
    a = mx.nd.random.normal(shape=8).asnumpy()
    mx.random.seed(int(seed))
    np.testing.assert_array_equal(a, mx.nd.random.normal(shape=8).asnumpy())


@pytest.mark.parametrize("bad", [1.0, "1", None])
def test_a_seed_that_is_not_an_int_is_refused_as_mxnet_refuses_it(bad):
    with pytest.raises(ValueError, match="expected seed_state an int"):
        mx.random.seed(bad)
    with pytest.raises(mx.MXNetError):
        mx.random.seed(bad)


def test_each_device_has_its_own_stream():
    mx.random.seed(3)
    a0 = mx.nd.random.uniform(shape=50, ctx=mx.cpu(0)).asnumpy()
    a1 = mx.nd.random.uniform(shape=50, ctx=mx.cpu(1)).asnumpy()
    assert not np.array_equal(a0, a1)
    mx.random.seed(3)
    mx.nd.random.uniform(shape=50, ctx=mx.cpu(1))  # a draw elsewhere first: cpu(0)'s is intact
    np.testing.assert_array_equal(mx.nd.random.uniform(shape=50, ctx=mx.cpu(0)).asnumpy(), a0)


def test_a_device_seeded_alone_draws_the_same_whatever_its_index():
    mx.random.seed(11, ctx=mx.cpu(2))
    mx.random.seed(11, ctx=mx.cpu(5))
    a = mx.nd.random.normal(shape=20, ctx=mx.cpu(2)).asnumpy()
    np.testing.assert_array_equal(a, mx.nd.random.normal(shape=20, ctx=mx.cpu(5)).asnumpy())
    mx.random.seed(11)  # as MXNet: what cpu(0) draws after seed(11)
    np.testing.assert_array_equal(a, mx.nd.random.normal(shape=20, ctx=mx.cpu(0)).asnumpy())


def test_random_uniform_as_the_nightly_kvstore_test_makes_gradients():
    grads = [mx.nd.random_uniform(-0.6, 0.6, shape=(4, 4), ctx=mx.cpu(g)) for g in range(4)]
    copies = copy.deepcopy(grads)
    for g, (grad, cp) in enumerate(zip(grads, copies, strict=True)):
        assert grad.shape == (4, 4) and grad.dtype == np.float32 and grad.context == mx.cpu(g)
        values = grad.asnumpy()
        assert ((values >= -0.6) & (values < 0.6)).all()
        np.testing.assert_array_equal(cp.asnumpy(), values)
        assert cp.context == mx.cpu(g)
    grads[0][:] = 0  # the deep copy is its own array
    assert np.abs(copies[0].asnumpy()).sum() > 0


def test_random_normal_as_the_gpu_kvstore_test_makes_a_row_sparse_gradient():
    copy_ = mx.nd.random_normal(shape=(4, 4), ctx=mx.cpu(1))
    grad = copy_.tostype("row_sparse")
    assert copy_.context == mx.cpu(1) and grad.shape == (4, 4)
    np.testing.assert_array_equal(grad.asnumpy(), copy_.asnumpy())


@pytest.mark.parametrize(
    ("call", "shape"),
    [
        (lambda: mx.nd.random.uniform(), (1,)),
        (lambda: mx.nd.random.normal(0, 1), (1,)),
        (lambda: mx.nd.random.uniform(shape=3), (3,)),
        (lambda: mx.nd.random.uniform(shape=[2, 3]), (2, 3)),
        (lambda: mx.nd.random_uniform(0, 1, 3), (3,)),
        (lambda: mx.nd.random_normal(1, 2, (3,)), (3,)),
        (lambda: mx.nd.random.randn(2, 3, loc=5), (2, 3)),
        (lambda: mx.nd.random.randint(5, 100), (1,)),
    ],
)
def test_shapes_are_mxnets(call, shape):
    assert call().shape == shape


@pytest.mark.parametrize(
    "call",
    [
        lambda: mx.nd.random.uniform(shape=()),
        lambda: mx.nd.random.uniform(shape=0),
        lambda: mx.nd.random.normal(shape=(2, 0)),
        lambda: mx.nd.random_uniform(),  # MXNet's operator needs a shape (or an out)
        lambda: mx.nd.random_normal(),
        lambda: mx.nd.random.randn(),
    ],
)
def test_empty_shapes_are_refused_as_mxnet_refuses_them(call):
    with pytest.raises(mx.MXNetError, match="expected"):
        call()


@pytest.mark.parametrize(
    ("call", "dtype"),
    [
        (lambda: mx.nd.random.uniform(shape=2), np.float32),
        (lambda: mx.nd.random.uniform(shape=2, dtype="float16"), np.float16),
        (lambda: mx.nd.random.normal(shape=2, dtype=np.float16), np.float16),
        (lambda: mx.nd.random_uniform(shape=2), np.float32),
        (lambda: mx.nd.random.randint(0, 5, shape=2), np.int32),
        (lambda: mx.nd.random.randint(0, 5, shape=2, dtype="int64"), np.int64),
        (lambda: mx.nd.random.shuffle(mx.nd.array([1, 2, 3], dtype="int64")), np.int64),
    ],
)
def test_dtypes_are_mxnets(call, dtype):
    a = call()
    assert a.dtype == dtype and a.asnumpy().dtype == dtype


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: mx.nd.random.uniform(shape=2, dtype="int32"), "expected dtype one of"),
        (lambda: mx.nd.random.randint(0, 5, dtype="float32"), "expected dtype one of"),
        (lambda: mx.nd.random.uniform(2, 1, shape=2), "expected low <= high"),
        (lambda: mx.nd.random.normal(0, 0, shape=2), "expected scale > 0"),
        (lambda: mx.nd.random.uniform("a", 2), "expected low a number or an NDArray"),
        (lambda: mx.nd.random.uniform(True, 2), "expected low a number"),
        (lambda: mx.nd.random_uniform(mx.nd.array([0]), mx.nd.array([1]), shape=2), "numbers"),
        (lambda: mx.nd.random.uniform(shape=2, foo=1), r"given \['foo'\]"),
    ],
)
def test_what_mxnet_refuses_is_refused_as_mxnet_error_and_value_error(call, match):
    with pytest.raises(mx.MXNetError, match=match) as caught:
        call()
    assert isinstance(caught.value, ValueError)


def test_parameters_of_mixed_kinds_are_refused_as_mxnet_asserts():
    with pytest.raises(AssertionError, match="one kind"):
        mx.nd.random.uniform(mx.nd.array([0, 1]), 2)
    with pytest.raises(mx.MXNetError):
        mx.nd.random.normal(0, mx.nd.array([1, 1]))


def test_ctx_places_the_draw_and_out_or_ndarray_parameters_win_over_it():
    assert mx.nd.random.uniform(shape=2, ctx=mx.cpu(3)).context == mx.cpu(3)
    with mx.cpu(4):
        assert mx.nd.random.normal(shape=2).context == mx.cpu(4)  # the current context
    out = mx.nd.zeros((2, 2), ctx=mx.cpu(5), dtype="float16")
    got = mx.nd.random.uniform(out=out, ctx=mx.cpu(1))
    assert got is out and out.context == mx.cpu(5) and out.dtype == np.float16
    low = mx.nd.array([0, 1], ctx=mx.cpu(2))
    a = mx.nd.random.uniform(low, mx.nd.array([1, 2]), shape=3, ctx=mx.cpu(6))
    assert a.shape == (2, 3) and a.context == mx.cpu(2)


def test_an_out_of_another_shape_or_dtype_is_refused_and_kept():
    out = mx.nd.ones((2, 2))
    with pytest.raises(mx.MXNetError, match=r"expected out of shape \(3,\)"):
        mx.nd.random.uniform(shape=3, out=out)
    with pytest.raises(mx.MXNetError, match="expected out of dtype float16"):
        mx.nd.random.uniform(shape=(2, 2), dtype="float16", out=out)
    np.testing.assert_array_equal(out.asnumpy(), np.ones((2, 2)))


def test_uniform_is_uniform_on_low_high():
    a = mx.nd.random.uniform(-2, 6, shape=(200_000,)).asnumpy()
    assert a.min() >= -2 and a.max() < 6
    assert abs(a.mean() - 2) < 0.05 and abs(a.var() - 64 / 12) < 0.1
    counts, _ = np.histogram(a, bins=8, range=(-2, 6))
    assert (np.abs(counts / len(a) - 1 / 8) < 0.01).all()


def test_normal_has_mean_loc_and_deviation_scale():
    a = mx.nd.random.normal(5, 2, shape=(200_000,)).asnumpy()
    assert abs(a.mean() - 5) < 0.03 and abs(a.std() - 2) < 0.03
    assert abs(np.mean(np.abs(a - 5) < 2) - 0.6827) < 0.01  # one sigma


def test_randint_is_uniform_on_its_integers():
    a = mx.nd.random.randint(-3, 4, shape=(70_000,)).asnumpy()
    values, counts = np.unique(a, return_counts=True)
    assert values.tolist() == list(range(-3, 4))
    assert (np.abs(counts / len(a) - 1 / 7) < 0.01).all()


def test_shuffle_permutes_the_first_axis_only_and_leaves_its_input():
    data = mx.nd.arange(20).reshape((10, 2))
    seen = set()
    for _ in range(5):
        rows = mx.nd.random.shuffle(data).asnumpy()
        assert sorted(rows.tolist()) == data.asnumpy().tolist()  # whole rows, each once
        seen.add(tuple(rows[:, 0]))
    assert len(seen) > 1
    np.testing.assert_array_equal(data.asnumpy(), np.arange(20).reshape((10, 2)))


def test_random_is_a_module_of_jaxkv_mx_and_of_jaxkv_nd():
    import jaxkv.nd.random as nd_random

    assert nd_random is mx.nd.random
    assert mx.random.uniform is mx.nd.random.uniform and mx.random.seed is nd_random.seed
    assert "random" not in mx._ABSENT
    assert isinstance(mx.random.RandomArgumentError("x"), jaxkv.KVStoreError)
