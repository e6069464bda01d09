"""Sharded storage: values above the big-array bound live 1/D per device, as do their optimizer
states; push reduce-scatters, updaters see the whole (global) array, pull all-gathers."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _devices import cpu_empty, cpu_store, held_per_device
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxkv
from jaxkv import nd

# With bound 16: sharded by rows, replicated, split padded (9 rows do not divide by 8).
BIG, SMALL, ODD = (16, 4), (3,), (9, 8)


def device_bytes(x):
    """Bytes per device, read from the addressable shards."""
    per = {}
    for s in x.addressable_shards:
        per[s.device] = per.get(s.device, 0) + s.data.nbytes
    return per


def in_split_bucket(state, key):
    """Whether ``key`` lies in a bucket split over the devices (a flat layout's shared one, or
    a padded value's own)."""
    flat = state.flat_layout
    b = flat.where[state.keys().index(key)][0] if flat is not None else -1
    return b >= 0 and flat.parts_of(b) > 1


@pytest.fixture
def state():
    return jaxkv.init(
        cpu_empty(bigarray_bound=16),
        {"big": jnp.arange(64.0).reshape(BIG), "small": jnp.zeros(SMALL), "odd": jnp.zeros(ODD)},
    )


def test_big_values_are_stored_one_eighth_per_device(state, devices):
    big = state["big"]
    assert set(held_per_device(state, "big")) == set(devices)
    assert all(b == big.nbytes // 8 for b in held_per_device(state, "big").values())
    # At least the bound but 9 rows: split all the same, flattened and padded, in every layout.
    assert in_split_bucket(state, "odd")
    assert all(b == state["odd"].nbytes // 8 for b in held_per_device(state, "odd").values())
    if in_split_bucket(state, "small"):  # flat: one bucket of 139 elements, split
        assert all(b == 4 for b in held_per_device(state, "small").values())  # 1 of 3 + pad
    else:  # below the bound: replicated
        small = state["small"].nbytes
        assert all(b == small for b in held_per_device(state, "small").values())
    np.testing.assert_array_equal(state["big"], np.arange(64.0).reshape(BIG))


def test_push_reduce_scatters_and_pull_all_gathers(state, devices):
    rng = np.random.default_rng(0)
    grads = [rng.integers(-4, 5, BIG).astype(np.float32) for _ in devices]
    new = jaxkv.push(
        state,
        "big",
        [jax.device_put(g, d) for g, d in zip(grads, devices)],
        updater=lambda k, p, s: s + p,
    )
    expected = np.arange(64.0).reshape(BIG) + np.sum(grads, axis=0)
    assert all(b == new["big"].nbytes // 8 for b in held_per_device(new, "big").values())
    np.testing.assert_array_equal(new["big"], expected)
    pulled = jaxkv.pull(new, "big", devices=devices)
    assert all(b == pulled.nbytes for b in device_bytes(pulled).values())
    np.testing.assert_array_equal(pulled, expected)


def test_pulled_replicas_share_one_host_buffer_safely(state, devices):
    """On CPU devices a pull of a sharded value writes one host copy that every device reads;
    donating one replica to a computation leaves the others (and the store) intact."""
    pulled = jaxkv.pull(state, "big", devices=devices)
    replicas = [s.data for s in pulled.addressable_shards]
    assert {r.device for r in replicas} == set(devices)
    assert len({r.unsafe_buffer_pointer() for r in replicas}) == 1
    assert replicas[0].unsafe_buffer_pointer() not in {
        s.data.unsafe_buffer_pointer() for s in state["big"].addressable_shards
    }
    doubled = jax.jit(lambda x: x * 2, donate_argnums=0)(replicas[3])
    expected = np.arange(64.0).reshape(BIG)
    np.testing.assert_array_equal(doubled, 2 * expected)
    for r in replicas[:3] + replicas[4:]:
        np.testing.assert_array_equal(r, expected)
    np.testing.assert_array_equal(state["big"], expected)


def test_non_elementwise_updaters_see_the_whole_array(state, devices):
    def normalise(key, pushed, stored):  # a global norm: wrong if applied per shard
        return stored + pushed / jnp.linalg.norm(pushed)

    g = np.arange(64.0, dtype=np.float32).reshape(BIG)
    new = jaxkv.push(state, "big", [jax.device_put(g, d) for d in devices[:3]], updater=normalise)
    total = 3 * g
    np.testing.assert_allclose(
        new["big"], np.arange(64.0).reshape(BIG) + total / np.linalg.norm(total), rtol=1e-6
    )


@pytest.mark.standard_promotion  # Adam
def test_optimizer_state_is_sharded_too(state, devices):
    opt = optax.adam(0.1)
    new = jaxkv.push(state, ["big", "small"], [jnp.ones(BIG), jnp.ones(SMALL)], updater=opt)
    if in_split_bucket(new, "big"):  # the group's bucket and its moments' buckets: split
        (packed,) = [o for g, o in zip(new.groups, new.group_states) if g == ("big", "small")]
        mus = [x for x in packed if x.ndim == 1 and x.size > 1]
        assert len(mus) == 2  # mu and nu, one bucket each
        assert all(b == x.nbytes // 8 for x in mus for b in device_bytes(x).values())
    else:
        mu = new.opt_states[("big", "small")][0].mu["big"]
        assert all(b == mu.nbytes // 8 for b in device_bytes(mu).values())
        small_mu = new.opt_states[("big", "small")][0].mu["small"]
        assert all(b == small_mu.nbytes for b in device_bytes(small_mu).values())
    p = jnp.arange(64.0).reshape(BIG)
    upd, _ = opt.update(jnp.ones(BIG), opt.init(p), p)
    np.testing.assert_allclose(new["big"], optax.apply_updates(p, upd), rtol=1e-6)


def test_sharded_state_inside_shard_map(state, devices):
    mesh = Mesh(np.array(devices), ("d",))

    def body(s, x):
        return jaxkv.push(s, "big", jnp.sum(x) * jnp.ones(BIG), axis_name="d")

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("d")), out_specs=P()))
    new = step(state, jnp.ones((8, 2)))
    np.testing.assert_array_equal(new["big"], np.full(BIG, 16.0))
    again = jaxkv.push(new, "big", jnp.ones(BIG))  # back to eager: stored sharded again
    assert all(b == again["big"].nbytes // 8 for b in held_per_device(again, "big").values())


def test_the_imperative_store_honours_mxnets_bound(monkeypatch):
    monkeypatch.setenv("MXNET_KVSTORE_BIGARRAY_BOUND", "16")
    kv = cpu_store("device")
    kv.init(0, nd.ones(BIG))
    kv.set_optimizer(optax.sgd(1.0, momentum=0.5))
    kv.push(0, [nd.ones(BIG, jaxkv.cpu(i)) for i in range(8)])
    stored = kv._state[0]
    assert all(b == stored.nbytes // 8 for b in held_per_device(kv._state, 0).values())
    outs = [nd.zeros(BIG, jaxkv.cpu(i)) for i in range(8)]
    kv.pull(0, out=outs)
    for i, o in enumerate(outs):
        assert o.context == jaxkv.cpu(i)
        np.testing.assert_array_equal(o.asnumpy(), np.full(BIG, -7.0))
    np.testing.assert_array_equal(kv.pull(0), np.full(BIG, -7.0))
