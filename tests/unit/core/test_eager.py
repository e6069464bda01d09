"""jaxkv/_src/core/eager.py: how each key's contributions are laid out and summed, which buffers
a push may reuse, and the cache of push computations."""

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxkv
from jaxkv._src.core import eager
from jaxkv._src.core.signature import PushOptions
from jaxkv._src.state import buckets


def _on(x, device):
    return jax.device_put(np.asarray(x), device)


def _add(key, pushed, stored):
    return stored * 10 + pushed


# -- donation and the cache of computations ---------------------------------------------------
@pytest.mark.parametrize(
    ("donate", "argnums"), [(True, (0, 1, 2)), (False, ()), (eager.KEEP_VALUES, (1, 2))]
)
def test_what_a_push_may_reuse(donate, argnums):
    # (stored values, optimizer state, residuals): KEEP_VALUES keeps only the stored values
    assert eager._donated(donate) == argnums


def test_the_cache_keeps_exactly_its_size_and_drops_the_least_recently_used():
    cache = eager._Computations(size=2)
    built = []

    def get(sig):
        return cache.get(sig, lambda key: built.append(key) or key)

    assert get("a") == "a" and get("b") == "b"
    assert get("a") == "a" and built == ["a", "b"]  # both kept at exactly the size
    get("c")  # one over: b, the least recently used (a was just asked for), goes
    assert get("a") == "a" and built == ["a", "b", "c"]
    get("b")
    assert built == ["a", "b", "c", "b"]


def test_a_cached_computation_is_used_only_with_the_very_updater_it_was_built_for():
    """The options compare their updater by identity, and a key holding them holds the
    updater alive (its id cannot be reused while the computation is cached)."""
    cache = eager._Computations()
    first, second = _add, lambda k, p, s: p
    like_first = lambda k, p, s: s * 10 + p  # noqa: E731 - the same function, another object
    assert PushOptions(updater=first) == PushOptions(updater=first)
    assert hash(PushOptions(updater=first)) == hash(PushOptions(updater=first))
    assert PushOptions(updater=first) != PushOptions(updater=like_first)
    assert PushOptions(updater=first) != PushOptions(updater=first, donate=True)
    assert PushOptions(updater=first) != PushOptions(updater=first, reduce="mean")
    assert cache.get(PushOptions(updater=first), lambda _: 1) == 1
    assert cache.get(PushOptions(updater=first), lambda _: 2) == 1
    assert cache.get(PushOptions(updater=second), lambda _: 3) == 3
    # The computation is built from the key alone, the updater in its options.
    got = cache.get(PushOptions(updater=like_first), lambda key: key.updater)
    assert got is like_first
    held = weakref.ref(second)
    del second
    gc.collect()
    assert held() is not None  # kept alive by the cached key


# -- sums on the host ------------------------------------------------------------------------
@pytest.mark.parametrize("count", [2, 3, 4])
def test_a_host_sum_adds_every_value_once_into_a_fresh_buffer(devices, count):
    parts = [np.arange(3, dtype=np.int32) * 10**i for i in range(count)]
    xs = [_on(p, devices[i % 2]) for i, p in enumerate(parts)]
    out = eager._host_sum(xs)
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out, np.sum(parts, axis=0))
    assert not any(np.shares_memory(out, np.asarray(x)) for x in xs)
    np.testing.assert_array_equal(xs[0], parts[0])  # the first value is left as it was


def test_numpy_adds_on_the_host_only_cpu_numbers_of_the_stored_dtype(devices):
    def ones(dtype, device=devices[0]):
        return jax.device_put(jnp.ones(2, dtype), device)

    for dtype in (jnp.float32, jnp.int32, jnp.uint8):
        assert eager._host_addable([ones(dtype), ones(dtype, devices[1])], dtype)
    assert not eager._host_addable([ones(jnp.bool_)] * 2, jnp.bool_)
    assert not eager._host_addable([ones(jnp.complex64)] * 2, jnp.complex64)
    assert not eager._host_addable([ones(jnp.float32), ones(jnp.float16)], jnp.float32)
    spread = jax.device_put(
        jnp.ones(2),
        jax.sharding.NamedSharding(
            jax.sharding.Mesh(np.array(devices[:2]), ("x",)), jax.sharding.PartitionSpec()
        ),
    )
    assert not eager._host_addable([ones(jnp.float32), spread], jnp.float32)


def test_local_sums_give_each_key_its_own_sum_on_the_home_device_in_its_dtype(devices):
    home = devices[0]
    state = jaxkv.init(
        jaxkv.empty([home], layout="keys"),
        {0: jnp.zeros(3), 1: jnp.zeros(2, jnp.int32), 2: jnp.zeros(2), 3: jnp.zeros(3)},
    )
    xss = [
        [_on([1.0, 2, 3], home), _on([10.0, 20, 30], devices[1]), _on([100.0, 0, 0], home)],
        [_on(np.array([7, 8], np.int32), devices[2])],  # one value, elsewhere: moved home
        [_on(np.array([1, 2], np.int32), home), _on(np.array([0.5, 0.5], np.float32), home)],
        [_on(np.array([1.5, 2.5, 3.5], np.float16), devices[3])],  # one value, cast
    ]
    stored = [state[k] for k in range(4)]
    out = eager.local_sums(state, [0, 1, 2, 3], stored, xss)
    want = [[111.0, 22, 33], [7, 8], [1.5, 2.5], [1.5, 2.5, 3.5]]
    for x, s, w in zip(out, stored, want):
        assert x.dtype == s.dtype
        assert x.sharding.device_set == {home}
        np.testing.assert_array_equal(x, w)


# -- laying out one key's contributions --------------------------------------------------------
@pytest.fixture(scope="module")
def four(devices):
    """A store over 4 devices with one float32 key of shape (2,)."""
    return jaxkv.init(jaxkv.empty(devices[:4], layout="keys"), {"k": jnp.zeros(2)})


def _blocks(x, n=4):
    """The per-device blocks of a stacked layout, in mesh order."""
    return np.asarray(x).reshape(n, -1)


def test_one_value_is_placed_as_it_is(four, devices):
    kind, x = eager._layout(four, four["k"], [_on([1.0, 2.0], devices[2])])
    assert kind == "one"
    assert x.sharding == four.sharding_for((2,))
    np.testing.assert_array_equal(x, [1.0, 2.0])


def test_one_value_per_device_in_order_is_stacked_block_by_block(four, devices):
    xs = [_on([i, 10 * i], d) for i, d in enumerate(devices[:4], start=1)]
    kind, x = eager._layout(four, four["k"], xs)
    assert kind == "stacked" and x.shape == (8,)
    np.testing.assert_array_equal(_blocks(x), [[1, 10], [2, 20], [3, 30], [4, 40]])


def test_values_on_some_devices_in_any_order_are_stacked_at_their_positions(four, devices):
    # Devices 3 and 1 pushed (in that order), devices 0 and 2 did not: their blocks are zeros.
    # One value is float16: all are cast to the stored float32.
    xs = [_on([3.0, 30.0], devices[3]), _on(np.array([1.0, 10.0], np.float16), devices[1])]
    kind, x = eager._layout(four, four["k"], xs)
    assert kind == "stacked" and x.dtype == jnp.float32
    np.testing.assert_array_equal(_blocks(x), [[0, 0], [1, 10], [0, 0], [3, 30]])


@pytest.mark.parametrize("where", [(0, 0), (1, 5)])  # twice on one device; one outside
def test_values_that_cannot_be_one_per_store_device_are_summed_where_the_store_keeps_them(
    four, devices, where
):
    xs = [_on([1.0, 2.0], devices[where[0]]), _on([10.0, 20.0], devices[where[1]])]
    kind, x = eager._layout(four, four["k"], xs)
    assert kind == "one"
    assert x.sharding == four.sharding_for((2,))
    np.testing.assert_array_equal(x, [11.0, 22.0])


def test_a_compressed_push_refuses_a_value_over_several_devices_before_laying_it_out(devices):
    spread = jnp.ones(
        2,
        device=jax.sharding.NamedSharding(
            jax.sharding.Mesh(np.array(devices[:2]), ("x",)), jax.sharding.PartitionSpec()
        ),
    )
    plain = jaxkv.init(jaxkv.empty(devices[:2], layout="keys"), {"k": jnp.zeros(2)})
    eager.check_laid_out(plain, {"k": [spread]})  # an uncompressed store takes it
    packed = jaxkv.init(jaxkv.empty(devices[:2], compression={"type": "fp16"}), {"k": jnp.zeros(2)})
    eager.check_laid_out(packed, {"k": [_on([1.0, 1.0], devices[0])]})
    with pytest.raises(jaxkv.KVStoreError, match=r"key 'k': a compressed push expects each"):
        eager.check_laid_out(packed, {"k": [_on([1.0, 1.0], devices[0]), spread]})


# -- the push computations ---------------------------------------------------------------------
def test_initialising_no_keys_returns_the_state_itself_and_a_group_is_sorted(four):
    assert eager.init_opt_states(four, optax.sgd(0.1), []) is four
    state = jaxkv.init(four, {"a": jnp.zeros(1)})
    state = eager.init_opt_states(state, optax.sgd(0.1), ["k", "a", "k"])
    assert state.groups == (("a", "k"),)


def test_an_assigned_value_is_a_copy_that_a_later_donating_push_leaves_alone(devices):
    state = jaxkv.init(jaxkv.empty(devices[:2], layout="keys"), {"a": jnp.zeros(3)})
    mine = jax.device_put(jnp.arange(3.0), state.sharding_for((3,)))
    state = eager.push_eager(
        state, {"a": [mine]}, [0], [state["a"]], None, PushOptions(updater=None)
    )
    stored = state["a"]
    state = eager.push_eager(
        state, {"a": [jnp.ones(3)]}, [0], [stored], None, PushOptions(updater=_add, donate=True)
    )
    assert stored.is_deleted()  # the donated value was the store's own
    assert not mine.is_deleted()
    np.testing.assert_array_equal(mine, [0.0, 1.0, 2.0])
    np.testing.assert_array_equal(state["a"], [1.0, 11.0, 21.0])


@pytest.mark.parametrize(
    ("donate", "values_reused", "opt_reused"),
    [(True, True, True), (eager.KEEP_VALUES, False, True), (False, False, False)],
)
def test_a_push_reuses_exactly_the_buffers_its_donation_allows(
    devices, donate, values_reused, opt_reused
):
    opt = optax.sgd(1.0, momentum=0.5)
    state = jaxkv.init(jaxkv.empty(devices[:1], layout="keys"), {"a": jnp.full(2, 4.0)})
    state = eager.init_opt_states(state, opt, ["a"])
    stored, trace = state["a"], state.opt_states[("a",)][0].trace["a"]
    new = eager.push_eager(
        state,
        {"a": [jnp.ones(2)]},
        [0],
        [stored],
        state.opt_states[("a",)],
        PushOptions(updater=opt, donate=donate),
    )
    assert stored.is_deleted() == values_reused
    assert trace.is_deleted() == opt_reused
    np.testing.assert_array_equal(new["a"], [3.0, 3.0])  # 4 - 1 * (1 + 0.5 * 0)


@pytest.mark.parametrize(
    ("donate", "reused"), [(True, [True, True]), (eager.KEEP_VALUES, [True, False])]
)
def test_a_flat_push_keeping_its_values_reuses_the_buckets_but_not_the_keys_alone(
    devices, donate, reused
):
    # Bound 4 on 2 devices: "s" (4 elements) is sharded, an array of its own; "b" is bucketed.
    state = jaxkv.init(
        jaxkv.empty(devices[:2], layout="auto", bigarray_bound=4),
        {"b": jnp.arange(3.0), "s": jnp.arange(4.0)},
    )
    assert state.flat_layout.where == ((0, 0, 3), (-1, 0, 4))
    leaves = state.leaves
    stored = [buckets.stored_type(state, i) for i in (0, 1)]
    grouped = {"b": [jnp.ones(3)], "s": [jnp.ones(4)]}
    new = eager.push_eager_flat(state, grouped, stored, PushOptions(updater=_add, donate=donate))
    assert [x.is_deleted() for x in leaves] == reused
    np.testing.assert_array_equal(new["b"], [1.0, 11.0, 21.0])
    np.testing.assert_array_equal(new["s"], [1.0, 11.0, 21.0, 31.0])


def test_a_flat_optax_push_keeping_its_values_steps_each_key_and_its_state(devices):
    opt = optax.sgd(1.0, momentum=0.5)
    state = jaxkv.init(
        jaxkv.empty(devices[:2], layout="auto", bigarray_bound=4),
        {"b": jnp.arange(3.0), "s": jnp.arange(4.0)},
    )
    state = jaxkv.init_optimizer(state, opt)
    alone = state.leaves[1]
    grads = {"b": [jnp.full(3, 2.0)], "s": [jnp.full(4, 3.0)]}
    for step in (1, 2):  # momentum's trace: g, then g + 0.5 g
        stored = [buckets.stored_type(state, i) for i in (0, 1)]
        state = eager.push_eager_flat(
            state, grads, stored, PushOptions(updater=opt, donate=eager.KEEP_VALUES)
        )
        trace = state.opt_states[("b", "s")][0].trace
        for k, g, start in (("b", 2.0, np.arange(3.0)), ("s", 3.0, np.arange(4.0))):
            np.testing.assert_array_equal(
                trace[k], np.full(start.shape, g * (1 + 0.5 * (step - 1)))
            )
            np.testing.assert_array_equal(state[k], start - g * (1 if step == 1 else 2.5))
    assert not alone.is_deleted()


# -- a split bucket --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def split(devices):
    """A flat store over 2 devices with two split buckets: float32 (3 + 4 + 5 elements, each
    padded to whole blocks: 2 + 2 + 3 a device) and float16 (4 elements)."""
    values = {
        0: jnp.arange(3.0),
        1: jnp.arange(4.0).reshape(2, 2),
        2: jnp.arange(5.0),
        3: jnp.arange(4, dtype=jnp.float16),
    }
    state = jaxkv.init(jaxkv.empty(devices[:2], layout="flat", bigarray_bound=4), values)
    assert state.flat_layout.buckets == (("float32", 14), ("float16", 4))
    assert state.flat_layout.parts == (2, 2)
    return state


def _per_device(devices, shapes, seed):
    rng = np.random.default_rng(seed)
    return [[rng.integers(-9, 9, s).astype(np.float32) for _ in range(2)] for s in shapes]


def _push_split(state, devices, keys, parts, updater):
    grouped = {k: [_on(p, d) for p, d in zip(ps, devices)] for k, ps in zip(keys, parts)}
    stored = [buckets.stored_type(state, state.index(k)) for k in keys]
    return eager.push_eager_flat(state, grouped, stored, PushOptions(updater=updater))


@pytest.mark.parametrize("keys", [[0, 2], [1], [2, 3], [0, 1, 2, 3]])
def test_per_device_values_to_keys_of_split_buckets_each_get_their_own_sum(split, devices, keys):
    shapes = [split.shapes[k] for k in keys]
    parts = _per_device(devices, shapes, seed=len(keys))
    new = _push_split(split, devices[:2], keys, parts, _add)
    for k in range(4):
        old = np.asarray(split[k])
        want = old * 10 + np.sum(parts[keys.index(k)], axis=0) if k in keys else old
        assert new[k].dtype == old.dtype
        np.testing.assert_array_equal(new[k], want)


def test_an_optax_push_to_a_split_bucket_with_some_keys_whole_gives_each_its_step(split, devices):
    # Key 1 comes as one value, keys 0 and 2 one per device: the bucket's gradient cannot be
    # taken from the per-device sums alone.
    opt = optax.sgd(0.5)
    state = jaxkv.init_optimizer(split, opt, [0, 1, 2])
    parts = _per_device(devices, [(3,), (5,)], seed=7)
    grouped = {
        0: [_on(p, d) for p, d in zip(parts[0], devices)],
        1: [jnp.full((2, 2), 2.0)],
        2: [_on(p, d) for p, d in zip(parts[1], devices)],
    }
    stored = [buckets.stored_type(state, i) for i in range(3)]
    new = eager.push_eager_flat(state, grouped, stored, PushOptions(updater=opt))
    np.testing.assert_array_equal(new[0], np.arange(3.0) - 0.5 * np.sum(parts[0], axis=0))
    np.testing.assert_array_equal(new[1], np.arange(4.0).reshape(2, 2) - 1.0)
    np.testing.assert_array_equal(new[2], np.arange(5.0) - 0.5 * np.sum(parts[1], axis=0))


def test_an_updater_made_anew_at_every_push_is_named_once_in_a_warning(caplog):
    """Each push with a new optax object compiles the push again (a computation is kept per
    updater object): from the fourth such compile of the same push a warning names the key and
    says to make the updater once; it is said once, and never for one updater object reused."""
    state = jaxkv.init(jaxkv.empty(), {"anew": jnp.zeros((3, 5)), "kept": jnp.zeros((5, 3))})
    tx = optax.sgd(0.5)
    with caplog.at_level("WARNING", logger="jaxkv"):
        for _ in range(6):
            state = jaxkv.push(state, "kept", jnp.ones((5, 3)), updater=tx)
        assert "updater made anew" not in caplog.text
        for _ in range(3):
            state = jaxkv.push(state, "anew", jnp.ones((3, 5)), updater=optax.sgd(0.5))
        assert "updater made anew" not in caplog.text
        for _ in range(3):
            state = jaxkv.push(state, "anew", jnp.ones((3, 5)), updater=optax.sgd(0.5))
    said = [r.getMessage() for r in caplog.records if "updater made anew" in r.getMessage()]
    assert len(said) == 1 and "key 'anew'" in said[0] and "compiled 4 times" in said[0], said
    np.testing.assert_array_equal(np.asarray(jaxkv.pull(state, "anew")), np.full((3, 5), -3.0))
