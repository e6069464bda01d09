"""``python -m jaxkv.launch`` names the process that stopped responding (SIGSTOP), and for how
long, not the peer that JAX then aborted because that one sent no more heartbeats; the job's
status stays the aborted peer's."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from _jobs import DIST, cpu_env

from jaxkv._src.processes.join import ENV_HEARTBEAT_TIMEOUT

#: JAX's heartbeat timeout in these jobs (seconds): short, yet long enough for a loaded machine.
HEARTBEAT = 10


@pytest.mark.skipif(sys.platform != "linux", reason="the launcher reads /proc")
@pytest.mark.parametrize("stopped", [1, 0])
def test_the_stopped_process_is_named_not_the_peer_that_aborted(stopped):
    """stop_job.py: after a push, rank ``stopped`` SIGSTOPs itself while the other waits for it
    in the next push. After the heartbeat timeout the other aborts (rank 0, the coordination
    service's, declares rank 1 dead; rank 1's heartbeats to a stopped rank 0 go unanswered).
    Before, the launcher said only ``process 0 was killed by SIGABRT`` (or 1)."""
    other = 1 - stopped
    start = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "jaxkv.launch", "-n", "2", "--devices-per-process", "1"]
        + [os.path.join(DIST, "stop_job.py"), str(stopped)],
        env=cpu_env(**{ENV_HEARTBEAT_TIMEOUT: str(HEARTBEAT)}),
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.monotonic() - start
    output = run.stdout + run.stderr
    assert "rank 0 pushed" in run.stdout and "rank 1 pushed" in run.stdout, output
    assert run.returncode == 128 + signal.SIGABRT, output
    summary = re.search(
        rf"^jaxkv.launch: process {stopped} stopped responding \(stopped by SIGSTOP\) for "
        rf"([\d.]+) s; as a result, process {other} was killed by SIGABRT; stopping the others$",
        run.stderr,
        re.MULTILINE,
    )
    assert summary, output
    # JAX declares it dead between half a timeout and a timeout after its last heartbeat.
    assert HEARTBEAT / 4 <= float(summary[1]) <= 2 * HEARTBEAT, output
    assert elapsed < 90, f"{elapsed:.0f} s"  # (a loaded machine starts JAX slowly)
