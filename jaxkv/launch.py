"""Start a multi-process jaxkv job on this machine.

    python -m jaxkv.launch -n N [--devices-per-process K] script.py [args...]

Starts N copies of ``script.py`` with a coordinator on 127.0.0.1; each joins the job when it
imports jaxkv, so ``jaxkv.create('dist_sync')`` spans the N x K devices. When a process fails,
the launcher stops the others and exits with that process's status.

Unless GLIBC_TUNABLES is already set, the processes start with
GLIBC_TUNABLES=glibc.malloc.hugetlb=1: glibc's malloc then takes transparent huge pages, which
cuts the page faults of XLA's per-run temp buffers on CPU (see docs/distributed.md). Set
GLIBC_TUNABLES yourself (an empty value too) to keep it off.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import time

from ._dist import (
    ENV_COORDINATOR,
    ENV_DEVICES_PER_PROCESS,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
)

logger = logging.getLogger("jaxkv.launch")

#: Set in launched processes unless the user set GLIBC_TUNABLES: huge-page malloc (glibc 2.35+).
HUGETLB_MALLOC = "glibc.malloc.hugetlb=1"


def process_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of ``env`` (default: ``os.environ``) with GLIBC_TUNABLES set to
    :data:`HUGETLB_MALLOC` when it is not set at all; a value the user set is kept as it is."""
    env = dict(os.environ if env is None else env)
    env.setdefault("GLIBC_TUNABLES", HUGETLB_MALLOC)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(procs: list[subprocess.Popen], grace: float = 2.0) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds (JAX's preemption notifier catches
    SIGTERM in a process that joined a job)."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def launch(n: int, script: list[str], devices_per_process: int | None = None) -> int:
    """Run ``script`` (argv) in ``n`` processes; returns the job's exit status."""
    coordinator = f"127.0.0.1:{_free_port()}"
    procs = []
    for i in range(n):
        env = process_env()
        env.update(
            {ENV_COORDINATOR: coordinator, ENV_NUM_PROCESSES: str(n), ENV_PROCESS_ID: str(i)}
        )
        if devices_per_process:
            env[ENV_DEVICES_PER_PROCESS] = str(devices_per_process)
        procs.append(subprocess.Popen([sys.executable, *script], env=env))
    logger.info("jaxkv.launch: %d processes, coordinator %s", n, coordinator)
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                logger.error(
                    "jaxkv.launch: process %d exited with %d; stopping the others", rank, code
                )
                _stop(procs)
                return code if code > 0 else 128 - code
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.05)
    except KeyboardInterrupt:
        _stop(procs)
        return 130


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxkv.launch", description=__doc__)
    parser.add_argument("-n", type=int, required=True, help="number of processes")
    parser.add_argument(
        "--devices-per-process",
        type=int,
        default=None,
        help="CPU devices each process simulates (default: JAX's)",
    )
    parser.add_argument("script", help="the Python script each process runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    args = parser.parse_args(argv)
    if args.n < 1:
        parser.error(f"-n: expected at least 1 process, given {args.n}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return launch(args.n, [args.script, *args.args], args.devices_per_process)


if __name__ == "__main__":
    sys.exit(main())
