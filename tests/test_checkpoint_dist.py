"""Checkpoints across processes and topologies: a dist_sync job of 2 processes x 2 devices saves
(``KVStore.save`` and ``save_state``, a directory each), reloads its own checkpoint and trains on
exactly as before; the checkpoint then loads bit-exactly, optimizer state included, in this
process on 4 devices (1 x 4) and in a job of 4 processes x 1 device (4 x 1), and training
continues exactly as the saving job's did; the 4 x 1 job also loads the one-file format that
this process saves. Each job also refuses a copy with one flipped byte in a file another
process wrote, on every process, its store unchanged, and this process refuses a flipped byte
in each file. A save in which one process dies before the commit leaves the previous
checkpoint loadable."""

import importlib.util
import json
import os

import _jobs
import jax
import numpy as np
import pytest

import jaxkv
from jaxkv import nd
from jaxkv._src.checkpoint.npz import load_state

pytest.importorskip("orbax.checkpoint")

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "dist", "checkpoint_job.py")
# The launched script, for its optimizer and gradients (its main() runs only when launched).
_spec = importlib.util.spec_from_file_location("checkpoint_job", SCRIPT)
job = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(job)


def launch(n, per_process, *args, ok=True):
    run = _jobs.launch(n, "checkpoint_job.py", *args, per_process=per_process, timeout=180)
    assert (run.returncode == 0) == ok, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout


def expect(stdout, n, checks):
    for rank in range(n):
        for check in checks:
            assert f"rank {rank} ok {check}" in stdout, stdout
        assert f"rank {rank} done" in stdout


def assert_leaves(got, path):
    with np.load(path, allow_pickle=False) as z:
        want = [z[f"a{i}"] for i in range(len(z.files))]
    got = [np.asarray(x) for x in job.leaves(got)]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g.dtype, g.shape) == (w.dtype, w.shape)
        np.testing.assert_array_equal(g, w)


def test_saved_by_2x2_loads_on_1x4_4x1_and_3x1_and_training_continues_exactly(tmp_path, devices):
    stdout = launch(2, 2, "save", str(tmp_path))
    refused = "damaged checkpoint refused, store unchanged"
    expect(stdout, 2, ["load on the saving topology", "training continues exactly", refused])
    expect(stdout, 2, ["refused over an existing file", "a local store's own file"])
    expect(stdout, 2, ["refused a directory for a local store"])
    # Each process wrote its own shards: the manifest records who hashed which file.
    with open(tmp_path / "ckpt" / "manifest.json") as f:
        manifest = json.loads(json.load(f)["manifest"])
    assert manifest["processes"] == 2
    assert {f["process"] for f in manifest["files"].values()} == {0, 1}

    # 1 x 4: this process, a store on 4 of its devices.
    kv = jaxkv.KVStore("device", devices=devices[:4])
    kv.set_optimizer(job.OPT)
    kv.load(tmp_path / "ckpt")
    assert_leaves(kv.state, tmp_path / "saved.npz")
    kv.save(tmp_path / "single.npz")  # the one-file format, for the 4 x 1 job to load
    assert kv.state[5].sharding.device_set == set(devices[:4])
    assert not kv.state[5].sharding.is_fully_replicated  # sharded over the 4 devices
    state = load_state(tmp_path / "state", jaxkv.empty(devices[:4]), optimizer=job.OPT)
    assert_leaves(state, tmp_path / "saved.npz")
    for step in [2, 3, 4]:
        for key in job.SHAPES:
            g = job.gradient(key, step)
            kv.push(key, [nd.array(g, jaxkv.cpu(i)) for i in range(4)])
    assert_leaves(kv.state, tmp_path / "after.npz")

    # Every file of the 2-process checkpoint, one byte flipped: refused, the store unchanged.
    for rel in sorted(manifest["files"]):
        victim = tmp_path / "ckpt" / manifest["data"] / "state" / rel
        raw = bytearray(victim.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        victim.write_bytes(bytes(raw))
        with pytest.raises(jaxkv.KVStoreError, match="checksum mismatch"):
            kv.load(tmp_path / "ckpt")
        raw[len(raw) // 2] ^= 0x10
        victim.write_bytes(bytes(raw))
    assert_leaves(kv.state, tmp_path / "after.npz")

    # 4 x 1 and 3 x 1: jobs of 4 and of 3 processes (3 does not divide the split key's rows).
    checks = ["load on another topology", "load_state on another topology"]
    checks.append("load of a single-process file")
    for n in (4, 3):
        stdout = launch(n, 1, "load", str(tmp_path))
        # Training goes on as the saving job's only on its 4 devices (each pushes a gradient).
        expect(stdout, n, [*checks, refused] + ["training continues exactly"] * (n == 4))


def test_a_save_killed_part_way_leaves_the_previous_checkpoint(tmp_path, devices):
    # The job fails: process 1's exit, or process 0's as its collective loses process 1.
    launch(2, 2, "killed", str(tmp_path), ok=False)
    # The killed save's data directory, never committed: removed by process 0 as its
    # collective fails, or left where the launcher stopped it first (the next save removes it).
    assert len([n for n in os.listdir(tmp_path / "killed") if n.startswith("data-")]) in (1, 2)
    kv = jaxkv.KVStore("device", devices=devices[:4])
    kv.set_optimizer(job.OPT)
    kv.load(tmp_path / "killed")
    assert_leaves(kv.state, tmp_path / "first.npz")


@pytest.mark.parametrize("directory", [False, True])
def test_a_save_makes_the_missing_parent_directories(tmp_path, directory):
    """``ckpt/step-2`` under a ``ckpt`` that does not exist yet, as the restart pattern of
    docs/distributed.md saves: a one-process job's file and a job's directory alike."""
    from jaxkv._src.checkpoint import npz as _checkpoint

    state = jaxkv.init(jaxkv.empty(), {"w": jax.numpy.arange(3.0)})
    path = tmp_path / "ckpt" / "more" / "step-2"
    _checkpoint.save(path, state, values=True, directory=directory)
    assert path.is_dir() == directory
    assert load_state(path, jaxkv.empty())["w"].tolist() == [0.0, 1.0, 2.0]
