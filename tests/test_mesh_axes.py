"""A store on a user's mesh of several axes (``jaxkv.empty(mesh=..., axis_name="data")``):
values summed along the named axis (or axes), big values sharded along it and replicated along
the others; a ``shard_map`` step over the whole mesh compiles once and equals optax."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxkv

D = 8


@pytest.fixture(scope="module")
def mesh():
    devs = jax.devices("cpu")
    assert len(devs) == D
    return Mesh(np.array(devs).reshape(2, 4), ("data", "model"))


def _params():
    rng = np.random.default_rng(0)
    return {
        "dense": {
            "kernel": jnp.asarray(rng.normal(size=(64, 512)), jnp.float32),
            "bias": jnp.asarray(rng.normal(size=(512,)), jnp.float32),
        },
        "out": jnp.asarray(rng.normal(size=(512, 2)), jnp.float32),
    }


def _loss(p, x):
    h = jnp.tanh(x @ p["dense"]["kernel"] + p["dense"]["bias"])
    return jnp.mean((h @ p["out"]) ** 2)


def _batch():
    rng = np.random.default_rng(1)
    return jnp.asarray(rng.normal(size=(16, 64)), jnp.float32)


def test_values_are_sharded_along_the_named_axis_and_replicated_along_the_others(mesh):
    state = jaxkv.init(jaxkv.empty(mesh=mesh, axis_name="data"), _params())
    assert state.axis == "data" and state.shards == 2
    assert state["dense/kernel"].sharding == NamedSharding(mesh, P("data"))
    assert state["out"].sharding == NamedSharding(mesh, P())
    specs = jaxkv.specs(state, "data", _params())
    assert specs == {"dense": {"kernel": P("data"), "bias": P()}, "out": P()}
    state = jaxkv.init_optimizer(state, optax.adam(0.1))
    ((adam, _),) = state.opt_states.values()
    assert adam.mu["dense/kernel"].sharding == NamedSharding(mesh, P("data"))
    # Each device holds half of the kernel and of its moments.
    shard = state["dense/kernel"].addressable_shards[0].data
    assert shard.shape == (32, 512)


@pytest.mark.standard_promotion
@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_a_shard_map_step_over_both_axes_equals_optax_and_compiles_once(mesh, compiles, reduce):
    """Data parallel along 'data' (each row of the mesh its half of the batch), the 'model'
    devices of a row computing the same gradient (invariant along 'model')."""
    tx = optax.adam(0.01)
    state = jaxkv.init(jaxkv.empty(mesh=mesh, axis_name="data", reduce=reduce), _params())
    state = jaxkv.init_optimizer(state, tx)
    spec = jaxkv.specs(state, "data")

    def step(state, x):
        params = jaxkv.pull(state, _params(), axis_name="data")
        return jaxkv.push(state, jax.grad(_loss)(params, x), updater=tx, axis_name="data")

    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec, P("data")), out_specs=spec))
    x = jax.device_put(_batch(), NamedSharding(mesh, P("data")))
    counts = []
    for _ in range(3):
        with compiles() as c:
            state = fn(state, x)
            jax.block_until_ready(state)
        counts.append(c.count)
    assert counts[1:] == [0, 0]
    assert state["dense/kernel"].sharding == NamedSharding(mesh, P("data"))

    params, opt = _params(), tx.init(_params())
    halves = _batch().reshape(2, 8, 64)
    for _ in range(3):
        grads = [jax.grad(_loss)(params, h) for h in halves]
        g = jax.tree.map(lambda a, b: a + b, *grads)
        if reduce == "mean":
            g = jax.tree.map(lambda a: a / 2, g)
        updates, opt = tx.update(g, opt, params)
        params = optax.apply_updates(params, updates)
    got = jaxkv.pull(state, _params())
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6), got, params)


def test_summing_along_both_axes(mesh):
    state = jaxkv.init(jaxkv.empty(mesh=mesh, axis_name=("data", "model")), {"w": jnp.zeros(3)})
    assert state.shards == D
    spec = jaxkv.specs(state, ("data", "model"))

    def step(state, x):
        return jaxkv.push(state, "w", jnp.full(3, x[0]), axis_name=("data", "model"))

    fn = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(spec, P(("data", "model"))), out_specs=spec)
    )
    state = fn(state, jnp.arange(D, dtype=jnp.float32))
    np.testing.assert_array_equal(jaxkv.pull(state, "w"), np.full(3, 28.0))


def test_eager_calls_on_a_mesh_of_several_axes(mesh, tmp_path):
    state = jaxkv.init(jaxkv.empty(mesh=mesh, axis_name="data"), _params())
    # One value per key eagerly: assigned, or given to the updater.
    state = jaxkv.push(state, "out", jnp.ones((512, 2)), updater=optax.sgd(0.5))
    np.testing.assert_allclose(jaxkv.pull(state, "out"), _params()["out"] - 0.5, rtol=1e-6)
    assert state["out"].sharding == NamedSharding(mesh, P())
    # A pull to given devices, and a checkpoint round trip.
    one = jaxkv.pull(state, "dense/kernel", devices=jax.devices("cpu")[3])
    np.testing.assert_array_equal(one, _params()["dense"]["kernel"])
    path = str(tmp_path / "kv.npz")
    jaxkv.save_state(path, state)
    like = jaxkv.empty(mesh=mesh, axis_name="data")
    loaded = jaxkv.load_state(path, like, optimizer=optax.sgd(0.5))
    assert loaded["dense/kernel"].sharding == NamedSharding(mesh, P("data"))
    jax.tree.map(
        np.testing.assert_array_equal, jaxkv.pull(loaded, _params()), jaxkv.pull(state, _params())
    )


def test_refusals_on_a_mesh_of_several_axes(mesh):
    devs = jax.devices("cpu")
    with pytest.raises(jaxkv.KVStoreError, match="expected the axis .* values are summed along"):
        jaxkv.empty(mesh=mesh)
    with pytest.raises(jaxkv.KVStoreError, match=r"expected axes of the mesh .* given 'batch'"):
        jaxkv.empty(mesh=mesh, axis_name="batch")
    with pytest.raises(jaxkv.KVStoreError, match="given 'flat'"):
        jaxkv.empty(mesh=mesh, axis_name="data", layout="flat")
    with pytest.raises(jaxkv.KVStoreError, match="compression: on a mesh of several axes"):
        jaxkv.empty(mesh=mesh, axis_name="data", compression={"type": "fp16"})
    state = jaxkv.init(jaxkv.empty(mesh=mesh, axis_name="data"), {"w": jnp.zeros((8, 2))})
    values = [jax.device_put(jnp.ones((8, 2)), d) for d in devs]
    with pytest.raises(jaxkv.KVStoreError, match="key 'w': a store on a mesh of several axes"):
        jaxkv.push(state, "w", values)
    with pytest.raises(jaxkv.KVStoreError, match="key 'w': push_rows expects a store on one"):
        jaxkv.push_rows(state, "w", [0], jnp.ones((1, 2)))
    np.testing.assert_array_equal(jaxkv.pull(state, "w"), np.zeros((8, 2)))


def test_a_tensor_parallel_sharding_is_not_kept_and_says_so(mesh, caplog):
    """Not yet kept: the value is placed by the store's rules (right numbers, replicated along
    'model'), and a warning says so."""
    w = jax.device_put(jnp.arange(32.0).reshape(4, 8), NamedSharding(mesh, P(None, "model")))
    with caplog.at_level("WARNING", logger="jaxkv"):
        state = jaxkv.init(jaxkv.empty(mesh=mesh, axis_name="data"), {"w": w})
    assert "key 'w': its sharding along ['model'] is not kept" in caplog.text
    assert state["w"].sharding == NamedSharding(mesh, P())
    np.testing.assert_array_equal(jaxkv.pull(state, "w"), np.arange(32.0).reshape(4, 8))
