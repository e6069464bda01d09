"""Refusals of malformed calls to init and push: what is refused, with which error, and what the
message says was expected; and the well-formed calls next to them that are accepted."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _devices import cpu_empty

import jaxkv


@pytest.fixture
def state():
    return jaxkv.init(cpu_empty(), {"w": jnp.zeros(2), "c": jnp.zeros(2, jnp.complex64)})


def test_keys_without_values_must_be_a_mapping(state):
    with pytest.raises(jaxkv.KVStoreError, match=r"expected a mapping \{key: value\} or keys"):
        jaxkv.push(state, "w")
    with pytest.raises(jaxkv.KVStoreError, match=r"given only list \['w'\]"):
        jaxkv.push(state, ["w"])
    with pytest.raises(jaxkv.KVStoreError, match=r"\{key: value\}"):
        jaxkv.init(cpu_empty(), 3)
    new = jaxkv.push(state, {"w": jnp.ones(2)})  # a mapping alone is fine
    np.testing.assert_array_equal(jaxkv.pull(new, "w"), [1.0, 1.0])


def test_lists_of_keys_need_as_many_values(state):
    with pytest.raises(jaxkv.ShapeError, match=r"2 values \(one per key\), given 1 values"):
        jaxkv.push(state, ["w", "c"], [jnp.ones(2)])
    with pytest.raises(jaxkv.ShapeError, match=r"expected 2 values \(one per key\), given one$"):
        jaxkv.push(state, ("w", "c"), jnp.ones(2))
    with pytest.raises(jaxkv.ShapeError, match="expected 1 values"):
        jaxkv.push(state, ["w"], [jnp.ones(2), jnp.ones(2)])
    new = jaxkv.push(state, ("w",), (jnp.ones(2),))  # tuples pair like lists
    np.testing.assert_array_equal(jaxkv.pull(new, "w"), [1.0, 1.0])


def test_an_empty_list_of_values_is_refused(state):
    with pytest.raises(jaxkv.ShapeError, match=r"key 'w': expected at least one value, given an"):
        jaxkv.push(state, "w", [])
    with pytest.raises(jaxkv.ShapeError, match="at least one value,"):
        jaxkv.push(state, ["w", "c"], [[jnp.ones(2)], []])


def test_pushed_shapes_must_match_and_name_the_value(state, devices):
    with pytest.raises(jaxkv.ShapeError, match=r"key 'w': the pushed value has shape \(3,\)"):
        jaxkv.push(state, "w", jnp.ones(3))
    values = [jax.device_put(jnp.ones(2), devices[0]), jax.device_put(jnp.ones(1), devices[1])]
    with pytest.raises(jaxkv.ShapeError, match=r"pushed value 1 has shape \(1,\), expected"):
        jaxkv.push(state, "w", values)
    with pytest.raises(jaxkv.ShapeError, match=r"expected the stored shape \(2,\)"):
        jaxkv.push(state, "w", jnp.ones((1, 2)))


def test_complex_values_go_only_into_complex_stores(state, devices):
    with pytest.raises(jaxkv.KVStoreError, match=r"key 'w': the pushed value has dtype complex64"):
        jaxkv.push(state, "w", jnp.ones(2, jnp.complex64))
    new = jaxkv.push(state, "c", [jnp.full(2, 1 + 2j, jnp.complex64), jnp.ones(2)])
    np.testing.assert_array_equal(jaxkv.pull(new, "c"), [2 + 2j, 2 + 2j])
    new = jaxkv.push(state, "c", jnp.ones(2, jnp.float32))  # a real value into a complex store
    np.testing.assert_array_equal(jaxkv.pull(new, "c"), [1 + 0j, 1 + 0j])


def test_duplicate_inits_are_refused_with_a_hint_only_for_lists(state):
    with pytest.raises(jaxkv.DuplicateKeyError) as one:
        jaxkv.init(state, "w", jnp.ones(2))
    assert "one value per key" not in str(one.value)
    with pytest.raises(jaxkv.DuplicateKeyError, match=r"\(init takes one value per key\)"):
        jaxkv.init(state, "w", [jnp.ones(2), jnp.ones(2)])
    with pytest.raises(jaxkv.DuplicateKeyError, match="duplicate init of key 'v'"):
        jaxkv.init(state, ["v", "v"], [jnp.ones(2), jnp.ones(2)])


def test_init_takes_exactly_one_value_per_key():
    with pytest.raises(jaxkv.ShapeError, match="init expects one value, given a list of 2"):
        jaxkv.init(cpu_empty(), "w", [jnp.ones(2), jnp.ones(2)])
    s = jaxkv.init(cpu_empty(), "w", [jnp.ones(2)])  # a list of one value is one value
    np.testing.assert_array_equal(jaxkv.pull(s, "w"), [1.0, 1.0])


def test_one_store_holds_one_kind_of_key():
    with pytest.raises(jaxkv.KeyTypeError, match="expected int keys, given a str key"):
        jaxkv.init(cpu_empty(), [1, "a"], [jnp.ones(1), jnp.ones(1)])
    with pytest.raises(jaxkv.KeyTypeError, match="expected str keys, given a int key"):
        jaxkv.init(cpu_empty(), ["a", 1], [jnp.ones(1), jnp.ones(1)])
    s = jaxkv.init(cpu_empty(), [np.int64(2), 1], [jnp.ones(1), jnp.zeros(1)])
    assert s.keys() == (1, 2)


def test_a_refused_init_adds_no_key(state):
    with pytest.raises(jaxkv.KVStoreError):
        jaxkv.init(state, ["x", "w"], [jnp.ones(1), jnp.ones(2)])
    assert state.keys() == ("c", "w")
