"""jaxkv/_src/checkpoint/orbax_dirs.py (one process): which process hashes each file, the
manifest's file records (process below the count, size from zero, 64 hex digits), every data
file verified, and orbax's own record of each array matched before a restore."""

import hashlib
import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxkv
from jaxkv._src.checkpoint import npz, orbax_dirs
from jaxkv._src.checkpoint.manifest import Malformed

pytest.importorskip("orbax.checkpoint")

SGD = optax.sgd(0.1, momentum=0.9)
TOKEN = "data-" + "0123456789abcdef"
SHA = "0" * 64


def _store(devices, shift=0.0):
    """Keys 0 (3 elements), 1 (a scalar: 1 element) and 2 (empty) on 2 devices, one SGD
    group: orbax is given arrays of sizes 3 and 1, never one of size 0."""
    values = {0: jnp.arange(3.0) + shift, 1: jnp.float32(5 + shift), 2: jnp.zeros((0,))}
    return jaxkv.init_optimizer(jaxkv.init(jaxkv.empty(devices[:2]), values), SGD)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, devices):
    """A checkpoint directory of ``_store`` (saved once: orbax takes a second)."""
    path = str(tmp_path_factory.mktemp("orbax") / "ckpt")
    npz.save(path, _store(devices), values=True, directory=True)
    return path


@pytest.fixture
def ckpt(saved, tmp_path):
    """A copy of the saved checkpoint for a test to change."""
    path = str(tmp_path / "ckpt")
    shutil.copytree(saved, path)
    return path


def _manifest(path):
    with open(os.path.join(path, orbax_dirs.MANIFEST)) as f:
        return json.loads(json.loads(f.read())["manifest"])


def _write_manifest(path, manifest, sha=None):
    text = json.dumps(manifest)
    sha = sha or hashlib.sha256(text.encode()).hexdigest()
    with open(os.path.join(path, orbax_dirs.MANIFEST), "w") as f:
        f.write(json.dumps({"manifest": text, "sha256": sha}))


def _values(state):
    return [np.asarray(state[k]) for k in state.keys()]


def test_a_checkpoint_loads_back_its_scalar_and_empty_values_on_other_devices(saved, devices):
    loaded = npz.load(saved, jaxkv.empty(devices[4:6]), values=True, optimizer=SGD)
    want = [np.arange(3.0, dtype=np.float32), np.float32(5), np.zeros((0,), np.float32)]
    for got, w in zip(_values(loaded), want, strict=True):
        assert (got.dtype, got.shape) == (w.dtype, w.shape)
        np.testing.assert_array_equal(got, w)
    assert loaded[1].sharding.device_set == set(devices[4:6])
    assert list(loaded.opt_states) == [(0, 1, 2)]


def test_the_manifest_records_every_data_file_its_size_and_sha256(saved):
    m = _manifest(saved)
    assert (m["format"], m["version"], m["processes"]) == ("jaxkv-checkpoint", 1, 1)
    assert set(os.listdir(saved)) == {orbax_dirs.MANIFEST, m["data"]}
    root = os.path.join(saved, m["data"], "state")
    on_disk = {}
    for top, _, names in os.walk(root):
        for name in names:
            with open(os.path.join(top, name), "rb") as f:
                raw = f.read()
            rel = os.path.relpath(os.path.join(top, name), root).replace(os.sep, "/")
            on_disk[rel] = {
                "process": 0,
                "size": len(raw),
                "sha256": hashlib.sha256(raw).hexdigest(),
            }
    assert m["files"] == on_disk
    assert [e["shape"] for e in m["arrays"] if e["part"] == "value"] == [[3], [], [0]]


@pytest.mark.parametrize(
    ("rel", "owner"),
    [
        ("ocdbt.process_3/d/abc", 3),
        ("array_metadatas/process_12", 12),
        ("a.process_1/b.process_2/c", 2),  # the innermost name that ends in one
        ("ocdbt.process_3x/d", 0),  # process_3x is no process's name
        ("process_/d", 0),
        ("manifest.ocdbt", 0),
        ("_METADATA", 0),
    ],
)
def test_a_file_is_hashed_by_the_process_its_path_names_else_by_process_0(rel, owner):
    assert orbax_dirs._owner(rel) == owner


def test_files_are_listed_sorted_relative_and_with_slashes(tmp_path):
    for rel in ("b", "a/z", "a/b/c", "_x"):
        os.makedirs(os.path.dirname(tmp_path / rel), exist_ok=True)
        (tmp_path / rel).write_bytes(b"")
    assert orbax_dirs._files(str(tmp_path)) == ["_x", "a/b/c", "a/z", "b"]


@pytest.mark.parametrize("size", [0, 2, 3, 4, 7])
def test_a_digest_covers_every_chunk_up_to_the_last_byte(tmp_path, monkeypatch, size):
    monkeypatch.setattr(orbax_dirs, "_CHUNK", 3)  # files of 0, 1, 2 and 3 chunks
    raw = bytes(range(10, 10 + size))
    (tmp_path / "f").write_bytes(raw)
    assert orbax_dirs._digest(str(tmp_path / "f")) == (size, hashlib.sha256(raw).hexdigest())


def _records(processes=2, **file):
    f = {"process": processes - 1, "size": 0, "sha256": SHA} | file
    return {"data": TOKEN, "processes": processes, "files": {"d/x": f}}


@pytest.mark.parametrize(
    "manifest",
    [
        _records(),  # the last process, an empty file
        _records(processes=1, process=0, size=5, sha256="a" * 64),
        {"data": TOKEN, "processes": 1, "files": {}},
    ],
)
def test_file_records_as_save_writes_them_are_accepted(manifest):
    orbax_dirs._check_files(manifest)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"data": "data-" + "0" * 15}, "'data' a data directory"),
        ({"data": "data-" + "0" * 17}, "'data' a data directory"),
        ({"data": "data-" + "A" * 16}, "'data' a data directory"),
        ({"data": "../" + TOKEN}, "'data' a data directory"),
        ({"processes": 0}, "'processes' a count, given 0"),
        ({"processes": True}, "'processes' a count, given True"),
        ({"files": []}, "'files' an object"),
    ],
)
def test_a_data_directory_process_count_or_file_table_of_another_form_is_refused(change, match):
    with pytest.raises(Malformed, match=match):
        orbax_dirs._check_files(_records() | change)


@pytest.mark.parametrize(
    "file",
    [
        {"process": 2},  # the process count: one past the last
        {"process": -1},
        {"process": True},
        {"size": -1},
        {"size": 1.0},
        {"size": True},
        {"sha256": SHA[:-1]},
        {"sha256": SHA + "0"},
        {"sha256": "A" * 64},
        {"sha256": None},
    ],
)
def test_a_file_record_with_another_process_size_or_digest_is_refused(file):
    with pytest.raises(Malformed, match=r"files\['d/x'\] with its process, size and SHA-256"):
        orbax_dirs._check_files(_records(**file))


@pytest.mark.parametrize("rel", ["", "a//b", "./a", "a/../b", "..", "a/"])
def test_a_file_path_that_leaves_or_repeats_the_data_directory_is_refused(rel):
    m = _records()
    m["files"] = {rel: m["files"]["d/x"]}
    with pytest.raises(Malformed, match="a relative path"):
        orbax_dirs._check_files(m)


def _data(tmp_path, files):
    root = tmp_path / "state"
    records = {}
    for rel, raw in files.items():
        os.makedirs(os.path.dirname(root / rel), exist_ok=True)
        (root / rel).write_bytes(raw)
        records[rel] = {"process": 0, "size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    return str(root), records


def _remove(root, records):
    os.unlink(f"{root}/d/b")


def _add(root, records):
    with open(f"{root}/d/c", "wb"):
        pass


def _alter(root, records):
    with open(f"{root}/d/b", "wb") as f:
        f.write(b"xyZ")  # the size kept


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda root, r: None, None),
        (
            _remove,
            r"expected the data files the manifest lists, given 1 missing \['d/b'\] and 0 not "
            r"listed \[\]",
        ),
        (
            _add,
            r"expected the data files the manifest lists, given 0 missing \[\] and 1 not "
            r"listed \['d/c'\]",
        ),
        (lambda root, r: r["d/b"].update(size=4), "data file d/b: expected 4 bytes, given 3"),
        (lambda root, r: r["a"].update(size=1), "data file a: expected 1 bytes, given 0"),
        (_alter, "data file d/b: checksum mismatch, expected the SHA-256 process 0 saved"),
    ],
)
def test_every_data_file_is_verified_present_listed_sized_and_hashed(tmp_path, damage, match):
    root, records = _data(tmp_path, {"a": b"", "d/b": b"xyz"})
    damage(root, records)
    if match is None:
        orbax_dirs._verify("ckpt", root, records)
        return
    with pytest.raises(jaxkv.KVStoreError, match=f"^ckpt: {match}"):
        orbax_dirs._verify("ckpt", root, records)


def _refused(path, match, devices):
    like = _store(devices, shift=1.0)
    before = _values(like)
    with pytest.raises(jaxkv.KVStoreError, match=match):
        npz.load(path, like, values=True, optimizer=SGD)
    for got, want in zip(_values(like), before, strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_manifest_missing_unreadable_or_not_matching_its_checksum_is_refused(ckpt, devices):
    m = _manifest(ckpt)
    _write_manifest(ckpt, m, sha="f" * 64)
    _refused(ckpt, "manifest checksum mismatch", devices)
    with open(os.path.join(ckpt, orbax_dirs.MANIFEST), "w") as f:
        f.write(json.dumps({"manifest": json.dumps(m)}))
    _refused(ckpt, "expected an object with 'manifest' and 'sha256'", devices)
    with open(os.path.join(ckpt, orbax_dirs.MANIFEST), "wb") as f:
        f.write(b"\xff{")
    _refused(ckpt, "expected a jaxkv checkpoint manifest, given one that cannot be read", devices)
    os.unlink(os.path.join(ckpt, orbax_dirs.MANIFEST))
    _refused(ckpt, "a directory without manifest.json", devices)


def test_a_manifest_in_the_one_file_format_is_refused(ckpt, devices):
    m = _manifest(ckpt)
    m.update(format="jaxkv-store", version=3)
    _write_manifest(ckpt, m)
    _refused(ckpt, "expected format 'jaxkv-checkpoint' version 1", devices)


def test_an_array_whose_stored_dtype_differs_from_the_manifest_is_refused_not_cast(ckpt, devices):
    m = _manifest(ckpt)
    key0 = [e for e in m["arrays"] if e.get("key") == 0 or e["path"] == "[0].trace[0]"]
    assert [(e["part"], e["dtype"]) for e in key0] == [("value", "float32"), ("opt", "float32")]
    for e in key0:  # key 0 and its momentum, said to be int32: the same bytes
        e["dtype"] = "int32"
    _write_manifest(ckpt, m)
    with pytest.raises(
        jaxkv.KVStoreError,
        match=(
            r"array a0: the data holds shape \(3,\) and dtype float32, the manifest says \(3,\) "
            "and int32"
        ),
    ):
        npz.load(ckpt, jaxkv.empty(devices[:2]), values=True, optimizer=SGD)


def test_arrays_the_manifest_calls_empty_but_the_data_holds_are_refused(ckpt, devices):
    m = _manifest(ckpt)
    scalars = [n for n, e in enumerate(m["arrays"]) if e["shape"] == []]
    assert len(scalars) == 2  # key 1's value and its momentum
    for n in scalars:
        m["arrays"][n]["shape"] = [0]
    _write_manifest(ckpt, m)
    with pytest.raises(
        jaxkv.KVStoreError,
        match=r"the data holds arrays \['a0', 'a1', 'a3', 'a4'\], expected \['a0', 'a3'\]",
    ):
        npz.load(ckpt, jaxkv.empty(devices[:2]), values=True, optimizer=SGD)


def test_a_save_over_a_checkpoint_keeps_only_its_own_data_and_no_temporary_file(ckpt, devices):
    old = _manifest(ckpt)["data"]
    os.makedirs(os.path.join(ckpt, TOKEN))  # a save cut short
    os.makedirs(os.path.join(ckpt, "data-mine"))  # no name a save gives
    for name in (".jaxkv-x.tmp", ".jaxkv-y", "keep.tmp"):
        open(os.path.join(ckpt, name), "wb").close()
    npz.save(ckpt, _store(devices, shift=10.0), values=True)  # already a directory: its format
    new = _manifest(ckpt)["data"]
    assert new not in (old, TOKEN)
    assert sorted(os.listdir(ckpt)) == sorted(
        [".jaxkv-y", "data-mine", "keep.tmp", new, orbax_dirs.MANIFEST]
    )
    loaded = npz.load(ckpt, jaxkv.empty(devices[:2]), values=True, optimizer=SGD)
    np.testing.assert_array_equal(loaded[0], np.arange(3.0, dtype=np.float32) + 10)


def test_a_save_to_an_existing_file_is_refused_and_leaves_it(tmp_path, devices):
    path = tmp_path / "f"
    path.write_bytes(b"mine")
    with pytest.raises(jaxkv.KVStoreError, match="is a directory, given an existing file"):
        orbax_dirs.save(str(path), {}, [])
    assert path.read_bytes() == b"mine" and os.listdir(tmp_path) == ["f"]


def test_a_manifest_with_an_unhashable_key_is_refused(ckpt, devices):
    m = _manifest(ckpt)
    m["arrays"][0]["key"] = [0]
    _write_manifest(ckpt, m)
    _refused(ckpt, "'key' one of", devices)
