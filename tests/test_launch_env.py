"""The environment ``python -m jaxkv.launch`` gives the processes it starts: huge-page malloc
(GLIBC_TUNABLES=glibc.malloc.hugetlb=1) unless the user set GLIBC_TUNABLES, which is kept."""

import os
import subprocess
import sys

import pytest

from jaxkv.launch import HUGETLB_MALLOC, launch, process_env

# Prints what a launched process sees; imports neither jax nor jaxkv, so it starts fast.
SCRIPT = """\
import os
print(f"rank {os.environ['JAXKV_PROCESS_ID']} GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES')!r}")
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "show_env.py"
    path.write_text(SCRIPT)
    return str(path)


def run_launcher(script, env):
    return subprocess.run(
        [sys.executable, "-m", "jaxkv.launch", "-n", "2", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_launched_processes_get_huge_page_malloc(script):
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    run = run_launcher(script, env)
    assert run.returncode == 0, run.stderr
    for rank in range(2):
        assert f"rank {rank} GLIBC_TUNABLES='glibc.malloc.hugetlb=1'" in run.stdout


@pytest.mark.parametrize("users", ["glibc.malloc.arena_max=2", ""])
def test_a_users_glibc_tunables_are_kept(script, users):
    run = run_launcher(script, {**os.environ, "GLIBC_TUNABLES": users})
    assert run.returncode == 0, run.stderr
    for rank in range(2):
        assert f"rank {rank} GLIBC_TUNABLES={users!r}" in run.stdout


def test_launch_in_process(script, monkeypatch, capfd):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert launch(1, [script]) == 0
    assert f"GLIBC_TUNABLES={HUGETLB_MALLOC!r}" in capfd.readouterr().out
    assert "GLIBC_TUNABLES" not in os.environ  # the launcher's own environment is unchanged


def test_process_env():
    assert process_env({})["GLIBC_TUNABLES"] == HUGETLB_MALLOC
    mine = {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0", "A": "1"}
    assert process_env(mine) == mine
    assert process_env(mine) is not mine
