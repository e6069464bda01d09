"""jaxkv/_src/processes/runner.py: a launched process runs its script as ``python script.py``
would (``__main__``, ``sys.argv``, ``sys.path[0]``, an uncaught exception's traceback and exit
status), and leaves a failure note for the launcher."""

import os
import subprocess
import sys

RUNNER = os.path.join(
    os.path.dirname(__file__), "..", "..", "..", "jaxkv", "_src", "processes", "runner.py"
)


def _run(tmp_path, body, *args, env=None):
    script = tmp_path / "script.py"
    script.write_text(body)
    return subprocess.run(
        [sys.executable, RUNNER, str(script), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=60,
    )


def test_a_script_runs_as_python_runs_it(tmp_path):
    body = (
        "import sys, os\n"
        "print(__name__, sys.argv[1:], os.path.basename(__file__))\n"
        "print(sys.path[0] == os.path.dirname(os.path.realpath(__file__)))\n"
        "print('_jaxkv_run_script' in globals())\n"
    )
    run = _run(tmp_path, body, "a", "b")
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["__main__ ['a', 'b'] script.py", "True", "False"]


def test_an_uncaught_exception_is_reported_from_the_scripts_frame_and_noted(tmp_path):
    notes = tmp_path / "notes"
    notes.mkdir()
    run = _run(
        tmp_path,
        "def f():\n    raise ValueError('boom')\nf()\n",
        env={"JAXKV_LAUNCH_NOTES": str(notes), "JAXKV_PROCESS_ID": "3"},
    )
    assert run.returncode == 1
    assert "ValueError: boom" in run.stderr and "script.py" in run.stderr
    assert "runner.py" not in run.stderr.split("Traceback")[1].splitlines()[1]
    note = (notes / "failed-3").read_text().split()
    assert float(note[0]) > 0  # the time it failed (time.monotonic)


def test_an_exit_status_is_kept(tmp_path):
    assert _run(tmp_path, "import sys\nsys.exit(7)\n").returncode == 7
    assert _run(tmp_path, "import sys\nsys.exit(0)\n").returncode == 0
