"""jaxkv/_src/checkpoint/manager.py (one process): what a store is (without reading its state),
the steps accepted, the handler that writes a step's checkpoint directory on its own (digests
left by the other processes, the manifest committed), a failed background save reported with
its step and never listed, and stores other than jaxkv's own saved and loaded through
``state`` and ``load``. Also the pieces of orbax_dirs.py that the handler shares with a
checkpoint directory's save: the data directory's name, the manifest's arrays, the digests
each process takes and their records."""

import asyncio
import hashlib
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxkv
from jaxkv._src.checkpoint import manager, npz, orbax_dirs

pytest.importorskip("orbax.checkpoint")

SGD = optax.sgd(0.1, momentum=0.9)


def _state(shift=0.0, devices=None):
    values = {"['w']": jnp.arange(3.0) + shift, "['s']": jnp.float32(shift), "['e']": jnp.zeros(0)}
    return jaxkv.init_optimizer(jaxkv.init(jaxkv.empty(devices), values), SGD)


def _same(got, want):
    a, b = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    assert got.keys() == want.keys() and len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


class _Store:
    """A store as the manager sees one: a ``state`` property and ``load``; its state may be
    read only when asked for."""

    def __init__(self, state=None):
        self._state, self.loaded = state, []

    @property
    def state(self):
        if self._state is None:
            raise AssertionError("the state was read")
        return self._state

    def load(self, fname):
        self.loaded.append(fname)


def test_a_store_is_known_by_its_state_property_and_load_without_reading_its_state(devices):
    assert manager._is_store(_Store())  # its state would raise if read
    assert manager._is_store(jaxkv.KVStore("local", devices=devices[:2]))
    assert not manager._is_store(_state())
    assert not manager._is_store({"state": 1, "load": print})

    class Attribute:  # a state that is no property
        state = None

        def load(self, fname): ...

    assert not manager._is_store(Attribute())


@pytest.mark.parametrize("step", [0, 7, np.int64(9), 16**16 - 1])
def test_a_step_is_an_int_from_0_to_16_hex_digits(step):
    got = manager.CheckpointManager._step(None, step)
    assert (got, type(got)) == (int(step), int)
    assert orbax_dirs.data_name(got) == f"data-{int(step):016x}"
    assert len(orbax_dirs.data_name(got)) == len("data-") + 16


@pytest.mark.parametrize(
    ("step", "match"),
    [(True, "an int, given bool"), (1.0, "an int, given float"), ("3", "an int, given str")]
    + [(-1, "from 0 to 16\\*\\*16 - 1, given -1"), (16**16, "given 18446744073709551616")],
)
def test_other_steps_are_refused(step, match):
    with pytest.raises(jaxkv.KVStoreError, match=match):
        manager.CheckpointManager._step(None, step)


@pytest.mark.parametrize("keep", [0, -2, True, 1.5, "2"])
def test_max_to_keep_is_a_positive_int_or_none(tmp_path, keep):
    with pytest.raises(jaxkv.KVStoreError, match="max_to_keep: expected None or a positive"):
        jaxkv.CheckpointManager(tmp_path, max_to_keep=keep)
    assert os.listdir(tmp_path) == []


def test_without_orbax_the_manager_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "orbax.checkpoint", None)  # import fails
    with pytest.raises(jaxkv.KVStoreError, match=r"pip install 'jaxkv\[dist\]'"):
        jaxkv.CheckpointManager(tmp_path / "steps")
    assert not (tmp_path / "steps").exists()


def test_the_directory_is_absolute_and_a_step_path_is_its_kv_item(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with jaxkv.CheckpointManager("steps") as ckpt:
        assert ckpt.directory == os.path.join(str(tmp_path), "steps")
        assert ckpt.path(12) == os.path.join(str(tmp_path), "steps", "12", manager.ITEM)


def test_describe_lists_every_array_and_gives_orbax_the_non_empty_ones():
    state = _state(1.0)
    header, entries = npz.directory_contents("ckpt", state)
    tree = orbax_dirs.describe(header, entries, "data-" + "0" * 16)
    assert (header["format"], header["data"], header["processes"]) == (
        "jaxkv-checkpoint",
        "data-" + "0" * 16,
        1,
    )
    parts = [(e.get("key"), e["part"], e["shape"]) for e in header["arrays"]]
    assert parts[:3] == [("['e']", "value", [0]), ("['s']", "value", []), ("['w']", "value", [3])]
    assert [p for _, p, _ in parts[3:]] == ["opt"] * (len(parts) - 3)
    assert sorted(tree) == sorted(f"a{n}" for n, (_, _, s) in enumerate(parts) if s != [0])


def test_each_process_hashes_its_own_files_and_process_0_the_shared_ones(tmp_path, monkeypatch):
    for rel in ["ocdbt.process_0/d/x", "ocdbt.process_1/d/y", "_METADATA", "d/z"]:
        os.makedirs(os.path.dirname(tmp_path / rel), exist_ok=True)
        (tmp_path / rel).write_bytes(rel.encode())

    def digest(rel):
        return (len(rel), hashlib.sha256(rel.encode()).hexdigest())

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    zero = orbax_dirs.digests(str(tmp_path))
    assert zero == {r: digest(r) for r in ["_METADATA", "d/z", "ocdbt.process_0/d/x"]}
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    one = orbax_dirs.digests(str(tmp_path))
    assert one == {"ocdbt.process_1/d/y": digest("ocdbt.process_1/d/y")}
    assert orbax_dirs.digests(str(tmp_path / "none")) == {}
    records = orbax_dirs.file_records([zero, json.loads(json.dumps(one))])
    assert records["ocdbt.process_1/d/y"] == {
        "process": 1,
        "size": len("ocdbt.process_1/d/y"),
        "sha256": digest("ocdbt.process_1/d/y")[1],
    }
    assert {r["process"] for r in records.values()} == {0, 1} and len(records) == 4


def test_the_digests_other_processes_leave_are_read_in_process_order(tmp_path, monkeypatch):
    root = tmp_path / "data" / "state"
    (root / "ocdbt.process_1").mkdir(parents=True)
    (root / "ocdbt.process_1" / "f").write_bytes(b"abc")
    manager._leave_digests(str(tmp_path), str(root))  # process 0 hashes in finalize
    assert not (tmp_path / manager.DIGESTS).exists()
    monkeypatch.setattr(jax, "process_count", lambda: 3)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    manager._leave_digests(str(tmp_path), str(root))
    assert os.listdir(tmp_path / manager.DIGESTS) == ["process_1.json"]
    with pytest.raises(jaxkv.KVStoreError, match="the digests of the files process 2 wrote"):
        manager._digests_left(str(tmp_path))
    (tmp_path / manager.DIGESTS / "process_2.json").write_text("{}")
    got = manager._digests_left(str(tmp_path))
    assert got == [{"ocdbt.process_1/f": [3, hashlib.sha256(b"abc").hexdigest()]}, {}]


@pytest.mark.parametrize("asynchronous", [True, False])
def test_the_handler_alone_writes_a_checkpoint_directory_that_loads(tmp_path, asynchronous):
    handler_type, save_type = manager._orbax_types()
    handler = handler_type()
    state = _state(2.0)
    header, entries = npz.directory_contents(str(tmp_path), state)
    args = save_type(header, orbax_dirs.describe(header, entries, orbax_dirs.data_name(3)))
    (tmp_path / manager.DIGESTS).mkdir()  # left by an earlier attempt: removed at the commit
    if asynchronous:
        for f in asyncio.run(handler.async_save(tmp_path, args)):
            f.result()
    else:
        handler.save(tmp_path, args)
    assert not (tmp_path / orbax_dirs.MANIFEST).exists()  # not yet committed
    handler.finalize(tmp_path)
    assert sorted(os.listdir(tmp_path)) == sorted([orbax_dirs.MANIFEST, orbax_dirs.data_name(3)])
    _same(npz.load(str(tmp_path), jaxkv.empty(), values=True, optimizer=SGD), state)
    with pytest.raises(jaxkv.KVStoreError, match="restored by jaxkv.CheckpointManager.restore"):
        handler.restore(tmp_path)
    handler.close()


def test_a_failed_background_save_names_its_step_and_is_never_listed(tmp_path, monkeypatch):
    def failing(root):
        raise OSError("disk full")

    with jaxkv.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, _state(1.0))
        ckpt.wait_until_finished()
        monkeypatch.setattr(orbax_dirs, "digests", failing)
        ckpt.save(2, _state(2.0))
        with pytest.raises(jaxkv.KVStoreError, match=r"save of step 2 failed \(OSError: disk full"):
            ckpt.wait_until_finished()
        ckpt.wait_until_finished()  # reported once
        assert ckpt.all_steps() == [1]
        monkeypatch.undo()
        ckpt.save(2, _state(3.0))  # the step again
        _same(ckpt.restore(optimizer=SGD), _state(3.0))
    assert sorted(os.listdir(tmp_path)) == ["1", "2"]


def test_any_store_with_state_and_load_is_saved_and_restored(tmp_path):
    state = _state(4.0)
    with jaxkv.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(3, _Store(state))
        other = _Store()
        assert ckpt.restore(into=other) is None
        assert other.loaded == [ckpt.path(3)]
        _same(ckpt.restore(3, state, optimizer=SGD), state)
