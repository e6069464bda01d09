"""``python -m jaxkv.launch``: stop signals end every process it started, restarts after a
failure resume the job, a stopped process ends the job within the bound, and the options."""

import contextlib
import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import pytest
from _jobs import cpu_env

from jaxkv._src.processes import join as dist_join
from jaxkv._src.processes import order as collective_order
from jaxkv.launch import Launcher, main

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location(
    "restart_job", os.path.join(HERE, "dist", "restart_job.py")
)
restart_job = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(restart_job)
LAUNCH = [sys.executable, "-m", "jaxkv.launch"]


def job(name):
    return os.path.join(HERE, "dist", name)


def alive(pid):
    """Whether ``pid`` runs (a zombie, not yet reaped by init, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def wait_for_pids(directory, n, proc, timeout=120):
    """The PIDs (each process's and its child's) the n processes of sleeper_job.py wrote."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = [directory / f"rank-{r}" for r in range(n)]
        if all(f.exists() for f in files):
            return [int(pid) for f in files for pid in f.read_text().split()]
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    raise AssertionError(f"the processes did not start in {timeout} s")


def assert_all_gone(pids, within=10.0):
    deadline = time.monotonic() + within
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if alive(p)], "processes outlived the launcher"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stop_signal_ends_every_process(tmp_path, sig):
    """The launcher's processes, and what they started, end with it (processes that import
    neither jax nor jaxkv, so this runs fast)."""
    proc = subprocess.Popen(
        [*LAUNCH, "-n", "2", job("sleeper_job.py"), str(tmp_path)],
        env=cpu_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pids = wait_for_pids(tmp_path, 2, proc)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + sig, err
    assert f"{signal.Signals(sig).name}; stopping every process" in err
    assert_all_gone(pids)


def test_the_processes_die_with_a_killed_launcher(tmp_path):
    """SIGKILL, which the launcher cannot handle: the kernel kills its processes
    (PR_SET_PDEATHSIG); what they started is reparented, not killed."""
    proc = subprocess.Popen(
        [*LAUNCH, "-n", "2", job("sleeper_job.py"), str(tmp_path)],
        env=cpu_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    pids = wait_for_pids(tmp_path, 2, proc)
    proc.kill()
    proc.wait(timeout=30)
    try:
        assert_all_gone(pids[::2])
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_timeout_ends_a_joined_job(tmp_path):
    """``timeout -s TERM`` around the launcher (what SLURM and Kubernetes also send): processes
    that joined the job catch SIGTERM (JAX's preemption notifier), and still none survives.
    The test sends SIGTERM to ``timeout`` once every process is up, which forwards it to the
    launcher as its expiry would."""
    proc = subprocess.Popen(
        ["timeout", "-s", "TERM", "600", *LAUNCH, "-n", "2", "--devices-per-process", "1"]
        + [job("sleeper_job.py"), str(tmp_path), "jax"],
        env=cpu_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pids = wait_for_pids(tmp_path, 2, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert_all_gone(pids)


def restart_job_run(tmp_path, max_restarts, args, env):
    """restart_job.py (``DIR STEPS EVERY [FAULT ...]`` after DIR) in 2 processes of 1 device,
    with ``max_restarts`` and ``env`` added to the environment; returns the completed run, its
    stdout + stderr, and the seconds it took."""
    pytest.importorskip("orbax.checkpoint")
    start = time.monotonic()
    run = subprocess.run(
        [*LAUNCH, "-n", "2", "--devices-per-process", "1", "--max-restarts", str(max_restarts)]
        + [job("restart_job.py"), str(tmp_path), *args],
        env=cpu_env(**env),
        capture_output=True,
        text=True,
        timeout=240,
    )
    return run, run.stdout + run.stderr, time.monotonic() - start


def test_killed_and_stopped_ranks_restart_to_the_uninterrupted_values(tmp_path):
    """restart_job.py checkpoints with kv.save every 2 of 6 steps. Attempt 0: rank 1 SIGKILLs
    itself before step 3 (step 3 is redone); attempt 1 resumes from step-2 and rank 0 (which
    serves the coordinator) SIGSTOPs itself before step 5, so that JAX's heartbeat timeout (10 s
    here) ends the job (step 5 is redone); attempt 2 resumes from step-4 and finishes. Every
    rank ends with exactly the values of an uninterrupted run, momentum included (one restart
    more is allowed, for a failure of the loaded machine's own)."""
    run, output, elapsed = restart_job_run(
        tmp_path, 3, ["6", "2", "1:kill@3", "0:stop@5"], {dist_join.ENV_HEARTBEAT_TIMEOUT: "10"}
    )
    assert run.returncode == 0, output
    assert "restarting the job (restart 2 of 3)" in run.stderr, output
    want = restart_job.uninterrupted(6, processes=2, devices_per_process=1)
    assert want != restart_job.uninterrupted(6, 2, 1, lose_momentum_at=(2, 4))
    for rank in range(2):
        starts = re.findall(rf"rank {rank} attempt (\d+) starts at step (\d+)", run.stdout)
        attempts = [int(a) for a, _ in starts]
        steps = [int(s) for _, s in starts]
        assert attempts == list(range(len(starts))), output
        if len(starts) == 3:
            assert steps == [0, 2, 4], output  # the checkpoints before the faults
        assert steps[0] == 0 and steps == sorted(steps), output
        assert f"rank {rank} final {want}" in run.stdout, output
    assert sorted(os.listdir(tmp_path)) == ["step-2", "step-4", "step-6"]
    assert elapsed < 120, f"{elapsed:.0f} s"


def test_a_hung_rank_ends_the_job_after_the_collective_timeout(tmp_path):
    """Rank 1 sleeps for ever before step 3 (alive: JAX's heartbeats go on), so rank 0's push
    waits; after JAXKV_COLLECTIVE_TIMEOUT (5 s here) rank 0 ends itself with status 124, the
    launcher stops rank 1 and restarts the job, which resumes from step-2 and ends with exactly
    the values of an uninterrupted run."""
    run, output, elapsed = restart_job_run(
        tmp_path, 2, ["4", "2", "1:hang@3"], {collective_order.ENV_COLLECTIVE_TIMEOUT: "5"}
    )
    assert run.returncode == 0, output
    assert "process 0 exited with 124" in run.stderr, output
    assert "a push has waited" in run.stderr and "JAXKV_COLLECTIVE_TIMEOUT=5" in run.stderr
    want = restart_job.uninterrupted(4, processes=2, devices_per_process=1)
    for rank in range(2):
        assert f"rank {rank} attempt 1 starts at step 2" in run.stdout, output
        assert f"rank {rank} final {want}" in run.stdout, output
    assert elapsed < 90, f"{elapsed:.0f} s"


def test_a_rank_that_exits_non_zero_ends_the_job_at_once():
    """Rank 1 of a joined job ends with ``sys.exit(3)`` while rank 0 waits for it in a
    collective: the launcher's script runner, which catches the SystemExit (``raise
    SystemExit(3)`` takes the same path), makes rank 1 exit at once rather than wait at JAX's
    shutdown for rank 0 (5 minutes), and the launcher stops the job. Its status is rank 1's 3,
    not that of rank 0, whose collective then fails and which may end first
    (test_launch_cause.py)."""
    start = time.monotonic()
    run = subprocess.run(
        [*LAUNCH, "-n", "2", "--devices-per-process", "1", job("exit_job.py"), "sys.exit"],
        env=cpu_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    elapsed = time.monotonic() - start
    output = run.stdout + run.stderr
    assert "rank 0 pushed" in run.stdout and "rank 1 pushed" in run.stdout, output
    assert run.returncode == 3, output
    assert "process 1 exited with 3; stopping the others" in run.stderr, output
    assert elapsed < 60, f"{elapsed:.0f} s"


def test_the_script_runs_as_python_runs_it(tmp_path, capfd):
    """What the script sees (``__name__``, ``__file__``, ``sys.argv``, ``sys.path[0]``), an
    uncaught exception's traceback (from the script's own frame), and exit statuses, in
    processes that join no JAX job."""
    script = tmp_path / "show.py"
    script.write_text(
        "import os, sys\n"
        "line = f'{__name__} {__file__} {sys.argv} {sys.path[0]} {type(__loader__).__name__}'\n"
        "os.write(1, (line + '\\n').encode())\n"
        "if sys.argv[1] == 'raise':\n"
        "    raise ValueError('boom')\n"
        "sys.exit(sys.argv[1] if sys.argv[1] == 'text' else int(sys.argv[1]))\n"
    )
    for arg, status in [("0", 0), ("4", 4), ("text", 1), ("raise", 1)]:
        assert Launcher(1, [str(script), arg]).run() == status, arg
        out, err = capfd.readouterr()
        want = f"[0] __main__ {script} {[str(script), arg]} {tmp_path} SourceFileLoader\n"
        assert want in out, out
        if arg == "text":
            assert "[0] text" in err.splitlines()
        if arg == "raise":
            assert err.split("[0] Traceback (most recent call last):\n")[1].startswith(
                f'[0]   File "{script}", line 5, in <module>'
            ), err


def test_each_process_gets_its_rank_and_restart_count(tmp_path, capfd):
    """Node 1 of 2 with 3 processes each: ranks 3, 4, 5, and the restart count (processes
    that import neither jax nor jaxkv)."""
    script = tmp_path / "show.py"
    script.write_text(
        "import os, sys\n"
        "e = os.environ\n"
        # One write per line: the processes share the pipe.
        "line = ' '.join(['rank', e['JAXKV_PROCESS_ID'], 'of', e['JAXKV_NUM_PROCESSES'],"
        " 'local', e['JAXKV_LOCAL_RANK'], 'node', e['JAXKV_NODE_RANK'], 'restart',"
        " e['JAXKV_RESTART_COUNT'], e['JAXKV_COORDINATOR']])\n"
        "os.write(1, (line + '\\n').encode())\n"
        "sys.exit(e['JAXKV_RESTART_COUNT'] == '0' and e['JAXKV_LOCAL_RANK'] == '0')\n"
    )
    launcher = Launcher(
        3,
        [str(script)],
        nnodes=2,
        node_rank=1,
        coordinator="10.0.0.1:1234",
        max_restarts=1,
        restart_delay=0,
    )
    assert launcher.run() == 0
    out = capfd.readouterr().out
    # Attempt 0 fails as rank 3 exits (the others may be stopped before they print).
    assert "rank 3 of 6 local 0 node 1 restart 0 10.0.0.1:1234" in out
    for i in range(3):
        assert f"rank {3 + i} of 6 local {i} node 1 restart 1 10.0.0.1:1234" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["-n", "0"], "at least 1"),
        (["-n", "1", "--nnodes", "2"], "needs --coordinator"),
        (["-n", "1", "--nnodes", "2", "--node-rank", "2", "--coordinator", "h:1"], "0 .. 1"),
        (["-n", "1", "--coordinator", "nohostport"], "HOST:PORT"),
        (["-n", "1", "--max-restarts", "-1"], "0 or more"),
    ],
)
def test_refused_options(args, message, capsys):
    with pytest.raises(SystemExit):
        main([*args, "x.py"])
    assert message in capsys.readouterr().err


def test_local_address_is_on_the_route_to_the_coordinator():
    assert dist_join.local_address("127.0.0.1:1234") == "127.0.0.1"
    assert dist_join.local_address("[::1]:1234") == "::1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: a route is enough, nothing is sent
        except OSError:
            pytest.skip("no IPv4 route off this machine")
        expected = s.getsockname()[0]
    assert dist_join.local_address("192.0.2.1:1234") == expected


def test_gloo_binding(monkeypatch):
    monkeypatch.delenv(dist_join.ENV_IFNAME, raising=False)
    assert dist_join.gloo_binding("127.0.0.1:5") == {"hostname": "127.0.0.1"}
    monkeypatch.setenv(dist_join.ENV_IFNAME, "eth7")
    assert dist_join.gloo_binding("127.0.0.1:5") == {"interface": "eth7"}


@pytest.mark.parametrize("route", ["jax", "variables"])
def test_cluster_detection(monkeypatch, route):
    """A job is found through JAX's own cluster environments, or, where jaxkv may not use them
    (another JAX, JAXKV_NO_FAST_PATHS=1), through SLURM's and Open MPI's variables."""
    if route == "variables":
        monkeypatch.setattr(dist_join.jax_internals, "cluster_environments", lambda: None)
    elif dist_join.jax_internals.cluster_environments() is None:
        pytest.skip("JAX's cluster environments are not available here (the other route runs)")
    for name in list(os.environ):
        if name.startswith(("SLURM_", "OMPI_")):
            monkeypatch.delenv(name)
    assert dist_join.detected_cluster() is None
    slurm = {
        "SLURM_JOB_ID": "7",
        "SLURM_STEP_NODELIST": "n[1-2]",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
    }
    for name, value in slurm.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert dist_join.detected_cluster() is None  # one task: nothing to join
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert dist_join.detected_cluster() == "slurm"
    for name in slurm:
        monkeypatch.delenv(name)
    monkeypatch.setenv("OMPI_MCA_orte_hnp_uri", "1531576320.0;tcp://10.96.0.1:34911")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    assert dist_join.detected_cluster() == "ompi"


def test_an_environment_jax_cannot_read_in_full_joins_nothing(monkeypatch):
    class Half:
        @classmethod
        def is_env_present(cls):
            return True

        @classmethod
        def get_process_count(cls):
            raise KeyError("SLURM_NTASKS")

    monkeypatch.setattr(dist_join.jax_internals, "cluster_environments", lambda: [Half])
    assert dist_join.detected_cluster() is None


def test_heartbeat_timeout(monkeypatch):
    monkeypatch.delenv(dist_join.ENV_HEARTBEAT_TIMEOUT, raising=False)
    assert dist_join.heartbeat_timeout() == dist_join.DEFAULT_HEARTBEAT_TIMEOUT
    monkeypatch.setenv(dist_join.ENV_HEARTBEAT_TIMEOUT, "15")
    assert dist_join.heartbeat_timeout() == 15
    monkeypatch.setenv(dist_join.ENV_RESTART_COUNT, "2")
    assert dist_join.restart_count() == 2


def test_a_slurm_step_joins_through_jax_detection():
    """Two processes with the variables ``srun -n 2`` sets, and no launcher: each joins through
    JAX's SLURM detection (coordinator: the step's first node, here localhost), and
    kvstore_job.py's sums agree on both."""
    launched = (dist_join.ENV_COORDINATOR, dist_join.ENV_NUM_PROCESSES, dist_join.ENV_PROCESS_ID)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", *launched))}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = cpu_env(
            {
                **base,
                "SLURM_JOB_ID": "4242",
                "SLURM_STEP_NODELIST": "localhost",
                "SLURM_STEP_NUM_NODES": "1",
                "SLURM_NTASKS": "2",
                "SLURM_PROCID": str(rank),
                "SLURM_LOCALID": str(rank),
                "JAX_COORDINATOR_PORT": str(port),  # JAX's own override of the job-id port
            }
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, job("slurm_job.py"), "2"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, out + err
        assert f"rank {rank} ok push sums over workers" in out
        assert f"rank {rank} done" in out


def test_the_watchdog_thread_ends_before_jaxs_clean_up(monkeypatch):
    """The watchdog's daemon thread is stopped by an ``atexit`` handler registered after JAX's
    own clean-up (so run before it): a thread left in jaxlib as the backends are cleared
    aborted a job that had succeeded."""
    import atexit

    registered = []
    monkeypatch.setattr(atexit, "register", registered.append)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    dog = collective_order._Watchdog()
    handle = dog.watch("push", lambda: False)
    assert handle is not None and dog._thread is not None and dog._thread.is_alive()
    assert registered == [dog.stop]
    dog.stop()
    assert not dog._thread.is_alive()
    dog.watch("push", lambda: False)  # a collective after the stop starts no thread again
    assert registered == [dog.stop]
