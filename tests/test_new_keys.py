"""Keys made one at a time, as MXNet's tutorial makes them (``init`` of a key, a push of it, a
pull of it, a read): after the first key of a shape and dtype, a new key compiles nothing, and
every value is the updater's. Counted in compilations, not timed."""

from __future__ import annotations

import numpy as np
import pytest

import jaxkv
import jaxkv.mx as mx

SHAPE = (2, 3)


def _python_updater(key, grad, weight):
    weight[:] = weight - 0.1 * grad  # MXNet's in-place style


def _store(updater: str, devices: list):
    kv = jaxkv.KVStore("device" if len(devices) > 1 else "local", devices=devices)
    if updater == "python":
        kv._set_updater(_python_updater)
    return kv


def _one_key(kv, key, devices: list) -> np.ndarray:
    kv.init(key, mx.nd.ones(SHAPE))
    kv.push(key, [mx.nd.ones(SHAPE, ctx=d) * 2 for d in devices])
    outs = [mx.nd.zeros(SHAPE, ctx=d) for d in devices]
    kv.pull(key, out=outs)
    return np.stack([o.asnumpy() for o in outs])


@pytest.mark.parametrize("updater", ["python", "none"])
@pytest.mark.parametrize("n_devices", [1, 2])
def test_a_new_key_of_a_known_shape_compiles_nothing(updater, n_devices, compiles):
    """The 3 keys after the first few compile nothing (each cost 4 compilations before: the
    store's buckets grew by a key, and every program over them was made anew), and the
    values are the updater's on every device."""
    devices = [mx.cpu(i) for i in range(n_devices)]
    kv = _store(updater, devices)
    want = 1 - 0.1 * 2 * n_devices if updater == "python" else 2.0 * n_devices
    for key in range(3):  # warm-up: the shape's programs, and the NDArray operators'
        np.testing.assert_allclose(_one_key(kv, key, devices), want, rtol=1e-6)
    with compiles() as c:
        for key in range(3, 6):
            np.testing.assert_allclose(_one_key(kv, key, devices), want, rtol=1e-6)
    assert c.count == 0
    # Every key keeps its own value; a list pull of them all reads what each push left.
    outs = [mx.nd.zeros(SHAPE) for _ in range(6)]
    kv.pull(list(range(6)), out=outs)
    for o in outs:
        np.testing.assert_allclose(o.asnumpy(), want, rtol=1e-6)


def test_keys_made_one_at_a_time_then_pushed_as_a_list(compiles):
    """Keys made one at a time, then pushed together as a list (laid out in buckets then):
    the list push gives each key its own update, as pushing them one by one would."""
    kv = jaxkv.KVStore("local")
    kv._set_updater(_python_updater)
    for key in range(4):
        kv.init(key, mx.nd.full(SHAPE, float(key)))
    kv.push(list(range(4)), [mx.nd.ones(SHAPE) * (k + 1) for k in range(4)])
    outs = [mx.nd.zeros(SHAPE) for _ in range(4)]
    kv.pull(list(range(4)), out=outs)
    for k, o in enumerate(outs):
        np.testing.assert_allclose(o.asnumpy(), k - 0.1 * (k + 1), rtol=1e-6)
    kv.push(2, mx.nd.ones(SHAPE))
    out = mx.nd.zeros(SHAPE)
    kv.pull(2, out=out)
    np.testing.assert_allclose(out.asnumpy(), 2 - 0.1 * 3 - 0.1, rtol=1e-6)
