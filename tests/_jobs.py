"""Launching the multi-process jobs of tests/dist/ as a user would: ``python -m jaxkv.launch``.

Every process a test starts that may use JAX runs on CPU devices (``cpu_env``): the jobs'
collectives are gloo's between CPU processes, and where an accelerator is JAX's default
backend here (``JAX_PLATFORMS=cuda,cpu`` on a GPU machine) each launched process would
otherwise take that one accelerator.
"""

import os
import subprocess
import sys

DIST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist")


def cpu_env(env=None, **extra):
    """``env`` (default: this process's environment) and ``extra``, with ``JAX_PLATFORMS=cpu``:
    the environment of a process that must run on CPU devices whatever this machine has. The
    suite's jobs check every sum they make across processes (``JAXKV_VERIFY_SUMS=1``, where
    users' jobs check a twentieth of each at every run) unless the environment says otherwise."""
    base = {"JAXKV_VERIFY_SUMS": "1", **(os.environ if env is None else env)}
    return {**base, **extra, "JAX_PLATFORMS": "cpu"}


def launch(n, script, *args, per_process=2, options=(), timeout=240):
    """``python -m jaxkv.launch -n N --devices-per-process K [OPTIONS...] tests/dist/SCRIPT
    ARGS...``, on CPU devices, its output captured as text."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxkv.launch",
            "-n",
            str(n),
            "--devices-per-process",
            str(per_process),
            *options,
            os.path.join(DIST, script),
            *map(str, args),
        ],
        env=cpu_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def expect_ok(run, n, checks, tag=""):
    """``run``, a job of ``n`` processes, ended with 0, and each of its ranks printed
    ``rank R ok [TAG ]CHECK`` for every one of ``checks``, then ``rank R done``."""
    shown = run.stdout + run.stderr
    assert run.returncode == 0, shown
    prefix = f"{tag} " if tag else ""
    for rank in range(n):
        for check in checks:
            assert f"rank {rank} ok {prefix}{check}" in run.stdout, shown
        assert f"rank {rank} done" in run.stdout, shown


def run_example(name, timeout=300):
    """``python examples/NAME`` from the repository's root, on CPU devices, its output captured
    as text: an example run as the README tells a user to run it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run(
        [sys.executable, os.path.join(root, "examples", name)],
        cwd=root,
        env=cpu_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def load_example(name):
    """``examples/NAME.py`` as a module named ``NAME`` (registered in ``sys.modules`` first:
    flax's dataclasses look their module up)."""
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "examples", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
