"""Start a multi-process jaxkv job, on this machine or on several.

    python -m jaxkv.launch -n N [--devices-per-process K] [--max-restarts R] script.py [args...]
    python -m jaxkv.launch --nnodes M --node-rank R --coordinator HOST:PORT -n N ... script.py

The first form starts N copies of ``script.py`` with a coordinator on 127.0.0.1. The second,
run once on each of M hosts (node ranks 0 .. M-1), starts N copies on each; process i of node
R is process R*N + i of the job, and process 0 (on node 0) serves the coordinator at HOST:PORT,
an address of node 0 that every host can reach. Each process joins the job when it imports
jaxkv, so ``jaxkv.create('dist_sync')`` spans every process's devices; gloo binds to the
address on the route toward the coordinator, or to the interface named in JAXKV_IFNAME.

When a process fails, the launcher stops the others and exits with that process's status (128 + n
for a process killed by signal n); with ``--max-restarts R`` it starts the whole job again
instead, up to R times, with JAXKV_RESTART_COUNT (0, 1, ...) in the environment. The process it
names is the first to fail, not a peer whose collective then failed because that one had gone
(such a peer fails within milliseconds, and may even end first); the others that failed follow
in its message. To tell them apart, it waits up to :data:`SETTLE` seconds after the first
failure for the others' statuses. A process that fails in Python (an exception, ``sys.exit(n)``)
notes when, and which of its peers on this node had begun to exit by then (``/proc/PID/stat``);
it comes after those. Other failures are ordered by when the launcher saw them end (on Linux, as
the kernel reports them through one pidfd per process).

Each process runs the script as ``python script.py`` would, except that ``sys.exit(n)``, n not
0, in a process of a multi-process job exits at once (JAX's shutdown would wait for the other
processes). SIGTERM, SIGINT and SIGHUP stop every process it started (SIGTERM, then SIGKILL
after a grace period, to each process's whole process group); the processes also get SIGKILL if
the launcher itself dies.

Unless GLIBC_TUNABLES is already set, the processes start with
GLIBC_TUNABLES=glibc.malloc.hugetlb=1: glibc's malloc then takes transparent huge pages, which
cuts the page faults of XLA's per-run temp buffers on CPU (see docs/distributed.md). Set
GLIBC_TUNABLES yourself (an empty value too) to keep it off.
"""

import sys

from jaxkv._src.processes.launcher import HUGETLB_MALLOC as HUGETLB_MALLOC
from jaxkv._src.processes.launcher import Launcher as Launcher
from jaxkv._src.processes.launcher import launch as launch
from jaxkv._src.processes.launcher import main as main
from jaxkv._src.processes.launcher import process_env as process_env

__all__ = ["HUGETLB_MALLOC", "Launcher", "launch", "main", "process_env"]

if __name__ == "__main__":
    sys.exit(main())
