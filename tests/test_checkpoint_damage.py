"""Damaged checkpoints. Property-tested: bytes of a saved file (the one-file format) or of any
file of a checkpoint directory (orbax's files and the manifest) are flipped, truncated or
replaced. Loading must raise KVStoreError and leave the store as it was, or, where the damage
hits bytes that nothing reads (or replaces a byte with itself), load exactly the saved values.
Never a wrong value, never another exception.

And file by file: every data file of a checkpoint directory in turn, and every array of the
one-file format, damaged where it matters (for the largest data file, in the array values
themselves), deleted or joined by a stray file. Each is refused by a message that names what
is wrong, whatever orbax would have made of the damage, so no test here leans on the warnings
that orbax leaves behind after a failed restore."""

import io
import os
import shutil
import tempfile
import zipfile

import jax
import numpy as np
import optax
import pytest
from _devices import cpu_store
from hypothesis import event, given, settings
from hypothesis import strategies as st

import jaxkv
from jaxkv import nd
from jaxkv._src.checkpoint import npz as _checkpoint
from jaxkv._src.checkpoint import orbax_dirs as _orbax

pytest.importorskip("orbax.checkpoint")

OPT = optax.sgd(0.1, momentum=0.9)
EXAMPLES = int(os.environ.get("HYPOTHESIS_MAX_EXAMPLES", 40))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None)


def saved_store():
    kv = cpu_store("device")
    kv.set_optimizer(OPT)
    # Noise that zstd cannot shrink below orbax's inline limit (1 KiB): "w"'s values get a
    # data file of their own, as a real model's weights do, not a place in orbax's index.
    noise = np.random.default_rng(0).standard_normal((64, 512), np.float32)
    kv.init(["b", "w"], [nd.array(np.arange(6.0).reshape(2, 3)), nd.array(noise)])
    kv.push(["b", "w"], [nd.ones((2, 3)) * 3, nd.ones((64, 512)) * 0.5])  # "w" is sharded
    return kv


def leaves(kv):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(kv.state)]


def assert_leaves_equal(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(g, w)


@pytest.fixture(scope="module")
def saved():
    """The saved store's leaves, and a checkpoint of it in each format."""
    kv = saved_store()
    root = tempfile.mkdtemp(prefix="jaxkv-damage-")
    kv.save(os.path.join(root, "s.npz"))
    state = kv.state
    directory = os.path.join(root, "dir")
    _checkpoint.save(directory, state, values=True, directory=True)
    yield leaves(kv), root
    shutil.rmtree(root)


def files(path):
    if os.path.isfile(path):
        return [path]
    return sorted(os.path.join(top, n) for top, _, names in os.walk(path) for n in names)


def data_files(directory):
    """The folder of the checkpoint ``directory`` that orbax wrote, and its files as load's
    messages name them (relative to it)."""
    (data,) = [name for name in os.listdir(directory) if name.startswith("data-")]
    state = os.path.join(directory, data, "state")
    return state, [os.path.relpath(f, state) for f in files(state)]


def damage_file(path, how, where, byte):
    """Flip (``byte`` the mask; 0 means bit 0), truncate at, or replace (by ``byte``) the byte
    of the file ``path`` at ``where``, a fraction of its size."""
    with open(path, "rb") as f:
        raw = bytearray(f.read())
    at = int(where * len(raw))
    if how == "flip" and raw:
        raw[at] ^= byte or 1
    elif how == "truncate":
        del raw[at:]
    elif raw:
        raw[at] = byte
    with open(path, "wb") as f:
        f.write(raw)


def load_fresh(path):
    """Load ``path`` into a fresh store with an optimizer and a key of its own: the refusal's
    message ('' where it loaded), the store then left exactly as it was; and its leaves."""
    kv = cpu_store("device")
    kv.set_optimizer(OPT)
    kv.init("other", nd.ones(4))
    before = leaves(kv)
    try:
        kv.load(path)
    except jaxkv.KVStoreError as e:
        assert_leaves_equal(leaves(kv), before)
        return str(e), before
    return "", leaves(kv)


damage = st.tuples(
    st.sampled_from(["flip", "truncate", "replace"]),
    st.floats(0, 1, exclude_max=True),  # where, as a fraction of the file's size
    st.integers(0, 255),  # the flip's mask (0 means bit 0) or the new byte
)


def damaged_copy(saved, name, data):
    """A copy of the checkpoint ``name``, one of its files damaged; what was done."""
    _, root = saved
    work = tempfile.mkdtemp(prefix="jaxkv-damaged-")
    source, copy = os.path.join(root, name), os.path.join(work, name)
    if os.path.isdir(source):
        shutil.copytree(source, copy)
    else:
        shutil.copyfile(source, copy)
    victim = data.draw(st.sampled_from(files(copy)), label="file")
    event(f"file {os.path.basename(victim)[:20]}")
    damage_file(victim, *data.draw(damage, label="damage"))
    return work, copy


def load_or_refuse(saved, copy):
    want, _ = saved
    why, got = load_fresh(copy)
    if why:
        event(f"refused: {why.split(': ', 1)[1][:40]}")
        return
    event("loaded")
    assert_leaves_equal(got, want)  # it loaded: only if nothing that is read changed


@pytest.mark.parametrize("name", ["s.npz", "dir"])
@SETTINGS
@given(data=st.data())
def test_a_damaged_checkpoint_is_refused_or_loads_exactly(saved, name, data):
    work, copy = damaged_copy(saved, name, data)
    try:
        load_or_refuse(saved, copy)
    finally:
        shutil.rmtree(work)


@pytest.mark.parametrize("name", ["s.npz", "dir/manifest.json"])
def test_an_empty_file_is_refused(saved, name, tmp_path):
    _, root = saved
    copy = tmp_path / "copy"
    shutil.copytree(os.path.join(root, "dir"), copy / "dir")
    shutil.copyfile(os.path.join(root, "s.npz"), copy / "s.npz")
    open(copy / name, "wb").close()
    kv = cpu_store("device")
    with pytest.raises(jaxkv.KVStoreError, match="cannot be read"):
        kv.load((copy / name).parent if name.endswith(".json") else copy / name)


@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
def test_each_damaged_data_file_is_refused_by_name(saved, tmp_path, how):
    """Every file orbax wrote (its metadata, its index and the array data), one at a time: a
    bit flipped in its middle, the file cut to half its size, or deleted. The refusal names
    that file, so a check of some of the files (the first, say) fails here."""
    _, root = saved
    _, names = data_files(os.path.join(root, "dir"))
    assert len(names) > 1
    for n, rel in enumerate(names):
        copy = tmp_path / str(n)
        shutil.copytree(os.path.join(root, "dir"), copy)
        state, _ = data_files(copy)
        victim = os.path.join(state, rel)
        size = os.path.getsize(victim)
        if how == "delete":
            os.unlink(victim)
        else:
            damage_file(victim, how, 0.5, 0)
        why, _ = load_fresh(copy)
        expected = {
            "flip": f"data file {rel}: checksum mismatch",
            "truncate": f"data file {rel}: expected {size} bytes, given {size // 2}",
            "delete": f"given 1 missing {[rel]} and 0 not listed []",
        }[how]
        assert expected in why


@pytest.mark.parametrize("rel", ["stray", "ocdbt.process_0/d/stray"])
def test_a_stray_data_file_is_refused_by_name(saved, tmp_path, rel):
    _, root = saved
    copy = tmp_path / "dir"
    shutil.copytree(os.path.join(root, "dir"), copy)
    state, _ = data_files(copy)
    os.makedirs(os.path.dirname(os.path.join(state, rel)), exist_ok=True)
    with open(os.path.join(state, rel), "wb") as f:
        f.write(b"\0" * 16)
    why, _ = load_fresh(copy)
    assert f"given 0 missing [] and 1 not listed {[rel]}" in why


def test_the_largest_data_file_flipped_in_its_middle_loads_wrong_values_unchecked(
    saved, tmp_path, monkeypatch
):
    """The damage above reaches the array values: with the data files' checksums unchecked,
    orbax loads the flipped bit as part of a value, without an error of its own."""
    want, root = saved
    copy = tmp_path / "dir"
    shutil.copytree(os.path.join(root, "dir"), copy)
    state, names = data_files(copy)
    largest = max(names, key=lambda rel: os.path.getsize(os.path.join(state, rel)))
    damage_file(os.path.join(state, largest), "flip", 0.5, 0)
    monkeypatch.setattr(_orbax, "_verify", lambda *args: None)
    why, got = load_fresh(copy)
    assert why == ""
    assert len(got) == len(want)
    assert sum(not np.array_equal(g, w) for g, w in zip(got, want)) == 1


# Each member of the one-file format, and how a store refuses it changed, and deleted.
MEMBERS = {
    "a0.npy": ("key 'b' value: checksum mismatch", "expected an array a0 for arrays[0]"),
    "a1.npy": ("key 'w' value: checksum mismatch", "expected an array a1 for arrays[1]"),
    "a2.npy": (
        "optimizer group 0 opt[0].trace['b']: checksum mismatch",
        "expected an array a2 for arrays[2]",
    ),
    "a3.npy": (
        "optimizer group 0 opt[0].trace['w']: checksum mismatch",
        "expected an array a3 for arrays[3]",
    ),
    "manifest.npy": ("manifest checksum mismatch", "'manifest is not a file in the archive'"),
    "manifest_sha256.npy": (
        "manifest checksum mismatch",
        "a checksummed manifest, given one without",
    ),
}


@pytest.mark.parametrize("how", ["change", "delete"])
@pytest.mark.parametrize("member", sorted(MEMBERS))
def test_each_changed_or_deleted_array_of_a_file_is_refused_by_name(saved, tmp_path, member, how):
    """One member of the ``.npz`` file: a bit flipped in the middle of its data (after the
    .npy header), the archive rewritten around it so that zip's own CRC-32 passes and only
    the manifest's SHA-256s can tell; or the member left out."""
    _, root = saved
    with zipfile.ZipFile(os.path.join(root, "s.npz")) as z:
        members = {name: z.read(name) for name in z.namelist()}
    assert sorted(members) == sorted(MEMBERS)
    raw = bytearray(members.pop(member))
    if how == "change":
        header = len(raw) - np.load(io.BytesIO(raw)).nbytes
        raw[(header + len(raw)) // 2] ^= 1
        members[member] = bytes(raw)
    copy = tmp_path / "s.npz"
    with zipfile.ZipFile(copy, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    why, _ = load_fresh(copy)
    changed, deleted = MEMBERS[member]
    assert (changed if how == "change" else deleted) in why
