"""Checkpoint directories (the format of multi-process jobs, on orbax-checkpoint) in one
process: round trips onto other devices, the atomic commit (a save cut short, in-process and by
SIGKILL, leaves the previous checkpoint loadable), the checks that run before any data is read,
and a KVState inside a user's own orbax CheckpointManager."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _devices import cpu_empty, cpu_store
from _jobs import cpu_env

import jaxkv
from jaxkv import nd
from jaxkv._src.checkpoint import npz as _checkpoint
from jaxkv._src.checkpoint import orbax_dirs as _orbax
from jaxkv._src.checkpoint.npz import load_state, save_state

ocp = pytest.importorskip("orbax.checkpoint")

SGD = optax.sgd(0.1, momentum=0.9)
ADAM = optax.adam(0.1)


def new_checkpoint(path, state):
    """A checkpoint directory, as a multi-process job writes it (one process suffices)."""
    _checkpoint.save(path, state, values=True, directory=True)


def bump(kv, keys=("b", "w")):
    """One more push of the store's optimizer group."""
    kv.push(list(keys), [nd.ones((2, 3)), nd.ones((64, 512))])


def store(keys=("b", "w"), compression=None, devices=None):
    """A store over ``devices`` (default: the 8 CPU devices), each device pushing once."""
    kv = jaxkv.KVStore("device", devices=jax.devices("cpu") if devices is None else devices)
    if compression:
        kv.set_gradient_compression(compression)
    kv.set_optimizer(SGD)
    kv.init(list(keys), [nd.array(np.arange(6.0).reshape(2, 3)), nd.ones((64, 512))])
    ids = [d.id for d in kv.state.devices]
    kv.push(
        list(keys),
        [
            [nd.ones((2, 3), jaxkv.cpu(i)) * (i + 1) for i in ids],
            [nd.ones((64, 512), jaxkv.cpu(i)) * 0.25 for i in ids],
        ],
    )
    return kv


def leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def assert_same(a, b):
    a, b = leaves(a), leaves(b)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("keys", [("b", "w"), (3, 9)])
def test_a_directory_round_trips_onto_other_devices(tmp_path, devices, keys):
    kv = store(keys)
    new_checkpoint(tmp_path / "c", kv.state)
    assert _orbax.is_checkpoint(tmp_path / "c")
    for devs in (devices[:2], devices[3:7], devices):
        fresh = jaxkv.KVStore("device", devices=devs)
        fresh.set_optimizer(SGD)
        fresh.load(tmp_path / "c")
        assert_same(fresh.state, kv.state)
        assert fresh.state[keys[1]].sharding.device_set == set(devs)
    # A checkpoint directory stays one: the next save of a single process writes it again.
    bump(kv, keys)
    kv.save(tmp_path / "c")
    assert len([n for n in os.listdir(tmp_path / "c") if n.startswith("data-")]) == 1
    fresh.load(tmp_path / "c")
    assert_same(fresh.state, kv.state)


def test_residuals_empty_values_and_optimizer_state_files(tmp_path, devices):
    kv = store(compression={"type": "2bit", "threshold": 0.5}, devices=devices[:4])
    kv.init("e", nd.zeros((0, 3)))  # orbax refuses empty arrays: the manifest holds them
    new_checkpoint(tmp_path / "c", kv.state)
    fresh = jaxkv.KVStore("device", devices=devices[4:])
    fresh.set_optimizer(SGD)
    fresh.load(tmp_path / "c")
    assert_same(fresh.state, kv.state)
    assert fresh.state.compression == ("2bit", 0.5)
    wrong = jaxkv.KVStore("device", devices=devices[:2])  # residuals hold one block per device
    wrong.set_optimizer(SGD)
    with pytest.raises(jaxkv.KVStoreError, match="residual expected shape"):
        wrong.load(tmp_path / "c")
    # Optimizer states alone, into a directory that already is a checkpoint.
    opt_only = tmp_path / "opt"
    state = kv.state
    _checkpoint.save(opt_only, state, values=False, directory=True)
    bump(kv)
    before = dict(kv.state.opt_states)
    kv.save_optimizer_states(opt_only)
    fresh = store(compression={"type": "2bit", "threshold": 0.5}, devices=devices[4:])
    fresh.init("e", nd.zeros((0, 3)))
    fresh.load_optimizer_states(opt_only)
    assert_same(dict(fresh.state.opt_states), before)


def test_save_state_and_load_state(tmp_path, devices):
    state = jaxkv.init_optimizer(jaxkv.init(cpu_empty(), {"w": jnp.ones((64, 512))}), ADAM)
    save_state(tmp_path / "s.npz", state)  # one process: one file
    new_checkpoint(tmp_path / "c", state)
    for path in (tmp_path / "s.npz", tmp_path / "c"):
        loaded = load_state(path, jaxkv.empty(devices[:2]), optimizer=ADAM)
        assert_same(loaded, state)
        assert loaded["w"].sharding.device_set == set(devices[:2])
    with pytest.raises(jaxkv.KVStoreError, match="expected a store with an optimizer"):
        load_state(tmp_path / "c", cpu_empty())
    with pytest.raises(jaxkv.KVStoreError, match="expected a jaxkv.KVState"):
        save_state(tmp_path / "x", {"w": 1})


def test_a_save_cut_short_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    kv = store()
    new_checkpoint(tmp_path / "c", kv.state)
    saved = leaves(kv.state)
    bump(kv)

    def cut(*args):
        raise KeyboardInterrupt  # after every data file is written, before the commit

    monkeypatch.setattr(_orbax, "commit", cut)
    with pytest.raises(KeyboardInterrupt):
        kv.save(tmp_path / "c")
    monkeypatch.undo()
    # The interrupted save removed its data directory; the previous checkpoint is whole.
    assert len([n for n in os.listdir(tmp_path / "c") if n.startswith("data-")]) == 1
    fresh = store()
    fresh.load(tmp_path / "c")
    for x, y in zip(leaves(fresh.state), saved):
        np.testing.assert_array_equal(x, y)
    (tmp_path / "c" / "data-0123456789abcdef").mkdir()  # as a killed save leaves
    (tmp_path / "c" / ".jaxkv-x.tmp").write_text("{")  # as a commit cut short leaves
    kv.save(tmp_path / "c")  # the next save removes what the cut ones left
    assert len([n for n in os.listdir(tmp_path / "c") if n.startswith("data-")]) == 1
    assert not (tmp_path / "c" / ".jaxkv-x.tmp").exists()
    fresh.load(tmp_path / "c")
    assert_same(fresh.state, kv.state)


KILLED = textwrap.dedent(
    """
    import sys, jax
    jax.config.update("jax_num_cpu_devices", 4)
    import jax.numpy as jnp, jaxkv
    from jaxkv._src.checkpoint import npz
    path = sys.argv[1]
    state = jaxkv.init(jaxkv.empty(), {"w": jnp.zeros((1024, 1024))})
    npz.save(path, state, values=True, directory=True)
    print("saved 0", flush=True)
    for i in range(1, 1000):
        state = jaxkv.init(jaxkv.empty(), {"w": jnp.full((1024, 1024), float(i))})
        npz.save(path, state, values=True)
        print(f"saved {i}", flush=True)
    """
)


def test_a_save_killed_part_way_leaves_the_previous_checkpoint(tmp_path, devices):
    path = tmp_path / "c"
    proc = subprocess.Popen(  # on 4 CPU devices, whatever this machine has
        [sys.executable, "-c", KILLED, str(path)], env=cpu_env(), stdout=subprocess.PIPE, text=True
    )
    try:
        lines = [proc.stdout.readline() for _ in range(3)]
        assert lines[-1].startswith("saved"), lines
        time.sleep(0.15)  # somewhere inside a later save
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    last = int(lines[-1].split()[1])
    fresh = jaxkv.KVStore("device", devices=devices[:4])
    fresh.load(path)
    w = np.asarray(fresh.pull("w"))
    assert w.shape == (1024, 1024) and w[0, 0] >= last
    np.testing.assert_array_equal(w, np.full_like(w, w[0, 0]))  # one whole save, never a mix


def edit_manifest(path, edit, *, rehash=True):
    with open(path / "manifest.json") as f:
        outer = json.load(f)
    manifest = json.loads(outer["manifest"])
    edit(manifest)
    outer["manifest"] = json.dumps(manifest)
    if rehash:
        import hashlib

        outer["sha256"] = hashlib.sha256(outer["manifest"].encode()).hexdigest()
    with open(path / "manifest.json", "w") as f:
        json.dump(outer, f)


def first_file(m):
    return m["files"][sorted(m["files"])[0]]


@pytest.mark.parametrize(
    "edit, rehash, pattern",
    [
        (lambda m: m.update(keys=["b", "x"]), False, "manifest checksum mismatch"),
        (lambda m: m.update(format="other"), True, "format 'jaxkv-checkpoint' version 1"),
        (lambda m: m.update(data="../elsewhere"), True, "'data' a data directory"),
        (lambda m: m.update(processes=0), True, "'processes' a count"),
        (lambda m: first_file(m).update(sha256="0" * 64), True, "checksum mismatch"),
        (lambda m: first_file(m).update(size=1), True, "expected 1 bytes"),
        (lambda m: first_file(m).update(process=5), True, "with its process, size and SHA-256"),
        (lambda m: m["files"].update({"../x": first_file(m)}), True, "a relative path"),
        (lambda m: m["files"].popitem(), True, r"0 missing \[\] and 1 not listed"),
        (lambda m: m["arrays"][1].update(shape=[32, 512]), True, "optimizer state expected"),
    ],
)
def test_a_bad_manifest_is_refused_and_changes_nothing(tmp_path, edit, rehash, pattern):
    kv = store()
    new_checkpoint(tmp_path / "c", kv.state)
    edit_manifest(tmp_path / "c", edit, rehash=rehash)
    fresh = cpu_store("device")
    fresh.set_optimizer(SGD)
    fresh.init("x", nd.ones(2))
    with pytest.raises(jaxkv.KVStoreError, match=pattern):
        fresh.load(tmp_path / "c")
    assert fresh.keys() == ["x"]


def test_the_store_is_checked_before_any_data_is_read(tmp_path):
    kv = store()
    new_checkpoint(tmp_path / "c", kv.state)
    (data,) = [n for n in os.listdir(tmp_path / "c") if n.startswith("data-")]
    os.rename(tmp_path / "c" / data, tmp_path / "gone")  # no data at all
    adam = cpu_store("device")
    adam.set_optimizer(ADAM)
    with pytest.raises(jaxkv.KVStoreError, match="optimizer state expected"):
        adam.load(tmp_path / "c")
    none = cpu_store("device")
    with pytest.raises(jaxkv.KVStoreError, match="expected a store with an optimizer"):
        none.load(tmp_path / "c")
    sgd = cpu_store("device")
    sgd.set_optimizer(SGD)
    with pytest.raises(jaxkv.KVStoreError, match="missing"):
        sgd.load(tmp_path / "c")  # only a store that fits reads (and misses) the data
    open(tmp_path / "c" / "extra", "w").close()  # a stray file beside the manifest is ignored
    os.rename(tmp_path / "gone", tmp_path / "c" / data)
    with open(tmp_path / "c" / data / "state" / "stray", "w") as f:
        f.write("x")
    with pytest.raises(jaxkv.KVStoreError, match=r"1 not listed \['stray'\]"):
        sgd.load(tmp_path / "c")
    os.unlink(tmp_path / "c" / data / "state" / "stray")
    sgd.load(tmp_path / "c")
    assert_same(sgd.state, kv.state)


def test_a_kvstate_in_a_users_checkpoint_manager(tmp_path, devices):
    """docs/design.md, "Saving": a KVState is a pytree, saved next to the model."""
    opt = optax.sgd(0.1, momentum=0.9)
    state = jaxkv.init(cpu_empty(), {"w": jnp.ones((64, 512)), "b": jnp.zeros(3)})
    state = jaxkv.init_optimizer(state, opt)
    params = {"dense": jnp.ones((2, 2))}
    options = ocp.CheckpointManagerOptions(max_to_keep=2)
    with ocp.CheckpointManager(tmp_path / "run", options=options) as mngr:
        mngr.save(
            1,
            args=ocp.args.Composite(
                model=ocp.args.StandardSave(params), kv=ocp.args.StandardSave(state)
            ),
        )
        mngr.wait_until_finished()
        like = jaxkv.init_optimizer(
            jaxkv.init(jaxkv.empty(devices[:4]), {"w": jnp.zeros((64, 512)), "b": jnp.zeros(3)}),
            opt,
        )
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like
        )
        out = mngr.restore(
            mngr.latest_step(),
            args=ocp.args.Composite(
                model=ocp.args.StandardRestore(params), kv=ocp.args.StandardRestore(abstract)
            ),
        )
    assert isinstance(out.kv, jaxkv.KVState)
    assert_same(out.kv, state)
    assert out.kv["w"].sharding.device_set == set(devices[:4])


def test_data_that_disagrees_with_a_consistent_manifest_is_refused(tmp_path):
    """A manifest rewritten with its checksum (a forgery, not damage) that gives an array
    another dtype: orbax would cast the data; its own metadata disagrees, so it is refused."""
    state = jaxkv.init(cpu_empty(), {"w": jnp.arange(4.0)})
    new_checkpoint(tmp_path / "c", state)
    edit_manifest(tmp_path / "c", lambda m: m["arrays"][0].update(dtype="bfloat16"))
    with pytest.raises(jaxkv.KVStoreError, match="the data holds shape"):
        load_state(tmp_path / "c", cpu_empty())


@pytest.mark.parametrize(
    "content, pattern",
    [
        (None, "given a directory without manifest.json"),
        (b"[1, 2]", "expected an object with 'manifest' and 'sha256'"),
        (b'{"manifest": 1, "sha256": "x"}', "expected an object with 'manifest' and 'sha256'"),
        (b"\xff\xfe", "cannot be read"),
        (b"[" * 100000, "cannot be read"),
    ],
)
def test_a_directory_without_a_readable_manifest_is_refused(tmp_path, content, pattern):
    (tmp_path / "c").mkdir()
    if content is not None:
        (tmp_path / "c" / "manifest.json").write_bytes(content)
    kv = cpu_store("device")
    kv.init("x", nd.ones(2))
    with pytest.raises(jaxkv.KVStoreError, match=pattern):
        kv.load(tmp_path / "c")
    with pytest.raises(jaxkv.KVStoreError, match="expected a jaxkv.KVState"):
        load_state(tmp_path / "c", {"x": 1})
    assert kv.keys() == ["x"]
