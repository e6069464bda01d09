"""A list pull into outs of keys in buckets (``placement.Later``): each out gets its key's value
at the pull, made only when an out is first read; a push that donates the store's buckets before
that leaves every out its value (the store spares them first)."""

import numpy as np
import pytest

import jaxkv
import jaxkv.mx as mx
from jaxkv import nd
from jaxkv._src.state import buckets, placement

SHAPES = [(2, 3)] * 4 + [(5,)] * 2
KEYS = list(range(len(SHAPES)))
LR = 0.5


def _views_made(monkeypatch):
    """Counts the computations that make keys' values out of their buckets."""
    made = []
    real = buckets.eager_views

    def counted(*args, **kwargs):
        fn = real(*args, **kwargs)

        def run(*a):
            made.append(1)
            return fn(*a)

        return run

    monkeypatch.setattr(buckets, "eager_views", counted)
    return made


def _store(devices):
    kv = jaxkv.KVStore("device", devices[:2], layout="flat")
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=LR))
    start = [np.arange(np.prod(s), dtype=np.float32).reshape(s) + k for k, s in enumerate(SHAPES)]
    kv.init(KEYS, [nd.array(x) for x in start])
    return kv, start


def _grads(step):
    return [
        [nd.array(np.full(s, (step + 1) * (k + 1) / 8, np.float32), jaxkv.cpu(d)) for d in (0, 1)]
        for k, s in enumerate(SHAPES)
    ]


def test_outs_read_after_later_pushes_hold_the_values_of_their_pull(devices, monkeypatch):
    """MXNet's model: an out holds its key's value when pulled, whatever is pushed after."""
    made = _views_made(monkeypatch)
    kv, model = _store(devices)
    pulled = []
    first = None  # (the first push makes each key's optimizer state from its value)
    for step in range(3):
        kv.push(KEYS, _grads(step))
        model = [w - LR * 2 * (step + 1) * (k + 1) / 8 for k, w in enumerate(model)]
        outs = [[nd.zeros(s, jaxkv.cpu(d)) for d in (0, 1)] for s in SHAPES]
        kv.pull(KEYS, out=outs)
        nd.waitall()
        pulled.append((outs, [w.copy() for w in model]))
        first = len(made) if first is None else first
    assert len(made) == first  # nothing read: no key's value made out of its bucket
    assert isinstance(pulled[0][0][0][0].held_value().later, placement.Later)
    for outs, expected in pulled:  # the first pull's outs after two more pushes (donating)
        for key_outs, want in zip(outs, expected):
            for o in key_outs:
                np.testing.assert_array_equal(o.asnumpy(), want)
    assert len(made) == first + 3  # once for each pull's outs, at their first read


def test_the_outs_of_one_pull_read_their_values_from_one_computation(devices, monkeypatch):
    made = _views_made(monkeypatch)
    kv, model = _store(devices)
    kv.push(KEYS, _grads(0))
    outs = [[nd.zeros(s, jaxkv.cpu(d)) for d in (0, 1)] for s in SHAPES]
    kv.pull(KEYS, out=outs)
    nd.waitall()  # (the push: it makes the optimizer state from the values)
    before = len(made)
    want = model[3] - LR * 2 * 4 / 8
    np.testing.assert_array_equal(outs[3][1].asnumpy(), want)
    assert len(made) == before + 1
    np.testing.assert_array_equal(outs[3][0].asnumpy(), want)  # the same values, made once
    assert len(made) == before + 1


@pytest.mark.parametrize("read_between", [False, True])
def test_a_row_push_into_a_bucket_after_the_pull_leaves_the_outs_theirs(
    devices, monkeypatch, read_between
):
    """A push of rows updates a table's bucket in place (donated): the outs of the pull before
    it keep the rows as they were."""
    kv = jaxkv.KVStore("device", devices[:2], layout="flat")
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=1.0))
    table = np.arange(12, dtype=np.float32).reshape(6, 2)
    kv.init([0, 1], [nd.array(table), nd.array(table + 100)])
    outs = [[nd.zeros((6, 2), jaxkv.cpu(d)) for d in (0, 1)] for _ in range(2)]
    kv.pull([0, 1], out=outs)
    if read_between:
        outs[1][0].asnumpy()
    rows = nd.sparse.row_sparse_array((np.ones((2, 2), np.float32), np.array([1, 4])), shape=(6, 2))
    kv.push(0, rows)
    after = nd.sparse.zeros("row_sparse", (6, 2))
    kv.row_sparse_pull(0, out=after, row_ids=nd.array([1, 4]))
    np.testing.assert_array_equal(after.data.asnumpy(), table[[1, 4]] - 1)
    for d in (0, 1):
        np.testing.assert_array_equal(outs[0][d].asnumpy(), table)
        np.testing.assert_array_equal(outs[1][d].asnumpy(), table + 100)


def test_keys_kept_on_their_own_are_lent_at_once_and_the_others_made_later(devices):
    """Under the layout ``auto`` a big value is an array of its own: its outs get it at the
    pull (nothing to make), the small keys' values wait for a read; both survive a push."""
    kv = jaxkv.KVStore("device", devices[:2], layout="auto")
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=LR))
    shapes = [(64, 64), (2, 3), (2, 3)]
    start = [np.full(s, k + 1.0, np.float32) for k, s in enumerate(shapes)]
    kv.init([0, 1, 2], [nd.array(x) for x in start])
    kv.push(
        [0, 1, 2],
        [[nd.array(np.ones(s, np.float32), jaxkv.cpu(d)) for d in (0, 1)] for s in shapes],
    )
    outs = [[nd.zeros(s, jaxkv.cpu(d)) for d in (0, 1)] for s in shapes]
    kv.pull([0, 1, 2], out=outs)
    nd.waitall()
    state = kv._state
    big = state.leaves[state.flat_layout.leaf(0)]
    assert outs[0][1].held_value().whole is big  # the stored array itself, lent
    assert isinstance(outs[1][0].held_value().later, placement.Later)
    kv.push(
        [0, 1, 2],
        [[nd.array(np.ones(s, np.float32), jaxkv.cpu(d)) for d in (0, 1)] for s in shapes],
    )
    nd.waitall()
    for k, key_outs in enumerate(outs):
        for o in key_outs:
            np.testing.assert_array_equal(o.asnumpy(), start[k] - LR * 2)
    np.testing.assert_array_equal(np.asarray(kv.pull(0)), start[0] - LR * 4)


def test_an_out_whose_buckets_were_donated_unspared_raises_when_read(devices):
    """Every donation of the store's spares the pulls not made yet; one that did not (the
    store's own arrays donated behind its back) loses an out not read yet: reading it says
    so, where JAX on CPU would crash reading a donated array."""
    import jax

    kv, _ = _store(devices)
    kv.push(KEYS, _grads(0))
    outs = [[nd.zeros(s, jaxkv.cpu(d)) for d in (0, 1)] for s in SHAPES]
    kv.pull(KEYS, out=outs)
    nd.waitall()
    leaves = list(kv._state.leaves)  # (no public name hands out the buckets themselves)
    jax.jit(lambda xs: [x + 1 for x in xs], donate_argnums=0)(leaves)
    with pytest.raises(jaxkv.KVStoreError, match="did not spare them for"):
        outs[0][0].asnumpy()


def test_a_spare_waits_for_a_making_under_way_in_another_thread(devices, monkeypatch):
    """A read in one thread makes the values from the store's buckets while a push in another
    spares them and then donates them: the spare waits until the making has dispatched its
    computation (else the push donates buckets the making is about to read: JAX on CPU
    crashes), and the out reads its pull's values."""
    import threading

    kv, start = _store(devices)
    kv.push(KEYS, _grads(0))
    model = [w - LR * 2 * (k + 1) / 8 for k, w in enumerate(start)]
    outs = [[nd.zeros(s, jaxkv.cpu(d)) for d in (0, 1)] for s in SHAPES]
    kv.pull(KEYS, out=outs)
    nd.waitall()  # (the pull runs; no out is read)
    later = next(iter(kv._lending.laters))  # noqa: SLF001 - the pull's pending values
    making, go = threading.Event(), threading.Event()
    real = buckets.run

    def slow(*args):  # (the making's dispatch, held up until the spare has started)
        making.set()
        assert go.wait(10)
        return real(*args)

    monkeypatch.setattr(buckets, "run", slow)
    read = threading.Thread(target=later.values)
    read.start()
    assert making.wait(10)
    spared = threading.Thread(target=later.spare)
    spared.start()
    spared.join(0.2)
    assert spared.is_alive()  # waiting for the making
    go.set()
    read.join(10)
    spared.join(10)
    assert not read.is_alive() and not spared.is_alive()
    monkeypatch.setattr(buckets, "run", real)
    kv.push(KEYS, _grads(1))  # donates the buckets: the outs keep their pull's values
    np.testing.assert_allclose(outs[0][0].asnumpy(), model[0], rtol=1e-6)
    np.testing.assert_allclose(outs[5][1].asnumpy(), model[5], rtol=1e-6)
