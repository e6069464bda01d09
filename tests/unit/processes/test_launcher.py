"""jaxkv/_src/processes/launcher.py: the command line and its refusals, each process's rank and
environment, how long the launcher waits after a failure, which process it names, and its
exit status (no multi-process job is started here)."""

import os
import shutil
import signal
import subprocess
import sys
import types

import pytest

from jaxkv._src.processes import join, launcher, order, unresponsive


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in (
        "GLIBC_TUNABLES",
        join.ENV_HEARTBEAT_TIMEOUT,
        join.ENV_DEVICES_PER_PROCESS,
        order.ENV_COLLECTIVE_TIMEOUT,
    ):
        monkeypatch.delenv(name, raising=False)


# ---- the environment ----


def test_processes_get_huge_page_malloc_unless_glibc_tunables_is_set_even_empty(monkeypatch):
    given = {"A": "1"}
    assert launcher.process_env(given) == {"A": "1", "GLIBC_TUNABLES": launcher.HUGETLB_MALLOC}
    assert given == {"A": "1"}  # a copy
    assert launcher.process_env({"GLIBC_TUNABLES": ""}) == {"GLIBC_TUNABLES": ""}
    assert launcher.process_env({"GLIBC_TUNABLES": "x=1"}) == {"GLIBC_TUNABLES": "x=1"}
    monkeypatch.setenv("JAXKV_TEST_MARK", "seen")  # default: this process's environment
    env = launcher.process_env()
    assert env["JAXKV_TEST_MARK"] == "seen" and env["GLIBC_TUNABLES"] == launcher.HUGETLB_MALLOC


class _Popen:
    """Stands in for ``subprocess.Popen``: records each process's command line and env."""

    def __init__(self, args, env, start_new_session, stdout, stderr):
        self.args, self.env, self.new_session = args, env, start_new_session
        self.piped = (stdout, stderr)
        self.stdout = self.stderr = None  # nothing to relay
        self.pid = 50000 + int(env[join.ENV_PROCESS_ID])


@pytest.fixture
def attempt(monkeypatch):
    """``attempt(launcher, n)``: run attempt ``n`` with processes that start nothing; returns
    them and the contents of the launcher's pid file as the processes would see it."""
    seen = {}

    def watch(ranks, procs, notes, signals, reports):
        with open(os.path.join(notes, "pids")) as f:
            seen["pids"] = f.read()
        seen["procs"], seen["ranks"] = procs, ranks
        return 0

    monkeypatch.setattr(launcher.subprocess, "Popen", _Popen)
    monkeypatch.setattr(launcher.Launcher, "_watch", staticmethod(watch))
    monkeypatch.setattr(launcher, "_stop", lambda procs: seen.setdefault("stopped", procs))

    def run(job, number):
        assert job._attempt(number, launcher._Signals()) == 0
        assert seen["stopped"] is seen["procs"]  # every process is stopped at the end
        return seen

    return run


def test_each_process_of_a_node_gets_its_rank_and_the_jobs_numbers(attempt):
    job = launcher.Launcher(
        3, ["train.py", "--lr", "1"], 4, nnodes=2, node_rank=1, coordinator="node0:9"
    )
    seen = attempt(job, 2)
    envs = [p.env for p in seen["procs"]]
    assert [e[join.ENV_PROCESS_ID] for e in envs] == ["3", "4", "5"]  # node 1, 3 per node
    assert seen["ranks"] == [3, 4, 5]
    assert [e[join.ENV_LOCAL_RANK] for e in envs] == ["0", "1", "2"]
    for e in envs:
        assert e[join.ENV_NUM_PROCESSES] == "6"
        assert e[join.ENV_NODE_RANK] == "1"
        assert e[join.ENV_COORDINATOR] == "node0:9"
        assert e[join.ENV_RESTART_COUNT] == "2"
        assert e[join.ENV_DEVICES_PER_PROCESS] == "4"
        assert e["GLIBC_TUNABLES"] == launcher.HUGETLB_MALLOC
    assert seen["pids"] == "3 50003\n4 50004\n5 50005\n"


def test_one_node_gets_a_coordinator_on_loopback_and_jaxs_own_device_count(attempt):
    seen = attempt(launcher.Launcher(2, ["train.py"]), 0)
    envs = [p.env for p in seen["procs"]]
    coordinators = {e[join.ENV_COORDINATOR] for e in envs}
    assert len(coordinators) == 1  # one coordinator for the whole job
    host, port = join.split_address(coordinators.pop())
    assert host == "127.0.0.1" and port > 0
    assert all(join.ENV_DEVICES_PER_PROCESS not in e for e in envs)
    assert [e[join.ENV_PROCESS_ID] for e in envs] == ["0", "1"]
    assert all(e[join.ENV_NUM_PROCESSES] == "2" for e in envs)


def test_each_process_runs_the_script_with_its_arguments_after_the_shim(attempt):
    seen = attempt(launcher.Launcher(1, ["train.py", "-n", "7"]), 0)
    (p,) = seen["procs"]
    shim = [sys.executable, "-S", "-c", launcher._DIE_WITH_PARENT, str(os.getpid())]
    assert p.args[: len(shim)] == shim  # killed with this launcher, whose pid it checks
    # What ps shows: python, the runner, the script and its arguments.
    assert p.args[len(shim) :] == [sys.executable, launcher.RUNNER, "train.py", "-n", "7"]
    assert os.path.basename(launcher.RUNNER) == "runner.py" and os.path.isfile(launcher.RUNNER)
    notes = p.env["JAXKV_LAUNCH_NOTES"]
    assert os.path.basename(notes).startswith("jaxkv-launch-")
    assert not os.path.exists(notes)  # removed once the attempt is over
    assert p.new_session
    assert p.piped == (subprocess.PIPE, subprocess.PIPE)  # relayed, prefixed
    assert p.env["PYTHONUNBUFFERED"] == "1"  # each line reaches the relay when printed


@pytest.mark.parametrize(
    "prefix, verbose, piped",
    [(True, False, True), (True, True, True), (False, False, True)] + [(False, True, False)],
)
def test_output_is_relayed_unless_nothing_is_to_be_prefixed_or_dropped(
    attempt, monkeypatch, prefix, verbose, piped
):
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
    seen = attempt(launcher.Launcher(1, ["train.py"], prefix=prefix, verbose=verbose), 0)
    (p,) = seen["procs"]
    assert p.piped == ((subprocess.PIPE,) * 2 if piped else (None, None))
    assert ("PYTHONUNBUFFERED" in p.env) == piped


def test_a_users_pythonunbuffered_is_kept(attempt, monkeypatch):
    monkeypatch.setenv("PYTHONUNBUFFERED", "")
    (p,) = attempt(launcher.Launcher(1, ["train.py"]), 0)["procs"]
    assert p.env["PYTHONUNBUFFERED"] == ""


# ---- the command line ----


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n": 0}, "-n"),
        ({"nnodes": 0}, "--node-rank"),
        ({"nnodes": 2, "node_rank": 2, "coordinator": "h:1"}, "0 .. 1"),
        ({"nnodes": 2, "node_rank": -1, "coordinator": "h:1"}, "--node-rank"),
        ({"nnodes": 2}, "--coordinator"),
        ({"coordinator": "h"}, "HOST:PORT"),
        ({"max_restarts": -1}, "--max-restarts"),
    ],
)
def test_the_launcher_refuses_impossible_jobs(kwargs, message):
    args = {"n": 1, **kwargs}
    with pytest.raises(ValueError, match=message):
        launcher.Launcher(args.pop("n"), ["s.py"], **args)


def test_the_smallest_and_largest_valid_numbers_are_accepted(monkeypatch):
    monkeypatch.setenv(join.ENV_HEARTBEAT_TIMEOUT, "7")
    last = launcher.Launcher(1, ["s.py"], nnodes=3, node_rank=2, coordinator="h:1")
    assert (last.n, last.node_rank, last.max_restarts) == (1, 2, 0)
    assert last.restart_delay == 7 + 5.0  # several nodes: the heartbeat timeout and 5 s
    assert launcher.Launcher(1, ["s.py"], node_rank=0).restart_delay == 0.0  # one node
    given = launcher.Launcher(1, ["s.py"], nnodes=2, coordinator="h:1", restart_delay=0.5)
    assert given.restart_delay == 0.5


def test_the_command_line_passes_options_after_the_script_to_it(monkeypatch):
    made = []
    monkeypatch.setattr(launcher.Launcher, "run", lambda self: made.append(self) or 17)
    monkeypatch.setattr(launcher.logging, "basicConfig", lambda **kw: None)
    argv = "-n 2 --devices-per-process 3 --nnodes 4 --node-rank 3 --coordinator h:5"
    argv = [*argv.split(), "--max-restarts", "6", "s.py", "--nnodes", "9", "-n", "1"]
    assert launcher.main(argv) == 17
    (job,) = made
    assert (job.n, job.devices_per_process, job.nnodes, job.node_rank) == (2, 3, 4, 3)
    assert (job.coordinator, job.max_restarts) == ("h:5", 6)
    assert job.script == ["s.py", "--nnodes", "9", "-n", "1"]


def test_the_command_line_reports_a_refused_job_as_a_usage_error(monkeypatch, capsys):
    monkeypatch.setattr(launcher.Launcher, "run", pytest.fail)
    with pytest.raises(SystemExit) as e:
        launcher.main(["-n", "2", "--node-rank", "1", "s.py"])
    assert e.value.code == 2
    assert "--node-rank 1 is not in 0 .. 0" in capsys.readouterr().err


# ---- restarts and signals ----


def _run_codes(monkeypatch, codes, max_restarts, on_sleep=None):
    """Run a launcher whose attempts end with ``codes``; returns its status, the attempts
    made and the sleeps between them."""
    attempts, sleeps = [], []

    def fake_attempt(self, number, signals):
        attempts.append(number)
        return codes[number]

    def fake_sleep(seconds, signals):
        sleeps.append(seconds)
        if on_sleep:
            on_sleep(signals)

    monkeypatch.setattr(launcher.Launcher, "_attempt", fake_attempt)
    monkeypatch.setattr(launcher.Launcher, "_sleep", staticmethod(fake_sleep))
    job = launcher.Launcher(1, ["s.py"], max_restarts=max_restarts, restart_delay=0.25)
    return job.run(), attempts, sleeps


def test_a_failed_job_is_restarted_up_to_max_restarts_times(monkeypatch):
    assert _run_codes(monkeypatch, [1, 2, 3, 4], 2) == (3, [0, 1, 2], [0.25, 0.25])
    assert _run_codes(monkeypatch, [5, 6], 0) == (5, [0], [])
    assert _run_codes(monkeypatch, [1, 0, 9], 2)[:2] == (0, [0, 1])  # success ends it


def test_a_stop_signal_while_waiting_to_restart_ends_the_launcher(monkeypatch):
    def stopped(signals):
        signals.received = signal.SIGTERM

    status, attempts, _ = _run_codes(monkeypatch, [1, 0], 3, on_sleep=stopped)
    assert (status, attempts) == (128 + signal.SIGTERM, [0])


def test_the_first_stop_signal_is_kept_and_the_handlers_restored():
    before = [signal.getsignal(s) for s in launcher.STOP_SIGNALS]
    with launcher._Signals() as signals:
        assert signal.getsignal(signal.SIGHUP) == signals._handle
        signals._handle(signal.SIGHUP, None)
        signals._handle(signal.SIGINT, None)
    assert signals.received == signal.SIGHUP
    assert [signal.getsignal(s) for s in launcher.STOP_SIGNALS] == before


# ---- watching the processes ----

STEP = 0.25  # the fake clock's tick per wait: SETTLE and GRACE are multiples of it


@pytest.fixture
def watch(monkeypatch):
    """``watch(schedule, ...)``: run ``Launcher._watch`` on processes that end as ``schedule``
    says (rank -> (when, status)), and are stopped from the times in ``stopped`` (rank -> when),
    on a clock that ticks :data:`STEP` per wait; returns the status and the number of waits."""

    def run(schedule, ending=(), notes="", received=None, stopped=None, reports=None):
        clock = types.SimpleNamespace(now=0.0, waits=0)

        class Exits:
            def __init__(self, ranks, procs):
                pass

            def wait(self, timeout):
                clock.now += STEP
                clock.waits += 1
                return {r: (s, t) for r, (t, s) in schedule.items() if t <= clock.now}

            def close(self):
                pass

        monkeypatch.setattr(launcher, "_Exits", Exits)
        monkeypatch.setattr(launcher, "time", types.SimpleNamespace(monotonic=lambda: clock.now))
        monkeypatch.setattr(launcher, "_ending", lambda pid: pid - 100 in ending)

        def stopped_by(pid):
            since = (stopped or {}).get(pid - 100, NEVER)
            return "stopped by SIGSTOP" if since <= clock.now else None

        monkeypatch.setattr(unresponsive, "stopped_by", stopped_by)
        ranks = [0, 1, 2]
        procs = [types.SimpleNamespace(pid=100 + r) for r in ranks]
        signals = types.SimpleNamespace(received=received)
        return launcher.Launcher._watch(ranks, procs, notes, signals, reports), clock.waits

    return run


NEVER = 1e9


def test_a_job_whose_processes_all_succeed_ends_with_0(watch):
    assert watch({0: (1.0, 0), 1: (0.5, 0), 2: (2.0, 0)}) == (0, 2.0 / STEP)


def test_after_a_failure_the_launcher_waits_settle_seconds_for_the_others(watch, tmp_path):
    (tmp_path / "failed-1").write_text("0.2")  # the failed process's own note: it has ended
    status, waits = watch({0: (NEVER, 0), 1: (STEP, 3), 2: (NEVER, 0)}, notes=str(tmp_path))
    assert status == 3
    assert waits == 1 + launcher.SETTLE / STEP  # the failure's wait, then SETTLE seconds


def test_a_peer_still_exiting_gets_grace_seconds_more(watch):
    status, waits = watch({0: (NEVER, 0), 1: (STEP, 3), 2: (NEVER, 0)}, ending={2})
    assert status == 3
    assert waits == 1 + (launcher.SETTLE + launcher.GRACE) / STEP


def test_a_peer_that_noted_its_failure_gets_grace_seconds_more(watch, tmp_path):
    (tmp_path / "failed-2").write_text("0.1")
    status, waits = watch({0: (NEVER, 0), 1: (STEP, 3), 2: (NEVER, 0)}, notes=str(tmp_path))
    assert waits == 1 + (launcher.SETTLE + launcher.GRACE) / STEP
    assert status == 3  # rank 2 never ended: its note alone does not name it


def test_a_peer_killed_before_the_noted_failure_is_named_with_128_plus_its_signal(watch, tmp_path):
    # Rank 1 fails first as the launcher sees it, but noted rank 0 as already exiting then.
    (tmp_path / "failed-1").write_text(f"{STEP} 0")
    schedule = {0: (3 * STEP, -signal.SIGKILL), 1: (STEP, 3), 2: (NEVER, 0)}
    status, _ = watch(schedule, notes=str(tmp_path))
    assert status == 128 + signal.SIGKILL


def test_a_process_stopped_long_before_the_first_failure_is_named_as_its_cause(watch, caplog):
    """Rank 1 stops at 1 s; rank 0 aborts at 21 s (the heartbeat timeout, 60 s by default, is
    the launcher's to know: least 15 s): rank 1 is named first, rank 0's status is the job's."""
    schedule = {0: (21.0, -signal.SIGABRT), 1: (NEVER, 0), 2: (NEVER, 0)}
    status, _ = watch(schedule, stopped={1: 1.0})
    assert status == 128 + signal.SIGABRT
    assert caplog.messages[-1] == (
        "jaxkv.launch: process 1 stopped responding (stopped by SIGSTOP) for 20 s; as a result, "
        "process 0 was killed by SIGABRT; stopping the others"
    )


def test_a_short_stop_is_not_named_unless_a_peer_reported_it(watch, caplog, monkeypatch):
    monkeypatch.setenv(join.ENV_HEARTBEAT_TIMEOUT, "40")  # least 10 s
    schedule = {0: (NEVER, 0), 1: (NEVER, 0), 2: (20.25, 3)}  # seen stopped from 11.25
    assert watch(schedule, stopped={1: 11.0})[0] == 3
    assert caplog.messages[-1] == "jaxkv.launch: process 2 exited with 3; stopping the others"
    reports = unresponsive.HeartbeatReports()
    for line in (unresponsive.UNHEALTHY, b"1"):
        reports.feed(2, line)
    assert watch(schedule, stopped={1: 11.0}, reports=reports)[0] == 3
    assert caplog.messages[-1] == (
        "jaxkv.launch: process 1 stopped responding (stopped by SIGSTOP) for 9.0 s; as a result, "
        "process 2 exited with 3; stopping the others"
    )


HUNG = order.EXIT_HUNG


def _said(lines):
    """What the processes logged (order.py): rank -> lines, ``waiting``, ``finished`` or
    ``timed out``."""
    reports = unresponsive.HeartbeatReports()
    said = {
        "waiting": "a push has waited 4 s, half of JAXKV_COLLECTIVE_TIMEOUT=8, for the other ...",
        "finished": "a push finished after 5 s",
        "timed out": "a push has waited 8 s for the other processes (JAXKV_COLLECTIVE_TIMEOUT=8)",
    }
    for rank, words in lines.items():
        for word in words:
            reports.feed(rank, f"jaxkv: process {rank}: {said[word]}".encode())
    return reports


def test_the_process_the_others_waited_for_is_named_when_a_collective_timed_out(watch, caplog):
    """Rank 0's push times out (124) and rank 2's, both waiting: rank 1, which had not said it
    was waiting, is named, even though it ended after rank 0 (SIGABRT, rank 0's coordination
    service gone); rank 0's status is the job's, and nothing waits longer than SETTLE."""
    waited = _said({0: ["waiting", "timed out"], 2: ["waiting"]})
    schedule = {0: (1.0, HUNG), 1: (1.25, -signal.SIGABRT), 2: (1.25, HUNG)}
    assert watch(schedule, reports=waited) == (HUNG, 1.25 / STEP)
    assert caplog.messages[-1] == (
        "jaxkv.launch: process 1 did not reach the push that process 0 waited 8 s for: it is hung "
        "or far behind; as a result, process 0 exited with 124; stopping the others (after it, "
        "process 1 was killed by SIGABRT, process 2 exited with 124)"
    )
    # Still running after SETTLE, as when a process other than 0 timed out; a push that had
    # waited, then finished, is not waiting; the timed-out line unread: "the collective".
    schedule = {0: (1.0, HUNG), 1: (NEVER, 0), 2: (NEVER, 0)}
    assert watch(schedule, reports=_said({0: ["waiting"], 1: ["waiting", "finished"]})) == (
        HUNG,
        (1.0 + launcher.SETTLE) / STEP,
    )
    assert caplog.messages[-1] == (
        "jaxkv.launch: processes 1, 2 did not reach the collective that process 0 waited for: "
        "hung or far behind; as a result, process 0 exited with 124; stopping the others"
    )


@pytest.mark.parametrize(
    "said",
    [
        {0: ["waiting", "timed out"], 1: ["waiting"], 2: ["waiting"]},  # every one waiting
        {1: ["waiting"], 2: ["waiting"]},  # rank 0's warnings unread: nothing to go by
        {},  # nothing relayed (--no-prefix --verbose)
    ],
)
def test_no_process_is_named_as_hung_unless_the_timed_out_one_said_it_was_waiting(
    watch, caplog, said
):
    schedule = {0: (1.0, HUNG), 1: (NEVER, 0), 2: (1.5, HUNG)}
    assert watch(schedule, reports=_said(said))[0] == HUNG
    assert caplog.messages[-1] == (
        "jaxkv.launch: process 0 exited with 124; stopping the others (after it, process 2 "
        "exited with 124)"
    )


def test_only_a_timed_out_collective_first_names_a_process_as_hung(watch, caplog):
    said = _said({0: ["waiting"], 2: ["waiting", "timed out"]})
    schedule = {0: (NEVER, 0), 1: (1.0, 3), 2: (1.5, HUNG)}
    assert watch(schedule, reports=said)[0] == 3
    assert caplog.messages[-1] == (
        "jaxkv.launch: process 1 exited with 3; stopping the others (after it, process 2 "
        "exited with 124)"
    )


def test_a_stopped_process_or_one_that_ended_well_is_not_named_as_hung(watch, caplog):
    # Stopped long before: named as stopped, as without the time-out.
    said = _said({0: ["waiting", "timed out"]})
    schedule = {0: (21.0, HUNG), 1: (NEVER, 0), 2: (2.0, 0)}
    assert watch(schedule, stopped={1: 1.0}, reports=said)[0] == HUNG
    assert caplog.messages[-1] == (
        "jaxkv.launch: process 1 stopped responding (stopped by SIGSTOP) for 20 s; as a result, "
        "process 0 exited with 124; stopping the others"
    )
    # Stopped too shortly before to be named as the cause: not named at all.
    watch(schedule, stopped={1: 20.0}, reports=said)
    assert caplog.messages[-1] == "jaxkv.launch: process 0 exited with 124; stopping the others"


def test_a_stop_signal_ends_the_watch_with_128_plus_its_number(watch):
    assert watch({0: (NEVER, 0)}, received=signal.SIGINT) == (128 + signal.SIGINT, 0)


def test_exits_are_recorded_under_each_process_rank():
    true, sh = shutil.which("true"), shutil.which("sh")
    procs = [subprocess.Popen([sh, "-c", "exit 3"]), subprocess.Popen([true])]
    exits = launcher._Exits([7, 5], procs)
    try:
        ended = {}
        for _ in range(200):  # until both have ended (each wait returns at the first exit)
            ended = exits.wait(0.05)
            if len(ended) == 2:
                break
    finally:
        exits.close()
        for p in procs:
            p.wait()
    assert {rank: status for rank, (status, _) in ended.items()} == {7: 3, 5: 0}


# ---- naming the first to fail ----


def test_describe_tells_an_exit_status_from_a_signal():
    assert launcher._describe(2, 0) == "process 2 exited with 0"
    assert launcher._describe(2, 3) == "process 2 exited with 3"
    assert launcher._describe(1, -signal.SIGKILL) == "process 1 was killed by SIGKILL"
    assert launcher._describe(1, -1000) == "process 1 was killed by signal 1000"


def test_failure_notes_are_read_and_partial_or_foreign_files_skipped(tmp_path):
    (tmp_path / "failed-3").write_text("12.5 1 2")
    (tmp_path / "failed-0").write_text("7.25")
    (tmp_path / "failed-4.tmp").write_text("1.0")  # still being written
    (tmp_path / "failed-x").write_text("1.0")  # not a rank
    (tmp_path / "failed-5").write_text("")  # no time
    (tmp_path / "pids").write_text("0 100\n")
    assert launcher._read_notes(str(tmp_path)) == {
        3: (12.5, frozenset({1, 2})),
        0: (7.25, frozenset()),
    }
    assert launcher._read_notes(str(tmp_path / "gone")) == {}


@pytest.mark.parametrize(
    "ended, notes, want",
    [
        ({0: (0, 1.0), 1: (0, 2.0)}, {}, []),
        # seen order, ties by rank; successes left out, signals kept
        ({0: (2, 5.0), 1: (0, 1.0), 2: (-9, 4.0), 3: (1, 4.0)}, {}, [(2, -9), (3, 1), (0, 2)]),
        # a note earlier than the launcher saw the end counts
        ({0: (2, 5.0), 1: (3, 4.0)}, {0: (3.5, frozenset())}, [(0, 2), (1, 3)]),
        # a note later than the end seen does not
        ({0: (2, 3.0), 1: (3, 4.0)}, {0: (6.0, frozenset())}, [(0, 2), (1, 3)]),
        # after a failed peer: not first, though earliest; the rest in time order
        (
            {0: (1, 1.0), 1: (1, 2.0), 2: (-9, 3.0)},
            {0: (0.5, frozenset({2}))},
            [(1, 1), (0, 1), (2, -9)],
        ),
        # a peer noted as exiting that then succeeded does not count
        ({0: (1, 1.0), 1: (0, 0.5), 2: (1, 2.0)}, {0: (1.0, frozenset({1}))}, [(0, 1), (2, 1)]),
        # each noted the other: the earliest stays first
        (
            {0: (1, 2.0), 1: (1, 1.0)},
            {0: (2.0, frozenset({1})), 1: (1.0, frozenset({0}))},
            [(1, 1), (0, 1)],
        ),
    ],
)
def test_the_first_to_fail_is_the_earliest_that_came_after_no_other_failure(ended, notes, want):
    assert launcher._order_failures(ended, notes) == want


def _stat(pid, state, flags, command="py"):
    # /proc/PID/stat: pid (comm) state ppid pgrp session tty_nr tpgid flags minflt ...
    return f"{pid} ({command}) {state} 1 {pid} {pid} 0 -1 {flags} 120 0 3 0"


@pytest.mark.parametrize(
    "state, flags, ending",
    [
        ("S", 0x400000, False),
        ("R", 0x400040, False),  # other flags only
        ("S", 0x400044, True),  # PF_EXITING
        ("Z", 0, True),
        ("X", 0, True),
    ],
)
def test_a_process_is_ending_when_exiting_a_zombie_or_dead(monkeypatch, state, flags, ending):
    text = _stat(4321, state, flags, command="a) S 1 2 3 4 5 0")  # a name that fools split(")")
    paths = []

    class Stat:
        def __init__(self, path):
            paths.append(path)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def read(self):
            return text

    monkeypatch.setattr(launcher, "open", Stat, raising=False)
    assert launcher._ending(4321) is ending
    assert paths == ["/proc/4321/stat"]


def test_a_process_proc_cannot_tell_about_is_not_ending(monkeypatch, tmp_path):
    assert launcher._ending(os.getpid()) is False  # running: this process
    short = tmp_path / "stat"
    short.write_text("1 (py) S 1")
    monkeypatch.setattr(launcher, "open", lambda path: short.open(), raising=False)
    assert launcher._ending(1) is False  # too few fields


def test_help_is_usage_and_examples_within_100_columns(capsys, monkeypatch):
    """``--help`` says how to use the launcher, with examples; how it works is in the docs."""
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit):
        launcher.main(["--help"])
    text = capsys.readouterr().out
    assert "examples:" in text and "--no-prefix" in text and "--verbose" in text
    assert "python -m jaxkv.launch -n 2 --devices-per-process 4 train.py" in text
    for internal in ("/proc", "pidfd", "PR_SET_PDEATHSIG", "atexit", "GLIBC_TUNABLES"):
        assert internal not in text
    assert max(map(len, text.splitlines())) <= 100
