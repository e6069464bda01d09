"""Test set-up shared by tests/ and the doctests: 8 simulated CPU devices, before JAX starts, and
strict dtype promotion, so an implicit cast in jaxkv shows up as an error (as equinox does).
Tests marked ``standard_promotion`` run optax's Adam by hand, which needs standard promotion."""

import atexit
import os
import shutil
import tempfile

# JAX's persistent compilation cache, one folder for the whole run: its xdist workers and every
# process a test launches (they inherit the environment) load a computation another has compiled
# instead of compiling it again (the same HLO, devices and options: the same executable), which
# takes about a third off the suite. The process that makes the folder removes it at its exit;
# a folder already set (JAX_COMPILATION_CACHE_DIR) is used as it is. Benchmarks never use one:
# they time start-up as users meet it.
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    _cache = tempfile.mkdtemp(prefix="jaxkv-tests-jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402 (after the cache's settings, which JAX reads as it starts)

jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update(
    "jax_persistent_cache_min_compile_time_secs",
    float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]),
)
jax.config.update(
    "jax_persistent_cache_min_entry_size_bytes",
    int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]),
)
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_dtype_promotion", "strict")

# Sphinx's configuration is no module of jaxkv (--doctest-modules would import it, and Sphinx,
# which only the docs extra installs); the built site is no test input.
collect_ignore = ["docs/conf.py", "docs/_build"]


def pytest_sessionfinish(session):
    """An xdist worker saves its coverage data (``make test``'s ``coverage run``, which
    starts one in each worker) once its tests are done, not only at its exit: xdist kills a
    worker still exiting after 10 seconds (execnet's ``EXIT_TIMEOUT``), and a worker killed
    then left no data (seen in ``make test``: 74 % instead of 95 %, no error)."""
    if not hasattr(session.config, "workerinput"):
        return
    try:
        import coverage
    except ImportError:  # (a run without the test extra's coverage)
        return
    measuring = coverage.Coverage.current()
    if measuring is not None:
        measuring.stop()
        measuring.save()
