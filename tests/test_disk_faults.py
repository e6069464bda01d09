"""Disk faults while saving and loading: a read-only directory, a full disk, a file too large,
permission denied, a missing file. Each is a KVStoreError that names the target the user gave
(never a temporary name) and the OS's reason in words, raised from the OSError; the checkpoint
saved there before stays intact and loads as it was, and no temporary file or directory is
left behind. A CheckpointManager removes interrupted steps' temporary directories when it
opens its directory.

The faults are made portably. A read-only directory: ``chmod``, where that stops writes (not
as root), and always the OS calls that create files and directories under it failing with
EROFS or EACCES. A file too large: the process's file size limit (RLIMIT_FSIZE), a real EFBIG.
A full disk: ``fsync`` failing with ENOSPC, and a real one only given a small file system
(``JAXKV_TEST_FULL_FS``, the path of a directory on one; a mount is not made here).
"""

import builtins
import contextlib
import errno
import os
import shutil
import signal
import subprocess
from collections.abc import Callable
from typing import NamedTuple

import jax
import numpy as np
import optax
import pytest

import jaxkv
from jaxkv import mx
from jaxkv._src.checkpoint import npz

OPT = optax.sgd(0.1, momentum=0.9)
# What a reason reads as: the OS's words, whatever the platform's capitals.
REASONS = {
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.ENOSPC: "no space left on device",
    errno.EFBIG: "file too large",
    errno.ENOENT: "no such file or directory",
    errno.EISDIR: "is a directory",
}


def store(devices, value, size=4):
    """A store with an SGD momentum group, pushed once: its value and momentum depend on
    ``value``."""
    kv = jaxkv.KVStore("device", devices=devices[:2])
    kv.set_optimizer(OPT)
    kv.init("w", jaxkv.nd.array(np.zeros(size, np.float32)))
    kv.push("w", jaxkv.nd.array(np.full(size, value, np.float32)))
    return kv


def leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


class Saving(NamedTuple):
    """One public way to save, and to load back what it saved."""

    save: Callable  # (kv, path)
    load: Callable  # (devices, path, size) -> the loaded leaves, into a store of that size
    saved: Callable  # (kv) -> the leaves a load of its save gives back


def _store_loaded(devices, path, size=4):
    kv = store(devices, 0.0, size)
    kv.load(path)
    return leaves(kv.state)


def _states_loaded(devices, path, size=4):
    kv = store(devices, 0.0, size)
    kv.load_optimizer_states(path)
    return leaves(kv.state.opt_states)


SAVINGS = {
    "jaxkv.save_state": Saving(
        lambda kv, path: jaxkv.save_state(path, kv.state),
        lambda devices, path, size=4: leaves(
            jaxkv.load_state(path, jaxkv.empty(devices[:2]), optimizer=OPT)
        ),
        lambda kv: leaves(kv.state),
    ),
    "KVStore.save": Saving(
        lambda kv, path: kv.save(path), _store_loaded, lambda kv: leaves(kv.state)
    ),
    "KVStore.save_optimizer_states": Saving(
        lambda kv, path: kv.save_optimizer_states(path),
        _states_loaded,
        lambda kv: leaves(kv.state.opt_states),
    ),
}


def snapshot(directory):
    """Every path under ``directory`` (relative), and each file's bytes."""
    out = {}
    for top, dirs, files in os.walk(directory):
        for name in dirs + files:
            full = os.path.join(top, name)
            rel = os.path.relpath(full, directory)
            if os.path.isdir(full):
                out[rel] = None
            else:
                with open(full, "rb") as f:
                    out[rel] = f.read()
    return out


def assert_fault(error, target, code):
    """``error`` is a KVStoreError naming ``target`` and ``code``'s reason, raised from the
    OSError, and naming no temporary file or directory."""
    message = str(error.value)
    assert type(error.value) is jaxkv.DiskError, type(error.value)
    assert isinstance(error.value, jaxkv.KVStoreError) and isinstance(error.value, OSError)
    assert os.fspath(target) in message, message
    assert REASONS[code] in message.lower(), message
    assert ".jaxkv-" not in message and "orbax-checkpoint-tmp" not in message, message
    cause = error.value.__cause__
    assert isinstance(cause, OSError) and cause.errno == code, repr(cause)


def _under(path, directory):
    path = os.path.abspath(os.fspath(path))
    return path == directory or path.startswith(directory + os.sep)


def _refused(code, path):
    return OSError(code, os.strerror(code), os.fspath(path))


def refuse_writes(monkeypatch, directory, code):
    """Make the OS calls that create, write, rename or remove files and directories under
    ``directory`` fail with ``code``, as a read-only directory does (reads still work)."""
    directory = os.path.abspath(directory)
    real_open, real_mkdir, real_builtin_open = os.open, os.mkdir, builtins.open
    real_replace, real_rename, real_unlink = os.replace, os.rename, os.unlink
    writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def os_open(path, flags, *args, **kwargs):
        if flags & writing and _under(path, directory):
            raise _refused(code, path)
        return real_open(path, flags, *args, **kwargs)

    def mkdir(path, *args, **kwargs):
        if _under(path, directory):
            raise _refused(code, path)
        return real_mkdir(path, *args, **kwargs)

    def builtin_open(file, mode="r", *args, **kwargs):
        writes = set(mode) & set("wax+")
        if writes and isinstance(file, (str, os.PathLike)) and _under(file, directory):
            raise _refused(code, file)
        return real_builtin_open(file, mode, *args, **kwargs)

    def moved(real):
        def move(src, dst, *args, **kwargs):
            if _under(src, directory) or _under(dst, directory):
                raise _refused(code, src)
            return real(src, dst, *args, **kwargs)

        return move

    def unlink(path, *args, **kwargs):
        if _under(path, directory):
            raise _refused(code, path)
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(builtins, "open", builtin_open)
    monkeypatch.setattr(os, "replace", moved(real_replace))
    monkeypatch.setattr(os, "rename", moved(real_rename))
    monkeypatch.setattr(os, "unlink", unlink)
    monkeypatch.setattr(os, "remove", unlink)


def refuse_reads(monkeypatch, directory, code, after=0):
    """Make opening a file under ``directory`` for reading fail with ``code``, after ``after``
    opens that succeed."""
    directory = os.path.abspath(directory)
    real = builtins.open
    opened = [0]

    def builtin_open(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and _under(file, directory):
            opened[0] += 1
            if opened[0] > after:
                raise _refused(code, file)
        return real(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", builtin_open)


@contextlib.contextmanager
def read_only(monkeypatch, directory, how, code):
    """``directory`` read-only for the block: by ``chmod`` (skipped where it stops no write, as
    for root) or by refusing the OS calls that write under it with ``code``."""
    if how == "chmod":
        mode = os.stat(directory).st_mode
        os.chmod(directory, 0o555)
        try:
            probe = os.path.join(directory, "probe")
            try:
                with open(probe, "w"):
                    pass
            except PermissionError:
                pass
            else:
                os.unlink(probe)
                pytest.skip(
                    "chmod stops no write here (root: `setpriv --bounding-set -dac_override "
                    "...` runs it); the refused-calls variant runs"
                )
            yield
        finally:
            os.chmod(directory, mode)
        return
    with monkeypatch.context() as m:
        refuse_writes(m, directory, code)
        yield


READ_ONLY = [("chmod", errno.EACCES), ("refused", errno.EROFS), ("refused", errno.EACCES)]


@contextlib.contextmanager
def fsync_fails(monkeypatch, code=errno.ENOSPC):
    """Every ``fsync`` fails with ``code``, as one on a full disk can."""

    def fsync(fd):
        raise OSError(code, os.strerror(code))

    with monkeypatch.context() as m:
        m.setattr(os, "fsync", fsync)
        yield


@contextlib.contextmanager
def file_size_limit(limit):
    """The process may write no file beyond ``limit`` bytes: a write past it is EFBIG."""
    resource = pytest.importorskip("resource")
    if not hasattr(signal, "SIGXFSZ"):
        pytest.skip("no SIGXFSZ on this platform")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the signal ends the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


# -- one file: jaxkv.save_state, KVStore.save, KVStore.save_optimizer_states ------------------


@pytest.mark.parametrize("how, code", READ_ONLY)
@pytest.mark.parametrize("saving", list(SAVINGS))
def test_a_read_only_directory(tmp_path, devices, monkeypatch, saving, how, code):
    s = SAVINGS[saving]
    target = tmp_path / "kv.file"
    old = store(devices, 1.0)
    s.save(old, str(target))
    before = snapshot(tmp_path)
    with read_only(monkeypatch, tmp_path, how, code), pytest.raises(jaxkv.KVStoreError) as error:
        s.save(store(devices, 2.0), str(target))
    assert_fault(error, target, code)
    assert snapshot(tmp_path) == before
    for got, want in zip(s.load(devices, str(target)), s.saved(old), strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("saving", list(SAVINGS))
def test_a_full_disk(tmp_path, devices, monkeypatch, saving):
    s = SAVINGS[saving]
    target = tmp_path / "kv.file"
    old = store(devices, 1.0)
    s.save(old, str(target))
    before = snapshot(tmp_path)
    with fsync_fails(monkeypatch), pytest.raises(jaxkv.KVStoreError) as error:
        s.save(store(devices, 2.0), str(target))
    assert_fault(error, target, errno.ENOSPC)
    assert snapshot(tmp_path) == before
    for got, want in zip(s.load(devices, str(target)), s.saved(old), strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.fixture
def small_file_system(tmp_path):
    """A directory on a file system of 2 MB: JAXKV_TEST_FULL_FS where set, else a tmpfs this
    test mounts (as root, where mounting is allowed)."""
    where = os.environ.get("JAXKV_TEST_FULL_FS")
    if where:
        yield where
        return
    where = str(tmp_path / "small")
    os.mkdir(where)
    mounted = os.geteuid() == 0 and shutil.which("mount") is not None
    if mounted:
        run = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", where], capture_output=True
        )
        mounted = run.returncode == 0
    if not mounted:
        pytest.skip(
            "needs a small file system: mounting a tmpfs is not allowed here (set "
            "JAXKV_TEST_FULL_FS to a directory on one); test_a_full_disk makes fsync fail instead"
        )
    try:
        yield where
    finally:
        subprocess.run(["umount", where], capture_output=True)


def test_a_full_small_file_system(devices, small_file_system):
    """A real full disk: a store bigger than what is left on a small file system."""
    where = small_file_system
    target = os.path.join(where, "kv.npz")
    old = store(devices, 1.0)
    old.save(target)
    free = os.statvfs(where).f_bavail * os.statvfs(where).f_frsize
    with pytest.raises(jaxkv.KVStoreError) as error:
        store(devices, 2.0, size=free // 4 + 1024).save(target)
    assert_fault(error, target, errno.ENOSPC)
    assert sorted(os.listdir(where)) == ["kv.npz"]
    for got, want in zip(_store_loaded(devices, target), leaves(old.state), strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("saving", list(SAVINGS))
def test_a_file_too_large(tmp_path, devices, saving):
    s = SAVINGS[saving]
    target = tmp_path / "kv.file"
    old = store(devices, 1.0, size=1 << 16)
    s.save(old, str(target))
    before = snapshot(tmp_path)
    new = store(devices, 2.0, size=1 << 16)
    with file_size_limit(1 << 14), pytest.raises(jaxkv.KVStoreError) as error:
        s.save(new, str(target))
    assert_fault(error, target, errno.EFBIG)
    assert snapshot(tmp_path) == before
    for got, want in zip(s.load(devices, str(target), 1 << 16), s.saved(old), strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_directory_in_place_of_the_file(tmp_path, devices):
    target = tmp_path / "kv.npz"
    target.mkdir()
    with pytest.raises(jaxkv.KVStoreError) as error:
        store(devices, 1.0).save(str(target))
    assert_fault(error, target, errno.EISDIR)
    assert snapshot(tmp_path) == {"kv.npz": None}


@pytest.mark.parametrize("points_to", ["a missing file", "a file"])
def test_a_symlink_is_written_through_as_numpy_save_does(tmp_path, devices, points_to):
    """``kv.save(link)`` writes the file the link names, as ``numpy.save`` does (a dangling
    link's file is made), and the link stays a link."""
    target, link = tmp_path / "real.npz", tmp_path / "link.npz"
    if points_to == "a file":
        store(devices, 1.0).save(str(target))
    link.symlink_to(target)
    new = store(devices, 2.0)
    new.save(str(link))
    assert link.is_symlink() and target.is_file()
    assert sorted(os.listdir(tmp_path)) == ["link.npz", "real.npz"]
    for got, want in zip(_store_loaded(devices, str(target)), leaves(new.state), strict=True):
        np.testing.assert_array_equal(got, want)


# -- loading a file ------------------------------------------------------------------------------

LOADS = {
    "jaxkv.load_state": lambda devices, path: jaxkv.load_state(
        path, jaxkv.empty(devices[:2]), optimizer=OPT
    ),
    "KVStore.load": _store_loaded,
    "KVStore.load_optimizer_states": _states_loaded,
}


@pytest.mark.parametrize("loading", list(LOADS))
def test_a_missing_file(tmp_path, devices, loading):
    target = tmp_path / "missing" / "kv.npz"
    with pytest.raises(jaxkv.KVStoreError) as error:
        LOADS[loading](devices, str(target))
    assert_fault(error, target, errno.ENOENT)


@pytest.mark.parametrize("loading", list(LOADS))
def test_permission_denied_reading_a_file(tmp_path, devices, monkeypatch, loading):
    target = tmp_path / "kv.npz"
    kv = store(devices, 1.0)
    (kv.save_optimizer_states if loading.endswith("states") else kv.save)(str(target))
    with monkeypatch.context() as m, pytest.raises(jaxkv.KVStoreError) as error:
        refuse_reads(m, tmp_path, errno.EACCES)
        LOADS[loading](devices, str(target))
    assert_fault(error, target, errno.EACCES)


def test_permission_denied_reading_mxnets_states_file(tmp_path, devices, monkeypatch):
    """An MXNet optimizer-state file (a pickle) that can be opened to see what it is, and not
    read: the store keeps its states."""
    target = tmp_path / "mxnet.states"
    target.write_bytes(b"\x80\x04}\x94.")  # pickle.dumps({}, protocol=4)
    kv = jaxkv.KVStore("device", devices=devices[:2])
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9))
    kv.init("w", jaxkv.nd.ones((4,)))
    kv.push("w", jaxkv.nd.ones((4,)))
    before = leaves(kv.state)
    with monkeypatch.context() as m, pytest.raises(jaxkv.KVStoreError) as error:
        refuse_reads(m, tmp_path, errno.EACCES, after=1)
        kv.load_optimizer_states(str(target))
    assert_fault(error, target, errno.EACCES)
    for got, want in zip(leaves(kv.state), before, strict=True):
        np.testing.assert_array_equal(got, want)


# -- a checkpoint directory ----------------------------------------------------------------------


@pytest.fixture
def checkpoint_dir(tmp_path, devices):
    """A checkpoint directory (the format of a multi-process job) of a store, and the store."""
    pytest.importorskip("orbax.checkpoint")
    path = tmp_path / "ckpt"
    old = store(devices, 1.0)
    npz.save(str(path), old.state, values=True, directory=True)
    return path, old


def a_fault(monkeypatch, path, fault):
    """The errno of ``fault`` ("read-only" or "full") and a context that makes it under
    ``path``."""
    if fault == "read-only":
        return errno.EROFS, read_only(monkeypatch, path, "refused", errno.EROFS)
    return errno.ENOSPC, fsync_fails(monkeypatch)


@pytest.mark.parametrize("fault", ["read-only", "full"])
def test_a_checkpoint_directory_keeps_its_checkpoint(checkpoint_dir, devices, monkeypatch, fault):
    path, old = checkpoint_dir
    before = snapshot(path)
    code, made = a_fault(monkeypatch, path, fault)
    with made, pytest.raises(jaxkv.KVStoreError) as error:
        store(devices, 2.0).save(str(path))
    assert_fault(error, path, code)
    assert snapshot(path) == before
    for got, want in zip(_store_loaded(devices, str(path)), leaves(old.state), strict=True):
        np.testing.assert_array_equal(got, want)


def test_permission_denied_reading_a_checkpoint_directory(checkpoint_dir, devices, monkeypatch):
    path, _ = checkpoint_dir
    with monkeypatch.context() as m, pytest.raises(jaxkv.KVStoreError) as error:
        refuse_reads(m, path, errno.EACCES)
        _store_loaded(devices, str(path))
    assert_fault(error, path, errno.EACCES)


# -- CheckpointManager ---------------------------------------------------------------------------


@pytest.fixture
def manager_dir(tmp_path, devices):
    """A CheckpointManager's directory holding step 1 of a store, and the store."""
    pytest.importorskip("orbax.checkpoint")
    path = tmp_path / "steps"
    old = store(devices, 1.0)
    with jaxkv.CheckpointManager(path) as ckpt:
        ckpt.save(1, old)
    return path, old


def assert_step_one(path, old, devices):
    with jaxkv.CheckpointManager(path) as ckpt:
        assert ckpt.all_steps() == [1]
        restored = ckpt.restore(into=jaxkv.empty(devices[:2]), optimizer=OPT)
    for got, want in zip(leaves(restored), leaves(old.state), strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("fault", ["read-only", "full"])
def test_a_checkpoint_manager_keeps_its_steps(manager_dir, devices, monkeypatch, fault):
    path, old = manager_dir
    before = snapshot(path)
    code, made = a_fault(monkeypatch, path, fault)
    with jaxkv.CheckpointManager(path) as ckpt:
        with made, pytest.raises(jaxkv.KVStoreError) as error:
            ckpt.save(2, store(devices, 2.0))
            ckpt.wait_until_finished()
        assert_fault(error, path, code)
        assert snapshot(path) == before
        assert ckpt.all_steps() == [1]
    assert_step_one(path, old, devices)
    with jaxkv.CheckpointManager(path) as ckpt:  # the failed step saves once the disk is mended
        ckpt.save(2, store(devices, 2.0))
        ckpt.wait_until_finished()
        assert ckpt.all_steps() == [1, 2]


def test_permission_denied_restoring_a_step(manager_dir, devices, monkeypatch):
    path, _ = manager_dir
    with (
        jaxkv.CheckpointManager(path) as ckpt,
        monkeypatch.context() as m,
        pytest.raises(jaxkv.KVStoreError) as error,
    ):
        refuse_reads(m, path, errno.EACCES)
        ckpt.restore(optimizer=OPT)
    assert_fault(error, path, errno.EACCES)


def test_a_checkpoint_manager_removes_interrupted_steps_when_it_opens(manager_dir, devices):
    path, old = manager_dir
    (path / "3.orbax-checkpoint-tmp-123" / "kv").mkdir(parents=True)
    (path / "3.orbax-checkpoint-tmp-123" / "kv" / "manifest.json").write_text("{}")
    (path / "4.orbax-checkpoint-tmp").mkdir()
    (path / ".jaxkv-abc.tmp").write_bytes(b"partial")
    (path / "notes.txt").write_text("not the manager's")
    with jaxkv.CheckpointManager(path) as ckpt:
        assert sorted(os.listdir(path)) == ["1", "notes.txt"]
        assert ckpt.all_steps() == [1]
    assert_step_one(path, old, devices)
