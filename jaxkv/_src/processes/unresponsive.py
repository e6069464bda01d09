"""Which of a job's processes stopped responding, and for how long: the cause the launcher names
when the others then fail.

A process that stops (SIGSTOP, a debugger, a frozen machine) does not fail itself: it stops
sending heartbeats, and after JAX's heartbeat timeout the *others* end, aborted by JAX (SIGABRT,
"Terminating process because the JAX distributed service detected fatal errors"), or a
collective of theirs times out (status 124, ``order.py``). Naming the first process to fail
would name one of them. So the launcher (launcher.py) keeps two records:

- :class:`Stops`, what it sees itself: each of its processes' state (``/proc/PID/stat``: ``T``,
  stopped; ``t``, stopped by a debugger), and, for its own children, the signal that stopped
  them (``waitid``), looked at every :data:`LOOK_EVERY` seconds;
- :class:`HeartbeatReports`, what the processes' logs say: JAX's coordination service, which runs
  in process 0, lists the tasks that stopped sending heartbeats (:data:`UNHEALTHY`) before it
  ends the job; a process whose heartbeats to the service go unanswered logs the failed
  heartbeat call (:data:`HEARTBEAT_CALL`, after a ``DEADLINE_EXCEEDED`` or ``UNAVAILABLE``
  error): process 0 stopped answering. This covers processes on
  other hosts, whose state the launcher cannot see.

:func:`silent` then says which processes to name as the cause.

A process that is alive and heartbeating but never reaches the next collective (a deadlock, an
endless loop) does not stop: its peers' collectives time out instead (status 124, ``order.py``),
and when process 0 is one of them, its exit ends every other process, the hung one included
(SIGABRT: the coordination service is gone). So the processes say it themselves: one whose
collective has waited half the timeout logs so (``order.WAITING``, and ``order.FINISHED`` once
it finishes). :class:`HeartbeatReports` reads that too, and when the first failure is a
time-out, the launcher names with :func:`behind` the processes that had not said they were
waiting (nor were stopped): the others were waiting for them.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading

from jaxkv._src.processes.join import heartbeat_timeout
from jaxkv._src.processes.order import FINISHED, TIMED_OUT, WAITING, collective_timeout

#: Seconds between two looks at the processes' states.
LOOK_EVERY = 0.5

#: What JAX's coordination service logs, in process 0, before it ends the job, followed by the
#: silent tasks one a line: ``1`` (jaxlib 0.10), ``/job:jax_worker/replica:0/task:1`` (older).
UNHEALTHY = b"The following tasks are unhealthy (stopped sending heartbeats):"

#: One task of that list, by its number.
_TASK = re.compile(rb"\s*(?:/job:[^/\s]+/replica:\d+/task:)?(\d+)\s*")

#: Older coordination services name each silent task in a line of its own.
_TIMED_OUT = re.compile(rb"task:(\d+) heartbeat timeout")

#: The end of the error a process logs when its heartbeats to the coordination service (in
#: process 0) went unanswered: ``RPC: /xla.coordination.CoordinationService/Heartbeat`` (jaxlib
#: 0.10), ``/tensorflow.CoordinationService/Heartbeat`` (older).
HEARTBEAT_CALL = re.compile(rb"RPC: /[\w.]*CoordinationService/Heartbeat\b")

#: The error (``absl::Status: CODE: ...``) logged before it, when the service did not answer.
_STATUS = re.compile(rb"absl::Status: ([A-Z_]+):")
_UNANSWERED = (b"DEADLINE_EXCEEDED", b"UNAVAILABLE")

#: The process that serves JAX's coordination service.
COORDINATOR = 0


def stopped_by(pid: int) -> str | None:
    """How process ``pid`` is stopped (``'stopped by SIGSTOP'``, ``'stopped by a debugger'``,
    ``'stopped'``), or ``None`` when it is not, or when neither ``waitid`` (a child of this
    process) nor ``/proc`` can tell."""
    with contextlib.suppress(OSError, AttributeError):  # not a child, or no waitid
        flags = os.WSTOPPED | os.WNOHANG | os.WNOWAIT  # WNOWAIT: the stop stays to be seen
        seen = os.waitid(os.P_PID, pid, flags)
        if seen is not None and seen.si_code == os.CLD_STOPPED:
            try:
                return f"stopped by {signal.Signals(seen.si_status).name}"
            except ValueError:
                return f"stopped by signal {seen.si_status}"
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
    return {"T": "stopped", "t": "stopped by a debugger"}.get(state)


class Stops:
    """The processes seen stopped: rank -> (when first seen so, how), as the launcher looks.

    A process seen running again is forgotten: only a stop that lasts counts.
    """

    def __init__(self) -> None:
        self.seen: dict[int, tuple[float, str]] = {}

    def look(self, rank: int, pid: int, now: float) -> None:
        """Look at process ``rank`` (``pid``) at ``time.monotonic()`` ``now``."""
        how = stopped_by(pid)
        if how is None:
            self.seen.pop(rank, None)
        elif rank not in self.seen:
            self.seen[rank] = (now, how)


class HeartbeatReports:
    """The processes that JAX's coordination service, or a peer's failed heartbeat, reported
    silent, and those that said a collective of theirs was waiting or timed out, from the lines
    the processes print on stderr (fed from the relay's thread).

    Examples:
      What process 0 logs when process 1 stopped sending heartbeats:

      >>> reports = HeartbeatReports()
      >>> for line in [b"E1202 ... UNAVAILABLE: " + UNHEALTHY, b"1", b"The tasks have crashed."]:
      ...     reports.feed(0, line)
      >>> reports.missing()
      {1: 0}

    And, from what order.py logs, the processes waiting in a collective, and those whose
    collective timed out:

      >>> reports.feed(0, b"jaxkv: process 0: a push has waited 4 s, half of ...")
      >>> reports.feed(2, b"jaxkv: process 2: a push has waited 4 s, half of ...")
      >>> reports.feed(2, b"jaxkv: process 2: a push finished after 5 s")
      >>> reports.feed(0, b"jaxkv: process 0: a push has waited 9 s for the other processes")
      >>> reports.waiting(), reports.timed_out()
      ({0}, {0: ('push', 9)})
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._missing: dict[int, int] = {}  # silent rank -> the rank that reported it
        self._listing: set[int] = set()  # ranks whose last line was in a list of tasks
        self._status: dict[int, bytes] = {}  # rank -> the code of the last error it logged
        self._waiting: set[int] = set()  # the ranks waiting in a collective, as they said
        self._timed_out: dict[int, tuple[str, int]] = {}  # rank -> (its collective, seconds)

    def feed(self, rank: int, line: bytes) -> None:
        """One whole line that process ``rank`` printed on stderr."""
        named: list[bytes] = []  # the silent ranks this line names
        if rank in self._listing:
            listed = _TASK.fullmatch(line)
            if listed:
                named.append(listed[1])
            else:
                self._listing.discard(rank)
        start = line.find(UNHEALTHY)
        if start >= 0:
            self._listing.add(rank)
            named += re.findall(rb"task:(\d+)", line[start + len(UNHEALTHY) :])
        named += _TIMED_OUT.findall(line)
        status = _STATUS.search(line)
        if status:
            self._status[rank] = status[1]
        if (
            HEARTBEAT_CALL.search(line)
            and rank != COORDINATOR
            and self._status.get(rank) in _UNANSWERED
        ):
            named.append(str(COORDINATOR).encode())
        timed_out = TIMED_OUT.search(line)
        with self._lock:
            for silent_rank in named:
                self._missing.setdefault(int(silent_rank), rank)
            if WAITING.search(line):
                self._waiting.add(rank)
            elif FINISHED.search(line):
                self._waiting.discard(rank)
            if timed_out:
                what = timed_out[1].decode(errors="replace")
                self._timed_out.setdefault(rank, (what, int(timed_out[2])))

    def missing(self) -> dict[int, int]:
        """Silent rank -> the rank that reported it, each as first reported."""
        with self._lock:
            return dict(self._missing)

    def waiting(self) -> set[int]:
        """The ranks that said a collective of theirs had waited half its timeout, and have not
        said since that it finished."""
        with self._lock:
            return set(self._waiting)

    def timed_out(self) -> dict[int, tuple[str, int]]:
        """Rank -> (what collective of it timed out, the seconds it had waited), as logged."""
        with self._lock:
            return dict(self._timed_out)


def least_silence() -> float:
    """Seconds a process must have been stopped for, when another fails, to be named as the
    cause: a quarter of the shorter of JAX's heartbeat timeout and the collective timeout (their
    values in this environment, which the launched processes inherit).

    JAX sends a heartbeat twice per timeout, so a stopped process is declared dead at least half
    a timeout after it stopped; the launcher may see the stop up to :data:`LOOK_EVERY` seconds
    (more on a loaded machine) late, hence a quarter. A shorter stop (a debugger's pause) did not
    end the job."""
    timeouts = [float(heartbeat_timeout())]
    if collective_timeout() > 0:
        timeouts.append(collective_timeout())
    return min(timeouts) / 4


def _seconds(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"


def silent(
    stops: dict[int, tuple[float, str]],
    missing: dict[int, int],
    ended: set[int],
    failed_at: float,
    least: float,
) -> list[str]:
    """The processes to name as having stopped responding before the first failure, described,
    in rank order.

    Args:
      stops: rank -> (when the launcher first saw it stopped, how): :attr:`Stops.seen`.
      missing: rank -> the rank that reported it silent: :meth:`HeartbeatReports.missing`.
      ended: the ranks that ended (their own failure is named as it is).
      failed_at: ``time.monotonic()`` when the launcher saw the first failure.
      least: :func:`least_silence`.

    A process still running is named when it had been stopped for at least ``least`` seconds
    when the first failure came, or when a peer reported it silent.

    Examples:
      >>> silent({1: (2.0, "stopped by SIGSTOP")}, {1: 0}, {0}, 12.0, 5.0)
      ['process 1 stopped responding (stopped by SIGSTOP) for 10 s']
      >>> silent({}, {1: 0}, {0}, 12.0, 5.0)
      ["process 1 stopped responding (no heartbeats, said JAX's coordination service in process 0)"]
    """
    described = []
    for rank in sorted(set(stops) | set(missing)):
        if rank in ended:
            continue
        since, how = stops.get(rank, (failed_at, ""))
        if since > failed_at:  # stopped after the failure
            how = ""
        if how and (failed_at - since >= least or rank in missing):
            described.append(
                f"process {rank} stopped responding ({how}) for {_seconds(failed_at - since)}"
            )
        elif rank in missing:
            by = missing[rank]
            if rank == COORDINATOR and by != COORDINATOR:
                said = f"process {by}'s heartbeats to it went unanswered"
            else:
                said = f"no heartbeats, said JAX's coordination service in process {by}"
            described.append(f"process {rank} stopped responding ({said})")
    return described


def behind(ranks: list[int], first: int, waited: tuple[str, int] | None) -> str:
    """The processes ``ranks`` described as the cause of process ``first``'s timed-out
    collective.

    Args:
      ranks: the processes that had not said they were waiting in a collective
        (:meth:`HeartbeatReports.waiting`), nor were stopped, when ``first`` timed out.
      first: the rank whose collective timed out first.
      waited: what collective of ``first`` timed out, and after how many seconds
        (:meth:`HeartbeatReports.timed_out`), or ``None`` where its log was not read.

    Examples:
      >>> behind([1], 0, ("push", 20))
      'process 1 did not reach the push that process 0 waited 20 s for: it is hung or far behind'
      >>> behind([1, 3], 2, None)
      'processes 1, 3 did not reach the collective that process 2 waited for: hung or far behind'
    """
    one = len(ranks) == 1
    who = f"process {ranks[0]}" if one else f"processes {', '.join(map(str, ranks))}"
    what, seconds = (waited[0], f" {waited[1]} s") if waited else ("collective", "")
    return (
        f"{who} did not reach the {what} that process {first} waited{seconds} for: "
        f"{'it is ' if one else ''}hung or far behind"
    )
