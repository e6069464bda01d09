"""The imperative store's host bookkeeping costs O(keys touched) a step, not O(everything it
ever lent): MXNet's list push and pull of many keys into outs on several devices, counted in
calls, not timed."""

from __future__ import annotations

import numpy as np
import pytest

import jaxkv
import jaxkv.mx as mx
from jaxkv._src.mxnet import lending


@pytest.mark.whole
def test_the_notes_of_lent_arrays_cost_o_keys_a_step(monkeypatch):
    """A list push of per-device gradients and a list pull into per-device outs, as MXNet's
    data-parallel loop, on a store whose small keys share a bucket (few stored arrays, many
    lent views): each step checks a bounded number of notes per key (the sweep of the dead
    ones is amortised), where it swept every note at every lend (120 keys: 8979 checks a
    step); every value is SGD's."""
    keys, devices = 120, [mx.cpu(0), mx.cpu(1)]
    kv = jaxkv.KVStore("device", devices=devices)
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.5))
    names = list(range(keys))
    kv.init(names, [mx.nd.zeros((4, 4)) for _ in names])
    outs = [[mx.nd.zeros((4, 4), ctx=d) for d in devices] for _ in names]
    grads = [[mx.nd.ones((4, 4), ctx=d) for d in devices] for _ in names]
    calls = []
    holds = lending.holds

    def counted(entry):
        calls[-1] += 1
        return holds(entry)

    monkeypatch.setattr(lending, "holds", counted)
    for _ in range(6):
        calls.append(0)
        kv.push(names, grads)
        kv.pull(names, out=outs)
        mx.nd.waitall()
    # Each step: w -= 0.5 * (1 + 1), six times.
    for out in outs[0] + outs[-1]:
        np.testing.assert_array_equal(out.asnumpy(), np.full((4, 4), -6.0, np.float32))
    assert max(calls[1:]) <= 4 * keys, calls
