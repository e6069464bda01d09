"""Run by tests/test_launch_hang.py under ``python -m jaxkv.launch -n 2``: after one push, one
rank stops itself (SIGSTOP), or hangs (sleeps, alive), while the other waits for it in the next
push (held until the pull's result is read):

    stop_job.py RANK [hang]

A stopped rank sends no more heartbeats. After JAX's heartbeat timeout
(``JAXKV_HEARTBEAT_TIMEOUT``) the other aborts (SIGABRT): rank 0, which serves the coordination
service, declares rank 1 dead; rank 1 finds rank 0's service gone. A hung rank goes on sending
heartbeats: the other's push times out (``JAXKV_COLLECTIVE_TIMEOUT``) and it exits with 124.
Either way the launcher must name the stopped or hung rank, not the one that ended.
"""

import os
import signal
import sys
import time

import jaxkv.mx as mx

kv = mx.kv.create("dist_sync")
kv.init("w", mx.nd.zeros((3,)))
kv.push("w", [mx.nd.ones((3,), mx.cpu(0))])
kv.barrier()  # both ranks have started and pushed before either stops (a loaded machine)
os.write(1, f"rank {kv.rank} pushed\n".encode())
if kv.rank == int(sys.argv[1]):
    if sys.argv[2:] != ["hang"]:
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(600)
kv.push("w", [mx.nd.ones((3,), mx.cpu(0))])
out = mx.nd.zeros((3,))
kv.pull("w", out=out)
out.asnumpy()  # runs what the store holds: waits until a timeout
time.sleep(600)
