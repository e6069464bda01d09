"""jaxkv/_src/state/pairing.py: MXNet's pairing of keys with values, and the checks before
anything changes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv._src.state import pairing


def test_every_form_mxnet_accepts_pairs_in_call_order():
    assert pairing.pairs(3, "a", "values") == [(3, ["a"])]
    assert pairing.pairs(3, ["a", "b"], "values") == [(3, ["a", "b"])]
    assert pairing.pairs([3, 1], ["a", "b"], "values") == [(3, ["a"]), (1, ["b"])]
    assert pairing.pairs([3, 3], [["a"], ("b", "c")], "values") == [(3, ["a"]), (3, ["b", "c"])]
    assert pairing.pairs({"w": 1, "b": [2, 3]}, pairing.MISSING, "values") == [
        ("w", [1]),
        ("b", [2, 3]),
    ]


@pytest.mark.parametrize(
    ("keys", "values", "message"),
    [
        ([1, 2], ["a"], "expected 2 values (one per key), given 1 values"),
        ([1, 2], "a", "expected 2 values (one per key), given one"),
        (1, [], "key 1: expected at least one value, given an empty list"),
        ([1], [[]], "key 1: expected at least one value, given an empty list"),
    ],
)
def test_lists_that_do_not_pair_up_are_refused(keys, values, message):
    with pytest.raises(jaxkv.ShapeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        pairing.pairs(keys, values, "values")


def test_a_mapping_is_needed_where_values_are_missing():
    with pytest.raises(jaxkv.KVStoreError, match="expected a mapping"):
        pairing.pairs([1, 2], pairing.MISSING, "values")


def test_a_value_of_the_whole_shape_or_the_device_block_is_accepted_nothing_else():
    stored = jax.ShapeDtypeStruct((2, 3), jnp.float32)  # this device's block of a (4, 3) value
    pairing.check_value(0, jnp.zeros((2, 3)), stored, "the pushed value", whole=(4, 3))
    pairing.check_value(0, jnp.zeros((4, 3)), stored, "the pushed value", whole=(4, 3))
    with pytest.raises(jaxkv.ShapeError, match=r"expected the stored shape \(4, 3\) or this"):
        pairing.check_value(0, jnp.zeros((3, 3)), stored, "the pushed value", whole=(4, 3))
    with pytest.raises(
        jaxkv.ShapeError, match=r"has shape \(3,\), expected the stored shape \(2, 3\) \("
    ):
        pairing.check_value(0, jnp.zeros(3), stored, "the pushed value")


def test_a_complex_value_for_a_real_key_is_refused():
    stored = jax.ShapeDtypeStruct((2,), jnp.float32)
    with pytest.raises(jaxkv.DtypeError, match="dtype complex64, which the key's dtype float32"):
        pairing.check_value("w", np.zeros(2, np.complex64), stored, "the pushed value")


def test_devices_must_be_distinct_devices():
    cpu = jax.devices("cpu")
    assert pairing.devices_of(cpu[0]) == (cpu[0],)
    assert pairing.devices_of([jaxkv.cpu(1), cpu[2]]) == (cpu[1], cpu[2])
    for bad in ([], [cpu[0], cpu[0]], ["cpu"]):
        with pytest.raises(jaxkv.KVStoreError, match="distinct devices"):
            pairing.devices_of(bad)
