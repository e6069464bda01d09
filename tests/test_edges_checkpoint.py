"""Saving and loading at the edges: str keys, empty and scalar values, compression kept or not,
refused manifests named by the field that is wrong, and no temporary file left by a failed save."""

import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _devices import SPLIT_BOUND, cpu_empty, cpu_store

import jaxkv
from jaxkv import nd


def leaves(kv):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(kv.state)]


def assert_same_leaves(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)


def edit_manifest(path, edit):
    """Rewrite the store file at ``path`` after ``edit(manifest)``, its checksum recomputed."""
    with np.load(path) as z:
        arrays = {name: z[name].copy() for name in z.files}
    manifest = json.loads(bytes(arrays["manifest"]).decode())
    edit(manifest)
    text = json.dumps(manifest).encode()
    arrays["manifest"] = np.frombuffer(text, np.uint8)
    arrays["manifest_sha256"] = np.frombuffer(hashlib.sha256(text).hexdigest().encode(), np.uint8)
    np.savez(path, **arrays)


@pytest.mark.parametrize("keys", [["b", "a"], [7, 2]], ids=["str keys", "int keys"])
def test_stores_of_either_key_kind_round_trip(tmp_path, keys):
    kv = cpu_store("local")
    kv.set_optimizer(optax.sgd(0.5, momentum=0.5))
    kv.init(keys, [nd.ones((2, 2)), nd.array(np.arange(3.0))])
    kv.push(keys, [nd.ones((2, 2)), nd.ones(3)])
    kv.save(tmp_path / "s.npz")
    kv.save_optimizer_states(tmp_path / "o.npz")
    fresh = cpu_store("local")
    fresh.set_optimizer(optax.sgd(0.5, momentum=0.5))
    fresh.load(tmp_path / "s.npz")
    assert fresh.keys() == sorted(keys)
    assert_same_leaves(leaves(fresh), leaves(kv))
    fresh.load_optimizer_states(tmp_path / "o.npz")
    assert_same_leaves(leaves(fresh), leaves(kv))


def test_empty_scalar_and_sharded_values_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("MXNET_KVSTORE_BIGARRAY_BOUND", str(SPLIT_BOUND))  # "big" is split
    kv = cpu_store("local")
    kv.init(
        ["empty", "scalar", "big", "half"],
        [
            nd.zeros((0, 3)),
            nd.array(np.float32(2.5)),
            nd.array(np.arange(16384.0, dtype=np.float32).reshape(64, 256)),
            nd.array(np.arange(4.0)).astype(np.float16),
        ],
    )
    kv.save(tmp_path / "s.npz")
    fresh = cpu_store("local")
    fresh.load(tmp_path / "s.npz")
    assert_same_leaves(leaves(fresh), leaves(kv))
    assert fresh.pull("empty").shape == (0, 3)
    assert not fresh.state["big"].sharding.is_fully_replicated  # placed as the store keeps it


def test_an_empty_store_round_trips(tmp_path):
    cpu_store("local").save(tmp_path / "s.npz")
    fresh = cpu_store("local")
    fresh.init(1, nd.ones(2))
    fresh.load(tmp_path / "s.npz")
    assert fresh.keys() == []


@pytest.mark.parametrize(
    "compression",
    [None, {"type": "2bit", "threshold": 0.25}, {"type": "fp16"}, {"type": "bf16"}],
)
def test_the_compression_comes_back_with_the_store(tmp_path, compression, devices):
    kv = cpu_store("device")
    if compression:
        kv.set_gradient_compression(compression)
    kv.init("w", nd.zeros(3))
    kv.push("w", [nd.ones(3, jaxkv.cpu(d)) * 0.2 for d in range(3)])
    kv.save(tmp_path / "s.npz")
    fresh = cpu_store("device")
    fresh.load(tmp_path / "s.npz")
    expected = None if compression is None else cpu_empty(compression=compression).compression
    assert fresh.state.compression == expected
    assert_same_leaves(leaves(fresh), leaves(kv))
    for store in (kv, fresh):  # the next push agrees too (2-bit: the residuals carried over)
        store.push("w", [nd.ones(3, jaxkv.cpu(d)) * 0.2 for d in range(3)])
    np.testing.assert_array_equal(np.asarray(fresh.pull("w")), np.asarray(kv.pull("w")))


@pytest.mark.parametrize(
    "edit, pattern",
    [
        (lambda m: m["arrays"][0].update(shape=[-1, 2]), r"'shape' a list of sizes"),
        (lambda m: m["arrays"][0].update(shape=[2, 1.5]), r"'shape' a list of sizes"),
        (lambda m: m.update(compression=[]), r"expected 'compression' a list"),
        (lambda m: m.update(compression="fp16"), r"expected 'compression' a list"),
        (lambda m: m.update(compression=["fp16", 1]), r"'compression'"),
        (lambda m: m.update(keys=["w", 3]), "all int or all str"),
        (lambda m: m.update(values=1), "'values' true or false"),
        (lambda m: m["arrays"][0].update(dtype=["float32"]), "'dtype' a dtype name"),
        (lambda m: m["arrays"].__setitem__(0, ["w"]), r"arrays\[0\] an object"),
    ],
)
def test_malformed_manifests_are_refused_naming_the_field(tmp_path, edit, pattern):
    kv = cpu_store("local")
    kv.init("w", nd.array(np.arange(4.0).reshape(2, 2)))
    path = tmp_path / "s.npz"
    kv.save(path)
    edit_manifest(path, edit)
    fresh = cpu_store("local")
    fresh.init("x", nd.ones(1))
    with pytest.raises(jaxkv.KVStoreError, match=pattern):
        fresh.load(path)
    assert fresh.keys() == ["x"]


def test_a_failed_save_leaves_no_temporary_file_and_changes_nothing(tmp_path):
    kv = cpu_store("local")
    kv.init("w", nd.ones(2))
    target = tmp_path / "taken"
    target.mkdir()  # the file cannot replace a directory
    with pytest.raises(jaxkv.KVStoreError, match="is a directory") as error:
        kv.save(target)
    assert isinstance(error.value.__cause__, IsADirectoryError)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]
    assert list(target.iterdir()) == []
    kv.save(tmp_path / "s.npz")  # the store is fine
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.npz", "taken"]


def test_a_residual_saved_for_another_store_shape_is_refused(tmp_path, devices):
    kv = jaxkv.KVStore("device", devices=devices[:2])
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    kv.init("w", nd.zeros(3))
    kv.save(tmp_path / "s.npz")
    fresh = cpu_store("device")  # 8 devices: residuals of 8 blocks expected
    with pytest.raises(jaxkv.KVStoreError, match=r"residual expected shape \(24,\)"):
        fresh.load(tmp_path / "s.npz")
    same = jaxkv.KVStore("device", devices=devices[4:6])  # 2 other devices: fine
    same.load(tmp_path / "s.npz")
    assert same.state.residuals["w"].shape == (6,)
    assert same.state.residuals["w"].sharding.device_set == set(devices[4:6])


def test_values_load_onto_the_loading_store_devices(tmp_path, devices):
    kv = jaxkv.KVStore("local", devices=devices[:2])
    kv.init(3, nd.array(np.arange(6.0)))
    kv.save(tmp_path / "s.npz")
    fresh = jaxkv.KVStore("local", devices=devices[5:])
    fresh.load(tmp_path / "s.npz")
    assert fresh.state[3].sharding.device_set == set(devices[5:])
    np.testing.assert_array_equal(np.asarray(fresh.pull(3)), np.arange(6.0))
    assert jnp.asarray(fresh.pull(3)).dtype == jnp.float32


def test_an_array_the_manifest_does_not_list_is_refused(tmp_path):
    """As a checkpoint directory refuses a stray file: nothing beside the listed arrays."""
    import io
    import zipfile

    kv = cpu_store("local")
    kv.init("w", nd.ones(3))
    path = tmp_path / "s.npz"
    kv.save(path)
    with zipfile.ZipFile(path, "a") as z:
        stray = io.BytesIO()
        np.save(stray, np.zeros(2))
        z.writestr("a9.npy", stray.getvalue())
    other = cpu_store("local")
    other.init("v", nd.zeros(2))
    before = leaves(other)
    with pytest.raises(jaxkv.KVStoreError, match=r"no arrays but the manifest's, given \['a9'\]"):
        other.load(path)
    assert_same_leaves(leaves(other), before)
