"""Saving and loading: every malformed or mismatched file is a KVStoreError that changes nothing.

Files are damaged the way a disk, a copy or a person would: array bytes flipped inside a valid
zip (so zip's own CRC-32 cannot catch it), the manifest edited with or without its checksum
recomputed, entries removed, a file of the other kind, optimizer states of another optimizer.
"""

import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _devices import cpu_store

import jaxkv
from jaxkv import nd

SHAPE = (2, 3)
SGD = optax.sgd(0.1, momentum=0.9)
ADAM = optax.adam(0.1)


def store(optimizer=SGD, compression=None, name="device"):
    kv = cpu_store(name)
    if compression is not None:
        kv.set_gradient_compression(compression)
    if optimizer is not None:
        kv.set_optimizer(optimizer)
    kv.init([3, 5], [nd.ones(SHAPE) * 2, nd.array(np.arange(6.0).reshape(SHAPE))])
    kv.push([3, 5], [[nd.ones(SHAPE, jaxkv.cpu(d)) * (d + 1) for d in range(2)]] * 2)
    return kv


def contents(kv):
    """Every leaf of the store (values, optimizer states, residuals) as NumPy arrays."""
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(kv.state)]


def assert_unchanged(kv, before):
    after = contents(kv)
    assert len(after) == len(before)
    for a, b in zip(after, before):
        np.testing.assert_array_equal(a, b)


def rewrite(path, edit, *, rehash=True):
    """Rewrite the .npz at ``path`` as a valid zip after ``edit(arrays, manifest)``; the
    manifest's checksum is recomputed unless ``rehash=False``."""
    with np.load(path) as z:
        arrays = {name: z[name].copy() for name in z.files}
    original = arrays["manifest"]
    manifest = json.loads(bytes(original).decode())
    edit(arrays, manifest)
    if arrays["manifest"] is original:  # else the edit replaced the manifest's bytes itself
        arrays["manifest"] = np.frombuffer(json.dumps(manifest).encode(), np.uint8)
    text = bytes(arrays["manifest"])
    if rehash:
        digest = hashlib.sha256(text).hexdigest().encode()
        arrays["manifest_sha256"] = np.frombuffer(digest, np.uint8)
    np.savez(path, **arrays)


def test_flipped_array_bytes_inside_a_valid_zip_are_caught_by_the_checksum(tmp_path):
    kv = store()
    path = tmp_path / "s.npz"
    kv.save(path)

    def flip(arrays, manifest):
        # One bit of the optimizer state of group [3, 5]; the zip stays valid.
        n = next(n for n, e in enumerate(manifest["arrays"]) if e["part"] == "opt")
        arrays[f"a{n}"][5] ^= 0x01

    rewrite(path, flip)
    kv.push([3, 5], [nd.ones(SHAPE)] * 2)
    before = contents(kv)
    with pytest.raises(jaxkv.KVStoreError, match=r"optimizer group 0 opt.*checksum mismatch"):
        kv.load(path)
    assert_unchanged(kv, before)


def test_an_edited_manifest_is_caught_by_its_own_checksum(tmp_path):
    kv = store()
    path = tmp_path / "s.npz"
    kv.save(path)

    def swap_keys(arrays, manifest):  # consistent, plausible, and wrong
        for entry in manifest["arrays"]:
            if "key" in entry:
                entry["key"] = {3: 5, 5: 3}[entry["key"]]

    rewrite(path, swap_keys, rehash=False)
    before = contents(kv)
    with pytest.raises(jaxkv.KVStoreError, match="manifest checksum mismatch"):
        kv.load(path)
    assert_unchanged(kv, before)


def _drop(field):
    return lambda a, m: m.pop(field)


def _entry(n, **changes):
    return lambda a, m: m["arrays"][n].update(changes)


MALFORMED = {
    "values renamed": (lambda a, m: m.update(valuez=m.pop("values")), "'values'"),
    "keys missing": (_drop("keys"), "'keys'"),
    "keys mixed": (lambda a, m: m.update(keys=[3, "5"]), "all int or all str"),
    "keys repeated": (lambda a, m: m.update(keys=[3, 3]), "distinct"),
    "an entry removed": (lambda a, m: m["arrays"].pop(0), "key 3 with 1 value"),
    "an array removed": (lambda a, m: a.pop("a0"), "an array a0"),
    "an extra entry": (lambda a, m: m["arrays"].append(dict(m["arrays"][0])), "an array a"),
    "unknown key": (_entry(0, key=9), "'key' one of"),
    "unknown part": (_entry(0, part="valuez"), "'part' one of"),
    "shape not a list": (_entry(0, shape="2x3"), "'shape'"),
    "negative size": (_entry(0, shape=[-2, -3]), "'shape'"),
    "shape of other size": (_entry(0, shape=[4, 3]), "expected 48 bytes.*given 24"),
    "bogus dtype": (_entry(0, dtype="float33"), "'dtype'"),
    "null dtype": (_entry(0, dtype=None), "'dtype'"),
    "dtype of other size": (_entry(0, dtype="float64"), "expected 48 bytes.*given 24"),
    "path not a str": (_entry(0, path=None), "'path'"),
    "checksum not a str": (_entry(0, sha256=0), "'sha256'"),
    "format": (lambda a, m: m.update(format="other"), "format"),
    "version": (lambda a, m: m.update(version=1), "version"),
    "compression bogus": (lambda a, m: m.update(compression=["3bit"]), "'compression'"),
    "compression threshold": (lambda a, m: m.update(compression=["2bit", -1]), "greater than 0"),
    "residual missing": (lambda a, m: m.update(compression=["2bit", 0.5]), "residual"),
    "not an object": (lambda a, m: a.update(manifest=np.frombuffer(b"[1]", np.uint8)), "object"),
    "not JSON": (lambda a, m: a.update(manifest=np.frombuffer(b"{x", np.uint8)), "JSON"),
    "not UTF-8": (lambda a, m: a.update(manifest=np.frombuffer(b"\xff", np.uint8)), "decode"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_every_malformed_manifest_is_a_kvstore_error(tmp_path, case):
    edit, pattern = MALFORMED[case]
    kv = store()
    path = tmp_path / "s.npz"
    kv.save(path)
    rewrite(path, edit)
    before = contents(kv)
    with pytest.raises(jaxkv.KVStoreError, match=pattern) as info:
        kv.load(path)
    assert str(path) in str(info.value)
    assert_unchanged(kv, before)


@pytest.mark.parametrize(
    "raw",
    [b"", b"not a zip at all", b"PK\x03\x04" + b"\x00" * 40],
    ids=["empty", "text", "truncated zip"],
)
def test_files_that_are_not_stores_are_refused(tmp_path, raw):
    path = tmp_path / "s.npz"
    path.write_bytes(raw)
    kv = store()
    before = contents(kv)
    with pytest.raises(jaxkv.KVStoreError, match="cannot be read"):
        kv.load(path)
    assert_unchanged(kv, before)


def test_a_single_array_file_is_refused(tmp_path):
    np.save(tmp_path / "one.npy", np.zeros(3))
    with pytest.raises(jaxkv.KVStoreError, match="expected an .npz archive"):
        store().load(tmp_path / "one.npy")


def test_an_npz_without_a_checksummed_manifest_is_refused(tmp_path):
    path = tmp_path / "s.npz"
    manifest = json.dumps({"format": "jaxkv-store", "version": 1, "values": True, "keys": []})
    np.savez(path, manifest=np.frombuffer(manifest.encode(), np.uint8))
    kv = store()
    with pytest.raises(jaxkv.KVStoreError, match="checksummed manifest"):
        kv.load(path)
    with pytest.raises(jaxkv.KVStoreError, match="cannot be read"):
        kv.load(tmp_path / "missing.npz")


def test_a_file_of_the_other_kind_is_refused(tmp_path):
    kv = store()
    kv.save(tmp_path / "store.npz")
    kv.save_optimizer_states(str(tmp_path / "opt.npz"))
    before = contents(kv)
    with pytest.raises(jaxkv.KVStoreError, match="expected a whole-store file"):
        kv.load(tmp_path / "opt.npz")
    with pytest.raises(jaxkv.KVStoreError, match="expected an optimizer-state file"):
        kv.load_optimizer_states(str(tmp_path / "store.npz"))
    assert_unchanged(kv, before)


@pytest.mark.standard_promotion  # Adam
def test_optimizer_states_of_another_optimizer_are_refused(tmp_path):
    momentum = store(SGD)
    momentum.save(tmp_path / "store.npz")
    momentum.save_optimizer_states(str(tmp_path / "opt.npz"))
    adam = store(ADAM)
    before = contents(adam)
    with pytest.raises(jaxkv.KVStoreError, match=r"group \[3, 5\]: optimizer state expected"):
        adam.load(tmp_path / "store.npz")
    with pytest.raises(jaxkv.KVStoreError, match=r"group \[3, 5\]: optimizer state expected"):
        adam.load_optimizer_states(str(tmp_path / "opt.npz"))
    assert_unchanged(adam, before)
    plain = store(None)
    with pytest.raises(jaxkv.KVStoreError, match="set_optimizer"):
        plain.load(tmp_path / "store.npz")


def test_optimizer_states_for_other_keys_are_refused(tmp_path):
    kv = store()
    kv.save_optimizer_states(str(tmp_path / "opt.npz"))
    other = cpu_store("local")
    other.set_optimizer(SGD)
    other.init([3, 4], [nd.ones(SHAPE), nd.ones(SHAPE)])
    with pytest.raises(jaxkv.KVStoreError, match=r"optimizer states for keys \[3, 4\]"):
        other.load_optimizer_states(str(tmp_path / "opt.npz"))


def test_residuals_of_another_device_count_are_refused(tmp_path):
    two_bit = {"type": "2bit", "threshold": 0.5}
    kv = store(None, two_bit)
    kv.save(tmp_path / "s.npz")
    fewer = jaxkv.KVStore("device", devices=jax.devices("cpu")[:4])
    with pytest.raises(jaxkv.KVStoreError, match=r"key 3: residual expected shape \(8, 3\)"):
        fewer.load(tmp_path / "s.npz")
    assert fewer.keys() == []


def test_compression_of_integer_values_in_a_file_is_refused(tmp_path):
    kv = cpu_store("device")
    kv.init(3, jnp.arange(6, dtype=jnp.int32).reshape(SHAPE))
    kv.save(tmp_path / "s.npz")
    rewrite(tmp_path / "s.npz", lambda a, m: m.update(compression=["fp16"]))
    fresh = cpu_store("device")
    with pytest.raises(jaxkv.KVStoreError, match="key 3: gradient compression 'fp16'.*int32"):
        fresh.load(tmp_path / "s.npz")
    assert fresh.keys() == []


@pytest.mark.standard_promotion  # Adam
def test_round_trip_keeps_every_leaf_and_the_next_push_agrees(tmp_path):
    for optimizer, compression in [(ADAM, None), (None, {"type": "2bit", "threshold": 0.5})]:
        kv = store(optimizer, compression)
        kv.save(tmp_path / "s.npz")
        fresh = cpu_store("device")
        if optimizer is not None:
            fresh.set_optimizer(optimizer)
        fresh.load(tmp_path / "s.npz")
        assert fresh.state.compression == kv.state.compression
        assert_unchanged(fresh, contents(kv))
        for s in (kv, fresh):
            s.push([3, 5], [[nd.ones(SHAPE, jaxkv.cpu(d)) * 0.3 for d in range(2)]] * 2)
        assert_unchanged(fresh, contents(kv))


def test_a_store_on_one_process_of_several_saves_files_not_directories(tmp_path, monkeypatch):
    kv = store()
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "manifest.json").write_text("{}")  # looks like a checkpoint directory
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    kv.save(tmp_path / "s.npz")  # this process's store, as in a single-process job
    fresh = store(optimizer=SGD)
    fresh.load(tmp_path / "s.npz")
    assert_unchanged(fresh, contents(kv))
    for call in (kv.save, kv.load):
        with pytest.raises(jaxkv.KVStoreError, match="by every process of the job together"):
            call(tmp_path / "dir")
    assert sorted(p.name for p in (tmp_path / "dir").iterdir()) == ["manifest.json"]


def test_checkpoint_directories_without_orbax_name_the_extra(tmp_path, monkeypatch):
    import sys

    kv = store()
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "manifest.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "orbax.checkpoint", None)  # as if not installed
    with pytest.raises(jaxkv.KVStoreError, match=r"pip install 'jaxkv\[dist\]'"):
        kv.save(tmp_path / "dir")
    assert sorted(p.name for p in (tmp_path / "dir").iterdir()) == ["manifest.json"]
