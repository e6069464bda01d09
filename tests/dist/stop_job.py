"""Run by tests/test_launch_hang.py under ``python -m jaxkv.launch -n 2``: after one push, one
rank stops itself (SIGSTOP) while the other waits for it in the next push:

    stop_job.py RANK

The stopped rank sends no more heartbeats. After JAX's heartbeat timeout
(``JAXKV_HEARTBEAT_TIMEOUT``) the other aborts (SIGABRT): rank 0, which serves the coordination
service, declares rank 1 dead; rank 1 finds rank 0's service gone. The launcher must name the
stopped rank as the process that stopped responding, not the one that aborted.
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
if kv.rank == int(sys.argv[1]):
    os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(600)
kv.push("w", [mx.nd.ones((3,), mx.cpu(0))])  # waits until the heartbeat timeout
time.sleep(600)
