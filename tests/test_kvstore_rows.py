"""The imperative store's held row-sparse push: under MXNet's lazy optimizers a ``kv.push`` of
row-sparse values is checked at once and run with the next call, in one computation with a
``row_sparse_pull`` of its key. Every other use of the store sees the push applied first, a
refused push is refused at the push, and a refused pull leaves the push applied."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
import jaxkv.mx as mx

ROWS, WIDTH, NDEV, LR = 2048, 8, 8, 0.5  # 16K elements: split over the 8 devices


def _store(layout="keys"):
    kv = jaxkv.KVStore("local", devices=jax.devices("cpu"), layout=layout)
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=LR, lazy_update=True))
    table = np.arange(ROWS * WIDTH, dtype=np.float32).reshape(ROWS, WIDTH) % 13
    kv.init("e", mx.nd.array(table).tostype("row_sparse"))
    kv.init("b", mx.nd.ones((3,)))
    return kv, table


def _grads(seed):
    rng = np.random.default_rng(seed)
    ids = [np.unique(rng.integers(0, ROWS, 5)) for _ in range(NDEV)]
    data = [rng.integers(-2, 3, (x.size, WIDTH)).astype(np.float32) for x in ids]
    values = [
        mx.nd.sparse.row_sparse_array((d, x), shape=(ROWS, WIDTH), ctx=mx.cpu(j))
        for j, (d, x) in enumerate(zip(data, ids))
    ]
    return ids, data, values


def _lazy_sgd(table, ids, data):
    out = table.copy()
    summed = {}
    for x, d in zip(ids, data):
        for i, r in zip(x.tolist(), d):
            summed[i] = summed.get(i, 0) + r
    for i, g in summed.items():
        out[i] = out[i] - np.float32(LR) * g
    return out


def _outs():
    return [mx.nd.sparse.zeros("row_sparse", (ROWS, WIDTH), ctx=mx.cpu(j)) for j in range(NDEV)]


@pytest.mark.parametrize("layout", ["keys", "flat"])
@pytest.mark.parametrize("asked", ["pushed", "others", "uneven"])
def test_a_push_then_a_row_sparse_pull_gives_push_then_pull(asked, layout):
    kv, table = _store(layout)
    model = table
    for seed in range(3):
        ids, data, values = _grads(seed)
        kv.push("e", values)
        assert kv._calls.rows is not None  # held: run with the pull below
        model = _lazy_sgd(model, ids, data)
        want = {
            "pushed": ids,
            "others": [np.array([j, ROWS - 1 - j, 7]) for j in range(NDEV)],
            "uneven": [np.arange(j % 3) for j in range(NDEV)],
        }[asked]
        outs = _outs()
        kv.row_sparse_pull("e", out=outs, row_ids=[mx.nd.array(x, dtype="int64") for x in want])
        assert kv._calls.rows is None
        for o, x, j in zip(outs, want, range(NDEV)):
            rows = np.unique(x)
            assert o.context == mx.cpu(j)
            np.testing.assert_array_equal(o.indices.asnumpy(), rows)
            np.testing.assert_array_equal(o.data.asnumpy(), model[rows])
    dense = mx.nd.zeros((ROWS, WIDTH))
    kv.pull("e", out=dense)
    np.testing.assert_array_equal(dense.asnumpy(), model)


@pytest.mark.parametrize(
    "then",
    [
        "pull",
        "push again",
        "state",
        "state set",
        "pushpull",
        "row_sparse_pull of another key",
        "save",
    ],
)
def test_every_other_call_sees_the_held_push(then, tmp_path):
    kv, table = _store()
    ids, data, values = _grads(0)
    kv.push("e", values)
    model = _lazy_sgd(table, ids, data)
    if then == "pull":
        out = mx.nd.zeros((ROWS, WIDTH))
        kv.pull("e", out=out)
        np.testing.assert_array_equal(out.asnumpy(), model)
    elif then == "push again":
        ids2, data2, values2 = _grads(1)
        kv.push("e", values2)
        np.testing.assert_array_equal(np.asarray(kv.pull("e")), _lazy_sgd(model, ids2, data2))
    elif then == "state":
        np.testing.assert_array_equal(np.asarray(jaxkv.pull(kv.state, "e")), model)
    elif then == "state set":  # a state set after the push replaces what the push made
        other, _ = _store()
        kv.state = other.state
        np.testing.assert_array_equal(np.asarray(kv.pull("e")), table)
    elif then == "pushpull":
        out = mx.nd.zeros((3,))
        kv.pushpull("b", mx.nd.ones((3,)), out=out)
        np.testing.assert_array_equal(np.asarray(kv.pull("e")), model)
    elif then == "row_sparse_pull of another key":
        kv.row_sparse_pull("b", out=mx.nd.zeros((3,)), row_ids=mx.nd.array([0]))
        np.testing.assert_array_equal(np.asarray(kv.pull("e")), model)
    else:
        kv.save(str(tmp_path / "ckpt"))
        again, _ = _store()
        again.load(str(tmp_path / "ckpt"))
        np.testing.assert_array_equal(np.asarray(again.pull("e")), model)


def test_a_refused_push_is_refused_at_the_push():
    kv, table = _store()
    wrong = [
        mx.nd.sparse.zeros("row_sparse", (ROWS, WIDTH + 1), ctx=mx.cpu(j)) for j in range(NDEV)
    ]
    with pytest.raises(jaxkv.ShapeError, match="expected the stored shape"):
        kv.push("e", wrong)
    assert kv._calls.rows is None
    np.testing.assert_array_equal(np.asarray(kv.pull("e")), table)


def test_a_refused_pull_leaves_the_held_push_applied():
    kv, table = _store()
    ids, data, values = _grads(0)
    kv.push("e", values)
    bad = [mx.nd.array([0])] * (NDEV - 1) + [mx.nd.array([ROWS])]
    with pytest.raises(jaxkv.KVStoreError, match=str(ROWS)):
        kv.row_sparse_pull("e", out=_outs(), row_ids=bad)
    with pytest.raises(jaxkv.ShapeError):
        kv.push("e", values)
        kv.row_sparse_pull("e", out=_outs(), row_ids=[mx.nd.array([0])] * 3)
    model = _lazy_sgd(_lazy_sgd(table, ids, data), ids, data)
    np.testing.assert_array_equal(np.asarray(kv.pull("e")), model)
    assert float(jnp.abs(kv.pull("b") - 1).max()) == 0


def test_a_value_changed_after_its_push_does_not_change_the_push():
    """The held push keeps the pushed arrays: a gradient buffer refilled in place (as a
    training loop refills its gradients) before the push runs does not change what was pushed."""
    kv, table = _store()
    ids, data, values = _grads(0)
    kv.push("e", values)
    for v in values:  # refilled in place, as a backward pass refills its gradients
        v[:] = mx.nd.sparse.row_sparse_array(
            (np.full((1, WIDTH), 100.0, np.float32), [0]), shape=(ROWS, WIDTH), ctx=v.context
        )
    model = _lazy_sgd(table, ids, data)
    outs = _outs()
    kv.row_sparse_pull("e", out=outs, row_ids=[mx.nd.array(x) for x in ids])
    for o, x in zip(outs, ids):
        np.testing.assert_array_equal(o.data.asnumpy(), model[np.unique(x)])
    np.testing.assert_array_equal(np.asarray(kv.pull("e")), model)
