"""The row arithmetic and the compiled computations that read, route and update a table's rows
(used by ``ops.py``, which checks the ids on the host and picks one of these per call).

Each works on a whole table or on one device's block of it (``Where``), or on a key's run of
elements in a flat bucket (``InRun``). Inside ``shard_map``, ``plan`` places each device's ids in
the slots of one all-to-all, ``exchange`` sends them (a push's rows beside them) to their owners,
and ``dedupe`` sums the duplicates an owner gets; ``update_rows`` applies the updater to the
touched rows (an optax updater also to the same rows of its per-parameter state).

For the HLO's op names and a profiler trace, rows moved between devices are traced under
``jax.named_scope(ROUTE)`` (``jaxkv.rows.route``), duplicates summed under ``jaxkv.sum`` and the
update under ``jaxkv.updater``.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jaxkv._src.core import checked
from jaxkv._src.core.collectives import SUM, psum_scatter
from jaxkv._src.core.on_blocks import UPDATER
from jaxkv._src.core.on_buckets import elementwise as _elementwise
from jaxkv._src.core.updater import (
    apply_updater,
    apply_updates,
    init_state,
    updater_errors,
    updater_name,
)
from jaxkv._src.core.verified import verify_every
from jaxkv._src.errors import KVStoreError, ShapeError, shown
from jaxkv._src.state.kvstate import Key, KVState
from jaxkv._src.state.pairing import as_array
from jaxkv._src.state.policy import block_rows

# The named scope of the rows moved between devices (``jax.named_scope``).
ROUTE = "jaxkv.rows.route"


# A table of at least this many bytes has its rows' cache lines touched before they are
# gathered (``_touched``): below it, the table stays in the CPU's caches and its TLB's reach.
TOUCH_MIN_BYTES = 16 << 20
_LINE = 64  # bytes: a CPU cache line


def _touched(x: Any, ids: Any, ordered: bool = False) -> Any:
    """``ids``, to gather rows of ``x`` by, once one element of each cache line of those rows
    has been read: on a CPU, for a table of at least :data:`TOUCH_MIN_BYTES` whose rows span
    several cache lines (whole lines); else ``ids`` as given. ``ordered``: the ids are sorted
    and distinct (XLA's gather is told so).

    XLA:CPU's gather of whole rows reads a row's elements one after another, so the CPU waits
    for each row's page-table walk and cache lines in turn (a TLB miss per row and table, the
    walk nested under a virtual machine's paging). A gather of one element per line issues
    those misses together; the whole rows are then read from the caches. The ids returned
    depend on the touched elements (or-ed with a zero XLA cannot see is one), so that the
    touch runs first and is kept. Lazy Adam on 1,280 of 1M rows of 64 float32 (three tables:
    weights and two moments), one jitted step on the project's 2-core AMD EPYC virtual
    machine: 1.66-1.94 ms, 0.96-1.17 ms with the touch; the embedding loop's row computation
    (``benchmarks/embedding_worker.py``) 1.42-2.22 ms, 1.00-1.19 ms (docs/benchmarks.md).
    """
    per_line = max(1, _LINE // x.dtype.itemsize)  # elements
    width = math.prod(x.shape[1:])
    if (
        jax.default_backend() != "cpu"
        or x.size * x.dtype.itemsize < TOUCH_MIN_BYTES
        or width < 2 * per_line
        or width % per_line
        or ids.ndim != 1
        or ids.shape[0] == 0
    ):
        return ids
    # The first element of each line of the rows: one gather of a strided slice of each row
    # (a slice of the table before the gather would copy it whole in some XLA versions).
    lined = x.reshape(x.shape[0], width // per_line, per_line)  # (a bitcast: no copy)
    lines = jax.lax.gather(
        lined,
        ids[:, None],
        jax.lax.GatherDimensionNumbers(
            offset_dims=(1,), collapsed_slice_dims=(0, 2), start_index_map=(0,)
        ),
        slice_sizes=(1, width // per_line, 1),
        indices_are_sorted=ordered,
        unique_indices=ordered,
        mode="fill",
        fill_value=0,
    )
    # 0 whatever the first id's sign (a negative id must not change the ids), and XLA cannot
    # tell it is 0: it does not follow a value's range through the comparison
    zero = jnp.where(ids[0] >= 0, jnp.minimum(ids[0], 0), 0)
    return ids | ((lines == 0).any(axis=1).astype(ids.dtype) & zero)


def take(x: Any, ids: Any, lo: Any = 0) -> Any:
    """The rows ``ids`` of ``x`` (a table, or the block of it whose first row is row ``lo``);
    rows outside ``x`` read as zeros."""
    if x.shape[0] == 0:  # (no rows here: a device that pushed none)
        return jnp.zeros((ids.shape[0], *x.shape[1:]), x.dtype)
    local = ids - lo
    inside = (local >= 0) & (local < x.shape[0])
    local = jnp.where(inside, local, x.shape[0])
    return jnp.take(x, _touched(x, local), axis=0, mode="fill", fill_value=0)


def put(x: Any, ids: Any, rows: Any, lo: Any = 0) -> Any:
    """``x`` with the rows ``ids`` set to ``rows``; rows outside ``x`` are dropped."""
    local = ids - lo
    inside = (local >= 0) & (local < x.shape[0])
    where = jnp.where(inside, local, x.shape[0])
    return x.at[where].set(rows.astype(x.dtype), mode="drop")


def dedupe(ids: Any, rows: Any, n_rows: int) -> tuple[Any, Any]:
    """Each distinct valid id once (sorted, padded with ``n_rows``, which selects nothing) and
    the sum of its rows: ids outside ``[0, n_rows)`` update nothing.

    One sort of the ids alone (sorting ids with their positions costs XLA:CPU 10x more), the
    distinct ids at the starts of runs, and each pushed row's place among them by binary
    search: 0.5 ms for 8,000 ids of 64 floats on one CPU core, against 1.25 ms for
    ``jnp.unique(..., return_inverse=True)``."""
    ids = jnp.where((ids >= 0) & (ids < n_rows), ids, n_rows)
    size = ids.shape[0]
    if size == 0:
        return ids, rows
    ordered = jnp.sort(ids)
    starts = jnp.concatenate([jnp.ones(1, bool), ordered[1:] != ordered[:-1]])
    slot = jnp.cumsum(starts.astype(jnp.int32)) - 1
    unique = jnp.full(size, n_rows, ids.dtype).at[slot].set(ordered)
    inverse = jnp.searchsorted(unique, ids, method="scan").astype(jnp.int32)
    if rows.dtype == jnp.bool_:  # summed as a push sums them: any of them
        return unique, jax.ops.segment_max(rows.astype(jnp.int8), inverse, num_segments=size) > 0
    summed = jax.ops.segment_sum(rows, inverse, num_segments=size)
    return unique, summed


class Where:
    """How to reach a key's rows from the code running: the whole table (``axis`` None), or
    this device's block of ``block`` rows along the mapped ``axis``."""

    def __init__(self, axis: Any = None, block: int = 0) -> None:
        self.axis = axis
        self.block = block

    def lo(self) -> Any:
        return 0 if self.axis is None else jax.lax.axis_index(self.axis) * self.block

    def take(self, x: Any, ids: Any) -> Any:
        """The rows ``ids`` (the same on every device) of the table whose part here is ``x``."""
        if self.axis is None:
            return take(x, ids)
        return jax.lax.psum(take(x, ids, self.lo()), self.axis)

    def take_own(self, x: Any, ids: Any) -> Any:
        """The rows ``ids`` that this device holds (zeros for the others), no communication."""
        return take(x, ids, self.lo())

    def put(self, x: Any, ids: Any, rows: Any) -> Any:
        return put(x, ids, rows, self.lo())


class _Sorted(Where):
    """``Where`` for a whole table whose ids are sorted, distinct and non-negative (those past
    the table, padding, read zeros and are dropped)."""

    def take(self, x: Any, ids: Any) -> Any:
        return jnp.take(
            x,
            _touched(x, ids, ordered=True),
            axis=0,
            mode="fill",
            fill_value=0,
            indices_are_sorted=True,
            unique_indices=True,
        )

    take_own = take

    def put(self, x: Any, ids: Any, rows: Any) -> Any:
        return x.at[ids].set(
            rows.astype(x.dtype), mode="drop", indices_are_sorted=True, unique_indices=True
        )


def _beyond(n_rows: int, ids: Any) -> Any:
    """``n_rows``, ``n_rows + 1``, ...: one distinct id past a table of ``n_rows`` rows for
    each of ``ids`` (padding that reads zeros and updates nothing)."""
    return n_rows + jnp.arange(ids.shape[0], dtype=ids.dtype)


def update_rows(
    key: Key,
    where: Where,
    stored: Any,
    opt_state: Any,
    ids: Any,
    rows: Any,
    n_rows: int,
    updater: Any,
    extra: Any = None,
    distinct: bool = False,
) -> tuple[Any, Any, Any]:
    """The new stored value (or block) and optimizer state after a push of ``rows`` at ``ids``
    (the whole push: the same on every device), and the rows it wrote: those of ``ids`` in
    their order where ``distinct`` (of ids outside the table: any value), else of the summed
    ids; of a block, those this device holds (a pull of the pushed ids from a whole table,
    with no gather from the new value; unused, XLA drops it).
    ``extra``: an optax updater's extra arguments (``update(..., **extra)``: an MXNet
    optimizer's scalars), arguments of the computation; ``distinct``: the valid ids are known
    to be distinct (the host checked them), so nothing is summed (ids outside ``[0, n_rows)``,
    the padding, still update nothing)."""
    whole = type(where) is Where and where.axis is None and n_rows + ids.shape[0] < 2**31
    if not distinct:
        with jax.named_scope(SUM):
            unique, summed = dedupe(ids, rows.astype(stored.dtype), n_rows)
        if whole:  # (sorted and distinct, the padding after them: made distinct as below)
            unique = jnp.where(unique < n_rows, unique, _beyond(n_rows, unique))
            where = _Sorted()
    elif whole:
        # Sorted distinct ids, the padding after them made distinct past the table: XLA's
        # gather and scatter told so run faster (0.52 against 0.77 ms, lazy Adam on 1,280
        # rows of 64 on one CPU core).
        unique, summed = jnp.where((ids >= 0) & (ids < n_rows), ids, _beyond(n_rows, ids)), rows
        where = _Sorted()
    else:
        unique, summed = jnp.where((ids >= 0) & (ids < n_rows), ids, n_rows), rows
    summed = summed.astype(stored.dtype)
    with jax.named_scope(UPDATER):
        return _updated(key, where, stored, opt_state, unique, summed, updater, extra)


def _updated(
    key: Key,
    where: Where,
    stored: Any,
    opt_state: Any,
    unique: Any,
    summed: Any,
    updater: Any,
    extra: Any = None,
) -> tuple[Any, Any, Any]:
    """:func:`update_rows` once the pushed rows are summed: ``summed[i]`` for row
    ``unique[i]``. The rows written are those the updater computes (none: the summed rows;
    optax's), or a Python updater's new value read at ``unique``."""
    if updater is None:
        return where.put(stored, unique, summed), opt_state, summed
    if isinstance(updater, optax.GradientTransformation):
        with updater_errors(updater, [key]):  # init (tree_map_params traces it) and update
            new_rows, opt_state = _optax_rows(
                key, where, stored, opt_state, unique, summed, updater, extra
            )
        new_rows = new_rows.astype(stored.dtype)
        return where.put(stored, unique, new_rows), opt_state, new_rows
    pushed = where.put(jnp.zeros_like(stored), unique, summed)
    with updater_errors(updater, [key]):  # its call, and a result that is no array
        value = updater(key, pushed, stored)
        if value is None:
            raise KVStoreError(
                f"key {shown(key)}: the updater {updater_name(updater)} returned None, "
                "expected the new stored value. MXNet-style in-place updaters (stored += ...) "
                "work through jaxkv.KVStore; a functional updater must return the new value"
            )
        value = as_array(value)
    if tuple(value.shape) != tuple(stored.shape):
        raise ShapeError(
            f"key {shown(key)}: the updater returned shape {tuple(value.shape)}, expected the "
            f"stored shape {tuple(stored.shape)} (the updater: {updater_name(updater)})"
        )
    value = value.astype(stored.dtype)
    return value, opt_state, where.take_own(value, unique)  # (no communication)


def _optax_rows(
    key: Key,
    where: Where,
    stored: Any,
    opt_state: Any,
    unique: Any,
    summed: Any,
    updater: Any,
    extra: Any = None,
) -> tuple[Any, Any]:
    """The optax updater on the touched rows: their new values, and the optimizer state with
    the same rows of its per-parameter leaves written back."""
    tree_map_params = optax.tree_utils.tree_map_params
    # Each device's own rows of a sharded table (zeros for the others'), where the updater
    # is elementwise: a row's update then needs nothing of another device's rows, and the
    # rows it gets wrong are rows this device does not write back. Else every device gets
    # every touched row (one psum), and runs the updater on them all.
    take = where.take_own
    opt_rows = tree_map_params(updater, lambda x: take(x, unique), opt_state)
    name = np.dtype(stored.dtype).name
    if where.axis is not None and not _elementwise(
        updater, (key,), (tuple(summed.shape),), name, opt_rows
    ):
        take = where.take
        opt_rows = tree_map_params(updater, lambda x: take(x, unique), opt_state)
    old = take(stored, unique)
    updates, new_opt = updater.update({key: summed}, opt_rows, {key: old}, **(extra or {}))
    new_rows = apply_updates({key: old}, updates)[key]
    # The per-parameter leaves: their touched rows written back; the others (a step
    # count) as the update left them.
    per_row = tree_map_params(
        updater, lambda x: True, opt_state, transform_non_params=lambda x: False
    )
    opt_state = jax.tree_util.tree_map(
        lambda rowwise, x, new: where.put(x, unique, new) if rowwise else new,
        per_row,
        opt_state,
        new_opt,
    )
    return new_rows, opt_state


def plan(ids: Any, block: int, parts: int, c: int) -> tuple[Any, Any]:
    """On one device, inside ``shard_map``: where each of its ``ids`` goes among the
    ``parts * c`` slots it sends (owner-major, ``c`` per owner of a table cut in ``parts``
    blocks of ``block`` rows), and each slot's id as a row of its owner's block (``block``,
    which selects nothing, where unused). An id outside the table (padding) goes nowhere: its
    slot is ``parts * c``. ``c`` is at least the most ids this device sends one owner (the host
    counts them: :func:`ops.busiest`)."""
    valid = (ids >= 0) & (ids < parts * block)
    owner = jnp.where(valid, ids // block, parts)
    to = owner[:, None] == jnp.arange(parts, dtype=owner.dtype)[None, :]
    seen = jnp.cumsum(to.astype(jnp.int32), axis=0)  # ids so far for each owner
    slot = jnp.sum(jnp.where(to, seen, 0), axis=1) - 1
    dest = jnp.where(valid, owner * c + slot, parts * c)
    local = jnp.full(parts * c, block, ids.dtype)
    return dest, local.at[dest].set(ids - owner * block, mode="drop")


def exchange(
    local: Any, rows: Any, dest: Any, axis: str, words: Any = None
) -> tuple[Any, Any, Any]:
    """Each slot's id and row sent to its owner (see :func:`plan`): one all-to-all, the id a
    column of the rows bit cast to ``int32`` where the rows' items are 4 bytes, else two.
    ``words`` (``int32``, this device's agreement: :func:`agreed`) ride behind each owner's
    slots, the same to every owner; the third result is every device's, one row each in mesh
    order (``None`` without ``words``)."""
    n = local.shape[0]
    shape = rows.shape[1:]
    parts = jax.lax.axis_size(axis)
    if jnp.dtype(rows.dtype).itemsize != 4:
        sent = jnp.zeros((n, *shape), rows.dtype).at[dest].set(rows, mode="drop")
        ids, got_words = _behind(local[:, None], words, parts, axis)
        return ids[:, 0], jax.lax.all_to_all(sent, axis, 0, 0, tiled=True), got_words
    flat = rows.reshape(rows.shape[0], math.prod(shape))
    if flat.dtype != jnp.int32:
        flat = jax.lax.bitcast_convert_type(flat, jnp.int32)
    sent = jnp.zeros((n, flat.shape[1] + 1), jnp.int32).at[:, -1].set(local)
    sent, got_words = _behind(sent.at[dest, :-1].set(flat, mode="drop"), words, parts, axis)
    got = sent[:, :-1]
    if rows.dtype != jnp.int32:
        got = jax.lax.bitcast_convert_type(got, rows.dtype)
    return sent[:, -1], got.reshape(n, *shape), got_words


def _behind(slots: Any, words: Any, parts: int, axis: str) -> tuple[Any, Any]:
    """One all-to-all of ``slots`` (``int32``, owner-major, ``parts`` equal chunks of rows) with
    ``words`` behind each chunk (as whole rows of zero-padded words): the received slots, and
    each sender's words (``None`` without ``words``)."""
    if words is None:
        return jax.lax.all_to_all(slots, axis, 0, 0, tiled=True), None
    width = slots.shape[1]
    extra = -(-words.shape[0] // width)  # rows of words behind each chunk
    behind = jnp.zeros(extra * width, jnp.int32).at[: words.shape[0]].set(words)
    chunks = slots.reshape(parts, -1, width)
    each = jnp.broadcast_to(behind.reshape(1, extra, width), (parts, extra, width))
    sent = jnp.concatenate([chunks, each], axis=1).reshape(-1, width)
    got = jax.lax.all_to_all(sent, axis, 0, 0, tiled=True).reshape(parts, -1, width)
    got_words = got[:, -extra:].reshape(parts, extra * width)[:, : words.shape[0]]
    return got[:, :-extra].reshape(-1, width), got_words


# The first of an agreement's words: a process's status (0: it agrees to run; else why not).
AGREE = 0


def agreed(words: Any) -> Any:
    """Whether every sender's agreement (``words``, one row each: :func:`exchange`) lets the
    computation run: each one's status :data:`AGREE` and its other words equal to every
    other's. Every device gets every sender's words, so all reach the same verdict."""
    return (words[:, 0] == AGREE).all() & (words[:, 1:] == words[:1, 1:]).all()


@functools.lru_cache(maxsize=64)
def routed_take(mesh: Any, axis: str, c: int) -> Any:
    """``(table, ids) -> rows``, both split along axis 0 over the mesh: each device's ids sent
    to their owners and the rows back, two all-to-alls of ``parts * c`` slots."""
    parts = mesh.shape[axis]

    @jax.named_scope(ROUTE)
    def body(block: Any, ids: Any) -> Any:
        dest, local = plan(ids, block.shape[0], parts, c)
        asked = jax.lax.all_to_all(local, axis, 0, 0, tiled=True)  # what others ask of me
        got = jax.lax.all_to_all(take(block, asked), axis, 0, 0, tiled=True)  # owner-major
        return jnp.take(got, dest, axis=0, mode="fill", fill_value=0)

    split = PartitionSpec(axis)
    return checked.jit(
        checked.shard_map(body, mesh=mesh, in_specs=(split, split), out_specs=split), verify_every()
    )


def like_table(opt: Any, table: Any, split: PartitionSpec) -> Any:
    """The ``shard_map`` specs of an optimizer state beside a table split along ``split``: its
    leaves of the table's shape (per-parameter moments) split alike, the others replicated."""
    return jax.tree_util.tree_map(
        lambda x: split if tuple(x.shape) == tuple(table.shape) else PartitionSpec(), opt
    )


@functools.lru_cache(maxsize=64)
def per_device_take(mesh: Any, axis: str, sharded: bool) -> Any:
    def body(table: Any, ids: Any) -> Any:
        if not sharded:
            return take(table, ids)
        with jax.named_scope(ROUTE):
            asked = jax.lax.all_gather(ids, axis)
            part = take(table, asked, jax.lax.axis_index(axis) * table.shape[0])
            return psum_scatter(part, axis, scatter_dimension=0)

    split = PartitionSpec(axis)
    table = split if sharded else PartitionSpec()
    return checked.jit(
        checked.shard_map(body, mesh=mesh, in_specs=(table, split), out_specs=split), verify_every()
    )


@functools.lru_cache(maxsize=64)
def replicated_take(sharding: NamedSharding) -> Any:
    return jax.jit(take, out_shardings=sharding)


def _blockwise(fn: Any, mesh: Any, axis: str, out: PartitionSpec) -> Any:
    """``(table, ids) -> fn(block, ids, lo)`` jitted over each device's block of a table
    split along ``axis`` (``lo``: the block's first row), the ids whole on every device."""

    def body(block: Any, ids: Any) -> Any:
        return fn(block, ids, jax.lax.axis_index(axis) * block.shape[0])

    spec = PartitionSpec(axis)
    return checked.jit(
        checked.shard_map(body, mesh=mesh, in_specs=(spec, PartitionSpec()), out_specs=out),
        verify_every(),
    )


@functools.lru_cache(maxsize=64)
def sharded_take(mesh: Any, axis: str) -> Any:
    @jax.named_scope(ROUTE)
    def summed(block: Any, ids: Any, lo: Any) -> Any:
        return jax.lax.psum(take(block, ids, lo), axis)

    return _blockwise(summed, mesh, axis, PartitionSpec())


def elements(ids: Any, lo: Any, rows: int, off: int, width: int, size: int) -> Any:
    """The element positions ``(n, width)`` in a run (a bucket, or a device's chunk of
    ``size`` elements) of the rows ``ids`` of a key at ``off`` holding rows
    ``[lo, lo + rows)``; ``size`` (past the end) for rows elsewhere."""
    local = ids - lo
    inside = (local >= 0) & (local < rows)
    first = off + jnp.where(inside, local, 0) * width
    at = first[:, None] + jnp.arange(width, dtype=first.dtype)[None, :]
    return jnp.where(inside[:, None], at, size)


def run_take(leaf: Any, ids: Any, lo: Any, rows: int, off: int, shape: tuple) -> Any:
    width = math.prod(shape[1:])
    at = elements(ids, lo, rows, off, width, leaf.shape[0])
    got = jnp.take(leaf, at, mode="fill", fill_value=0)
    return got.reshape(ids.shape[0], *shape[1:])


def run_put(leaf: Any, ids: Any, new: Any, lo: Any, rows: int, off: int, shape: tuple) -> Any:
    width = math.prod(shape[1:])
    at = elements(ids, lo, rows, off, width, leaf.shape[0])
    values = new.reshape(ids.shape[0], width).astype(leaf.dtype)
    return leaf.at[at].set(values, mode="drop")


class InRun(Where):
    """``Where`` for a key's run in a bucket (or in this device's chunk of a split one)."""

    def __init__(self, axis: Any, rows: int, off: int, shape: tuple) -> None:
        super().__init__(axis, rows)
        self.off, self.shape = off, shape

    def take_own(self, x: Any, ids: Any) -> Any:
        return run_take(x, ids, self.lo(), self.block, self.off, self.shape)

    def take(self, x: Any, ids: Any) -> Any:
        mine = self.take_own(x, ids)
        return mine if self.axis is None else jax.lax.psum(mine, self.axis)

    def put(self, x: Any, ids: Any, rows: Any) -> Any:
        return run_put(x, ids, rows, self.lo(), self.block, self.off, self.shape)


@functools.lru_cache(maxsize=256)
def bucket_rows_take(
    mesh: Any, axis: str, off: int, shape: tuple, split: bool, each: bool = False
) -> Any:
    """``(bucket, ids) -> rows`` of a key at ``off`` in its bucket, read in place: whole on
    every device, or (``each``: across processes, the ids one run per device, split along axis
    0) each device's rows for its own run of ids."""
    out = NamedSharding(mesh, PartitionSpec(axis) if each else PartitionSpec())
    if not split:  # the result named whole on the devices: with no ids, XLA would pick one
        take = lambda leaf, ids: run_take(leaf, ids, 0, shape[0], off, shape)  # noqa: E731
        return jax.jit(take, out_shardings=out)
    parts = mesh.devices.size
    rows = _rows_of_block(shape, parts)

    @jax.named_scope(ROUTE)
    def body(chunk: Any, ids: Any) -> Any:
        lo = jax.lax.axis_index(axis) * rows
        return jax.lax.psum(run_take(chunk, ids, lo, rows, off, shape), axis)

    spec = PartitionSpec(axis)
    return checked.jit(
        checked.shard_map(
            body, mesh=mesh, in_specs=(spec, PartitionSpec()), out_specs=PartitionSpec()
        ),
        verify_every(),
        out_shardings=out,
    )


def _rows_of_block(shape: tuple, parts: int) -> int:
    """The rows of each device's block of a key of a split bucket, addressed in place (the
    caller routes only keys whose blocks are whole rows: ``buckets.block_rows``)."""
    rows = block_rows(shape, parts)
    assert rows is not None, (shape, parts)
    return rows


@functools.lru_cache(maxsize=256)
def bucket_pusher(
    mesh: Any,
    axis: str,
    key: Key,
    off: int,
    shape: tuple,
    split: bool,
    updater: Any,
    packing: Any,
    families: tuple[int, ...],
    donate: bool,
) -> Any:
    """``(bucket, opt_state, ids, rows, extra) -> (bucket, opt_state)`` for a key at ``off``."""
    parts = mesh.devices.size if split else 1
    rows_here = _rows_of_block(shape, parts) if split else shape[0]

    def update(leaf: Any, opt: Any, ids: Any, rows: Any, extra: Any) -> Any:
        where = InRun(axis if split else None, rows_here, off, shape)
        if packing is None:
            return update_rows(key, where, leaf, opt, ids, rows, shape[0], updater, extra)[:2]
        # The packed leaves as optax's tree: each family bucket as the key's value (addressed
        # by the same run), the other leaves as they are.
        tree = jax.tree_util.tree_unflatten(packing.treedef, list(opt))
        value, new, _ = update_rows(key, where, leaf, tree, ids, rows, shape[0], updater, extra)
        return value, tuple(jax.tree_util.tree_leaves(new))

    if not split:
        return jax.jit(update, donate_argnums=(0, 1) if donate else ())
    spec = PartitionSpec(axis)

    def run(leaf: Any, opt: Any, ids: Any, rows: Any, extra: Any) -> Any:
        if packing is None:
            opt_spec = like_table(opt, leaf, spec)
        else:
            opt_spec = tuple(spec if j in families else PartitionSpec() for j in range(len(opt)))
        mapped = checked.shard_map(
            update,
            mesh=mesh,
            in_specs=(spec, opt_spec, PartitionSpec(), PartitionSpec(), PartitionSpec()),
            out_specs=(spec, opt_spec),
            check_vma=False,
        )
        return mapped(leaf, opt, ids, rows, extra)

    return checked.jit(run, verify_every(), donate_argnums=(0, 1) if donate else ())


@functools.lru_cache(maxsize=256)
def bucket_take(key: Key, out: NamedSharding | None = None) -> Any:
    """The rows of a key read through its view of its bucket (``out``: where the result goes;
    across processes, each device's rows for its own ids, split along axis 0)."""
    return jax.jit(lambda state, ids: take(state[key], ids), out_shardings=out)


def keep(x: Any, ids: Any, lo: Any = 0) -> Any:
    return put(jnp.zeros_like(x), ids, take(x, ids, lo), lo)


@functools.lru_cache(maxsize=64)
def replicated_keep(out: NamedSharding) -> Any:
    return jax.jit(keep, out_shardings=out)


@functools.lru_cache(maxsize=64)
def sharded_keep(mesh: Any, axis: str) -> Any:
    return _blockwise(keep, mesh, axis, PartitionSpec(axis))


@functools.lru_cache(maxsize=256)
def bucket_keep(key: Key, out: NamedSharding | None) -> Any:
    return jax.jit(lambda state, ids: keep(state[key], ids), out_shardings=out)


@functools.lru_cache(maxsize=256)
def routed_push(
    mesh: Any,
    axis: str,
    key: Key,
    updater: Any,
    donate: bool,
    c: int,
    back: int | None,
    agree: int = 0,
    dense: Dense | None = None,
) -> Any:
    """``(table, opt_state, ids, rows, extra) -> (table, opt_state)``, ids and rows split along
    axis 0 (``extra``: the updater's extra arguments, whole on every device):
    each device sends each owner its ids and rows for it (one all-to-all of ``parts * c`` slots,
    see :func:`plan`), and each owner sums and updates the rows of its block alone.

    With ``back`` (not ``None``), also each device's rows after the update: ``back == 0``, the
    pushed ids, in their order (one more all-to-all, back along the same routes); ``back > 0``,
    the ids of one more argument, ``pull_ids`` (routed as a pull with ``C = back``: two more).
    Then ``(table, opt_state, rows)``.

    With ``agree`` (a count of words), the processes' agreement rides in the first all-to-all:
    one more argument after ``extra``, each device's ``agree`` ``int32`` words (split along
    axis 0), and one more result, whether they agreed (:func:`agreed`; one per device, the
    same on all). Where they did not, nothing changes (the table, every leaf of its optimizer
    state), and the rows sent back are not the pull's.

    With ``dense`` (and ``agree``), dense keys' pushes too (:class:`Dense`), in four more
    arguments after the others: each device's gradients of those keys, flat and side by side
    (split along axis 0), the keys' values and their optimizer group's state (whole on every
    device), and that update's extra arguments; and three more results, the new values and
    state (whole), and a copy of the values (:meth:`Dense.update`). Each device's gradients
    ride behind its words in the first all-to-all, the same to every owner, and every device
    sums every sender's in mesh order (the same bytes in the same order everywhere: every
    device's sum is the same, no all-reduce), then updates the values as one push of those
    keys would (``apply_updater``); where the processes did not agree, the values and state
    come back as they were."""
    split = PartitionSpec(axis)
    parts = mesh.shape[axis]
    whole = PartitionSpec()

    def body(block: Any, opt: Any, ids: Any, rows: Any, extra: Any, *more: Any) -> Any:
        dense_args: tuple = ()
        if dense is not None:
            more, dense_args = more[:-4], more[-4:]
        words, pull_ids = (more[0], more[1:]) if agree else (None, more)
        sent_words = words
        if dense_args:  # (each device's dense gradients behind its words, as int32)
            assert words is not None
            sent_words = jnp.concatenate([words, _as_words(dense_args[0])])
        with jax.named_scope(ROUTE):
            dest, local = plan(ids, block.shape[0], parts, c)
            got_ids, got, got_words = exchange(local, rows, dest, axis, sent_words)
        n = block.shape[0]
        before = block, opt
        if agree:
            assert words is not None
            every = got_words
            got_words = every[:, : words.shape[0]]
            ok = agreed(got_words)
            got_ids = jnp.where(ok, got_ids, n)  # (selects nothing: no row is written)
        block, opt, _ = update_rows(key, Where(), block, opt, got_ids, got, n, updater, extra)
        if agree:
            block, opt = _unless(ok, updater, before, (block, opt))
        done = (ok.reshape(1),) if agree else ()
        if dense is not None:
            assert words is not None
            grads = every[:, words.shape[0] :]
            done = (*done, *dense.update(grads, dense_args[1:], ok))
        if back is None:
            return block, opt, *done
        with jax.named_scope(ROUTE):
            if pull_ids:
                dest, local = plan(pull_ids[0], block.shape[0], parts, back)
                got_ids = jax.lax.all_to_all(local, axis, 0, 0, tiled=True)
            rows = jax.lax.all_to_all(take(block, got_ids), axis, 0, 0, tiled=True)
            return block, opt, jnp.take(rows, dest, axis=0, mode="fill", fill_value=0), *done

    def run(table: Any, opt: Any, ids: Any, rows: Any, extra: Any, *more: Any) -> Any:
        opt_spec = like_table(opt, table, split)
        outs = (split, opt_spec) if back is None else (split, opt_spec, split)
        if agree:
            outs = (*outs, split)
        ins = [split] * len(more)
        if dense is not None:  # (the gradients split; the values, state and numbers whole)
            ins[-4:] = [split, whole, whole, whole]
            outs = (*outs, whole, whole, whole)
        mapped = checked.shard_map(
            body,
            mesh=mesh,
            in_specs=(split, opt_spec, split, split, whole, *ins),
            out_specs=outs,
            check_vma=False,
        )
        return mapped(table, opt, ids, rows, extra, *more)

    return checked.jit(run, verify_every(), donate_argnums=(0, 1) if donate else ())


class Dense(NamedTuple):
    """Dense keys' pushes made in a routed push's computation (:func:`routed_push`): their
    ``keys`` (sorted, one optimizer group), ``shapes`` and ``dtype`` (one, of 4-byte items),
    and the group's ``updater`` (an optax transformation; its extra arguments given with the
    values). Hashable: part of the computation's cache key."""

    keys: tuple
    shapes: tuple
    dtype: Any
    updater: Any

    def update(self, grads: Any, args: tuple, ok: Any) -> tuple[Any, Any, Any]:
        """Inside ``shard_map``: every sender's gradients (``grads``: one row of ``int32``
        words each, in mesh order) summed in that order, then the keys' values and state
        (``args``: values, state, extra arguments) updated: ``(values, state, values)``, as
        they were where not ``ok`` (the values twice: XLA gives each result its own buffer,
        and the second is a copy a pull of those keys hands out: ``placement.spare``)."""
        values, state, extra = args
        got = jax.lax.bitcast_convert_type(grads, jnp.dtype(self.dtype))
        total = got[0]
        for j in range(1, got.shape[0]):  # (in mesh order, on every device alike)
            total = total + got[j]
        pushed, at = [], 0
        for shape in self.shapes:
            size = math.prod(shape)
            pushed.append(total[at : at + size].reshape(shape))
            at += size
        made, made_state = apply_updater(
            self.updater, self.keys, pushed, list(values), state, extra
        )
        new = tuple(jnp.where(ok, x, old) for x, old in zip(made, values))
        new_state = jax.tree_util.tree_map(lambda x, old: jnp.where(ok, x, old), made_state, state)
        return new, new_state, new  # (the values twice: a spare copy for a pull's out)


def _as_words(x: Any) -> Any:
    """``x`` (flat, of 4-byte items) as ``int32`` words."""
    return x if x.dtype == jnp.int32 else jax.lax.bitcast_convert_type(x, jnp.int32)


def _unless(ok: Any, updater: Any, before: tuple[Any, Any], after: tuple[Any, Any]) -> Any:
    """``after`` where ``ok``, else ``before`` (a block and its optimizer state), given an
    update whose ids selected nothing where not ``ok``: an optax updater's per-parameter
    leaves are then unchanged already, and only its other leaves (a step count) are chosen
    (a select of a whole table costs a read and a write of it); a Python updater's whole
    new value is chosen."""
    (block, opt), (new_block, new_opt) = before, after
    if updater is None:
        return new_block, new_opt
    if isinstance(updater, optax.GradientTransformation):
        per_row = optax.tree_utils.tree_map_params(
            updater, lambda x: True, opt, transform_non_params=lambda x: False
        )
        new_opt = jax.tree_util.tree_map(
            lambda rowwise, x, new: new if rowwise else jnp.where(ok, new, x),
            per_row,
            opt,
            new_opt,
        )
        return new_block, new_opt
    return jnp.where(ok, new_block, block), new_opt


@functools.lru_cache(maxsize=256)
def own_push(
    mesh: Any,
    axis: str,
    key: Key,
    n_rows: int,
    sharded: bool,
    updater: Any,
    donate: bool,
    distinct: bool = False,
    back: str | None = None,
) -> Any:
    """The eager push of rows into a key kept as an array of its own: ``(table, opt_state,
    ids, rows, extra) -> (table, opt_state)``, in a ``shard_map`` over the store's mesh for a
    sharded table (its optimizer state's per-parameter leaves sharded like it). ``distinct``:
    see :func:`update_rows`. ``back`` (a table kept whole), rows after the push as a third
    result: ``"ids"``, those of one more argument, ids to pull; ``"sorted ids"``, the same,
    those ids sorted and distinct (their padding, ``-1``, after them), and XLA's gather told
    so; ``"pushed"`` (with ``distinct``), those of the pushed ids, the rows the update made
    (no gather from the new table, no more argument)."""
    donated = (0, 1) if donate else ()
    if not sharded:

        def whole(table: Any, opt: Any, ids: Any, rows: Any, extra: Any, *pull: Any) -> Any:
            ids, rows = _together(mesh, ids, rows)
            table, opt, written = update_rows(
                key, Where(), table, opt, ids, rows, n_rows, updater, extra, distinct
            )
            if back is None:
                return table, opt
            if back == "pushed":
                return table, opt, written
            asked = pull[0]
            if back == "sorted ids" and n_rows + asked.shape[0] < 2**31:
                asked = jnp.where((asked >= 0) & (asked < n_rows), asked, _beyond(n_rows, asked))
                return table, opt, _Sorted().take(table, asked)
            return table, opt, take(table, asked)

        return jax.jit(whole, donate_argnums=donated)

    return checked.jit(
        sharded_runner(mesh, axis, key, n_rows, updater), verify_every(), donate_argnums=donated
    )


def _together(mesh: Any, ids: Any, rows: Any) -> tuple[Any, Any]:
    """Every device's ids and rows, whole on every device of ``mesh``: where they are split over
    it (a push from every device, from every process), one all-gather of the rows with the ids
    a column of them bit cast to ``int32`` (rows of 4-byte items; else one all-gather each).
    Left to XLA, a push into a whole table gathers the ids, then sums the rows scattered to
    them with an all-reduce: two collectives, each a wait for every process (gloo)."""
    if mesh.size == 1:
        return ids, rows
    whole = NamedSharding(mesh, PartitionSpec())
    shape = rows.shape[1:]
    if jnp.dtype(rows.dtype).itemsize != 4 or ids.dtype != jnp.int32:
        return (
            jax.lax.with_sharding_constraint(ids, whole),
            jax.lax.with_sharding_constraint(rows, whole),
        )
    flat = rows.reshape(rows.shape[0], math.prod(shape))
    if flat.dtype != jnp.int32:
        flat = jax.lax.bitcast_convert_type(flat, jnp.int32)
    both = jax.lax.with_sharding_constraint(jnp.concatenate([flat, ids[:, None]], axis=1), whole)
    got = both[:, :-1]
    if rows.dtype != jnp.int32:
        got = jax.lax.bitcast_convert_type(got, rows.dtype)
    return both[:, -1], got.reshape(rows.shape)


def sharded_runner(mesh: Any, axis: str, key: Key, n_rows: int, updater: Any) -> Any:
    """``(table, opt_state, ids, rows, extra) -> (table, opt_state)`` for a table sharded over
    ``mesh``: the pairs, whether replicated or one block per device, are all-gathered where
    they are not whole on each device."""
    split = PartitionSpec(axis)

    def run(table: Any, opt: Any, ids: Any, rows: Any, extra: Any) -> Any:
        opt_spec = like_table(opt, table, split)

        def body(block: Any, opt: Any, ids: Any, rows: Any, extra: Any) -> Any:
            # ids and rows arrive whole (replicated in_specs): XLA gathers stacked pairs once.
            where = Where(axis, block.shape[0])
            return update_rows(key, where, block, opt, ids, rows, n_rows, updater, extra)[:2]

        replicated = PartitionSpec()
        mapped = checked.shard_map(
            body,
            mesh=mesh,
            in_specs=(split, opt_spec, replicated, replicated, replicated),
            out_specs=(split, opt_spec),
            check_vma=False,
        )
        return mapped(table, opt, ids, rows, extra)

    return run


@functools.lru_cache(maxsize=256)
def state_push(key: Key, n_rows: int, updater: Any, donate: bool) -> Any:
    """The eager push of rows into a key of a bucket (flat layout): the whole state in and
    out, the key's view read and written inside the one computation."""

    def run(state: KVState, ids: Any, rows: Any, extra: Any) -> KVState:
        return push_whole(state, key, n_rows, ids, rows, updater, extra)

    return checked.jit(run, verify_every(), donate_argnums=(0,) if donate else ())


def push_whole(
    state: KVState, key: Key, n_rows: int, ids: Any, rows: Any, updater: Any, extra: Any = None
) -> KVState:
    stored = state[key]
    group = state.opt_group(key) if isinstance(updater, optax.GradientTransformation) else None
    opt = None if group is None else state.opt_states[group]
    if isinstance(updater, optax.GradientTransformation) and opt is None:
        opt = init_state(updater, {key: stored})
        group = (key,)
    value, opt, _ = update_rows(key, Where(), stored, opt, ids, rows, n_rows, updater, extra)
    return state.replace({key: value}, None if group is None else {group: opt})
