"""jaxkv/_src/state/kvstate.py: where a value of each size is stored; its mappings as pytrees."""

import jax
import jax.numpy as jnp
import pytest

import jaxkv


@pytest.mark.parametrize(
    ("shape", "bound", "sharded"),
    [
        ((8, 2), 16, True),  # exactly the big-array bound: split across the devices (MXNet's)
        ((8, 2), 17, False),  # one element below it: whole on every device
        ((8, 3), 16, True),
        ((6, 4), 16, False),  # rows not a multiple of the devices: whole
        ((), 1, False),  # a scalar is never split
    ],
)
def test_a_value_of_at_least_the_bound_is_sharded(shape, bound, sharded):
    state = jaxkv.empty(jax.devices("cpu")[:4], bigarray_bound=bound, layout="keys")
    assert state.is_sharded(shape) is sharded


def test_one_device_or_no_bound_shards_nothing():
    one = jaxkv.empty(jax.devices("cpu")[:1], bigarray_bound=1, layout="keys")
    none = jaxkv.empty(jax.devices("cpu")[:4], bigarray_bound=None, layout="keys")
    assert not one.is_sharded((8, 2)) and not none.is_sharded((8, 2))


def test_values_opt_states_and_residuals_are_pytrees_of_the_stored_arrays():
    """jax.tree.leaves / jax.tree.map work on state.values and state.opt_states (a byte count
    of the store is not silently 0), and they stay read-only."""
    import optax

    state = jaxkv.init(jaxkv.empty(), {"a": jnp.ones(3), "b": jnp.zeros((2, 2))})
    assert sum(x.nbytes for x in jax.tree.leaves(state.values)) == 28
    shapes = jax.tree.map(lambda x: x.shape, state.values)
    assert dict(shapes) == {"a": (3,), "b": (2, 2)}
    state = jaxkv.init_optimizer(state, optax.adam(0.1))
    leaves = jax.tree.leaves(state.opt_states)
    assert leaves and all(isinstance(x, jax.Array) for x in leaves)
    assert sum(x.nbytes for x in leaves) >= 2 * 28  # Adam's two moments, and its count
    with pytest.raises(TypeError):
        state.values["a"] = jnp.zeros(3)  # type: ignore[index]
    paths = [
        jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state.values)[0]
    ]
    assert paths == ["['a']", "['b']"]
