"""``python -m jaxkv.launch``: starting, watching and stopping a job's processes.

The launcher starts ``-n`` processes on its node, each running the script through runner.py,
and passes their output on through output.py's relay. When one fails, it names the first to
fail, after any that had stopped responding before, or that the others waited for when a
collective timed out (unresponsive.py), and stops the others, or restarts the whole job
(``--max-restarts``); a stop signal stops every process.
docs/distributed.md says how, for users: its "One host" and "Failures, hangs and restarts"
sections. What ``--help`` prints is :data:`USAGE` and :data:`EXAMPLES`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from jaxkv._src.processes import unresponsive
from jaxkv._src.processes.join import (
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
from jaxkv._src.processes.order import EXIT_HUNG
from jaxkv._src.processes.output import Relay

logger = logging.getLogger("jaxkv.launch")

#: Set in launched processes unless the user set GLIBC_TUNABLES: huge-page malloc (glibc 2.35+).
HUGETLB_MALLOC = "glibc.malloc.hugetlb=1"

#: The signals that stop the job.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

#: Seconds between SIGTERM and SIGKILL when the launcher stops its processes (a process that
#: joined a JAX job catches SIGTERM, for JAX's preemption notices, and does not exit on it).
GRACE = 2.0

#: Seconds the launcher goes on watching after the first failure, for the other processes'
#: statuses, before it names the first to fail and stops the rest (a collective that waited for
#: a failed process fails within milliseconds). A process that is still exiting then, or has
#: noted its failure, gets up to :data:`GRACE` seconds more.
SETTLE = 1.0

#: ``PF_EXITING`` in the flags of ``/proc/PID/stat`` (Linux): the process has begun to exit.
_PF_EXITING = 0x4


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
#: ``python runner.py script.py args...`` (same PID).
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

#: The program each process runs: the script, as ``python script.py`` would (runner.py).
RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "runner.py")


def _write_atomically(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


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


def _ending(pid: int) -> bool:
    """Whether process ``pid`` (not yet reaped) has begun to exit; False where ``/proc`` cannot
    tell."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0] in ("Z", "X") or bool(int(fields[6]) & _PF_EXITING)
    except (OSError, IndexError, ValueError):
        return False


def _read_notes(directory: str) -> dict[int, tuple[float, frozenset[int]]]:
    """The failure notes in ``directory`` (see runner.py): rank -> (the time it
    failed, the ranks that had begun to exit before)."""
    notes = {}
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            if not name.startswith("failed-") or name.endswith(".tmp"):
                continue
            with contextlib.suppress(OSError, ValueError):
                with open(os.path.join(directory, name)) as f:
                    when, *ending = f.read().split()
                notes[int(name[len("failed-") :])] = (float(when), frozenset(map(int, ending)))
    return notes


def _order_failures(
    ended: dict[int, tuple[int, float]], notes: dict[int, tuple[float, frozenset[int]]]
) -> list[tuple[int, int]]:
    """The processes that failed, as ``(rank, status)``, the first to fail first.

    Args:
      ended: rank -> (exit status, ``time.monotonic()`` when the launcher saw it end).
      notes: rank -> (when it noted its failure, the ranks that had begun to exit before), for
        the processes that failed in Python (see runner.py).

    The first is the earliest (noted, else seen) of the failures that came after no other
    failure; the rest follow in the order they failed.

    Examples:
      Rank 0 saw rank 1 exiting when its collective failed, and the launcher saw rank 0 end
      first:

      >>> _order_failures({0: (1, 10.0), 1: (-9, 10.002)}, {0: (9.99, frozenset({1}))})
      [(1, -9), (0, 1)]
    """
    failed = {rank for rank, (status, _) in ended.items() if status != 0}

    def when(rank: int) -> float:
        seen = ended[rank][1]
        return min(notes[rank][0], seen) if rank in notes else seen

    def after_another(rank: int) -> bool:
        return rank in notes and bool(notes[rank][1] & failed)

    order = sorted(failed, key=lambda rank: (when(rank), rank))
    if order:  # no cycle: a process noted its peers as exiting while it was not
        first = next((rank for rank in order if not after_another(rank)), order[0])
        order.remove(first)
        order.insert(0, first)
    return [(rank, ended[rank][0]) for rank in order]


def _describe(rank: int, status: int) -> str:
    """``process 1 exited with 3``, ``process 1 was killed by SIGKILL``."""
    if status >= 0:
        return f"process {rank} exited with {status}"
    try:
        name = signal.Signals(-status).name
    except ValueError:
        name = f"signal {-status}"
    return f"process {rank} was killed by {name}"


class _Exits:
    """The processes' statuses, each with the ``time.monotonic()`` at which the launcher saw
    it end, as they end.

    On Linux one ``poll`` waits on a pidfd per process, so each exit is timed as soon as the
    kernel reports it; without ``os.pidfd_open`` a thread per process waits for it (and a
    thread woken late can time two exits close together in the wrong order).
    """

    def __init__(self, ranks: list[int], procs: list[subprocess.Popen]) -> None:
        self.ended: dict[int, tuple[int, float]] = {}
        self._fds: dict[int, tuple[int, subprocess.Popen]] = {}
        self._changed = threading.Event()
        self._poll: select.poll | None = None
        try:
            self._poll = select.poll()
            for rank, p in zip(ranks, procs):
                fd = os.pidfd_open(p.pid)
                self._fds[fd] = (rank, p)
                self._poll.register(fd, select.POLLIN)
        except (AttributeError, OSError):  # not Linux, or before 5.3
            self.close()
            self._poll = None
            for rank, p in zip(ranks, procs):
                threading.Thread(target=self._wait_for, args=(rank, p), daemon=True).start()

    def _wait_for(self, rank: int, p: subprocess.Popen) -> None:
        status = p.wait()
        self.ended[rank] = (status, time.monotonic())
        self._changed.set()

    def wait(self, timeout: float) -> dict[int, tuple[int, float]]:
        """Waits up to ``timeout`` seconds for a process to end; returns :attr:`ended`."""
        if self._poll is None:
            self._changed.wait(timeout)
            self._changed.clear()
        else:
            ready = self._poll.poll(timeout * 1000)
            now = time.monotonic()
            for fd, _ in ready:
                rank, p = self._fds.pop(fd)
                self._poll.unregister(fd)
                os.close(fd)
                self.ended[rank] = (p.wait(), now)
        return dict(self.ended)

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()


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
        prefix: bool = True,
        verbose: bool = False,
    ) -> None:
        """``restart_delay``: seconds to wait before a restart; by default none on one node,
        and JAX's heartbeat timeout plus 5 s on several (see :meth:`run`). ``prefix`` and
        ``verbose``: as ``--no-prefix`` (False) and ``--verbose`` (see :class:`.output.Relay`)."""
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
        self.prefix, self.verbose = prefix, verbose

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
        try:  # where the processes note their failures (see runner.py)
            notes = tempfile.mkdtemp(prefix="jaxkv-launch-")
        except OSError:
            notes = ""
        # Output as it is, to the launcher's own stdout and stderr, only when nothing is to be
        # prefixed or dropped.
        reports = unresponsive.HeartbeatReports()  # what the processes' stderr says of silent peers
        relay = Relay(self.prefix, gloo_lines=self.verbose, on_error_line=reports.feed)
        piped = self.prefix or not self.verbose
        pipe = subprocess.PIPE if piped else None
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
                if notes:
                    env["JAXKV_LAUNCH_NOTES"] = notes
                if piped:  # each print reaches the pipe at once, not at exit
                    env.setdefault("PYTHONUNBUFFERED", "1")
                shim = [sys.executable, "-S", "-c", _DIE_WITH_PARENT, str(os.getpid())]
                p = subprocess.Popen(
                    [*shim, sys.executable, RUNNER, *self.script],
                    env=env,
                    start_new_session=True,
                    stdout=pipe,
                    stderr=pipe,
                )
                procs.append(p)
                ranks.append(rank)
                relay.watch(rank, p.stdout, p.stderr)
                logger.debug("jaxkv.launch: process %d is PID %d", rank, p.pid)
            relay.start()
            logger.info(
                "jaxkv.launch: processes %d-%d of %d, coordinator %s%s",
                ranks[0] if ranks else 0,
                ranks[-1] if ranks else 0,
                total,
                coordinator,
                f", restart {attempt}" if attempt else "",
            )
            if notes:
                _write_atomically(
                    os.path.join(notes, "pids"),
                    "".join(f"{rank} {p.pid}\n" for rank, p in zip(ranks, procs)),
                )
            return self._watch(ranks, procs, notes, signals, reports)
        finally:
            _stop(procs)
            relay.close()
            if notes:
                shutil.rmtree(notes, ignore_errors=True)

    @staticmethod
    def _watch(
        ranks: list[int],
        procs: list[subprocess.Popen],
        notes: str,
        signals: _Signals,
        reports: unresponsive.HeartbeatReports | None = None,
    ) -> int:
        """Waits for the processes to end, or for a failure or a stop signal; returns the status
        of the attempt. Until the first failure, it looks at the processes' states every
        :data:`.unresponsive.LOOK_EVERY` seconds, to name one that stopped responding, with
        ``reports`` (what the processes logged of their peers, and of their own collectives:
        when the first to fail timed out in one, those that were not waiting are named)."""
        exits = _Exits(ranks, procs)
        ended: dict[int, tuple[int, float]] = {}
        failed_at: float | None = None  # when the launcher saw the first failure
        stops, looked = unresponsive.Stops(), -unresponsive.LOOK_EVERY
        try:
            while signals.received is None:
                ended = exits.wait(0.05)
                if len(ended) == len(procs):
                    break
                if failed_at is None:
                    now = time.monotonic()
                    if any(status for status, _ in ended.values()):
                        failed_at = now
                    elif now - looked >= unresponsive.LOOK_EVERY:
                        looked = now
                        for rank, p in zip(ranks, procs):
                            if rank not in ended:
                                stops.look(rank, p.pid, now)
                    continue
                # After SETTLE, only for a process that is ending or has noted its failure.
                waited = time.monotonic() - failed_at
                if waited >= SETTLE + GRACE or (
                    waited >= SETTLE
                    and not any(
                        _ending(p.pid) or (notes and os.path.exists(f"{notes}/failed-{rank}"))
                        for rank, p in zip(ranks, procs)
                        if rank not in ended
                    )
                ):
                    break
        finally:
            exits.close()
        if signals.received is not None:
            logger.error(
                "jaxkv.launch: %s; stopping every process",
                signal.Signals(signals.received).name,
            )
            return 128 + signals.received
        failures = _order_failures(ended, _read_notes(notes) if notes else {})
        if not failures:
            return 0
        (rank, code), after = failures[0], failures[1:]
        first = _describe(rank, code)
        then = f" (after it, {', '.join(_describe(*f) for f in after)})" if after else ""
        missing = reports.missing() if reports is not None else {}
        at = time.monotonic() if failed_at is None else failed_at
        cause = unresponsive.silent(
            stops.seen, missing, set(ended), at, unresponsive.least_silence()
        )
        if not cause and code == EXIT_HUNG and reports is not None:
            cause = _behind(rank, ranks, procs, ended, reports, stops)
        if cause:  # the first to fail failed because these had stopped responding
            first = f"{', '.join(cause)}; as a result, {first}"
        logger.error("jaxkv.launch: %s; stopping the others%s", first, then)
        return code if code > 0 else 128 - code


def _behind(
    first: int,
    ranks: list[int],
    procs: list[subprocess.Popen],
    ended: dict[int, tuple[int, float]],
    reports: unresponsive.HeartbeatReports,
    stops: unresponsive.Stops,
) -> list[str]:
    """Process ``first``'s collective timed out: the processes the others waited for, described
    (see unresponsive.py), or none.

    They are the processes that had not said that a collective of theirs was waiting (nor were
    stopped, nor had ended with 0), provided that ``first``'s own word that it was waiting was
    read (its output relayed, jaxkv's warnings not filtered out)."""
    waiting = reports.waiting()
    if first not in waiting:
        return []
    seen = ended[first][1]
    behind = [
        rank
        for rank, p in zip(ranks, procs)
        if rank not in waiting
        and rank not in stops.seen
        and (
            ended[rank][0] != 0 and ended[rank][1] >= seen  # ended as a result (SIGABRT)
            if rank in ended
            else unresponsive.stopped_by(p.pid) is None
        )
    ]
    if not behind:
        return []
    return [unresponsive.behind(behind, first, reports.timed_out().get(first))]


#: ``--help``'s description.
USAGE = """\
Start a multi-process jaxkv job: N copies of a Python script, on this machine, or on each of
several machines. In the script, jaxkv.create("dist_sync") spans every process's devices and
kv.rank says which process it is.

Each line a process prints is passed on with its rank in front ("[1] loss 0.25"). When a process
fails, the launcher stops the others and exits with that process's status, naming it; Ctrl-C
stops every process."""

#: ``--help``'s closing lines.
EXAMPLES = """\
examples:
  one machine, 2 processes of 4 simulated CPU devices each:
    python -m jaxkv.launch -n 2 --devices-per-process 4 train.py --lr 0.1

  two machines, 4 processes each: on machine 0 (10.0.0.1, an address the other reaches),
    python -m jaxkv.launch --nnodes 2 --node-rank 0 --coordinator 10.0.0.1:29500 -n 4 train.py
  and on machine 1 the same with --node-rank 1.

  start the job again, up to 3 times, when a process fails (train.py resumes from its
  checkpoints):
    python -m jaxkv.launch -n 2 --max-restarts 3 train.py ckpt/

  each process's output as it is, for a program that reads it:
    python -m jaxkv.launch -n 2 --no-prefix train.py > out.txt

The guide to processes (docs/distributed.md) has SLURM, restarts, the environment variables
and how the launcher names the process that failed first."""


def launch(
    n: int,
    script: list[str],
    devices_per_process: int | None = None,
    *,
    nnodes: int = 1,
    node_rank: int = 0,
    coordinator: str | None = None,
    max_restarts: int = 0,
    prefix: bool = True,
    verbose: bool = False,
) -> int:
    """Run ``script`` (argv) in ``n`` processes on this node; returns the job's exit status.

    The arguments are ``python -m jaxkv.launch``'s options (``prefix=False`` is
    ``--no-prefix``); the processes' output goes to this process's ``sys.stdout`` and
    ``sys.stderr``."""
    return Launcher(
        n,
        script,
        devices_per_process,
        nnodes=nnodes,
        node_rank=node_rank,
        coordinator=coordinator,
        max_restarts=max_restarts,
        prefix=prefix,
        verbose=verbose,
    ).run()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jaxkv.launch",
        description=USAGE,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-n", type=int, required=True, help="number of processes on this node")
    parser.add_argument(
        "--devices-per-process",
        type=int,
        default=None,
        metavar="K",
        help="CPU devices each process simulates (default: JAX's)",
    )
    parser.add_argument(
        "--nnodes", type=int, default=1, metavar="M", help="number of machines (default 1)"
    )
    parser.add_argument(
        "--node-rank",
        type=int,
        default=0,
        metavar="R",
        help="this machine's rank, 0 .. M-1 (default 0)",
    )
    parser.add_argument(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help="an address of machine 0 and a free port there (default, one machine: "
        "127.0.0.1 and a free port)",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="TIMES",
        help="start the whole job again up to TIMES times when a process fails (default 0)",
    )
    parser.add_argument(
        "--no-prefix",
        action="store_true",
        help="pass each process's output on as it is, without the [rank] in front",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="keep gloo's connection lines ([Gloo] Rank N is connected ...) and log each "
        "process's PID",
    )
    parser.add_argument("script", help="the Python script each process runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.verbose:  # the launcher's own debug lines, not every library's
        logger.setLevel(logging.DEBUG)
    try:
        launcher = Launcher(
            args.n,
            [args.script, *args.args],
            args.devices_per_process,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            coordinator=args.coordinator,
            max_restarts=args.max_restarts,
            prefix=not args.no_prefix,
            verbose=args.verbose,
        )
    except ValueError as e:
        parser.error(str(e))
    return launcher.run()


if __name__ == "__main__":
    sys.exit(main())
