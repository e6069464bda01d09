"""The flat layout of a store (``jaxkv.empty(layout=...)``, ``JAXKV_LAYOUT``): which values share
a bucket, and that every operation gives the numbers of the per-key layout, eagerly and inside
``jit``, ``shard_map`` and ``pmap``, with no recompiles, in the per-key store's memory, and with
one checkpoint format for both."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxkv
from jaxkv import KVStoreError

SHAPES = {"a": (3,), "b": (2, 2), "c": (), "d": (4, 1, 2), "e": (5,)}
DTYPES = {"a": np.float32, "b": np.float32, "c": np.float32, "d": np.int32, "e": np.float32}
FLOAT = ["a", "b", "c", "e"]
# Module-level optimizers: compiled pushes are cached per updater object.
OPTIMIZERS = {
    "sgd-momentum": optax.sgd(0.1, momentum=0.9),
    "adam": optax.adam(0.05),
    "clip-adam": optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.05)),
    "lamb": optax.lamb(0.05),
}


def _init_values(seed=0):
    rng = np.random.default_rng(seed)
    return {
        k: (rng.integers(-9, 9, s).astype(t) if t == np.int32 else rng.normal(size=s).astype(t))
        for (k, s), t in zip(SHAPES.items(), DTYPES.values())
    }


def _grads(step):
    rng = np.random.default_rng(100 + step)
    return {k: rng.normal(size=SHAPES[k]).astype(np.float32) for k in FLOAT}


def _stores(devices=None, **options):
    """The same values in a per-key store and a flat one."""
    values = _init_values()
    out = []
    for layout in ("keys", "flat"):
        s = jaxkv.empty(devices, layout=layout, **options)
        out.append(jaxkv.init(s, {k: jnp.asarray(v) for k, v in values.items()}))
    return out


def _same(a, b, exact=True):
    assert a.keys() == b.keys()
    for k in a.keys():
        x, y = np.asarray(a[k]), np.asarray(b[k])
        assert x.shape == y.shape and x.dtype == y.dtype, k
        if exact:
            np.testing.assert_array_equal(x, y, err_msg=str(k))
        else:
            np.testing.assert_allclose(x, y, rtol=2e-6, atol=2e-6, err_msg=str(k))
    assert list(a.opt_states) == list(b.opt_states)
    for (g, x), y in zip(a.opt_states.items(), b.opt_states.values()):
        xs, ys = jax.tree_util.tree_leaves(x), jax.tree_util.tree_leaves(y)
        assert jax.tree_util.tree_structure(x) == jax.tree_util.tree_structure(y), g
        for u, v in zip(xs, ys):
            np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=2e-6, atol=2e-6)


def test_values_of_one_dtype_and_group_share_a_bucket():
    _, flat = _stores()
    assert flat.layout == "flat" and flat.buckets == 2  # float32, int32
    flat = jaxkv.init_optimizer(flat, OPTIMIZERS["adam"], ["a", "e"])
    assert flat.buckets == 3  # the group (a, e), the other float32 keys, the int32 key
    assert len(jax.tree_util.tree_leaves(flat)) == 3 + 3  # buckets; count, mu and nu buckets
    for k, v in _init_values().items():
        np.testing.assert_array_equal(np.asarray(flat[k]), v)
        assert flat[k].dtype == v.dtype


def test_the_layout_is_asked_for_by_name_or_by_the_environment(monkeypatch):
    monkeypatch.setenv("JAXKV_LAYOUT", "keys")
    assert jaxkv.empty().layout == "keys"
    assert jaxkv.KVStore("local").state.layout == "keys"
    monkeypatch.setenv("JAXKV_LAYOUT", "flat")
    assert jaxkv.empty().layout == "flat"
    assert jaxkv.KVStore("local").state.layout == "flat"
    assert jaxkv.empty(layout="keys").layout == "keys"  # the argument wins
    monkeypatch.setenv("JAXKV_LAYOUT", "dense")
    with pytest.raises(KVStoreError, match="JAXKV_LAYOUT: expected one of"):
        jaxkv.empty()
    monkeypatch.delenv("JAXKV_LAYOUT")
    assert jaxkv.empty().layout == "auto"
    with pytest.raises(KVStoreError, match=r"layout: expected one of \['auto', 'flat', 'keys'\]"):
        jaxkv.empty(layout="buckets")


def test_auto_on_cpu_buckets_small_values_and_keeps_big_ones_apart(devices):
    s = jaxkv.empty(devices[:1], layout="auto")
    s = jaxkv.init(s, {"small": jnp.ones(16), "big": jnp.ones((64, 128)), "s2": jnp.ones(3)})
    assert s.buckets == 1
    leaves = jax.tree_util.tree_leaves(s)
    assert sorted(x.shape for x in leaves) == [(19,), (64, 128)]
    keys = jaxkv.init(jaxkv.empty(devices[:1], layout="keys"), {"small": jnp.ones(16)})
    assert keys.buckets == 0


@pytest.mark.standard_promotion
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_eager_optax_pushes_give_the_per_key_numbers(name, devices):
    opt = OPTIMIZERS[name]
    keys, flat = _stores(devices[:2])
    keys, flat = (jaxkv.init_optimizer(s, opt, FLOAT) for s in (keys, flat))
    for step in range(3):
        g = _grads(step)
        per_device = {k: [jax.device_put(v / 2, d) for d in devices[:2]] for k, v in g.items()}
        keys = jaxkv.push(keys, per_device, updater=opt)
        flat = jaxkv.push(flat, per_device, updater=opt, donate=step == 1)
    _same(keys, flat, exact=False)  # to XLA's rounding: the two programs fuse differently


def test_eager_assign_sums_and_mxnet_updaters_give_the_per_key_numbers(devices):
    keys, flat = _stores(devices[:4])

    def updater(key, pushed, stored):
        return stored * 0.5 + pushed if key != "d" else stored - pushed

    for step in range(2):
        g = {k: v.astype(DTYPES[k]) for k, v in _grads(step).items()}
        g["d"] = np.full(SHAPES["d"], step + 1, np.int32)
        lists = {k: [jax.device_put(v, d) for d in devices[:4]] for k, v in g.items()}
        keys, flat = (jaxkv.push(s, lists, updater=updater) for s in (keys, flat))
        keys, flat = (
            jaxkv.push(s, ["a", "a", "c"], [g["a"], g["a"], g["c"]]) for s in (keys, flat)
        )
        _same(keys, flat)
    assert jaxkv.pull(flat, ["d", "a"], devices=devices[5])[0].devices() == {devices[5]}


def _sin_step(opt):
    """A jitted step: every float key pulled, AD's gradients of ``sum sin(v) * x`` pushed."""

    @jax.jit
    def step(state, x):
        params = {k: jaxkv.pull(state, k) for k in FLOAT}
        loss = lambda p: sum(jnp.sum(jnp.sin(v) * x) for v in p.values())
        return jaxkv.push(state, jax.grad(loss)(params), updater=opt)

    return step


@pytest.mark.standard_promotion
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_jitted_step_gives_the_per_key_numbers_and_compiles_once(name, compiles):
    opt = OPTIMIZERS[name]
    keys, flat = (jaxkv.init_optimizer(s, opt, FLOAT) for s in _stores())
    step = _sin_step(opt)

    keys, flat = step(keys, 1.0), step(flat, 1.0)
    with compiles() as c:
        for i in range(3):
            keys, flat = step(keys, 1.0 + i), step(flat, 1.0 + i)
    assert c.count == 0
    _same(keys, flat, exact=False)
    assert len(jax.tree_util.tree_leaves(flat)) < len(jax.tree_util.tree_leaves(keys))


@pytest.mark.standard_promotion
def test_a_shard_map_step_over_a_flat_store_gives_the_per_key_numbers(devices, compiles):
    opt = OPTIMIZERS["adam"]
    mesh = jax.sharding.Mesh(np.array(devices), ("d",))
    keys, flat = (
        jaxkv.init_optimizer(
            jaxkv.init(
                jaxkv.empty(mesh=mesh, layout=layout),
                {"w": jnp.ones((8, 4096)), "b": jnp.arange(3.0), "c": jnp.ones((2, 2))},
            ),
            opt,
        )
        for layout in ("keys", "flat")
    )
    assert flat.buckets == 1

    def body(state, x):
        params = jaxkv.pull(state, ["w", "b", "c"], axis_name="d")
        loss = lambda p: sum(jnp.sum(v * x) ** 2 for v in p)
        grads = jax.grad(loss)(params)
        return jaxkv.push(state, dict(zip(["w", "b", "c"], grads)), updater=opt, axis_name="d")

    def make(state):
        sp = jaxkv.specs(state, "d")
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(sp, P("d")), out_specs=sp))

    xs = jnp.arange(8.0)
    fk, ff = make(keys), make(flat)
    keys, flat = fk(keys, xs), ff(flat, xs)
    with compiles() as c:
        keys, flat = fk(keys, xs), ff(flat, xs)
    assert c.count == 0
    _same(keys, flat, exact=False)


def test_pmap_takes_a_replicated_flat_store(devices):
    keys, flat = _stores(devices, bigarray_bound=None)

    def body(state, g):
        return jaxkv.push(state, {"a": g}, axis_name="i")

    g = jnp.arange(24.0).reshape(8, 3)
    out = [
        jax.pmap(body, axis_name="i", in_axes=(None, 0), out_axes=None, devices=devices)(s, g)
        for s in (keys, flat)
    ]
    np.testing.assert_array_equal(np.asarray(out[1]["a"]), np.asarray(g.sum(0)))
    _same(*out)


def test_a_flat_store_holds_the_per_key_bytes(devices):
    keys, flat = _stores(devices[:1])
    opt = OPTIMIZERS["adam"]
    keys, flat = (jaxkv.init_optimizer(s, opt, FLOAT) for s in (keys, flat))
    nbytes = lambda s: sum(x.nbytes for x in jax.tree_util.tree_leaves(s))
    assert nbytes(flat) <= 1.05 * nbytes(keys)


@pytest.mark.standard_promotion
@pytest.mark.parametrize("saved, loaded", [("flat", "keys"), ("keys", "flat"), ("flat", "flat")])
def test_one_checkpoint_format_for_both_layouts(tmp_path, saved, loaded):
    opt = OPTIMIZERS["adam"]
    stores = dict(zip(("keys", "flat"), _stores()))
    s = jaxkv.init_optimizer(stores[saved], opt, FLOAT)
    s = jaxkv.push(s, _grads(0), updater=opt)
    jaxkv.save_state(tmp_path / "ckpt", s)
    back = jaxkv.load_state(tmp_path / "ckpt", jaxkv.empty(layout=loaded), optimizer=opt)
    assert back.layout == loaded and (back.buckets > 0) == (loaded == "flat")
    _same(s, back)
    # training goes on with the same numbers (to XLA's rounding across layouts)
    _same(
        jaxkv.push(s, _grads(1), updater=opt),
        jaxkv.push(back, _grads(1), updater=opt),
        exact=saved == loaded,
    )


def test_kvstore_under_the_flat_layout(monkeypatch):
    monkeypatch.setenv("JAXKV_LAYOUT", "flat")
    kv = jaxkv.KVStore("local")
    kv.init([3, 5], [jnp.ones((2, 3)), jnp.zeros(4)])
    assert kv.state.buckets == 1
    kv.set_optimizer(optax.sgd(0.1))
    held = kv.state  # handed out: a later push must not invalidate it
    kv.push(3, jnp.ones((2, 3)))
    np.testing.assert_allclose(np.asarray(held[3]), np.ones((2, 3)))
    out = jaxkv.nd.zeros((2, 3))
    kv.pull(3, out=out)
    np.testing.assert_allclose(out.asnumpy(), np.full((2, 3), 0.9))


def test_refusals_leave_a_flat_store_as_it_was():
    _, flat = _stores()
    before = [np.asarray(x) for x in jax.tree_util.tree_leaves(flat)]
    with pytest.raises(jaxkv.ShapeError, match="key 'b'"):
        jaxkv.push(flat, {"a": jnp.ones(3), "b": jnp.ones(3)})
    with pytest.raises(KVStoreError, match="key 'zz'"):
        jaxkv.push(flat, "zz", jnp.ones(3))
    after = [np.asarray(x) for x in jax.tree_util.tree_leaves(flat)]
    for x, y in zip(before, after):
        np.testing.assert_array_equal(x, y)


# -- which optax updaters run once over a bucket (jaxkv/_src/core/on_buckets.py) ----------------
def _sign_sgd(lr):
    """An elementwise custom transformation: sign of the gradient, then scaled."""

    def update(updates, state, params=None):
        return jax.tree_util.tree_map(lambda g: -lr * jnp.sign(g), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def _mix_keys():
    """Not elementwise: each key's update is the mean of every key's gradient sum."""

    def update(updates, state, params=None):
        total = sum(jnp.sum(g) for g in jax.tree_util.tree_leaves(updates))
        return jax.tree_util.tree_map(lambda g: -0.1 * total * jnp.ones_like(g), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def _global(reduce, combine, inner=lambda x: x, outer=lambda x: x):
    """A scale shared by all keys, from a reduction over each key's gradient (``reduce``, of
    ``inner`` of it) combined over the keys (``combine``), then ``outer`` of that."""

    def update(updates, state, params=None):
        parts = [reduce(inner(g)) for g in jax.tree_util.tree_leaves(updates)]
        scale = outer(functools.reduce(combine, parts))
        return jax.tree_util.tree_map(lambda g: -0.1 * g / (1.0 + scale), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def _reversed_rows():
    """Not elementwise: each key's gradient reversed along its first axis, with momentum."""
    inner = optax.trace(0.5)

    def update(updates, state, params=None):
        flipped = jax.tree_util.tree_map(lambda g: -0.1 * jnp.flip(g, 0) if g.ndim else g, updates)
        return inner.update(flipped, state, params)

    return optax.GradientTransformation(inner.init, update)


def _scanned():
    """Not elementwise: a running sum over each key's elements, by ``lax.scan``."""

    def update(updates, state, params=None):
        def run(g):
            total = lambda c, x: (c + x, c + x)
            return -0.1 * jax.lax.scan(total, jnp.zeros((), g.dtype), g.ravel())[1].reshape(g.shape)

        return jax.tree_util.tree_map(run, updates), state

    return optax.chain(
        optax.GradientTransformation(lambda p: optax.EmptyState(), update), optax.trace(0.5)
    )


BUCKETED = {
    "adam": (OPTIMIZERS["adam"], True),
    "adamw": (optax.adamw(0.05, weight_decay=0.1), True),
    "sgd-momentum": (OPTIMIZERS["sgd-momentum"], True),
    "rmsprop": (optax.rmsprop(0.05), True),
    # A sum, maximum or minimum over the whole group: once over the bucket (the group's norm).
    "clip-adam": (OPTIMIZERS["clip-adam"], True),
    "mix-keys+trace": (optax.chain(_mix_keys(), optax.trace(0.9)), True),
    "inf-norm+trace": (
        optax.chain(_global(jnp.max, jnp.maximum, jnp.abs), optax.trace(0.9)),
        True,
    ),
    "min+trace": (
        optax.chain(_global(jnp.min, jnp.minimum, outer=jnp.abs), optax.trace(0.9)),
        True,
    ),
    # A reduction per key, or combined otherwise than by its own operation: per key.
    "lamb": (OPTIMIZERS["lamb"], False),
    "sum-of-norms+trace": (
        optax.chain(_global(lambda g: jnp.sqrt(jnp.sum(g * g)), jnp.add), optax.trace(0.9)),
        False,
    ),
    "sum-of-means+trace": (optax.chain(_global(jnp.mean, jnp.add), optax.trace(0.9)), False),
    "max-of-sums+trace": (optax.chain(_global(jnp.sum, jnp.maximum), optax.trace(0.9)), False),
    "row-sums+trace": (
        optax.chain(
            _global(lambda g: jnp.max(jnp.sum(g, axis=-1)) if g.ndim else g, jnp.add),
            optax.trace(0.9),
        ),
        False,
    ),
    "sign-sgd+trace": (optax.chain(_sign_sgd(0.1), optax.trace(0.9)), True),
    "reversed-rows": (_reversed_rows(), False),
    "scanned": (_scanned(), False),
}


@pytest.mark.standard_promotion
@pytest.mark.parametrize("name", list(BUCKETED))
def test_elementwise_updaters_run_once_over_the_bucket_with_the_per_key_numbers(name, monkeypatch):
    from jaxkv._src.core import on_buckets as _bucket

    opt, expected = BUCKETED[name]
    ran = []
    real = _bucket.update_bucket

    def spy(state, *args):
        out = real(state, *args)
        if state.buckets:
            ran.append(out is not None)
        return out

    monkeypatch.setattr(_bucket, "update_bucket", spy)
    monkeypatch.setattr(jaxkv._src.core.traced, "update_bucket", spy)
    keys, flat = (jaxkv.init_optimizer(s, opt, FLOAT) for s in _stores())
    step = _sin_step(opt)

    for i in range(3):
        keys, flat = step(keys, 1.0 + i), step(flat, 1.0 + i)
    assert ran and set(ran) == {expected}
    _same(keys, flat, exact=False)
