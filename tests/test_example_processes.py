"""``examples/flax_processes.py`` as the README runs it: a flax MLP trained by 2 launched
processes through jaxkv (sharded init, each process's own rows, the gather + push step),
checkpointed every 4 steps; rank 1 of the first attempt is SIGKILLed at step 6, the launcher
restarts the job, which resumes from step 4 and ends where one-device optax ends."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _jobs import cpu_env

pytest.importorskip("flax", reason="flax (the examples extra) is not installed")
pytest.importorskip("orbax.checkpoint")

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "flax_processes.py"


def test_killed_and_resumed_it_ends_where_one_device_optax_ends(tmp_path):
    command = [sys.executable, "-m", "jaxkv.launch", "-n", "2", "--max-restarts", "1"]
    command += [str(EXAMPLE), str(tmp_path), "--steps", "12", "--every", "4", "--kill-at", "6"]
    run = subprocess.run(
        command, env=cpu_env(), capture_output=True, text=True, timeout=400, cwd=os.getcwd()
    )
    text = run.stdout + run.stderr
    assert run.returncode == 0, text
    assert "[1] rank 1 kills itself at step 6" in text, text
    assert "restarting the job (restart 1 of 1)" in text, text
    for rank in (0, 1):
        assert f"rank {rank} starts at step 0 of 12" in text, text
        assert f"rank {rank} starts at step 4 of 12" in text, text
    diff = re.search(r"max \|jaxkv - optax\| = (\S+)", run.stdout)
    assert diff is not None, text
    assert float(diff.group(1)) < 1e-6, text
    assert sorted(os.listdir(tmp_path)) == ["12", "8"]  # max_to_keep=2


def test_the_readmes_dist_sync_example_prints_the_sum_over_both_processes():
    """``examples/dist_sync.py``, launched as the README shows: 2 processes of 4 devices, each
    pushing ones from its devices, each pulling their sum (8) and printing it with its rank."""
    script = EXAMPLE.parent / "dist_sync.py"
    command = [sys.executable, "-m", "jaxkv.launch", "-n", "2", "--devices-per-process", "4"]
    run = subprocess.run(
        [*command, str(script)], env=cpu_env(), capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout + run.stderr
    lines = sorted(line for line in run.stdout.splitlines() if " of 2:" in line)
    assert lines == ["[0] rank 0 of 2: [8. 8. 8.]", "[1] rank 1 of 2: [8. 8. 8.]"], run.stdout
