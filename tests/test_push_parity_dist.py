"""tests/test_push_parity.py's cases across two processes (tests/dist/parity_job.py): each
option of ``jaxkv.push``, both values of it each pushed twice, through the eager paths (a list
of keys, a mapping, per-device values), inside the user's ``jax.jit`` and inside the user's
``shard_map``, into stores of one array per key and flat ones, spanning 2 processes of 2 CPU
devices; every process's own values summed, every result against the NumPy model, the
processes agreeing bit for bit. A push computation's cache key without an option fails it.

One job runs the cases a test names: a covering set (every pair of an option, a path and a
layout) in ``make test-whole``, every combination in ``make test-deep``.
"""

import re

import pytest
from _jobs import expect_ok, launch
from _variants import covering
from test_push_parity import EAGER, LAYOUTS, OPTIONS, TRACED

# (option, path, layout), as tests/test_push_parity.py's test_each_option_of_push_on_each_path
# lists them: the options a trace takes no part in on the eager paths only.
_PARAMS = covering(EAGER, LAYOUTS, list(OPTIONS)) + covering(["jit", "shard_map"], LAYOUTS, TRACED)
EVERY = [(o, p, layout) for p, layout, o in (param.values for param in _PARAMS)]
COVERING = [
    (o, p, layout) for param in _PARAMS if not param.marks for p, layout, o in [param.values]
]


def _run(cases, *flags, timeout=600):
    return launch(2, "parity_job.py", ",".join(":".join(c) for c in cases), *flags, timeout=timeout)


@pytest.mark.parametrize(
    "cases",
    [
        pytest.param(COVERING, id="covering"),
        pytest.param(EVERY, id="every", marks=pytest.mark.deep),
    ],
)
def test_each_option_of_push_on_each_path_across_processes(cases):
    """Both processes compute the model's values for every case, bit for bit alike; an eager
    push of one array over every process's devices is refused, naming the key."""
    checks = [" ".join(c) for c in cases] + ["refused: a value over every process"]
    expect_ok(_run(cases), 2, checks)


# (the fields left out of the push computations' key, the case that must then fail; each in
# COVERING, so make test-whole runs it whole too): in make test-whole the mean's divisors and reduce
# option, which across processes count every process's values (one value per process: a mean
# divides by 2, the computation of the sum taken for it without them); the others in make
# test-deep.
DROPPED = [
    pytest.param("divisors,reduce", ("reduce", "plan", "flat"), id="divisors"),
    pytest.param("updater", ("updater", "general", "flat"), id="updater", marks=pytest.mark.deep),
    pytest.param("donate", ("donate", "devices", "keys"), id="donate", marks=pytest.mark.deep),
]


@pytest.mark.parametrize(("field", "case"), DROPPED)
def test_an_option_left_out_of_the_key_is_caught_across_processes(field, case):
    """The push computations' cache without ``field`` in its key (``--drop``): the job ends
    with an error, a rank naming the case's mismatch (the case passes with the whole key)."""
    assert case in COVERING
    run = _run([case], "--drop", field, timeout=300)
    shown = run.stdout + run.stderr
    what = " ".join(case)
    assert run.returncode != 0, shown
    assert re.search(rf"rank \d mismatch {what}: ", run.stdout), shown
    assert f"ok {what}" not in run.stdout, shown
