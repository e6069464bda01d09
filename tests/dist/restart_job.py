"""Run by tests/test_launch.py under ``python -m jaxkv.launch --max-restarts R``: a training
loop that keeps its progress in a file of its own and resumes from it after a restart.

    restart_job.py DIR STEPS [FAULT ...]

FAULT number a (``RANK:kill@STEP`` or ``RANK:stop@STEP``) is what happens on attempt a
(JAXKV_RESTART_COUNT == a): that rank SIGKILLs or SIGSTOPs itself when it reaches that step.

Each step pushes ``(rank + 1) * (step + 1)`` from every local device and applies SGD; after the
pull, each rank writes ``DIR/progress-<rank>.npy`` (the next step, then the values) by an
atomic rename. On start, every rank loads its own file and ``init``s the store with it: the
store keeps rank 0's values, so every rank resumes from rank 0's step. (Synchronous steps make
rank 0's file at least as new as the last step every rank finished before the failure.)
"""

import os
import signal
import sys

import jax
import numpy as np
import optax

import jaxkv.mx as mx

SHAPE = (2, 3)


def main():
    directory, steps, faults = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    attempt = int(os.environ["JAXKV_RESTART_COUNT"])
    kv = mx.kv.create("dist_sync")
    rank, local = kv.rank, jax.local_devices()
    fault = faults[attempt].split(":") if attempt < len(faults) else None
    progress = os.path.join(directory, f"progress-{rank}.npy")
    saved = np.load(progress) if os.path.exists(progress) else np.zeros(1 + np.prod(SHAPE))
    kv.init(["step", "w"], [mx.nd.array(saved[:1]), mx.nd.array(saved[1:].reshape(SHAPE))])
    start = int(np.asarray(kv.pull("step"))[0])  # rank 0's, on every rank
    print(f"rank {rank} attempt {attempt} starts at step {start}", flush=True)
    kv.set_optimizer(optax.sgd(0.5))
    for step in range(start, steps):
        if fault and int(fault[0]) == rank and fault[1] in (f"kill@{step}", f"stop@{step}"):
            os.kill(os.getpid(), signal.SIGKILL if fault[1].startswith("kill") else signal.SIGSTOP)
        grads = [
            mx.nd.ones(SHAPE, mx.cpu(i)) * ((rank + 1) * (step + 1)) for i in range(len(local))
        ]
        kv.push("w", grads)
        w = np.asarray(kv.pull("w"))
        tmp = f"{progress}.tmp.npy"
        np.save(tmp, np.concatenate([[step + 1], w.ravel()]))
        os.replace(tmp, progress)
    print(f"rank {rank} final {w.ravel().tolist()}", flush=True)


if __name__ == "__main__":
    main()
