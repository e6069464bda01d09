"""Keys made one at a time, as MXNet's tutorial makes them (``init`` of a key, a push of it, a
pull of it, a read): after the first key of a shape and dtype, a new key compiles nothing, and
every value is the updater's. Counted in compilations, not timed."""

from __future__ import annotations

import jax
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
    elif updater == "mxnet-sgd":
        kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1))
    return kv


def _one_key(kv, key, devices: list) -> np.ndarray:
    kv.init(key, mx.nd.ones(SHAPE))
    kv.push(key, [mx.nd.ones(SHAPE, ctx=d) * 2 for d in devices])
    outs = [mx.nd.zeros(SHAPE, ctx=d) for d in devices]
    kv.pull(key, out=outs)
    return np.stack([o.asnumpy() for o in outs])


@pytest.mark.parametrize("updater", ["python", "none", "mxnet-sgd"])
@pytest.mark.parametrize("n_devices", [1, 2])
def test_a_new_key_of_a_known_shape_compiles_nothing(updater, n_devices, compiles):
    """The 3 keys after the first few compile nothing (each cost 4 compilations before, 5
    under an MXNet optimizer: the store's buckets grew by a key, and every program over them
    was made anew), and the values are the updater's on every device."""
    devices = [mx.cpu(i) for i in range(n_devices)]
    kv = _store(updater, devices)
    want = 2.0 * n_devices if updater == "none" else 1 - 0.1 * 2 * n_devices
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


def _mxnet_run(optimizer, keys: int, steps: int) -> list[np.ndarray]:
    """Keys made, pushed and read one at a time under an MXNet optimizer, then ``steps``
    rounds of a push of each key alone: every key's final value."""
    devices = [mx.cpu(0), mx.cpu(1)]
    kv = jaxkv.KVStore("device", devices=devices)
    kv.set_optimizer(optimizer)
    rng = np.random.default_rng(0)
    grads = rng.standard_normal((steps + 1, keys, 2, *SHAPE)).astype(np.float32)
    for key in range(keys):
        kv.init(key, mx.nd.array(np.full(SHAPE, key + 1.0, np.float32)))
        kv.push(key, [mx.nd.array(g, ctx=d) for g, d in zip(grads[0, key], devices)])
        out = mx.nd.zeros(SHAPE)
        kv.pull(key, out=out)
        out.asnumpy()
    for t in range(1, steps + 1):
        for key in range(keys):
            kv.push(key, [mx.nd.array(g, ctx=d) for g, d in zip(grads[t, key], devices)])
    outs = [mx.nd.zeros(SHAPE) for _ in range(keys)]
    kv.pull(list(range(keys)), out=outs)
    return [o.asnumpy() for o in outs]


def _adam():
    opt = mx.optimizer.Adam(learning_rate=0.1, wd=0.01)
    opt.set_lr_mult({1: 0.5, 3: 2.0})  # per key: an argument of the one computation
    opt.set_wd_mult({2: 0.0})
    return opt


@pytest.mark.parametrize(
    "make",
    [_adam, lambda: mx.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=0.01)],
    ids=["adam", "sgd-momentum"],
)
def test_mxnet_optimizers_on_keys_made_one_at_a_time(make, compiles, monkeypatch):
    """Under an MXNet optimizer a new key of a known shape compiles nothing (its state and
    its push reuse the computations of keys renamed by rank), and every value is, bit for
    bit, what the computations of the keys' own names give (per-key learning-rate and
    weight-decay multipliers included)."""
    from jaxkv._src.core import renamed as by_rank
    from jaxkv._src.mxnet import per_key

    keys, steps = 5, 3
    with compiles() as c:
        renamed = _mxnet_run(make(), keys, steps)
    monkeypatch.setattr(by_rank, "renamable", lambda state, updater, keys: False)
    monkeypatch.setattr(per_key, "is_positional", lambda u: False)
    with compiles() as named_count:
        named = _mxnet_run(make(), keys, steps)
    for a, b in zip(renamed, named):
        np.testing.assert_array_equal(a, b)
    assert len({a.tobytes() for a in renamed}) == keys  # each key its own numbers
    assert c.count < named_count.count  # named, each new key compiled its own


def _optax_run(tx, names: list[str], steps: int) -> dict[str, np.ndarray]:
    """Keys made one at a time under an optax optimizer on the imperative store, each pushed
    alone ``steps`` times: every key's final value."""
    kv = jaxkv.KVStore("local")
    kv.set_optimizer(tx)
    rng = np.random.default_rng(1)
    for n, name in enumerate(names):
        kv.init(name, mx.nd.array(np.full(SHAPE, n + 1.0, np.float32)))
        for _ in range(steps):
            kv.push(name, mx.nd.array(rng.standard_normal(SHAPE).astype(np.float32)))
        out = mx.nd.zeros(SHAPE)
        kv.pull(name, out=out)
        out.asnumpy()
    outs = [mx.nd.zeros(SHAPE) for _ in names]
    kv.pull(names, out=outs)
    return {name: o.asnumpy() for name, o in zip(names, outs)}


def test_optax_on_keys_made_one_at_a_time(compiles, monkeypatch):
    """optax.adam on keys made one at a time: a new key of a known shape compiles nothing
    (its program, traced for its own name and for its rank, is the same), and the values are
    bit for bit those of the keys' own names."""
    import optax

    from jaxkv._src.core import renamed

    tx = optax.adam(0.1)
    names = ["a", "b", "c", "d"]
    with jax.numpy_dtype_promotion("standard"):  # optax's bias correction mixes types
        _optax_run(tx, names[:1], 2)  # warm-up: the shape's programs
        with compiles() as c:
            by_rank = _optax_run(tx, names[1:], 2)
        monkeypatch.setattr(renamed, "renamable", lambda state, updater, keys: False)
        with compiles() as named_count:
            named = _optax_run(tx, names[1:], 2)
    assert c.count == 0
    assert named_count.count >= 2 * len(names[1:])  # its state and its push, per key
    for k in names[1:]:
        np.testing.assert_array_equal(by_rank[k], named[k])


def test_a_transformation_that_reads_names_is_not_renamed():
    """A weight decay masked by the key's name (no decay for "bias"), keys made one at a time:
    each key gets its own mask's numbers (renamed, "bias" would be key 0 and decayed)."""
    import optax

    def mask(params):
        return {k: k != "bias" for k in params}

    tx = optax.chain(optax.masked(optax.add_decayed_weights(0.5), mask), optax.sgd(1.0))
    kv = jaxkv.KVStore("local")
    kv.set_optimizer(tx)
    for name in ["bias", "kernel", "scale"]:
        kv.init(name, mx.nd.ones(SHAPE))
        kv.push(name, mx.nd.zeros(SHAPE))  # the update is the decay alone
        out = mx.nd.zeros(SHAPE)
        kv.pull(name, out=out)
        want = 1.0 if name == "bias" else 0.5  # w - 1.0 * (0 + 0.5 * w)
        np.testing.assert_array_equal(out.asnumpy(), np.full(SHAPE, want, np.float32))
