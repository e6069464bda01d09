"""The eager fast path (``jaxkv/_src/core/plans.py``): a repeated push or pull replays a plan, with
the general path's results and refusals, and no per-key host work (no ``device_put`` of a value
already where it belongs; one compiled computation per push)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxkv
import jaxkv._src.core.plans as dispatch
import jaxkv.mx as mx

SHAPES = [(3,), (2, 2), (), (4, 3)]


@pytest.fixture(scope="module")
def cpus():
    devs = jax.devices("cpu")
    assert len(devs) == 8, "tests expect 8 simulated CPU devices (see conftest.py)"
    return devs


def _general(monkeypatch):
    """Every call through the general path from here on."""
    monkeypatch.setattr(dispatch, "push", lambda *a: None)
    monkeypatch.setattr(dispatch, "pull", lambda *a: dispatch.NO_PLAN)
    monkeypatch.setattr(dispatch, "prepare_fill", lambda *a: None)


def _store(devices, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    values = [jnp.asarray(rng.normal(size=s), dtype) for s in SHAPES]
    return jaxkv.init(jaxkv.empty(devices), list(range(len(SHAPES))), values)


def _grads(rng, devices, per_device):
    if per_device:
        return [
            [jax.device_put(jnp.asarray(rng.normal(size=s), jnp.float32), d) for d in devices]
            for s in SHAPES
        ]
    return [
        jax.device_put(jnp.asarray(rng.normal(size=s), jnp.float32), devices[0]) for s in SHAPES
    ]


def _run(devices, per_device, updater, keys_order, steps=4):
    rng = np.random.default_rng(1)
    state = _store(devices)
    out = []
    for _ in range(steps):
        grads = _grads(rng, devices, per_device)
        keys = [keys_order[i] for i in range(len(SHAPES))]
        values = [grads[k] for k in keys]
        state, pulled = jaxkv.pushpull(state, keys, values, updater=updater, devices=devices)
        out.append([np.asarray(x) for x in pulled])
    return out


@pytest.mark.standard_promotion  # optax's Adam
@pytest.mark.parametrize(("n_devices", "per_device"), [(1, False), (8, False), (8, True)])
@pytest.mark.parametrize("updater", ["assign", "sgd", "adam", "mxnet"])
@pytest.mark.parametrize("keys_order", [(0, 1, 2, 3), (2, 0, 3, 1)])
def test_the_fast_path_gives_the_general_paths_numbers(
    cpus, monkeypatch, n_devices, per_device, updater, keys_order
):
    devices = cpus[:n_devices]
    fn = {
        "assign": None,
        "sgd": optax.sgd(0.1, momentum=0.9),
        "adam": optax.adam(0.01),
        "mxnet": lambda key, pushed, stored: stored + 0.5 * pushed,
    }[updater]
    fast = _run(devices, per_device, fn, keys_order)
    _general(monkeypatch)
    general = _run(devices, per_device, fn, keys_order)
    for a, b in zip(fast, general):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


def test_a_repeated_push_puts_nothing_and_runs_one_computation(cpus, monkeypatch):
    """Values already on the store's device are not device_put again, and the push is one
    compiled computation, whatever the number of keys."""
    dev = cpus[0]
    keys = list(range(50))
    state = jaxkv.init(jaxkv.empty([dev]), keys, [jnp.zeros(3, device=dev) for _ in keys])
    grads = [jnp.ones(3, device=dev) for _ in keys]
    sgd = optax.sgd(1.0)
    for _ in range(3):  # the plan is made (a flat store's, by its second push by plan)
        state = jaxkv.push(state, keys, grads, updater=sgd)
    puts = []
    real_put = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: puts.append(a) or real_put(*a, **k))
    sig = next(reversed(dispatch._PUSHES._plans))
    plan = dispatch._PUSHES._plans[sig]
    calls = []
    real_fn = plan.fn
    plan.fn = lambda *a: calls.append(1) or real_fn(*a)
    try:
        for _ in range(3):
            state = jaxkv.push(state, keys, grads, updater=sgd)
    finally:
        plan.fn = real_fn
    assert puts == [] and len(calls) == 3
    np.testing.assert_array_equal(np.asarray(jaxkv.pull(state, 7)), -6 * np.ones(3))


def test_the_fast_path_refuses_what_the_general_path_refuses(cpus):
    dev = cpus[0]
    state = jaxkv.init(jaxkv.empty([dev]), {0: jnp.zeros(3), 1: jnp.zeros(2)})
    good = [jnp.ones(3, device=dev), jnp.ones(2, device=dev)]
    for _ in range(2):
        state = jaxkv.push(state, [0, 1], good)
    with pytest.raises(jaxkv.ShapeError, match="key 1"):
        jaxkv.push(state, [0, 1], [good[0], jnp.ones(3, device=dev)])
    with pytest.raises(jaxkv.KVStoreError, match="complex"):
        jaxkv.push(state, [0, 1], [good[0], jnp.ones(2, jnp.complex64, device=dev)])
    with pytest.raises(jaxkv.KeyTypeError):
        jaxkv.push(state, [False, True], good)  # equal to [0, 1] and of the same hash
    with pytest.raises(jaxkv.UnknownKeyError):
        jaxkv.push(state, [0, 2], good)
    np.testing.assert_array_equal(np.asarray(jaxkv.pull(state, 0)), np.ones(3))


def test_a_value_elsewhere_or_of_another_dtype_takes_the_general_way(cpus):
    """After a plan for values on the store's device, values on another device or of another
    dtype are moved and cast as before, with the same numbers."""
    state = jaxkv.init(jaxkv.empty([cpus[0]]), {0: jnp.zeros(3)})
    for _ in range(2):
        state = jaxkv.push(state, 0, jnp.ones(3, device=cpus[0]), updater=optax.sgd(1.0))
    state = jaxkv.push(state, 0, jnp.ones(3, device=cpus[3]), updater=optax.sgd(1.0))
    state = jaxkv.push(state, 0, jnp.ones(3, jnp.int8, device=cpus[0]), updater=optax.sgd(1.0))
    assert jaxkv.pull(state, 0).devices() == {cpus[0]}
    np.testing.assert_array_equal(np.asarray(jaxkv.pull(state, 0)), -4 * np.ones(3))


def test_stores_with_the_same_keys_and_other_shapes_keep_their_own_plans(cpus):
    a = jaxkv.init(jaxkv.empty([cpus[0]]), {0: jnp.zeros(3)})
    b = jaxkv.init(jaxkv.empty([cpus[0]]), {0: jnp.zeros((2, 2))})
    for _ in range(2):
        a = jaxkv.push(a, [0], [jnp.ones(3, device=cpus[0])])
        b = jaxkv.push(b, [0], [jnp.full((2, 2), 2.0, device=cpus[0])])
    with pytest.raises(jaxkv.ShapeError):
        jaxkv.push(a, [0], [jnp.ones((2, 2), device=cpus[0])])
    assert jaxkv.pull(b, 0).shape == (2, 2) and float(jaxkv.pull(b, 0)[0, 0]) == 2.0


def test_donated_pushes_by_plan_keep_pulled_values_valid(cpus):
    dev = cpus[0]
    state = jaxkv.init(jaxkv.empty([dev]), {0: jnp.zeros(3), 1: jnp.zeros(2)})
    kept = []
    for step in range(4):
        grads = [jnp.full(3, step, jnp.float32, device=dev), jnp.ones(2, device=dev)]
        state = jaxkv.push(state, [0, 1], grads, donate=True)
        kept.append(jaxkv.pull(state, [0, 1], devices=[jax.devices("cpu")[1]]))
    assert [float(k[0][0]) for k in kept] == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("n_devices", [1, 8])
def test_imperative_pulls_into_outs_by_plan(cpus, n_devices):
    """Outs on each of the store's devices, a key pulled twice, and outs that stay valid
    across the store's later (donating) pushes."""
    ctxs = [mx.cpu(i) for i in range(n_devices)]
    kv = jaxkv.KVStore("device", devices=cpus[:n_devices])
    kv.init([0, 1], [mx.nd.zeros((2, 3)), mx.nd.zeros(4)])
    kv.set_optimizer(optax.sgd(1.0))
    history = []
    for step in range(4):
        grads = [
            [mx.nd.ones((2, 3), c) * (step + 1) for c in ctxs],
            [mx.nd.ones(4, c) for c in ctxs],
        ]
        kv.push([0, 1], grads)
        outs = [[mx.nd.zeros((2, 3), c) for c in ctxs], [mx.nd.zeros((2, 3), c) for c in ctxs]]
        kv.pull([0, 0], out=outs)
        history.append(outs)
    expected = 0.0
    for step, outs in enumerate(history):
        expected -= n_devices * (step + 1)
        for o, c in zip(outs[0] + outs[1], ctxs + ctxs):
            assert o.context == c
            np.testing.assert_array_equal(o.asnumpy(), np.full((2, 3), expected, np.float32))


def test_an_out_of_another_dtype_or_shape_takes_the_general_way(cpus):
    kv = jaxkv.KVStore("device", devices=cpus[:1])
    kv.init(0, mx.nd.ones(3))
    out = mx.nd.zeros(3)
    for _ in range(2):
        kv.pull(0, out=out)
    half = mx.nd.zeros(3, dtype="float16")
    kv.pull(0, out=half)
    assert half.dtype == np.float16 and half.asnumpy().tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(jaxkv.ShapeError):
        kv.pull(0, out=mx.nd.zeros(4))


def test_outs_hold_the_stored_values_and_the_optimizer_state_is_still_reused(cpus):
    """A pull by plan lends the stored arrays to the outs (no copy); the next push keeps them
    (the outs stay valid) and still reuses the optimizer state's buffers."""
    kv = jaxkv.KVStore("device", devices=cpus[:1], layout="keys")  # a flat store copies out
    kv.init([0, 1], [mx.nd.ones(3), mx.nd.ones(2)])
    kv.set_optimizer(optax.sgd(0.5, momentum=0.9))
    outs = [mx.nd.zeros(3), mx.nd.zeros(2)]
    for _ in range(2):
        kv.push([0, 1], [mx.nd.ones(3), mx.nd.ones(2)])
        kv.pull([0, 1], out=outs)
    assert outs[0].asjax() is kv._state[0]  # lent, not copied
    momentum = jax.tree_util.tree_leaves(kv._state.opt_states[(0, 1)])
    kv.push([0, 1], [mx.nd.ones(3), mx.nd.ones(2)])
    assert not outs[0].asjax().is_deleted()
    assert all(m.is_deleted() for m in momentum)
    # sgd with momentum 0.9 on a gradient of ones: 1 - 0.5 * (1 + 1.9)
    np.testing.assert_allclose(outs[0].asnumpy(), np.full(3, 1 - 0.5 * 2.9, np.float32))
