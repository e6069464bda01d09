"""jaxkv/_src/core/updater.py: which optimizer group a push updates, and what an updater may
return (each key its own values, the stored shape, cast to the stored dtype)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxkv
from jaxkv._src.core import updater
from jaxkv._src.state.kvstate import KVState


def _grouped_state():
    """Keys a..e on one device; groups (a, b) and (c,) hold stand-in optimizer states; d and e
    have none. No computation: the groups are aux data."""
    keys = ("a", "b", "c", "d", "e")
    values = [jnp.zeros(1)] * len(keys)
    return KVState(keys, (jax.devices("cpu")[0],), values, ["AB", "C"], groups=[("a", "b"), ("c",)])


# -- marking and naming ---------------------------------------------------------------------
def test_a_function_is_marked_pure_in_place_and_returned_itself():
    def update(key, pushed, stored):
        return stored + pushed

    assert not updater.is_pure_updater(update)
    assert updater.pure_updater(update) is update
    assert updater.is_pure_updater(update)


def test_a_builtin_or_bound_method_that_takes_no_attribute_is_wrapped_and_called_through():
    class Holder:
        def update(self, key, pushed, stored):
            return key, pushed, stored

    for fn, name in [(pow, "pow"), (Holder().update, Holder.update.__qualname__)]:
        marked = updater.pure_updater(fn)  # builtins and bound methods refuse setattr
        assert marked is not fn
        assert updater.is_pure_updater(marked) and not updater.is_pure_updater(fn)
        assert updater.updater_name(marked) == name
    assert updater.pure_updater(pow)(2, 5, 7) == 2**5 % 7  # key, pushed, stored in that order
    assert updater.pure_updater(Holder().update)(1, 2, 3) == (1, 2, 3)


def test_a_value_that_is_not_callable_is_refused_naming_it():
    with pytest.raises(jaxkv.KVStoreError, match=r"expected a callable.*given 3"):
        updater.pure_updater(3)


def test_an_updater_is_named_by_its_qualified_name_else_its_type():
    class Scaled:
        def __call__(self, key, pushed, stored):
            return pushed

    assert updater.updater_name(Scaled) == (
        "test_an_updater_is_named_by_its_qualified_name_else_its_type.<locals>.Scaled"
    )
    assert updater.updater_name(Scaled()) == "Scaled"


# -- optimizer groups ------------------------------------------------------------------------
def test_keys_without_optimizer_state_become_a_new_group_in_sorted_order():
    assert updater.optimizer_group(_grouped_state(), ["e", "d"]) == (("d", "e"), None)


def test_exactly_a_groups_keys_in_any_order_give_that_group_and_its_state():
    state = _grouped_state()
    assert updater.optimizer_group(state, ["b", "a"]) == (("a", "b"), "AB")
    assert updater.optimizer_group(state, ["c"]) == (("c",), "C")
    # unpack=False: the group's state is only said to exist
    assert updater.optimizer_group(state, ["a", "b"], unpack=False) == (("a", "b"), True)


@pytest.mark.parametrize(
    ("keys", "why"),
    [
        (["a"], r"\(the group also holds \['b'\]\)"),  # one key short of the group
        (["a", "b", "d"], r"\(keys \['d'\] have no optimizer state yet\)"),  # one key beyond
        (["a", "b", "c"], r"\(they span the groups \['a', 'b'\], \['c'\]\)"),
    ],
)
def test_anything_but_one_whole_group_or_fresh_keys_is_refused(keys, why):
    state = _grouped_state()
    with pytest.raises(jaxkv.KVStoreError, match=why) as err:
        updater.optimizer_group(state, keys)
    given = "[" + ", ".join(map(repr, sorted(keys))) + "]"
    assert f"given {given}" in str(err.value)
    assert "expected exactly the keys of group ['a', 'b']" in str(err.value)
    assert state.groups == (("a", "b"), ("c",))  # nothing changed
    assert dict(state.opt_states) == {("a", "b"): "AB", ("c",): "C"}


# -- running an updater ----------------------------------------------------------------------
def test_no_updater_assigns_each_pushed_value_cast_to_its_stored_dtype():
    pushed = [jnp.array([1.5, 2.5], jnp.float32), jnp.array([7.0], jnp.float32)]
    stored = [jnp.zeros(2, jnp.float16), jnp.zeros(1, jnp.int32)]
    new, opt = updater.apply_updater(None, ["a", "b"], pushed, stored, None)
    assert opt is None
    assert [x.dtype for x in new] == [jnp.float16, jnp.int32]
    np.testing.assert_array_equal(new[0], [1.5, 2.5])
    np.testing.assert_array_equal(new[1], [7])


def test_a_plain_updater_runs_once_per_key_with_that_keys_own_values():
    seen = []

    def update(key, pushed, stored):
        seen.append(key)
        return stored * 10 + pushed

    pushed = [jnp.array([1, 2], jnp.int32), jnp.array([3], jnp.int32)]
    stored = [jnp.array([4, 5], jnp.int32), jnp.array([6], jnp.int32)]
    new, _ = updater.apply_updater(update, [0, 1], pushed, stored, None)
    assert seen == [0, 1]
    np.testing.assert_array_equal(new[0], [41, 52])
    np.testing.assert_array_equal(new[1], [63])


def test_an_updaters_result_is_cast_to_the_stored_dtype():
    new, _ = updater.apply_updater(
        lambda k, p, s: p.astype(jnp.float32) + 0.75,
        ["w"],
        [jnp.array([2], jnp.int32)],
        [jnp.array([0], jnp.int32)],
        None,
    )
    assert new[0].dtype == jnp.int32
    np.testing.assert_array_equal(new[0], [2])  # 2.75 truncated


@pytest.mark.parametrize("returned", [(1, 3), (3, 1), (4,), ()])
def test_a_result_of_any_other_shape_is_refused_even_of_the_same_size(returned):
    with pytest.raises(jaxkv.ShapeError) as err:
        updater.apply_updater(
            lambda k, p, s: jnp.zeros(returned), ["w"], [jnp.ones(3)], [jnp.ones(3)], None
        )
    assert str(err.value) == (
        f"key 'w': the updater returned shape {returned}, expected the stored shape (3,)"
    )


def test_an_updater_returning_none_is_refused_naming_the_key():
    with pytest.raises(jaxkv.KVStoreError, match=r"key 'w': the updater returned None"):
        updater.apply_updater(lambda k, p, s: None, ["w"], [jnp.ones(1)], [jnp.ones(1)], None)


def test_an_updaters_own_error_is_wrapped_and_a_kvstore_error_passes_as_it_is():
    def broken(key, pushed, stored):
        raise ValueError("no good")

    with pytest.raises(jaxkv.KVStoreError, match=r"key 3: the updater .*broken raised") as err:
        updater.apply_updater(broken, [3], [jnp.ones(1)], [jnp.ones(1)], None)
    assert isinstance(err.value.__cause__, ValueError)

    mine = jaxkv.ShapeError("key 3: mine")

    def refusing(key, pushed, stored):
        raise mine

    with pytest.raises(jaxkv.ShapeError) as err:
        updater.apply_updater(refusing, [3], [jnp.ones(1)], [jnp.ones(1)], None)
    assert err.value is mine


def test_an_optax_updater_updates_the_keys_as_one_tree():
    # Clipping by the global norm sees both keys: the gradients (3) and (4) have norm 5, so
    # clipped to norm 1 they are 0.6 and 0.8 (each alone would be clipped to 1).
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
    stored = [jnp.array([10.0]), jnp.array([20.0])]
    pushed = [jnp.array([3.0]), jnp.array([4.0])]
    new, state = updater.apply_updater(opt, ["a", "b"], pushed, stored, None)
    np.testing.assert_allclose(new[0], [10.0 - 0.6], rtol=1e-6)
    np.testing.assert_allclose(new[1], [20.0 - 0.8], rtol=1e-6)
    assert state is not None  # made by init, as optax.update would need


def test_an_optax_updaters_error_is_wrapped_naming_the_keys():
    def update(updates, state, params):
        raise RuntimeError("bad step")

    opt = optax.GradientTransformation(lambda params: (), update)
    with pytest.raises(jaxkv.KVStoreError, match=r"keys \['a', 'b'\]: the optimizer raised"):
        updater.apply_updater(opt, ["a", "b"], [jnp.ones(1)] * 2, [jnp.ones(1)] * 2, None)
