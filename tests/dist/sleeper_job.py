"""Run by tests/test_launch.py: a process that never ends by itself.

    sleeper_job.py DIR [jax]

Starts a child (``sleep``), writes ``DIR/rank-<rank>`` with its own PID and the child's, and
sleeps. With ``jax`` it first joins the job (importing jaxkv) and meets the others at a
barrier, so JAX's SIGTERM handler is installed, as in a real job.
"""

import os
import subprocess
import sys
import time

directory = sys.argv[1]
if sys.argv[2:] == ["jax"]:
    import jaxkv

    jaxkv.create("dist_sync").barrier()
child = subprocess.Popen(["sleep", "600"])
rank = os.environ["JAXKV_PROCESS_ID"]
tmp = os.path.join(directory, f".rank-{rank}")
with open(tmp, "w") as f:
    f.write(f"{os.getpid()} {child.pid}\n")
os.rename(tmp, os.path.join(directory, f"rank-{rank}"))
time.sleep(600)
