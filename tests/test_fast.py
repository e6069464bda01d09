"""The private JAX names jaxkv uses for speed (``jaxkv/_src/jax_internals.py``) each have a public
fallback; ``JAXKV_NO_FAST_PATHS=1`` turns them all off, and the same tests must then still pass."""

import os
import subprocess
import sys
from pathlib import Path

import jaxkv._src.jax_internals

ROOT = Path(__file__).resolve().parent.parent


def test_fast_paths_follow_the_environment():
    off = os.environ.get("JAXKV_NO_FAST_PATHS", "") not in ("", "0")
    assert jaxkv._src.jax_internals.ENABLED is not off
    if off:
        assert (
            jaxkv._src.jax_internals.ArrayImpl is None
            and jaxkv._src.jax_internals.ShapedArray is None
        )


def test_the_public_fallbacks_give_the_same_results():
    """Pushes through every layout and collective, sharded storage and pulls into outs, with
    every private name off."""
    tests = ["tests/test_sums.py", "tests/test_sharded.py", f"{__file__}::{_this()}"]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
        cwd=ROOT,
        env=dict(os.environ, JAXKV_NO_FAST_PATHS="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout


def _this() -> str:
    return test_fast_paths_follow_the_environment.__name__
