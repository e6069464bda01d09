"""Run by tests/test_launch_cause.py under ``python -m jaxkv.launch -n 2``: after one push,
rank 1 fails while rank 0 waits for it in the next push, whose collective then fails too (rank
0 exits 1, or is aborted). The launcher must name rank 1, whichever way it failed:

    cause_job.py exit|raise|kill|abort

``exit``: ``sys.exit(3)`` (status 3); ``raise``: an uncaught exception (status 1, as rank 0's
failed push); ``kill``: SIGKILL (status -9); ``abort``: SIGABRT (status -6).
"""

import os
import signal
import sys
import time

import jaxkv.mx as mx

kv = mx.kv.create("dist_sync")
kv.init("w", mx.nd.zeros((3,)))
kv.push("w", [mx.nd.ones((3,), mx.cpu(0))])
os.write(1, f"rank {kv.rank} pushed\n".encode())
if kv.rank == 1:
    how = sys.argv[1]
    if how == "exit":
        sys.exit(3)
    if how == "raise":
        raise RuntimeError("rank 1 fails")
    os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGABRT)
    time.sleep(600)
kv.push("w", [mx.nd.ones((3,), mx.cpu(0))])  # fails once rank 1 is gone
time.sleep(600)
