"""``python -m jaxkv.launch``'s output and processes as a user sees them: each line prefixed with
its rank as it is printed, gloo's connection lines only with ``--verbose``, ``--no-prefix``
passing the bytes on as they are, and ``ps`` showing the script and its arguments."""

import os
import subprocess
import sys
import time

from _jobs import cpu_env

from jaxkv._src.processes.launcher import RUNNER

LAUNCH = [sys.executable, "-m", "jaxkv.launch"]
HERE = os.path.dirname(os.path.abspath(__file__))

#: Prints as scripts do (print, no flush), to both streams, then waits for a file before its
#: last line: the lines before it must reach the launcher's output while the process runs.
PRINTER = """\
import os, sys, time
rank = os.environ["JAXKV_PROCESS_ID"]
print("hello from", rank)
print("warning from", rank, file=sys.stderr)
print("two\\nlines from", rank)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.02)
sys.stdout.write("no end from " + rank)
"""

#: One push across the processes: gloo connects them, and prints that it did.
PUSHER = """\
import numpy as np
import jaxkv
kv = jaxkv.create("dist_sync")
kv.init("w", np.zeros(2, np.float32))
kv.push("w", np.ones(2, np.float32))
print("rank", kv.rank, "pulled", kv.pull("w").tolist())
"""


def _read_line(pipe, timeout):
    """A line of ``pipe``, read by a thread, or None after ``timeout`` seconds."""
    import queue
    import threading

    got = queue.Queue()
    threading.Thread(target=lambda: got.put(pipe.readline()), daemon=True).start()
    try:
        return got.get(timeout=timeout)
    except queue.Empty:
        return None


def test_each_line_comes_with_its_rank_as_it_is_printed(tmp_path):
    script = tmp_path / "printer.py"
    script.write_text(PRINTER)
    go = tmp_path / "go"
    proc = subprocess.Popen(
        [*LAUNCH, "-n", "2", str(script), str(go)],
        env=cpu_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        bufsize=0,  # unbuffered: the line read first is all that communicate() does not read
    )
    try:
        # The first line arrives while the processes still run (they wait for ``go``).
        first = _read_line(proc.stdout, timeout=60)
        assert first in (b"[0] hello from 0\n", b"[1] hello from 1\n")
        assert proc.poll() is None
        go.touch()
        out, err = (b.decode() for b in proc.communicate(timeout=60))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    lines = (first.decode() + out).splitlines()
    for rank in (0, 1):
        mine = [line for line in lines if line.startswith(f"[{rank}] ")]
        assert mine == [
            f"[{rank}] hello from {rank}",
            f"[{rank}] two",
            f"[{rank}] lines from {rank}",
            f"[{rank}] no end from {rank}",  # ended by a newline: the next line starts a line
        ]
    assert len(lines) == 8, out
    errs = [line for line in err.splitlines() if not line.startswith("jaxkv.launch:")]
    assert sorted(errs) == ["[0] warning from 0", "[1] warning from 1"], err


def test_no_prefix_passes_the_output_on_as_it_is(tmp_path):
    script = tmp_path / "printer.py"
    script.write_text(PRINTER)
    go = tmp_path / "go"
    go.touch()
    run = subprocess.run(
        [*LAUNCH, "-n", "1", "--no-prefix", str(script), str(go)],
        env=cpu_env(),
        capture_output=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout == b"hello from 0\ntwo\nlines from 0\nno end from 0"


def _pushes(tmp_path, *options):
    script = tmp_path / "pusher.py"
    script.write_text(PUSHER)
    run = subprocess.run(
        [*LAUNCH, "-n", "2", "--devices-per-process", "1", *options, str(script)],
        env=cpu_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    for rank in (0, 1):
        assert f"[{rank}] rank {rank} pulled [2.0, 2.0]" in run.stdout.splitlines()
    return run


def test_gloos_connection_lines_show_only_with_verbose(tmp_path):
    quiet = _pushes(tmp_path)
    assert "is connected to" not in quiet.stdout + quiet.stderr, quiet.stdout
    verbose = _pushes(tmp_path, "--verbose")
    for rank in (0, 1):
        connected = f"[{rank}] [Gloo] Rank {rank} is connected to 1 peer ranks."
        assert any(line.startswith(connected) for line in verbose.stdout.splitlines())
        assert f"jaxkv.launch: process {rank} is PID " in verbose.stderr


def test_ps_shows_python_the_runner_the_script_and_its_arguments(tmp_path):
    """Each process's command line (what ``ps`` shows) is one short line, not the runner's
    source: ``python .../runner.py sleeper_job.py DIR``."""
    sleeper = os.path.join(HERE, "dist", "sleeper_job.py")
    proc = subprocess.Popen(
        [*LAUNCH, "-n", "2", sleeper, str(tmp_path)],
        env=cpu_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        files = [tmp_path / f"rank-{r}" for r in (0, 1)]
        while not all(f.exists() for f in files):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        for f in files:
            pid = int(f.read_text().split()[0])
            with open(f"/proc/{pid}/cmdline", "rb") as c:
                argv = c.read().rstrip(b"\0").decode().split("\0")
            assert argv == [sys.executable, RUNNER, sleeper, str(tmp_path)]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
