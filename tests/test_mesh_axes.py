"""A store on a user's mesh of several axes (``jaxkv.empty(mesh=..., axis_name="data")``):
values summed along the named axis (or axes), big values sharded along it and replicated along
the others; a ``shard_map`` step over the whole mesh compiles once and equals optax."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _devices import SPLIT_BOUND
from _mesh import data_by_model, stepped
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxkv

D = 8


@pytest.fixture(scope="module")
def mesh():
    return data_by_model()


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


def _trained(state, loss, tx, mesh, compiles, steps=3):
    """``state`` after ``steps`` of a ``shard_map`` step over the whole mesh (the batch split
    along 'data'): pull the tree with ``axis_name='data'``, push the gradients of ``loss``;
    checks that only the first call compiles."""
    spec = jaxkv.specs(state, "data")

    def step(state, x):
        params = jaxkv.pull(state, _params(), axis_name="data")
        return jaxkv.push(state, jax.grad(loss)(params, x), updater=tx, axis_name="data")

    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec, P("data")), out_specs=spec))
    x = jax.device_put(_batch(), NamedSharding(mesh, P("data")))
    return stepped(fn, state, (x,), steps, compiles)


def _optax_on_one_device(tx, reduce="sum", steps=3):
    """The reference: the two halves' gradients of :func:`_loss` added (and halved for a mean),
    then ``tx`` on one device."""
    params, opt = _params(), tx.init(_params())
    halves = _batch().reshape(2, 8, 64)
    for _ in range(steps):
        g = jax.tree.map(lambda a, b: a + b, *[jax.grad(_loss)(params, h) for h in halves])
        if reduce == "mean":
            g = jax.tree.map(lambda a: a / 2, g)
        updates, opt = tx.update(g, opt, params)
        params = optax.apply_updates(params, updates)
    return params


def test_values_are_sharded_along_the_named_axis_and_replicated_along_the_others(mesh):
    state = jaxkv.init(
        jaxkv.empty(mesh=mesh, axis_name="data", bigarray_bound=SPLIT_BOUND), _params()
    )
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
    state = jaxkv.init(
        jaxkv.empty(mesh=mesh, axis_name="data", reduce=reduce, bigarray_bound=SPLIT_BOUND),
        _params(),
    )
    state = _trained(jaxkv.init_optimizer(state, tx), _loss, tx, mesh, compiles)
    assert state["dense/kernel"].sharding == NamedSharding(mesh, P("data"))
    params = _optax_on_one_device(tx, reduce)
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
    state = jaxkv.init(
        jaxkv.empty(mesh=mesh, axis_name="data", bigarray_bound=SPLIT_BOUND), _params()
    )
    # One value per key eagerly: assigned, or given to the updater.
    state = jaxkv.push(state, "out", jnp.ones((512, 2)), updater=optax.sgd(0.5))
    np.testing.assert_allclose(jaxkv.pull(state, "out"), _params()["out"] - 0.5, rtol=1e-6)
    assert state["out"].sharding == NamedSharding(mesh, P())
    # A pull to given devices, and a checkpoint round trip.
    one = jaxkv.pull(state, "dense/kernel", devices=jax.devices("cpu")[3])
    np.testing.assert_array_equal(one, _params()["dense"]["kernel"])
    path = str(tmp_path / "kv.npz")
    jaxkv.save_state(path, state)
    like = jaxkv.empty(mesh=mesh, axis_name="data", bigarray_bound=SPLIT_BOUND)
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


# -- tensor parallelism: a leaf's own sharding along "model" kept, the store's added on top ------
def _tp_params(mesh):
    """An MLP split Megatron-style along 'model': the first kernel by columns (and its bias),
    the second by rows."""
    p = _params()
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    return {
        "dense": {
            "kernel": put(p["dense"]["kernel"], P(None, "model")),
            "bias": put(p["dense"]["bias"], P("model")),
        },
        "out": put(p["out"], P("model", None)),
    }


def _tp_loss(p, x):
    """The loss of :func:`_loss` on this device's columns of the hidden layer: the partial
    outputs summed over 'model'."""
    h = jnp.tanh(x @ p["dense"]["kernel"] + p["dense"]["bias"])
    return jnp.mean(jax.lax.psum(h @ p["out"], "model") ** 2)


def test_a_leafs_own_sharding_is_kept_and_the_store_shards_on_top(mesh):
    state = jaxkv.empty(mesh=mesh, axis_name="data", bigarray_bound=256)
    state = jaxkv.init(state, _tp_params(mesh))
    state = jaxkv.init_optimizer(state, optax.adam(0.1))
    specs = jaxkv.specs(state, "data", _params())
    # Column-split kernel (64, 512): 'model' on its columns, the store's 'data' on its rows;
    # the row-split one (512, 2): both on its rows; the bias (128 per device: below the bound)
    # keeps its own split only.
    assert specs == {
        "dense": {"kernel": P("data", "model"), "bias": P("model")},
        "out": P(("model", "data")),
    }
    assert state["dense/kernel"].sharding.spec == P("data", "model")
    ((adam, _),) = state.opt_states.values()
    kernel_size = 64 * 512
    for moment in (adam.mu, adam.nu):
        shard = moment["dense/kernel"].addressable_shards[0].data
        assert shard.size == kernel_size // D  # ZeRO over tensor parallelism: 1/8 per device
    # The values as given.
    jax.tree.map(np.testing.assert_array_equal, jaxkv.pull(state, _params()), _params())


@pytest.mark.standard_promotion
def test_a_tensor_parallel_step_equals_optax_and_compiles_once(mesh, compiles):
    tx = optax.adam(0.01)
    state = jaxkv.empty(mesh=mesh, axis_name="data", bigarray_bound=256)
    state = jaxkv.init_optimizer(jaxkv.init(state, _tp_params(mesh)), tx)
    state = _trained(state, _tp_loss, tx, mesh, compiles)  # pulls: this device's columns
    assert state["dense/kernel"].sharding.spec == P("data", "model")
    params = _optax_on_one_device(tx)
    got = jaxkv.pull(state, _params())
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), got, params)


def test_eager_pushes_and_checkpoints_keep_a_leafs_own_sharding(mesh, tmp_path):
    tx = optax.sgd(0.5, momentum=0.9)
    state = jaxkv.empty(mesh=mesh, axis_name="data", bigarray_bound=256)
    state = jaxkv.init_optimizer(jaxkv.init(state, _tp_params(mesh)), tx)
    grads = jax.tree.map(jnp.ones_like, _params())
    state = jaxkv.push(state, grads, updater=tx)  # one value per key, eagerly
    assert state["dense/kernel"].sharding.spec == P("data", "model")
    ((trace, _),) = state.opt_states.values()
    assert trace.trace["dense/kernel"].sharding.spec == P("data", "model")
    want = jax.tree.map(lambda p: p - 0.5, _params())
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),
        jaxkv.pull(state, _params()),
        want,
    )
    path = str(tmp_path / "kv.npz")
    jaxkv.save_state(path, state)
    like = jaxkv.empty(mesh=mesh, axis_name="data", bigarray_bound=256)
    loaded = jaxkv.load_state(path, like, optimizer=tx)
    assert loaded.tp_specs == state.tp_specs
    assert loaded["out"].sharding.spec == state["out"].sharding.spec
    ((trace, _),) = loaded.opt_states.values()
    assert trace.trace["dense/kernel"].sharding.spec == P("data", "model")
    a = jaxkv.pull(jaxkv.push(loaded, grads, updater=tx), _params())
    b = jaxkv.pull(jaxkv.push(state, grads, updater=tx), _params())
    jax.tree.map(np.testing.assert_array_equal, a, b)
    # Onto a one-axis store: placed by its rules, the same numbers.
    flat = jaxkv.load_state(path, jaxkv.empty(jax.devices("cpu")), optimizer=tx)
    assert flat.tp_specs == ()
    jax.tree.map(np.testing.assert_array_equal, jaxkv.pull(flat, _params()), want)


def test_a_plain_jit_push_of_whole_values_keeps_a_leafs_own_sharding(mesh, compiles):
    tx = optax.sgd(0.5)
    state = jaxkv.empty(mesh=mesh, axis_name="data", bigarray_bound=256)
    state = jaxkv.init_optimizer(jaxkv.init(state, _tp_params(mesh)), tx)
    grads = jax.tree.map(jnp.ones_like, _params())
    fn = jax.jit(lambda s, g: jaxkv.push(s, g, updater=tx))
    state = fn(state, grads)
    with compiles() as c:
        state = fn(state, grads)
    assert c.count == 0
    assert state["dense/kernel"].sharding.spec == P("data", "model")
    want = jax.tree.map(lambda p: p - 1.0, _params())
    got = jaxkv.pull(state, _params())
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, want)
