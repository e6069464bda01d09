"""Pushes inside the caller's jit where only part of the call is traced (the state closed over, or
constant values pushed to a traced state), and the operations' calling conventions."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _devices import cpu_empty

import jaxkv


@pytest.fixture
def state():
    return jaxkv.init(cpu_empty(), {"w": jnp.arange(3.0), "b": jnp.zeros(())})


def test_a_closed_over_state_takes_traced_values(state):
    step = jax.jit(lambda g: jaxkv.pull(jaxkv.push(state, "w", [g, 2 * g]), "w"))
    np.testing.assert_array_equal(step(jnp.ones(3)), [3.0, 3.0, 3.0])
    add = jax.jit(lambda g: jaxkv.push(state, "w", g, updater=lambda k, p, s: s + p)["w"])
    np.testing.assert_array_equal(add(jnp.ones(3)), [1.0, 2.0, 3.0])


def test_a_traced_state_takes_constant_values(state):
    const = np.array([5.0, 6.0, 7.0], np.float32)
    step = jax.jit(lambda s: jaxkv.push(s, ["w", "b"], [[const, const], np.float32(2)]))
    new = step(state)
    np.testing.assert_array_equal(np.asarray(new["w"]), 2 * const)
    assert float(new["b"]) == 2.0


def test_an_optimizer_push_inside_jit_starts_its_state_there(state):
    sgd = optax.sgd(1.0, momentum=0.5)
    step = jax.jit(lambda s, g: jaxkv.push(s, "w", g, updater=sgd))
    once = step(state, jnp.ones(3))
    np.testing.assert_array_equal(np.asarray(once["w"]), [-1.0, 0.0, 1.0])
    twice = step(once, jnp.ones(3))  # momentum: 1 + 0.5
    np.testing.assert_array_equal(np.asarray(twice["w"]), [-2.5, -1.5, -0.5])
    assert once.opt_group("b") is None


def test_push_takes_the_store_keys_and_values_by_name_and_the_rest_only_by_name(state):
    new = jaxkv.push(state=state, keys="w", values=jnp.ones(3))
    np.testing.assert_array_equal(np.asarray(new["w"]), [1.0, 1.0, 1.0])
    with pytest.raises(TypeError):
        jaxkv.push(state, "w", jnp.ones(3), None)  # updater is keyword-only
    with pytest.raises(TypeError):
        jaxkv.pull(state, "w", jax.devices("cpu")[0])  # so are devices
    with pytest.raises(TypeError):
        jaxkv.row_sparse_pull(state, "w", [0], jax.devices("cpu")[0])
    pulled = jaxkv.pull(state=state, keys="w")
    np.testing.assert_array_equal(np.asarray(pulled), [0.0, 1.0, 2.0])
