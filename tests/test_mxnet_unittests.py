"""MXNet's own KVStore unit tests, run through the drop-in ``import jaxkv.mx as mx``.

Modelled on apache/mxnet v1.9.x ``tests/python/unittest/test_kvstore.py`` (and, for
``broadcast`` / ``pushpull``, the same release's ``test_kvstore_custom.py``). The checks are
MXNet's: the same constants (shape (4, 4), int keys [5, 7, 11], str keys ['b', 'c', 'd']), the
same values and the same exact-equality assertion (``check_diff_to_scalar``); the code is our
own. Each test keeps the name of the MXNet test it ports. Stores are ``mx.kv.create``'s over the
8 simulated CPU devices that stand in for MXNet's devices (``cpu_store``), whatever JAX's
default backend.

Left out here: every sparse storage case (``stype='row_sparse'`` values and outs,
``test_sparse_aggregator``, the pulls into row_sparse outs of ``test_invalid_pull``), which
tests/test_mxnet_sparse_unittests.py ports; ``'csr'`` (jaxkv has no csr storage: refused); and
the tests of MXNet's ``'teststore'`` plug-in (``test_custom_store``, ``test_get_type_device``,
``test_set_optimizer``), which tests/test_mx_custom_store.py covers.
``row_sparse_pull`` on a dense value is kept, with MXNet's semantics (rows not asked for are 0).
"""

import numpy as np
import pytest
from _devices import cpu_store

import jaxkv
import jaxkv.mx as mx

SHAPE = (4, 4)
KEYS = [5, 7, 11]
STR_KEYS = ["b", "c", "d"]
NUM_DEVS = 4


def _int_store(kind: str = "local"):
    """A store holding zeros under the single key 3 and under each of KEYS."""
    kv = cpu_store(kind)
    kv.init(3, mx.nd.zeros(SHAPE))
    kv.init(KEYS, [mx.nd.zeros(SHAPE) for _ in KEYS])
    return kv


def _str_store(kind: str = "local"):
    """The same with str keys: 'a', then each of STR_KEYS."""
    kv = cpu_store(kind)
    kv.init("a", mx.nd.zeros(SHAPE))
    kv.init(STR_KEYS, [mx.nd.zeros(SHAPE) for _ in STR_KEYS])
    return kv


# (store factory, single key, key list): every check runs with int keys and with str keys.
STORES = [
    pytest.param(_int_store, 3, KEYS, id="int-keys"),
    pytest.param(_str_store, "a", STR_KEYS, id="str-keys"),
]


def check_diff_to_scalar(arr, x) -> None:
    """Every element of ``arr`` is exactly ``x``: the absolute differences sum to zero."""
    total = np.abs((arr - x).asnumpy()).sum()
    assert total == 0, (arr.asnumpy(), x)


def _contexts():
    return [mx.Context("cpu", i) for i in range(NUM_DEVS)]


# --------------------------------------------------------------------------------------------
# test_kvstore.py
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make, key, key_list", STORES)
def test_single_kv_pair(make, key, key_list):
    kv = make()
    kv.push(key, mx.nd.ones(SHAPE))
    got = mx.nd.empty(SHAPE)
    kv.pull(key, out=got)
    check_diff_to_scalar(got, 1)


@pytest.mark.parametrize("ids_dtype", ["float32", "int64"])
def test_row_sparse_pull(ids_dtype):
    # MXNet stores 'e' as row_sparse and pulls into row_sparse outs; jaxkv is dense throughout.
    # MXNet's test builds row ids with mx.nd.array's default dtype (float32); int64 is checked too.
    kv = _str_store()
    kv.init("e", mx.nd.ones(SHAPE))
    rng = np.random.default_rng(0)
    num_rows = SHAPE[0]

    def check(count):
        outs = [mx.nd.zeros(SHAPE) for _ in range(count)]
        row_ids = []
        for _ in range(count):
            wanted = rng.integers(num_rows, size=num_rows).reshape(2, num_rows // 2)
            row_ids.append(mx.nd.array(wanted, dtype=ids_dtype))
        if count == 1:
            kv.row_sparse_pull("e", out=outs[0], row_ids=row_ids[0])
        else:
            kv.row_sparse_pull("e", out=outs, row_ids=row_ids)
        for out, ids in zip(outs, row_ids):
            got = out.asnumpy()
            kept = set(ids.asnumpy().astype(np.int64).ravel().tolist())
            for row in range(num_rows):
                expected = np.full(SHAPE[1], 1.0 if row in kept else 0.0, np.float32)
                np.testing.assert_array_equal(got[row], expected)

    check(1)
    check(4)


@pytest.mark.parametrize("key", [3, "a"])
def test_init(key):
    kv = cpu_store()
    kv.init(key, mx.nd.ones(SHAPE) * 4)
    got = mx.nd.zeros(SHAPE)
    kv.pull(key, out=got)
    check_diff_to_scalar(got, 4)


@pytest.mark.parametrize("kind", ["device", "local"])
@pytest.mark.parametrize("first, second", [("1", "2"), (1, 2)])
def test_pull(kind, first, second):
    kv = cpu_store(kind)
    ones = mx.nd.ones(SHAPE)
    got = mx.nd.zeros(SHAPE)
    kv.init(first, mx.nd.zeros(SHAPE))
    kv.push(first, [ones, ones, ones, ones])  # four values on one device: summed
    kv.pull(first, got)  # out given positionally
    check_diff_to_scalar(got, 4)
    kv.init(second, mx.nd.zeros(SHAPE))
    kv.pull(second, got)
    check_diff_to_scalar(got, 0)


@pytest.mark.parametrize("make, key, key_list", STORES)
def test_list_kv_pair(make, key, key_list):
    kv = make()
    kv.push(key_list, [mx.nd.ones(SHAPE) * 4] * len(key_list))
    outs = [mx.nd.empty(SHAPE)] * len(key_list)  # one handle, listed once per key
    kv.pull(key_list, out=outs)
    for out in outs:
        check_diff_to_scalar(out, 4)


@pytest.mark.parametrize("make, key, key_list", STORES)
def test_aggregator(make, key, key_list):
    kv = make()
    devs = _contexts()

    # One key, one value per device.
    vals = [mx.nd.ones(SHAPE, d) for d in devs]
    outs = [mx.nd.empty(SHAPE, d) for d in devs]
    kv.push(key, vals)
    kv.pull(key, out=outs)
    for out in outs:
        check_diff_to_scalar(out, NUM_DEVS)

    # A key list, a list of per-device values for each key.
    vals = [[mx.nd.ones(SHAPE, d) * 2.0 for d in devs]] * len(key_list)
    outs = [[mx.nd.empty(SHAPE, d) for d in devs]] * len(key_list)
    kv.push(key_list, vals)
    kv.pull(key_list, out=outs)
    for per_key in outs:
        for out in per_key:
            check_diff_to_scalar(out, NUM_DEVS * 2.0)
            assert out.context in devs


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

    vals = [mx.nd.ones(SHAPE, d) for d in devs]
    outs = [mx.nd.empty(SHAPE, d) for d in devs]
    kv.push(key, vals)
    kv.pull(key, out=outs)
    for out in outs:
        check_diff_to_scalar(out, NUM_DEVS)

    vals = [[mx.nd.ones(SHAPE, d) for d in devs]] * len(key_list)
    outs = [[mx.nd.empty(SHAPE, d) for d in devs]] * len(key_list)
    num_push = 4
    for _ in range(num_push):
        kv.push(key_list, vals)
    kv.pull(key_list, out=outs)
    for per_key in outs:
        for out in per_key:
            check_diff_to_scalar(out, NUM_DEVS * num_push)


@pytest.mark.parametrize(
    "kvtype",
    [
        "local_allreduce_cpu",  # the type MXNet's test_get_type checks
        "local",
        "device",
        "nccl",
        "local_allreduce_device",
        "local_update_cpu",
        "dist_sync",
        "dist_device_sync",
    ],
)
def test_get_type(kvtype):
    assert mx.kv.create(kvtype).type == kvtype


@pytest.mark.parametrize("kvtype", ["dist_async", "dist_device_async"])
def test_get_type_async_refused(kvtype):
    # MXNet creates async stores; jaxkv refuses them on purpose (README, last table row).
    with pytest.raises(mx.MXNetError, match="async"):
        mx.kv.create(kvtype)


@pytest.mark.parametrize(
    "make, other_key, other_list",
    [
        pytest.param(_int_store, "a", STR_KEYS, id="int-store-str-keys"),
        pytest.param(_str_store, 3, KEYS, id="str-store-int-keys"),
    ],
)
def test_invalid_pull(make, other_key, other_list):
    assert mx.MXNetError is jaxkv.KVStoreError
    kv = make()
    before = {k: np.asarray(v) for k, v in zip(kv.keys(), kv.pull(kv.keys()))}

    # A store takes either int or str keys, never both: a key of the other kind is refused.
    one = mx.nd.ones(SHAPE) * 2
    with pytest.raises(mx.MXNetError):
        kv.init(other_key, one)
    with pytest.raises(mx.MXNetError):
        kv.push(other_key, one)
    with pytest.raises(mx.MXNetError):
        kv.pull(other_key, one)
    with pytest.raises(mx.MXNetError):  # MXNet passes a row_sparse out here; jaxkv is dense
        kv.row_sparse_pull(other_key, one, row_ids=mx.nd.array([1], dtype="int64"))

    many = [mx.nd.ones(SHAPE) * 2] * len(other_list)
    with pytest.raises(mx.MXNetError):
        kv.init(other_list, many)
    with pytest.raises(mx.MXNetError):
        kv.push(other_list, many)
    with pytest.raises(mx.MXNetError):
        kv.pull(other_list, many)
    with pytest.raises(mx.MXNetError):
        kv.row_sparse_pull(
            other_list, many, row_ids=[mx.nd.array([1], dtype="int64")] * len(other_list)
        )

    # MXNet also expects row_sparse_pull into a dense out to fail; jaxkv's row_sparse_pull is
    # dense by design (README: "row_sparse_pull returns a dense array"), so that check is not
    # ported. Nothing above changed the store, and the outs keep their values.
    assert sorted(kv.keys()) == sorted(before)
    for k, v in zip(kv.keys(), kv.pull(kv.keys())):
        np.testing.assert_array_equal(np.asarray(v), before[k])
    check_diff_to_scalar(one, 2)
    for m in many:
        check_diff_to_scalar(m, 2)


# --------------------------------------------------------------------------------------------
# test_kvstore_custom.py: broadcast and pushpull ('device' store; 'teststore': test_mx_custom_store)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key", [3, "a"])
def test_broadcast_single_kv_pair(key):
    kv = cpu_store("device")
    ones = mx.nd.ones(SHAPE)
    out = mx.nd.empty(SHAPE)
    kv.broadcast(key, ones, out)
    check_diff_to_scalar(out, 1)

    # One value broadcast into several outs (a new key: 3 + 3 or 'a' + 'a').
    outs = [mx.nd.empty(SHAPE)] * 3
    kv.broadcast(key + key, ones, outs)
    for o in outs:
        check_diff_to_scalar(o, 1)


@pytest.mark.parametrize("key_list", [KEYS, STR_KEYS], ids=["int-keys", "str-keys"])
def test_broadcast_list_kv_pair(key_list):
    kv = cpu_store("device")
    ones = [mx.nd.ones(SHAPE)] * len(key_list)
    outs = [mx.nd.empty(SHAPE)] * len(key_list)
    kv.broadcast(key_list, ones, outs)
    for o in outs:
        check_diff_to_scalar(o, 1)

    # New keys, two outs for each.
    doubled = [k + k for k in key_list]
    nested = [[mx.nd.empty(SHAPE)] * 2 for _ in key_list]
    kv.broadcast(doubled, ones, nested)
    for per_key in nested:
        for o in per_key:
            check_diff_to_scalar(o, 1)


def _check_pushpull(kv, key, key_list, in_place: bool) -> None:
    devs = _contexts()
    kv.broadcast(key, mx.nd.zeros(SHAPE), out=mx.nd.empty(SHAPE))

    vals = [mx.nd.ones(SHAPE, d) for d in devs]
    outs = [mx.nd.empty(SHAPE, d) for d in devs]
    kv.pushpull(key, vals, out=outs)
    for o in outs:
        check_diff_to_scalar(o, NUM_DEVS)
    if in_place:
        kv.pushpull(key, vals)  # no out: the pushed values are overwritten with the result
        for v in vals:
            check_diff_to_scalar(v, NUM_DEVS)

    n = len(key_list)
    kv.broadcast(key_list, [mx.nd.zeros(SHAPE)] * n, out=[mx.nd.empty(SHAPE)] * n)
    vals = [[mx.nd.ones(SHAPE, d) * 2.0 for d in devs]] * n
    outs = [[mx.nd.empty(SHAPE, d) for d in devs]] * n
    kv.pushpull(key_list, vals, out=outs)
    for per_key in outs:
        for o in per_key:
            check_diff_to_scalar(o, NUM_DEVS * 2.0)
    if in_place:
        kv.pushpull(key_list, vals)
        for per_key in vals:
            for v in per_key:
                check_diff_to_scalar(v, NUM_DEVS * 2.0)


@pytest.mark.parametrize("key, key_list", [(3, KEYS), ("a", STR_KEYS)], ids=["int", "str"])
def test_pushpull_single_kv_pair(key, key_list):
    _check_pushpull(cpu_store("device"), key, key_list, in_place=True)


@pytest.mark.parametrize("key, key_list", [(3, KEYS), ("a", STR_KEYS)], ids=["int", "str"])
def test_pushpull_list_kv_pair(key, key_list):
    _check_pushpull(cpu_store("device"), key, key_list, in_place=False)
