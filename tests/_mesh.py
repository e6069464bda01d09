"""Shared by the tests of stores on a mesh of two axes: the 2 x 4 mesh ``("data", "model")``
of the 8 CPU devices, and a jitted step run a few times with its compilations counted."""

import jax
import numpy as np
from jax.sharding import Mesh


def data_by_model() -> Mesh:
    """The 8 CPU devices as a 2 x 4 mesh ``("data", "model")``."""
    devices = jax.devices("cpu")
    assert len(devices) == 8, "tests expect 8 simulated CPU devices (see conftest.py)"
    return Mesh(np.array(devices).reshape(2, 4), ("data", "model"))


def stepped(fn, state, args, steps, compiles):
    """``state`` after ``steps`` calls of ``fn(state, *args)``, each waited for; asserts that
    only the first call compiles."""
    counts = []
    for _ in range(steps):
        with compiles() as c:
            state = jax.block_until_ready(fn(state, *args))
        counts.append(c.count)
    assert counts[1:] == [0] * (steps - 1), counts
    return state
