"""Data-parallel training through jaxkv on 8 devices matches single-device training.

A small MLP on synthetic regression data, trained with SGD (momentum) for a few steps: once on
one device with plain optax, and three ways data-parallel through jaxkv (shard_map, pmap, and
the imperative KVStore with per-device gradients). Parameters must agree to 1e-5.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _devices import cpu_empty, cpu_store
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxkv

STEPS, BATCH, D = 8, 64, 8
OPT = optax.sgd(0.05, momentum=0.9)


def init_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": jax.random.normal(k1, (4, 16)) * 0.5,
        "b1": jnp.zeros(16),
        "w2": jax.random.normal(k2, (16, 1)) * 0.5,
        "b2": jnp.zeros(1),
    }


def data():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((STEPS, BATCH, 4)).astype(np.float32)
    y = np.sin(x.sum(-1, keepdims=True)).astype(np.float32)
    return x, y


def loss_sum(params, x, y):
    """Sum of squared errors over the examples given, divided by the *global* batch size."""
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.sum((h @ params["w2"] + params["b2"] - y) ** 2) / BATCH


@pytest.fixture(scope="module")
def reference():
    params, opt_state = init_params(), OPT.init(init_params())
    xs, ys = data()

    @jax.jit
    def step(params, opt_state, x, y):
        grads = jax.grad(loss_sum)(params, x, y)
        updates, opt_state = OPT.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for x, y in zip(xs, ys):
        params, opt_state = step(params, opt_state, x, y)
    return params


def assert_matches(state, reference):
    got = {k: np.asarray(state[k]) for k in reference}
    chex.assert_trees_all_close(got, jax.device_get(reference), atol=1e-5, rtol=1e-5)


def test_shard_map_loop_matches_single_device(reference, devices, compiles):
    mesh = Mesh(np.array(devices), ("d",))
    state = jaxkv.init(cpu_empty(), init_params())

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), P("d"), P("d")), out_specs=P())
    def step(state, x, y):
        params = dict(zip(state.keys(), jaxkv.pull(state, list(state.keys()))))
        grads = jax.grad(loss_sum)(params, x, y)  # already summed over "d" by JAX
        return jaxkv.push(state, grads, updater=OPT, axis_name="d")

    xs, ys = data()
    # Warm-up: after step one the optimizer state exists, and the state's leaves carry the
    # step's own output sharding (mesh axis "d", not the store's "kv"): one compile each.
    for x, y in zip(xs[:2], ys[:2]):
        state = step(state, x, y)
    with compiles() as c:
        for x, y in zip(xs[2:], ys[2:]):
            state = step(state, x, y)
    assert c.count == 0
    assert_matches(state, reference)


def test_pmap_loop_matches_single_device(reference, compiles):
    state = jaxkv.init(cpu_empty(), init_params())

    @functools.partial(
        jax.pmap, axis_name="i", in_axes=(None, 0, 0), out_axes=None, devices=jax.devices("cpu")
    )
    def step(state, x, y):
        params = {k: jaxkv.pull(state, k) for k in state.keys()}
        grads = jax.grad(loss_sum)(params, x, y)  # per-device: jaxkv sums them once
        return jaxkv.push(state, grads, updater=OPT, axis_name="i")

    xs, ys = data()
    for x, y in zip(xs[:2], ys[:2]):
        state = step(state, x.reshape(D, -1, 4), y.reshape(D, -1, 1))
    with compiles() as c:
        for x, y in zip(xs[2:], ys[2:]):
            state = step(state, x.reshape(D, -1, 4), y.reshape(D, -1, 1))
    assert c.count == 0
    assert_matches(state, reference)


def test_imperative_loop_matches_single_device(reference, devices, compiles):
    kv = cpu_store("device")
    params = init_params()
    keys = sorted(params)
    kv.init(keys, [params[k] for k in keys])
    kv.set_optimizer(OPT)
    grad_fn = jax.jit(jax.grad(loss_sum))
    outs = [{k: jaxkv.nd.zeros(params[k].shape, jaxkv.cpu(d)) for k in keys} for d in range(D)]
    kv.pull(keys, out=[[outs[d][k] for d in range(D)] for k in keys])

    def step(x, y):
        per_device = []
        for d in range(D):
            local = {k: outs[d][k].asjax() for k in keys}
            xd = jax.device_put(x[d::D], devices[d])
            yd = jax.device_put(y[d::D], devices[d])
            per_device.append(grad_fn(local, xd, yd))
        kv.push(keys, [[g[k] for g in per_device] for k in keys])
        kv.pull(keys, out=[[outs[d][k] for d in range(D)] for k in keys])

    xs, ys = data()
    # Warm-up: the first push lays the keys out and makes the optimizer state; the outs its
    # pull fills are made when first read, by the second step (one computation, compiled
    # then: the views of the buckets).
    for x, y in zip(xs[:2], ys[:2]):
        step(x, y)
    with compiles() as c:
        for x, y in zip(xs[2:], ys[2:]):
            step(x, y)
    assert c.count == 0
    assert_matches(dict(zip(keys, kv.pull(keys))), reference)
    for d in range(D):  # every device holds the same parameters, on itself
        assert outs[d]["w1"].context == jaxkv.cpu(d)
        np.testing.assert_array_equal(outs[d]["w1"].asnumpy(), outs[0]["w1"].asnumpy())
