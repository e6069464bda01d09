"""Run by tests/test_launch.py under ``python -m jaxkv.launch -n 2``: rank 1 ends with
``sys.exit(3)`` (argument ``sys.exit``) or ``raise SystemExit(3)`` (``raise``) after one push,
while rank 0 goes on to the next push, a collective that can never complete. Without the
launcher's script runner, rank 1 would wait at JAX's shutdown for rank 0, up to 5 minutes."""

import os
import sys
import time

import jaxkv.mx as mx

kv = mx.kv.create("dist_sync")
kv.init("w", mx.nd.zeros((3,)))
kv.push("w", [mx.nd.ones((3,), mx.cpu(0))])
os.write(1, f"rank {kv.rank} pushed\n".encode())
if kv.rank == 1:
    if sys.argv[1] == "sys.exit":
        sys.exit(3)
    raise SystemExit(3)
kv.push("w", [mx.nd.ones((3,), mx.cpu(0))])  # waits for rank 1 until the launcher ends it
time.sleep(600)
