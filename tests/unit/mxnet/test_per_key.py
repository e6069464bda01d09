"""jaxkv/_src/mxnet/per_key.py: a group of several keys runs its transformation on each key
alone, one state each, and groups are cut and joined without changing a key's state."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxkv
from jaxkv._src.mxnet import per_key

# Clipping by the global norm tells a tree from keys alone; the schedule's count tells whose
# state a key holds (the n-th update scales by n).
INNER = optax.chain(
    optax.clip_by_global_norm(1.0),
    optax.scale_by_schedule(lambda n: (n + 1).astype(jnp.float32)),
)
VALUES = {"a": np.zeros(2, np.float32), "b": np.ones(3, np.float32), "c": np.full(1, 2, np.float32)}


def _count(state):
    """The update count in one key's state of INNER."""
    return int(state[1].count)


def _with_count(key, n):
    """INNER's state of ``key`` after ``n`` updates."""
    state = INNER.init({key: jnp.asarray(VALUES[key])})
    return (state[0], state[1]._replace(count=jnp.asarray(n, jnp.int32)))


@pytest.fixture(params=["keys", "flat"])
def store(request, devices):
    return jaxkv.init(
        jaxkv.empty(devices[:1], layout=request.param),
        {k: jnp.asarray(v) for k, v in VALUES.items()},
    )


def test_per_key_state_holds_each_key_in_key_order_and_is_a_pytree():
    st = per_key.PerKeyState({"b": 2, "a": 1, "c": 3})
    assert list(st.states) == ["a", "b", "c"]
    leaves, treedef = jax.tree_util.tree_flatten(st)
    assert leaves == [1, 2, 3]
    back = jax.tree_util.tree_unflatten(treedef, [10, 20, 30])
    assert isinstance(back, per_key.PerKeyState) and back.states == {"a": 10, "b": 20, "c": 30}
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(st)[0]]
    assert paths == [(jax.tree_util.DictKey(k),) for k in "abc"]


def test_one_key_runs_the_transformation_itself_and_several_run_each_key_alone():
    tx = per_key.per_key(INNER)
    assert per_key.per_key(INNER) is tx  # the same object: its compiled pushes are reused
    one = {"a": jnp.array([3.0, 4.0])}
    state = tx.init(one)
    assert not isinstance(state, per_key.PerKeyState)
    np.testing.assert_allclose(tx.update(one, state)[0]["a"], [0.6, 0.8], rtol=1e-6)
    grads = {"b": jnp.array([0.0, 1.0]), "a": jnp.array([3.0, 4.0])}  # norms 1 and 5
    state = tx.init(grads)
    assert isinstance(state, per_key.PerKeyState) and list(state.states) == ["a", "b"]
    updates, state = tx.update(grads, state)
    # Each clipped by its own norm: a to norm 1, b left as it is (a tree would scale both).
    np.testing.assert_allclose(updates["a"], [0.6, 0.8], rtol=1e-6)
    np.testing.assert_allclose(updates["b"], [0.0, 1.0], rtol=1e-6)
    updates, state = tx.update(grads, state)  # the second update of each key: scaled by 2
    np.testing.assert_allclose(updates["b"], [0.0, 2.0], rtol=1e-6)
    assert _count(state.states["a"]) == _count(state.states["b"]) == 2


def test_the_state_of_a_group_splits_into_its_keys_only_where_kept_per_key():
    st = per_key.PerKeyState({"a": 1, "b": 2})
    assert per_key._states_of(("a",), "mine") == {"a": "mine"}
    assert per_key._states_of(("a", "b"), st) == {"a": 1, "b": 2}
    assert per_key._states_of(("a", "c"), st) is None  # kept per key, but for other keys
    assert per_key._states_of(("a", "b"), {"a": 1, "b": 2}) is None  # one tree over both


def test_joining_keys_keeps_each_keys_own_state_and_leaves_the_rest_alone(store):
    state = store.replace(
        opt_states={
            ("a",): _with_count("a", 3),
            ("b", "c"): per_key.PerKeyState({"b": _with_count("b", 5), "c": _with_count("c", 7)}),
        }
    )
    joined = per_key.regroup(state, ["b", "a"], INNER)
    assert sorted(joined.groups) == [("a", "b"), ("c",)]
    both = joined.opt_states[("a", "b")]
    assert isinstance(both, per_key.PerKeyState) and list(both.states) == ["a", "b"]
    assert _count(both.states["a"]) == 3 and _count(both.states["b"]) == 5
    assert _count(joined.opt_states[("c",)]) == 7  # c left its group: its state alone
    assert per_key.any_per_key(joined)
    assert per_key.holds_per_key(joined, ["b"]) and not per_key.holds_per_key(joined, ["c"])
    alone = per_key.alone(joined)  # each key its own group again, with its own state
    assert sorted(alone.groups) == [("a",), ("b",), ("c",)]
    assert [_count(alone.opt_states[(k,)]) for k in "abc"] == [3, 5, 7]
    assert not per_key.any_per_key(alone)


def test_a_key_without_state_gets_a_fresh_one_when_joined(store):
    state = store.replace(opt_states={("a",): _with_count("a", 4)})
    joined = per_key.regroup(state, ["a", "c"], INNER)
    both = joined.opt_states[("a", "c")]
    assert _count(both.states["a"]) == 4 and _count(both.states["c"]) == 0
    assert list(joined.groups) == [("a", "c")]


def test_keys_already_one_group_or_without_state_are_left_as_they_are(store):
    assert per_key.regroup(store, ["a", "b"], INNER) is store  # no key has state yet
    grouped = per_key.regroup(
        store.replace(opt_states={("a",): _with_count("a", 1)}), ["a", "b"], INNER
    )
    assert per_key.regroup(grouped, ["b", "a"], INNER) is grouped
    assert per_key.alone(store) is store


def test_a_group_holding_one_tree_over_several_keys_cannot_be_cut(store):
    tree = INNER.init({"a": jnp.zeros(2), "b": jnp.ones(3)})
    state = store.replace(opt_states={("a", "b"): tree})
    assert per_key.regroup(state, ["a"], INNER) is None
    assert per_key.regroup(state, ["b", "c"], INNER) is None
    assert not per_key.any_per_key(state) and not per_key.holds_per_key(state, ["a", "b"])
    assert per_key.alone(state) is state
