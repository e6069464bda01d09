"""jaxkv/_src/processes/unresponsive.py: how a stopped process is told (its own child's stop
signal, else /proc), the record of stops as the launcher looks, the reports of silent processes
read from JAX's log lines, the least stop that counts, and which processes the launcher names as
having stopped responding (no job is started here)."""

import os
import signal
import subprocess
import sys
import time

import pytest

from jaxkv._src.processes import join, order, unresponsive
from jaxkv._src.processes.unresponsive import UNHEALTHY, HeartbeatReports, silent


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in (join.ENV_HEARTBEAT_TIMEOUT, order.ENV_COLLECTIVE_TIMEOUT):
        monkeypatch.delenv(name, raising=False)


# ---- a stopped process ----


@pytest.mark.skipif(sys.platform != "linux", reason="/proc and waitid's CLD_STOPPED")
def test_a_child_stopped_by_sigstop_is_told_with_its_signal_and_forgotten_when_continued():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert unresponsive.stopped_by(child.pid) is None  # running (asleep)
        os.kill(child.pid, signal.SIGSTOP)
        for _ in range(200):
            if unresponsive.stopped_by(child.pid) is not None:
                break
            time.sleep(0.01)
        assert unresponsive.stopped_by(child.pid) == "stopped by SIGSTOP"
        assert unresponsive.stopped_by(child.pid) == "stopped by SIGSTOP"  # still to be seen
        os.kill(child.pid, signal.SIGCONT)
        for _ in range(200):
            if unresponsive.stopped_by(child.pid) is None:
                break
            time.sleep(0.01)
        assert unresponsive.stopped_by(child.pid) is None
    finally:
        child.kill()
    assert child.wait() == -signal.SIGKILL  # the looks reaped nothing


def _stat(pid, state):
    # /proc/PID/stat: pid (comm) state ppid ..., the command a name that fools split(")")
    return f"{pid} (a) T 1 (b) {state} 1 {pid} {pid} 0 -1 4194560 120 0 3 0"


@pytest.mark.parametrize(
    "state, how",
    [("T", "stopped"), ("t", "stopped by a debugger"), ("S", None), ("R", None), ("Z", None)],
)
def test_another_process_is_told_stopped_by_proc(monkeypatch, tmp_path, state, how):
    stat = tmp_path / "stat"
    stat.write_text(_stat(4321, state))
    paths = []

    def fake_open(path):
        paths.append(path)
        return stat.open()

    def not_a_child(*args):
        raise ChildProcessError(10, "No child processes")

    monkeypatch.setattr(unresponsive.os, "waitid", not_a_child)
    monkeypatch.setattr(unresponsive, "open", fake_open, raising=False)
    assert unresponsive.stopped_by(4321) == how
    assert paths == ["/proc/4321/stat"]


def test_a_process_proc_cannot_tell_about_is_not_stopped(monkeypatch, tmp_path):
    def not_a_child(*args):
        raise ChildProcessError(10, "No child processes")

    monkeypatch.setattr(unresponsive.os, "waitid", not_a_child)
    short = tmp_path / "stat"
    short.write_text("1 (py)")
    monkeypatch.setattr(unresponsive, "open", lambda path: short.open(), raising=False)
    assert unresponsive.stopped_by(1) is None  # no state
    monkeypatch.setattr(
        unresponsive, "open", lambda path: (tmp_path / "gone").open(), raising=False
    )
    assert unresponsive.stopped_by(1) is None  # no such process


def test_stops_are_timed_from_the_first_look_that_saw_them_until_seen_running(monkeypatch):
    states = {}
    monkeypatch.setattr(unresponsive, "stopped_by", lambda pid: states.get(pid))
    stops = unresponsive.Stops()
    stops.look(0, 100, 1.0)
    states[101] = "stopped by SIGSTOP"
    stops.look(1, 101, 1.5)
    stops.look(1, 101, 2.0)
    assert stops.seen == {1: (1.5, "stopped by SIGSTOP")}
    states.pop(101)  # continued
    stops.look(1, 101, 2.5)
    assert stops.seen == {}
    states[101] = "stopped"
    stops.look(1, 101, 3.0)
    assert stops.seen == {1: (3.0, "stopped")}


# ---- what the processes' logs report ----

# What jaxlib 0.10 logs in process 0 when process 1 stopped (tests/dist/stop_job.py 1) ...
NOW = [
    b"E1202 16:11:42.043046   18181 coordination_service.cc:1549] [1655958167678430840] Use "
    b"error polling to propagate the following error to all tasks: UNAVAILABLE: " + UNHEALTHY,
    b"1",
    b"The tasks have crashed. Check the task logs for an earlier error, or scheduler events "
    b"(e.g. preemption, eviction) to debug further. [type.googleapis.com/tensorflow."
    b"CoordinationServiceError='']",
    b"F1202 16:11:42.043628   18192 client.h:80] Terminating process because the JAX distributed "
    b"service detected fatal errors. absl::Status: UNAVAILABLE: " + UNHEALTHY,
    b"1",
    b"The tasks have crashed.",
    b"",
    b"RPC: /xla.coordination.CoordinationService/PollForError",
]
# ... and in process 1 when process 0 stopped (tests/dist/stop_job.py 0).
COORDINATOR_STOPPED = [
    b"F1202 16:14:24.664808   20713 client.h:80] Terminating process because the JAX distributed "
    b"service detected fatal errors. absl::Status: DEADLINE_EXCEEDED: Deadline Exceeded",
    b"",
    b"RPC: /xla.coordination.CoordinationService/Heartbeat",
    b"*** Check failure stack trace: ***",
]
# Older jaxlibs: each task by its name, in the list or in a line of its own.
OLDER = [
    b"absl::Status: UNAVAILABLE: " + UNHEALTHY,
    b"/job:jax_worker/replica:0/task:3",
    b"/job:jax_worker/replica:0/task:5",
    b"The tasks have crashed. Check the task logs for an earlier error.",
    b"2",  # a number after the list: not a task
]

OLD_HEARTBEAT = b"RPC: /tensorflow.CoordinationService/Heartbeat"


def _reports(lines_by_rank):
    reports = HeartbeatReports()
    for rank, lines in lines_by_rank:
        for line in lines:
            reports.feed(rank, line)
    return reports.missing()


@pytest.mark.parametrize(
    "lines_by_rank, missing",
    [
        ([(0, NOW)], {1: 0}),
        ([(1, COORDINATOR_STOPPED)], {0: 1}),
        ([(0, OLDER)], {3: 0, 5: 0}),
        ([(2, [b"Task /job:jax_worker/replica:0/task:4 heartbeat timeout. This ..."])], {4: 2}),
        ([(0, [b"... " + UNHEALTHY + b" /job:jax_worker/replica:0/task:6"])], {6: 0}),
        # The list ends at the first line that names no task, whoever prints next.
        ([(0, [UNHEALTHY, b"1"]), (2, [b"7"]), (0, [b"loss 0.5", b"8"])], {1: 0}),
        # The first report of a rank is kept.
        ([(2, [UNHEALTHY, b"1"]), (0, NOW)], {1: 2}),
        # A failed heartbeat names the coordinator only when the service did not answer ...
        ([(1, [b"absl::Status: INTERNAL: x", OLD_HEARTBEAT])], {}),
        ([(1, [b"absl::Status: UNAVAILABLE: x", OLD_HEARTBEAT])], {0: 1}),
        # ... and never from the coordinator itself.
        ([(0, COORDINATOR_STOPPED)], {}),
        ([(0, [b"rank 0 pushed", b"1", b"heartbeat"])], {}),
    ],
)
def test_reports_of_silent_processes_are_read_from_jaxs_log_lines(lines_by_rank, missing):
    assert _reports(lines_by_rank) == missing


# ---- the least stop that counts ----


def test_the_least_stop_is_a_quarter_of_the_shorter_timeout(monkeypatch):
    assert (
        unresponsive.least_silence()
        == min(join.DEFAULT_HEARTBEAT_TIMEOUT, order.DEFAULT_COLLECTIVE_TIMEOUT) / 4
    )
    monkeypatch.setenv(join.ENV_HEARTBEAT_TIMEOUT, "10")
    assert unresponsive.least_silence() == 2.5
    monkeypatch.setenv(order.ENV_COLLECTIVE_TIMEOUT, "4")
    assert unresponsive.least_silence() == 1.0
    monkeypatch.setenv(order.ENV_COLLECTIVE_TIMEOUT, "0")  # no collective watch
    assert unresponsive.least_silence() == 2.5


# ---- which processes are named ----

SIGSTOP = "stopped by SIGSTOP"


@pytest.mark.parametrize(
    "stops, missing, ended, named",
    [
        # Stopped long enough before the first failure (at 20.0; least 5 s).
        (
            {1: (10.0, SIGSTOP)},
            {},
            {0},
            ["process 1 stopped responding (stopped by SIGSTOP) for 10 s"],
        ),
        ({1: (16.5, "stopped")}, {}, {0}, []),  # 3.5 s
        ({1: (15.0, "stopped")}, {}, {0}, ["process 1 stopped responding (stopped) for 5.0 s"]),
        # Shorter, but reported silent: named, with how long.
        (
            {1: (19.0, SIGSTOP)},
            {1: 0},
            {0},
            ["process 1 stopped responding (stopped by SIGSTOP) for 1.0 s"],
        ),
        # Stopped after the failure: only the report counts.
        (
            {1: (21.0, SIGSTOP)},
            {1: 0},
            {0},
            [
                "process 1 stopped responding "
                "(no heartbeats, said JAX's coordination service in process 0)"
            ],
        ),
        ({1: (21.0, SIGSTOP)}, {}, {0}, []),
        # Reported only (another host's process, or one not stopped).
        (
            {},
            {0: 1},
            {1},
            ["process 0 stopped responding (process 1's heartbeats to it went unanswered)"],
        ),
        # A process that ended is named by its own failure, not as silent.
        ({1: (10.0, SIGSTOP)}, {1: 0}, {0, 1}, []),
        # Several, in rank order.
        (
            {2: (10.0, SIGSTOP), 1: (12.0, SIGSTOP)},
            {},
            {0},
            [
                "process 1 stopped responding (stopped by SIGSTOP) for 8.0 s",
                "process 2 stopped responding (stopped by SIGSTOP) for 10 s",
            ],
        ),
        ({}, {}, {0}, []),
    ],
)
def test_a_process_stopped_long_enough_or_reported_silent_is_named(stops, missing, ended, named):
    assert silent(stops, missing, ended, 20.0, 5.0) == named


# ---- the processes that a timed-out collective waited for ----


def test_waiting_and_timed_out_collectives_are_read_from_what_the_watchdog_logs():
    reports = HeartbeatReports()
    reports.feed(1, b"rank 1: a push has waited 3 s, half of it")  # not jaxkv's
    reports.feed(0, b"WARNING:jaxkv:jaxkv: process 0: a barrier has waited 4 s, half of ...")
    reports.feed(2, b"jaxkv: process 2: a push has waited 45 s, half of ...")
    reports.feed(2, b"jaxkv: process 2: a push finished after 50 s")
    assert reports.waiting() == {0}
    reports.feed(
        0,
        b"ERROR:jaxkv:jaxkv: process 0: a broadcast of rank 0's values has waited 91 s for the "
        b"other processes (JAXKV_COLLECTIVE_TIMEOUT=90); one of them is hung or far behind.",
    )
    reports.feed(0, b"jaxkv: process 0: a push has waited 95 s for the other processes")
    assert reports.timed_out() == {0: ("broadcast of rank 0's values", 91)}  # the first kept
    assert reports.waiting() == {0} and reports.missing() == {}


@pytest.mark.parametrize(
    "ranks, waited, described",
    [
        (
            [1],
            ("push", 20),
            "process 1 did not reach the push that process 0 waited 20 s for: it is hung or far "
            "behind",
        ),
        (
            [1, 3],
            None,
            "processes 1, 3 did not reach the collective that process 0 waited for: hung or far "
            "behind",
        ),
    ],
)
def test_processes_that_never_reached_the_collective_are_described(ranks, waited, described):
    assert unresponsive.behind(ranks, 0, waited) == described
