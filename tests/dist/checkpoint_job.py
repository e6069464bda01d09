"""Run by tests/test_checkpoint_dist.py through ``python -m jaxkv.launch``: one worker of a
dist_sync job that saves or loads checkpoint directories.

    checkpoint_job.py save DIR   train 2 steps, save DIR/ckpt (KVStore.save) and DIR/state
                                 (save_state), train 3 more; rank 0 writes DIR/saved.npz and
                                 DIR/after.npz (every leaf, whole); then load DIR/ckpt again and
                                 train the same 3 steps
    checkpoint_job.py killed DIR save DIR/killed, then save again and kill rank 1 part way
    checkpoint_job.py load DIR   load DIR/ckpt and DIR/state saved by another topology, and
                                 DIR/single.npz saved by one process, compare with
                                 DIR/saved.npz, train 3 steps, compare with DIR/after.npz

Both modes then damage a copy of the checkpoint (one byte of a file another process wrote) and
expect every process to refuse it, its store unchanged. Every device pushes the same gradient
per step, so the sums, and so the whole run, are the same on any topology with 4 devices.
Each check prints ``rank R ok NAME``; any failure raises, so the worker exits non-zero.
"""

import json
import os
import shutil
import sys

import jax
import numpy as np
import optax
from jax.experimental import multihost_utils

import jaxkv
import jaxkv.mx as mx  # importing jaxkv joins the job
from jaxkv._src.checkpoint.npz import load_state, save_state

OPT = optax.sgd(0.25, momentum=0.5)
SHAPES = {3: (4, 3), 5: (64, 512), 8: (0,)}  # replicated, split across processes, empty


def gradient(key, step):
    """One device's gradient: small integers, so every sum and update is exact."""
    rng = np.random.default_rng(100 * step + key)
    return rng.integers(-4, 5, SHAPES[key]).astype(np.float32)


def initial(key):
    rng = np.random.default_rng(key)
    return (rng.integers(-8, 9, SHAPES[key]) / 4).astype(np.float32)


def train(kv, steps):
    local = len(jax.local_devices())
    for step in steps:
        for key in SHAPES:
            g = gradient(key, step)
            kv.push(key, [mx.nd.array(g, mx.cpu(i)) for i in range(local)])


def whole(state):
    """Every leaf of ``state`` as one NumPy array each, the same on every process."""
    return [np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in leaves(state)]


def leaves(state):
    """The state's arrays in a form every layout shares: each key's value, then each optimizer
    group's optax state, then the residuals (a flat store's buckets seen through its views)."""
    return jax.tree_util.tree_leaves(
        [
            list(state.values.values()),
            list(state.opt_states.values()),
            list(state.residuals.values()),
        ]
    )


def check(name, got, want):
    assert len(got) == len(want), (name, len(got), len(want))
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, g.shape, w.shape)
        np.testing.assert_array_equal(g, w, err_msg=name)
    print(f"rank {jax.process_index()} ok {name}", flush=True)


def saved(path):
    with np.load(path, allow_pickle=False) as z:
        return [z[f"a{i}"] for i in range(len(z.files))]


def write(path, arrays):
    if jax.process_index() == 0:
        np.savez(path, **{f"a{i}": a for i, a in enumerate(arrays)})
    multihost_utils.sync_global_devices(path)


def store():
    # MXNet's bound set: key 5 is split across the processes, so that each writes its part
    # (a dist_sync store otherwise keeps every value whole in each process).
    os.environ["MXNET_KVSTORE_BIGARRAY_BOUND"] = str(2**14)
    kv = mx.kv.create("dist_sync")
    kv.set_optimizer(OPT)
    return kv


def damaged_is_refused(kv, directory):
    """A copy of ``directory/ckpt`` with one byte flipped in a file the last saving process
    wrote: every process refuses it, whichever of them verifies that file."""
    bad = os.path.join(directory, f"bad{jax.process_count()}")
    if jax.process_index() == 0:
        shutil.copytree(os.path.join(directory, "ckpt"), bad)
        with open(os.path.join(bad, "manifest.json")) as f:
            manifest = json.loads(json.load(f)["manifest"])
        # The biggest data file of the last process that saved the checkpoint.
        last = max(f["process"] for f in manifest["files"].values())
        rel = max(
            (r for r, f in manifest["files"].items() if f["process"] == last),
            key=lambda r: manifest["files"][r]["size"],
        )
        victim = os.path.join(bad, manifest["data"], "state", rel)
        with open(victim, "r+b") as f:
            f.seek(os.path.getsize(victim) // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x01]))
    multihost_utils.sync_global_devices("damaged")
    before = whole(kv.state)
    try:
        kv.load(bad)
    except jaxkv.KVStoreError as e:
        assert "checksum mismatch" in str(e), e
    else:
        raise AssertionError("a damaged checkpoint loaded")
    check("damaged checkpoint refused, store unchanged", whole(kv.state), before)


def refused(name, call, *args):
    try:
        call(*args)
    except jaxkv.KVStoreError:
        print(f"rank {jax.process_index()} ok refused {name}", flush=True)
    else:
        raise AssertionError(f"not refused: {name}")


def local_stores(directory, ckpt):
    """A store on this process's devices only saves and loads files of its own, as in a
    single-process job, and refuses checkpoint directories (the other processes would wait)."""
    rank = jax.process_index()
    local = mx.kv.create("local")
    local.init(7, mx.nd.ones((2, 2)) * (rank + 1))
    mine = os.path.join(directory, f"local{rank}.npz")
    local.save(mine)
    other = mx.kv.create("local")
    other.load(mine)
    check(
        "a local store's own file",
        [np.asarray(other.pull(7))],
        [np.full((2, 2), rank + 1, np.float32)],
    )
    refused("a directory for a local store", local.load, ckpt)


def killed(directory):
    """Save DIR/killed once, then again with rank 1 killed after writing its shards, before
    the commit: the launcher stops the job, and the first checkpoint must still load."""
    from jaxkv._src.checkpoint import orbax_dirs as _orbax

    kv = store()
    kv.init(list(SHAPES), [mx.nd.array(initial(k)) for k in SHAPES])
    train(kv, [0])
    path = os.path.join(directory, "killed")
    kv.save(path)
    write(os.path.join(directory, "first.npz"), whole(kv.state))
    train(kv, [1])
    if jax.process_index() == 1:
        _orbax._digest = lambda *args: os._exit(9)  # dies while hashing what it wrote
    kv.save(path)
    raise AssertionError("the save completed")


def main():
    mode, directory = sys.argv[1], sys.argv[2]
    rank = jax.process_index()
    ckpt, state_dir = os.path.join(directory, "ckpt"), os.path.join(directory, "state")
    if mode == "killed":
        return killed(directory)
    kv = store()
    if mode == "save":
        kv.init(list(SHAPES), [mx.nd.array(initial(k)) for k in SHAPES])
        train(kv, [0, 1])
        kv.save(ckpt)
        save_state(state_dir, kv.state)
        here = whole(kv.state)
        write(os.path.join(directory, "saved.npz"), here)
        train(kv, [2, 3, 4])
        after = whole(kv.state)
        write(os.path.join(directory, "after.npz"), after)
        kv.load(ckpt)
        check("load on the saving topology", whole(kv.state), here)
        train(kv, [2, 3, 4])
        check("training continues exactly", whole(kv.state), after)
        refused("over an existing file", kv.save, os.path.join(directory, "saved.npz"))
        local_stores(directory, ckpt)
    else:
        kv.load(ckpt)
        check("load on another topology", whole(kv.state), saved(f"{directory}/saved.npz"))
        state = load_state(state_dir, jaxkv.empty(jax.devices()), optimizer=OPT)
        check("load_state on another topology", whole(state), saved(f"{directory}/saved.npz"))
        single = store()  # a file a single-process job saved: every process reads it whole
        single.load(os.path.join(directory, "single.npz"))
        check("load of a single-process file", whole(single.state), saved(f"{directory}/saved.npz"))
        if len(jax.devices()) == 4:  # the saving job's 4 devices: the same sums
            train(kv, [2, 3, 4])
            check("training continues exactly", whole(kv.state), saved(f"{directory}/after.npz"))
    damaged_is_refused(kv, directory)
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
