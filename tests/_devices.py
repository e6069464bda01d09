"""Stores over the 8 simulated CPU devices (root conftest.py), named by platform.

``jaxkv.create(name)`` and ``jaxkv.empty()`` take JAX's default backend's devices: where an
accelerator is the default backend (``JAX_PLATFORMS=cuda,cpu``), that is one GPU. Tests about
several devices build their stores over ``jax.devices("cpu")`` instead (the ``devices`` fixture
of tests/conftest.py gives the same 8), so they check the same layouts on any backend.
"""

import jax

import jaxkv


def cpu_store(name="local", layout=None):
    """``jaxkv.create(name)``, over the 8 CPU devices (in ``layout``: default ``JAXKV_LAYOUT``,
    else ``'auto'``)."""
    return jaxkv.KVStore(name, devices=jax.devices("cpu"), layout=layout)


def cpu_empty(**options):
    """``jaxkv.empty(**options)``, over the 8 CPU devices."""
    return jaxkv.empty(jax.devices("cpu"), **options)
