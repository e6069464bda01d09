"""Damaged checkpoints, property-tested: bytes of a saved file (the one-file format) or of any
file of a checkpoint directory (orbax's files and the manifest) are flipped, truncated or
replaced. Loading must raise KVStoreError and leave the store as it was, or, where the damage
hits bytes that nothing reads (or replaces a byte with itself), load exactly the saved values.
Never a wrong value, never another exception."""

import os
import shutil
import tempfile

import jax
import numpy as np
import optax
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

import jaxkv
from jaxkv import _checkpoint, nd

pytest.importorskip("orbax.checkpoint")

OPT = optax.sgd(0.1, momentum=0.9)
EXAMPLES = int(os.environ.get("HYPOTHESIS_MAX_EXAMPLES", 40))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None)


def saved_store():
    kv = jaxkv.create("device")
    kv.set_optimizer(OPT)
    kv.init(["b", "w"], [nd.array(np.arange(6.0).reshape(2, 3)), nd.ones((64, 512))])
    kv.push(["b", "w"], [nd.ones((2, 3)) * 3, nd.ones((64, 512)) * 0.5])  # "w" is sharded
    return kv


def leaves(kv):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(kv.state)]


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
    how, where, byte = data.draw(damage, label="damage")
    with open(victim, "rb") as f:
        raw = bytearray(f.read())
    at = int(where * len(raw))
    if how == "flip" and raw:
        raw[at] ^= byte or 1
    elif how == "truncate":
        del raw[at:]
    elif raw:
        raw[at] = byte
    with open(victim, "wb") as f:
        f.write(raw)
    return work, copy


def load_or_refuse(saved, copy):
    want, _ = saved
    kv = jaxkv.create("device")
    kv.set_optimizer(OPT)
    kv.init("other", nd.ones(4))
    before = leaves(kv)
    try:
        kv.load(copy)
    except jaxkv.KVStoreError as e:
        event(f"refused: {str(e).split(': ', 1)[1][:40]}")
        got = leaves(kv)
        assert len(got) == len(before)
        for g, b in zip(got, before):
            np.testing.assert_array_equal(g, b)
        return
    event("loaded")
    got = leaves(kv)  # it loaded: only if nothing that is read changed
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(g, w)


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
    kv = jaxkv.create("device")
    with pytest.raises(jaxkv.KVStoreError, match="cannot be read"):
        kv.load((copy / name).parent if name.endswith(".json") else copy / name)
