"""Gradient compression at its edges: which parameters are accepted, 2-bit quantization exactly at
the threshold, residuals of devices that push nothing, several values on one device, values from
devices the store does not hold, and the difference between fp16 and bf16 rounding.

Stores are over the 8 CPU devices (``jax.devices("cpu")``) unless a test names others."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _devices import cpu_empty, cpu_store
from jax.sharding import PartitionSpec as P

import jaxkv

T = 0.5


def on(device, value, dtype=jnp.float32):
    return jax.device_put(jnp.asarray(value, dtype), device)


def two_bit(threshold=T, devices=None, **values):
    devices = jax.devices("cpu") if devices is None else devices
    state = jaxkv.empty(devices, compression={"type": "2bit", "threshold": threshold})
    return jaxkv.init(state, {k: jnp.zeros(np.shape(v)) for k, v in values.items()})


@pytest.mark.parametrize(
    "params, expected",
    [
        (None, None),
        ({"type": "none"}, None),
        ({"type": "2bit"}, ("2bit", 0.5)),  # MXNet's default threshold
        ({"type": "2bit", "threshold": 2}, ("2bit", 2.0)),
        ({"type": "2bit", "threshold": 1e-3}, ("2bit", 1e-3)),
        ({"type": "fp16"}, ("fp16",)),
        ({"type": "bf16"}, ("bf16",)),
    ],
)
def test_accepted_compression_parameters(params, expected):
    state = cpu_empty(compression=params)
    assert state.compression == expected
    if expected is not None and expected[0] == "2bit":
        assert type(state.compression[1]) is float


@pytest.mark.parametrize(
    "params, pattern",
    [
        ("2bit", r"expected \{'type': one of \['2bit', 'fp16', 'bf16', 'none'\], \.\.\.\}"),
        ({"threshold": 0.5}, "one of"),
        ({"type": "1bit"}, "given {'type': '1bit'}"),
        ({"type": "2bit", "threshold": 0.5, "size": 3}, r"unexpected parameters \['size'\]"),
        ({"type": "none", "threshold": 0.5}, r"'none': unexpected parameters \['threshold'\]"),
        ({"type": "bf16", "threshold": 0.5}, r"'bf16': unexpected parameters \['threshold'\]"),
        ({"type": "fp16", "x": 1}, r"unexpected parameters \['x'\]"),
        ({"type": "2bit", "threshold": -1.0}, "greater than 0"),
        ({"type": "2bit", "threshold": 0.0}, "greater than 0"),
        ({"type": "2bit", "threshold": True}, "given True"),
        ({"type": "2bit", "threshold": "0.5"}, "given '0.5'"),
        ({"type": "2bit", "threshold": None}, "given None"),
    ],
)
def test_refused_compression_parameters(params, pattern):
    with pytest.raises(jaxkv.KVStoreError, match=pattern):
        cpu_empty(compression=params)


def test_two_bit_sends_the_threshold_from_exactly_the_threshold_on(devices):
    """Per element: residual + value >= t sends t, <= -t sends -t, else 0 and it is kept."""
    g = np.array([T, -T, T - 2**-10, -T + 2**-10, 0.0, 3.0, -3.0], np.float32)
    state = two_bit(w=g)
    new = jaxkv.push(state, "w", [on(devices[2], g)])
    np.testing.assert_array_equal(np.asarray(new["w"]), [T, -T, 0, 0, 0, T, -T])
    residual = np.asarray(new.residuals["w"]).reshape(8, -1)
    kept = g - np.array([T, -T, 0, 0, 0, T, -T], np.float32)
    np.testing.assert_array_equal(residual[2], kept)
    assert not residual[[0, 1, 3, 4, 5, 6, 7]].any()  # devices that pushed nothing
    # Device 2 now holds residuals of 2.5 and -2.5: while it pushes nothing, it sends nothing.
    later = jaxkv.push(new, "w", [on(devices[0], np.zeros(7))])
    np.testing.assert_array_equal(np.asarray(later["w"]), np.zeros(7))
    np.testing.assert_array_equal(np.asarray(later.residuals["w"]).reshape(8, -1)[2], kept)
    again = jaxkv.push(later, "w", [on(devices[2], np.zeros(7))])
    np.testing.assert_array_equal(np.asarray(again["w"]), [0, 0, 0, 0, 0, T, -T])


def test_residuals_of_silent_devices_wait_for_their_next_push(devices):
    state = two_bit(w=np.zeros(2))
    state = jaxkv.push(state, "w", [on(devices[0], [0.3, -0.3]), on(devices[5], [0.2, 0.4])])
    np.testing.assert_array_equal(np.asarray(state["w"]), [0.0, 0.0])
    # Only device 5 pushes now: its residual (0.2, 0.4) plus 0.3 crosses t; device 0 keeps its own.
    state = jaxkv.push(state, "w", [on(devices[5], [0.3, 0.3])])
    np.testing.assert_array_equal(np.asarray(state["w"]), [T, T])
    # Device 0's residual (0.3, -0.3) plus (0.2, -0.2) reaches (t, -t) exactly.
    state = jaxkv.push(state, "w", [on(devices[0], [0.2, -0.2])])
    np.testing.assert_allclose(np.asarray(state["w"]), [T, -T], rtol=0, atol=1e-7)


def test_several_values_on_one_device_are_added_before_compression(devices):
    state = two_bit(w=np.zeros(3))
    values = [on(devices[1], [0.3, 0.2, -0.3]), on(devices[1], [0.3, 0.2, -0.3])]
    new = jaxkv.push(state, "w", values)
    # 0.6 crosses t on device 1 alone; 0.4 does not; two values summed across devices would.
    np.testing.assert_array_equal(np.asarray(new["w"]), [T, 0.0, -T])
    values = [on(devices[1], [0.3, 0.3, 0.3]), on(devices[2], [0.3, 0.3, 0.3])]
    np.testing.assert_array_equal(np.asarray(jaxkv.push(state, "w", values)["w"]), [0, 0, 0])


def test_compressed_values_of_other_dtypes_are_cast_first(devices):
    state = two_bit(w=np.zeros(2))
    values = [on(devices[0], [1.0, -1.0], jnp.float16), on(devices[3], [1.0, 0.0], jnp.bfloat16)]
    new = jaxkv.push(state, "w", values)
    assert new["w"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(new["w"]), [2 * T, -T])


def test_a_value_from_off_the_store_is_the_store_device_at_its_position(devices):
    """MXNet's device store fed from CPU-side data: a value on a device the store does not hold
    is copied to the store device at its position in the key's values (the i-th to the
    (i mod D)-th), and compressed there with that device's residual, as if pushed from it."""
    store, away = devices[:4], devices[4:]
    a, b = [0.3, 0.6], [0.6, -0.3]
    state = two_bit(devices=store, w=np.zeros(2))
    new = jaxkv.push(state, "w", [on(away[2], a), on(away[0], b)])
    # Position 0 on store device 0, position 1 on store device 1: each has its own residual.
    np.testing.assert_array_equal(np.asarray(new["w"]), [T, T])
    residual = np.asarray(new.residuals["w"]).reshape(4, 2)
    np.testing.assert_allclose(residual, [[0.3, 0.1], [0.1, -0.3], [0, 0], [0, 0]], atol=1e-7)
    assert {s.device for s in new["w"].addressable_shards} == set(store)
    same = jaxkv.push(state, "w", [on(store[0], a), on(store[1], b)])
    np.testing.assert_array_equal(np.asarray(new["w"]), np.asarray(same["w"]))
    np.testing.assert_array_equal(np.asarray(new.residuals["w"]), np.asarray(same.residuals["w"]))
    # The residuals carry from push to push by position: 0.3 + 0.3 crosses t on device 0.
    again = jaxkv.push(new, "w", [on(away[1], [0.3, 0.0]), on(away[3], [0.0, 0.0])])
    np.testing.assert_array_equal(np.asarray(again["w"]), [T, 0.0])


def test_values_from_off_the_store_wrap_around_and_join_a_device_values(devices):
    """With more values than store devices, the (D+1)-th joins the first device's: values that
    land on one device are added (in call order) before they are compressed, as several values
    pushed from one device are. A value pushed from a store device keeps that device."""
    store = devices[:2]
    state = two_bit(devices=store, w=np.zeros(1))
    values = [on(devices[5], [0.3]), on(devices[6], [0.1]), on(devices[7], [0.3])]
    new = jaxkv.push(state, "w", values)
    # Device 0: 0.3 + 0.3 = 0.6 crosses t (MXNet, compressing each alone, would send 0).
    np.testing.assert_array_equal(np.asarray(new["w"]), [T])
    np.testing.assert_allclose(np.asarray(new.residuals["w"]), [0.1, 0.1], atol=1e-7)
    # Position 1 off the store lands on device 1, beside store device 0's own value.
    mixed = jaxkv.push(state, "w", [on(store[0], [0.3]), on(devices[4], [0.4])])
    np.testing.assert_array_equal(np.asarray(mixed["w"]), [0.0])
    np.testing.assert_allclose(np.asarray(mixed.residuals["w"]), [0.3, 0.4], atol=1e-7)
    # Position 0 off the store lands on device 0, which also pushes its own value.
    joined = jaxkv.push(state, "w", [on(devices[4], [0.3]), on(store[0], [0.3])])
    np.testing.assert_array_equal(np.asarray(joined["w"]), [T])
    np.testing.assert_allclose(np.asarray(joined.residuals["w"]), [0.1, 0.0], atol=1e-7)


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_rounded_values_from_off_the_store_are_rounded_per_store_device(devices, kind):
    """1 + 2**-9 is a float16 but not a bfloat16: each of two values from off the store is
    rounded on its own store device; three on two devices round the first device's sum."""
    x = np.float32(1 + 2**-9)
    state = jaxkv.init(
        jaxkv.empty(devices[:2], compression={"type": kind}), {"w": jnp.zeros(1, jnp.float32)}
    )
    new = jaxkv.push(state, "w", [on(d, [x]) for d in devices[5:7]])
    np.testing.assert_array_equal(np.asarray(new["w"]), [2 * x if kind == "fp16" else 2.0])
    three = jaxkv.push(state, "w", [on(d, [x]) for d in devices[5:8]])
    # Device 0 rounds 2x = 2 + 2**-8 (a float16, not a bfloat16), device 1 rounds x.
    np.testing.assert_array_equal(np.asarray(three["w"]), [3 * x if kind == "fp16" else 3.0])
    assert new.residuals["w"] is None


def test_a_compressed_push_refuses_a_value_on_several_devices(devices):
    """A value that spans devices has no one residual: refused, and nothing changes."""
    state = two_bit(devices=devices[:4], w=np.zeros(2))
    spread = jax.device_put(
        jnp.ones(2), jax.sharding.NamedSharding(jax.sharding.Mesh(devices[:2], ("d",)), P())
    )
    with pytest.raises(jaxkv.KVStoreError, match="expects each value on one device"):
        jaxkv.push(state, "w", [on(devices[0], [1.0, 1.0]), spread])
    new = jaxkv.push(state, "w", [on(devices[3], [1.0, 1.0])])
    np.testing.assert_array_equal(np.asarray(new["w"]), [T, T])
    assert np.asarray(new.residuals["w"]).shape == (8,)  # one block of 2 per store device


def test_residuals_have_one_block_per_device(devices):
    state = two_bit(s=np.float32(0), m=np.zeros((3, 2)))
    assert state.residuals["s"].shape == (8,)
    assert state.residuals["m"].shape == (24, 2)
    assert not np.asarray(state.residuals["m"]).any()
    scalar = jaxkv.push(state, "s", [on(d, 0.3) for d in devices[:2]])
    np.testing.assert_array_equal(np.asarray(scalar["s"]), 0.0)
    np.testing.assert_allclose(np.asarray(scalar.residuals["s"]), [0.3, 0.3, 0, 0, 0, 0, 0, 0])


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_fp16_and_bf16_round_differently(devices, kind):
    """1 + 2**-9 is a float16 (10 mantissa bits) but not a bfloat16 (7 bits)."""
    x = np.float32(1 + 2**-9)
    state = jaxkv.init(cpu_empty(compression={"type": kind}), {"w": jnp.zeros(2)})
    new = jaxkv.push(state, "w", [on(d, [x, 3.0]) for d in devices[:4]])
    expected = 4 * x if kind == "fp16" else 4.0
    np.testing.assert_array_equal(np.asarray(new["w"]), [expected, 12.0])
    assert new.residuals["w"] is None


def test_compression_set_on_a_store_with_keys_starts_their_residuals_at_zero(devices):
    kv = cpu_store("device")
    kv.init(["a", "b"], [jnp.ones((2, 2)), jnp.ones(3)])
    kv.set_gradient_compression({"type": "2bit", "threshold": 1.0})
    state = kv.state
    assert state.compression == ("2bit", 1.0)
    assert state.residuals["a"].shape == (16, 2) and state.residuals["b"].shape == (24,)
    assert not np.asarray(state.residuals["a"]).any()
    kv.set_gradient_compression({"type": "fp16"})
    assert kv.state.compression == ("fp16",)
    assert dict(kv.state.residuals) == {"a": None, "b": None}
    kv.set_gradient_compression({"type": "none"})
    assert kv.state.compression is None
    kv.push("b", [on(d, [0.1, 0.2, 0.3]) for d in devices[:2]])  # uncompressed again
    np.testing.assert_allclose(np.asarray(kv.pull("b")), [0.2, 0.4, 0.6], rtol=1e-6)


def test_an_uncompressed_store_keeps_no_residuals():
    state = jaxkv.init(cpu_empty(), {"w": jnp.zeros(2)})
    assert dict(state.residuals) == {"w": None}
    state = jaxkv.init(cpu_empty(compression={"type": "fp16"}), {"w": jnp.zeros(2)})
    assert dict(state.residuals) == {"w": None}


def test_compression_is_refused_for_a_store_already_holding_integers():
    kv = cpu_store("device")
    kv.init(["f", "i"], [jnp.ones(2), jnp.ones(2, jnp.int32)])
    with pytest.raises(jaxkv.KVStoreError, match="key 'i': gradient compression '2bit' expects"):
        kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    assert kv.state.compression is None and dict(kv.state.residuals) == {"f": None, "i": None}
    kv.set_gradient_compression({"type": "none"})  # no compression: integers are fine
    assert kv.state.compression is None
