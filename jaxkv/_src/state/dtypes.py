"""The dtype rule: which pushed values a key takes (those its dtype holds without loss)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv._src.errors import DtypeError, shown

__all__ = ["check_dtype", "holds"]

# A Python number (a weak-typed value) is judged by its kind, as JAX's promotion judges it: an
# int goes into any integer or floating key, a float into any floating key, a complex into a
# complex one.
_WEAK_INTO = {
    "b": (jnp.bool_, jnp.integer, jnp.floating, jnp.complexfloating),
    "i": (jnp.integer, jnp.floating, jnp.complexfloating),
    "f": (jnp.floating, jnp.complexfloating),
    "c": (jnp.complexfloating,),
}


def _kind(dtype: np.dtype) -> str:
    for kind, category in (
        ("b", jnp.bool_),
        ("i", jnp.integer),
        ("f", jnp.floating),
        ("c", jnp.complexfloating),
    ):
        if jnp.issubdtype(dtype, category):
            return kind
    return "?"


def holds(stored: Any, given: Any, weak: bool = False) -> bool:
    """Whether a key of dtype ``stored`` takes a value of dtype ``given`` without loss: the
    same dtype, a safe widening (NumPy's ``can_cast(..., 'safe')``: ``float16`` into
    ``float32``, ``uint8`` into ``int32``), or, for a Python number (``weak``), one of a kind
    the key holds."""
    stored, given = np.dtype(stored), np.dtype(given)
    if stored == given:
        return True
    if weak:
        return any(jnp.issubdtype(stored, c) for c in _WEAK_INTO.get(_kind(given), ()))
    return bool(np.can_cast(given, stored, "safe"))


def check_dtype(key: Any, x: Any, stored: Any, what: str) -> None:
    """Refuse ``x`` (an array or tracer) for a key stored as ``stored``'s dtype, unless the key
    holds it without loss (:func:`holds`): a float into an integer key, a float32 into a
    float16 key, an int32 into a float32 key (above 2**24) would each change the number."""
    if x.dtype == stored.dtype:  # the common case, before any conversion (every push)
        return
    given = jax.dtypes.canonicalize_dtype(x.dtype)  # NumPy's float64 is float32 in JAX
    dtype = np.dtype(stored.dtype)
    if holds(dtype, given, bool(getattr(x, "weak_type", False))):
        return
    raise DtypeError(
        f"key {shown(key)}: {what} has dtype {given.name}, which the key's dtype {dtype.name} "
        f"cannot hold without loss; expected {dtype.name} or a dtype that widens to it "
        f"safely. To cast on purpose, push value.astype({dtype.name!r}) (or init the key as "
        f"{given.name})"
    )
