"""Launching the multi-process jobs of tests/dist/ as a user would: ``python -m jaxkv.launch``."""

import os
import subprocess
import sys

DIST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist")


def launch(n, script, *args, per_process=2, timeout=240):
    """``python -m jaxkv.launch -n N --devices-per-process K tests/dist/SCRIPT ARGS...``, its
    output captured as text."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxkv.launch",
            "-n",
            str(n),
            "--devices-per-process",
            str(per_process),
            os.path.join(DIST, script),
            *map(str, args),
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
