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


# -- calls held before a push of rows, in one process ---------------------------------------
# A dense key's push held before a push of rows (MXNet's embedding loop: push the dense key,
# push the table's rows, row_sparse_pull them) is kept by the push of rows and run once the
# rows' computation is dispatched, while it runs. Its values are as if run in call order:
# momentum SGD, whose result depends on the order of a key's pushes, against a NumPy model.
MU, W = 0.9, 4


def _momentum_store(n_devices):
    kv = jaxkv.KVStore("local", devices=jax.devices("cpu")[:n_devices])
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=LR, momentum=MU, lazy_update=True))
    kv.init("e", mx.nd.zeros((ROWS, W)).tostype("row_sparse"))
    kv.init("b", mx.nd.zeros((W,)))
    kv.pull("b")  # (the held inits run: a push of rows keeps no held init)
    return kv


class _Model:
    """MXNet's SGD with momentum (lazy on the table's pushed rows), call by call."""

    def __init__(self):
        self.e, self.me = np.zeros((ROWS, W)), np.zeros((ROWS, W))
        self.b, self.mb = np.zeros(W), np.zeros(W)

    def push_b(self, g):
        self.mb = MU * self.mb - LR * g
        self.b = self.b + self.mb

    def push_e(self, ids, g):
        self.me[ids] = MU * self.me[ids] - LR * g
        self.e[ids] = self.e[ids] + self.me[ids]


def _rows(ids, scale, ctx=None):
    data = np.full((len(ids), W), scale, np.float32)
    return mx.nd.sparse.row_sparse_array((data, np.array(ids)), shape=(ROWS, W), ctx=ctx)


@pytest.mark.parametrize("n_devices", [1, NDEV])
def test_pushes_held_before_a_push_of_rows_run_after_its_computation(n_devices, monkeypatch):
    from jaxkv._src.mxnet import kvstore as kvstore_module

    events = []
    real_pushpull, real_held = kvstore_module.kvstore_rows.pushpull_into, jaxkv.KVStore._push_held

    def pushpull(*args, **kwargs):
        events.append("rows")
        return real_pushpull(*args, **kwargs)

    def push_held(self, keys, *args):
        events.append(tuple(keys))
        return real_held(self, keys, *args)

    monkeypatch.setattr(kvstore_module.kvstore_rows, "pushpull_into", pushpull)
    monkeypatch.setattr(jaxkv.KVStore, "_push_held", push_held)
    kv, model = _momentum_store(n_devices), _Model()
    ctxs = [mx.cpu(j) for j in range(n_devices)]
    outs = [mx.nd.sparse.zeros("row_sparse", (ROWS, W), ctx=c) for c in ctxs]
    for step in range(3):
        ids = [step, 10 + step, 30]
        events.clear()
        kv.push("b", [mx.nd.ones((W,), ctx=c) for c in ctxs])
        kv.push("e", [_rows(ids, 1.0 + step, c) for c in ctxs])
        if step == 2:  # a push held after the push of rows: it runs after the kept one
            kv.push("b", [mx.nd.ones((W,), ctx=c) * 3 for c in ctxs])
        kv.row_sparse_pull("e", out=outs, row_ids=[mx.nd.array(ids)] * n_devices)
        assert events == ["rows", ("b",)], (step, events)  # the kept push ran after the rows'
        model.push_b(np.full(W, n_devices))
        model.push_e(ids, (1.0 + step) * n_devices)
        if step == 2:
            model.push_b(np.full(W, 3.0 * n_devices))
        for o in outs:
            np.testing.assert_allclose(o.data.asnumpy(), model.e[ids], rtol=1e-6)
        np.testing.assert_allclose(np.asarray(kv.pull("b")), model.b, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(kv.pull("e")), model.e, rtol=1e-6)


def test_a_pull_held_before_a_push_of_rows_reads_before_it():
    """A held pull keeps the calls before the push of rows from being kept: the pull reads the
    table as it was before the push."""
    kv, model = _momentum_store(1), _Model()
    before = mx.nd.zeros((ROWS, W))
    kv.push("b", mx.nd.ones((W,)))
    kv.pull("e", out=before)
    kv.push("e", _rows([1, 2], 1.0))
    out = mx.nd.sparse.zeros("row_sparse", (ROWS, W))
    kv.row_sparse_pull("e", out=out, row_ids=mx.nd.array([1, 2]))
    np.testing.assert_array_equal(before.asnumpy(), model.e)
    model.push_b(np.ones(W))
    model.push_e([1, 2], 1.0)
    np.testing.assert_allclose(np.asarray(kv.pull("b")), model.b, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(kv.pull("e")), model.e, rtol=1e-6)


@pytest.mark.parametrize("refused", ["the pull's ids", "the next push of rows"])
def test_a_refused_call_after_a_kept_push_runs_it_once(refused):
    """A refused row_sparse_pull leaves the push of rows and the push it kept applied, once; a
    push of rows refused at the push keeps nothing: the push held before it runs once later."""
    kv, model = _momentum_store(1), _Model()
    kv.push("b", mx.nd.ones((W,)))
    if refused == "the pull's ids":
        kv.push("e", _rows([1, 2], 1.0))
        with pytest.raises(jaxkv.KVStoreError, match=str(ROWS)):
            kv.row_sparse_pull(
                "e", out=mx.nd.sparse.zeros("row_sparse", (ROWS, W)), row_ids=mx.nd.array([ROWS])
            )
        model.push_e([1, 2], 1.0)
    else:
        wrong = mx.nd.sparse.zeros("row_sparse", (ROWS + 1, W))
        with pytest.raises(jaxkv.ShapeError, match="expected the stored shape"):
            kv.push("e", wrong)
        assert kv._calls.rows is None and kv._calls.queue is not None  # still held
    model.push_b(np.ones(W))
    np.testing.assert_allclose(np.asarray(kv.pull("b")), model.b, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(kv.pull("e")), model.e, rtol=1e-6)
    out = mx.nd.sparse.zeros("row_sparse", (ROWS, W))  # and the next step is right
    kv.push("b", mx.nd.ones((W,)))
    kv.push("e", _rows([2, 3], 2.0))
    kv.row_sparse_pull("e", out=out, row_ids=mx.nd.array([2, 3]))
    model.push_b(np.ones(W))
    model.push_e([2, 3], 2.0)
    np.testing.assert_allclose(out.data.asnumpy(), model.e[[2, 3]], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(kv.pull("b")), model.b, rtol=1e-6)


@pytest.mark.parametrize("then", ["row_sparse_pull", "a read"])
def test_a_key_pushed_before_and_after_a_push_of_rows_gets_them_in_call_order(then):
    """The push kept by the push of rows runs before the one held since (which a read or the
    row_sparse_pull's check of its outs must not run first)."""
    kv, model = _momentum_store(1), _Model()
    kv.push("b", mx.nd.ones((W,)))
    kv.push("e", _rows([1, 2], 1.0))
    kv.push("b", mx.nd.ones((W,)) * 3)
    if then == "row_sparse_pull":
        out = mx.nd.sparse.zeros("row_sparse", (ROWS, W))
        kv.row_sparse_pull("e", out=out, row_ids=mx.nd.array([1, 2]))
    model.push_b(np.ones(W))
    model.push_e([1, 2], 1.0)
    model.push_b(np.full(W, 3.0))
    np.testing.assert_allclose(np.asarray(kv.pull("b")), model.b, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(kv.pull("e")), model.e, rtol=1e-6)
