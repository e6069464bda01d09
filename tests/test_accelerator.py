"""jaxkv on an accelerator: a store on it, fed from it and from CPU devices (MXNet's ``device``
store with CPU-side data), pulls onto both, 2-bit and fp16 compression, optax, save and load.
Every number is checked against NumPy (or optax run by hand on one device).

These tests run where JAX has a device that is not a CPU: with a GPU as JAX's default backend
(``JAX_PLATFORMS=cuda,cpu``, as ``benchmarks/gpu_check.sh`` runs the suite), the imperative store
is ``jaxkv.create("device")`` (on every local GPU), the functional one ``jaxkv.empty([gpu])``,
and the 8 simulated CPU devices (``jax.devices("cpu")``) are the host side. Elsewhere they are
skipped, with the reason.

``JAXKV_TEST_ACCELERATOR=cpu`` (a switch for checking these tests, not a mode of jaxkv) lets the
last CPU device play the accelerator, with the other seven as the host side, so that the tests'
logic runs on a machine without one. A store there is over that one device, and values from the
others come from devices the store does not hold, as CPU values into a GPU store do.
"""

import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxkv
from jaxkv import nd

SWITCH = "JAXKV_TEST_ACCELERATOR"
T = 0.5  # the 2-bit threshold


class Setup(NamedTuple):
    accel: jax.Device  # the accelerator (one of them)
    hosts: list  # CPU devices, the host side
    store: tuple  # the devices of the imperative device store
    default: bool  # whether the accelerator is JAX's default backend (create("device") is on it)


def _find() -> Setup | str:
    """The accelerator set-up, or why there is none."""
    cpus = jax.devices("cpu")
    how = os.environ.get(SWITCH, "")
    if how == "cpu":
        return Setup(cpus[-1], list(cpus[:-1]), (cpus[-1],), False)
    if how:
        raise ValueError(f"{SWITCH}={how!r}: expected 'cpu' (a CPU device plays the accelerator)")
    if jax.devices()[0].platform != "cpu":
        accel = jax.devices()[0]
        return Setup(accel, list(cpus), tuple(jax.local_devices()), True)
    for backend in ("gpu", "tpu"):
        try:
            found = jax.devices(backend)
        except RuntimeError:  # no such backend here
            continue
        return Setup(found[0], list(cpus), (found[0],), False)
    return (
        "no accelerator: JAX finds only CPU devices (run with JAX_PLATFORMS=cuda,cpu on a GPU "
        f"machine, or set {SWITCH}=cpu to let a CPU device play one)"
    )


@pytest.fixture(scope="module")
def setup() -> Setup:
    found = _find()
    if isinstance(found, str):
        pytest.skip(found)
    return found


def device_store(setup: Setup) -> jaxkv.KVStore:
    """MXNet's ``create("device")`` on the accelerator: the store itself where the accelerator
    is JAX's default backend, else one over the accelerator named."""
    kv = jaxkv.create("device") if setup.default else jaxkv.KVStore("device", list(setup.store))
    assert kv.state.devices == setup.store
    return kv


def on(device, x):
    return jax.device_put(np.asarray(x, np.float32), device)


def host_values(setup: Setup, xs):
    """``xs[i]`` on host device ``i`` (as many host devices as values)."""
    return [on(setup.hosts[i], x) for i, x in enumerate(xs)]


def grid(rng, n, shape):
    """``n`` arrays of ``shape`` holding multiples of 1/8 in [-1, 1]: every sum below is exact
    in float32, on any device, in any order."""
    return [rng.integers(-8, 9, size=shape).astype(np.float32) / 8 for _ in range(n)]


# -- sums and pulls ---------------------------------------------------------------------------
def test_a_store_on_the_accelerator_sums_values_from_it_and_from_host_devices(setup):
    rng = np.random.default_rng(0)
    shapes = {"w": (3, 4), "big": (64, 512)}  # "big": above the big-array bound
    state = jaxkv.init(jaxkv.empty([setup.accel]), {k: jnp.zeros(s) for k, s in shapes.items()})
    assert {d for k in shapes for d in state[k].devices()} == {setup.accel}
    for n_hosts, from_accel in [(1, False), (3, True), (len(setup.hosts), False), (0, True)]:
        xs = {k: grid(rng, n_hosts + from_accel, s) for k, s in shapes.items()}
        values = {k: host_values(setup, x[:n_hosts]) for k, x in xs.items()}
        if from_accel:
            for k, x in xs.items():
                values[k].append(on(setup.accel, x[-1]))
        state = jaxkv.push(state, values)
        for k, x in xs.items():
            np.testing.assert_array_equal(np.asarray(state[k]), np.sum(x, axis=0))
            assert state[k].devices() == {setup.accel}


def test_pulls_land_on_the_accelerator_and_on_host_devices(setup):
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    state = jaxkv.init(jaxkv.empty([setup.accel]), {"w": on(setup.hosts[0], w)})
    for devices in ([setup.accel], setup.hosts[:1], setup.hosts[2:5]):
        pulled = jaxkv.pull(state, "w", devices=devices)
        assert pulled.devices() == set(devices)
        np.testing.assert_array_equal(np.asarray(pulled), w)
    pulled = jaxkv.pull(state, ["w", "w"], devices=setup.hosts[1])
    assert all(p.devices() == {setup.hosts[1]} for p in pulled)


def test_the_device_store_fed_from_host_contexts_fills_host_and_accelerator_outs(setup):
    """The MXNet tutorial on a GPU store: values on cpu(i) contexts, outs on cpu(i) and on the
    accelerator's context, an in-place updater."""
    kv = device_store(setup)
    shape = (2, 3)
    kv.init(3, nd.ones(shape) * 2)  # nd's default context: cpu(0), MXNet's
    n = min(4, len(setup.hosts))
    kv.push(3, [nd.ones(shape, jaxkv.cpu(i)) * (i + 1) for i in range(n)])
    accel_ctx = jaxkv.Context.from_device(setup.accel)
    outs = [nd.zeros(shape, jaxkv.cpu(i)) for i in range(n)] + [nd.zeros(shape, accel_ctx)]
    kv.pull(3, out=outs)
    for i, o in enumerate(outs):
        assert o.context == (jaxkv.cpu(i) if i < n else accel_ctx)
        np.testing.assert_array_equal(o.asnumpy(), np.full(shape, n * (n + 1) / 2))

    def update(key, inp, stored):
        stored += inp * 2

    kv.set_updater(update)
    kv.push(3, [nd.ones(shape, jaxkv.cpu(i)) for i in range(n)] + [nd.ones(shape, accel_ctx)])
    kv.pull(3, out=outs)
    expected = n * (n + 1) / 2 + 2 * (n + 1)
    for o in outs:
        np.testing.assert_array_equal(o.asnumpy(), np.full(shape, expected))
    pulled = kv.pull(3)
    assert pulled.devices() == set(setup.store)
    np.testing.assert_array_equal(np.asarray(pulled), np.full(shape, expected))


# -- compression ------------------------------------------------------------------------------
def _store_device(setup: Setup, devices: list, i: int) -> int:
    """The store device (index into ``setup.store``) whose residual the ``i``-th value uses:
    its own where it is on one, else the store device at its position (docs/design.md)."""
    d = devices[i]
    return setup.store.index(d) if d in setup.store else i % len(setup.store)


def two_bit_model(setup, residuals, devices, xs):
    """NumPy: values added per store device (in call order), then MXNet's 2-bit rule with that
    device's residual, then the sum over devices; ``residuals`` updated in place."""
    by_device: dict = {}
    for i, x in enumerate(xs):
        d = _store_device(setup, devices, i)
        by_device[d] = by_device.get(d, np.float32(0)) + x
    total = np.zeros_like(xs[0])
    for d, g in by_device.items():
        acc = residuals[d] + g
        q = np.where(acc >= T, T, np.where(acc <= -T, -T, 0)).astype(np.float32)
        residuals[d] = acc - q
        total = total + q
    return total


def test_two_bit_compression_of_host_and_accelerator_values_follows_numpy(setup):
    rng = np.random.default_rng(1)
    kv = device_store(setup)
    kv.set_gradient_compression({"type": "2bit", "threshold": T})
    shape = (4, 8)
    kv.init("g", nd.zeros(shape))
    residuals = [np.zeros(shape, np.float32) for _ in setup.store]
    for step in range(6):
        n = [1, 2, 3, len(setup.hosts), 2, 1][step]
        xs = [x * 0.75 for x in grid(rng, n + 1, shape)]  # multiples of 3/32: exact sums
        devices = setup.hosts[:n] + [setup.accel]
        kv.push("g", [on(d, x) for d, x in zip(devices, xs)])
        expected = two_bit_model(setup, residuals, devices, xs)
        np.testing.assert_array_equal(np.asarray(kv.pull("g")), expected)
    stored = np.asarray(kv.state.residuals["g"]).reshape(len(setup.store), *shape)
    np.testing.assert_allclose(stored, np.stack(residuals), rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_rounding_compression_of_host_values_follows_numpy(setup, kind):
    """Each store device's sum is rounded to 16 bits, then summed (1 + 2**-9 is a float16, not a
    bfloat16)."""
    kv = device_store(setup)
    kv.set_gradient_compression({"type": kind})
    kv.init("h", nd.zeros(3))
    x = np.float32(1 + 2**-9)
    xs = [np.array([x, 3.0, -0.25], np.float32)] * min(3, len(setup.hosts))
    devices = setup.hosts[: len(xs)]
    kv.push("h", host_values(setup, xs))
    low = np.float16 if kind == "fp16" else jnp.bfloat16
    by_device: dict = {}
    for i, v in enumerate(xs):
        d = _store_device(setup, devices, i)
        by_device[d] = by_device.get(d, np.float32(0)) + v
    expected = sum(v.astype(low).astype(np.float32) for v in by_device.values())
    np.testing.assert_array_equal(np.asarray(kv.pull("h")), expected)


# -- optax ------------------------------------------------------------------------------------
@pytest.mark.standard_promotion  # Adam
def test_adam_on_the_accelerator_matches_optax_by_hand(setup):
    rng = np.random.default_rng(2)
    opt = optax.adam(0.1)
    params = {"w": rng.normal(size=(3, 4)).astype(np.float32), "b": np.zeros(4, np.float32)}
    state = jaxkv.init(jaxkv.empty([setup.accel]), {k: jnp.asarray(v) for k, v in params.items()})
    kv = device_store(setup)
    kv.init(["b", "w"], [nd.array(params["b"]), nd.array(params["w"])])
    kv.set_optimizer(opt)
    cpu = jax.devices("cpu")[0]
    ref = jax.device_put(params, cpu)
    ref_state = opt.init(ref)
    for _ in range(4):
        grads = {
            k: [rng.normal(size=v.shape).astype(np.float32) for _ in range(3)]
            for k, v in params.items()
        }
        # Two values from host devices, one from the accelerator, per key.
        values = {
            k: host_values(setup, g[:-1]) + [on(setup.accel, g[-1])] for k, g in grads.items()
        }
        state = jaxkv.push(state, values, updater=opt)
        kv.push(["b", "w"], [values["b"], values["w"]])
        summed = jax.device_put({k: np.sum(g, axis=0) for k, g in grads.items()}, cpu)
        updates, ref_state = opt.update(summed, ref_state, ref)
        ref = optax.apply_updates(ref, updates)
        for k in params:
            np.testing.assert_allclose(np.asarray(state[k]), np.asarray(ref[k]), rtol=1e-5)
            np.testing.assert_allclose(np.asarray(kv.pull(k)), np.asarray(ref[k]), rtol=1e-5)
    assert {d for leaf in jax.tree_util.tree_leaves(state) for d in leaf.devices()} == {setup.accel}


# -- save and load ----------------------------------------------------------------------------
@pytest.mark.standard_promotion  # Adam
def test_save_and_load_on_the_accelerator_and_onto_host_devices(setup, tmp_path):
    rng = np.random.default_rng(3)
    kv = device_store(setup)
    kv.set_gradient_compression({"type": "2bit", "threshold": T})
    kv.set_optimizer(optax.adam(0.1))
    w = rng.normal(size=(8, 4)).astype(np.float32)
    kv.init(["w"], [nd.array(w)])
    grads = [x * 0.75 for x in grid(rng, 3, w.shape)]
    kv.push("w", host_values(setup, grads))
    kv.save(tmp_path / "store.npz")
    fresh = device_store(setup)  # uncompressed: the file brings its compression back
    fresh.set_optimizer(optax.adam(0.1))
    fresh.load(tmp_path / "store.npz")
    assert fresh.state.compression == ("2bit", T)
    for a, b in zip(jax.tree_util.tree_leaves(kv.state), jax.tree_util.tree_leaves(fresh.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert b.devices() <= set(setup.store)
    # Both continue identically: values, Adam's moments and the 2-bit residuals were kept.
    for store in (kv, fresh):
        store.push("w", host_values(setup, grads))
    np.testing.assert_array_equal(np.asarray(kv.pull("w")), np.asarray(fresh.pull("w")))
    # Values alone load onto a store on host devices (residuals need the same device count).
    kv.set_gradient_compression({"type": "none"})
    kv.save(tmp_path / "plain.npz")
    host = jaxkv.KVStore("device", setup.hosts[:2])
    host.set_optimizer(optax.adam(0.1))
    host.load(tmp_path / "plain.npz")
    assert host.pull("w").devices() == set(setup.hosts[:2])
    np.testing.assert_array_equal(np.asarray(host.pull("w")), np.asarray(kv.pull("w")))
