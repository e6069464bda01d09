"""Pairing keys with values as MXNet does, and checking them before anything changes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from jaxkv._src.errors import KVStoreError, ShapeError, shown
from jaxkv._src.jax_internals import ArrayImpl
from jaxkv._src.state import buckets
from jaxkv._src.state.dtypes import check_dtype
from jaxkv._src.state.kvstate import Key, KVState, normalize_key

__all__ = [
    "MISSING",
    "as_array",
    "as_value",
    "check_value",
    "devices_of",
    "group",
    "is_traced",
    "pairs",
]

MISSING = object()  # ``values`` not given: ``keys`` is a mapping


def _as_list(v: Any) -> list:
    return list(v) if isinstance(v, list | tuple) else [v]


def pairs(keys: Any, values: Any, what: str) -> list[tuple[Key, list]]:
    """MXNet's pairing: ``(key, value)``, ``(key, [per-device values])``, ``([keys], [values])``,
    ``([keys], [[per-device values], ...])``, or one mapping ``{key: value}``.

    Returns a list of ``(key, [values])`` in call order; keys may repeat.
    """
    if values is MISSING:
        if not isinstance(keys, Mapping):
            raise KVStoreError(
                f"expected a mapping {{key: {what[:-1]}}} or keys and {what}, "
                f"given only {type(keys).__name__} {shown(keys)}"
            )
        keys, values = list(keys.keys()), list(keys.values())
    if isinstance(keys, list | tuple):
        if not isinstance(values, list | tuple) or len(values) != len(keys):
            given = f"{len(values)} {what}" if isinstance(values, list | tuple) else "one"
            raise ShapeError(
                f"keys {list(keys)!r}: expected {len(keys)} {what} (one per key), given {given}"
            )
        out = [(normalize_key(k), _as_list(v)) for k, v in zip(keys, values)]
    else:
        out = [(normalize_key(keys), _as_list(values))]
    for k, vs in out:
        if not vs:
            raise ShapeError(
                f"key {shown(k)}: expected at least one {what[:-1]}, given an empty list"
            )
    return out


def is_traced(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def as_array(x: Any) -> jax.Array:
    if type(x) is ArrayImpl or isinstance(x, jax.Array):  # the first test is the cheap one
        return x
    if hasattr(x, "__jax_array__"):
        return x.__jax_array__()
    return jnp.asarray(x)


def check_value(key: Key, x: jax.Array, stored: Any, what: str, whole: Any = None) -> None:
    """Refuse a value of another shape than the stored one (``whole``, the shape of the whole
    value, where ``stored`` is only this device's block of it inside ``shard_map``: either
    shape is accepted then), or a complex value for a real one."""
    whole = tuple(stored.shape) if whole is None else tuple(whole)
    if tuple(x.shape) not in (whole, tuple(stored.shape)):
        block = "" if whole == tuple(stored.shape) else f" or this device's block {stored.shape}"
        raise ShapeError(
            f"key {shown(key)}: {what} has shape {tuple(x.shape)}, expected the stored shape "
            f"{whole}{block} (dtype {stored.dtype})"
        )
    check_dtype(key, x, stored, what)


def as_value(key: Key, v: Any, what: str) -> jax.Array:
    """``v`` as an array, or a refusal naming the key where it is not one (``None``, a str,
    a dict, an object)."""
    if type(v) is ArrayImpl or isinstance(v, jax.Array):
        return v
    try:
        x = as_array(v)
    except (TypeError, ValueError) as e:
        raise KVStoreError(
            f"key {shown(key)}: {what} is {type(v).__name__} {shown(v)}, expected an array "
            "(a jax.Array, a NumPy array, an NDArray) or a number"
        ) from e
    if not (jnp.issubdtype(x.dtype, jnp.number) or jnp.issubdtype(x.dtype, jnp.bool_)):
        raise KVStoreError(
            f"key {shown(key)}: {what} has dtype {x.dtype}, expected an array of numbers"
        )
    return x


def group(
    state: KVState, keys: Any, values: Any, pending: Mapping[Key, Any] | None = None
) -> dict[Key, list[jax.Array]]:
    """Validated contributions per distinct key, in a canonical (sorted) key order; a key of
    ``pending`` (inits not yet run: key -> value) is checked against that value."""
    grouped: dict[Key, list[jax.Array]] = {}
    for key, vs in pairs(keys, values, "values"):
        if pending and key in pending:
            stored = pending[key]
            whole = stored.shape
        else:
            i = state.index(key)
            stored, whole = buckets.stored_type(state, i), state.key_shapes[i]
            if state.tp_spec(key) is not None and tuple(stored.shape) != whole:
                whole = state.local_shape(key)  # in shard_map over the axes of its own split
        arrays = []
        for n, v in enumerate(vs):
            what = "the pushed value" if len(vs) == 1 else f"pushed value {n}"
            x = as_value(key, v, what)
            check_value(key, x, stored, what, whole)
            arrays.append(x)
        grouped.setdefault(key, []).extend(arrays)
    return {k: grouped[k] for k in sorted(grouped)}


def devices_of(devices: Any) -> tuple[jax.Device, ...]:
    """A device, a context, or a list of them, as a tuple of JAX devices."""
    from jaxkv._src.devices import Context

    items = list(devices) if isinstance(devices, list | tuple) else [devices]
    out = tuple(d.device if isinstance(d, Context) else d for d in items)
    if not out or not all(isinstance(d, jax.Device) for d in out) or len(set(out)) != len(out):
        raise KVStoreError(
            f"devices: expected a device or a list of distinct devices, given {devices!r}"
        )
    return out
