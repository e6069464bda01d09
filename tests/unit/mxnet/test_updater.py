"""jaxkv/_src/mxnet/updater.py: MXNet's Updater applies an optimizer by hand, index by index,
with the store's numbers; a store given one through set_updater uses its optimizer."""

import numpy as np
import pytest

import jaxkv
import jaxkv.mx as mx


def test_the_updater_gives_what_the_store_gives():
    rng = np.random.default_rng(0)
    w0 = rng.uniform(-1, 1, (3, 2)).astype(np.float32)
    grads = [rng.uniform(-1, 1, (3, 2)).astype(np.float32) for _ in range(4)]

    def make():
        sched = mx.lr_scheduler.FactorScheduler(step=1, factor=0.5, base_lr=0.5)
        return mx.optimizer.SGD(momentum=0.9, wd=0.1, lr_scheduler=sched)

    by_hand = make()
    update = mx.optimizer.get_updater(by_hand)
    w = mx.nd.array(w0)
    kv = mx.kv.create("local")
    kv._set_updater(mx.optimizer.get_updater(make()))  # MXNet's way to set an optimizer
    kv.init(5, mx.nd.array(w0))
    out = mx.nd.zeros((3, 2))
    for g in grads:
        update(5, mx.nd.array(g), w)
        kv.push(5, mx.nd.array(g))
        kv.pull(5, out=out)
        np.testing.assert_array_equal(w.asnumpy(), out.asnumpy())
    assert by_hand.num_update == 4 and set(update.states) == {5}
    assert not np.array_equal(w.asnumpy(), w0)


def test_the_updater_takes_lists_and_refuses_what_it_cannot_do():
    update = mx.optimizer.get_updater(mx.optimizer.create("test", rescale_grad=2.0))
    a, b = mx.nd.ones((2,)), mx.nd.zeros((3,))
    update([0, 1], [mx.nd.ones((2,)), mx.nd.ones((3,))], [a, b])
    np.testing.assert_array_equal(a.asnumpy(), [3.0, 3.0])
    np.testing.assert_array_equal(b.asnumpy(), [2.0, 2.0, 2.0])
    with pytest.raises(jaxkv.KVStoreError, match="index 0: expected a gradient of the weight"):
        update(0, mx.nd.ones((5,)), a)
    with pytest.raises(jaxkv.KVStoreError, match="as many gradients and weights"):
        update([0, 1], [mx.nd.ones((2,))], [a, b])
    with pytest.raises(jaxkv.KVStoreError, match="does not pickle"):
        update.get_states()
    with pytest.raises(jaxkv.KVStoreError, match="does not unpickle"):
        update.set_states(b"")
    with pytest.raises(jaxkv.KVStoreError, match="expected a jaxkv.mx.optimizer optimizer"):
        mx.optimizer.get_updater(object())
