"""jaxkv/_src/core/ops.py: what an init adds and refuses, where a pull places its values, and
which optimizer groups init_optimizer keeps, replaces or refuses."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxkv
from jaxkv._src.core import ops


@pytest.fixture(scope="module")
def two(devices):
    """A store over 2 devices, one array per key."""
    return ops.init(jaxkv.empty(devices[:2], layout="keys"), {"a": jnp.arange(3.0)})


# -- init ------------------------------------------------------------------------------------
def test_checked_inits_gives_the_new_values_in_call_order_and_changes_nothing(two):
    new = ops.checked_inits(two, ["c", "b"], [jnp.ones(2), np.zeros(1, np.int32)])
    assert list(new) == ["c", "b"]
    assert isinstance(new["b"], jax.Array) and new["b"].dtype == jnp.int32
    assert two.keys() == ("a",)


@pytest.mark.parametrize(
    ("keys", "pending", "message"),
    [
        (1, None, r"key 1: expected str keys, given a int key"),  # the store's kind
        (["b", 2], None, r"key 2: expected str keys, given a int key"),
    ],
)
def test_a_key_of_another_kind_than_the_stores_is_refused(two, keys, pending, message):
    values = [jnp.ones(1)] * len(keys) if isinstance(keys, list) else jnp.ones(1)
    with pytest.raises(jaxkv.KeyTypeError, match=message):
        ops.checked_inits(two, keys, values, pending)


def test_an_empty_store_takes_the_kind_of_the_pending_keys_else_of_the_first_key(devices):
    empty = jaxkv.empty(devices[:1])
    with pytest.raises(jaxkv.KeyTypeError, match=r"key 1: expected str keys, given a int key"):
        ops.checked_inits(empty, 1, jnp.ones(1), pending={"p": jnp.ones(1)})
    with pytest.raises(jaxkv.KeyTypeError, match=r"key 'x': expected int keys, given a str"):
        ops.checked_inits(empty, [3, "x"], [jnp.ones(1), jnp.ones(1)])
    assert list(ops.checked_inits(empty, [3, 1], [jnp.ones(1), jnp.ones(1)])) == [3, 1]


@pytest.mark.parametrize(
    ("keys", "values", "pending", "hint"),
    [
        ("a", jnp.ones(3), None, False),  # already in the store
        ("p", jnp.ones(3), {"p": jnp.ones(3)}, False),  # an init not yet run
        (["q", "q"], [jnp.ones(1), jnp.ones(1)], None, False),  # twice in the call
        ("a", [jnp.ones(3), jnp.ones(3)], None, True),  # a list of values: the hint
    ],
)
def test_a_key_already_there_pending_or_repeated_is_refused(two, keys, values, pending, hint):
    with pytest.raises(jaxkv.DuplicateKeyError) as err:
        ops.checked_inits(two, keys, values, pending)
    key = keys[0] if isinstance(keys, list) else keys
    message = str(err.value)
    assert message.startswith(f"duplicate init of key {key!r}: expected a key not yet")
    assert message.endswith("(init takes one value per key)") == hint


def test_a_list_of_values_for_a_new_key_is_refused_naming_how_many(two):
    with pytest.raises(
        jaxkv.ShapeError, match=r"key 'n': init expects one value, given a list of 2"
    ):
        ops.checked_inits(two, "n", [jnp.ones(1), jnp.ones(1)])
    assert ops.checked_inits(two, "n", [jnp.ones(1)])["n"].shape == (1,)  # a list of one: fine


def test_a_compressed_store_refuses_an_integer_value_and_gives_each_key_a_zero_residual(devices):
    store = jaxkv.empty(devices[:2], compression={"type": "2bit", "threshold": 0.5})
    with pytest.raises(jaxkv.KVStoreError, match=r"key 'i'.*given dtype int32"):
        ops.init(store, {"f": jnp.ones(3), "i": jnp.ones(3, jnp.int32)})
    state = ops.init(store, {"f": jnp.ones((3, 2))})
    residual = state.residuals["f"]
    assert residual.shape == (6, 2) and residual.dtype == jnp.float32  # one block per device
    assert not np.asarray(residual).any()
    for kind in ("fp16", "bf16"):  # only 2-bit compression keeps residuals
        other = ops.init(jaxkv.empty(devices[:2], compression={"type": kind}), {"f": jnp.ones(3)})
        assert other.residuals["f"] is None


def test_a_2bit_store_refuses_traced_values_at_init(devices):
    store = jaxkv.empty(devices[:1], compression={"type": "2bit", "threshold": 0.5})
    with pytest.raises(jaxkv.KVStoreError, match=r"keys \['t'\]: .*expects eager values"):
        jax.jit(lambda x: ops.init(store, {"t": x}))(jnp.ones(2))


# -- push and pull ---------------------------------------------------------------------------
def test_an_eager_push_with_an_axis_name_is_refused_and_changes_nothing(two):
    before = np.asarray(two["a"])
    with pytest.raises(jaxkv.KVStoreError, match=r"axis_name='i': expected to be called inside"):
        ops.push(two, "a", [jnp.ones(3), jnp.ones(3)], axis_name="i")
    np.testing.assert_array_equal(two["a"], before)
    assert two.keys() == ("a",)


def test_a_pull_to_other_devices_is_replicated_on_exactly_those(two, devices):
    for target in ([devices[1]], [devices[2], devices[5]]):
        (got,) = ops.pull(two, ["a"], devices=target)
        assert got.sharding.device_set == set(target)
        assert got.sharding.is_fully_replicated
        np.testing.assert_array_equal(got, [0.0, 1.0, 2.0])
    # To the store's own devices, a replicated value is the stored array itself.
    assert ops.pull(two, "a", devices=devices[:2]) is two["a"]


def test_a_split_value_pulled_to_the_stores_own_devices_is_gathered_whole(devices):
    # A flat bucket of at least the bound (here 4 elements) is split over the 2 devices.
    state = ops.init(
        jaxkv.empty(devices[:2], layout="flat", bigarray_bound=4), {"s": jnp.arange(5.0)}
    )
    assert state.flat_layout.parts_of(0) == 2
    got = ops.pull(state, "s", devices=devices[:2])
    assert got.sharding.is_fully_replicated and got.sharding.device_set == set(devices[:2])
    for shard in got.addressable_shards:
        np.testing.assert_array_equal(shard.data, np.arange(5.0))


def test_pushpull_of_a_mapping_pushes_its_values_and_pulls_its_keys(two):
    state = ops.init(two, {"b": jnp.zeros(2)})
    new, pulled = ops.pushpull(state, {"b": jnp.array([4.0, 5.0]), "a": jnp.array([1.0, 2, 3])})
    assert isinstance(pulled, list) and len(pulled) == 2
    np.testing.assert_array_equal(pulled[0], [4.0, 5.0])
    np.testing.assert_array_equal(pulled[1], [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(state["b"], [0.0, 0.0])  # the old state is unchanged


# -- init_optimizer --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def grouped(devices):
    """Keys a, b, c, d on one device; (a, b) one optimizer group."""
    state = ops.init(
        jaxkv.empty(devices[:1], layout="keys"), {k: jnp.ones(2) for k in ("a", "b", "c", "d")}
    )
    return ops.init_optimizer(state, optax.sgd(0.1), ["b", "a"])


def test_init_optimizer_refuses_what_is_not_an_optax_transformation(grouped):
    with pytest.raises(jaxkv.KVStoreError, match=r"given function"):
        ops.init_optimizer(grouped, lambda k, p, s: s)


def test_a_group_wholly_outside_the_keys_is_kept(grouped):
    state = ops.init_optimizer(grouped, optax.sgd(0.1), "c")
    assert set(state.opt_states) == {("a", "b"), ("c",)}


def test_a_group_wholly_inside_the_keys_is_replaced_by_one_sorted_group(grouped):
    state = ops.init_optimizer(grouped, optax.sgd(0.1), ["c", "b", "a", "c"])
    assert set(state.opt_states) == {("a", "b", "c")}
    assert set(ops.init_optimizer(grouped, optax.sgd(0.1)).opt_states) == {("a", "b", "c", "d")}


@pytest.mark.parametrize("keys", [["a"], ["c", "b"]])
def test_a_group_partly_inside_the_keys_is_refused_naming_the_keys_left_out(grouped, keys):
    inside = next(k for k in ("a", "b") if k in keys)
    left = [k for k in ("a", "b") if k not in keys]
    with pytest.raises(jaxkv.KVStoreError) as err:
        ops.init_optimizer(grouped, optax.sgd(0.1), keys)
    assert str(err.value).startswith(
        f"keys {sorted(keys)}: key {inside!r} belongs to the optimizer group ['a', 'b'], "
        f"expected a group inside the keys given, given keys without {left}"
    )
    assert set(grouped.opt_states) == {("a", "b")}
