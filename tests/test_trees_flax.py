"""Trees of flax models as keys (jaxkv/_src/core/trees.py): a linen ``params`` dict and an nnx
``State`` in, the same tree out, equal to optax on the tree. flax is the ``examples`` extra
(``make test`` installs it; it needs JAX 0.10 or newer, so the oldest JAX's suite skips this)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxkv

flax = pytest.importorskip("flax", reason="flax (the examples extra) is not installed")


@pytest.mark.standard_promotion
def test_a_flax_linen_params_dict():
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(nn.relu(nn.Dense(8)(x)))

    model = MLP()
    params = model.init(jax.random.key(0), jnp.ones((1, 3)))
    x, y = jnp.ones((4, 3)), jnp.zeros((4, 2))
    tx = optax.adam(0.01)
    grad = jax.grad(lambda p: jnp.mean((model.apply(p, x) - y) ** 2))
    state = jaxkv.init(jaxkv.empty(), params)
    ref, opt = params, tx.init(params)
    for _ in range(3):
        p = jaxkv.pull(state, params)
        state = jaxkv.push(state, grad(p), updater=tx)
        updates, opt = tx.update(grad(ref), opt, ref)
        ref = optax.apply_updates(ref, updates)
    got = jaxkv.pull(state, params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), got, ref)


def test_an_nnx_state():
    from flax import nnx

    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    state = jaxkv.init(jaxkv.empty(), params)
    assert state.keys() == ("bias/value", "kernel/value")
    grads = jax.tree.map(jnp.ones_like, params)
    state = jaxkv.push(state, grads, updater=optax.sgd(0.5))
    got = jaxkv.pull(state, params)
    assert type(got) is type(params)
    nnx.update(model, got)
    np.testing.assert_allclose(model.bias[...], [-0.5, -0.5])
