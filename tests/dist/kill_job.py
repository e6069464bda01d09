"""Run by tests/test_kill_matrix.py under ``python -m jaxkv.launch``: a small model trained with
a ``jaxkv.CheckpointManager`` that resumes from its latest step, one rank killed (SIGKILL) once.

    kill_job.py WORK STEPS EVERY [RANK:WHEN@STEP]

A two-layer MLP (``w1`` split across the processes, so that each process writes its own shards
of a step; ``b1``, ``w2`` kept whole) trained with Adam through a ``dist_sync`` store: at each
step every process pulls the parameters, computes the gradient of its own batch (drawn from a
generator seeded by the step and the rank, so the data never depends on the attempt) on each of
its devices, and pushes them. After every EVERY steps, every process calls
``ckpt.save(steps done, kv)`` into ``WORK/ckpt`` (``max_to_keep=2``); on start, it restores the
latest step and runs the steps after it. At the end process 0 writes the parameters to
``WORK/final.npz``.

The fault, only while ``WORK/killed`` does not exist (the rank makes it, then kills itself, so a
restarted or relaunched job runs clean): rank RANK SIGKILLs itself

- ``push@S``: at step S's push (0-based: S steps done), before it has completed on any process;
- ``save@S``: inside the save of step S (S a multiple of EVERY), once it has written its part of
  the step (process 0: in ``finalize``, before the manifest is committed; the others: in
  orbax's background thread, while hashing what they wrote);
- ``saved@S``: right after the save of step S, once the step is complete (its directory renamed
  into place).

Each rank prints ``rank R starts at step S`` when it starts training.
"""

import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxkv
import jaxkv.mx as mx
from jaxkv._src.checkpoint import orbax_dirs

FEATURES, HIDDEN, BATCH = 8, 64, 16  # BATCH: rows per device and step
SHAPES = {"w1": (FEATURES, HIDDEN), "b1": (HIDDEN,), "w2": (HIDDEN, 1)}
OPTIMIZER = optax.adam(0.05)


def loss(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


gradient = jax.jit(jax.grad(loss))


def batch(step, rank, device):
    """The batch of one device of ``rank`` at ``step``: the same in every attempt."""
    rng = np.random.default_rng([step, rank, device])
    x = rng.standard_normal((BATCH, FEATURES)).astype(np.float32)
    y = np.sin(x.sum(axis=1, keepdims=True)).astype(np.float32)
    return x, y


def initial():
    rng = np.random.default_rng(0)
    return {k: (0.3 * rng.standard_normal(s)).astype(np.float32) for k, s in SHAPES.items()}


def die(marker, fault):
    """Make ``marker`` (so that the next attempt runs clean), then SIGKILL this process."""
    with open(marker, "x"):
        pass
    print(f"rank {jax.process_index()} kills itself ({fault})", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def kill_while_hashing(step, marker, fault):
    """Die once this process hashes the files it wrote for ``step`` (process 0 in
    ``finalize``, the others in orbax's background thread), not those of the save before it,
    which may still be in progress."""
    digests = orbax_dirs.digests

    def hashing(root):
        if orbax_dirs.data_name(step) in root:
            die(marker, fault)
        return digests(root)

    orbax_dirs.digests = hashing


def fault_of(rank, marker):
    """``WHEN@STEP`` where this rank dies in this attempt, or ``None``."""
    if len(sys.argv) < 5 or os.path.exists(marker):
        return None
    who, fault = sys.argv[4].split(":")
    return fault if int(who) == rank else None


def main():
    work, steps, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    marker = os.path.join(work, "killed")
    # w1 (512 elements) is split across the processes; b1 and w2 are kept whole.
    os.environ["MXNET_KVSTORE_BIGARRAY_BOUND"] = "512"
    kv = mx.kv.create("dist_sync")
    rank, local = kv.rank, jax.local_devices()
    fault = fault_of(rank, marker)
    kv.set_optimizer(OPTIMIZER)  # before restore: it restores the optimizer's state
    with jaxkv.CheckpointManager(os.path.join(work, "ckpt"), max_to_keep=2) as ckpt:
        start = ckpt.latest_step() or 0
        if start:
            ckpt.restore(into=kv)
        else:
            values = initial()
            kv.init(list(values), [mx.nd.array(v) for v in values.values()])
        print(f"rank {rank} starts at step {start}", flush=True)
        for step in range(start, steps):
            params = dict(zip(SHAPES, map(np.asarray, kv.pull(list(SHAPES)))))
            grads = [gradient(params, *batch(step, rank, i)) for i in range(len(local))]
            if fault == f"push@{step}":
                die(marker, fault)
            kv.push(
                list(SHAPES),
                [[mx.nd.array(g[k], mx.cpu(i)) for i, g in enumerate(grads)] for k in SHAPES],
            )
            done = step + 1
            if done % every:
                continue
            if fault == f"save@{done}":
                kill_while_hashing(done, marker, fault)
            ckpt.save(done, kv)
            if fault == f"saved@{done}":
                complete = os.path.join(ckpt.directory, str(done))  # renamed into place
                deadline = time.monotonic() + 120
                while not os.path.isdir(complete):
                    assert time.monotonic() < deadline, f"step {done} not complete in 120 s"
                    time.sleep(0.01)
                die(marker, fault)
        params = dict(zip(SHAPES, map(np.asarray, kv.pull(list(SHAPES)))))
    if rank == 0:
        np.savez(os.path.join(work, "final.npz"), **params)
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
