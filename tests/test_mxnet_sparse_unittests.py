"""MXNet's KVStore unit tests with row-sparse values, run through the drop-in ``jaxkv.mx``.

Ported from apache/mxnet v1.9.x ``tests/python/unittest/test_kvstore.py``: the
``stype='row_sparse'`` cases that tests/test_mxnet_unittests.py leaves out. Those are the
row-sparse half of ``test_single_kv_pair``, ``test_list_kv_pair``, ``test_aggregator`` and
``test_updater`` (row-sparse values pushed into dense keys), ``test_row_sparse_pull`` with
row-sparse outs, ``test_sparse_aggregator``, and the checks of ``test_invalid_pull`` that
involve row-sparse outs. Also ported: the examples of ``KVStore.init``, ``push`` and
``row_sparse_pull`` in the docstrings of the same release's ``python/mxnet/kvstore/kvstore.py``
(1.9.1 has no sparse case in ``test_init``), and the three tests of
``tests/python/gpu/test_kvstore_gpu.py``, on CPU contexts in place of GPUs.

The checks are MXNet's (shape (4, 4), int keys [5, 7, 11], str keys ['b', 'c', 'd'], the same
values and the same assertions); the code is our own, and each test keeps the name of the MXNet
test it ports. Where a test here checks more than MXNet's (the ids an out holds, its device, an
out left unchanged by a refused call), a comment says so. MXNet's random values come from NumPy
generators with fixed seeds. Stores are over the 8 simulated CPU devices (``cpu_store``).

Two checks differ from MXNet's, on purpose (README's table of differences): a
``row_sparse_pull`` into a dense out is filled (MXNet refuses it), and a row-sparse out pulled
from a key that holds no rows lists the rows asked for, as zeros (MXNet's is empty: jaxkv keeps
every value dense, so the dense values agree).
"""

import numpy as np
import pytest
from _devices import cpu_store

import jaxkv.mx as mx

SHAPE = (4, 4)
KEYS = [5, 7, 11]
STR_KEYS = ["b", "c", "d"]
NUM_DEVS = 4


def _int_store(stype: str = "default", kind: str = "local"):
    """MXNet's init_kv: zeros of ``stype`` under the key 3 and under each of KEYS."""
    kv = cpu_store(kind)
    kv.init(3, mx.nd.zeros(SHAPE, stype=stype))
    kv.init(KEYS, [mx.nd.zeros(SHAPE, stype=stype)] * len(KEYS))
    return kv


def _str_store(stype: str = "default", kind: str = "local"):
    """MXNet's init_kv_with_str: the same under 'a' and each of STR_KEYS."""
    kv = cpu_store(kind)
    kv.init("a", mx.nd.zeros(SHAPE, stype=stype))
    kv.init(STR_KEYS, [mx.nd.zeros(SHAPE, stype=stype)] * len(STR_KEYS))
    return kv


STORES = [
    pytest.param(_int_store, 3, KEYS, id="int-keys"),
    pytest.param(_str_store, "a", STR_KEYS, id="str-keys"),
]


def check_diff_to_scalar(arr, x) -> None:
    """Every element of ``arr`` is exactly ``x`` (``arr - x`` is dense for a row-sparse arr)."""
    total = np.abs((arr - x).asnumpy()).sum()
    assert total == 0, (arr.asnumpy(), x)


def _contexts():
    return [mx.Context("cpu", i) for i in range(NUM_DEVS)]


def _kept(row_ids, value: float) -> np.ndarray:
    """The dense value of an out pulled with ``row_ids`` from a table holding ``value`` in
    every row: ``value`` in the rows asked for, zero elsewhere."""
    asked = np.isin(np.arange(SHAPE[0]), row_ids.asnumpy())
    return np.where(asked[:, None], np.float32(value), np.float32(0)) * np.ones(SHAPE, np.float32)


def _rand_row_sparse(rng, shape):
    """MXNet's ``rand_ndarray(shape, 'row_sparse')``: each row stored with a random density,
    values uniform in [0, 1); an empty row-sparse array when no row is drawn."""
    density = rng.random()
    ids = np.flatnonzero(rng.random(shape[0]) < density)
    if not len(ids):
        return mx.nd.zeros(shape, stype="row_sparse")
    values = rng.random((len(ids), *shape[1:])).astype(np.float32)
    return mx.nd.sparse.row_sparse_array((values, ids), shape=shape)


# --------------------------------------------------------------------------------------------
# test_kvstore.py: row-sparse values pushed into dense keys, pulled into dense outs
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make, key, key_list", STORES)
def test_single_kv_pair(make, key, key_list):
    kv = make()
    kv.push(key, mx.nd.ones(SHAPE).tostype("row_sparse"))
    got = mx.nd.empty(SHAPE)
    kv.pull(key, out=got)
    check_diff_to_scalar(got, 1)


@pytest.mark.parametrize("make, key, key_list", STORES)
def test_list_kv_pair(make, key, key_list):
    kv = make()
    kv.push(key_list, [mx.nd.ones(SHAPE).tostype("row_sparse") * 4] * len(key_list))
    outs = [mx.nd.empty(SHAPE)] * len(key_list)
    kv.pull(key_list, out=outs)
    for out in outs:
        check_diff_to_scalar(out, 4)


@pytest.mark.parametrize("make, key, key_list", STORES)
def test_aggregator(make, key, key_list):
    kv = make()
    devs = _contexts()

    vals = [mx.nd.ones(SHAPE, d).tostype("row_sparse") for d in devs]
    outs = [mx.nd.empty(SHAPE, d) for d in devs]
    kv.push(key, vals)
    kv.pull(key, out=outs)
    for out in outs:
        check_diff_to_scalar(out, NUM_DEVS)

    vals = [[mx.nd.ones(SHAPE, d).tostype("row_sparse") * 2.0 for d in devs]] * len(key_list)
    outs = [[mx.nd.empty(SHAPE, d) for d in devs]] * len(key_list)
    kv.push(key_list, vals)
    kv.pull(key_list, out=outs)
    for per_key in outs:
        for out in per_key:
            check_diff_to_scalar(out, NUM_DEVS * 2.0)


def _int_updater(key, recv, local):
    """MXNet's test updater, ``local += recv``, also checking the key's type."""
    assert isinstance(key, int)
    local += recv


def _str_updater(key, recv, local):
    assert isinstance(key, str)
    local += recv


@pytest.mark.parametrize(
    "make, key, key_list, updater",
    [
        pytest.param(_int_store, 3, KEYS, _int_updater, id="int-keys"),
        pytest.param(_str_store, "a", STR_KEYS, _str_updater, id="str-keys"),
    ],
)
def test_updater(make, key, key_list, updater):
    kv = make()
    kv._set_updater(updater)
    devs = _contexts()

    vals = [mx.nd.ones(SHAPE, d).tostype("row_sparse") for d in devs]
    outs = [mx.nd.empty(SHAPE, d) for d in devs]
    kv.push(key, vals)
    kv.pull(key, out=outs)
    for out in outs:
        check_diff_to_scalar(out, NUM_DEVS)

    vals = [[mx.nd.ones(SHAPE, d).tostype("row_sparse") for d in devs]] * len(key_list)
    outs = [[mx.nd.empty(SHAPE, d) for d in devs]] * len(key_list)
    num_push = 4
    for _ in range(num_push):
        kv.push(key_list, vals)
    kv.pull(key_list, out=outs)
    for per_key in outs:
        for out in per_key:
            check_diff_to_scalar(out, NUM_DEVS * num_push)


# --------------------------------------------------------------------------------------------
# test_kvstore.py: row-sparse keys and row-sparse outs
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ids_dtype", [None, "int64"])
def test_row_sparse_pull(ids_dtype):
    # MXNet's test builds row ids with mx.nd.array's default dtype (float32); int64 too here.
    kv = _str_store("row_sparse")
    kv.init("e", mx.nd.ones(SHAPE).tostype("row_sparse"))
    rng = np.random.default_rng(0)
    num_rows = SHAPE[0]

    def check(count):
        outs = [mx.nd.zeros(SHAPE).tostype("row_sparse") for _ in range(count)]
        row_ids = []
        for _ in range(count):
            wanted = rng.integers(num_rows, size=num_rows)
            row_ids.append(mx.nd.array(wanted, dtype=ids_dtype).reshape((2, num_rows // 2)))
        kv.row_sparse_pull(
            "e",
            out=outs[0] if count == 1 else outs,
            row_ids=row_ids[0] if count == 1 else row_ids,
        )
        for out, ids in zip(outs, row_ids):
            np.testing.assert_array_equal(out.asnumpy(), _kept(ids, 1))
            # Beyond MXNet's test: the out stays row-sparse and holds exactly the rows asked
            # for (MXNet's sparse_retain of a table that stores every row).
            assert out.stype == "row_sparse"
            asked = np.unique(ids.asnumpy()).astype(np.int64)
            np.testing.assert_array_equal(out.indices.asnumpy(), asked)

    check(1)
    check(4)


def test_init_row_sparse():
    # KVStore.init's docstring: a row-sparse value, then row_sparse_pull of rows 0 and 1.
    kv = cpu_store()
    kv.init("4", mx.nd.ones(SHAPE).tostype("row_sparse"))
    b = mx.nd.sparse.zeros("row_sparse", SHAPE)
    kv.row_sparse_pull("4", row_ids=mx.nd.array([0, 1]), out=b)
    np.testing.assert_array_equal(b.asnumpy(), _kept(mx.nd.array([0, 1]), 1))
    # Beyond the docstring: a dense out gets the whole value (MXNet's pull copies the stored
    # row-sparse array into it); an empty row-sparse init stores zeros.
    dense = mx.nd.zeros(SHAPE)
    kv.pull("4", out=dense)
    check_diff_to_scalar(dense, 1)
    kv.init("5", mx.nd.zeros(SHAPE, stype="row_sparse"))
    kv.pull("5", out=dense)
    check_diff_to_scalar(dense, 0)
    kv.row_sparse_pull("5", row_ids=mx.nd.array([0, 1]), out=b)
    check_diff_to_scalar(b, 0)
    # MXNet's out is empty here (its stored value holds no rows); jaxkv stores values densely,
    # so its out lists the rows asked for, all zeros: the same dense value.
    assert b.indices.asnumpy().tolist() == [0, 1]


def test_push_row_sparse():
    # KVStore.push's docstring: a row-sparse push into a row-sparse key, then row_sparse_pull.
    shape = (2, 3)
    kv = cpu_store()
    b = mx.nd.sparse.zeros("row_sparse", shape)
    kv.init("10", mx.nd.sparse.zeros("row_sparse", shape))
    kv.push("10", mx.nd.ones(shape).tostype("row_sparse"))
    kv.row_sparse_pull("10", row_ids=mx.nd.array([0, 1]), out=b)
    check_diff_to_scalar(b, 1)


def test_row_sparse_pull_duplicate_and_unsorted_row_ids():
    # KVStore.row_sparse_pull's docstring: row ids need be neither unique nor sorted.
    shape = (3, 3)
    kv = cpu_store()
    kv.init("3", mx.nd.ones(shape).tostype("row_sparse"))
    a = mx.nd.sparse.zeros("row_sparse", shape)
    for ids, rows in [([0, 2], [0, 2]), ([2, 2], [2]), ([1, 0], [0, 1])]:
        kv.row_sparse_pull("3", out=a, row_ids=mx.nd.array(ids, dtype="int64"))
        expected = np.zeros(shape, np.float32)
        expected[rows] = 1
        np.testing.assert_array_equal(a.asnumpy(), expected)


@pytest.mark.parametrize("sparse_pull", [False, True])
def test_sparse_aggregator(sparse_pull):
    kv = _str_store("row_sparse")
    devs = _contexts()
    rng = np.random.default_rng(1 + sparse_pull)
    all_rows = mx.nd.array(np.arange(SHAPE[0]))

    # One key: one random row-sparse value per device, summed; every out gets the sum.
    vals = [_rand_row_sparse(rng, SHAPE).copyto(d) for d in devs]
    expected = sum(v.asnumpy().astype(np.float64) for v in vals)
    kv.push("a", vals)
    if sparse_pull:
        kv.row_sparse_pull("a", out=vals, row_ids=[all_rows] * len(vals))
    else:
        kv.pull("a", out=vals, ignore_sparse=False)
    result = sum(v.asnumpy().astype(np.float64) for v in vals)
    np.testing.assert_allclose(result, expected * NUM_DEVS, rtol=1e-5)
    for v, d in zip(vals, devs):  # beyond MXNet's test: each out stays row-sparse, in place
        assert v.stype == "row_sparse" and v.context == d

    # A key list: the same per-device values pushed to each key (one list, listed per key).
    vals = [[_rand_row_sparse(rng, SHAPE).copyto(d) for d in devs]] * len(STR_KEYS)
    expected = sum(v.asnumpy().astype(np.float64) for v in vals[0])
    kv.push(STR_KEYS, vals)
    if sparse_pull:
        kv.row_sparse_pull(STR_KEYS, out=vals, row_ids=[[all_rows] * NUM_DEVS] * len(vals))
    else:
        kv.pull(STR_KEYS, out=vals, ignore_sparse=False)
    for per_key in vals:
        result = sum(v.asnumpy().astype(np.float64) for v in per_key)
        np.testing.assert_allclose(result, expected * NUM_DEVS, rtol=1e-5)


@pytest.mark.parametrize(
    "make, key, key_list, other_key, other_list",
    [
        pytest.param(_int_store, 3, KEYS, "a", STR_KEYS, id="int-store"),
        pytest.param(_str_store, "a", STR_KEYS, 3, KEYS, id="str-store"),
    ],
)
def test_invalid_pull(make, key, key_list, other_key, other_list):
    kv = make()
    n = len(key_list)

    # A pull into row-sparse outs is ignored (ignore_sparse=True by default): outs unchanged.
    rsp = (mx.nd.ones(SHAPE) * 2).tostype("row_sparse")
    kv.pull(key, out=rsp)
    check_diff_to_scalar(rsp, 2)
    rsps = [v.tostype("row_sparse") for v in [mx.nd.ones(SHAPE) * 2] * n]
    kv.pull(key_list, out=rsps)
    for v in rsps:
        check_diff_to_scalar(v, 2)

    # MXNet refuses row_sparse_pull into dense outs; jaxkv fills them (documented since its
    # first release: the value with only the rows asked for, the others zero), so MXNet code
    # that works runs the same, and the extra case gives MXNet's dense value.
    dense = mx.nd.ones(SHAPE) * 2
    kv.row_sparse_pull(key, out=dense, row_ids=mx.nd.array([1]))
    want = np.zeros(SHAPE, np.float32)
    want[1] = kv.pull(key).__array__()[1]
    np.testing.assert_array_equal(dense.asnumpy(), want)
    denses = [mx.nd.ones(SHAPE) * 2 for _ in range(n)]
    kv.row_sparse_pull(key_list, out=denses, row_ids=[mx.nd.array([1])] * n)
    for d in denses:
        np.testing.assert_array_equal(d.asnumpy(), want)
    dense = mx.nd.ones(SHAPE) * 2

    # A store takes either int or str keys: keys of the other kind are refused, row-sparse
    # outs or not.
    with pytest.raises(mx.MXNetError):
        kv.init(other_key, dense)
    with pytest.raises(mx.MXNetError):
        kv.push(other_key, dense)
    with pytest.raises(mx.MXNetError):
        kv.pull(other_key, dense)
    with pytest.raises(mx.MXNetError):
        kv.row_sparse_pull(other_key, rsp, row_ids=mx.nd.array([1]))
    with pytest.raises(mx.MXNetError):
        kv.init(other_list, denses)
    with pytest.raises(mx.MXNetError):
        kv.push(other_list, denses)
    with pytest.raises(mx.MXNetError):
        kv.pull(other_list, denses)
    with pytest.raises(mx.MXNetError):
        kv.row_sparse_pull(other_list, rsps, row_ids=[mx.nd.array([1])] * n)
    check_diff_to_scalar(rsp, 2)


# --------------------------------------------------------------------------------------------
# tests/python/gpu/test_kvstore_gpu.py, on CPU contexts
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["local", "device"])
@pytest.mark.parametrize("push_devs", [(0, 1), (2, 3)], ids=["push-cpu01", "push-cpu23"])
def test_rsp_push_pull(kind, push_devs):
    # MXNet pushes from cpu(0), cpu(1) or from gpu(0), gpu(1); pulls into outs on one device,
    # on two (gpu(i // 2)) or on four.
    kv = _str_store("row_sparse", kind)
    kv.init("e", mx.nd.ones(SHAPE).tostype("row_sparse"))
    kv.push("e", [mx.nd.ones(SHAPE, ctx=mx.cpu(i)).tostype("row_sparse") for i in push_devs])
    rng = np.random.default_rng(sum(push_devs) + len(kind))
    num_rows = SHAPE[0]

    def check_rsp_pull(ctxs, is_same_rowid=False, use_slice=False):
        count = len(ctxs)
        vals = [mx.nd.sparse.zeros(shape=SHAPE, ctx=c, stype="row_sparse") for c in ctxs]
        if is_same_rowid:
            row_ids = [mx.nd.array(rng.integers(num_rows, size=num_rows))] * count
        elif use_slice:
            total = mx.nd.array(rng.integers(num_rows, size=count * num_rows))
            row_ids = [total[i * num_rows : (i + 1) * num_rows] for i in range(count)]
        else:
            row_ids = [mx.nd.array(rng.integers(num_rows, size=num_rows)) for _ in range(count)]
        ids_to_pull = row_ids[0] if (len(row_ids) == 1 or is_same_rowid) else row_ids
        vals_to_pull = vals[0] if len(vals) == 1 else vals

        kv.row_sparse_pull("e", out=vals_to_pull, row_ids=ids_to_pull)
        for val, ids, c in zip(vals, row_ids, ctxs):
            np.testing.assert_array_equal(val.asnumpy(), _kept(ids, 2))
            assert val.context == c  # beyond MXNet's test: each out stays on its device

        kv.pull("e", out=vals_to_pull, ignore_sparse=False)
        for val in vals:
            check_diff_to_scalar(val, 2)

    check_rsp_pull([mx.cpu(0)])
    check_rsp_pull([mx.cpu(1)])
    check_rsp_pull([mx.cpu(i // 2) for i in range(4)])
    check_rsp_pull([mx.cpu(i // 2) for i in range(4)], is_same_rowid=True)
    check_rsp_pull([mx.cpu(i) for i in range(4)])
    check_rsp_pull([mx.cpu(i) for i in range(4)], is_same_rowid=True)
    check_rsp_pull([mx.cpu(i // 2) for i in range(4)], use_slice=True)
    check_rsp_pull([mx.cpu(i) for i in range(4)], use_slice=True)


def test_row_sparse_pull_single_device():
    # The out is the very array pushed: it gets back its own rows.
    kv = mx.kv.create("device")
    copy = mx.nd.array(np.random.default_rng(2).standard_normal((4, 4)))  # random_normal
    grad = copy.tostype("row_sparse")
    kv.init(0, grad)
    idx = grad.indices
    kv.push(0, grad)
    kv.row_sparse_pull(0, out=grad, row_ids=idx)
    np.testing.assert_allclose(grad.asnumpy(), copy.asnumpy(), rtol=1e-6)


def test_rsp_push_pull_large_rowid():
    num_rows = 793470
    val = mx.nd.ones((num_rows, 1)).tostype("row_sparse").copyto(mx.cpu(1))  # MXNet: mx.gpu()
    kv = cpu_store("device")
    kv.init("a", val)
    out = mx.nd.zeros((num_rows, 1), stype="row_sparse").copyto(mx.cpu(1))
    kv.push("a", val)
    kv.row_sparse_pull("a", out=out, row_ids=mx.nd.arange(0, num_rows, dtype="int64"))
    assert out.indices.shape[0] == num_rows
