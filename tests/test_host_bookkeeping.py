"""The imperative store's host bookkeeping costs O(keys touched) a step, not O(everything it
ever lent): MXNet's list push and pull of many keys into outs on several devices, counted in
calls, not timed."""

from __future__ import annotations

import numpy as np
import pytest

import jaxkv
import jaxkv.mx as mx
from jaxkv._src.mxnet import lending


def _devices():
    return [mx.cpu(0), mx.cpu(1)]


def _counted_steps(monkeypatch, module, name, keys, shape, steps):
    """MXNet's data-parallel loop on a ``device`` store of 2 devices under SGD (learning rate
    0.5): ``keys`` keys of ``shape``, a list push of per-device gradients of ones and a list
    pull into per-device outs, ``steps`` times, counting the calls of ``module.name`` in each
    step. Returns the store, its keys, the gradients, the outs and the counts."""
    devices = _devices()
    kv = jaxkv.KVStore("device", devices=devices)
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.5))
    names = list(range(keys))
    kv.init(names, [mx.nd.zeros(shape) for _ in names])
    mx.nd.waitall()
    grads = [[mx.nd.ones(shape, ctx=d) for d in devices] for _ in names]
    outs = [[mx.nd.zeros(shape, ctx=d) for d in devices] for _ in names]
    counts: list[int] = []
    real = getattr(module, name)

    def counted(*args, **kwargs):
        counts[-1] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    for _ in range(steps):
        counts.append(0)
        kv.push(names, grads)
        kv.pull(names, out=outs)
        mx.nd.waitall()
    return kv, names, grads, outs, counts


@pytest.mark.whole
def test_the_notes_of_lent_arrays_cost_o_keys_a_step(monkeypatch):
    """A list push of per-device gradients and a list pull into per-device outs, as MXNet's
    data-parallel loop, on a store whose small keys share a bucket (few stored arrays, many
    lent views): each step notes at most one array per key, not one per out (it noted two
    weak references per out: the out and what it held); every value is SGD's."""
    keys = 120
    _, _, _, outs, calls = _counted_steps(monkeypatch, lending, "_note", keys, (4, 4), 6)
    # Each step: w -= 0.5 * (1 + 1), six times.
    for out in outs[0] + outs[-1]:
        np.testing.assert_array_equal(out.asnumpy(), np.full((4, 4), -6.0, np.float32))
    assert 0 < max(calls[1:]) <= keys, calls


def test_a_list_push_like_an_earlier_one_checks_its_values_once(monkeypatch):
    """MXNet's list push of per-device gradients, step after step: each value is checked
    (shape, dtype) at the first push of the call's form, and later pushes of values of the
    same shapes, dtypes and devices are grouped again in C-level passes; a later push whose
    values differ is checked, and refused, as the first one was, before anything changes."""
    from jaxkv._src.state import pairing

    keys = 30
    kv, names, grads, outs, checks = _counted_steps(
        monkeypatch, pairing, "check_value", keys, (2, 3), 5
    )
    assert checks[-1] == checks[-2] == 0, checks  # once the form is known
    devices = _devices()
    assert checks[0] >= keys * len(devices), checks
    for out in outs[0] + outs[-1]:  # w -= 0.5 * (1 + 1), five times
        np.testing.assert_array_equal(out.asnumpy(), np.full((2, 3), -5.0, np.float32))
    wrong = [list(g) for g in grads]
    wrong[7][1] = mx.nd.ones((2, 3), ctx=devices[1], dtype="float16")  # the same shape
    wrong[9][0] = mx.nd.ones((3, 2), ctx=devices[0])
    with pytest.raises(jaxkv.ShapeError, match="key 9"):
        kv.push(names, wrong)
    wrong[9][0] = grads[9][0]
    kv.push(names, wrong)  # float16 widens to float32 safely: taken
    kv.pull(names, out=outs)
    np.testing.assert_array_equal(outs[7][0].asnumpy(), np.full((2, 3), -6.0, np.float32))
    np.testing.assert_array_equal(outs[9][1].asnumpy(), np.full((2, 3), -6.0, np.float32))


def test_the_forms_of_a_push_of_one_value_per_key_are_grouped_apart():
    """``kv.push(k, [x])`` and ``kv.push([k], [x])`` name the same keys with one value each, as
    a list and as the value itself: each form grouped again is grouped as it was, whichever
    came first (the value's shape is the stored one; nothing is stacked)."""
    kv = jaxkv.KVStore("local", devices=[mx.cpu(0)])
    kv.init([1, 2], [mx.nd.zeros((8, 4)), mx.nd.zeros((8, 4))])
    mx.nd.waitall()
    x = mx.nd.ones((8, 4))
    out = mx.nd.zeros((8, 4))
    calls = [
        lambda: kv.push([1, 2], [x, x]),  # a value per key
        lambda: kv.push([1, 2], [[x], [x]]),  # a list of one value per key
        lambda: kv.push(1, [x]),
        lambda: kv.push([1], [x]),
    ]
    for call in calls + calls[::-1] + calls:
        call()
        kv.pull(1, out=out)
        np.testing.assert_array_equal(out.asnumpy(), np.ones((8, 4), np.float32))
