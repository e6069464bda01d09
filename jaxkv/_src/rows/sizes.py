"""Row counts rounded up to a few sizes, and rows padded and cut to them, so that batches of
varying size compile nothing new."""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv._src.processes import order

__all__ = [
    "Padded",
    "concat_rows",
    "cut",
    "exact",
    "fit",
    "on_host_cheaply",
    "pad_ids",
    "pad_rows",
    "padded",
    "route",
    "slots",
    "sorted_distinct",
]


def slots(most: int) -> int:
    """``most`` rounded up to a multiple of an eighth of its power of two (at least 8): 8 sizes
    per octave, so a count that varies from step to step (a batch's distinct rows, the
    busiest route of a sharded table) meets a new size only when it grows past one of them,
    and pads at most 1/8 (1,000 random ids per device over 8 devices: about 150 on the
    busiest route, C = 160; rounding to a power of two, 256, measured 1.8x slower)."""
    most = max(most, 1)
    step = max(8, 1 << max(most.bit_length() - 4, 0))
    return -(-most // step) * step


def padded(n: int) -> int:
    """The count a computation over ``n`` rows is compiled for (see :func:`slots`): the rows
    past ``n`` are padding, whose ids select no row (``-1``) and whose rows are zeros."""
    return slots(n)


# How many exact counts a place of the code compiles for before it pads: a workload of one
# size pads nothing (padding costs a copy of the rows and up to 1/8 more rows to compute), one
# whose count varies meets a few padded sizes from its second count on. (Two exact counts cost
# a loop whose count varies a compile of its whole row computation that no later step uses:
# 0.2-0.3 s for MXNet's embedding loop on one device, which MXNet never pays.)
EXACT = 1
_SEEN: dict[Any, set[int]] = {}


def fit(site: Any, n: int) -> int:
    """The count a computation at ``site`` (a hashable naming the place and the key) is run
    for, given ``n`` rows: ``n`` itself where the site has met ``n`` before or fewer than
    ``EXACT`` counts, else :func:`padded`. Across processes it is called with the agreed
    count, in the same order everywhere, so every process pads alike."""
    seen = _SEEN.get(site)
    if seen is None:
        if len(_SEEN) >= 4096:  # (sites of keys long gone: start again)
            _SEEN.clear()
        seen = _SEEN[site] = set()
    if n in seen:
        return n
    if len(seen) < EXACT:
        seen.add(n)
        return n
    return padded(n)


def route(most: int, n: int, parts: int) -> int:
    """``C``, the slots of each route of an all-to-all of ``n`` (padded) ids per device to
    ``parts`` owners whose busiest route takes ``most``: at least an even share and 2.5 of
    its standard deviations (random ids: at most the share's square root), so that ``C``
    follows the padded count (a few sizes) unless a route is much busier than chance makes
    it, and a busiest route that moves from step to step compiles nothing new (9/8 of the
    share, at 3 processes of 129-143 rows, met a new size at steps 3 to 5)."""
    share = -(-n // parts)
    return slots(max(most, share + math.ceil(2.5 * math.sqrt(share))))


def sorted_distinct(ids: np.ndarray) -> bool:
    """Whether the (checked) host ids are sorted and distinct."""
    return ids.size < 2 or bool(np.all(ids[1:] > ids[:-1]))


def pad_ids(ids: np.ndarray, to: int, fill: int = -1) -> np.ndarray:
    """Host ids padded to ``to`` with ``fill`` (an id outside the table: it reads zeros and
    updates nothing)."""
    if ids.size == to:
        return ids.astype(np.int32, copy=False)
    return np.concatenate([ids, np.full(to - ids.size, fill, np.int32)]).astype(np.int32)


def on_host_cheaply(x: jax.Array) -> bool:
    """Whether ``x`` lives in host memory (CPU devices), where a copy through NumPy compiles
    nothing and costs a memcpy."""
    return x.is_fully_addressable and all(d.platform == "cpu" for d in x.devices())


def pad_rows(rows: Any, to: int) -> Any:
    """``rows`` with rows of zeros appended up to ``to``, where it is: on the host for NumPy
    rows, and through the host on CPU devices (no computation, so no compile for a new count);
    elsewhere one small computation per count, compiled once."""
    n = rows.shape[0]
    if n == to:
        return rows
    numpy = isinstance(rows, np.ndarray)
    if numpy or on_host_cheaply(rows):
        host = np.zeros((to, *rows.shape[1:]), rows.dtype)
        host[:n] = np.asarray(rows)
        return host if numpy else order.put(host, rows.sharding)
    return _pad_on_device(rows, to)


@functools.partial(jax.jit, static_argnums=1)
def _pad_on_device(rows: jax.Array, to: int) -> jax.Array:
    return jnp.concatenate([rows, jnp.zeros((to - rows.shape[0], *rows.shape[1:]), rows.dtype)])


class Padded(NamedTuple):
    """Rows computed for a padded count: the first ``n`` rows of ``rows`` are the result
    (a caller that only hands them on, an MXNet out, cuts them when they are read)."""

    rows: jax.Array
    n: int

    def cut(self) -> jax.Array:
        return cut(self.rows, self.n)


def exact(x: Any) -> jax.Array:
    """``x`` itself, or a :class:`Padded` result cut to its count."""
    return x.cut() if isinstance(x, Padded) else x


def cut(x: jax.Array, n: int) -> jax.Array:
    """The first ``n`` rows of ``x`` (a result computed for a padded count), where ``x`` is:
    through the host on CPU devices; elsewhere a slice, compiled once per count."""
    if x.shape[0] == n:
        return x
    if on_host_cheaply(x):
        return order.put(np.asarray(x)[:n], x.sharding)
    return x[:n]


def concat_rows(rows: list[Any], sharding: Any, to: int, dtype: Any = None) -> jax.Array:
    """``rows`` (arrays of rows, of one trailing shape) one after the other, zeros appended up to
    ``to``, placed with ``sharding``, in ``dtype`` (default: their common one): through the host
    where they all are in host memory (no computation), else one concatenation, compiled once
    per list of counts."""
    dtype = np.result_type(*[r.dtype for r in rows]) if dtype is None else np.dtype(dtype)
    if all(not isinstance(r, jax.Array) or on_host_cheaply(r) for r in rows):
        n = sum(r.shape[0] for r in rows)
        host = np.zeros((to, *rows[0].shape[1:]), dtype)
        host[:n] = np.concatenate([np.asarray(r) for r in rows])
        return order.put(host, sharding)
    placed = jax.device_put(list(rows), [sharding] * len(rows))
    return pad_rows(_concat(tuple(placed)).astype(dtype), to)


@jax.jit
def _concat(rows: tuple) -> Any:
    dtype = jnp.result_type(*rows)
    return jnp.concatenate([r.astype(dtype) for r in rows])
