"""``reduce="mean"`` (jaxkv/_src/core/reduce.py): each key's sum divided once by its
contributions, equal to ``jax.lax.pmean`` eagerly, in ``shard_map`` and in ``pmap``, on the
store and per push, after decoding under compression."""

import functools

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
def cpus():
    devs = jax.devices("cpu")
    assert len(devs) == D
    return devs


@pytest.fixture(scope="module")
def mesh(cpus):
    return Mesh(np.array(cpus), ("data",))


def _per_device(shape, seed):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(D, *shape)).astype(np.float32)


def _pmean(mesh, xs):
    """``jax.lax.pmean`` of one value per device (``xs[d]`` on device d)."""
    f = jax.shard_map(
        lambda x: jax.lax.pmean(x[0], "data"), mesh=mesh, in_specs=P("data"), out_specs=P()
    )
    return np.asarray(jax.jit(f)(jnp.asarray(xs)))


SHAPES = {"w": (4, 3), "big": (64, 512), "s": ()}


@pytest.mark.parametrize("layout", ["keys", "flat"])
def test_an_eager_mean_equals_pmean(cpus, mesh, layout):
    state = jaxkv.empty(cpus, layout=layout, reduce="mean")
    state = jaxkv.init(state, {k: jnp.zeros(s) for k, s in SHAPES.items()})
    host = {k: _per_device(s, n) for n, (k, s) in enumerate(SHAPES.items())}
    values = {k: [jax.device_put(x[d], cpus[d]) for d in range(D)] for k, x in host.items()}
    for _ in range(2):  # the second call replays a plan
        got = jaxkv.push(state, list(values), list(values.values()))
        for k in SHAPES:
            np.testing.assert_allclose(jaxkv.pull(got, k), _pmean(mesh, host[k]), rtol=2e-7)
    # The push's own reduce overrides the store's.
    summed = jaxkv.push(state, "w", values["w"], reduce="sum")
    np.testing.assert_allclose(jaxkv.pull(summed, "w"), host["w"].sum(0), rtol=1e-6)


def test_a_mean_with_an_optimizer_is_optax_on_the_mean(cpus, mesh):
    tx = optax.sgd(0.1, momentum=0.9)
    state = jaxkv.init(jaxkv.empty(cpus, reduce="mean"), {"w": jnp.ones((4, 3))})
    w, opt = jnp.ones((4, 3)), tx.init(jnp.ones((4, 3)))
    for step in range(3):
        host = _per_device((4, 3), step)
        state = jaxkv.push(
            state, "w", [jax.device_put(host[d], cpus[d]) for d in range(D)], updater=tx
        )
        updates, opt = tx.update(jnp.asarray(_pmean(mesh, host)), opt, w)
        w = optax.apply_updates(w, updates)
    np.testing.assert_allclose(jaxkv.pull(state, "w"), w, rtol=1e-6)


def test_duplicates_count_as_contributions():
    state = jaxkv.init(jaxkv.empty(reduce="mean"), {"w": jnp.zeros(2)})
    state = jaxkv.push(state, ["w", "w", "w"], [jnp.ones(2), jnp.full(2, 2.0), jnp.full(2, 6.0)])
    np.testing.assert_array_equal(jaxkv.pull(state, "w"), [3.0, 3.0])
    # One value is its own mean.
    state = jaxkv.push(state, "w", jnp.full(2, 5.0))
    np.testing.assert_array_equal(jaxkv.pull(state, "w"), [5.0, 5.0])


@pytest.mark.parametrize("compression", [{"type": "fp16"}, {"type": "2bit", "threshold": 0.5}])
def test_under_compression_the_mean_divides_the_decoded_sum(cpus, compression):
    """The same decoded sum as reduce='sum', divided once by the devices."""
    host = _per_device((4, 3), 7)
    values = [jax.device_put(host[d], cpus[d]) for d in range(D)]

    def pushed(reduce):
        state = jaxkv.empty(cpus, compression=compression, reduce=reduce)
        state = jaxkv.init(state, {"w": jnp.zeros((4, 3))})
        return np.asarray(jaxkv.pull(jaxkv.push(state, "w", values), "w"))

    total = pushed("sum")
    np.testing.assert_array_equal(pushed("mean"), total / np.float32(D))


def _grads_in_shard_map(mesh, reduce_on_store, tx):
    """A shard_map step whose gradient of the replicated key "b" is invariant (JAX summed it)
    and whose per-device gradient of "w" is varying."""
    kw = {"reduce": "mean"} if reduce_on_store else {}
    state = jaxkv.empty(mesh=mesh, **kw)
    state = jaxkv.init(state, {"w": jnp.ones((64, 512)), "b": jnp.ones(3)})
    state = jaxkv.init_optimizer(state, tx)
    spec = jaxkv.specs(state, "data")
    push_kw = {} if reduce_on_store else {"reduce": "mean"}

    def step(state, x):
        b = jaxkv.pull(state, "b", axis_name="data")  # (a block under JAXKV_LAYOUT=flat)
        gb = jax.grad(lambda b: jnp.sum(b * jnp.sum(x)))(b)  # invariant in 'data': summed
        gw = jnp.full((64, 512), jnp.sum(x))  # varying
        return jaxkv.push(state, ["w", "b"], [gw, gb], updater=tx, axis_name="data", **push_kw)

    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec, P("data")), out_specs=spec))
    x = jax.device_put(jnp.arange(D * 2, dtype=jnp.float32), NamedSharding(mesh, P("data")))
    return fn(state, x), x


@pytest.mark.parametrize("reduce_on_store", [True, False])
def test_in_shard_map_a_mean_is_pmean_also_of_values_jax_has_summed(mesh, reduce_on_store):
    tx = optax.sgd(0.5)
    state, x = _grads_in_shard_map(mesh, reduce_on_store, tx)
    per_device = np.asarray(x).reshape(D, 2).sum(1)
    expected = 1.0 - 0.5 * per_device.mean()  # pmean of each device's gradient
    np.testing.assert_allclose(jaxkv.pull(state, "w"), np.full((64, 512), expected), rtol=1e-6)
    np.testing.assert_allclose(jaxkv.pull(state, "b"), np.full(3, expected), rtol=1e-6)


def test_in_pmap_a_mean_is_pmean(cpus):
    state = jaxkv.init(jaxkv.empty(cpus, bigarray_bound=None, reduce="mean"), {"w": jnp.zeros(5)})
    host = _per_device((5,), 3)

    @functools.partial(jax.pmap, axis_name="i", in_axes=(None, 0), out_axes=None)
    def step(state, g):
        return jaxkv.pull(jaxkv.push(state, "w", g, axis_name="i"), "w"), jax.lax.pmean(g, "i")

    got, reference = step(state, jnp.asarray(host))
    np.testing.assert_array_equal(got, reference)


def test_a_mean_of_an_integer_key_is_refused_and_nothing_changes(cpus):
    state = jaxkv.init(jaxkv.empty(cpus, reduce="mean"), {"n": jnp.zeros(2, jnp.int32)})
    values = [jax.device_put(jnp.ones(2, jnp.int32), d) for d in cpus[:2]]
    with pytest.raises(jaxkv.KVStoreError, match="key 'n': reduce='mean' expects a floating"):
        jaxkv.push(state, "n", values)
    np.testing.assert_array_equal(jaxkv.pull(state, "n"), [0, 0])
    # reduce='sum' on the push is fine.
    state = jaxkv.push(state, "n", values, reduce="sum")
    np.testing.assert_array_equal(jaxkv.pull(state, "n"), [2, 2])


def test_refusals():
    with pytest.raises(jaxkv.KVStoreError, match=r"reduce: expected one of \['sum', 'mean'\]"):
        jaxkv.empty(reduce="avg")
    state = jaxkv.init(jaxkv.empty(), {"e": jnp.zeros((4, 2))})
    with pytest.raises(jaxkv.KVStoreError, match=r"reduce: expected one of"):
        jaxkv.push(state, "e", jnp.ones((4, 2)), reduce="max")
    means = jaxkv.init(jaxkv.empty(reduce="mean"), {"e": jnp.zeros((4, 2))})
    with pytest.raises(jaxkv.KVStoreError, match="row-sparse push sums its rows"):
        jaxkv.push_rows(means, "e", [0, 1], jnp.ones((2, 2)))


def test_the_imperative_store_takes_reduce(cpus):
    kv = jaxkv.create("device", reduce="mean")
    kv.init("w", jnp.zeros(3))
    kv.push("w", [jax.device_put(jnp.full(3, float(d)), cpus[d]) for d in range(4)])
    np.testing.assert_array_equal(kv.pull("w"), np.full(3, 1.5))
    assert kv.state.reduce == "mean"


@pytest.mark.parametrize("layout", ["keys", "flat"])
def test_each_key_is_divided_by_its_own_count(cpus, layout):
    """Keys pushed a different number of times in one push (["a", "a", "b"]): "a" is the mean
    of its two values, "b" its one value; eagerly from one device, and from 8 devices, each
    pushing its own list (a: 16 contributions, b: 8)."""
    state = jaxkv.empty(reduce="mean", layout=layout)
    state = jaxkv.init(state, {"a": jnp.zeros(3), "b": jnp.zeros(3)})
    state = jaxkv.push(state, ["a", "a", "b"], [jnp.full(3, 2.0), jnp.full(3, 6.0), jnp.ones(3)])
    np.testing.assert_array_equal(jaxkv.pull(state, "a"), [4.0] * 3)  # (2 + 6) / 2
    np.testing.assert_array_equal(jaxkv.pull(state, "b"), [1.0] * 3)  # 1 / 1
    host = _per_device((3,), 11)
    state = jaxkv.empty(cpus, reduce="mean", layout=layout)
    state = jaxkv.init(state, {"a": jnp.zeros(3), "b": jnp.zeros(3)})
    a = [jax.device_put(host[d], cpus[d]) for d in range(D)]
    a2 = [jax.device_put(2 * host[d], cpus[d]) for d in range(D)]
    b = [jax.device_put(host[d] + 1, cpus[d]) for d in range(D)]
    state = jaxkv.push(state, ["a", "a", "b"], [a, a2, b])
    np.testing.assert_allclose(jaxkv.pull(state, "a"), 3 * host.sum(0) / (2 * D), rtol=1e-6)
    np.testing.assert_allclose(jaxkv.pull(state, "b"), (host + 1).mean(0), rtol=1e-6)


def test_in_shard_map_each_key_is_divided_by_its_own_count(mesh):
    """Inside shard_map, ["a", "a", "b"] from every device: "a" is pmean of each device's two
    values' mean, "b" pmean of its one value."""
    state = jaxkv.init(
        jaxkv.empty(mesh=mesh, reduce="mean"), {"a": jnp.zeros(3), "b": jnp.zeros(3)}
    )
    spec = jaxkv.specs(state, "data")

    def step(state, x):
        v = jnp.full(3, jnp.sum(x))  # varying along "data"
        return jaxkv.push(state, ["a", "a", "b"], [v, 3 * v, v + 1], axis_name="data")

    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec, P("data")), out_specs=spec))
    x = jax.device_put(jnp.arange(D * 2, dtype=jnp.float32), NamedSharding(mesh, P("data")))
    state = fn(state, x)
    per_device = np.asarray(x).reshape(D, 2).sum(1)
    np.testing.assert_allclose(jaxkv.pull(state, "a"), [2 * per_device.mean()] * 3, rtol=1e-6)
    np.testing.assert_allclose(jaxkv.pull(state, "b"), [per_device.mean() + 1] * 3, rtol=1e-6)
