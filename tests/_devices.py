"""Stores over the 8 simulated CPU devices (root conftest.py), named by platform.

``jaxkv.create(name)`` and ``jaxkv.empty()`` take JAX's default backend's devices: where an
accelerator is the default backend (``JAX_PLATFORMS=cuda,cpu``), that is one GPU. Tests about
several devices build their stores over ``jax.devices("cpu")`` instead (the ``devices`` fixture
of tests/conftest.py gives the same 8), so they check the same layouts on any backend.
"""

import jax

import jaxkv

# The bound a test of split values gives its store (jaxkv.empty's ``bigarray_bound``), so that
# it takes the split path whatever the default is (``JAXKV_BIGARRAY_BOUND``, else the policy's
# BIGARRAY_BOUND): a test that assumes a value is split states the bound it assumes, and one
# about the default asks the store's placement (``state.placement``). ``make test-deep`` runs
# the tests of placement again under other defaults (tests/test_bounds.py).
SPLIT_BOUND = 1 << 14


def cpu_store(name="local", layout=None):
    """``jaxkv.create(name)``, over the 8 CPU devices (in ``layout``: default ``JAXKV_LAYOUT``,
    else ``'auto'``)."""
    return jaxkv.KVStore(name, devices=jax.devices("cpu"), layout=layout)


def cpu_empty(**options):
    """``jaxkv.empty(**options)``, over the 8 CPU devices."""
    return jaxkv.empty(jax.devices("cpu"), **options)


def held_per_device(state, key):
    """Bytes of ``key``'s stored value that each device holds: its own array's shards, or under
    the flat layout its share of its bucket (all of it in a bucket kept whole on every device,
    its block in a bucket split over the devices)."""
    i = state.keys().index(key)
    flat = state.flat_layout
    if flat is None or flat.where[i][0] < 0:
        leaf = state[key]
        per = {}
        for s in leaf.addressable_shards:
            per[s.device] = per.get(s.device, 0) + s.data.nbytes
        return per
    from jaxkv._src.state.buckets import block

    b, _, size = flat.where[i]
    parts = flat.parts_of(b)
    itemsize = state.leaves[b].dtype.itemsize
    count = block(flat.shapes[i], parts) if parts > 1 else size
    return {s.device: count * itemsize for s in state.leaves[b].addressable_shards}


def split_buckets(state):
    """Whether ``state`` keeps some of its values in buckets split over the devices."""
    return state.flat_layout is not None and state.flat_layout.split
