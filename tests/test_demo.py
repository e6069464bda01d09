"""``examples/demo.py`` (``make demo``) runs to the end and prints what each step shows."""

import re

import numpy as np
from _jobs import run_example


def _filled(value) -> str:
    """How the tutorial's 2x3 array holding ``value`` prints."""
    return str(np.full((2, 3), value, np.float32))


def test_demo_runs_and_shows_each_step():
    # The demo is a tour of 8 simulated CPU devices (jax.devices()): on CPU whatever this
    # machine's default backend is.
    proc = run_example("demo.py")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout

    headers = [
        "== Initialization ==",
        "== Push, aggregation and updater ==",
        "== Pull to several devices ==",
        "== List key-value pairs ==",
        "== Functional style ==",
        "== Data-parallel training on 8 devices ==",
    ]
    positions = [out.index(h) for h in headers]
    assert positions == sorted(positions)

    imperative = out[positions[0] : positions[4]]
    functional = out[positions[4] : positions[5]]
    for part in (imperative, functional):
        shown = [part.index(_filled(v)) for v in (2, 8, 4, 6, 3, 11)]
        assert shown == sorted(shown), part
    assert imperative.count("update on key: 3") == 1
    assert imperative.count("update on key: 5\nupdate on key: 7\nupdate on key: 9") == 2
    assert "still holds 4.0" in functional

    losses = [float(v) for v in re.findall(r"^step +\d+ +loss ([0-9.]+)", out, re.M)]
    assert len(losses) >= 4, out
    assert losses[-1] < losses[0] / 2, out
    diff = re.search(r"single-device training: (\S+)", out)
    assert diff is not None and float(diff.group(1)) < 1e-4
