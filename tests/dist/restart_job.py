"""Run by tests/test_launch.py and tests/test_launch_hosts.py under
``python -m jaxkv.launch --max-restarts R``: the restart pattern of docs/distributed.md, a
training loop that checkpoints with ``kv.save`` every k steps and resumes with ``kv.load``.

    restart_job.py DIR STEPS EVERY [FAULT ...]

FAULT number a (``RANK:kill@STEP``, ``RANK:stop@STEP`` or ``RANK:hang@STEP``) is what happens on
attempt a (JAXKV_RESTART_COUNT == a): that rank SIGKILLs or SIGSTOPs itself, or sleeps for ever
(alive, heartbeats going, never reaching the next push), when it is about to run step STEP
(0-based: STEP steps done).

Each step pushes ``(rank + 1) * (step + 1)`` from every local device to ``w`` and applies SGD
with momentum (optimizer state that a checkpoint must carry). After every EVERY steps, every
rank calls ``kv.save(DIR/step-N)`` (N: steps done; a checkpoint directory in a multi-process
job). On start, every rank loads the newest complete checkpoint, if any, and runs the steps
after it: a fault between two checkpoints makes the restarted job redo the steps since the last.
Each rank prints ``rank R attempt A starts at step S`` and, at the end, ``rank R final [...]``.
"""

import os
import re
import signal
import sys
import time

import jax
import numpy as np
import optax

import jaxkv.mx as mx

SHAPE = (2, 3)
# Momentum 0.5 keeps every value a small dyadic number, exact in float32 in any order of
# operations, so the tests' NumPy reference is exact too.
OPTIMIZER = optax.sgd(0.5, momentum=0.5)


def latest(directory):
    """``(steps done, path)`` of the newest complete checkpoint in ``directory``, or
    ``(0, None)``. A checkpoint is complete once its save returned: a directory's
    ``manifest.json`` (or a one-process job's file) appears by an atomic rename."""
    found = [(0, None)]
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        m = re.fullmatch(r"step-(\d+)", name)
        if m and (os.path.isfile(path) or os.path.isfile(os.path.join(path, "manifest.json"))):
            found.append((int(m[1]), path))
    return max(found)


def uninterrupted(steps, processes, devices_per_process, lose_momentum_at=()):
    """``w`` after ``steps`` steps with no fault, computed with NumPy (float32, as the store):
    each step's gradient is the sum of every device's push. ``lose_momentum_at``: steps before
    which the momentum is dropped (what a resume without the optimizer state would give)."""
    w, trace = np.zeros(SHAPE, np.float32), np.zeros(SHAPE, np.float32)
    for step in range(steps):
        if step in lose_momentum_at:
            trace = np.zeros_like(trace)
        pushed = sum((rank + 1) * (step + 1) for rank in range(processes)) * devices_per_process
        trace = np.float32(pushed) + np.float32(0.5) * trace
        w = w + np.float32(-0.5) * trace
    return w.ravel().tolist()


def say(line):
    os.write(1, (line + "\n").encode())  # one write: the processes share the pipe


def main():
    directory, steps, every, faults = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
    attempt = int(os.environ["JAXKV_RESTART_COUNT"])
    kv = mx.kv.create("dist_sync")
    rank, local = kv.rank, jax.local_devices()
    fault = faults[attempt].split(":") if attempt < len(faults) else None
    kv.set_optimizer(OPTIMIZER)  # first: load restores the optimizer's state
    start, path = latest(directory)
    if path:
        kv.load(path)
    else:
        kv.init("w", mx.nd.zeros(SHAPE))
    say(f"rank {rank} attempt {attempt} starts at step {start}")
    for step in range(start, steps):
        if fault and int(fault[0]) == rank and fault[1] == f"hang@{step}":
            time.sleep(1e6)
        if fault and int(fault[0]) == rank and fault[1] in (f"kill@{step}", f"stop@{step}"):
            os.kill(os.getpid(), signal.SIGKILL if fault[1].startswith("kill") else signal.SIGSTOP)
        grads = [
            mx.nd.ones(SHAPE, mx.cpu(i)) * ((rank + 1) * (step + 1)) for i in range(len(local))
        ]
        kv.push("w", grads)
        if (step + 1) % every == 0:
            kv.save(os.path.join(directory, f"step-{step + 1}"))
    say(f"rank {rank} final {np.asarray(kv.pull('w')).ravel().tolist()}")


if __name__ == "__main__":
    main()
