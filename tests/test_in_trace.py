"""optax on the pushed tree, and sharded values inside the user's ``jit`` + ``shard_map`` step.

Every result is compared with plain optax on one device (or with the sum it must equal), so a
gradient summed twice, a norm taken per key or per block, or a lost layout fails here.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _devices import SPLIT_BOUND, cpu_empty, cpu_store, held_per_device, split_buckets
from _variants import rotating
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxkv

D = 8
AXIS = "kv"  # the store's own mesh axis: state.mesh
CLIP_ADAM = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.01))
OPTIMIZERS = {
    "sgd+momentum": optax.sgd(0.05, momentum=0.9),
    "adam": optax.adam(0.01),
    "clip+adam": CLIP_ADAM,
    "lamb": optax.lamb(0.01),  # a trust ratio: norms of each key's value and update
}


def assert_trees_close(a, b, tol=1e-6):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


# -- optax on the tree of pushed keys ----------------------------------------------------------


def test_clip_by_global_norm_takes_the_norm_over_every_pushed_key(call):
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
    params = {"a": jnp.ones(3), "b": 2 * jnp.ones(4)}
    grads = {"a": 3 * jnp.ones(3), "b": 4 * jnp.ones(4)}
    s = jaxkv.init(cpu_empty(), params)
    s = call(lambda s, g: jaxkv.push(s, g, updater=opt), s, grads)
    updates, _ = opt.update(grads, opt.init(params), params)
    expected = optax.apply_updates(params, updates)
    np.testing.assert_allclose(s["a"], expected["a"], rtol=1e-6)
    np.testing.assert_allclose(s["b"], expected["b"], rtol=1e-6)
    np.testing.assert_allclose(s["a"][0], 0.6855, atol=1e-4)  # not 0.4226: each key's own norm
    np.testing.assert_allclose(s["b"][0], 1.5807, atol=1e-4)


@pytest.mark.standard_promotion  # Adam
def test_multi_transform_with_labels_from_the_tree_matches_optax(call):
    opt = optax.multi_transform(
        {"fast": optax.adam(0.1), "slow": optax.sgd(0.01)},
        lambda tree: {k: "fast" if k.startswith("w") else "slow" for k in tree},
    )
    params = {"w1": jnp.arange(4.0), "w2": jnp.ones((2, 2)), "b": jnp.zeros(3)}
    s = jaxkv.init_optimizer(jaxkv.init(cpu_empty(), params), opt)
    opt_state = opt.init(params)
    for step in range(3):
        grads = {
            "w1": jnp.arange(4.0) - step,
            "w2": jnp.full((2, 2), 0.5 * step - 1),
            "b": jnp.ones(3) * (step + 1),
        }
        s = call(lambda s, g: jaxkv.push(s, g, updater=opt), s, grads)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        assert_trees_close(dict(s.values), params)
        assert_trees_close(s.opt_states[("b", "w1", "w2")], opt_state)


def _refused(s, keys, match):
    before = jax.tree_util.tree_leaves(s)
    with pytest.raises(jaxkv.KVStoreError, match=match):
        jaxkv.push(s, keys, [jnp.ones(3)] * len(keys), updater=CLIP_ADAM)
    for x, y in zip(jax.tree_util.tree_leaves(s), before, strict=True):
        assert x is y


@pytest.mark.standard_promotion  # Adam
def test_a_push_must_be_exactly_one_optimizer_group():
    s = jaxkv.init(cpu_empty(), {k: jnp.ones(3) for k in "abcd"})
    s = jaxkv.push(s, ["a", "b"], [jnp.ones(3)] * 2, updater=CLIP_ADAM)  # makes group (a, b)
    s = jaxkv.push(s, ["c"], [jnp.ones(3)], updater=CLIP_ADAM)  # and group (c,)
    assert list(s.opt_states) == [("a", "b"), ("c",)]
    assert s.opt_group("b") == ("a", "b") and s.opt_group("d") is None
    _refused(s, ["a"], r"group \['a', 'b'\].*the group also holds \['b'\]")
    _refused(s, ["a", "b", "c"], r"span the groups \['a', 'b'\], \['c'\]")
    _refused(s, ["c", "d"], r"keys \['d'\] have no optimizer state yet")
    s = jaxkv.push(s, ["b", "a"], [jnp.ones(3)] * 2, updater=CLIP_ADAM)  # any order
    assert int(s.opt_states[("a", "b")][1][0].count) == 2


def test_init_optimizer_makes_one_group_and_refuses_to_split_one(call):
    s = jaxkv.init(cpu_empty(), {k: jnp.ones(3) for k in "abc"})
    s = call(lambda s: jaxkv.init_optimizer(s, CLIP_ADAM, keys=["a", "b"]), s)
    assert list(s.opt_states) == [("a", "b")]
    with pytest.raises(jaxkv.KVStoreError, match=r"group \['a', 'b'\].*without \['b'\]"):
        jaxkv.init_optimizer(s, CLIP_ADAM, keys=["a", "c"])
    s = jaxkv.init_optimizer(s, CLIP_ADAM)  # every key: the group inside is replaced
    assert list(s.opt_states) == [("a", "b", "c")]
    with pytest.raises(jaxkv.KVStoreError, match="optax.GradientTransformation"):
        jaxkv.init_optimizer(s, lambda k, g, w: w)
    fresh = jaxkv.init(cpu_empty(), {k: jnp.ones(3) for k in "ab"})
    repeated = call(lambda s: jaxkv.init_optimizer(s, CLIP_ADAM, keys=["b", "b"]), fresh)
    assert list(repeated.opt_states) == [("b",)]


def test_kvstore_pushing_key_by_key_is_mxnet_and_a_list_is_optax_on_the_list():
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
    params = {0: jnp.ones(3), 1: 2 * jnp.ones(4)}
    grads = {0: 3 * jnp.ones(3), 1: 4 * jnp.ones(4)}
    by_key, by_list = cpu_store("local"), cpu_store("local")
    for kv in (by_key, by_list):
        kv.init(list(params), list(params.values()))
        kv.set_optimizer(opt)
    for k in params:
        by_key.push(k, grads[k])
    by_list.push(list(grads), list(grads.values()))
    for k in params:  # each key its own tree, as MXNet's optimizers update key by key
        updates, _ = opt.update(grads[k], opt.init(params[k]), params[k])
        np.testing.assert_allclose(by_key.pull(k), params[k] + updates, rtol=1e-6)
    updates, _ = opt.update(grads, opt.init(params), params)
    for k in params:
        np.testing.assert_allclose(by_list.pull(k), params[k] + updates[k], rtol=1e-6)
    with pytest.raises(jaxkv.KVStoreError, match="one optimizer group"):
        by_list.push(0, grads[0])


# -- sharded values inside jit + shard_map ---------------------------------------------------

# A two-layer MLP whose weights are stored sharded (>= the big-array bound, rows divisible by
# 8) and whose biases are replicated.
rng = np.random.default_rng(0)
PARAMS = {
    "w1": (rng.normal(size=(64, 512)) * 0.1).astype(np.float32),
    "b1": np.zeros(512, np.float32),
    "w2": (rng.normal(size=(512, 64)) * 0.1).astype(np.float32),
    "b2": np.zeros(64, np.float32),
}
X = rng.normal(size=(32, 64)).astype(np.float32)
Y = rng.normal(size=(32, 64)).astype(np.float32)
STEPS = 4


def loss(params, x, y):
    """Summed squared error over this device's examples, divided by the whole batch: the sum
    over devices is the mean over the batch."""
    out = jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]
    return jnp.sum((out - y) ** 2) / X.shape[0]


def reference(opt, steps=STEPS):
    params = {k: jnp.asarray(v) for k, v in PARAMS.items()}
    opt_state = opt.init(params)
    for _ in range(steps):
        updates, opt_state = opt.update(jax.grad(loss)(params, X, Y), opt_state, params)
        params = optax.apply_updates(params, updates)
    return params, opt_state


def train_step(opt, form):
    def step(state, x, y):
        keys = list(state.keys())
        if form == "whole":  # grad w.r.t. the pulled whole values: per-device, whole shape
            params = dict(zip(keys, jaxkv.pull(state, keys, axis_name=AXIS)))
            grads = jax.grad(loss)(params, x, y)
        else:  # grad through the gather: AD reduce-scatters, shard-shaped and summed
            grads = jax.grad(lambda local: loss(jaxkv.gather(state, local, AXIS), x, y))(
                dict(state.values)
            )
        return jaxkv.push(state, grads, updater=opt, axis_name=AXIS)

    return step


def sharded_run(opt, form, compiles):
    state = jaxkv.init_optimizer(jaxkv.init(cpu_empty(bigarray_bound=SPLIT_BOUND), PARAMS), opt)
    specs = jaxkv.specs(state, AXIS)
    step = jax.jit(
        jax.shard_map(
            train_step(opt, form),
            mesh=state.mesh,
            in_specs=(specs, P(AXIS), P(AXIS)),
            out_specs=specs,
        ),
        donate_argnums=0,
    )
    data = NamedSharding(state.mesh, P(AXIS))
    x, y = jax.device_put(X, data), jax.device_put(Y, data)
    state = step(state, x, y)
    with compiles() as counted:
        for _ in range(STEPS - 1):
            state = step(state, x, y)
    return state, counted.count


def device_bytes(leaf, device):
    return sum(s.data.nbytes for s in leaf.addressable_shards if s.device == device)


@pytest.mark.standard_promotion  # Adam
# make test: each optimizer once, the forms taking turns; every pair in make test-deep.
@pytest.mark.parametrize(("name", "form"), rotating(list(OPTIMIZERS), ["whole", "shard"]))
def test_data_parallel_training_with_a_sharded_store_matches_optax(name, form, compiles, devices):
    opt = OPTIMIZERS[name]
    state, count = sharded_run(opt, form, compiles)
    assert count == 0  # one compilation, at the first step
    params, opt_state = reference(opt)
    assert_trees_close(dict(state.values), params, tol=1e-5)
    assert_trees_close(list(state.opt_states.values())[0], opt_state, tol=1e-5)
    # The layout it came in with: weights and their moments 1/D per device, biases whole;
    # under the flat layout the group's bucket is split, and with it the biases and every
    # moment (their buckets).
    split = split_buckets(state)
    for key in ("w1", "w2", "b1", "b2"):
        whole = key in ("b1", "b2") and not split
        per_device = state[key].nbytes if whole else state[key].nbytes // D
        assert held_per_device(state, key)[devices[0]] == per_device
    if split:
        (packed,) = state.group_states
        moments = [x for x in jax.tree_util.tree_leaves(packed) if x.ndim == 1 and x.size > 1]
        assert moments and all(device_bytes(x, devices[0]) == x.nbytes // D for x in moments)
        return
    for leaf in jax.tree_util.tree_leaves(list(state.opt_states.values())):
        per_device = leaf.nbytes // D if leaf.shape in {(64, 512), (512, 64)} else leaf.nbytes
        assert device_bytes(leaf, devices[0]) == per_device


def test_specs_split_big_values_and_their_moments_and_replicate_the_rest():
    state = jaxkv.init_optimizer(
        jaxkv.init(cpu_empty(bigarray_bound=SPLIT_BOUND), PARAMS), optax.adam(0.1)
    )
    specs = jaxkv.specs(state, "d")
    bias = P("d") if split_buckets(state) else P()  # flat: in the group's split bucket
    assert specs.values == {"b1": bias, "b2": bias, "w1": P("d"), "w2": P("d")}
    ((adam, _),) = specs.opt_states.values()
    assert adam.count == P() and adam.mu == {"b1": bias, "b2": bias, "w1": P("d"), "w2": P("d")}
    assert jax.tree_util.tree_structure(specs) == jax.tree_util.tree_structure(state)


def in_store_mesh(state, fn, in_specs, out_specs):
    return jax.jit(jax.shard_map(fn, mesh=state.mesh, in_specs=in_specs, out_specs=out_specs))


def per_device_grads():
    """Device d's gradient data for a (64, 512) key, and their sum."""
    g = np.stack([np.full((64, 512), d + 1, np.float32) * np.arange(512) for d in range(D)])
    return g.reshape(D * 64, 512), g.sum(0)


def test_a_gradient_reduce_scattered_by_ad_is_not_summed_again():
    """The first bug of issue 9: grad through the all-gather of the pulled shard, pushed with
    axis_name, was summed a second time (off by up to 0.196, silently)."""
    state = jaxkv.init(cpu_empty(bigarray_bound=SPLIT_BOUND), {"w": jnp.zeros((64, 512))})
    specs = jaxkv.specs(state, AXIS)
    data, total = per_device_grads()

    def step(state, g):
        grads = jax.grad(lambda local: jnp.vdot(jaxkv.gather(state, local, AXIS)["w"], g))(
            dict(state.values)
        )
        assert grads["w"].shape == (64 // D, 512)  # shard-shaped, already summed by AD
        return jaxkv.push(state, grads, axis_name=AXIS)

    data = jax.device_put(data, NamedSharding(state.mesh, P(AXIS)))
    new = in_store_mesh(state, step, (specs, P(AXIS)), specs)(state, data)
    np.testing.assert_array_equal(np.asarray(new["w"]), total)
    assert new["w"].sharding.spec == P(AXIS)


@pytest.mark.parametrize("invariant", [False, True])
def test_a_whole_shape_value_is_reduce_scattered_once(invariant):
    state = jaxkv.init(cpu_empty(bigarray_bound=SPLIT_BOUND), {"w": jnp.zeros((64, 512))})
    specs = jaxkv.specs(state, AXIS)
    data, total = per_device_grads()
    ones = jnp.ones((64, 512))

    def step(state, g):
        # Per device, whole shape: varying (to be summed), or the same everywhere (summed).
        value = ones if invariant else g.reshape(64, 512)
        return jaxkv.push(state, "w", value, axis_name=AXIS)

    data = jax.device_put(data, NamedSharding(state.mesh, P(AXIS)))
    new = in_store_mesh(state, step, (specs, P(AXIS)), specs)(state, data)
    np.testing.assert_array_equal(np.asarray(new["w"]), ones if invariant else total)


def _normalise(key, pushed, stored):
    return stored - pushed / jnp.sqrt(jnp.sum(pushed * pushed))  # a reduction over the rows


def _scale(key, pushed, stored):
    return stored * 0.5 - pushed  # elementwise


def _reverse(key, pushed, stored):
    return stored - pushed[::-1]  # moves rows: no block holds its own result


def pushed_through(updater, start):
    """A step pushing each device's gradient data to a sharded key "w" holding ``start`` with
    ``updater``; returns the jitted step, the state, the data and what "w" must then hold."""
    state = jaxkv.init(cpu_empty(bigarray_bound=SPLIT_BOUND), {"w": start})
    specs = jaxkv.specs(state, AXIS)
    data, total = per_device_grads()

    def step(state, g):
        return jaxkv.push(state, "w", g.reshape(64, 512), updater=updater, axis_name=AXIS)

    data = jax.device_put(data, NamedSharding(state.mesh, P(AXIS)))
    fn = in_store_mesh(state, step, (specs, P(AXIS)), specs)
    return fn, state, data, updater("w", total, start)


@pytest.mark.parametrize(
    ("updater", "collective"),
    [(_scale, None), (_normalise, "psum"), (_reverse, "all_gather")],
)
def test_an_updater_gives_on_blocks_what_it_gives_on_the_whole_value(updater, collective):
    start = jnp.arange(64 * 512, dtype=jnp.float32).reshape(64, 512) / 1e4
    fn, state, data, expected = pushed_through(updater, start)
    new = fn(state, data)
    np.testing.assert_allclose(new["w"], expected, rtol=1e-6)
    # Elementwise updaters run on the blocks as they are; reductions over the rows are
    # completed with a collective; anything else runs on the gathered value.
    text = fn.lower(state, data).as_text()
    for name, op in [("psum", "all_reduce"), ("all_gather", "all_gather")]:
        assert (f"stablehlo.{op}" in text) == (name == collective), name


def test_pull_inside_the_step_gathers_or_gives_the_block():
    value = jnp.arange(64 * 512, dtype=jnp.float32).reshape(64, 512)
    state = jaxkv.init(cpu_empty(bigarray_bound=SPLIT_BOUND), {"w": value, "b": jnp.arange(3.0)})
    specs = jaxkv.specs(state, AXIS)
    # Under the flat layout "b" shares the split bucket: its leaf here is a block as well.
    b_axis = AXIS if split_buckets(state) else None

    def step(state):
        whole = jaxkv.pull(state, "w", axis_name=AXIS)
        block = jaxkv.pull(state, "w", local=True)
        b = jaxkv.pull(state, "b", axis_name=b_axis)
        return whole.sum(axis=0, keepdims=True), block, b[None]  # b: each device's copy

    out = in_store_mesh(state, step, (specs,), (P(AXIS), P(AXIS), P(AXIS)))(state)
    whole, block, b = out
    np.testing.assert_array_equal(np.asarray(whole), np.tile(value.sum(0), (D, 1)))
    np.testing.assert_array_equal(np.asarray(block), value)
    np.testing.assert_array_equal(np.asarray(b), np.tile(np.arange(3.0), (D, 1)))


@pytest.mark.parametrize(
    ("step", "match"),
    [
        (lambda s: jaxkv.pull(s, "w"), r"expected axis_name=.*given none"),
        (lambda s: jaxkv.push(s, "w", jnp.ones((8, 512))), r"expected axis_name=.*given none"),
        (
            lambda s: jaxkv.push(s, "w", jnp.ones((64, 512)), updater=CLIP_ADAM, axis_name=AXIS),
            r"expected optimizer state.*jaxkv.init_optimizer",
        ),
        (lambda s: jaxkv.init_optimizer(s, CLIP_ADAM), "init_optimizer before the step"),
    ],
)
def test_blocks_without_what_they_need_are_refused(step, match):
    state = jaxkv.init(cpu_empty(bigarray_bound=SPLIT_BOUND), {"w": jnp.zeros((64, 512))})
    specs = jaxkv.specs(state, AXIS)
    with pytest.raises(jaxkv.KVStoreError, match=match):
        in_store_mesh(state, lambda s: jax.tree_util.tree_leaves(step(s))[0].sum(), (specs,), P())(
            state
        )


def test_an_optimizer_state_made_for_another_optimizer_is_refused_in_the_step():
    state = jaxkv.init_optimizer(
        jaxkv.init(cpu_empty(bigarray_bound=SPLIT_BOUND), {"w": jnp.zeros((64, 512))}),
        optax.sgd(0.1, momentum=0.9),
    )
    specs = jaxkv.specs(state, AXIS)
    step = functools.partial(jaxkv.push, keys="w", updater=optax.adam(0.1), axis_name=AXIS)
    with pytest.raises(jaxkv.KVStoreError, match="structure this optimizer makes"):
        in_store_mesh(state, lambda s: step(s, values=jnp.ones((8, 512))), (specs,), specs)(state)


def test_pushpull_in_the_step_reduce_scatters_then_gathers():
    state = jaxkv.init(cpu_empty(bigarray_bound=SPLIT_BOUND), {"w": jnp.zeros((64, 512))})
    specs = jaxkv.specs(state, AXIS)
    data, total = per_device_grads()

    def step(state, g):
        state, whole = jaxkv.pushpull(state, "w", g.reshape(64, 512), axis_name=AXIS)
        return state, whole[None]

    data = jax.device_put(data, NamedSharding(state.mesh, P(AXIS)))
    new, whole = in_store_mesh(state, step, (specs, P(AXIS)), (specs, P(AXIS)))(state, data)
    np.testing.assert_array_equal(np.asarray(new["w"]), total)
    np.testing.assert_array_equal(np.asarray(whole), np.broadcast_to(total, (D, 64, 512)))


def _by_size(key, pushed, stored):
    return stored - pushed / pushed.size  # the block's size would be 1/D of the value's


def _by_count(key, pushed, stored):
    return stored - pushed / jnp.sum(jnp.ones_like(stored))  # a reduction of a broadcast


@pytest.mark.parametrize("updater", [_by_size, _by_count])
def test_an_updater_that_depends_on_the_number_of_rows_sees_the_whole_value(updater):
    fn, state, data, expected = pushed_through(updater, jnp.ones((64, 512)))
    np.testing.assert_allclose(fn(state, data)["w"], expected, rtol=1e-6)
