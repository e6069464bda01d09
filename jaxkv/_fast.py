"""Every use of a private JAX name, each with its public fallback.

These save host time per value on the eager path (a push or pull of ResNet-50's 193 tensors
handles thousands of arrays). Each is feature-checked: another JAX without the private name
takes the public route, with the same results. ``JAXKV_NO_FAST_PATHS=1`` in the environment
(read at import) turns every one of them off; the test suite runs a check that way.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import jax
from jax.sharding import NamedSharding, SingleDeviceSharding

__all__ = ["ENABLED", "ArrayImpl", "assemble", "per_device", "single_device"]

ENABLED = os.environ.get("JAXKV_NO_FAST_PATHS", "") in ("", "0")

ArrayImpl: Any = None  # the concrete class of eager jax.Arrays, cheaper to test for than the ABC
ShapedArray: Any = None
if ENABLED:
    try:
        from jax._src.array import ArrayImpl
        from jax._src.core import ShapedArray
    except ImportError:  # another JAX: the public routes below still work
        ArrayImpl = ShapedArray = None


def single_device(x: jax.Array) -> jax.Device | None:
    """The device ``x`` lives on, or ``None`` if it spans several."""
    sharding = x.sharding
    if ENABLED and type(sharding) is SingleDeviceSharding:  # the common case, without a set
        device = getattr(sharding, "_device", None)
        if device is not None:
            return device
    devices = sharding.device_set
    return next(iter(devices)) if len(devices) == 1 else None


def assemble(shape: tuple[int, ...], sharding: NamedSharding, shards: list[jax.Array]):
    """``jax.make_array_from_single_device_arrays`` for shards already in the mesh's device
    order, with the same shape and dtype; skips the public function's per-call checks (a third
    of a push's host time on 193 keys) where this JAX offers that."""
    if ArrayImpl is not None and ShapedArray is not None:
        try:
            aval = _aval(shape, shards[0].dtype)
            return ArrayImpl(aval, sharding, shards, committed=True, _skip_checks=True)
        except TypeError:  # this JAX's constructor takes other arguments
            pass
    return jax.make_array_from_single_device_arrays(shape, sharding, shards)


@functools.lru_cache(maxsize=4096)
def _aval(shape: tuple[int, ...], dtype: Any) -> Any:
    return ShapedArray(shape, dtype)


def per_device(x: jax.Array) -> list[jax.Array]:
    """The single-device arrays of ``x``, one per device that holds a part of it."""
    arrays = getattr(x, "_arrays", None) if ENABLED else None  # the public route: ~10x slower
    return list(arrays) if arrays is not None else [s.data for s in x.addressable_shards]
