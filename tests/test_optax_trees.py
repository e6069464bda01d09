"""optax sees the user's tree (jaxkv/_src/core/tree_view.py): a push with an optax updater hands
it the tree the store was initialised with, whatever form the push took, so masks and labels by
path give optax-on-one-device's numbers, eagerly, in ``jit`` and in ``shard_map``, in every
layout; a store of plain keys hands a mapping of its keys."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _variants import covering
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxkv
from jaxkv._src.core import tree_view

STEPS = 2


def _params():
    rng = np.random.default_rng(0)
    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    return {
        "params": {
            "dense": {"kernel": f(64, 16), "bias": f(16)},
            "head": {"kernel": f(16, 4), "bias": f(4)},
            "norm": {"scale": f(16)},
        }
    }


def _grads(step):
    rng = np.random.default_rng(10 + step)
    return jax.tree.map(
        lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32) * 0.5, _params()
    )


def _no_decay_on_bias(params):
    """A weight-decay mask written the usual way: a function of the flax paths."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: path[-1].key not in ("bias", "scale"), params
    )


def _labels(params):
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "frozen" if path[1].key == "norm" else "trained", params
    )


UPDATERS = {
    "adamw-mask-by-path": lambda: optax.adamw(0.1, weight_decay=0.5, mask=_no_decay_on_bias),
    "masked-tree": lambda: optax.chain(
        optax.masked(optax.add_decayed_weights(0.5), _no_decay_on_bias(_params())),
        optax.sgd(0.1),
    ),
    "multi-transform": lambda: optax.multi_transform(
        {"trained": optax.adam(0.1), "frozen": optax.set_to_zero()}, _labels
    ),
    "clip-and-mask": lambda: optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(0.05, weight_decay=0.3, mask=_no_decay_on_bias),
    ),
}


def _optax_on_one_device(tx, steps=STEPS):
    params, opt = _params(), tx.init(_params())
    for step in range(steps):
        updates, opt = tx.update(_grads(step), opt, params)
        params = optax.apply_updates(params, updates)
    return params


def _close(got, want, atol=1e-6):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=atol), got, want)


def _as(form, state, grads):
    """The gradients in the form a user pushes them: the tree, a flat mapping of its keys, or
    the gradients of ``dict(state.values)`` (keys named by path)."""
    if form == "tree":
        return grads
    flat = {
        jax.tree_util.keystr(p, simple=True, separator="/"): x
        for p, x in jax.tree_util.tree_flatten_with_path(grads)[0]
    }
    if form == "flat":
        return flat
    return jax.grad(lambda v: sum(jnp.vdot(v[k], flat[k]) for k in v))(dict(state.values))


# Every pair of (updater, layout, devices) in make test; the rest in make test-deep.
@pytest.mark.standard_promotion
@pytest.mark.parametrize(
    ("name", "layout", "n"), covering(sorted(UPDATERS), ["keys", "flat"], [1, 8])
)
def test_a_mask_by_path_gives_optaxs_numbers(devices, name, layout, n):
    tx = UPDATERS[name]()
    state = jaxkv.init(jaxkv.empty(devices[:n], layout=layout), _params())
    for step in range(STEPS):
        state = jaxkv.push(state, _grads(step), updater=tx)
    _close(jaxkv.pull(state, _params()), _optax_on_one_device(tx))


@pytest.mark.standard_promotion
@pytest.mark.parametrize("form", ["tree", "flat", "grad-of-values"])
@pytest.mark.parametrize("layout", ["keys", "flat"])
def test_every_form_of_push_hands_optax_the_tree(devices, form, layout, call):
    tx = UPDATERS["adamw-mask-by-path"]()
    state = jaxkv.init_optimizer(jaxkv.init(jaxkv.empty(devices, layout=layout), _params()), tx)
    for step in range(STEPS):
        state = call(lambda s, g: jaxkv.push(s, _as(form, s, g), updater=tx), state, _grads(step))
    _close(jaxkv.pull(state, _params()), _optax_on_one_device(tx))


def _spy():
    """An optax transformation that records the structure of the trees it is handed."""
    seen = []

    def init(params):
        seen.append(("init", jax.tree_util.tree_structure(params)))
        return optax.EmptyState()

    def update(updates, state, params=None):
        seen.append(("update", jax.tree_util.tree_structure(updates)))
        return jax.tree.map(jnp.negative, updates), state

    return optax.GradientTransformation(init, update), seen


@pytest.mark.parametrize("layout", ["keys", "flat"])
def test_the_updater_is_handed_the_tree_given_to_init(devices, layout):
    tx, seen = _spy()
    state = jaxkv.init(jaxkv.empty(devices[:2], layout=layout), _params())
    jaxkv.push(state, _grads(0), updater=tx)
    want = jax.tree_util.tree_structure(_params())
    assert [s for _, s in seen] and all(s == want for _, s in seen), seen


def test_a_store_of_plain_keys_hands_a_mapping_of_its_keys(devices):
    tx, seen = _spy()
    state = jaxkv.init(jaxkv.empty(devices[:2]), {"a": jnp.ones(3), "b": jnp.ones(2)})
    jaxkv.push(state, {"a": jnp.ones(3), "b": jnp.ones(2)}, updater=tx)
    want = jax.tree_util.tree_structure({"a": 0, "b": 0})
    assert [s for _, s in seen] and all(s == want for _, s in seen), seen


def test_a_group_within_a_tree_is_handed_the_tree_with_none_elsewhere(devices):
    tx, seen = _spy()
    state = jaxkv.init(jaxkv.empty(devices[:1]), _params())
    head = ["params/head/bias", "params/head/kernel"]
    state = jaxkv.init_optimizer(state, tx, keys=head)
    jaxkv.push(state, {k: jnp.ones(state[k].shape) for k in head}, updater=tx)
    params = _params()
    params["params"]["dense"] = {"kernel": None, "bias": None}
    params["params"]["norm"] = {"scale": None}
    want = jax.tree_util.tree_structure(params)
    assert [s for _, s in seen] and all(s == want for _, s in seen), seen


@pytest.mark.standard_promotion
def test_the_stored_optimizer_state_stays_keyed_by_path(devices):
    """The store keeps optax's per-key subtrees as ``{key: leaf}`` mappings (what its layouts,
    sharding rules and checkpoints read), while optax is handed the tree."""
    tx = optax.adam(0.1)
    state = jaxkv.init_optimizer(jaxkv.init(jaxkv.empty(devices[:1]), _params()), tx)
    ((group, opt),) = state.opt_states.items()
    assert sorted(opt[0].mu) == sorted(group)
    state = jaxkv.push(state, _grads(0), updater=tx)
    assert sorted(next(iter(state.opt_states.values()))[0].mu) == sorted(group)


def test_state_tree_gives_the_values_as_the_tree(devices):
    state = jaxkv.init(jaxkv.empty(devices[:1]), _params())
    tree = state.tree()
    assert jax.tree_util.tree_structure(tree) == jax.tree_util.tree_structure(_params())
    _close(tree, _params(), atol=0)


@pytest.mark.standard_promotion
def test_a_mask_by_path_in_the_readmes_sharded_step(devices):
    """The README's sharded step, differentiating with respect to the tree (``state.tree()``):
    big values split over the 8 devices, a mask by path, clipping: optax's numbers."""
    tx = UPDATERS["clip-and-mask"]()
    store = jaxkv.empty(devices, bigarray_bound=512)
    state = jaxkv.init_optimizer(jaxkv.init(store, _params()), tx)
    specs = jaxkv.specs(state, "kv")
    assert tuple(specs.values["params/dense/kernel"]) == ("kv",)

    @jax.jit
    @partial(jax.shard_map, mesh=state.mesh, in_specs=(specs, P()), out_specs=specs)
    def step(state, grads):
        def loss(local):
            params = jaxkv.gather(state, local, "kv")
            return sum(jnp.vdot(a, b) for a, b in zip(jax.tree.leaves(params), grads))

        return jaxkv.push(state, jax.grad(loss)(state.tree()), updater=tx, axis_name="kv")

    for s in range(STEPS):
        state = step(state, jax.tree.leaves(_grads(s)))
    _close(jaxkv.pull(state, _params()), _optax_on_one_device(tx))


@pytest.mark.standard_promotion
def test_a_mask_by_path_on_a_data_x_model_mesh_in_plain_jit(devices):
    """The plain-``jit`` recipe: params on NamedShardings over a 2 x 4 mesh, the store's pull and
    push inside ``jax.jit``; a mask by path and clipping give optax's numbers."""
    mesh = Mesh(np.array(devices).reshape(2, 4), ("data", "model"))
    specs = {
        "params": {
            "dense": {"kernel": P(None, "model"), "bias": P("model")},
            "head": {"kernel": P("model", None), "bias": P()},
            "norm": {"scale": P()},
        }
    }
    params = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), _params(), specs)
    tx = UPDATERS["clip-and-mask"]()
    store = jaxkv.empty(mesh=mesh, axis_name="data")
    state = jaxkv.init_optimizer(jaxkv.init(store, params), tx)

    @jax.jit
    def step(state, grads):
        return jaxkv.push(state, grads, updater=tx)

    for s in range(STEPS):
        state = step(state, _grads(s))
    _close(jaxkv.pull(state, _params()), _optax_on_one_device(tx))


def test_the_wrapper_is_the_same_object_for_the_same_updater_and_trees(devices):
    tx = optax.sgd(0.1)
    state = jaxkv.init(jaxkv.empty(devices[:1]), _params())
    assert tree_view.viewed(state, tx) is tree_view.viewed(state, tx)
    assert tree_view.inner(tree_view.viewed(state, tx)) is tx
    plain = jaxkv.init(jaxkv.empty(devices[:1]), {"a": jnp.ones(2)})
    assert tree_view.viewed(plain, tx) is tx


@pytest.mark.standard_promotion
def test_a_push_compiles_once(devices, compiles):
    tx = UPDATERS["adamw-mask-by-path"]()
    state = jaxkv.init_optimizer(jaxkv.init(jaxkv.empty(devices[:1]), _params()), tx)
    state = jaxkv.push(state, _grads(0), updater=tx)
    with compiles() as c:
        for step in range(1, 3):
            state = jaxkv.push(state, _grads(step), updater=tx)
    assert c.count == 0


@pytest.mark.standard_promotion
@pytest.mark.parametrize("layout", ["keys", "flat"])
def test_the_imperative_store_hands_optax_the_tree(devices, layout):
    tx = UPDATERS["adamw-mask-by-path"]()
    kv = jaxkv.KVStore("device", layout=layout)
    kv.set_optimizer(tx)
    kv.init(_params())
    for step in range(STEPS):
        kv.push(_grads(step))
    _close(kv.pull(_params()), _optax_on_one_device(tx))


def _tree_with_a_list():
    return {"blocks": [{"w": jnp.ones((4, 3))}, {"w": jnp.ones((4, 3))}], "bias": jnp.ones(3)}


@pytest.mark.standard_promotion
@pytest.mark.parametrize("older", [False, True], ids=["now", "without-tree-paths"])
def test_a_checkpoint_resumes_with_the_trees_structure(devices, tmp_path, monkeypatch, older):
    """Saved and loaded into an empty store, a store of a tree (a list inside) goes on as the
    uninterrupted one, its mask by path seeing the same tree; a checkpoint written before the
    structures were saved loads too (its trees rebuilt as nested dicts of the keys)."""
    from jaxkv._src.checkpoint import npz

    tx = optax.adamw(0.1, weight_decay=0.5, mask=_no_decay_on_bias)
    tree = _tree_with_a_list()
    grads = jax.tree.map(lambda x: jnp.full_like(x, 0.3), tree)
    state = jaxkv.init_optimizer(jaxkv.init(jaxkv.empty(devices[:1]), tree), tx)
    state = jaxkv.push(state, grads, updater=tx)
    if older:
        monkeypatch.setattr(npz, "tree_paths", lambda tree: None)
    path = str(tmp_path / "kv.npz")
    jaxkv.save_state(path, state)
    loaded = jaxkv.load_state(path, jaxkv.empty(devices[:1]), optimizer=tx)
    if not older:
        assert loaded.trees == state.trees
        assert jax.tree_util.tree_structure(loaded.tree()) == jax.tree_util.tree_structure(tree)
    a = jaxkv.pull(jaxkv.push(loaded, grads, updater=tx), tree)
    b = jaxkv.pull(jaxkv.push(state, grads, updater=tx), tree)
    _close(a, b, atol=0)


@pytest.mark.whole
def test_a_mask_by_path_across_processes():
    """2 processes of 2 devices, the README's sharded step with a mask by path: optax's numbers
    on one device (tests/dist/tree_mask_job.py)."""
    from _jobs import launch

    run = launch(2, "tree_mask_job.py", per_process=2, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert len([line for line in run.stdout.splitlines() if " ok 3 steps" in line]) == 2, (
        run.stdout + run.stderr
    )


@pytest.mark.standard_promotion
def test_a_checkpoint_whose_optimizer_saw_flat_keys_is_refused_saying_why(
    devices, tmp_path, monkeypatch
):
    """A state made while optax was handed flat "a/b" keys (before trees were handed) has
    another structure where a mask by path matters: loading it under the tree is refused,
    naming why, not resumed with other numbers."""

    def make():  # (a new transformation, as a new process has, for the load)
        return optax.masked(optax.scale_by_adam(), _no_decay_on_bias)

    path = str(tmp_path / "kv.npz")
    with monkeypatch.context() as m:
        m.setattr(tree_view, "_view", lambda trees, keys: None)  # optax handed flat keys
        state = jaxkv.init_optimizer(jaxkv.init(jaxkv.empty(devices[:1]), _params()), make())
        jaxkv.save_state(path, state)
    with pytest.raises(jaxkv.KVStoreError, match="flat mapping of the tree's keys"):
        jaxkv.load_state(path, jaxkv.empty(devices[:1]), optimizer=make())
    # What docs/troubleshooting.md says to do: load it with the mask as it came out on the
    # flat keys (true everywhere), then start the optimizer afresh.
    then = optax.masked(optax.scale_by_adam(), lambda p: jax.tree.map(lambda _: True, p))
    loaded = jaxkv.load_state(path, jaxkv.empty(devices[:1]), optimizer=then)
    tx = make()
    loaded = jaxkv.push(jaxkv.init_optimizer(loaded, tx), _grads(0), updater=tx)
    fresh = jaxkv.init_optimizer(jaxkv.init(jaxkv.empty(devices[:1]), _params()), tx)
    _close(loaded.tree(), jaxkv.push(fresh, _grads(0), updater=tx).tree())


def test_a_row_push_to_a_tree_hands_optax_the_tree(devices):
    """``push_rows`` of one key of a tree: optax is handed the tree (the key's leaf, ``None``
    elsewhere), so a mask by path reaches the table's rows."""
    params = {"embed": {"table": jnp.ones((16, 4))}, "dense": {"bias": jnp.ones(4)}}
    mask = lambda p: jax.tree_util.tree_map_with_path(lambda path, _: path[0].key == "embed", p)  # noqa: E731
    tx = optax.chain(optax.masked(optax.add_decayed_weights(0.5), mask), optax.sgd(0.1))
    state = jaxkv.init(jaxkv.empty(devices[:1]), params)
    state = jaxkv.push_rows(state, "embed/table", jnp.array([1, 3]), jnp.ones((2, 4)), updater=tx)
    table = np.asarray(jaxkv.pull(state, "embed/table"))
    np.testing.assert_allclose(table[[1, 3]], 1 - 0.1 * (1 + 0.5))  # decayed: the mask saw it
    np.testing.assert_array_equal(table[[0, 2]], 1.0)  # rows not pushed: unchanged
