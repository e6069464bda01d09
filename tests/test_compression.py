"""Gradient compression: MXNet's 2-bit error-feedback scheme (and fp16/bf16 rounding).

The expected pulls were recorded from Apache MXNet 1.9.1 by conformance/record_compression.py
(a `device` store over D cpu contexts, device d pushing g * (d + 1) for each g in G). MXNet
refuses thresholds -0.5 and 0 ("threshold must be greater than 0"), unknown types, and
compression on a `local` store; so does jaxkv.

MXNet's device store sums where the pushed values are; here stores are over the 8 CPU devices
that stand in for its GPUs (``jax.devices("cpu")``, whatever JAX's default backend), or over
some of them fed from the others (MXNet's device store fed from CPU-side data).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
import jaxkv.mx as mx

G = [0.3, 0.3, -0.7, 1.2, 0.05, -2.0]
RECORDED = {  # (devices, threshold, updater) -> MXNet 1.9.1's pulls, one per push
    (2, 0.5, "assign"): [0.5, 1.0, -1.0, 1.0, 1.0, -1.0],
    (2, 0.5, "add2"): [1.0, 3.0, 1.0, 3.0, 5.0, 3.0],
    (2, 0.25, "assign"): [0.5, 0.5, -0.5, 0.5, 0.5, -0.5],
    (2, 0.25, "add2"): [1.0, 2.0, 1.0, 2.0, 3.0, 2.0],
    (4, 0.5, "assign"): [1.5, 2.0, -2.0, 2.0, 2.0, -2.0],
    (4, 0.5, "add2"): [3.0, 7.0, 3.0, 7.0, 11.0, 7.0],
    (4, 0.25, "assign"): [1.0, 1.0, -1.0, 1.0, 1.0, -1.0],
    (4, 0.25, "add2"): [2.0, 4.0, 2.0, 4.0, 6.0, 4.0],
}


def add2(key, inp, stored):
    stored += inp * 2


def device_store(name="device", devices=None):
    """MXNet's ``mx.kv.create(name)``, over the 8 CPU devices unless ``devices`` are named."""
    return mx.kv.KVStore(name, devices=jax.devices("cpu") if devices is None else devices)


@pytest.mark.parametrize("where", ["pushing devices", "other devices"])
@pytest.mark.parametrize("case", sorted(RECORDED))
def test_two_bit_matches_mxnet(case, where):
    """Over the pushing devices, each device's value is compressed with its residual; over
    other devices (fed from off the store), the d-th value with store device d's: both are
    MXNet's numbers, whose residuals go by position in the pushed list."""
    devices, threshold, updater = case
    others = [mx.cpu(8 - devices + d) for d in range(devices)]
    kv = device_store(devices=None if where == "pushing devices" else others)
    kv.set_gradient_compression({"type": "2bit", "threshold": threshold})
    kv.init(3, mx.nd.zeros((2, 3)))
    if updater == "add2":
        kv._set_updater(add2)
    pulls = []
    for g in G:
        kv.push(3, [mx.nd.ones((2, 3), mx.cpu(d)) * g * (d + 1) for d in range(devices)])
        out = mx.nd.zeros((2, 3))
        kv.pull(3, out=out)
        assert np.all(out.asnumpy() == out.asnumpy()[0, 0])
        pulls.append(float(out.asnumpy()[0, 0]))
    assert pulls == RECORDED[case]


@pytest.mark.parametrize(
    "store, params, pattern",
    [
        ("device", {"type": "2bit", "threshold": -0.5}, "greater than 0"),
        ("device", {"type": "2bit", "threshold": 0}, "greater than 0"),
        ("device", {"type": "1bit", "threshold": 0.5}, "'1bit'"),
        ("device", {"type": "fp16", "threshold": 0.5}, "threshold"),
        ("local", {"type": "2bit", "threshold": 0.5}, "'local'"),
    ],
)
def test_refusals_match_mxnet_and_change_nothing(store, params, pattern):
    kv = mx.kv.create(store)
    kv.init(3, mx.nd.ones((2, 3)))
    before = kv.state
    with pytest.raises(jaxkv.KVStoreError, match=pattern):
        kv.set_gradient_compression(params)
    assert kv.state is before and kv.state.compression is None


def model_push(residuals, grads, threshold):
    """NumPy model: per-device error feedback, then the sum over devices."""
    total = 0
    for d, g in grads.items():
        acc = residuals[d] + g
        q = np.where(acc >= threshold, threshold, np.where(acc <= -threshold, -threshold, 0))
        residuals[d] = acc - q
        total = total + q
    return total.astype(np.float32)


def test_random_pushes_follow_the_numpy_model(devices):
    rng = np.random.default_rng(0)
    t = 0.3
    shapes = {"a": (2, 3), "big": (16, 4), "s": ()}  # bound 16: "big" is stored sharded
    state = jaxkv.empty(devices, bigarray_bound=16, compression={"type": "2bit", "threshold": t})
    state = jaxkv.init(state, {k: jnp.zeros(s) for k, s in shapes.items()})
    residuals = {k: {d: np.zeros(s, np.float32) for d in range(8)} for k, s in shapes.items()}
    stored = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    for _ in range(6):
        pushes = {}
        for k, s in shapes.items():
            ds = sorted(rng.choice(8, size=rng.integers(1, 9), replace=False).tolist())
            pushes[k] = {d: rng.normal(size=s).astype(np.float32) for d in ds}
        state = jaxkv.push(
            state,
            list(pushes),
            [[jax.device_put(g, devices[d]) for d, g in p.items()] for p in pushes.values()],
            updater=lambda key, pushed, st: st + pushed,
        )
        for k, p in pushes.items():
            stored[k] = stored[k] + model_push(residuals[k], p, np.float32(t))
            np.testing.assert_allclose(np.asarray(state[k]), stored[k], atol=1e-5)
    # Each device's residual lives on that device, in its own block.
    big = state.residuals["big"]
    for shard in big.addressable_shards:
        d = devices.index(shard.device)
        np.testing.assert_allclose(np.asarray(shard.data), residuals["big"][d], atol=1e-5)


def test_fp16_rounds_each_device_value_before_the_sum(devices):
    state = jaxkv.init(jaxkv.empty(devices, compression={"type": "fp16"}), {"w": jnp.zeros(3)})
    third = np.float32(1 / 3)
    state = jaxkv.push(state, "w", [jax.device_put(jnp.full(3, third), d) for d in devices[:2]])
    expected = 2 * np.float32(np.float16(third))
    np.testing.assert_array_equal(np.asarray(state["w"]), np.full(3, expected, np.float32))
    assert state.residuals["w"] is None


def test_compressed_state_is_pure_and_refused_inside_jit(devices):
    state = jaxkv.init(
        jaxkv.empty(devices, compression={"type": "2bit", "threshold": 1.0}), {"w": jnp.zeros(2)}
    )
    new = jaxkv.push(state, "w", [jax.device_put(jnp.full(2, 0.6), d) for d in devices[:2]])
    np.testing.assert_array_equal(np.asarray(state.residuals["w"]), np.zeros(16))
    assert float(np.abs(np.asarray(new.residuals["w"])).sum()) == pytest.approx(2.4)
    with pytest.raises(jaxkv.KVStoreError, match="eager"):
        jax.jit(lambda s, g: jaxkv.push(s, "w", g))(new, jnp.ones(2))


def test_save_and_load_keep_residuals_and_compression(tmp_path):
    kv = device_store()
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    kv.init(3, mx.nd.zeros((2, 3)))
    kv.push(3, [mx.nd.ones((2, 3), mx.cpu(d)) * 0.3 * (d + 1) for d in range(2)])
    kv.save(tmp_path / "store.npz")
    fresh = device_store()
    fresh.load(tmp_path / "store.npz")
    assert fresh.state.compression == ("2bit", 0.5)
    for store in (kv, fresh):  # the second push of the MXNet sequence: 1.0 if residuals kept
        store.push(3, [mx.nd.ones((2, 3), mx.cpu(d)) * 0.3 * (d + 1) for d in range(2)])
    np.testing.assert_array_equal(np.asarray(fresh.pull(3)), np.full((2, 3), 1.0))
    np.testing.assert_array_equal(np.asarray(kv.pull(3)), np.asarray(fresh.pull(3)))


def test_the_nightly_compression_cases():
    """MXNet's nightly 2-bit cases (tests/nightly/test_kvstore.py), in our words: a
    local_allreduce_device store over 4 devices, a `stored += 2 * input` updater (MXNet's
    'test' optimizer with rescale_grad=2), threshold 0.5, small, medium and big (sharded) keys.
    Run through MXNet 1.9.1 itself, this sequence pulls 0, 0, 0, 4, 4, 8, 4, 0, -4 for each
    key, as asserted here."""
    t, rate, workers = 0.5, 2, 4
    shapes = {3: (4, 4), 5: (100, 100), 7: (1200, 1200)}
    kv = device_store("local_allreduce_device")
    kv.set_gradient_compression({"type": "2bit", "threshold": t})
    kv._set_updater(lambda key, inp, stored: stored.__iadd__(inp * rate))
    for k, s in shapes.items():
        kv.init(k, mx.nd.zeros(s))
    kv.init(9, mx.nd.ones((4, 4)))  # never pushed

    def push_all(k, value):
        kv.push(k, [mx.nd.ones(shapes[k], mx.cpu(g)) * value for g in range(workers)])

    def pulled(k):
        outs = [mx.nd.ones(shapes[k], mx.cpu(g)) for g in range(workers)]
        kv.pull(k, out=outs)
        for o in outs[1:]:
            np.testing.assert_array_equal(o.asnumpy(), outs[0].asnumpy())
        return outs[0].asnumpy()

    np.testing.assert_array_equal(pulled(3) * 0 + np.asarray(kv.pull(9)), np.ones((4, 4)))
    for k in shapes:
        assert not pulled(k).any()  # before any push
        push_all(k, 0.0)
        assert not pulled(k).any()  # zeros stay zeros
        # The residual carries what falls below the threshold until it crosses it.
        push_all(k, 0.4)
        assert not pulled(k).any()
        push_all(k, t - 0.3)
        np.testing.assert_allclose(pulled(k), t * rate * workers)
        push_all(k, 0.2)
        np.testing.assert_allclose(pulled(k), t * rate * workers)
        push_all(k, t - 0.3)
        current = 2 * t * rate * workers
        np.testing.assert_allclose(pulled(k), current)
        for _ in range(3):  # the residual is 0 again: -t goes through whole
            push_all(k, -t)
            current -= t * rate * workers
            np.testing.assert_allclose(pulled(k), current)


@pytest.mark.parametrize("kind", ["2bit", "fp16", "bf16"])
def test_integer_values_are_refused_as_mxnet_does(kind):
    """A 2-bit threshold cast to int32 would be 0 and drop every push; rounding big integers to
    fp16 would change them. MXNet refuses compression of non-float values, and so does jaxkv,
    whichever comes first: the compression or the key."""
    params = {"type": kind, "threshold": 0.5} if kind == "2bit" else {"type": kind}
    kv = device_store()
    kv.set_gradient_compression(params)
    kv.init(3, mx.nd.zeros(4))  # float32: fine
    with pytest.raises(jaxkv.KVStoreError, match=f"key 5: gradient compression '{kind}'.*int32"):
        kv.init([4, 5], [mx.nd.zeros(4), mx.nd.zeros(4, dtype="int32")])
    assert kv.keys() == [3]
    plain = device_store()
    plain.init([3, 5], [mx.nd.zeros(4), mx.nd.zeros(4, dtype="int32")])
    with pytest.raises(jaxkv.KVStoreError, match=f"key 5: gradient compression '{kind}'.*int32"):
        plain.set_gradient_compression(params)
    assert plain.state.compression is None
    with pytest.raises(jaxkv.KVStoreError, match="key 'i'.*int32"):
        jaxkv.init(
            jaxkv.empty(jax.devices("cpu"), compression=params), {"i": jnp.zeros(2, jnp.int32)}
        )
    # Integer values pushed to a float key are cast first, and compress as floats.
    kv.push(3, [mx.nd.array([3, 0, 0, -3], dtype="int32", ctx=mx.cpu(d)) for d in range(2)])
    expected = [1.0, 0.0, 0.0, -1.0] if kind == "2bit" else [6.0, 0.0, 0.0, -6.0]
    assert kv.pull(3).tolist() == expected


def test_values_from_one_device_are_cast_before_they_are_summed(devices):
    """As in an uncompressed push: each value is cast to the stored dtype, then the device's
    values are summed, then compressed. (Summed in float32 first, cpu(0)'s share would round to
    1 + 2**-10 in float16 and leave a residual of 0.5 + 2**-10.) float32 into float16 is the
    drop-in's cast (MXNet's); jaxkv's own store refuses it and widens float16 into float32."""
    import jaxkv.mx as mx

    kv = mx.kv.create("device")
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    kv.init("h", mx.nd.zeros((1,), dtype="float16"))
    a, b = np.float32(1 + 2**-11), np.float32(2**-11)
    on0 = lambda x: jax.device_put(jnp.asarray(x), devices[0])  # noqa: E731
    kv.push("h", [mx.nd.array([a], dtype="float32"), mx.nd.array([b], dtype="float32")])
    assert float(np.asarray(kv.state.residuals["h"])[0]) == 0.5
    assert float(np.asarray(kv.pull("h"))[0]) == 0.5
    state = jaxkv.init(
        jaxkv.empty(devices, compression={"type": "2bit", "threshold": 0.5}),
        {"h": jnp.zeros(1, jnp.float16), "f": jnp.zeros(1)},
    )
    with pytest.raises(jaxkv.DtypeError, match="key 'h'"):
        jaxkv.push(state, {"h": [on0([a]), on0([b])]})
    new = jaxkv.push(state, {"f": [on0(jnp.ones(1, jnp.float16)), on0(np.ones(1))]})
    np.testing.assert_array_equal(np.asarray(new.residuals["f"])[0], [1.5])  # 2 - 0.5


def test_a_store_on_one_process_compresses_per_device_in_a_job_of_several(monkeypatch):
    """Only a store over several processes compresses once per process (and is refused with
    several devices in one: tests/test_dist_compression.py); one on this process's devices
    keeps the per-device semantics of MXNet's device store."""
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    state = jaxkv.empty(jax.devices("cpu")[:2], compression={"type": "2bit", "threshold": 0.5})
    assert state.compression == ("2bit", 0.5)
