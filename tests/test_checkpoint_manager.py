"""jaxkv.CheckpointManager: numbered steps in one directory, saved in the background through
orbax-checkpoint, the newest ``max_to_keep`` kept, any step restored (the latest by default),
into a functional KVState or an imperative KVStore; keys that are pytree paths (brackets,
quotes) come back as they were; a damaged step is refused, as ``load_state`` refuses one; a
process killed (SIGKILL) part way through a save leaves the previous steps, and a restart
resumes from the latest complete one.

A job of 2 processes x 2 devices (gloo) does the same across processes: this file is also the
job's script (``python -m jaxkv.launch -n 2 ... tests/test_checkpoint_manager.py MODE DIR``).
"""

import json
import os
import signal
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxkv
from jaxkv._src.checkpoint import orbax_dirs

pytest.importorskip("orbax.checkpoint")

OPT = optax.sgd(0.1, momentum=0.9)
# Keys as pytree paths would name them: brackets, quotes, a slash, a dot-dot, non-ASCII.
KEYS = {
    "['params']['Dense_0']['kernel']": (64, 512),  # sharded over the devices
    "['params']['Dense_0']['bias']": (3,),
    '["a\\"b"]/../c': (2, 2),
    "['ключ'][0]": (),
    "['empty']": (0,),
}


def state_at(step, devices=None):
    """A state with an SGD momentum group, pushed once: every leaf depends on ``step``."""
    values = {k: jnp.full(shape, step, jnp.float32) for k, shape in KEYS.items()}
    state = jaxkv.init(jaxkv.empty(devices), values)
    state = jaxkv.init_optimizer(state, OPT)
    grads = {k: jnp.full(shape, 0.5 * step + 1, jnp.float32) for k, shape in KEYS.items()}
    return jaxkv.push(state, grads, updater=OPT)


def leaves(state):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(state)]


def assert_same(got, want):
    assert got.keys() == want.keys()
    a, b = leaves(got), leaves(want)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x.dtype, x.shape) == (y.dtype, y.shape)
        np.testing.assert_array_equal(x, y)


def store(devices):
    kv = jaxkv.KVStore("device", devices=devices[:4])
    kv.set_optimizer(OPT)
    kv.init(list(KEYS), [jaxkv.nd.array(np.full(s, 1.0, np.float32)) for s in KEYS.values()])
    return kv


def train(kv, step):
    kv.push(list(KEYS), [jaxkv.nd.array(np.full(s, step, np.float32)) for s in KEYS.values()])


def test_steps_are_listed_and_the_latest_or_any_one_restored(tmp_path, devices):
    states = {step: state_at(step, devices[:2]) for step in (1, 2, 5)}
    with jaxkv.CheckpointManager(tmp_path / "ckpt") as ckpt:
        assert (ckpt.all_steps(), ckpt.latest_step()) == ([], None)
        for step, state in states.items():
            ckpt.save(step, state)
        ckpt.wait_until_finished()
        assert (ckpt.all_steps(), ckpt.latest_step()) == ([1, 2, 5], 5)
        assert sorted(os.listdir(tmp_path / "ckpt")) == ["1", "2", "5"]
        latest = ckpt.restore(into=jaxkv.empty(devices[2:6]), optimizer=OPT)
        assert_same(latest, states[5])
        assert latest["['params']['Dense_0']['bias']"].sharding.device_set == set(devices[2:6])
        assert_same(ckpt.restore(2, optimizer=OPT), states[2])
        # Each step is a checkpoint directory that load_state reads too.
        assert_same(jaxkv.load_state(ckpt.path(1), jaxkv.empty(), optimizer=OPT), states[1])
    # A restart: a new manager finds the steps on disk and restores the latest.
    with jaxkv.CheckpointManager(tmp_path / "ckpt") as again:
        assert (again.all_steps(), again.latest_step()) == ([1, 2, 5], 5)
        assert_same(again.restore(optimizer=OPT), states[5])


def test_a_step_whose_deletion_was_cut_short_is_removed_when_a_manager_opens(tmp_path):
    """orbax deletes an old step (max_to_keep) in place: a kill there leaves the step's
    directory without its manifest. A new manager removes it, as it removes cut-short saves."""
    states = {step: state_at(step) for step in (1, 2)}
    with jaxkv.CheckpointManager(tmp_path / "ckpt") as ckpt:
        for step, state in states.items():
            ckpt.save(step, state)
        ckpt.wait_until_finished()
    os.remove(tmp_path / "ckpt" / "1" / "kv" / orbax_dirs.MANIFEST)  # half deleted
    with jaxkv.CheckpointManager(tmp_path / "ckpt") as again:
        assert (again.all_steps(), again.latest_step()) == ([2], 2)
        assert sorted(os.listdir(tmp_path / "ckpt")) == ["2"]
        assert_same(again.restore(optimizer=OPT), states[2])


def test_a_restore_logs_no_warning(tmp_path, devices, caplog):
    """A step that restores correctly logs nothing alarming: orbax's warning that the step's
    arrays have no _CHECKPOINT_METADATA (jaxkv's manifest is their metadata) is not logged."""
    import logging

    state = state_at(1, devices[:2])
    with jaxkv.CheckpointManager(tmp_path / "ckpt") as ckpt:
        ckpt.save(1, state)
        ckpt.wait_until_finished()
        with caplog.at_level(logging.WARNING):
            assert_same(ckpt.restore(optimizer=OPT), state)
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == [], caplog.text


def test_max_to_keep_keeps_the_newest_steps(tmp_path):
    with jaxkv.CheckpointManager(tmp_path, max_to_keep=2) as ckpt:
        for step in range(1, 5):
            ckpt.save(step, state_at(step))
        ckpt.wait_until_finished()
        assert ckpt.all_steps() == [3, 4]
    assert sorted(os.listdir(tmp_path)) == ["3", "4"]
    with jaxkv.CheckpointManager(tmp_path, max_to_keep=2) as again:
        assert again.all_steps() == [3, 4]
        assert_same(again.restore(3, optimizer=OPT), state_at(3))


def test_a_save_returns_before_the_step_is_written_and_wait_until_finished_completes_it(
    tmp_path, devices, monkeypatch
):
    """The store trains on while its step is written: the step holds the values it had when
    ``save`` returned, and is listed on disk only once written."""
    release, hashing = threading.Event(), threading.Event()
    digests = orbax_dirs.digests

    def held(root):  # process 0 hashes its files in orbax's background thread
        hashing.set()
        assert release.wait(60), "save waited for its own background thread"
        return digests(root)

    monkeypatch.setattr(orbax_dirs, "digests", held)
    kv = store(devices)
    train(kv, 2)
    want = kv.state
    with jaxkv.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(7, kv)
        assert hashing.wait(60)  # the save is under way in the background, and returned
        train(kv, 3)  # the store trains on meanwhile
        assert ckpt.latest_step() == 7  # in progress
        assert not os.path.exists(ckpt.path(7))
        assert "7" not in os.listdir(tmp_path)
        release.set()
        ckpt.wait_until_finished()
        assert os.path.isdir(ckpt.path(7))
        assert os.listdir(tmp_path) == ["7"]
        ckpt.restore(into=kv)
    assert_same(kv.state, want)


def test_a_state_deleted_as_soon_as_save_returns_is_saved_as_it_was(tmp_path, devices):
    """The arrays are on the host when ``save`` returns: their buffers may be donated or
    deleted at once, while the step is still being written."""
    state = state_at(2, devices[:4])
    want = leaves(state)
    with jaxkv.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, state)
        for x in jax.tree_util.tree_leaves(state):
            x.delete()
        got = leaves(ckpt.restore(into=jaxkv.empty(devices[:4]), optimizer=OPT))
    for x, y in zip(got, want, strict=True):
        np.testing.assert_array_equal(x, y)


def test_a_kvstore_restores_in_place_with_its_own_optimizer(tmp_path, devices):
    kv = store(devices)
    train(kv, 1)
    with jaxkv.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, kv)
        want = kv.state
        train(kv, 2)
        ckpt.save(2, kv)
        ckpt.restore(1, kv)
        assert_same(kv.state, want)
        assert kv.keys() == sorted(KEYS)
        with pytest.raises(jaxkv.KVStoreError, match="its own optimizer"):
            ckpt.restore(1, kv, optimizer=OPT)
        other = jaxkv.KVStore("device", devices=devices[4:8])  # no optimizer: refused
        with pytest.raises(jaxkv.KVStoreError, match="set_optimizer"):
            ckpt.restore(into=other)
        assert other.keys() == []


def test_keys_that_are_pytree_paths_come_back_as_they_were(tmp_path):
    with jaxkv.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(0, state_at(3))
        restored = ckpt.restore(optimizer=OPT)
    assert restored.keys() == state_at(3).keys()
    assert sorted(restored.keys()) == sorted(KEYS)
    assert list(restored.opt_states) == [tuple(sorted(KEYS))]
    for key, shape in KEYS.items():
        assert restored[key].shape == shape


def _flip(path):
    """Flip a bit of the middle byte of the file ``path`` (again: mended)."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([byte ^ 0x10]))


def test_a_damaged_or_mismatched_step_is_refused_and_the_others_restore(tmp_path, devices):
    with jaxkv.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, state_at(1))
        ckpt.save(2, state_at(2))
        ckpt.wait_until_finished()
        path = ckpt.path(2)
        with open(os.path.join(path, orbax_dirs.MANIFEST)) as f:
            manifest = json.loads(json.load(f)["manifest"])
        biggest = max(manifest["files"], key=lambda rel: manifest["files"][rel]["size"])
        _flip(os.path.join(path, manifest["data"], "state", biggest))
        with pytest.raises(jaxkv.KVStoreError, match=f"{biggest}: checksum mismatch"):
            ckpt.restore(optimizer=OPT)
        kv = store(devices)
        before = kv.state
        with pytest.raises(jaxkv.KVStoreError, match="checksum mismatch"):
            ckpt.restore(2, kv)
        assert_same(kv.state, before)  # unchanged
        _flip(os.path.join(ckpt.path(1), orbax_dirs.MANIFEST))
        with pytest.raises(jaxkv.KVStoreError, match="manifest"):
            ckpt.restore(1, optimizer=OPT)
        _flip(os.path.join(ckpt.path(1), orbax_dirs.MANIFEST))  # mended
        assert_same(ckpt.restore(1, optimizer=OPT), state_at(1))
        with pytest.raises(jaxkv.KVStoreError, match="optimizer"):
            ckpt.restore(1)  # optimizer states and no optimizer to rebuild them
        with pytest.raises(jaxkv.KVStoreError, match="optimizer state expected"):
            ckpt.restore(1, optimizer=optax.adam(0.1))


def test_steps_and_arguments_are_refused_before_anything_is_written(tmp_path):
    with pytest.raises(jaxkv.KVStoreError, match="max_to_keep"):
        jaxkv.CheckpointManager(tmp_path, max_to_keep=0)
    ckpt = jaxkv.CheckpointManager(tmp_path)
    with pytest.raises(jaxkv.KVStoreError, match="expected a saved step, given none"):
        ckpt.restore()
    ckpt.save(5, state_at(5))
    for step in (5, 4):
        with pytest.raises(jaxkv.KVStoreError, match=r"after the latest saved \(5\)"):
            ckpt.save(step, state_at(step))
    for step, match in [(True, "an int"), (2.0, "an int"), (-1, "from 0"), (16**16, "from 0")]:
        with pytest.raises(jaxkv.KVStoreError, match=match):
            ckpt.save(step, state_at(1))
    with pytest.raises(jaxkv.KVStoreError, match="KVState or a jaxkv.KVStore, given dict"):
        ckpt.save(6, {"w": jnp.ones(3)})
    with pytest.raises(jaxkv.KVStoreError, match=r"saved steps \[5\], given 3"):
        ckpt.restore(3)
    with pytest.raises(jaxkv.KVStoreError, match="into: expected"):
        ckpt.restore(5, into={"w": jnp.ones(3)})
    assert ckpt.all_steps() == [5]
    ckpt.close()
    ckpt.close()  # once is enough
    with pytest.raises(jaxkv.KVStoreError, match="closed"):
        ckpt.save(6, state_at(6))
    assert os.listdir(tmp_path) == ["5"]


# A process that saves step 1, then is killed (SIGKILL) part way through the save of step 2:
# while process 0 hashes the written files, or once the step's manifest is in place but before
# orbax renames the step's directory into place.
KILLED = """
import os, signal, sys
import jax.numpy as jnp
import jaxkv
from jaxkv._src.checkpoint import orbax_dirs

where = sys.argv[2]
def killed(*args):
    if where == "committed":
        commit(*args)
    os.kill(os.getpid(), signal.SIGKILL)

commit = orbax_dirs.commit
ckpt = jaxkv.CheckpointManager(sys.argv[1])
ckpt.save(1, jaxkv.init(jaxkv.empty(), {"['w']": jnp.ones(3)}))
ckpt.wait_until_finished()
setattr(orbax_dirs, "digests" if where == "hashing" else "commit", killed)
ckpt.save(2, jaxkv.init(jaxkv.empty(), {"['w']": jnp.zeros(3)}))
ckpt.wait_until_finished()
"""


@pytest.mark.parametrize("where", ["hashing", "committed"])
def test_a_save_killed_part_way_leaves_the_previous_step_and_a_restart_resumes(tmp_path, where):
    import _jobs

    run = subprocess.run(
        [sys.executable, "-c", KILLED, str(tmp_path), where],
        env=_jobs.cpu_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == -signal.SIGKILL, run.stderr[-3000:]
    assert "1" in os.listdir(tmp_path) and "2" not in os.listdir(tmp_path)
    with jaxkv.CheckpointManager(tmp_path) as ckpt:
        assert (ckpt.all_steps(), ckpt.latest_step()) == ([1], 1)
        assert ckpt.restore()["['w']"].tolist() == [1.0, 1.0, 1.0]
        ckpt.save(2, jaxkv.init(jaxkv.empty(), {"['w']": jnp.full(3, 2.0)}))
        ckpt.wait_until_finished()
        assert ckpt.restore()["['w']"].tolist() == [2.0, 2.0, 2.0]
    assert sorted(os.listdir(tmp_path)) == ["1", "2"]  # the cut-short save cleaned away


# -- across processes ------------------------------------------------------------------------
# The job's keys: one split across the processes (MXNet's bound set below), so that each
# process writes its part; one kept whole; one empty.
JOB_KEYS = {"['params']['big']": (64, 512), "['params']['w']": (4, 3), "['empty']": (0,)}


@pytest.mark.whole
def test_a_job_of_2_processes_keeps_steps_and_resumes_from_the_latest_after_a_kill(tmp_path):
    import _jobs

    def launch(mode):
        return _jobs.launch(2, os.path.abspath(__file__), mode, tmp_path, timeout=240)

    run = launch("save")
    out = run.stdout + run.stderr
    # Process 1 killed itself part way through step 4's save, and the launcher stopped the job.
    assert run.returncode != 0 and "process 1 was killed by SIGKILL" in out, out[-3000:]
    for rank in (0, 1):
        for check in ["max_to_keep", "latest into the store", "step 2 as a state", "refused"]:
            assert f"rank {rank} ok {check}" in out, out[-3000:]
    steps = tmp_path / "steps"
    assert sorted(n for n in os.listdir(steps) if n.isdigit()) == ["2", "3"]
    with open(steps / "3" / "kv" / orbax_dirs.MANIFEST) as f:
        manifest = json.loads(json.load(f)["manifest"])
    assert manifest["processes"] == 2
    assert {f["process"] for f in manifest["files"].values()} == {0, 1}

    run = launch("resume")
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    for rank in (0, 1):
        for check in ["resumed from step 3", "saved step 4"]:
            assert f"rank {rank} ok {check}" in out, out[-3000:]
    assert sorted(os.listdir(steps)) == ["3", "4"]


def _job(mode, directory):
    """One process of the job (run by ``jaxkv.launch``): see the test above."""
    from jax.experimental import multihost_utils

    import jaxkv.mx as mx

    rank = jax.process_index()

    def check(name, ok):
        assert ok, name
        print(f"rank {rank} ok {name}", flush=True)

    def whole(state):
        return [
            np.asarray(multihost_utils.process_allgather(x, tiled=True))
            for x in jax.tree_util.tree_leaves(state)
        ]

    def same(a, b):
        return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))

    def train(kv, step):
        local = len(jax.local_devices())
        for key, shape in JOB_KEYS.items():
            g = np.full(shape, step + rank, np.float32)  # the sum: the same on any topology
            kv.push(key, [mx.nd.array(g, mx.cpu(i)) for i in range(local)])

    os.environ["MXNET_KVSTORE_BIGARRAY_BOUND"] = str(2**14)
    kv = mx.kv.create("dist_sync")
    kv.set_optimizer(OPT)
    saved = os.path.join(directory, "step3.npz")
    with jaxkv.CheckpointManager(os.path.join(directory, "steps"), max_to_keep=2) as ckpt:
        if mode == "save":
            kv.init(list(JOB_KEYS), [mx.nd.ones(s) for s in JOB_KEYS.values()])
            at = {}
            for step in (1, 2, 3):
                train(kv, step)
                ckpt.save(step, kv)
                at[step] = whole(kv.state)
            ckpt.wait_until_finished()
            check("max_to_keep", ckpt.all_steps() == [2, 3])
            if rank == 0:
                np.savez(saved, *at[3])
            train(kv, 4)
            ckpt.restore(into=kv)
            check("latest into the store", same(whole(kv.state), at[3]))
            state = ckpt.restore(2, kv.state, optimizer=OPT)
            check("step 2 as a state", same(whole(state), at[2]))
            # A byte of a file process 1 wrote, flipped: refused on every process.
            path = ckpt.path(2)
            with open(os.path.join(path, orbax_dirs.MANIFEST)) as f:
                manifest = json.loads(json.load(f)["manifest"])
            rel = max(r for r, f in manifest["files"].items() if f["process"] == 1)
            victim = os.path.join(path, manifest["data"], "state", rel)
            if rank == 0:
                _flip(victim)
            multihost_utils.sync_global_devices("flipped")
            try:
                ckpt.restore(2, kv)
            except jaxkv.KVStoreError as e:
                check("refused", "checksum mismatch" in str(e) and same(whole(kv.state), at[3]))
            multihost_utils.sync_global_devices("refused")
            # Process 1 dies (SIGKILL) once it has written its part of step 4.
            train(kv, 4)
            if rank == 1:
                orbax_dirs.digests = lambda root: os.kill(os.getpid(), signal.SIGKILL)
            ckpt.save(4, kv)
            ckpt.wait_until_finished()
            raise AssertionError("the save completed")
        with np.load(saved) as z:
            want = [z[f"arr_{i}"] for i in range(len(z.files))]
        check("latest step 3", ckpt.latest_step() == 3)
        ckpt.restore(into=kv)
        check("resumed from step 3", same(whole(kv.state), want))
        train(kv, 4)
        ckpt.save(4, kv)
        ckpt.wait_until_finished()
        at4 = whole(kv.state)
        ckpt.restore(4, kv)
        check("saved step 4", ckpt.all_steps() == [3, 4] and same(whole(kv.state), at4))
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    _job(sys.argv[1], sys.argv[2])
