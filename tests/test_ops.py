"""The functional core: init, push, pull, pushpull, row_sparse_pull, eagerly and under jit,
pmap and shard_map, with compile counting, purity, donation and refusals."""

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _devices import cpu_empty
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxkv


def on(device, value):
    return jax.device_put(jnp.asarray(value, jnp.float32), device)


@pytest.fixture
def state():
    return jaxkv.init(
        cpu_empty(), {"w": jnp.zeros((2, 3)), "b": jnp.zeros(()), "v": jnp.arange(4.0)}
    )


def add(key, pushed, stored):
    return stored + pushed


def snapshot(state):
    return {k: np.asarray(state[k]) for k in state.keys()}


def assert_same(state, snap):
    assert set(state.keys()) == set(snap)
    for k, v in snap.items():
        np.testing.assert_array_equal(np.asarray(state[k]), v)


# -- eager ----------------------------------------------------------------------------------
def test_init_copies_values_onto_the_store_devices(devices):
    src = on(devices[0], [1.0, 2.0])
    s = jaxkv.init(cpu_empty(), 7, src)
    stored = s[7]
    assert stored.sharding.device_set == set(devices)
    assert stored.sharding.is_fully_replicated
    for shard in stored.addressable_shards:  # no shard aliases the caller's buffer
        assert shard.data.unsafe_buffer_pointer() != src.unsafe_buffer_pointer()


def test_keys_are_sorted_and_one_kind(state):
    assert state.keys() == ("b", "v", "w")
    with pytest.raises(jaxkv.KeyTypeError, match="str keys"):
        jaxkv.init(state, 3, jnp.zeros(1))
    with pytest.raises(jaxkv.KeyTypeError, match="int or a str"):
        jaxkv.init(cpu_empty(), 1.5, jnp.zeros(1))
    with pytest.raises(jaxkv.KeyTypeError, match="one kind"):
        jaxkv.init(cpu_empty(), [1, "a"], [jnp.zeros(1), jnp.zeros(1)])


def test_push_is_pure_unless_donated(state):
    new = jaxkv.push(state, "w", jnp.ones((2, 3)))
    np.testing.assert_array_equal(state["w"], np.zeros((2, 3)))
    np.testing.assert_array_equal(new["w"], np.ones((2, 3)))
    old_b = state["b"]
    donated = jaxkv.push(new, "w", jnp.full((2, 3), 5.0), updater=add, donate=True)
    assert any(x.is_deleted() for x in jax.tree_util.tree_leaves(new))  # what held "w"
    assert not old_b.is_deleted()  # keys not pushed keep their buffers
    np.testing.assert_array_equal(donated["w"], np.full((2, 3), 6.0))


def test_stored_values_never_share_the_pushers_buffers(state, devices):
    g = on(devices[0], np.ones((2, 3)))
    new = jaxkv.push(state, "w", g)  # assign: the stored value must be a copy
    jaxkv.push(new, "w", g, updater=add, donate=True)
    np.testing.assert_array_equal(g, np.ones((2, 3)))  # still alive and unchanged


def test_per_device_values_are_summed_and_stored_replicated(state, devices):
    grads = [on(d, np.full((2, 3), i + 1.0)) for i, d in enumerate(devices)]
    new = jaxkv.push(state, "w", grads)
    np.testing.assert_array_equal(new["w"], np.full((2, 3), 36.0))
    assert isinstance(new["w"].sharding, NamedSharding)
    assert new["w"].sharding.is_fully_replicated
    assert {s.device for s in new["w"].addressable_shards} == set(devices)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_any_number_of_devices_and_scalars(state, devices, n):
    new = jaxkv.push(
        state,
        ["b", "v"],
        [[on(d, 2.0) for d in devices[:n]], [on(d, np.arange(4.0)) for d in devices[-n:]]],
    )
    assert float(new["b"]) == 2.0 * n
    np.testing.assert_array_equal(new["v"], n * np.arange(4.0))


def test_same_device_and_off_store_values_are_summed_too(devices):
    s = jaxkv.init(jaxkv.empty(devices[:2]), 0, jnp.zeros(3))
    pushed = [
        on(devices[0], 1.0 * np.ones(3)),
        on(devices[0], 2.0 * np.ones(3)),
        on(devices[5], 4.0 * np.ones(3)),
    ]
    new = jaxkv.push(s, 0, pushed)
    np.testing.assert_array_equal(new[0], 7.0 * np.ones(3))
    assert new[0].sharding.device_set == set(devices[:2])


# -- every operation, eagerly and under jit (the `call` fixture runs each test both ways) ------
def test_init_adds_keys_and_leaves_the_state_alone(state, call):
    new = call(lambda s, x, y: jaxkv.init(s, {"n": x, "m": y}), state, jnp.arange(3.0), 2.5)
    assert new.keys() == ("b", "m", "n", "v", "w") and state.keys() == ("b", "v", "w")
    np.testing.assert_array_equal(new["n"], np.arange(3.0))
    assert float(new["m"]) == 2.5
    np.testing.assert_array_equal(new["v"], np.arange(4.0))


def test_push_sums_lists_and_duplicate_keys_then_updates_once_per_key(state, call):
    calls = []

    def counting(key, pushed, stored):
        calls.append(key)
        return stored * 10 + pushed

    new = call(
        lambda s, a, b: jaxkv.push(s, ["v", "b", "v"], [[a, 2 * a], 3.0, b], updater=counting),
        state,
        jnp.arange(4.0),
        jnp.full(4, 0.5),
    )
    np.testing.assert_array_equal(new["v"], np.arange(4.0) * 10 + 3 * np.arange(4.0) + 0.5)
    assert float(new["b"]) == 3.0
    assert sorted(calls) == ["b", "v"]  # one call per distinct key
    np.testing.assert_array_equal(state["v"], np.arange(4.0))  # pure


def test_push_widens_to_the_stored_dtype_and_refuses_a_lossy_cast(state, call):
    new = call(lambda s, x: jaxkv.push(s, {"v": x}), state, jnp.arange(4, dtype=jnp.int16) - 2)
    assert new["v"].dtype == jnp.float32
    np.testing.assert_array_equal(new["v"], np.arange(4.0) - 2)
    ints = jaxkv.init(cpu_empty(), {"i": jnp.zeros(3, jnp.int32)})
    new = call(lambda s, x: jaxkv.push(s, "i", x), ints, jnp.array([1, -2, 3], jnp.int8))
    assert new["i"].dtype == jnp.int32
    np.testing.assert_array_equal(new["i"], [1, -2, 3])
    with pytest.raises(jaxkv.DtypeError, match="key 'i': the pushed value has dtype float32"):
        call(lambda s, x: jaxkv.push(s, "i", x), ints, jnp.array([1.0, -2.0, 3.0]))


def test_pull_returns_the_stored_values(state, call):
    pushed = jaxkv.push(state, "w", jnp.arange(6.0).reshape(2, 3))
    w, v, w2 = call(lambda s: jaxkv.pull(s, ["w", "v", "w"]), pushed)
    np.testing.assert_array_equal(w, np.arange(6.0).reshape(2, 3))
    np.testing.assert_array_equal(w2, w)
    np.testing.assert_array_equal(v, np.arange(4.0))
    np.testing.assert_array_equal(call(lambda s: jaxkv.pull(s, "v"), pushed), np.arange(4.0))


def test_pushpull_returns_the_new_state_and_value(state, call):
    new, out = call(
        lambda s, g: jaxkv.pushpull(s, ["v", "b"], [[g, g], 1.0], updater=add), state, jnp.ones(4)
    )
    np.testing.assert_array_equal(out[0], np.arange(4.0) + 2)
    assert float(out[1]) == 1.0
    np.testing.assert_array_equal(new["v"], out[0])
    np.testing.assert_array_equal(state["v"], np.arange(4.0))


def test_row_sparse_pull_keeps_the_requested_rows(call):
    s = jaxkv.init(cpu_empty(), "e", jnp.arange(12.0).reshape(4, 3))
    rows = call(lambda s, ids: jaxkv.row_sparse_pull(s, "e", ids), s, jnp.array([3, 1, 1]))
    expected = np.arange(12.0).reshape(4, 3)
    expected[[0, 2]] = 0
    np.testing.assert_array_equal(rows, expected)


def test_traced_row_ids_outside_the_value_select_no_row():
    s = jaxkv.init(cpu_empty(), "e", jnp.arange(12.0).reshape(4, 3))
    rows = jax.jit(lambda s, ids: jaxkv.row_sparse_pull(s, "e", ids))(s, jnp.array([-1, 4, 1]))
    expected = np.zeros((4, 3))
    expected[1] = [3.0, 4.0, 5.0]  # not the last row for -1, nothing for 4
    np.testing.assert_array_equal(rows, expected)


@pytest.mark.parametrize("ids", [[-1], [0, -4], [4], [1.5], ["a"]])
def test_row_ids_that_are_not_rows_are_refused(ids):
    s = jaxkv.init(cpu_empty(), "e", jnp.arange(12.0).reshape(4, 3))
    with pytest.raises(jaxkv.KVStoreError, match=r"key 'e': row_ids expected integers in \[0, 4\)"):
        jaxkv.row_sparse_pull(s, "e", ids)


ADAM = optax.adam(0.1)  # one object for every test: its computations compile once


@pytest.mark.standard_promotion  # Adam
def test_optax_updater_carries_its_state_from_push_to_push(state, call):
    """Adam with gradients that change sign and size: a reset moment (or count) shows."""
    grads = [np.array(g, np.float32) for g in ([1, -2, 3, 0.5], [-4, 1, 0, 2], [0.1, 0.1, 5, -1])]
    params, opt_state = jnp.arange(4.0), ADAM.init(jnp.arange(4.0))
    s = state
    for g in grads:
        s = call(lambda s, g: jaxkv.push(s, "v", g, updater=ADAM), s, g)
        updates, opt_state = ADAM.update(jnp.asarray(g), opt_state, params)
        params = optax.apply_updates(params, updates)
        # atol: one element ends near 0 (-0.0024, after steps of 0.1), where a float32
        # rounding of the steps (JAX 0.8.1 fuses Adam differently) is 4e-6 of it.
        np.testing.assert_allclose(s["v"], params, rtol=1e-6, atol=1e-7)
        for a, b in zip(
            jax.tree_util.tree_leaves(s.opt_states[("v",)]), jax.tree_util.tree_leaves(opt_state)
        ):
            np.testing.assert_allclose(a, b, rtol=1e-6)
    assert s.opt_group("w") is None  # keys not pushed get no optimizer state


def test_pull_places_results_on_exactly_the_requested_devices(state, devices):
    one = jaxkv.pull(state, "v", devices=devices[3])
    assert one.devices() == {devices[3]}
    two = jaxkv.pull(state, ["v", "w"], devices=[jaxkv.cpu(1), jaxkv.cpu(2)])
    for x in two:
        assert x.sharding.device_set == {devices[1], devices[2]}
        assert x.sharding.is_fully_replicated
    dup = jaxkv.pull(state, ["v", "v"])
    np.testing.assert_array_equal(dup[0], dup[1])


def test_pushpull_returns_the_new_value(state, devices):
    new, out = jaxkv.pushpull(
        state, "v", [on(d, np.ones(4)) for d in devices[:4]], updater=add, devices=devices[:4]
    )
    np.testing.assert_array_equal(out, np.arange(4.0) + 4.0)
    assert out.sharding.device_set == set(devices[:4])
    np.testing.assert_array_equal(new["v"], out)


# -- refusals leave the state as it was ------------------------------------------------------
@pytest.mark.parametrize(
    "call, error, pattern",
    [
        (lambda s: jaxkv.push(s, "nope", jnp.ones(1)), jaxkv.UnknownKeyError, "'nope'"),
        (
            lambda s: jaxkv.push(s, ["v", "w"], [jnp.ones(4), jnp.ones((3, 2))]),
            jaxkv.ShapeError,
            r"key 'w'.*\(3, 2\).*\(2, 3\)",
        ),
        (lambda s: jaxkv.push(s, ["v", "w"], [jnp.ones(4)]), jaxkv.ShapeError, "expected 2"),
        (lambda s: jaxkv.init(s, "v", jnp.ones(4)), jaxkv.DuplicateKeyError, "duplicate init"),
        (lambda s: jaxkv.push(s, "v", jnp.ones(4), axis_name="i"), jaxkv.KVStoreError, "axis_name"),
        (
            lambda s: jaxkv.push(s, "v", jnp.ones(4), updater=lambda k, p, st: p.sum()),
            jaxkv.ShapeError,
            r"updater returned shape \(\)",
        ),
        (lambda s: jaxkv.pull(s, 3), jaxkv.KeyTypeError, "str keys"),
        (lambda s: jaxkv.push(s, "v", jnp.ones(4, jnp.complex64)), jaxkv.DtypeError, "complex64"),
    ],
)
def test_refusals_name_the_key_and_change_nothing(state, call, error, pattern):
    before = snapshot(state)
    with pytest.raises(error, match=pattern):
        call(state)
    assert_same(state, before)
    # Errors are also the built-in kinds MXNet/Python users catch.
    assert issubclass(error, jaxkv.KVStoreError)


def test_unknown_key_errors_are_key_errors(state):
    with pytest.raises(KeyError):
        jaxkv.pull(state, "missing")
    # A failed pull does not poison a later init of that key (an MXNet 1.9.1 defect).
    s = jaxkv.init(state, "missing", jnp.ones(2))
    np.testing.assert_array_equal(jaxkv.pull(s, "missing"), np.ones(2))


# -- compile once per signature --------------------------------------------------------------
def test_no_recompiles_after_warm_up(state, devices, compiles):
    grads = {
        "w": [on(d, np.ones((2, 3))) for d in devices],
        "v": [on(d, np.ones(4)) for d in devices[:3]],
        "b": 1.0,
    }
    s = jaxkv.push(state, grads, updater=add)  # warm-up, the pull's views included
    s = jaxkv.push(s, "w", grads["w"], updater=add)
    jax.block_until_ready(jaxkv.pull(s, ["w", "v", "b"]))
    with compiles() as c:
        for _ in range(3):
            s = jaxkv.push(s, grads, updater=add)
            s = jaxkv.push(s, dict(reversed(list(grads.items()))), updater=add)  # other order
            s = jaxkv.push(s, "w", grads["w"], updater=add)
            jax.block_until_ready(jaxkv.pull(s, ["w", "v", "b"]))
    assert c.count == 0
    np.testing.assert_array_equal(s["w"], np.full((2, 3), 8.0 * 11))


def test_cached_push_computations_keep_no_arrays_alive(devices):
    """A push computation is cached per signature; it must not keep the state it was first
    built from (or that state's arrays) alive."""
    old = jaxkv.init(cpu_empty(), {"w": jnp.arange(7.0), "big": jnp.zeros((64, 512))})
    stored = [weakref.ref(old["w"]), weakref.ref(old["big"])]
    grads = [jax.device_put(jnp.ones((64, 512)), d) for d in devices]
    new = jaxkv.push(old, {"w": jnp.ones(7), "big": grads})
    del old
    gc.collect()
    assert [r() for r in stored] == [None, None]
    np.testing.assert_array_equal(new["big"], 8 * np.ones((64, 512)))


def test_compile_counter_sees_new_signatures(state, compiles):
    with compiles() as c:
        jaxkv.push(state, "v", jnp.ones(4), updater=lambda k, p, st: st - p)
    assert c.count >= 1


def test_key_order_does_not_change_the_bits(state, devices):
    rng = np.random.default_rng(0)
    vals = {
        "w": [on(d, rng.standard_normal((2, 3))) for d in devices],
        "v": [on(d, rng.standard_normal(4)) for d in devices],
    }
    a = jaxkv.push(state, ["w", "v"], [vals["w"], vals["v"]], updater=add)
    b = jaxkv.push(state, ["v", "w"], [vals["v"], vals["w"]], updater=add)
    for k in ("w", "v"):
        assert np.asarray(a[k]).tobytes() == np.asarray(b[k]).tobytes()


# -- inside the user's transformations --------------------------------------------------------
def test_inside_jit(state, compiles):
    @jax.jit
    def step(s, g):
        s = jaxkv.push(s, {"v": g, "b": g.sum()}, updater=add)
        return s, jaxkv.pull(s, "v")

    s, v = step(state, jnp.ones(4))
    np.testing.assert_array_equal(v, np.arange(4.0) + 1)
    assert float(s["b"]) == 4.0
    with compiles() as c:
        s, v = step(s, jnp.ones(4))
    assert c.count == 0
    np.testing.assert_array_equal(v, np.arange(4.0) + 2)


def test_inside_pmap_values_are_summed_once(state, devices):
    step = jax.pmap(
        lambda s, g: jaxkv.push(s, {"v": g}, updater=add, axis_name="i"),
        axis_name="i",
        in_axes=(None, 0),
        out_axes=None,
        devices=devices,
    )
    new = step(state, jnp.ones((8, 4)))
    np.testing.assert_array_equal(new["v"], np.arange(4.0) + 8)


@pytest.mark.parametrize("check_vma", [True, False])
def test_inside_shard_map_gradients_are_not_summed_twice(state, devices, check_vma):
    mesh = Mesh(np.array(devices), ("d",))

    def body(s, x):
        w = jaxkv.pull(s, "v")
        g = jax.grad(lambda w: jnp.sum(x @ w))(w)  # replicated parameter, sharded data
        return jaxkv.push(s, {"v": g, "b": jnp.sum(x)}, axis_name="d")

    step = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(), P("d")), out_specs=P(), check_vma=check_vma)
    )
    x = jnp.ones((16, 4))
    new = step(state, x)
    np.testing.assert_array_equal(new["v"], np.full(4, 16.0))  # the full-batch gradient
    assert float(new["b"]) == 64.0


def test_axis_name_outside_a_mapped_context_is_refused(state):
    with pytest.raises(jaxkv.KVStoreError, match="not bound"):
        jax.jit(lambda s, g: jaxkv.push(s, "v", g, axis_name="nope"))(state, jnp.ones(4))


def test_state_is_a_pytree_of_arrays(state):
    new = jaxkv.push(state, "v", jnp.ones(4), updater=optax.sgd(0.1))
    leaves = jax.tree_util.tree_leaves(new)
    assert leaves and all(isinstance(x, jax.Array) for x in leaves)
    doubled = jax.tree_util.tree_map(lambda x: x * 2, new)
    assert isinstance(doubled, jaxkv.KVState) and doubled.keys() == new.keys()
    with pytest.raises(AttributeError):
        new.foo = 1


@pytest.mark.standard_promotion  # Adam
def test_an_optimizer_push_compiles_once(state, devices, compiles):
    opt = optax.adam(0.01)  # a fresh optimizer: nothing of it compiled yet
    grads = [on(d, np.ones(4)) for d in devices]
    s = jaxkv.push(state, "v", grads, updater=opt)  # initialises the optimizer state first
    jax.block_until_ready(s["v"])  # (a read of a flat state compiles its views once)
    with compiles() as c:
        for _ in range(3):
            s = jaxkv.push(s, "v", grads, updater=opt)
        jax.block_until_ready(s["v"])
    assert c.count == 0
