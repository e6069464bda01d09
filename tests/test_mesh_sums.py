"""Sums over the whole tree on a store on a data x model mesh (``clip_by_global_norm``, LAMB's
trust ratio): each is completed over every mesh axis a leaf is split on (a tensor-parallel
key's block over "model", and "data" where the store splits it too; a data-split key over
"data"), so the numbers are optax's on one device, in ``shard_map``, in plain ``jit`` and
eagerly; and a push inside ``shard_map(check_vma=False)`` on such a mesh is refused."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _mesh import data_by_model, stepped
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxkv

D = 8
IN = 512
# Split along "data" too: "emb" (262144 elements: reduce-scattered alone, apart from the small
# keys), "col" (512 x 32 per "model" device) and "row" (32 x 32 per "model" device).
BOUND = 1024
CLIP = 0.1


@pytest.fixture(scope="module")
def mesh():
    return data_by_model()


def _params():
    rng = np.random.default_rng(0)
    f = lambda *shape: jnp.asarray(rng.normal(size=shape) * 0.3, jnp.float32)  # noqa: E731
    return {
        "emb": f(IN, IN) / 8,
        "col": f(IN, 128) / 8,
        "hb": f(128),
        "row": f(128, 32),
        "bias": f(32),
    }


def _tp_params(mesh):
    """``col`` (and its bias ``hb``) split by columns along "model", ``row`` by rows, the rest
    replicated."""
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    p = _params()
    return {
        "emb": put(p["emb"], P()),
        "col": put(p["col"], P(None, "model")),
        "hb": put(p["hb"], P("model")),
        "row": put(p["row"], P("model", None)),
        "bias": put(p["bias"], P()),
    }


def _out(p, x, model=None):
    """The model's output; with ``model``, on this device's columns of the hidden layer, the
    partial outputs summed over that axis."""
    h = jnp.tanh(jnp.tanh(x @ p["emb"]) @ p["col"] + p["hb"]) @ p["row"]
    return (h if model is None else jax.lax.psum(h, model)) + p["bias"]


def _loss(p, x):
    return jnp.mean(_out(p, x) ** 2)


def _tp_loss(p, x):
    return jnp.mean(_out(p, x, "model") ** 2)


def _batch():
    rng = np.random.default_rng(1)
    return jnp.asarray(rng.normal(size=(16, IN)), jnp.float32)


def _grad(p):
    """The mean of the two halves' gradients: what the store's ``reduce="mean"`` gives."""
    halves = _batch().reshape(2, 8, IN)
    return jax.tree.map(lambda a, b: (a + b) / 2, *[jax.grad(_loss)(p, h) for h in halves])


def _optax_on_one_device(tx, steps=3):
    """The reference: ``tx`` on one device, each step's gradient :func:`_grad`; checks that a
    clip below the gradient's norm binds at every step."""
    params, opt = _params(), tx.init(_params())
    for _ in range(steps):
        g = _grad(params)
        assert optax.tree.norm(g) > 2 * CLIP  # the clip binds
        updates, opt = tx.update(g, opt, params)
        params = optax.apply_updates(params, updates)
    return params


def _store(mesh, tx):
    state = jaxkv.empty(mesh=mesh, axis_name="data", reduce="mean", bigarray_bound=BOUND)
    state = jaxkv.init_optimizer(jaxkv.init(state, _tp_params(mesh)), tx)
    specs = jaxkv.specs(state, "data", _params())
    assert specs == {
        "emb": P("data"),
        "col": P("data", "model"),
        "hb": P("model"),
        "row": P(("model", "data")),
        "bias": P(),
    }
    return state


def _same(state, want, name):
    """The store's values are optax's on one device, within two float32 roundings: LAMB's
    Adam ratio at an element of a small second moment amplifies them (``row[4, 29]`` after 3
    steps: the store and optax each 6e-6 from float64's value, on either side of it, on JAX
    0.12); a sum left incomplete over a mesh axis is off by the update itself (1e-3 and up)."""
    got = jaxkv.pull(state, _params())
    tol = 3e-5 if name == "lamb" else 1e-5
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=tol, atol=tol), got, want)


# Adam's eps above the default: a clipped gradient of 3e-8 (emb[43, 11]) against 1e-8 would make
# its update a ratio of rounding errors, whatever the order of the norm's sum.
TXS = {
    "clip+adam": lambda: optax.chain(optax.clip_by_global_norm(CLIP), optax.adam(1e-2, eps=1e-4)),
    "lamb": lambda: optax.lamb(1e-2),
}
# Gathered (its finiteness test is a cond): each leaf all-gathered along its split dimensions.
GATHERED = {
    "apply_if_finite": lambda: optax.apply_if_finite(
        optax.chain(optax.clip_by_global_norm(CLIP), optax.sgd(0.1)), 3
    ),
}


def _shard_map_step(state, tx, mesh, check_vma=True):
    spec = jaxkv.specs(state, "data")

    def step(state, x):
        params = jaxkv.pull(state, _params(), axis_name="data")
        return jaxkv.push(state, jax.grad(_tp_loss)(params, x), updater=tx, axis_name="data")

    return jax.jit(
        jax.shard_map(
            step, mesh=mesh, in_specs=(spec, P("data")), out_specs=spec, check_vma=check_vma
        )
    )


@pytest.mark.standard_promotion
@pytest.mark.parametrize("name", [*TXS, *GATHERED])
def test_tree_sums_in_a_shard_map_step_are_completed_over_each_leafs_axes(mesh, compiles, name):
    tx = {**TXS, **GATHERED}[name]()
    state = _store(mesh, tx)
    fn = _shard_map_step(state, tx, mesh)
    x = jax.device_put(_batch(), NamedSharding(mesh, P("data")))
    state = stepped(fn, state, (x,), 3, compiles)
    assert state["col"].sharding.spec == P("data", "model")
    _same(state, _optax_on_one_device(tx), name)


@pytest.mark.standard_promotion
@pytest.mark.parametrize("name", list(TXS))
def test_tree_sums_of_whole_gradients_eagerly_and_in_plain_jit(mesh, compiles, name):
    tx = TXS[name]()
    want = _optax_on_one_device(tx)
    state = _store(mesh, tx)
    for _ in range(3):  # eagerly: one whole gradient per key
        state = jaxkv.push(state, _grad(jaxkv.pull(state, _params())), updater=tx)
    _same(state, want, name)

    @jax.jit
    def step(state):
        return jaxkv.push(state, _grad(jaxkv.pull(state, _params())), updater=tx)

    state = stepped(step, _store(mesh, tx), (), 3, compiles)
    assert state["col"].sharding.spec == P("data", "model")
    _same(state, want, name)


@pytest.mark.standard_promotion
def test_a_push_in_shard_map_without_varying_axes_tracking_is_refused(mesh):
    """Without shard_map's tracking, the gradient of "emb" (replicated along "model", used
    beside split columns) is each "model" device's part only: jaxkv cannot know it."""
    tx = optax.adam(1e-2)
    state = _store(mesh, tx)
    fn = _shard_map_step(state, tx, mesh, check_vma=False)
    x = jax.device_put(_batch(), NamedSharding(mesh, P("data")))
    with pytest.raises(jaxkv.KVStoreError, match="check_vma"):
        fn(state, x)


def test_on_a_store_of_one_axis_a_step_without_varying_axes_tracking_stays_right():
    """The README's sharded step: with one mesh axis every gradient is either summed by AD
    (a block through the all-gather) or each device's own, summed by jaxkv, so without
    tracking (as under ``pmap``) the numbers are those with it."""
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1, momentum=0.9))
    rng = np.random.default_rng(2)
    params = {
        "w": jnp.asarray(rng.normal(size=(64, 512)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=(512,)), jnp.float32),
    }
    x = jnp.asarray(rng.normal(size=(16, 64)), jnp.float32)

    def trained(check_vma):
        state = jaxkv.init(jaxkv.empty(jax.devices("cpu")), params)
        state = jaxkv.init_optimizer(state, opt)
        specs = jaxkv.specs(state, "kv")

        def step(state, x):
            def loss(local):
                whole = jaxkv.gather(state, local, "kv")
                return jnp.sum(jnp.tanh(x @ whole["w"] + whole["b"]))

            grads = jax.grad(loss)(dict(state.values))
            return jaxkv.push(state, grads, updater=opt, axis_name="kv")

        fn = jax.jit(
            jax.shard_map(
                step,
                mesh=state.mesh,
                in_specs=(specs, P("kv")),
                out_specs=specs,
                check_vma=check_vma,
            )
        )
        xs = jax.device_put(x, NamedSharding(state.mesh, P("kv")))
        for _ in range(2):
            state = fn(state, xs)
        return jaxkv.pull(state, params)

    want, got = trained(True), trained(False)
    assert not np.allclose(want["w"], params["w"])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)
