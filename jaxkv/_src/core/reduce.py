"""Means: ``reduce="mean"``, each key's sum over its contributions divided once, after the
sum (and after decoding, under compression), by how many there were.

Eagerly a key's contributions are the values pushed to it in the call (one per device in a
list, duplicates of a key counted too); inside ``pmap``/``shard_map`` with ``axis_name``, each
device's values count once per device of the named axes, as ``jax.lax.pmean`` counts them, also
where JAX has already summed them (values invariant along the axes). The division is in the
sum's dtype (the stored one), so a mean of float values equals ``pmean``'s. Across processes,
an eager push adds every process's counts first (:func:`job_counts`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv._src.errors import KVStoreError, shown
from jaxkv._src.processes import host
from jaxkv._src.state import buckets
from jaxkv._src.state.kvstate import Key, KVState

__all__ = ["REDUCES", "axis_count", "check", "divide", "divisors", "effective", "job_counts"]

REDUCES = ("sum", "mean")


def check(reduce: Any, where: str = "reduce") -> str:
    """``reduce`` if it is one of :data:`REDUCES`, else a refusal."""
    if reduce not in REDUCES:
        raise KVStoreError(f"{where}: expected one of {list(REDUCES)}, given {reduce!r}")
    return str(reduce)


def effective(state: KVState, reduce: Any) -> str:
    """The reduction of a push: ``reduce`` where given, else the store's."""
    return state.reduce if reduce is None else check(reduce)


def divisors(
    state: KVState, keys: Sequence[Key], counts: Sequence[int], reduce: str, each: int = 1
) -> tuple[int, ...] | None:
    """Each key's divisor (its ``counts`` times ``each``: the devices of the summed axes), or
    ``None`` where nothing is divided (a sum, or a mean of one contribution each). A mean of
    an integer key is refused: its division would round."""
    if reduce == "sum":
        return None
    out = tuple(c * each for c in counts)
    if all(d == 1 for d in out):
        return None
    for key, d in zip(keys, out):
        dtype = buckets.stored_type(state, state.index(key)).dtype
        if d > 1 and not jnp.issubdtype(dtype, jnp.inexact):
            raise KVStoreError(
                f"key {shown(key)}: reduce='mean' expects a floating-point value (a mean of "
                f"integers would round), given dtype {np.dtype(dtype)}; push it with "
                "reduce='sum'"
            )
    return out


def job_counts(counts: Sequence[int]) -> list[int]:
    """Across processes, each key's contributions from every process together (each process
    counts only its own values): one host all-gather, in the store's order of collectives."""
    every = host.all_gather(np.asarray(counts, np.int64), "the counts of a mean")
    return [int(n) for n in np.asarray(every).reshape(-1, len(counts)).sum(0)]


def divide(pushed: list[Any], divisors: Sequence[int] | None) -> list[Any]:
    """Inside a push computation: each summed value divided by its divisor, in its dtype."""
    if divisors is None:
        return pushed
    return [x if d == 1 else x / jnp.asarray(d, x.dtype) for x, d in zip(pushed, divisors)]


def axis_count(names: Sequence[Any]) -> int:
    """Inside ``pmap``/``shard_map``: how many devices the named axes hold together."""
    return math.prod(int(jax.lax.psum(1, name)) for name in names)
