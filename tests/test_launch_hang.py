"""``python -m jaxkv.launch`` names the process that stopped responding (SIGSTOP), and for how
long, not the peer that JAX then aborted because that one sent no more heartbeats; and the
process that hung (alive, heartbeating), not the peer whose collective then timed out. The job's
status stays the peer's."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from _jobs import DIST, cpu_env

from jaxkv._src.processes.join import ENV_HEARTBEAT_TIMEOUT
from jaxkv._src.processes.order import ENV_COLLECTIVE_TIMEOUT, EXIT_HUNG


def _stop_job(args, timeout_name, timeout):
    """stop_job.py with ``args`` under the launcher, ``timeout_name`` set to ``timeout``
    seconds: the finished run and its whole output, once both ranks have pushed once, and
    within 90 s (a loaded machine starts JAX slowly)."""
    start = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "jaxkv.launch", "-n", "2", "--devices-per-process", "1"]
        + [os.path.join(DIST, "stop_job.py"), *args],
        env=cpu_env(**{timeout_name: str(timeout)}),
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.monotonic() - start
    output = run.stdout + run.stderr
    assert "rank 0 pushed" in run.stdout and "rank 1 pushed" in run.stdout, output
    assert elapsed < 90, f"{elapsed:.0f} s"
    return run, output


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
    run, output = _stop_job([str(stopped)], ENV_HEARTBEAT_TIMEOUT, HEARTBEAT)
    # (JAX's coordination client aborts the peer; JAX 0.8.1's exits with 1 instead)
    assert run.returncode in (128 + signal.SIGABRT, 1), output
    summary = re.search(
        rf"^jaxkv.launch: process {stopped} stopped responding \(stopped by SIGSTOP\) for "
        rf"([\d.]+) s; as a result, process {other} (was killed by SIGABRT|exited with 1); "
        "stopping the others$",
        run.stderr,
        re.MULTILINE,
    )
    assert summary, output
    # JAX declares it dead between half a timeout and a timeout after its last heartbeat.
    assert HEARTBEAT / 4 <= float(summary[1]) <= 2 * HEARTBEAT, output


#: The collective timeout in the hung job (seconds): short, yet long enough for a loaded machine.
COLLECTIVE = 8


@pytest.mark.skipif(sys.platform != "linux", reason="the launcher reads /proc")
def test_the_hung_process_is_named_not_the_peer_whose_collective_timed_out():
    """stop_job.py 1 hang: after a push, rank 1 sleeps (alive, heartbeating) while rank 0 waits
    for it in the next push. Rank 0 says so at half the collective timeout and exits with 124 at
    the timeout, which ends rank 1 too (SIGABRT: rank 0 served the coordination service). Before,
    the launcher said only ``process 0 exited with 124``."""
    run, output = _stop_job(["1", "hang"], ENV_COLLECTIVE_TIMEOUT, COLLECTIVE)
    assert run.returncode == EXIT_HUNG, output
    summary = re.search(
        r"^jaxkv.launch: process 1 did not reach the (.+) that process 0 waited (\d+) s for: it "
        r"is hung or far behind; as a result, process 0 exited with 124; stopping the others"
        r"( \(after it, process 1 (was killed by SIGABRT|exited with 1)\))?$",
        run.stderr,
        re.MULTILINE,
    )
    assert summary, output
    assert COLLECTIVE <= int(summary[2]) <= 2 * COLLECTIVE, output
