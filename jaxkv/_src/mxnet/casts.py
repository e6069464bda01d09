"""MXNet 1.9.1's cast of a pushed value to its key's dtype, for the drop-in's store."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["mxnet_cast"]

# The integer dtypes whose cast from a float MXNet makes through a 32-bit integer (C's cast, as
# x86 runs it: a truncation toward zero, INT_MIN for NaN, infinities and values beyond int32's
# range, then the low bits).
_THROUGH_INT32 = frozenset(map(np.dtype, ("int8", "uint8", "int16", "uint16", "int32")))


def castable(dtype: Any) -> bool:
    """Whether :func:`mxnet_cast` gives MXNet's value for a key of ``dtype``: floats, and the
    integers of 32 bits or fewer (the others are refused as jaxkv's own store refuses them)."""
    dtype = np.dtype(dtype)
    return dtype in _THROUGH_INT32 or jnp.issubdtype(dtype, jnp.floating)


def mxnet_cast(x: jax.Array, dtype: Any) -> jax.Array:
    """``x`` as MXNet 1.9.1 casts a value pushed into a key of ``dtype``: a float into an
    integer truncates toward zero through int32 and keeps the low bits (300.0 into uint8 is 44,
    -1.7 is 255, 70000.0 is 112; NaN, infinities and values beyond int32's range give INT_MIN's
    low bits); other casts round as NumPy's ``astype`` does."""
    dtype = np.dtype(dtype)
    if x.dtype == dtype:
        return x
    if dtype in _THROUGH_INT32 and jnp.issubdtype(x.dtype, jnp.floating):
        wide = x.astype(jnp.float32)
        inside = jnp.abs(wide) < 2.0**31  # False for NaN and the infinities too
        whole = jnp.where(inside, jnp.trunc(wide), 0.0).astype(jnp.int32)
        x = jnp.where(inside, whole, jnp.iinfo(jnp.int32).min)
    return x.astype(dtype)
