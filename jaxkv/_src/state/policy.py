"""The one placement policy of a store: which values are split over its devices and in what
blocks, which layouts bucket them, and which sums share one collective (``KVState.placement``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

from jaxkv._src.errors import KVStoreError

__all__ = [
    "AUTO_CPU_BELOW",
    "BIGARRAY_BOUND",
    "BOUND_ENV",
    "FUSE_BELOW",
    "Placement",
    "ROW_PADDING",
    "SCATTER_FUSE_BELOW",
    "block_rows",
    "bound_from",
    "default_bound",
    "is_sharded",
    "scatters_alone",
]

# Values with at least this many elements are stored sharded over the devices. MXNet's
# MXNET_KVSTORE_BIGARRAY_BOUND plays the same role (default 1e6); measured on 8 CPU devices,
# sharding from 16K elements up made push + pull of ResNet-50's parameters fastest.
BIGARRAY_BOUND = 1 << 14
# The environment variable that sets the bound of a store made without one (jaxkv.empty's
# default; an MXNet store reads MXNET_KVSTORE_BIGARRAY_BOUND, as MXNet does).
BOUND_ENV = "JAXKV_BIGARRAY_BOUND"
# Under the "auto" layout on CPU, values below this many elements that the store does not
# shard share buckets (docs/design.md).
AUTO_CPU_BELOW = 1 << 12
# Pushed values below this many elements are summed together through one flat buffer (one
# collective for many small arrays); larger ones whose rows divide over the devices are
# reduce-scattered one by one, which XLA's CPU collectives do much faster than an all-reduce.
# Measured, not derived from the bound: it stays put when the bound moves.
FUSE_BELOW = 1 << 14
# Reduce-scattered values below this many elements are reduce-scattered together, through one
# flat buffer: XLA's CPU collectives cost ~0.3 ms each however small the array.
SCATTER_FUSE_BELOW = 1 << 18
# A split value's blocks are whole rows where padding its rows to a multiple of the devices adds
# at most 1/ROW_PADDING of them (a table of 2048 rows over 3 devices: blocks of 683 rows, one
# row of zeros): its rows are then read and written in place, as a sharded table's are.
ROW_PADDING = 16


def default_bound() -> int | None:
    """The bound of a store made without one: ``JAXKV_BIGARRAY_BOUND`` (a positive number of
    elements, or ``none``: nothing is split), else :data:`BIGARRAY_BOUND`."""
    text = os.environ.get(BOUND_ENV, "").strip()
    return bound_from(BOUND_ENV) if text else BIGARRAY_BOUND


def bound_from(variable: str) -> int | None:
    """The bound the environment variable ``variable`` sets (a positive number of elements, or
    ``none``); a :class:`KVStoreError` naming it for anything else."""
    text = os.environ.get(variable, "").strip()
    if text.lower() == "none":
        return None
    try:
        bound = int(text)
    except ValueError:
        bound = 0
    if bound < 1:
        raise KVStoreError(
            f"{variable}: expected a positive number of elements or 'none', given {text!r}"
        )
    return bound


def block_rows(shape: tuple[int, ...], parts: int) -> int | None:
    """How many rows (along axis 0) each of a value's blocks over ``parts`` devices holds where
    its blocks are whole rows, else ``None``. They are whole rows where the rows divide by
    ``parts`` (the flattened value's ``1/parts`` is then exactly those rows), and also where
    padding the rows to a multiple of ``parts`` adds at most ``1/ROW_PADDING`` of them.
    Otherwise (a value of few rows, or none) the flattened value is padded to a multiple of
    ``parts``."""
    if not shape:
        return None
    rows = -(-shape[0] // parts)
    return rows if (rows * parts - shape[0]) * ROW_PADDING <= shape[0] else None


def scatters_alone(size: int) -> bool:
    """Whether a reduce-scattered block of ``size`` elements has a collective of its own (else
    it shares one flat buffer with the other small blocks)."""
    return size >= SCATTER_FUSE_BELOW


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a store over ``shards`` devices (along its axis) puts a value, given its bound.

    Every layout asks it (the store, its buckets, the sums of a push, the row operations), and
    so do the tests of the default placement, rather than assuming the default bound (a test
    of split values gives its store the bound it assumes; :meth:`smallest_split` and
    :meth:`largest_whole` give shapes on either side of a bound).
    """

    shards: int
    bound: int | None = BIGARRAY_BOUND

    def splittable(self, shape: tuple[int, ...]) -> bool:
        """Whether a value of ``shape`` is big enough to split (at least the bound's elements,
        not a scalar, over more than one device)."""
        return _splittable(tuple(shape), self.shards, self.bound)

    def is_sharded(self, shape: tuple[int, ...]) -> bool:
        """Whether a value (or optimizer-state leaf) of ``shape`` is stored sharded along its
        rows: big enough to split, its rows divided by the devices."""
        return is_sharded(tuple(shape), self.shards, self.bound)

    def pads(self, shape: tuple[int, ...]) -> bool:
        """Whether a value of ``shape`` is big enough to split but its rows do not divide over
        the devices: it is split padded instead (by whole rows, or flattened:
        :func:`block_rows`), in a split bucket, never kept whole."""
        shape = tuple(shape)
        return _splittable(shape, self.shards, self.bound) and shape[0] % self.shards != 0

    def block_rows(self, shape: tuple[int, ...]) -> int | None:
        """:func:`block_rows` over this store's devices."""
        return block_rows(tuple(shape), self.shards)

    def scatters(self, shape: tuple[int, ...], processes: int = 1) -> bool:
        """Whether a pushed value of ``shape`` is reduce-scattered (else summed in one fused
        all-reduce with the other small values). Across processes only the values the store
        shards are: gloo's reduce-scatter costs what an all-reduce does, and the value would
        then need an all-gather as well."""
        shape = tuple(shape)
        sharded = self.is_sharded(shape)
        if processes > 1 or sharded:
            return sharded
        return len(shape) > 0 and shape[0] % self.shards == 0 and math.prod(shape) >= FUSE_BELOW

    def splits_bucket(self, size: int) -> bool:
        """Whether a bucket of ``size`` elements shared by several small values (the flat
        layout) is split over the devices: at least the bound's elements, over more than one
        device (a bucket of one padded value is split whatever its size)."""
        return self.shards > 1 and self.bound is not None and size >= self.bound

    def smallest_split(self, width: int = 1) -> tuple[int, int] | None:
        """The smallest ``(rows, width)`` shape the store shards (rows a multiple of the
        devices), or ``None`` where it shards nothing."""
        if self.bound is None or self.shards < 2:
            return None
        rows = -(-self.bound // width)
        return (-(-rows // self.shards) * self.shards, width)

    def largest_whole(self, width: int = 1) -> tuple[int, int]:
        """The largest ``(rows, width)`` shape the store keeps whole on every device (rows a
        multiple of the devices, so that only its size keeps it whole)."""
        if self.bound is None or self.shards < 2:
            return (self.shards * 1024, width)
        rows = (self.bound - 1) // width // self.shards * self.shards
        return (max(rows, 0), width)


@functools.lru_cache(maxsize=4096)
def _splittable(shape: tuple[int, ...], n: int, bound: int | None) -> bool:
    return bound is not None and n > 1 and len(shape) > 0 and math.prod(shape) >= bound


@functools.lru_cache(maxsize=4096)
def is_sharded(shape: tuple[int, ...], n: int, bound: int | None) -> bool:
    """:meth:`Placement.is_sharded` of ``Placement(n, bound)``, for the store's own hot path
    (asked for every value of every push and pull: cached, since shapes repeat)."""
    return _splittable(shape, n, bound) and shape[0] % n == 0
