"""Threads sharing one store: pushes, pulls and pushpulls at once, against a NumPy model of the
exact sums, for ``jaxkv.KVStore`` and the ``jaxkv.mx`` store."""

import threading

import jax
import numpy as np
import pytest
from _devices import cpu_store

import jaxkv
import jaxkv.mx as mx
from jaxkv import nd

SHAPE = (2, 3)


@pytest.fixture
def kv():
    store = cpu_store("local")
    store.init([3, 5], [nd.ones(SHAPE) * 2, nd.zeros(SHAPE)])
    return store


def test_concurrent_pushes_lose_nothing(kv):
    kv.set_updater(lambda k, i, s: s + i)
    n_threads, n_pushes = 8, 25

    def worker(i):
        for _ in range(n_pushes):
            kv.push([3, 5], [nd.ones(SHAPE, jaxkv.cpu(i)), nd.ones(SHAPE, jaxkv.cpu(i))])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total = n_threads * n_pushes
    np.testing.assert_array_equal(kv.pull(3), np.full(SHAPE, 2.0 + total))
    np.testing.assert_array_equal(kv.pull(5), np.full(SHAPE, float(total)))


# -- pulls and pushpulls while others push --------------------------------------------------
def _store(kind):
    if kind == "jaxkv":
        store = cpu_store("local")
        store.init([3, 5], [jax.numpy.full(SHAPE, 2.0), jax.numpy.zeros(SHAPE)])
    else:
        store = mx.kv.create("local")
        store.init([3, 5], [mx.nd.ones(SHAPE) * 2, mx.nd.zeros(SHAPE)])
    return store


def _array(kind, value, device):
    if kind == "jaxkv":
        return nd.full(SHAPE, value, jaxkv.cpu(device))
    return mx.nd.full(SHAPE, value, ctx=mx.cpu(device))


def _outs(kind):
    zeros = mx.nd.zeros if kind == "mx" else nd.zeros
    return [zeros(SHAPE), zeros(SHAPE)]


def _pulled(kind, store):
    """Keys 3 and 5 as NumPy, pulled in one call."""
    outs = _outs(kind)
    store.pull([3, 5], out=outs)
    return [o.asnumpy() for o in outs]


def _pushpulled(kind, store, value, device):
    """Keys 3 and 5 as NumPy after a pushpull of ``value`` to each from ``device``."""
    outs = _outs(kind)
    store.pushpull([3, 5], [_array(kind, value, device), _array(kind, value, device)], out=outs)
    return [o.asnumpy() for o in outs]


def _added(three, five, total, since):
    """What the pushes added so far, read from a pull of keys 3 (``2 +`` it) and 5 (it), as the
    model says a pull can see it: one number in every element of both keys (each push is one
    call over both: none seen half done), a whole number from ``since`` to ``total``."""
    added = three - 2.0
    assert np.array_equal(added, five), (three, five)
    assert np.all(added == added.flat[0]), added
    n = float(added.flat[0])
    assert n == int(n) and since <= n <= total, (n, since, total)
    return n


@pytest.mark.parametrize("updater", ["python", "pure"])
@pytest.mark.parametrize("kind", ["jaxkv", "mx"])
def test_pulls_and_pushpulls_during_pushes_see_whole_pushes_and_the_exact_sum(kind, updater):
    store = _store(kind)

    def add(key, pushed, stored):
        return stored + pushed

    store.set_updater(add if updater == "python" else jaxkv.pure_updater(add))
    n_writers, n_pushes, n_pushpulls = 4, 15, 15
    # The model: writer w adds w + 1 to each key per push, the pushpull thread 1 per call.
    total = n_pushes * sum(w + 1 for w in range(n_writers)) + n_pushpulls
    errors, done = [], threading.Event()

    def guarded(fn, *args):
        def run():
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                errors.append(e)

        return threading.Thread(target=run)

    def writer(w):
        for _ in range(n_pushes):
            store.push([3, 5], [_array(kind, w + 1.0, w), _array(kind, w + 1.0, w)])

    def reader():
        seen, finished = 0.0, False
        while not finished:  # one read at least, and one after the last push
            finished = done.is_set()
            seen = _added(*_pulled(kind, store), total, seen)  # never goes back

    def pushpuller():
        seen = 0.0
        for i in range(n_pushpulls):
            # Its own push is in what it gets back, with whatever others pushed before.
            seen = _added(*_pushpulled(kind, store, 1.0, 7), total, max(seen + 1, i + 1))

    writers = [guarded(writer, w) for w in range(n_writers)] + [guarded(pushpuller)]
    readers = [guarded(reader) for _ in range(2)]
    for t in readers + writers:
        t.start()
    for t in writers:
        t.join()
    done.set()
    for t in readers:
        t.join()
    assert not errors, errors
    three, five = _pulled(kind, store)
    np.testing.assert_array_equal(three, np.full(SHAPE, 2.0 + total, np.float32))
    np.testing.assert_array_equal(five, np.full(SHAPE, float(total), np.float32))


def test_an_out_read_while_its_held_pull_runs_waits_for_its_value(kv):
    """A thread reading an out while another thread runs the pull held for it (the store's
    held calls, run by a read) gets the pulled value: the out stays owed until it is filled.
    Before, the held calls released every out first, and a read in between got what the out
    held before (its zeros) with no error."""
    kv.push(3, nd.ones(SHAPE) * 5)  # (assigned: 5 everywhere)
    out, other = nd.zeros(SHAPE), nd.zeros(SHAPE)
    kv.pull(5, out=other)
    kv.pull(3, out=out)  # both held
    entered, go = threading.Event(), threading.Event()
    pull_now = kv._pull_now

    def slow_pull(*args, **kwargs):  # (the held pulls run: pause before filling any out)
        entered.set()
        assert go.wait(10)
        return pull_now(*args, **kwargs)

    kv._pull_now = slow_pull
    seen = []
    filler = threading.Thread(target=other.asnumpy)  # runs what the store holds
    reader = threading.Thread(target=lambda: seen.append(out.asnumpy()))
    filler.start()
    assert entered.wait(10)
    reader.start()
    reader.join(0.5)  # it waits for the store (before: it read the zeros at once)
    go.set()
    filler.join(10)
    reader.join(10)
    np.testing.assert_array_equal(seen[0], np.full(SHAPE, 5.0))
