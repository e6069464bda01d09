"""Start a multi-process jaxkv job, on this machine or on several.

    python -m jaxkv.launch -n N [--devices-per-process K] [--max-restarts R] script.py [args...]
    python -m jaxkv.launch --nnodes M --node-rank R --coordinator HOST:PORT -n N ... script.py

The first form starts N copies of ``script.py`` with a coordinator on 127.0.0.1. The second,
run once on each of M hosts (node ranks 0 .. M-1), starts N copies on each; process i of node
R is process R*N + i of the job, and process 0 (on node 0) serves the coordinator at HOST:PORT,
an address of node 0 that every host can reach. Each process joins the job when it imports
jaxkv, so ``jaxkv.create('dist_sync')`` spans every process's devices; gloo binds to the
address on the route toward the coordinator, or to the interface named in JAXKV_IFNAME.

When a process fails, the launcher stops the others and exits with that process's status; with
``--max-restarts R`` it starts the whole job again instead, up to R times, with
JAXKV_RESTART_COUNT (0, 1, ...) in the environment. Each process runs the script as
``python script.py`` would, except that ``sys.exit(n)``, n not 0, in a process of a
multi-process job exits at once (JAX's shutdown would wait for the other processes).
SIGTERM, SIGINT and SIGHUP stop every process it started (SIGTERM, then SIGKILL after a grace
period, to each process's whole process group); the processes also get SIGKILL if the launcher
itself dies.

Unless GLIBC_TUNABLES is already set, the processes start with
GLIBC_TUNABLES=glibc.malloc.hugetlb=1: glibc's malloc then takes transparent huge pages, which
cuts the page faults of XLA's per-run temp buffers on CPU (see docs/distributed.md). Set
GLIBC_TUNABLES yourself (an empty value too) to keep it off.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from ._dist import (
    ENV_COORDINATOR,
    ENV_DEVICES_PER_PROCESS,
    ENV_LOCAL_RANK,
    ENV_NODE_RANK,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    ENV_RESTART_COUNT,
    heartbeat_timeout,
    split_address,
)

logger = logging.getLogger("jaxkv.launch")

#: Set in launched processes unless the user set GLIBC_TUNABLES: huge-page malloc (glibc 2.35+).
HUGETLB_MALLOC = "glibc.malloc.hugetlb=1"

#: The signals that stop the job.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

#: Seconds between SIGTERM and SIGKILL when the launcher stops its processes (a process that
#: joined a JAX job catches SIGTERM, for JAX's preemption notices, and does not exit on it).
GRACE = 2.0


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


#: Run by ``python -S -c`` in each new process before the script: asks the kernel for SIGKILL
#: when the launcher dies (Linux's ``PR_SET_PDEATHSIG``, kept across ``exec``), gives up if the
#: launcher is already gone, then replaces itself with the command line after the launcher's PID,
#: ``python -c _RUN_SCRIPT script.py args...`` (same PID).
#: A ``preexec_fn`` would do it without a second interpreter, but forks from Python, which is
#: not safe in a process where JAX's threads run (``launch()`` called in-process).
_DIE_WITH_PARENT = """\
import ctypes, os, sys
try:
    ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):
    os._exit(1)
os.execv(sys.executable, sys.argv[2:])
"""

#: Run by ``python -c`` in each process (after the shim above) instead of ``python script.py
#: args...``, which it does as Python would (``__main__``, ``sys.argv``, ``sys.path[0]``, the
#: traceback of an uncaught exception), with one difference: a process that joined a JAX job
#: and ends with ``sys.exit(n)`` (or ``raise SystemExit(n)``), n not 0, exits at once with
#: that status, without running its ``atexit`` handlers. JAX's shutdown, an ``atexit``
#: handler, would otherwise wait, up to 5 minutes, for every other process to finish, while
#: they wait for it in their next collective (as for an uncaught exception: ``_dist.py``).
_RUN_SCRIPT = """\
def _jaxkv_run_script():
    import importlib.machinery, io, os, runpy, sys
    globals().pop("_jaxkv_run_script")
    path = os.path.abspath(sys.argv[1])  # as Python makes the __main__ module's __file__
    sys.argv = sys.argv[1:]
    try:
        if os.path.isfile(path):
            sys.path[0] = os.path.dirname(os.path.realpath(path))
            with io.open_code(path) as f:
                code = compile(f.read(), path, "exec", dont_inherit=True)
            loader = importlib.machinery.SourceFileLoader("__main__", path)
            globals().update(__file__=path, __cached__=None, __loader__=loader)
            exec(code, globals())
        else:  # a directory or zip file with __main__.py
            sys.path[0] = path
            runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        jax = sys.modules.get("jax")
        several = int(os.environ.get("JAXKV_NUM_PROCESSES") or 1) > 1
        if e.code in (None, 0) or not several or not getattr(jax, "distributed", None):
            raise
        try:
            joined = jax.distributed.is_initialized()
        except Exception:
            joined = False
        if not joined:
            raise
        status = e.code
        if not isinstance(status, int):
            print(status, file=sys.stderr)
            status = 1
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(status)
    except KeyboardInterrupt:
        raise
    except BaseException as e:
        # As Python reports it: from the script's own frame.
        e = e.with_traceback(e.__traceback__.tb_next)
        sys.excepthook(type(e), e, e.__traceback__)
        sys.exit(1)
_jaxkv_run_script()
"""


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    """``sig`` to ``p``'s process group (each process leads its own), so that whatever it
    started goes too."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, sig)


def _stop(procs: list[subprocess.Popen], grace: float = GRACE) -> None:
    """SIGTERM to every process group, then SIGKILL after ``grace`` seconds."""
    for p in procs:
        if p.poll() is None:
            _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:  # the stragglers, a stopped (SIGSTOP) process, and any children left behind
        _signal_group(p, signal.SIGKILL)
    for p in procs:
        p.wait()


# What signal.signal takes and returns: a function, SIG_DFL or SIG_IGN, or None.
_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class _Signals:
    """Records the first stop signal; installed only in the main thread."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._saved: dict[int, _Handler] = {}

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._saved[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)


class Launcher:
    """One node's share of a job: ``n`` processes, numbered ``node_rank * n + i``."""

    def __init__(
        self,
        n: int,
        script: list[str],
        devices_per_process: int | None = None,
        *,
        nnodes: int = 1,
        node_rank: int = 0,
        coordinator: str | None = None,
        max_restarts: int = 0,
        restart_delay: float | None = None,
    ) -> None:
        """``restart_delay``: seconds to wait before a restart; by default none on one node,
        and JAX's heartbeat timeout plus 5 s on several (see :meth:`run`)."""
        if n < 1:
            raise ValueError(f"-n: expected at least 1 process, given {n}")
        if nnodes < 1 or not 0 <= node_rank < nnodes:
            raise ValueError(f"--node-rank {node_rank} is not in 0 .. {nnodes - 1}")
        if nnodes > 1 and not coordinator:
            raise ValueError(
                "--nnodes above 1 needs --coordinator HOST:PORT (an address of node 0)"
            )
        if coordinator:
            split_address(coordinator)
        if max_restarts < 0:
            raise ValueError(f"--max-restarts: expected 0 or more, given {max_restarts}")
        self.n, self.script, self.devices_per_process = n, script, devices_per_process
        self.nnodes, self.node_rank = nnodes, node_rank
        self.coordinator, self.max_restarts = coordinator, max_restarts
        if restart_delay is None:
            restart_delay = heartbeat_timeout() + 5.0 if nnodes > 1 else 0.0
        self.restart_delay = restart_delay

    def run(self) -> int:
        """Run the job, restarting it up to ``max_restarts`` times; returns its exit status."""
        with _Signals() as signals:
            attempt = 0
            while True:
                code = self._attempt(attempt, signals)
                if code == 0 or signals.received is not None or attempt >= self.max_restarts:
                    return code
                attempt += 1
                logger.warning(
                    "jaxkv.launch: restarting the job (restart %d of %d)",
                    attempt,
                    self.max_restarts,
                )
                # On several nodes, the other nodes' processes end within JAX's heartbeat
                # timeout (their launchers restart too); start again once they have, so that no
                # new process meets the old job's coordinator.
                self._sleep(self.restart_delay, signals)
                if signals.received is not None:
                    return 128 + signals.received

    @staticmethod
    def _sleep(seconds: float, signals: _Signals) -> None:
        deadline = time.monotonic() + seconds
        while signals.received is None and time.monotonic() < deadline:
            time.sleep(0.05)

    def _attempt(self, attempt: int, signals: _Signals) -> int:
        coordinator = self.coordinator or f"127.0.0.1:{_free_port()}"
        total = self.nnodes * self.n
        procs: list[subprocess.Popen] = []
        ranks: list[int] = []
        try:
            for i in range(self.n):
                if signals.received is not None:
                    break
                rank = self.node_rank * self.n + i
                env = process_env()
                env.update(
                    {
                        ENV_COORDINATOR: coordinator,
                        ENV_NUM_PROCESSES: str(total),
                        ENV_PROCESS_ID: str(rank),
                        ENV_LOCAL_RANK: str(i),
                        ENV_NODE_RANK: str(self.node_rank),
                        ENV_RESTART_COUNT: str(attempt),
                    }
                )
                if self.devices_per_process:
                    env[ENV_DEVICES_PER_PROCESS] = str(self.devices_per_process)
                shim = [sys.executable, "-S", "-c", _DIE_WITH_PARENT, str(os.getpid())]
                procs.append(
                    subprocess.Popen(
                        [*shim, sys.executable, "-c", _RUN_SCRIPT, *self.script],
                        env=env,
                        start_new_session=True,
                    )
                )
                ranks.append(rank)
            logger.info(
                "jaxkv.launch: processes %d-%d of %d, coordinator %s%s",
                ranks[0] if ranks else 0,
                ranks[-1] if ranks else 0,
                total,
                coordinator,
                f", restart {attempt}" if attempt else "",
            )
            # (rank, status) in the order the processes exit: the first to fail is the likelier
            # cause of the others' failures (a collective with a process that is gone fails),
            # even when the launcher finds them all gone at once.
            exits: list[tuple[int, int]] = []
            for rank, p in zip(ranks, procs):
                threading.Thread(
                    target=lambda rank=rank, p=p: exits.append((rank, p.wait())), daemon=True
                ).start()
            while signals.received is None:
                failed = [(r, c) for r, c in list(exits) if c != 0]
                if failed:
                    rank, code = failed[0]
                    logger.error(
                        "jaxkv.launch: process %d exited with %d; stopping the others", rank, code
                    )
                    return code if code > 0 else 128 - code
                if len(exits) == len(procs):
                    return 0
                time.sleep(0.05)
            logger.error(
                "jaxkv.launch: %s; stopping every process",
                signal.Signals(signals.received).name,
            )
            return 128 + signals.received
        finally:
            _stop(procs)


def launch(
    n: int,
    script: list[str],
    devices_per_process: int | None = None,
    *,
    nnodes: int = 1,
    node_rank: int = 0,
    coordinator: str | None = None,
    max_restarts: int = 0,
) -> int:
    """Run ``script`` (argv) in ``n`` processes on this node; returns the job's exit status."""
    return Launcher(
        n,
        script,
        devices_per_process,
        nnodes=nnodes,
        node_rank=node_rank,
        coordinator=coordinator,
        max_restarts=max_restarts,
    ).run()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jaxkv.launch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-n", type=int, required=True, help="number of processes on this node")
    parser.add_argument(
        "--devices-per-process",
        type=int,
        default=None,
        help="CPU devices each process simulates (default: JAX's)",
    )
    parser.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's rank (default 0)")
    parser.add_argument(
        "--coordinator",
        default=None,
        help="HOST:PORT of the coordinator on node 0 (default, one node: 127.0.0.1:a free port)",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart the whole job up to this many times when a process fails (default 0)",
    )
    parser.add_argument("script", help="the Python script each process runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        launcher = Launcher(
            args.n,
            [args.script, *args.args],
            args.devices_per_process,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            coordinator=args.coordinator,
            max_restarts=args.max_restarts,
        )
    except ValueError as e:
        parser.error(str(e))
    return launcher.run()


if __name__ == "__main__":
    sys.exit(main())
