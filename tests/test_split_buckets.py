"""Split buckets (the flat layout over several devices): a bucket of at least the big-array
bound is split over the devices, each key flattened, padded and cut in D blocks. Every value,
of any shape, is then held 1/D per device; a push sums with one reduce-scatter per bucket; and
every operation gives the per-key layout's numbers, eagerly, inside ``jit`` and inside
``shard_map`` (both gradient forms), with no recompiles."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _devices import SPLIT_BOUND, held_per_device
from _variants import rotating
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxkv

D = 8
BOUND = 64
# Rows dividing by D (a block of rows), rows that do not (a padded piece of the flattened
# value), a vector, a scalar: every kind of block.
SHAPES = {"w": (16, 6), "odd": (5, 7, 3), "e": (130,), "b": (3,), "s": ()}
OPTIMIZERS = {
    "sgd-momentum": optax.sgd(0.1, momentum=0.9),
    "adam": optax.adam(0.05),
    "clip-adam": optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.05)),
    "lamb": optax.lamb(0.05),
}
_rng = np.random.default_rng(0)
START = {k: _rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
X = _rng.normal(size=(2 * D, 6)).astype(np.float32)


def _store(devices, layout, values=START, **options):
    s = jaxkv.empty(devices, layout=layout, bigarray_bound=BOUND, **options)
    return jaxkv.init(s, {k: jnp.asarray(v) for k, v in values.items()})


def _close(a, b, tol=2e-6):
    for k in SHAPES:
        np.testing.assert_allclose(np.asarray(a[k]), np.asarray(b[k]), rtol=tol, atol=tol)


def test_a_big_bucket_is_split_and_each_key_held_one_dth_per_device(devices):
    s = _store(devices, "flat")
    assert s.buckets == 1 and s.flat_layout.parts == (D,)
    (bucket,) = s.leaves
    blocks = {"w": 12, "odd": 14, "e": 17, "b": 1, "s": 1}  # each key's padded 1/D
    assert bucket.shape == (D * sum(blocks.values()),)
    assert bucket.sharding.spec == P("kv")
    assert {sh.data.shape for sh in bucket.addressable_shards} == {(sum(blocks.values()),)}
    for k, n in blocks.items():
        assert set(held_per_device(s, k).values()) == {4 * n}, k
        np.testing.assert_array_equal(np.asarray(s[k]), START[k])
    # The per-key layout shards "w" (rows divisible by D) by rows, splits "odd" and "e" (at
    # least the bound, rows not divisible by D) each in a split bucket of its own, and
    # replicates the rest (below the bound).
    keys = _store(devices, "keys")
    assert set(held_per_device(keys, "w").values()) == {START["w"].nbytes // D}
    assert keys.flat_layout.parts == (D, D)
    for k in ("odd", "e"):
        assert set(held_per_device(keys, k).values()) == {4 * blocks[k]}, k
    assert set(held_per_device(keys, "b").values()) == {START["b"].nbytes}


def test_auto_on_cpu_splits_no_bucket(devices):
    s = jaxkv.init(
        jaxkv.empty(devices, layout="auto", bigarray_bound=SPLIT_BOUND),
        {"w": jnp.ones((8, 4096)), "b": jnp.ones(3)},
    )
    assert s.buckets == 1 and not s.flat_layout.split
    (big,) = [x for x in jax.tree_util.tree_leaves(s) if x.shape == (8, 4096)]
    assert big.sharding.spec == P("kv")
    sp = jaxkv.specs(s, "d")
    assert (tuple(sp.values["b"]), tuple(sp.values["w"])) == ((), ("d",))


def test_specs_split_the_bucket_and_its_moments(devices):
    s = jaxkv.init_optimizer(_store(devices, "flat"), optax.adam(0.1))
    sp = jaxkv.specs(s, "d")
    assert set(sp.values.values()) == {P("d")}
    ((adam, _),) = sp.opt_states.values()
    assert adam.count == P() and set(adam.mu.values()) == {P("d")}
    # The moments' buckets are split as the values' bucket is.
    (packed,) = s.group_states
    moments = [x for x in jax.tree_util.tree_leaves(packed) if x.ndim == 1]
    assert len(moments) == 2
    assert all(x.shape == s.leaves[0].shape and x.sharding.spec == P("kv") for x in moments)


@pytest.mark.standard_promotion
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_eager_pushes_from_every_device_give_the_per_key_numbers(name, devices):
    opt = OPTIMIZERS[name]
    keys, flat = (jaxkv.init_optimizer(_store(devices, lay), opt) for lay in ("keys", "flat"))
    for step in range(3):
        rng = np.random.default_rng(10 + step)
        grads = {
            k: [jax.device_put(rng.normal(size=s).astype(np.float32), d) for d in devices]
            for k, s in SHAPES.items()
        }
        keys = jaxkv.push(keys, grads, updater=opt)
        flat = jaxkv.push(flat, grads, updater=opt, donate=True)
    _close(keys, flat)
    for x, y in zip(
        jax.tree_util.tree_leaves(list(keys.opt_states.values())),
        jax.tree_util.tree_leaves(list(flat.opt_states.values())),
    ):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-6, atol=2e-6)
    assert flat.leaves[0].sharding.spec == P("kv")


@pytest.mark.standard_promotion
def test_an_eager_push_reduce_scatters_once_per_bucket(devices):
    from jaxkv._src.core.eager import _layout, flat_push_fn
    from jaxkv._src.core.signature import PushOptions

    opt = OPTIMIZERS["adam"]
    s = jaxkv.init_optimizer(_store(devices, "flat"), opt)
    grads = {
        k: [jax.device_put(np.ones(sh, np.float32), d) for d in devices] for k, sh in SHAPES.items()
    }
    new = jaxkv.push(s, grads, updater=opt)
    p = {k: jnp.asarray(v) for k, v in START.items()}
    g = {k: jnp.full(sh, float(D), jnp.float32) for k, sh in SHAPES.items()}
    u, _ = opt.update(g, opt.init(p), p)
    _close(new, optax.apply_updates(p, u), tol=1e-6)
    # The computation: one reduce-scatter, no all-reduce, for the one bucket of five keys.
    kinds, pushed = zip(*[_layout(s, s[k], grads[k]) for k in sorted(SHAPES)])
    fn = flat_push_fn(s, tuple(sorted(SHAPES)), kinds, PushOptions(updater=opt))
    text = jax.jit(fn).lower(s, list(pushed)).as_text()  # (fn: the jitted push, then Python)
    assert text.count("stablehlo.reduce_scatter") == 1
    assert "stablehlo.all_reduce" not in text


@pytest.mark.standard_promotion
@pytest.mark.parametrize("name", ["adam", "lamb"])
def test_a_jitted_step_gives_the_per_key_numbers_and_compiles_once(name, devices, compiles):
    opt = OPTIMIZERS[name]

    @functools.partial(jax.jit, donate_argnums=0)
    def step(state, g):
        return jaxkv.push(state, g, updater=opt)

    out = {}
    for layout in ("keys", "flat"):
        s = jaxkv.init_optimizer(_store(devices, layout), opt)
        grads = [{k: jnp.full(sh, float(i)) for k, sh in SHAPES.items()} for i in range(3)]
        s = step(s, grads[0])
        with compiles() as counted:
            for g in grads[1:]:
                s = step(s, g)
        assert counted.count == 0, layout
        out[layout] = s
    _close(out["keys"], out["flat"])
    assert out["flat"].leaves[0].sharding.spec == P("kv")


def _loss(params, x):
    h = jnp.tanh(x @ params["w"].T)  # (n, 16)
    return 0.01 * (
        jnp.sum(h * jnp.mean(params["odd"] ** 2))
        + jnp.sum(h[:, :1] * params["e"][:16] * params["b"][0])
        + jnp.sum(x) * params["s"] ** 2
    )


def _reference(opt, steps):
    params = {k: jnp.asarray(v) for k, v in START.items()}
    opt_state = opt.init(params)
    for _ in range(steps):
        grads = [jax.grad(_loss)(params, jnp.asarray(X[2 * d : 2 * d + 2])) for d in range(D)]
        total = jax.tree_util.tree_map(lambda *g: functools.reduce(jnp.add, g), *grads)
        updates, opt_state = opt.update(total, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params


@pytest.mark.standard_promotion
# make test-whole: each optimizer once, the forms taking turns; every pair in make test-deep.
@pytest.mark.parametrize(("name", "form"), rotating(list(OPTIMIZERS), ["whole", "blocks"]))
def test_a_shard_map_step_matches_one_device_optax(name, form, devices, compiles):
    """Both gradient forms: the whole values pulled (a whole-shape, per-device gradient,
    reduce-scattered into the blocks), and the blocks gathered inside the loss (AD's
    reduce-scatter gives each block's gradient, already summed)."""
    opt = OPTIMIZERS[name]
    s = jaxkv.init_optimizer(_store(devices, "flat"), opt)
    spec = jaxkv.specs(s, "kv")
    mesh = s.mesh

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(spec, P("kv")), out_specs=spec)
    def step(state, x):
        if form == "whole":
            params = dict(zip(SHAPES, jaxkv.pull(state, list(SHAPES), axis_name="kv")))
            grads = jax.grad(_loss)(params, x)
        else:
            local = {k: jaxkv.pull(state, k, local=True) for k in SHAPES}
            grads = jax.grad(lambda v: _loss(jaxkv.gather(state, v, "kv"), x))(local)
            assert grads["w"].shape == (16 // D, 6)  # its rows
            assert grads["odd"].shape == (14,)  # a padded piece of the flattened value
        return jaxkv.push(state, grads, updater=opt, axis_name="kv")

    x = jax.device_put(X, NamedSharding(mesh, P("kv")))
    s = step(s, x)
    with compiles() as counted:
        for _ in range(2):
            s = step(s, x)
    assert counted.count == 0
    _close(s, _reference(opt, 3), tol=2e-5)
    assert s.leaves[0].sharding.spec == P("kv")


def test_a_whole_shape_push_in_shard_map_is_one_reduce_scatter(devices):
    """Device d pushes its own whole-shape values (varying): summed with one reduce-scatter
    for the bucket, each device keeping its blocks; an already-summed (invariant) value is
    just cut into its blocks."""
    s = _store(devices, "flat")
    spec = jaxkv.specs(s, "kv")
    data = {k: _rng.normal(size=(D, *sh)).astype(np.float32) for k, sh in SHAPES.items()}

    def body(state, g):
        mine = {k: v[0] for k, v in g.items()}
        return jaxkv.push(state, mine, axis_name="kv")

    step = jax.jit(jax.shard_map(body, mesh=s.mesh, in_specs=(spec, P("kv")), out_specs=spec))
    g = {k: jax.device_put(v, NamedSharding(s.mesh, P("kv"))) for k, v in data.items()}
    new = step(s, g)
    for k in SHAPES:
        np.testing.assert_allclose(np.asarray(new[k]), data[k].sum(0), rtol=1e-5, atol=1e-5)
    text = step.lower(s, g).as_text()
    assert text.count("stablehlo.reduce_scatter") == 1
    assert "stablehlo.all_gather" not in text

    def invariant(state):
        return jaxkv.push(
            state, {k: jnp.asarray(v.sum(0)) for k, v in data.items()}, axis_name="kv"
        )

    step = jax.jit(jax.shard_map(invariant, mesh=s.mesh, in_specs=(spec,), out_specs=spec))
    new = step(s)
    for k in SHAPES:
        np.testing.assert_allclose(np.asarray(new[k]), data[k].sum(0), rtol=1e-5, atol=1e-5)
    assert "stablehlo.reduce_scatter" not in step.lower(s).as_text()


def _max_abs(key, pushed, stored):
    return stored - pushed / jnp.max(jnp.abs(pushed))


def test_a_maximum_over_a_split_key_is_taken_over_every_device(devices):
    """A key whose rows divide by D runs a maximum over its rows on its block, completed by
    an all-reduce; a key whose block is a padded piece is gathered first: the padding (zeros)
    must not enter a maximum of negative numbers."""
    values = {"w": START["w"], "neg": -np.abs(START["odd"]) - 1.0}
    s = jaxkv.init(
        jaxkv.empty(devices, layout="flat", bigarray_bound=BOUND),
        {k: jnp.asarray(v) for k, v in values.items()},
    )
    spec = jaxkv.specs(s, "kv")
    data = {
        k: -np.abs(_rng.normal(size=(D, *v.shape))).astype(np.float32) for k, v in values.items()
    }

    def body(state, g):
        return jaxkv.push(state, {k: v[0] for k, v in g.items()}, updater=_max_abs, axis_name="kv")

    step = jax.jit(jax.shard_map(body, mesh=s.mesh, in_specs=(spec, P("kv")), out_specs=spec))
    g = {k: jax.device_put(v, NamedSharding(s.mesh, P("kv"))) for k, v in data.items()}
    new = step(s, g)
    for k, v in values.items():
        total = data[k].sum(0)
        expected = v - total / np.max(np.abs(total))
        np.testing.assert_allclose(np.asarray(new[k]), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.standard_promotion
def test_a_checkpoint_of_split_buckets_loads_into_the_per_key_layout_and_back(devices, tmp_path):
    opt = OPTIMIZERS["adam"]
    flat = jaxkv.init_optimizer(_store(devices, "flat"), opt)
    flat = jaxkv.push(flat, {k: jnp.ones(sh) for k, sh in SHAPES.items()}, updater=opt)
    jaxkv.save_state(tmp_path / "flat", flat)
    like = jaxkv.init_optimizer(_store(devices, "keys"), opt)
    keys = jaxkv.load_state(tmp_path / "flat", like, optimizer=opt)
    _close(keys, flat, tol=0)
    jaxkv.save_state(tmp_path / "keys", keys)
    back = jaxkv.load_state(tmp_path / "keys", flat, optimizer=opt)
    assert back.flat_layout == flat.flat_layout and back.leaves[0].sharding.spec == P("kv")
    _close(back, flat, tol=0)
    for x, y in zip(
        jax.tree_util.tree_leaves(list(back.opt_states.values())),
        jax.tree_util.tree_leaves(list(flat.opt_states.values())),
    ):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_split_buckets_hold_at_most_the_per_key_bytes_per_device_plus_padding(devices):
    """ResNet-50's shapes scaled down: the flat store's bytes on one device are the per-key
    store's sharded share, plus padding (at most D - 1 elements per key)."""
    shapes = [(64, 3, 7, 7), (64,), (64,), (256, 64, 1, 1), (256,), (1000, 2048 // 16), (1000,)]
    values = {f"k{i}": jnp.ones(s) for i, s in enumerate(shapes)}
    flat = jaxkv.init(jaxkv.empty(devices, layout="flat"), values)
    total = sum(v.nbytes for v in values.values())
    on_one = sum(sh.data.nbytes for x in flat.leaves for sh in x.addressable_shards[:1])
    assert on_one <= 1.05 * total / D


def test_the_imperative_store_with_split_buckets(devices, monkeypatch):
    monkeypatch.setenv("MXNET_KVSTORE_BIGARRAY_BOUND", str(BOUND))
    kv = jaxkv.KVStore("device", devices=devices, layout="flat")
    kv.init(list(SHAPES), [jaxkv.nd.array(START[k]) for k in SHAPES])
    kv.set_optimizer(optax.sgd(1.0))
    kv.push(
        list(SHAPES), [[jaxkv.nd.ones(SHAPES[k], jaxkv.cpu(i)) for i in range(D)] for k in SHAPES]
    )
    assert kv._state.flat_layout.split
    outs = [jaxkv.nd.zeros(SHAPES["odd"], jaxkv.cpu(i)) for i in range(D)]
    kv.pull("odd", out=outs)
    for i, o in enumerate(outs):
        assert o.context == jaxkv.cpu(i)
        np.testing.assert_allclose(o.asnumpy(), START["odd"] - D, rtol=1e-6)


def test_a_pull_inside_the_step_gathers_a_split_bucket_at_once(devices):
    """The whole values of a bucket's keys come from one all-gather of the bucket's blocks,
    and ``jax.grad`` through ``jaxkv.gather`` gives each block's gradient with one
    reduce-scatter."""
    s = _store(devices, "flat")
    spec = jaxkv.specs(s, "kv")

    def body(state):
        whole = jaxkv.pull(state, list(SHAPES), axis_name="kv")
        local = {k: jaxkv.pull(state, k, local=True) for k in SHAPES}
        grads = jax.grad(
            lambda v: sum(jnp.sum(x**2) for x in jaxkv.gather(state, v, "kv").values())
        )(local)
        return [w[None] for w in whole], grads

    grad_spec = {k: P("kv") for k in SHAPES}
    step = jax.jit(
        jax.shard_map(
            body, mesh=s.mesh, in_specs=(spec,), out_specs=([P("kv")] * len(SHAPES), grad_spec)
        )
    )
    whole, grads = step(s)
    for k, w in zip(SHAPES, whole):
        np.testing.assert_array_equal(np.asarray(w)[0], START[k])
    np.testing.assert_allclose(
        np.asarray(grads["w"]).reshape(SHAPES["w"]), 2 * D * START["w"], rtol=1e-6
    )
    text = step.lower(s).as_text()
    assert text.count("stablehlo.all_gather") == 2  # the pull's, and the gather's
    assert text.count("stablehlo.reduce_scatter") == 1


def test_new_keys_inside_shard_map_are_refused_over_split_buckets(devices):
    """Inside ``shard_map`` the split buckets' values are blocks: laying out the buckets anew
    from them would give wrong values, so a new key is refused there, before anything runs."""
    s = _store(devices, "flat")
    spec = jaxkv.specs(s, "kv")

    def body(state):
        return jaxkv.init(state, {"new": jnp.ones(3)})

    step = jax.jit(jax.shard_map(body, mesh=s.mesh, in_specs=(spec,), out_specs=P()))
    with pytest.raises(jaxkv.KVStoreError, match="expected whole values to lay out anew"):
        step(s)


def test_compression_set_over_split_buckets_lays_each_key_out_where_it_belongs(
    devices, monkeypatch
):
    """Setting gradient compression takes a flat store to one array per key. Each key's array
    must then be placed as the per-key layout places it (replicated below the bound), not as
    XLA placed its view of the split bucket (row-sharded): else a pull into outs hands each
    device only its rows (found by the stateful model, make test-deep)."""
    monkeypatch.setenv("MXNET_KVSTORE_BIGARRAY_BOUND", str(SPLIT_BOUND))  # the bucket is split
    kv = jaxkv.KVStore("device", devices=devices, layout="flat")
    shapes = [(8, 4), (2, 3), (1024, 16)]
    values = [np.arange(np.prod(s), dtype=np.float32).reshape(s) for s in shapes]
    kv.init([0, 1, 2], [jaxkv.nd.array(v) for v in values])
    kv.state  # noqa: B018 - lays the new keys out (an init leaves that to the next push)
    assert kv._state.flat_layout.split
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    state = kv._state
    assert state.buckets == 0
    for k, s in enumerate(shapes):
        assert state[k].sharding.spec == (P("kv") if state.is_sharded(s) else P()), k
    outs = [jaxkv.nd.zeros(shapes[0], jaxkv.cpu(i)) for i in range(D)]
    kv.pull(0, out=outs)
    for o in outs:
        np.testing.assert_array_equal(o.asnumpy(), values[0])
