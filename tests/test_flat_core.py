"""The flat layout's bookkeeping (``jaxkv/_src/state/buckets.py``) against a plain model: buckets
per dtype and optimizer group, views, in-place writes, and optimizer states packed by family; a
jitted training step kept flat gives the per-key step's numbers (to XLA's rounding: the two programs
fuse differently)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxkv._src.state import buckets as _flat

SHAPES = [(3,), (2, 2), (), (4, 1, 2), (5,)]
DTYPES = [np.float32, np.float32, np.float32, np.int32, np.float32]
KEYS = ["a", "b", "c", "d", "e"]


def _values(seed=0):
    rng = np.random.default_rng(seed)
    return [
        (rng.normal(size=s) * 10).astype(t) if t != np.int32 else rng.integers(-9, 9, s, t)
        for s, t in zip(SHAPES, DTYPES)
    ]


def test_keys_share_a_bucket_by_dtype_and_optimizer_group():
    layout = _flat.plan(KEYS, SHAPES, DTYPES, groups=[("b", "e")])
    buckets = [layout.where[i][0] for i in range(len(KEYS))]
    assert buckets[0] == buckets[2] != buckets[1] == buckets[4] != buckets[3]
    assert layout.buckets[buckets[0]] == ("float32", 3 + 1)
    assert layout.buckets[buckets[1]] == ("float32", 4 + 5)
    assert layout.buckets[buckets[3]] == ("int32", 8)
    assert layout.where[4] == (buckets[1], 4, 5)


@pytest.mark.parametrize("groups", [(), [("a", "b", "c", "d", "e")], [("a",), ("c", "e")]])
def test_views_of_packed_values_are_the_values_and_writes_land_in_place(groups):
    layout = _flat.plan(KEYS, SHAPES, DTYPES, groups)
    values = _values()
    buckets = jax.jit(lambda v: _flat.pack(layout, v))(values)
    assert [(str(b.dtype), b.size) for b in buckets] == list(layout.buckets)
    for got, want in zip(_flat.views(layout, buckets), values):
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    new = _values(seed=1)
    written = jax.jit(lambda b, v: _flat.write(layout, b, {1: v[1], 3: v[3]}))(buckets, new)
    model = list(values)
    model[1], model[3] = new[1], new[3]
    for got, want in zip(_flat.views(layout, written), model):
        np.testing.assert_array_equal(got, want)


OPTIMIZERS = {
    "adam": optax.adam(0.1),
    "sgd-momentum": optax.sgd(0.1, momentum=0.9),
    "clip-adam": optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1)),
    "lamb": optax.lamb(0.1),
}
FLOAT_KEYS = ["a", "b", "c", "e"]


@pytest.mark.standard_promotion  # optax's Adam
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_states_pack_by_family_and_unpack_to_the_same_tree(name):
    opt = OPTIMIZERS[name]
    shapes = [SHAPES[KEYS.index(k)] for k in FLOAT_KEYS]
    params = {k: jnp.ones(s) * (i + 1) for i, (k, s) in enumerate(zip(FLOAT_KEYS, shapes))}
    state = opt.init(params)
    packing, leaves = _flat.pack_opt(FLOAT_KEYS, shapes, state)
    per_key = sum(len(FLOAT_KEYS) for _ in packing.families)
    assert packing.families and len(leaves) == packing.leaves - per_key + len(packing.families)
    back = _flat.unpack_opt(packing, leaves)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(state)
    for x, y in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(state)):
        np.testing.assert_array_equal(x, y)
    grads = {k: v * 0.5 for k, v in params.items()}
    _, new_state = opt.update(grads, state, params)
    written = _flat.write_opt(packing, leaves, new_state)
    for x, y in zip(
        jax.tree_util.tree_leaves(_flat.unpack_opt(packing, written)),
        jax.tree_util.tree_leaves(new_state),
    ):
        np.testing.assert_array_equal(x, y)


@pytest.mark.standard_promotion  # optax's Adam
@pytest.mark.parametrize("name", ["adam", "sgd-momentum", "lamb"])
def test_a_flat_training_step_gives_the_per_key_steps_numbers(name):
    opt = OPTIMIZERS[name]
    shapes = [SHAPES[KEYS.index(k)] for k in FLOAT_KEYS]
    rng = np.random.default_rng(2)
    params = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in zip(FLOAT_KEYS, shapes)}
    layout = _flat.plan(FLOAT_KEYS, shapes, [np.float32] * 4, groups=[tuple(FLOAT_KEYS)])

    def loss(p, x):
        return sum(jnp.sum(jnp.sin(v) * v) for v in p.values()) * x

    @jax.jit
    def per_key(p, s, x):
        u, s = opt.update(jax.grad(loss)(p, x), s, p)
        return optax.apply_updates(p, u), s

    packing, _ = _flat.pack_opt(FLOAT_KEYS, shapes, opt.init(params))

    @jax.jit
    def flat(buckets, leaves, x):
        p = dict(zip(FLOAT_KEYS, _flat.views(layout, buckets)))
        s = _flat.unpack_opt(packing, leaves)
        u, s = opt.update(jax.grad(loss)(p, x), s, p)
        new = optax.apply_updates(p, u)
        written = _flat.write(layout, buckets, {i: new[k] for i, k in enumerate(FLOAT_KEYS)})
        return written, _flat.write_opt(packing, leaves, s)

    flat = jax.jit(flat.__wrapped__, donate_argnums=(0, 1))
    p, s = params, opt.init(params)
    b = _flat.pack(layout, [params[k] for k in FLOAT_KEYS])
    leaves = _flat.pack_opt(FLOAT_KEYS, shapes, opt.init(params))[1]
    for step in range(3):
        x = jnp.float32(1.0 + step)
        p, s = per_key(p, s, x)
        b, leaves = flat(b, leaves, x)
    for k, v in zip(FLOAT_KEYS, _flat.views(layout, b)):
        np.testing.assert_allclose(v, p[k], rtol=1e-6, atol=1e-7)
    for x, y in zip(
        jax.tree_util.tree_leaves(_flat.unpack_opt(packing, leaves)), jax.tree_util.tree_leaves(s)
    ):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
