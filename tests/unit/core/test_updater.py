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
    return KVState(
        keys=keys,
        devices=(jax.devices("cpu")[0],),
        values=values,
        opt_states=["AB", "C"],
        groups=[("a", "b"), ("c",)],
    )


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
        f"key 'w': the updater returned shape {returned}, expected the stored shape (3,) "
        "(the updater: test_a_result_of_any_other_shape_is_refused_even_of_the_same_size."
        "<locals>.<lambda>)"
    )


def test_an_updater_returning_none_is_refused_naming_the_key():
    with pytest.raises(jaxkv.KVStoreError, match=r"key 'w': the updater .*<lambda> returned None"):
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


def _empty_init(params):
    return ()


def test_an_optax_updaters_error_is_wrapped_naming_the_keys_and_the_optimizer():
    def update(updates, state, params):
        raise RuntimeError("bad step")

    opt = optax.GradientTransformation(_empty_init, update)
    with pytest.raises(jaxkv.KVStoreError) as err:
        updater.apply_updater(opt, ["a", "b"], [jnp.ones(1)] * 2, [jnp.ones(1)] * 2, None)
    assert str(err.value) == (
        "keys ['a', 'b']: the optimizer optax.GradientTransformation(init=_empty_init, "
        "update=test_an_optax_updaters_error_is_wrapped_naming_the_keys_and_the_optimizer."
        "<locals>.update) raised RuntimeError: bad step"
    )
    assert isinstance(err.value.__cause__, RuntimeError)


def test_updates_that_do_not_add_to_the_values_are_wrapped_with_their_error():
    # optax.apply_updates of a (5, 7) update onto a (3,) value: jnp refuses to broadcast.
    opt = optax.GradientTransformation(_empty_init, lambda u, s, p: ({"w": jnp.ones((5, 7))}, s))
    with pytest.raises(jaxkv.KVStoreError, match=r"keys \['w'\]: the optimizer .* raised") as err:
        updater.apply_updater(opt, ["w"], [jnp.ones(3)], [jnp.ones(3)], None)
    assert isinstance(err.value.__cause__, ValueError)


def test_an_optax_init_error_is_wrapped_naming_the_group():
    def init(params):
        raise ValueError("no state for these")

    opt = optax.GradientTransformation(init, optax.identity().update)
    with pytest.raises(jaxkv.KVStoreError, match=r"keys \['a'\]: the optimizer .*<locals>\.init, "):
        updater.apply_updater(opt, ["a"], [jnp.ones(1)], [jnp.ones(1)], None)
    with pytest.raises(jaxkv.KVStoreError, match=r"keys \['a'\]: .* raised ValueError: no state"):
        updater.init_state(opt, {"a": jnp.ones(1)})
    assert updater.init_state(optax.sgd(0.1), {"a": jnp.ones(1)}) == optax.sgd(0.1).init(
        {"a": jnp.ones(1)}
    )


def test_updater_errors_name_one_key_or_a_group_and_let_jaxkvs_own_errors_pass():
    def broken(key, pushed, stored):
        raise AssertionError("no")

    one = pytest.raises(jaxkv.KVStoreError, match=r"^key 'w': the updater .*broken raised")
    with one, updater.updater_errors(broken, ["w"]):
        broken("w", 1, 2)
    group = pytest.raises(jaxkv.KVStoreError, match=r"^keys \['w'\]: the updater .*broken raised")
    with group, updater.updater_errors(broken, ["w"], group=True):
        broken("w", 1, 2)
    mine = jaxkv.UnknownKeyError("key 'x': mine")
    with pytest.raises(jaxkv.UnknownKeyError) as err, updater.updater_errors(broken, ["w"]):
        raise mine
    assert err.value is mine
    # not an Exception: not the updater's error
    with pytest.raises(KeyboardInterrupt), updater.updater_errors(broken, ["w"]):
        raise KeyboardInterrupt


def test_an_optax_transformation_is_named_by_its_type_and_functions():
    tx = optax.MultiSteps(optax.sgd(0.1), 2).gradient_transformation()
    assert updater.updater_name(tx) == (
        "optax.GradientTransformation(init=MultiSteps.init, update=MultiSteps.update)"
    )
    assert updater.updater_name(optax.sgd(0.1)) == (
        "optax.GradientTransformationExtraArgs(init=chain.<locals>.init_fn, "
        "update=chain.<locals>.update_fn)"
    )


# -- what is taken as an updater -------------------------------------------------------------
class _Wrapper:
    """An optax wrapper as MultiSteps is: not a transformation, but it gives one."""

    def __init__(self):
        self.made = 0

    def gradient_transformation(self):
        self.made += 1
        return optax.sgd(0.5)


def test_none_a_transformation_and_a_callable_are_taken_as_they_are():
    tx = optax.adam(0.1)

    def f(key, pushed, stored):
        return stored

    assert updater.as_updater(None) is None
    assert updater.as_updater(tx) is tx
    assert updater.as_updater(f) is f
    assert updater.as_transformation(tx, "init_optimizer") is tx


def test_a_wrapper_gives_its_transformation_the_same_object_each_time():
    wrapper = _Wrapper()
    tx = updater.as_updater(wrapper)
    assert isinstance(tx, optax.GradientTransformation)
    assert updater.as_updater(wrapper) is tx  # so its pushes compile once
    assert updater.as_transformation(wrapper, "set_optimizer") is tx
    assert wrapper.made == 1
    other = _Wrapper()
    assert updater.as_updater(other) is not tx  # another wrapper, another transformation
    ms = optax.MultiSteps(optax.sgd(0.1), 2)
    assert updater.as_updater(ms) is updater.as_updater(ms)
    assert isinstance(updater.as_updater(ms).init({"a": jnp.ones(1)}), optax.MultiStepsState)


@pytest.mark.parametrize("given", [3, "adam", None, object()])
def test_anything_else_is_refused_naming_it_and_what_is_taken(given):
    if given is not None:
        with pytest.raises(jaxkv.KVStoreError) as err:
            updater.as_updater(given, "set_updater")
        message = str(err.value)
        assert message.startswith("set_updater: expected None (assign), a callable updater(")
        assert "optax GradientTransformation" in message and "optax.MultiSteps" in message
        assert message.endswith(f"given {type(given).__name__} {given!r}")
    with pytest.raises(jaxkv.KVStoreError) as err:
        updater.as_transformation(given, "init_optimizer")
    assert str(err.value) == (
        "init_optimizer: expected an optax.GradientTransformation such as optax.adam(1e-3), "
        "or an object with a gradient_transformation() method such as optax.MultiSteps, "
        f"given {type(given).__name__} {given!r}"
    )


def test_a_long_given_value_is_cut_short_and_a_class_is_named():
    with pytest.raises(jaxkv.KVStoreError, match=r"given str '(x){76}\.\.\.$"):
        updater.as_updater("x" * 200)
    # the class, not an instance: its gradient_transformation() needs one
    with pytest.raises(
        jaxkv.KVStoreError, match=r"^updater type MultiSteps: gradient_transformation\(\) raised"
    ):
        updater.as_updater(optax.MultiSteps)
