"""Parameter trees as keys (jaxkv/_src/core/trees.py): a nested tree in, the same tree out,
its leaves keyed by their paths; an optax push on a tree equals ``optax.update`` on it."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _devices import SPLIT_BOUND
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxkv

D = 8


def _params(scale=1.0):
    rng = np.random.default_rng(0)
    f = lambda *s: jnp.asarray(rng.normal(size=s) * scale, jnp.float32)  # noqa: E731
    return {
        "params": {
            "Dense_0": {"kernel": f(64, 512), "bias": f(512)},
            "Dense_1": {"kernel": f(512, 3), "bias": f(3)},
            "blocks": [{"w": f(5)}, {"w": f(5)}],
        }
    }


def _grads(k):
    return jax.tree.map(lambda x: jnp.full_like(x, 0.01 * (k + 1)) * jnp.sign(x), _params())


@pytest.fixture(scope="module")
def cpus():
    devs = jax.devices("cpu")
    assert len(devs) == D
    return devs


def test_a_trees_leaves_are_keyed_by_their_paths():
    state = jaxkv.init(jaxkv.empty(), _params())
    assert state.keys() == (
        "params/Dense_0/bias",
        "params/Dense_0/kernel",
        "params/Dense_1/bias",
        "params/Dense_1/kernel",
        "params/blocks/0/w",
        "params/blocks/1/w",
    )
    # Each leaf is a key of its own.
    np.testing.assert_array_equal(
        jaxkv.pull(state, "params/Dense_1/bias"), _params()["params"]["Dense_1"]["bias"]
    )


@pytest.mark.standard_promotion
@pytest.mark.parametrize("layout", ["keys", "flat"])
@pytest.mark.parametrize("n", [1, D])
def test_an_optax_push_of_a_tree_equals_optax_update_on_it(cpus, layout, n):
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.05))
    state = jaxkv.init(jaxkv.empty(cpus[:n], layout=layout), _params())
    params, opt = _params(), tx.init(_params())
    for k in range(3):
        state = jaxkv.push(state, _grads(k), updater=tx)
        updates, opt = tx.update(_grads(k), opt, params)
        params = optax.apply_updates(params, updates)
    got = jaxkv.pull(state, _params())
    assert jax.tree.structure(got) == jax.tree.structure(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), got, params)


def test_pushpull_gives_the_tree_back():
    state = jaxkv.init(jaxkv.empty(), _params())
    state, got = jaxkv.pushpull(state, _grads(0))
    assert jax.tree.structure(got) == jax.tree.structure(_params())
    jax.tree.map(np.testing.assert_array_equal, got, _grads(0))


def test_pull_reads_only_the_structure_and_paths():
    state = jaxkv.init(jaxkv.empty(), _params())
    shape_only = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _params())
    got = jaxkv.pull(state, shape_only, devices=jax.devices()[0])
    jax.tree.map(np.testing.assert_array_equal, got, _params())
    # A part of the tree is a tree too.
    part = jaxkv.pull(state, {"params": {"Dense_1": {"bias": None, "kernel": 0}}})
    np.testing.assert_array_equal(
        part["params"]["Dense_1"]["kernel"], _params()["params"]["Dense_1"]["kernel"]
    )
    assert part["params"]["Dense_1"]["bias"] is None  # None is no leaf


def test_a_pushed_tree_of_another_structure_is_refused_naming_the_first_path():
    state = jaxkv.init(jaxkv.empty(), _params())
    grads = _grads(0)
    del grads["params"]["Dense_1"]
    with pytest.raises(jaxkv.KVStoreError, match="no leaf at path 'params/Dense_1/bias'"):
        jaxkv.push(state, grads)
    with pytest.raises(jaxkv.KVStoreError, match="no leaf at path 'params/Dense_1/bias'"):
        jaxkv.pushpull(state, grads)
    grads = _grads(0)
    grads["params"]["Dense_2"] = {"kernel": jnp.ones(3)}
    with pytest.raises(jaxkv.KVStoreError, match="path 'params/Dense_2/kernel', which the stored"):
        jaxkv.push(state, grads, updater=optax.sgd(0.1))
    # Nothing moved.
    jax.tree.map(np.testing.assert_array_equal, jaxkv.pull(state, _params()), _params())


def test_trees_and_plain_keys_do_not_mix():
    trees = jaxkv.init(jaxkv.empty(), _params())
    with pytest.raises(jaxkv.KVStoreError, match="key 'step': expected a tree"):
        jaxkv.init(trees, "step", jnp.zeros(()))
    plain = jaxkv.init(jaxkv.empty(), {"w": jnp.zeros(3)})
    with pytest.raises(jaxkv.KVStoreError, match="given a store holding the plain key 'w'"):
        jaxkv.init(plain, _params())
    with pytest.raises(jaxkv.KVStoreError, match="expected a store of trees"):
        jaxkv.push(plain, {"a": {"w": jnp.zeros(3)}})
    # A second tree in a store of trees is fine, and each is pushed on its own.
    both = jaxkv.init(trees, {"stats": {"mean": jnp.zeros(3), "var": jnp.ones(3)}})
    both = jaxkv.push(both, {"stats": {"mean": jnp.ones(3), "var": jnp.ones(3)}})
    np.testing.assert_array_equal(jaxkv.pull(both, "stats/mean"), np.ones(3))


def test_two_leaves_of_one_name_are_refused():
    with pytest.raises(jaxkv.KVStoreError, match="tree key 'a/b'.*two leaves"):
        jaxkv.init(jaxkv.empty(), {"a/b": jnp.zeros(2), "a": {"b": jnp.zeros(2)}})


def test_a_flat_mapping_keeps_its_meaning():
    """A mapping of arrays, or of lists of per-device arrays, is not a tree: its keys are
    plain keys and lists are summed."""
    state = jaxkv.init(jaxkv.empty(), {"w": jnp.zeros(2)})
    assert state.trees == ()
    state = jaxkv.push(state, {"w": [jnp.ones(2), jnp.ones(2)]})
    np.testing.assert_array_equal(jaxkv.pull(state, "w"), [2.0, 2.0])
    assert jaxkv.pull(state, {"w": None}) == {"w": None}  # the leaf named 'w' is None
    np.testing.assert_array_equal(jaxkv.pull(state, {"w": 0})["w"], [2.0, 2.0])


def test_namedtuples_and_other_nodes_below_the_root():
    Pair = collections.namedtuple("Pair", "a b")
    tree = {"x": Pair(jnp.ones(2), jnp.zeros(3))}
    state = jaxkv.init(jaxkv.empty(), tree)
    assert state.keys() == ("x/a", "x/b")
    got = jaxkv.pull(state, tree)
    assert isinstance(got["x"], Pair)


def test_a_shard_map_step_on_a_tree_compiles_once_and_matches_optax(cpus, compiles):
    mesh = Mesh(np.array(cpus), ("data",))
    tx = optax.sgd(0.1, momentum=0.9)
    state = jaxkv.init(jaxkv.empty(mesh=mesh, bigarray_bound=SPLIT_BOUND), _params())
    state = jaxkv.init_optimizer(state, tx, _params())
    spec = jaxkv.specs(state, "data")
    # Big leaves are sharded: the specs of a tree say so.
    leaf_specs = jaxkv.specs(state, "data", _params())
    assert leaf_specs["params"]["Dense_0"]["kernel"] == P("data")
    if state.flat_layout is None:  # (JAXKV_LAYOUT=flat splits a bucket of the small ones)
        assert leaf_specs["params"]["Dense_1"]["bias"] == P()

    def step(state, x):
        params = jaxkv.pull(state, _params(), axis_name="data")  # whole values
        grads = jax.tree.map(lambda p: jnp.sign(p) * jnp.mean(x), params)
        return jaxkv.push(state, grads, updater=tx, axis_name="data")

    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec, P("data")), out_specs=spec))
    data = jax.device_put(jnp.arange(D, dtype=jnp.float32), NamedSharding(mesh, P("data")))
    counts = []
    for _ in range(3):
        with compiles() as c:
            state = fn(state, data)
            jax.block_until_ready(state)
        counts.append(c.count)
    assert counts[1:] == [0, 0]
    params, opt = _params(), tx.init(_params())
    for _ in range(3):
        g = jax.tree.map(lambda p: jnp.sign(p) * jnp.sum(jnp.arange(D, dtype=jnp.float32)), params)
        updates, opt = tx.update(g, opt, params)
        params = optax.apply_updates(params, updates)
    got = jaxkv.pull(state, _params())
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, params)


def test_gather_takes_and_gives_trees(cpus):
    mesh = Mesh(np.array(cpus), ("data",))
    state = jaxkv.init(jaxkv.empty(mesh=mesh, bigarray_bound=SPLIT_BOUND), _params())
    spec = jaxkv.specs(state, "data")

    def step(state):
        blocks = jaxkv.pull(state, _params(), local=True)
        return jaxkv.gather(state, blocks, "data")

    out_specs = jax.tree.map(lambda _: P(), _params())
    fn = jax.shard_map(step, mesh=mesh, in_specs=(spec,), out_specs=out_specs, check_vma=False)
    whole = jax.jit(fn)(state)
    jax.tree.map(np.testing.assert_array_equal, whole, _params())


def test_a_checkpoint_names_leaves_by_path_and_keeps_the_trees(tmp_path):
    tx = optax.sgd(0.1, momentum=0.9)
    state = jaxkv.init_optimizer(jaxkv.init(jaxkv.empty(), _params()), tx)
    state = jaxkv.push(state, _grads(0), updater=tx)
    path = str(tmp_path / "kv.npz")
    jaxkv.save_state(path, state)
    loaded = jaxkv.load_state(path, jaxkv.empty(), optimizer=tx)
    assert loaded.keys() == state.keys() and loaded.trees == state.trees
    # The loaded store takes the tree, and goes on as the saved one does.
    a = jaxkv.pull(jaxkv.push(loaded, _grads(1), updater=tx), _params())
    b = jaxkv.pull(jaxkv.push(state, _grads(1), updater=tx), _params())
    jax.tree.map(np.testing.assert_array_equal, a, b)
