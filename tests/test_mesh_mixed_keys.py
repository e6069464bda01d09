"""Keys of every kind side by side in one store on a mesh of two axes (``"data"``, ``"model"``):
tensor-parallel keys (split along ``"model"`` by their own sharding), keys the store splits along
``"data"``, replicated ones, of sizes on both sides of ``bigarray_bound`` and of the
reduce-scatter fusion limit. A push inside the user's ``shard_map`` sums each group of blocks
that vary over the same mesh axes together, never a block varying over ``"model"`` with one
that does not: every key leaves the step typed as its ``out_specs`` say, and the parameters
equal optax's on one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _devices import SPLIT_BOUND
from _mesh import data_by_model, stepped
from _variants import covering
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxkv
from jaxkv._src.jax_internals import to_varying, varying_axes

D = 8
BATCH = 8
# Adam's eps is raised from 1e-8: its step divides the first moment by the root of the second,
# which in an element whose gradient is tiny (1e-6 beside 4e-2 elsewhere) turns that gradient's
# float rounding into up to 1% of the learning rate. The tensor-parallel products are summed over
# 'model' in another order than one device's matmul, so the reference would differ by that
# (measured: 1e-4 at 1e-2); with eps=1e-3 such an element's step is linear in its gradient, and
# the parameters agree to 1e-5 as SGD's do.
TXS = {
    "sgd": lambda: optax.sgd(0.1, momentum=0.9),
    "adam": lambda: optax.adam(1e-2, eps=1e-3),
}


@pytest.fixture(scope="module")
def mesh():
    return data_by_model()


# The tensor-parallel keys' shapes: "small" ones keep their own split only; "big" ones (a block
# of 256 x 64 per 'model' device, the default bound's 16384 elements) are split along 'data' too.
TP_SHAPES = {
    "small": {"wpe": (64, 128), "proj": (128, 16)},
    "big": {"wpe": (256, 256), "proj": (256, 256)},
}


def _params(rows, tp):
    """A plain key ``w`` of ``rows`` x 256 (split along 'data' by the store; reduce-scattered
    alone from 1024 rows), its replicated bias ``b``, and a tensor-parallel MLP: ``wpe`` split
    by columns along 'model' (and its bias ``hb``), ``proj`` by rows."""
    rng = np.random.default_rng(0)

    # Scaled by the fan-in, so that no hidden unit saturates (where 1 - tanh^2 loses precision).
    def normal(*shape):
        scale = 0.5 / np.sqrt(shape[0]) if len(shape) > 1 else 0.1
        return jnp.asarray(rng.normal(size=shape) * scale, jnp.float32)

    wpe, proj = TP_SHAPES[tp]["wpe"], TP_SHAPES[tp]["proj"]
    return {
        "w": normal(rows, 256),
        "b": normal(256),
        "wpe": normal(*wpe),
        "hb": normal(wpe[1]),
        "proj": normal(*proj),
    }


def _tp(params, mesh):
    """``params`` with the tensor-parallel keys put on the mesh split along 'model'."""
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    return {
        **params,
        "wpe": put(params["wpe"], P(None, "model")),
        "hb": put(params["hb"], P("model")),
        "proj": put(params["proj"], P("model", None)),
    }


def _loss(p, x, model_sum=lambda v: v):
    """A loss over every key. Inside ``shard_map``, the tensor-parallel keys' blocks are this
    device's columns (rows of ``proj``) along 'model', and ``model_sum`` completes their
    partial products over 'model'; on one device it is the identity."""
    plain = jnp.mean((x[:, : p["w"].shape[0]] @ p["w"] + p["b"]) ** 2)
    h = jnp.tanh(x[:, : p["wpe"].shape[0]] @ p["wpe"] + p["hb"])  # this device's columns
    out = model_sum(h @ p["proj"])
    return plain + jnp.mean(out**2)


def _batch(params):
    rng = np.random.default_rng(1)
    width = max(params["w"].shape[0], params["wpe"].shape[0])
    return jnp.asarray(rng.normal(size=(BATCH, width)), jnp.float32)


def _optax_on_one_device(tx, params, x, steps):
    """The reference: the whole batch's mean gradient (the two halves' averaged), ``tx`` on one
    device."""
    opt = tx.init(params)
    halves = x.reshape(2, BATCH // 2, -1)
    for _ in range(steps):
        g = jax.tree.map(lambda a, b: (a + b) / 2, *[jax.grad(_loss)(params, h) for h in halves])
        updates, opt = tx.update(g, opt, params)
        params = optax.apply_updates(params, updates)
    return params


def _local(params):
    """``params`` typed varying over 'data' (as each device's own copy): their gradients are
    then each device's own, left for ``push`` to sum over 'data' (JAX sums the gradient of a
    value invariant over 'data' itself)."""
    return {
        k: v if "data" in varying_axes(v) else to_varying(v, ("data",)) for k, v in params.items()
    }


def _trained(state, tx, mesh, tree, x, compiles, steps, grads="summed"):
    """``state`` after ``steps`` of a ``shard_map`` step over the whole mesh (the batch split
    along 'data'; ``tree``: the tree to pull; ``grads="local"``: each device's own gradients,
    see :func:`_local`); checks that only the first call compiles."""
    spec = jaxkv.specs(state, "data")

    def step(state, x):
        params = jaxkv.pull(state, tree, axis_name="data")
        if grads == "local":
            params = _local(params)
        g = jax.grad(_loss)(params, x, lambda v: jax.lax.psum(v, "model"))
        return jaxkv.push(state, g, updater=tx, axis_name="data")

    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec, P("data")), out_specs=spec))
    x = jax.device_put(x, NamedSharding(mesh, P("data")))
    return stepped(fn, state, (x,), steps, compiles)


def _check(state, params, name, x, steps):
    """``state``'s values against optax's on one device after ``steps`` of optimizer ``name``."""
    want = _optax_on_one_device(TXS[name](), params, x, steps)
    got = jaxkv.pull(state, params)
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)  # noqa: E731
    jax.tree.map(close, got, want)


def _store(mesh, params, tx, layout=None):
    state = jaxkv.empty(
        mesh=mesh, axis_name="data", reduce="mean", layout=layout, bigarray_bound=SPLIT_BOUND
    )
    return jaxkv.init_optimizer(jaxkv.init(state, _tp(params, mesh)), tx)


@pytest.mark.standard_promotion
@pytest.mark.parametrize(
    ("name", "rows", "tp", "grads"),
    covering(list(TXS), [128, 256, 512, 1024], list(TP_SHAPES), ["summed", "local"]),
)
def test_a_push_of_mixed_keys_on_a_mesh_of_two_axes_equals_optax(
    mesh, compiles, name, rows, tp, grads
):
    tx = TXS[name]()
    params = _params(rows, tp)
    state = _store(mesh, params, tx)
    big = tp == "big"
    assert state["w"].sharding.spec == P("data")
    assert state["b"].sharding.spec == P()
    assert state["wpe"].sharding.spec == (P("data", "model") if big else P(None, "model"))
    assert state["proj"].sharding.spec == (P(("model", "data")) if big else P("model"))
    assert state["hb"].sharding.spec == P("model")
    x = _batch(params)
    state = _trained(state, tx, mesh, params, x, compiles, steps=2, grads=grads)
    assert state["wpe"].sharding.spec == (P("data", "model") if big else P(None, "model"))
    _check(state, params, name, x, steps=2)


@pytest.mark.standard_promotion
@pytest.mark.parametrize(("name", "tp"), [("adam", "big"), ("sgd", "small")])
def test_an_eager_push_of_mixed_keys_on_a_mesh_of_two_axes(mesh, name, tp):
    """Outside any trace: one whole gradient per key, pushed twice."""
    tx = TXS[name]()
    params = _params(256, tp)
    state = _store(mesh, params, tx)
    x = _batch(params)
    g = jax.tree.map(
        lambda a, b: (a + b) / 2,
        *[jax.grad(_loss)(params, h) for h in x.reshape(2, BATCH // 2, -1)],
    )
    for _ in range(2):
        state = jaxkv.push(state, g, updater=tx)
    want, opt = params, tx.init(params)
    for _ in range(2):
        updates, opt = tx.update(g, opt, want)
        want = optax.apply_updates(want, updates)
    got = jaxkv.pull(state, params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), got, want)
    assert state["wpe"].sharding.spec == state.key_spec("wpe")


@pytest.mark.standard_promotion
def test_the_keys_layout_and_the_flat_one_on_a_mesh_of_two_axes(mesh, compiles):
    """``layout="keys"`` (each key an array of its own) trains the mix as the default does; the
    flat layout is refused on such a mesh when the store is made, before any key is in it."""
    name = "adam"
    tx = TXS[name]()
    params = _params(256, "big")
    state = _store(mesh, params, tx, layout="keys")
    x = _batch(params)
    state = _trained(state, tx, mesh, params, x, compiles, steps=2, grads="local")
    _check(state, params, name, x, steps=2)
    with pytest.raises(jaxkv.KVStoreError, match="given 'flat'"):
        jaxkv.empty(mesh=mesh, axis_name="data", layout="flat")


def test_a_push_that_would_leave_a_key_varying_along_another_axis_is_refused(mesh):
    """Where a key's new value would vary along an axis its out_specs say it does not (a
    gradient left unsummed over 'model'), ``push`` refuses naming the key before
    ``shard_map``'s check can. (A global norm over tensor-parallel blocks is completed over
    their axes: tests/test_mesh_sums.py.)"""
    params = _params(256, "small")
    for tx, bump in [(TXS["sgd"](), "b")]:
        state = _store(mesh, params, tx)
        spec = jaxkv.specs(state, "data")

        def step(state, x, tx=tx, bump=bump):
            p = jaxkv.pull(state, params, axis_name="data")
            g = jax.grad(_loss)(p, x, lambda v: jax.lax.psum(v, "model"))
            if bump is not None:  # each 'model' device its own gradient of a replicated key
                g[bump] = g[bump] + jax.lax.axis_index("model").astype(jnp.float32)
            return jaxkv.push(state, g, updater=tx, axis_name="data")

        fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec, P("data")), out_specs=spec))
        x = jax.device_put(_batch(params), NamedSharding(mesh, P("data")))
        with pytest.raises(
            jaxkv.KVStoreError, match=r"key 'b': its new value varies along mesh axes \['model'\]"
        ):
            fn(state, x)
