"""The imperative store takes trees (issue 39): ``kv.init(params)``, ``kv.push(grads)``,
``kv.pull(params)``, ``kv.pushpull(grads)`` with a flax-style tree, each leaf a key named by its
path as in the functional calls, under optax; a store holds trees or plain keys, not both."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxkv
import jaxkv.nd as nd

PARAMS = {
    "params": {
        "Dense_0": {"kernel": jnp.ones((4, 3)), "bias": jnp.zeros(3)},
        "Dense_1": {"kernel": jnp.full((3, 2), 2.0), "bias": jnp.zeros(2)},
    }
}


def _grads(step):
    return jax.tree.map(lambda x: jnp.full(x.shape, 0.1 * (step + 1), x.dtype), PARAMS)


def _same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", ["local", "device"])
def test_a_tree_trains_as_the_functional_calls(kind):
    tx = optax.sgd(0.1, momentum=0.9)
    kv = jaxkv.KVStore(kind)
    kv.init(PARAMS)
    kv.set_optimizer(tx)
    state = jaxkv.init_optimizer(jaxkv.init(jaxkv.empty(), PARAMS), tx)
    for step in range(3):
        kv.push(_grads(step))
        state = jaxkv.push(state, _grads(step), updater=tx)
        _same(kv.pull(PARAMS), jaxkv.pull(state, PARAMS))
    got = kv.pushpull(_grads(3))
    state, want = jaxkv.pushpull(state, _grads(3), updater=tx)
    _same(got, want)
    assert sorted(kv.state.keys()) == sorted(
        [
            "params/Dense_0/kernel",
            "params/Dense_0/bias",
            "params/Dense_1/kernel",
            "params/Dense_1/bias",
        ]
    )
    leaf = kv.pull("params/Dense_1/kernel")  # a leaf by its path, as a key
    np.testing.assert_allclose(np.asarray(leaf), np.asarray(want["params"]["Dense_1"]["kernel"]))


def test_ndarray_leaves_and_a_flat_mapping():
    kv = jaxkv.KVStore("local")
    kv.init({"w": {"a": nd.ones((2,)), "b": nd.zeros((2,))}})
    kv.push({"w": {"a": nd.ones((2,)), "b": nd.ones((2,))}})  # no updater: assigned
    got = kv.pull({"w": {"a": nd.zeros((2,)), "b": nd.zeros((2,))}})  # (leaves not read)
    np.testing.assert_array_equal(np.asarray(got["w"]["b"]), [1.0, 1.0])
    flat = jaxkv.KVStore("local")
    flat.init({"x": jnp.ones(2), "y": jnp.zeros(3)})  # a flat mapping: plain keys
    flat.push({"x": jnp.full(2, 3.0), "y": jnp.ones(3)})
    got = flat.pull({"x": 0, "y": 0})
    np.testing.assert_array_equal(np.asarray(got["x"]), [3.0, 3.0])


def test_mixing_trees_and_plain_keys_is_refused_at_once_and_changes_nothing():
    kv = jaxkv.KVStore("local")
    kv.init(PARAMS)
    with pytest.raises(jaxkv.KVStoreError, match="expected a tree"):
        kv.init("plain", nd.ones((2,)))
    assert "plain" not in kv.state
    plain = jaxkv.KVStore("local")
    plain.init("a", nd.ones((2,)))
    with pytest.raises(jaxkv.KVStoreError, match="expected a store of trees"):
        plain.push(_grads(0))
    with pytest.raises(jaxkv.KVStoreError, match="expected a store of trees"):
        plain.init(PARAMS)
    np.testing.assert_array_equal(np.asarray(plain.pull("a")), [1.0, 1.0])


def test_a_tree_of_other_paths_is_refused_naming_the_path():
    kv = jaxkv.KVStore("local")
    kv.init(PARAMS)
    kv.set_optimizer(optax.sgd(0.1))
    before = kv.pull(PARAMS)
    wrong = {"params": {"Dense_0": {"kernel": jnp.ones((4, 3))}}}
    with pytest.raises(jaxkv.KVStoreError, match="no leaf at path 'params/Dense_0/bias'"):
        kv.push(wrong)
    with pytest.raises(jaxkv.KVStoreError, match="no leaf at path"):
        kv.pull(wrong)
    _same(kv.pull(PARAMS), before)
    with pytest.raises(jaxkv.KVStoreError, match="expected a value for the key"):
        kv.push("params/Dense_0/bias")


def test_a_pushpull_of_a_flat_mapping_gives_its_values_as_a_mapping():
    kv = jaxkv.KVStore("local")
    kv.init({"x": jnp.ones(2), "y": jnp.zeros(3)})
    got = kv.pushpull({"x": jnp.full(2, 3.0), "y": jnp.ones(3)})
    assert set(got) == {"x", "y"}
    np.testing.assert_array_equal(np.asarray(got["x"]), [3.0, 3.0])
    np.testing.assert_array_equal(np.asarray(got["y"]), [1.0, 1.0, 1.0])
