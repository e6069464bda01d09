"""jaxkv/_src/core/plans.py: which calls a plan replays, each value reaching its own key and each
out its own value, and the cache of plans."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxkv
from jaxkv._src.core import plans
from jaxkv._src.core.signature import PushOptions
from jaxkv._src.jax_internals import per_device
from jaxkv._src.state.kvstate import KVState

_OPTIONS = PushOptions(updater=None)  # an assignment, nothing donated


def _on(x, device):
    return jax.device_put(np.asarray(x, np.float32), device)


def _add(key, pushed, stored):
    return stored * 10 + pushed


def _cached(state, ckeys):
    """The push plans cached for ``state``'s key set and devices and the call keys ``ckeys``."""
    return [
        plan
        for sig, plan in plans._PUSHES._plans.items()
        if (sig[0], sig[3].devices, sig[4]) == (id(state.keys()), state.devices, ckeys)
    ]


@pytest.fixture(autouse=True)
def _no_plans():
    """Each test starts with no push plans cached: a plan never made (``NO_PLAN``) keeps no key
    set alive, so a later key set could reuse its id and seem to have it."""
    plans._PUSHES.clear()


@pytest.fixture
def store(devices):
    """A store over 2 devices, one array per key."""
    values = {"a": jnp.arange(2.0), "b": jnp.arange(2.0) + 5, "c": jnp.arange(3.0)}
    return jaxkv.init(jaxkv.empty(devices[:2], layout="keys"), values)


# -- the cache and the call forms ------------------------------------------------------------
def test_the_cache_keeps_exactly_its_size_and_drops_the_least_recently_used():
    cache = plans._Plans(size=2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1 and cache.get("b") == 2  # both kept at exactly the size
    assert cache.get("a") == 1
    cache.put("c", 3)  # one over: b, the least recently used, goes
    assert (cache.get("a"), cache.get("b"), cache.get("c")) == (1, None, 3)


@pytest.mark.parametrize(
    ("keys", "values", "want"),
    [
        ("a", 1, (("a",), 1, [1])),
        (["a", "b"], [1, 2], (("a", "b"), 1, [1, 2])),
        (("a", "b"), ([1, 2], [3, 4]), (("a", "b"), 2, [1, 2, 3, 4])),
        ([0], [(5,)], ((0,), 1, [5])),  # one key with a list of one item
    ],
)
def test_a_call_a_plan_can_replay(keys, values, want):
    ckeys, _, per, flat = plans._call(keys, values)
    assert (ckeys, per, list(flat)) == want


@pytest.mark.parametrize(
    ("keys", "values"),
    [
        (["a"], 1),  # a list of keys with one value
        (["a", "b"], [1]),  # one value short
        (["a"], [1, 2]),  # one value over
        ([], []),  # no keys
        ([np.int64(1)], [1]),  # a key the general path normalises
        ([True], [1]),  # a bool is no int key
        (["a", "b"], [1, [2]]),  # values of two kinds
        (["a", "b"], [[1], [2, 3]]),  # lists of two lengths
        (["a"], [[]]),  # no value at all
    ],
)
def test_any_other_call_is_left_to_the_general_path(keys, values):
    assert plans._call(keys, values) is None


def test_a_plan_is_anchored_to_the_very_key_set_shapes_and_groups(devices):
    state = KVState(
        keys=("a", "b"),
        devices=(devices[0],),
        values=[jnp.ones(1)] * 2,
        opt_states=["S"],
        groups=[("a",)],
    )
    plan = types.SimpleNamespace(keys=state.keys(), shapes_of=state.key_shapes, groups=state.groups)
    assert plans._anchored(plan, state)
    for field in ("keys", "shapes_of", "groups"):
        equal = types.SimpleNamespace(**vars(plan))
        setattr(equal, field, tuple(list(getattr(plan, field))))  # equal, another object
        assert getattr(equal, field) == getattr(plan, field)
        assert not plans._anchored(equal, state)


# -- pushes by plan --------------------------------------------------------------------------
@pytest.mark.parametrize("per_device", [False, True])
@pytest.mark.parametrize("ckeys", [["c", "a"], ["a", "b", "c"], ["b"]])
def test_each_value_reaches_its_own_key_whatever_the_call_order(store, devices, ckeys, per_device):
    rng = np.random.default_rng(len(ckeys))
    state = store
    for _ in range(2):  # the first call makes the plan, the second replays it
        values, sums = [], {}
        for k in ckeys:
            parts = [rng.integers(-9, 9, store.shapes[k]) for _ in range(2)]
            if per_device:
                values.append([_on(p, d) for p, d in zip(parts, devices[:2])])
                sums[k] = parts[0] + parts[1]
            else:
                values.append(_on(parts[0], devices[1]))
                sums[k] = parts[0]
        new = plans.push(state, ckeys, values, PushOptions(updater=_add))
        assert new is not None
        for k in "abc":
            want = np.asarray(state[k]) * 10 + sums[k] if k in ckeys else state[k]
            np.testing.assert_array_equal(new[k], want)
            assert new[k].sharding == store.sharding_for(store.shapes[k])
        state = new
    (plan,) = _cached(store, tuple(ckeys))
    assert plan.whole == (ckeys == ["a", "b", "c"])
    # The new state holds the very key set and shapes: later plans stay anchored.
    assert state.keys() is store.keys() and state.key_shapes is store.key_shapes


def test_a_value_off_a_one_device_store_is_put_there_and_one_on_it_is_not(devices):
    state = jaxkv.init(
        jaxkv.empty(devices[:1], layout="keys"), {"x": jnp.ones(2), "y": jnp.ones(3)}
    )
    # Call order y (on device 1), x (on the store's device 0).
    new = plans.push(
        state, ["y", "x"], [_on([1, 2, 3], devices[1]), _on([4, 5], devices[0])], _OPTIONS
    )
    (plan,) = _cached(state, ("y", "x"))
    assert [p for p, _ in plan.puts] == [1]  # y's sorted position alone
    assert new["x"].sharding.device_set == new["y"].sharding.device_set == {devices[0]}
    np.testing.assert_array_equal(new["x"], [4, 5])
    np.testing.assert_array_equal(new["y"], [1, 2, 3])


@pytest.mark.parametrize(
    ("n", "per"),
    [(2, 3), (1, 2), (4, 2)],  # one value over, and a list on a one-device store, or short
)
def test_values_per_key_other_than_one_or_one_per_device_are_never_planned(devices, n, per):
    state = jaxkv.init(jaxkv.empty(devices[:n], layout="keys"), {"a": jnp.ones(2)})
    values = [[_on([1, 1], devices[i % n]) for i in range(per)]]
    assert plans.push(state, ["a"], values, _OPTIONS) is None
    assert _cached(state, ("a",)) == [plans.NO_PLAN]


def test_a_repeated_key_or_a_scalar_per_device_is_never_planned(devices):
    state = jaxkv.init(
        jaxkv.empty(devices[:2], layout="keys"), {"a": jnp.ones(2), "s": jnp.ones(())}
    )
    assert plans.push(state, ["a", "a"], [jnp.ones(2), jnp.ones(2)], _OPTIONS) is None
    assert _cached(state, ("a", "a")) == [plans.NO_PLAN]
    scalars = [jax.device_put(jnp.ones(()), d) for d in devices[:2]]
    assert plans.push(state, ["s"], [scalars], _OPTIONS) is None
    assert _cached(state, ("s",)) == [plans.NO_PLAN]


def test_values_not_one_per_device_in_mesh_order_or_of_mixed_dtypes_are_not_planned_now(
    store, devices
):
    # Key c comes first in the call, as it should; key a second, not as it should.
    c = [_on([1, 1, 1], devices[0]), _on([2, 2, 2], devices[1])]
    swapped = [_on([1, 1], devices[1]), _on([2, 2], devices[0])]
    assert plans.push(store, ["c", "a"], [c, swapped], _OPTIONS) is None
    mixed = [_on([1, 1], devices[0]), jax.device_put(jnp.ones(2, jnp.float16), devices[1])]
    assert plans.push(store, ["c", "a"], [c, mixed], _OPTIONS) is None
    assert _cached(store, ("c", "a")) == []  # nothing cached: the next call may be planned
    ordered = [_on([1, 1], devices[0]), _on([2, 2], devices[1])]
    new = plans.push(store, ["c", "a"], [c, ordered], _OPTIONS)
    np.testing.assert_array_equal(new["a"], [3, 3])
    np.testing.assert_array_equal(new["c"], [3, 3, 3])


def test_a_later_call_unlike_its_plan_goes_the_general_way_and_keeps_the_plan(store, devices):
    assert plans.push(store, "a", _on([1, 2], devices[0]), _OPTIONS) is not None
    (plan,) = _cached(store, ("a",))
    assert (
        plans.push(store, "a", jax.device_put(jnp.ones(2, jnp.float16), devices[0]), _OPTIONS)
        is None
    )
    assert plans.push(store, "a", _on([1, 2], devices[1]), _OPTIONS) is None  # other device
    assert _cached(store, ("a",)) == [plan]


def test_a_value_of_the_plans_shape_and_dtype_replays_it_whatever_its_aval_object(store, devices):
    """The plan asks a call's types by its values' avals (the objects JAX interns), then by
    shape and dtype: a weakly typed value of the same shape and dtype replays the plan (an
    assignment: the key then holds it); a value of another shape does not."""
    assert plans.push(store, "a", _on([1, 2], devices[0]), _OPTIONS) is not None
    weak = jax.device_put(jnp.broadcast_to(jnp.array(3.0), (2,)), devices[0])
    assert weak.aval.weak_type and weak.aval is not _on([1, 2], devices[0]).aval
    new = plans.push(store, "a", weak, _OPTIONS)
    assert new is not None
    np.testing.assert_array_equal(jaxkv.pull(new, "a"), [3, 3])
    assert plans.push(store, "a", _on([[1, 2]], devices[0]), _OPTIONS) is None  # other shape


def test_a_refused_call_raises_as_the_general_path_and_caches_nothing(store):
    with pytest.raises(jaxkv.UnknownKeyError, match=r"key 'z' has not been initialised"):
        plans.push(store, ["a", "z"], [jnp.ones(2), jnp.ones(2)], _OPTIONS)
    with pytest.raises(jaxkv.ShapeError, match=r"key 'c': the pushed value has shape \(2,\)"):
        plans.push(store, ["c"], [jnp.ones(2)], _OPTIONS)
    assert _cached(store, ("a", "z")) == [] and _cached(store, ("c",)) == []


def test_a_compressed_store_is_never_planned(devices):
    state = jaxkv.init(jaxkv.empty(devices[:1], compression={"type": "fp16"}), {"a": jnp.ones(2)})
    assert plans.push(state, "a", jnp.ones(2), _OPTIONS) is None
    assert _cached(state, ("a",)) == []


def test_an_optax_push_by_plan_updates_its_own_group_and_keeps_the_others(devices):
    opt = optax.sgd(1.0, momentum=0.5)
    state = jaxkv.init(
        jaxkv.empty(devices[:1], layout="keys"), {k: jnp.full(2, 9.0) for k in ("a", "b", "c")}
    )
    state = jaxkv.init_optimizer(state, opt, ["a"])
    state = jaxkv.init_optimizer(state, opt, ["b", "c"])
    first = state.group_states[0]
    value = 9.0
    for trace in [1.0, 1.5]:  # momentum: 1, then 1 + 0.5 * 1
        state = plans.push(state, ["c", "b"], [jnp.ones(2), jnp.ones(2)], PushOptions(updater=opt))
        value -= trace  # learning rate 1
        assert len(state.group_states) == 2 and state.group_states[0] is first
        np.testing.assert_array_equal(state.opt_states[("b", "c")][0].trace["c"], [trace] * 2)
        np.testing.assert_array_equal(state["b"], [value] * 2)
    np.testing.assert_array_equal(state["a"], [9.0, 9.0])
    # Keys without optimizer state: the general path makes it, a plan never.
    fresh = jaxkv.init(state, {"d": jnp.ones(2)})
    assert plans.push(fresh, "d", jnp.ones(2), PushOptions(updater=opt)) is None
    assert _cached(fresh, ("d",)) == [plans.NO_PLAN]


# -- pulls by plan ---------------------------------------------------------------------------
def test_a_pull_by_plan_gives_the_stored_arrays_themselves(store, devices):
    assert plans.pull(store, "c", None) is store["c"]
    got = plans.pull(store, ["c", "a", "c"], list(devices[:2]))
    assert [x is store[k] for x, k in zip(got, "cac")] == [True] * 3


@pytest.mark.parametrize(
    ("keys", "where"),
    [([], None), ([np.int64(1)], None), (["a"], [0]), (["a"], [1, 0]), (["a"], [0, 1, 2])],
)
def test_a_pull_elsewhere_or_of_other_keys_is_left_to_the_general_path(store, devices, keys, where):
    target = None if where is None else [devices[i] for i in where]
    assert plans.pull(store, keys, target) is plans.NO_PLAN


def test_a_split_value_pulled_to_the_stores_devices_is_left_to_the_general_path(devices):
    state = jaxkv.init(
        jaxkv.empty(devices[:2], layout="keys", bigarray_bound=4), {"s": jnp.ones(4)}
    )
    assert plans.pull(state, "s", list(devices[:2])) is plans.NO_PLAN
    assert plans.pull(state, "s", None) is state["s"]


def test_a_pull_of_an_unknown_key_is_refused(store):
    with pytest.raises(jaxkv.UnknownKeyError, match=r"key 'q' has not been initialised"):
        plans.pull(store, ["a", "q"], None)


# -- outs filled by plan ---------------------------------------------------------------------
class _Out:
    """An out as the fill sees one (``NDArray``'s methods it calls)."""

    def __init__(self, shape, device, dtype=jnp.float32):
        self.data, self.device, self.got = jnp.zeros(shape, dtype, device=device), device, None

    def held_value(self):
        return self.data

    def jax_device(self):
        return self.device

    def set_value(self, x, device):
        self.got = (x, device)

    def set_part(self, whole, position, device):  # (taken out here, to look at)
        self.got = (per_device(whole)[position], device)


@pytest.mark.parametrize("lend", [True, False])
def test_each_out_gets_its_own_keys_value_on_its_own_device(store, devices, lend):
    d0, d1 = devices[:2]
    outs = [[_Out(3, d1), _Out(3, d0)], [_Out(2, d0), _Out(2, d1)], [_Out(2, d1), _Out(2, d1)]]
    go = plans.prepare_fill(store, ["c", "a", "a"], outs, _Out)
    assert go is not None and go(store, lend)
    for out, key in zip(outs, "caa"):
        for o in out:
            x, device = o.got
            assert device == o.device and x.sharding.device_set == {o.device}
            np.testing.assert_array_equal(x, store[key])
            stored = per_device(store[key])[devices.index(o.device)]
            assert (x.unsafe_buffer_pointer() == stored.unsafe_buffer_pointer()) == lend


def test_a_fill_for_another_key_set_or_other_shapes_does_nothing(store, devices):
    outs = [_Out(2, devices[0])]
    go = plans.prepare_fill(store, ["a"], outs, _Out)
    others = [
        jaxkv.init(store, {"d": jnp.ones(1)}),
        # The very shapes under other keys, and the very keys with equal shapes of another tuple
        KVState(
            keys=("a", "b", "d"),
            devices=store.devices,
            values=store.leaves,
            opt_states=(),
            shapes=store.key_shapes,
        ),
        KVState(
            keys=store.keys(),
            devices=store.devices,
            values=store.leaves,
            opt_states=(),
            shapes=tuple(list(store.key_shapes)),
        ),
    ]
    assert others[2].key_shapes == store.key_shapes
    for other in others:
        assert go(other, True) is False
    assert outs[0].got is None
    assert go(store, True) and outs[0].got is not None


@pytest.mark.parametrize(
    "out",
    [
        lambda d: _Out(3, d[0]),  # another shape
        lambda d: _Out(2, d[0], jnp.int32),  # another dtype
        lambda d: _Out(2, d[2]),  # a device outside the store
        lambda d: types.SimpleNamespace(),  # another type
    ],
)
def test_an_out_unlike_its_stored_value_is_left_to_the_general_path(store, devices, out):
    assert plans.prepare_fill(store, ["a"], [out(devices)], _Out) is None
    both = [_Out(2, devices[0]), out(devices)]  # one out as it should be, one not
    assert plans.prepare_fill(store, ["b", "a"], both, _Out) is None
