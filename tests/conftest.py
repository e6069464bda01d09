"""Fixtures shared by the tests (the 8 simulated CPU devices are set in the root conftest.py).

The suite runs on any default backend: tests that need several devices take the 8 CPU devices
by platform (the ``devices`` fixture, ``jax.devices("cpu")``); a test about the default device
uses it, and holds on CPU and on an accelerator alike. Processes the tests start run on CPU
(``_jobs.cpu_env``)."""

import contextlib
import logging

import jax
import pytest

# Scripts that tests/test_dist.py, tests/test_dist_loops.py and others run in launched
# processes: never import them here.
collect_ignore_glob = ["dist/*"]


class _CompileCounter(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.count = 0

    def emit(self, record):
        if "Compiling" in record.getMessage():
            self.count += 1


@pytest.fixture
def compiles():
    """A context manager counting XLA compilations: ``with compiles() as c: ...; c.count``."""

    @contextlib.contextmanager
    def counting():
        counter = _CompileCounter()
        logger = logging.getLogger("jax")  # jax.log_compiles logs "Compiling ..." at WARNING
        logger.addHandler(counter)
        try:
            with jax.log_compiles(True):
                yield counter
        finally:
            logger.removeHandler(counter)

    return counting


@pytest.fixture(autouse=True)
def _promotion(request):
    """Strict dtype promotion (root conftest.py), except for tests marked
    ``standard_promotion``: optax's Adam computes its bias correction with an implicit cast,
    so a reference run of optax by hand needs standard promotion."""
    if request.node.get_closest_marker("standard_promotion") is None:
        yield
        return
    with jax.numpy_dtype_promotion("standard"):
        yield


@pytest.fixture(scope="session")
def devices():
    """The 8 simulated CPU devices, asked for by platform: where an accelerator is JAX's default
    backend (``JAX_PLATFORMS=cuda,cpu``), ``jax.devices()`` gives the accelerator, and tests
    that need several devices name these, in the stores they make and the arrays they place."""
    devs = jax.devices("cpu")
    assert len(devs) == 8, "tests expect 8 simulated CPU devices (see conftest.py)"
    return devs


@pytest.fixture(params=["eager", "jit"])
def call(request):
    """Run a function of arrays eagerly or under ``jax.jit``, as chex's variants do.

    ``call(fn, *args)``: ``fn``'s array arguments are traced in the ``jit`` variant; anything
    static (keys, updaters) is closed over. Tests taking this fixture run once per variant.
    """
    if request.param == "eager":
        return lambda fn, *args: fn(*args)
    return lambda fn, *args: jax.jit(fn)(*args)
