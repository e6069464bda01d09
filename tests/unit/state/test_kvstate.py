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


def test_a_flat_state_read_key_by_key_makes_few_views_then_all_once(monkeypatch):
    """KVState.values_at: the first read of a few keys of a flat state of many keys makes
    their values alone; a second read makes every view once (kept with the state): keys read
    one at a time cost two computations a state, not one a key nor every view at each read.
    A key kept as an array of its own is that array, with no view made. The values are the
    state's. A store of few keys makes every view at its first read."""
    from jaxkv._src.state import buckets

    values = {f"k{i:02d}": jnp.full((3, 2), float(i)) for i in range(70)}  # (FEW_VIEWS_FROM)
    values["big"] = jnp.arange(5000.0)  # (auto: an array of its own on CPU)
    state = jaxkv.init(jaxkv.empty(jax.devices("cpu")[:1], layout="auto"), values)
    assert state.flat_layout is not None
    made = []
    real_all, real_few = buckets.eager_values, buckets.eager_values_at
    monkeypatch.setattr(buckets, "eager_values", lambda *a: made.append("all") or real_all(*a))
    monkeypatch.setattr(buckets, "eager_values_at", lambda *a: made.append("few") or real_few(*a))
    keys = state.keys()
    big = state["big"]
    assert made == [] and big is state.leaves[-1]
    for k in ["k03", "k05", "k07", "big"]:
        (got,) = state.values_at([keys.index(k)])
        assert got.tolist() == values[k].tolist()
    assert made == ["few", "all"]
    small = jaxkv.init(jaxkv.empty(jax.devices("cpu")[:1], layout="flat"), {"a": jnp.ones(3)})
    made.clear()
    small.values_at([0])  # (a store of few keys: every view at once, one compile a layout)
    assert made == ["all"]
