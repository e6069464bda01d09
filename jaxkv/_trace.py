"""Push inside the user's trace (``jit``, ``pmap``, ``shard_map``): the updater runs in the
caller's trace, and ``axis_name`` sums each value over the mapped axes exactly once."""

from __future__ import annotations

import functools
import operator
from typing import Any

import jax

from ._collectives import axis_sum
from ._errors import KVStoreError
from ._push import apply_updater
from ._state import Key, KVState

__all__ = ["push_in_trace"]


def push_in_trace(
    state: KVState,
    grouped: dict[Key, list[jax.Array]],
    stored: list[Any],
    opts: list[Any],
    updater: Any,
    axis_name: Any,
) -> KVState:
    """``push`` of the validated contributions ``grouped`` (with their keys' stored values and
    optimizer states) when any of them is traced."""
    if state.compression is not None:
        raise KVStoreError(
            f"keys {list(grouped)}: a store with gradient compression {state.compression} "
            "expects eager pushes, given traced values (inside jit, compress with the "
            "caller's own code)"
        )
    new_v, new_o = {}, {}
    for (key, xs), s, o in zip(grouped.items(), stored, opts):
        total = functools.reduce(operator.add, [x.astype(s.dtype) for x in xs])
        if axis_name is not None:
            total = axis_sum(total, axis_name)
        new_v[key], new_o[key] = apply_updater(updater, key, total, s, o)
    return state.replace(new_v, new_o)
