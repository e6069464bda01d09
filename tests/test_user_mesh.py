"""A store on the user's own mesh (``jaxkv.empty(mesh=..., axis_name=...)``): its arrays carry
shardings over that mesh, so a ``shard_map`` step over it compiles once, and every eager path
(push, optimizer, compression, checkpoints) works on it."""

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


@pytest.fixture(scope="module")
def cpus():
    devs = jax.devices("cpu")
    assert len(devs) == D, "tests expect 8 simulated CPU devices (see conftest.py)"
    return devs


@pytest.fixture(scope="module")
def mesh(cpus):
    return Mesh(np.array(cpus), ("data",))


def _step(state, g):
    """Each device pushes its rows of ``g`` as its gradient for the sharded key "w"."""
    return jaxkv.push(state, "w", g.reshape(64, 512), axis_name="data", updater=optax.sgd(0.1))


def _loop(state, mesh, steps, compiles):
    specs = jaxkv.specs(state, "data")
    fn = jax.jit(jax.shard_map(_step, mesh=mesh, in_specs=(specs, P("data")), out_specs=specs))
    data = jax.device_put(jnp.ones((D * 64, 512)), NamedSharding(mesh, P("data")))
    counts = []
    for _ in range(steps):
        with compiles() as c:
            state = fn(state, data)
            jax.block_until_ready(state)
        counts.append(c.count)
    return state, counts


def test_a_shard_map_step_over_the_users_mesh_compiles_once(mesh, compiles):
    state = jaxkv.init(
        jaxkv.empty(mesh=mesh, bigarray_bound=SPLIT_BOUND),
        {"w": jnp.zeros((64, 512)), "b": jnp.zeros(3)},
    )
    state = jaxkv.init_optimizer(state, optax.sgd(0.1), keys=["w"])
    assert state.mesh is mesh and state.axis == "data"
    assert state["w"].sharding == NamedSharding(mesh, P("data"))
    state, counts = _loop(state, mesh, 3, compiles)
    assert counts[0] >= 1 and counts[1:] == [0, 0]
    # Each step adds -0.1 * (the sum over 8 devices of ones) to every element.
    np.testing.assert_allclose(np.asarray(state["w"]), np.full((64, 512), -3 * 0.8), rtol=1e-6)
    assert state["w"].sharding == NamedSharding(mesh, P("data"))


def test_a_store_on_its_own_mesh_recompiles_in_such_a_loop(cpus, mesh, compiles):
    """What the user's mesh is for: the store's own mesh (axis 'kv') comes back out of the
    step on the user's mesh, a new input sharding at the second call."""
    state = jaxkv.init(
        jaxkv.empty(cpus, bigarray_bound=SPLIT_BOUND),
        {"w": jnp.zeros((64, 512)), "b": jnp.zeros(3)},
    )
    state = jaxkv.init_optimizer(state, optax.sgd(0.1), keys=["w"])
    _, counts = _loop(state, mesh, 3, compiles)
    assert counts[1] >= 1


def test_axis_name_alone_names_the_stores_own_mesh(cpus):
    state = jaxkv.init(
        jaxkv.empty(cpus, axis_name="batch", bigarray_bound=SPLIT_BOUND),
        {"w": jnp.zeros((64, 512))},
    )
    assert state.axis == "batch" and state.mesh.axis_names == ("batch",)
    assert state["w"].sharding.spec == P("batch")
    assert jaxkv.specs(state, "batch").values["w"] == P("batch")


@pytest.mark.parametrize(
    "compression", [None, {"type": "fp16"}, {"type": "2bit", "threshold": 0.5}]
)
def test_eager_pushes_on_the_users_mesh(cpus, mesh, compression):
    """Per-device values (sharded and replicated keys), an optimizer, compression, a pull to
    other devices: the numbers of a store on its own mesh."""
    rng = np.random.default_rng(0)
    values = {"w": rng.normal(size=(64, 512)).astype(np.float32), "b": np.zeros(3, np.float32)}
    grads = {
        k: [rng.normal(size=v.shape).astype(np.float32) for _ in cpus] for k, v in values.items()
    }
    results = []
    for store in (
        jaxkv.empty(mesh=mesh, compression=compression, bigarray_bound=SPLIT_BOUND),
        jaxkv.empty(cpus, compression=compression, bigarray_bound=SPLIT_BOUND),
    ):
        state = jaxkv.init(store, {k: jnp.asarray(v) for k, v in values.items()})
        state = jaxkv.init_optimizer(state, optax.sgd(0.1, momentum=0.9))
        for _ in range(3):
            pushed = {
                k: [jax.device_put(g, d) for g, d in zip(gs, cpus)] for k, gs in grads.items()
            }
            state = jaxkv.push(state, pushed, updater=optax.sgd(0.1, momentum=0.9))
        results.append({k: np.asarray(jaxkv.pull(state, k, devices=cpus[2])) for k in values})
        if store.mesh is mesh:
            assert state["w"].sharding == NamedSharding(mesh, P("data"))
    for k in values:
        np.testing.assert_array_equal(results[0][k], results[1][k])


def test_a_checkpoint_loads_across_meshes(tmp_path, cpus, mesh):
    own = jaxkv.init(
        jaxkv.empty(cpus, bigarray_bound=SPLIT_BOUND),
        {"w": jnp.arange(64 * 512.0).reshape(64, 512), "b": jnp.ones(3)},
    )
    own = jaxkv.init_optimizer(own, optax.adam(0.1))
    jaxkv.save_state(str(tmp_path / "own.kv"), own)
    target = jaxkv.init(
        jaxkv.empty(mesh=mesh, bigarray_bound=SPLIT_BOUND),
        {"w": jnp.zeros((64, 512)), "b": jnp.zeros(3)},
    )
    loaded = jaxkv.load_state(str(tmp_path / "own.kv"), target, optimizer=optax.adam(0.1))
    assert loaded.mesh is mesh and loaded["w"].sharding == NamedSharding(mesh, P("data"))
    np.testing.assert_array_equal(np.asarray(loaded["w"]), np.asarray(own["w"]))


def test_refusals(cpus, mesh):
    two = Mesh(np.array(cpus).reshape(2, 4), ("data", "model"))
    with pytest.raises(jaxkv.KVStoreError, match="on a mesh of several axes"):
        jaxkv.empty(mesh=two)  # which axis is the data axis?
    with pytest.raises(jaxkv.KVStoreError, match="'data'"):
        jaxkv.empty(mesh=mesh, axis_name="batch")
    with pytest.raises(jaxkv.KVStoreError, match="mesh's devices"):
        jaxkv.empty(cpus[::-1], mesh=mesh)
    with pytest.raises(jaxkv.KVStoreError, match="Mesh"):
        jaxkv.empty(mesh="data")


@pytest.mark.whole
def test_a_tree_on_the_users_mesh_moves_into_a_store_across_processes():
    """2 processes of 4 devices: 48 leaves on a 2 x 4 mesh, some split along "model", given to
    a store over the same devices on one axis that splits them: each moved by its own reshard,
    one collective turn at a time (issued together they hung), every value the tree's
    (tests/dist/mesh_move_job.py)."""
    from _jobs import launch

    run = launch(2, "mesh_move_job.py", per_process=4, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert len([line for line in run.stdout.splitlines() if " ok 48 keys" in line]) == 2, (
        run.stdout + run.stderr
    )
