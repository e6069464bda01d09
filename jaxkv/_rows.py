"""Rows of a table: ``pull_rows``, ``push_rows``, ``pushpull_rows`` and ``row_sparse_pull``,
which read, sum and update only the rows a step touches (MXNet's ``row_sparse`` values and
``lazy_update``).

How rows move. A table the store replicates is read and written where it is, on every device:
a gather of the rows asked for, a scatter of the rows pushed. A table the store shards (its rows
split over the D devices of the mesh, each holding ``R / D`` consecutive rows) is handled in one
``shard_map`` over the store's mesh. With one request (or pair) per device, the ids are routed:
the host checks them and counts the busiest route (``C``), each device places its ids in ``D * C``
slots, owner-major (:func:`_plan`), one all-to-all takes them (and a push's rows, its ids a
column beside them) to their owners, and another brings a pull's rows back. An owner sums the
duplicate ids it gets (one sort, see :func:`_dedupe`) and updates its own rows alone where the
updater is elementwise. Otherwise every device gets every pair (an all-gather), reads the
touched rows it holds, and one ``psum`` (or ``psum_scatter``) adds the D partial answers. Cost:
O(rows touched x D) per device at most, nothing proportional to the table (with
``donate=True``: without it, a pure function must leave the old table intact, which copies it).

An optax updater runs on the touched rows and the same rows of its per-parameter state leaves
(``optax.tree_utils.tree_map_params`` finds them); its other leaves (Adam's step count) are
updated once per push, as a dense push would: MXNet's ``lazy_update=True``. An MXNet-style
``updater(key, pushed, stored)`` gets what MXNet gives it, densely: the pushed rows summed into a
value of the table's shape, zero elsewhere, and the stored value (this device's block inside
``shard_map``); it may change any row, as in MXNet.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from . import _dist
from ._args import as_array, devices_of, is_traced
from ._arrays import replicate
from ._bucket import elementwise as _elementwise
from ._collectives import axis_names, unsummed_axes
from ._errors import KVStoreError, ShapeError
from ._fast import assemble, per_device
from ._state import Key, KVState, normalize_key
from ._state import _spans_processes as _state_spans_processes
from ._update import optimizer_group

__all__ = ["pull_rows", "push_rows", "pushpull_rows", "row_sparse_pull"]

_ID_DTYPE = jnp.int32  # row ids on device (JAX's default integer); tables below 2**31 rows


# -- the row arithmetic, on a whole table or on one device's block of it --------------------
def _take(x: Any, ids: Any, lo: Any = 0) -> Any:
    """The rows ``ids`` of ``x`` (a table, or the block of it whose first row is row ``lo``);
    rows outside ``x`` read as zeros."""
    if x.shape[0] == 0:  # (no rows here: a device that pushed none)
        return jnp.zeros((ids.shape[0], *x.shape[1:]), x.dtype)
    local = ids - lo
    inside = (local >= 0) & (local < x.shape[0])
    return jnp.take(x, jnp.where(inside, local, x.shape[0]), axis=0, mode="fill", fill_value=0)


def _put(x: Any, ids: Any, rows: Any, lo: Any = 0) -> Any:
    """``x`` with the rows ``ids`` set to ``rows``; rows outside ``x`` are dropped."""
    local = ids - lo
    inside = (local >= 0) & (local < x.shape[0])
    where = jnp.where(inside, local, x.shape[0])
    return x.at[where].set(rows.astype(x.dtype), mode="drop")


def _dedupe(ids: Any, rows: Any, n_rows: int) -> tuple[Any, Any]:
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


class _Where:
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
            return _take(x, ids)
        return jax.lax.psum(_take(x, ids, self.lo()), self.axis)

    def take_own(self, x: Any, ids: Any) -> Any:
        """The rows ``ids`` that this device holds (zeros for the others), no communication."""
        return _take(x, ids, self.lo())

    def put(self, x: Any, ids: Any, rows: Any) -> Any:
        return _put(x, ids, rows, self.lo())


def _update_rows(
    key: Key,
    where: _Where,
    stored: Any,
    opt_state: Any,
    ids: Any,
    rows: Any,
    n_rows: int,
    updater: Any,
) -> tuple[Any, Any]:
    """The new stored value (or block) and optimizer state after a push of ``rows`` at ``ids``
    (the whole push: the same on every device)."""
    unique, summed = _dedupe(ids, rows.astype(stored.dtype), n_rows)
    if updater is None:
        return where.put(stored, unique, summed), opt_state
    if isinstance(updater, optax.GradientTransformation):
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
        updates, new_opt = updater.update({key: summed}, opt_rows, {key: old})
        new_rows = optax.apply_updates({key: old}, updates)[key]
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
        return where.put(stored, unique, new_rows), opt_state
    pushed = where.put(jnp.zeros_like(stored), unique, summed)
    value = updater(key, pushed, stored)
    if value is None:
        raise KVStoreError(
            f"key {key!r}: the updater returned None, expected the new stored value. "
            "MXNet-style in-place updaters (stored += ...) work through jaxkv.KVStore; "
            "a functional updater must return the new value"
        )
    value = as_array(value)
    if tuple(value.shape) != tuple(stored.shape):
        raise ShapeError(
            f"key {key!r}: the updater returned shape {tuple(value.shape)}, expected the stored "
            f"shape {tuple(stored.shape)}"
        )
    return value.astype(stored.dtype), opt_state


# -- checks -----------------------------------------------------------------------------------
def _table(state: KVState, key: Any, what: str) -> tuple[Key, int, tuple[int, ...]]:
    key = normalize_key(key)
    i = state.index(key)
    shape = state._shapes[i]
    if not shape:
        raise ShapeError(f"key {key!r}: {what} expects a value with rows, given a scalar")
    if shape[0] >= 2**31:
        raise KVStoreError(
            f"key {key!r}: {what} expects a table of fewer than 2**31 rows, given {shape[0]}"
        )
    return key, i, shape


def _host_ids(key: Key, row_ids: Any, n_rows: int) -> np.ndarray:
    """Eager row ids, flattened, as int32 on the host; refused unless whole numbers in
    ``[0, n_rows)`` (MXNet's ids are often float32, ``mx.nd.array``'s default)."""
    if hasattr(row_ids, "asnumpy"):
        row_ids = row_ids.asnumpy()
    ids = np.asarray(jax.device_get(row_ids) if isinstance(row_ids, jax.Array) else row_ids)
    ids = ids.ravel()
    if ids.size and (
        not (np.issubdtype(ids.dtype, np.integer) or np.issubdtype(ids.dtype, np.floating))
        or np.any(ids != np.round(ids))
        or ids.min() < 0
        or ids.max() >= n_rows
    ):
        shown = ids.tolist() if ids.size <= 16 else f"{ids[:16].tolist()} ... ({ids.size} ids)"
        raise KVStoreError(
            f"key {key!r}: row_ids expected integers in [0, {n_rows}), given {shown}"
        )
    if ids.size == 0 and not np.issubdtype(ids.dtype, np.number):
        ids = ids.astype(np.int32)
    return ids.astype(np.int32)


def _fetched(row_ids: list) -> list:
    """``row_ids`` with every id array on a device copied to the host in one transfer (one
    ``device_get`` each would wait for each in turn)."""
    row_ids = [x.asjax() if hasattr(x, "asjax") else x for x in row_ids]
    on_device = [i for i, x in enumerate(row_ids) if isinstance(x, jax.Array)]
    if on_device:
        got = jax.device_get([row_ids[i] for i in on_device])
        for i, x in zip(on_device, got):
            row_ids[i] = x
    return row_ids


def _traced_ids(row_ids: Any) -> Any:
    if hasattr(row_ids, "asjax"):
        row_ids = row_ids.asjax()
    ids = jnp.asarray(row_ids).ravel()
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        ids = jnp.where(ids == jnp.round(ids), ids, -1)  # a fraction selects no row
    return ids.astype(_ID_DTYPE)


def _block_rows(state: KVState, key: Key, leaf: Any) -> int | None:
    """Inside ``shard_map``: the rows of this device's block of ``key`` (``None``: ``leaf`` is
    the whole value); refuses a block that is not whole rows."""
    shape = state.shapes[key]
    if tuple(leaf.shape) == shape and not state._chunked(state.index(key)):
        return None
    if tuple(leaf.shape[1:]) != shape[1:]:
        raise KVStoreError(
            f"key {key!r}: expected this device's block to be whole rows of the table {shape}, "
            f"given a block of shape {tuple(leaf.shape)} (a split bucket cuts a table whose rows "
            "do not divide by the devices across rows); use layout='keys' for this table, or "
            "call this outside shard_map"
        )
    return int(leaf.shape[0])


def _axis(state: KVState, axis_name: Any, key: Key) -> Any:
    names = axis_names(axis_name) if axis_name is not None else (state.axis,)
    if len(names) != 1:
        raise KVStoreError(
            f"key {key!r}: expected one mapped axis for the rows of a table, given {names}"
        )
    return names[0]


# -- pull -------------------------------------------------------------------------------------
def pull_rows(
    state: KVState, key: Any, row_ids: Any, *, devices: Any = None, axis_name: Any = None
) -> Any:
    """The rows ``row_ids`` of the value of ``key``: shape ``(len(row_ids), *shape[1:])``
    (``row_ids`` of any shape are flattened), in their order, repeats allowed.

    Its cost grows with the rows asked for, not with the table: only those rows are read and
    moved, from the devices that hold them when the table is sharded.

    Args:
      state: the store.
      key: a key whose value has rows (at least one dimension).
      row_ids: integer row ids (whole-number floats are accepted, as MXNet's ids often are).
      devices: where to place the result (replicated on each); default the store's devices.
        With a list of id arrays as ``row_ids`` (one per device), the devices they go to
        (default: the store's), and the result is a list: each device's rows, on it.
      axis_name: inside ``shard_map`` over a sharded table (its leaf this device's block): the
        mapped axis (default the store's axis name). Each device gets the rows of its own ids.

    Raises:
      KVStoreError: eagerly, an id that is not a whole number in ``[0, rows)``. Inside ``jit``
        such an id cannot be refused: it selects no row (its row of the result is zeros).

    Examples:
      >>> import jax.numpy as jnp, jaxkv
      >>> s = jaxkv.init(jaxkv.empty(), {"e": jnp.arange(6.0).reshape(3, 2)})
      >>> jaxkv.pull_rows(s, "e", [2, 0, 2]).tolist()
      [[4.0, 5.0], [0.0, 1.0], [4.0, 5.0]]
    """
    key, i, shape = _table(state, key, "pull_rows")
    value = state[key]
    if is_traced(value) or is_traced(row_ids) or _traced_leaves(state):
        ids = _traced_ids(row_ids)
        block = _block_rows(state, key, value)
        if block is None:
            return _take(value, jnp.where(ids >= 0, ids, shape[0]))
        axis = _axis(state, axis_name, key)
        ids = jnp.where(ids >= 0, ids, shape[0])
        asked = jax.lax.all_gather(ids, axis)  # every device's request
        part = _take(value, asked, jax.lax.axis_index(axis) * block)
        return jax.lax.psum_scatter(part, axis, scatter_dimension=0)
    if _spans_processes(state):
        return _pull_across(state, key, i, shape, row_ids, devices)
    if _per_device(row_ids):
        return _pull_per_device(state, key, i, shape, list(row_ids), devices)
    ids = _host_ids(key, row_ids, shape[0])
    out = _eager_take(state, key, i, ids)
    if devices is not None:
        out = replicate([out], devices_of(devices))[0]
    return out


def _per_device(row_ids: Any) -> bool:
    """Whether eager ``row_ids`` are a list of id arrays (one per device), not ids."""
    return isinstance(row_ids, list | tuple) and any(
        np.ndim(x) >= 1 or hasattr(x, "shape") and len(x.shape) >= 1 for x in row_ids
    )


def _pull_per_device(
    state: KVState, key: Key, i: int, shape: tuple[int, ...], row_ids: list, devices: Any
) -> list[jax.Array]:
    """Each device's own rows, on it: ``row_ids[j]`` to ``devices[j]``. Where the devices are
    the store's, in order, and ask for as many rows each, one computation serves them all
    (each device gathers from its block of a sharded table what every device asks, and one
    ``psum_scatter`` gives each its own rows); else one pull each."""
    targets = devices_of(devices) if devices is not None else state.devices
    if len(targets) != len(row_ids):
        raise ShapeError(
            f"key {key!r}: expected one row_ids per device ({len(targets)} devices), given "
            f"{len(row_ids)} row_ids"
        )
    ids = [_host_ids(key, x, shape[0]) for x in _fetched(row_ids)]
    leaf = _own_leaf(state, i)
    sizes = {x.size for x in ids}
    if (
        targets != state.devices
        or len(sizes) != 1
        or leaf is None
        or len(targets) == 1
        or _spans_processes(state)
    ):
        return [_place(_eager_take(state, key, i, x), d) for x, d in zip(ids, targets)]
    asked = _split_ids(state, row_ids, ids)
    if state.is_sharded(shape):
        c = slots(busiest(ids, shape[0] // len(targets), len(targets)))
        fn = _routed_take(state.mesh, state.axis, c)
        return per_device(_dist.ordered("pull_rows", fn, state._leaves[leaf], asked))
    fn = _per_device_take(state.mesh, state.axis, False)
    return per_device(_dist.ordered("pull_rows", fn, state._leaves[leaf], asked))


def _split_ids(state: KVState, given: Sequence[Any], ids: list[np.ndarray]) -> jax.Array:
    """Each device's ids (``ids[j]``, checked on the host, as many for each device) as one array
    split along axis 0 over the store's mesh: the ``given`` arrays themselves where they are
    already ``int32`` on their devices, else copied from the host."""
    split = NamedSharding(state.mesh, PartitionSpec(state.axis))
    n = ids[0].size
    shards = [x.asjax() if hasattr(x, "asjax") else x for x in given]
    if all(
        isinstance(x, jax.Array) and x.dtype == jnp.int32 and x.shape == (n,) and x.devices() == {d}
        for x, d in zip(shards, state.devices)
    ):
        return assemble((n * len(shards),), split, shards)
    return jax.device_put(np.concatenate(ids), split)


def busiest(ids: Sequence[np.ndarray], block: int, parts: int) -> int:
    """The most ids one of ``ids`` (one array of checked ids per device) sends to one owner of a
    table cut in ``parts`` blocks of ``block`` rows."""
    return max(
        (int(np.bincount(x // block, minlength=parts).max()) for x in ids if x.size), default=1
    )


def slots(most: int) -> int:
    """``C`` for a busiest route of ``most`` ids: ``most`` rounded up to a multiple of an
    eighth of its power of two (at least 8), so that a step compiles again only when its
    busiest route grows past one of 8 sizes per octave, and pads at most 1/8 (1,000 random
    ids per device over 8 devices: about 150 on the busiest route, C = 160; rounding to a
    power of two, 256, measured 1.8x slower)."""
    most = max(most, 1)
    step = max(8, 1 << max(most.bit_length() - 4, 0))
    return -(-most // step) * step


def _plan(ids: Any, block: int, parts: int, c: int) -> tuple[Any, Any]:
    """On one device, inside ``shard_map``: where each of its ``ids`` goes among the
    ``parts * c`` slots it sends (owner-major, ``c`` per owner of a table cut in ``parts``
    blocks of ``block`` rows), and each slot's id as a row of its owner's block (``block``,
    which selects nothing, where unused). An id outside the table (padding) goes nowhere: its
    slot is ``parts * c``. ``c`` is at least the most ids this device sends one owner (the host
    counts them: :func:`busiest`)."""
    valid = (ids >= 0) & (ids < parts * block)
    owner = jnp.where(valid, ids // block, parts)
    to = owner[:, None] == jnp.arange(parts, dtype=owner.dtype)[None, :]
    seen = jnp.cumsum(to.astype(jnp.int32), axis=0)  # ids so far for each owner
    slot = jnp.sum(jnp.where(to, seen, 0), axis=1) - 1
    dest = jnp.where(valid, owner * c + slot, parts * c)
    local = jnp.full(parts * c, block, ids.dtype)
    return dest, local.at[dest].set(ids - owner * block, mode="drop")


def _exchange(local: Any, rows: Any, dest: Any, axis: str) -> tuple[Any, Any]:
    """Each slot's id and row sent to its owner (see :func:`_plan`): one all-to-all, the id a
    column of the rows bit cast to ``int32`` where the rows' items are 4 bytes, else two."""
    n = local.shape[0]
    shape = rows.shape[1:]
    if jnp.dtype(rows.dtype).itemsize != 4:
        sent = jnp.zeros((n, *shape), rows.dtype).at[dest].set(rows, mode="drop")
        ids = jax.lax.all_to_all(local, axis, 0, 0, tiled=True)
        return ids, jax.lax.all_to_all(sent, axis, 0, 0, tiled=True)
    flat = rows.reshape(rows.shape[0], math.prod(shape))
    if flat.dtype != jnp.int32:
        flat = jax.lax.bitcast_convert_type(flat, jnp.int32)
    sent = jnp.zeros((n, flat.shape[1] + 1), jnp.int32).at[:, -1].set(local)
    sent = jax.lax.all_to_all(sent.at[dest, :-1].set(flat, mode="drop"), axis, 0, 0, tiled=True)
    got = sent[:, :-1]
    if rows.dtype != jnp.int32:
        got = jax.lax.bitcast_convert_type(got, rows.dtype)
    return sent[:, -1], got.reshape(n, *shape)


@functools.lru_cache(maxsize=64)
def _routed_take(mesh: Any, axis: str, c: int) -> Any:
    """``(table, ids) -> rows``, both split along axis 0 over the mesh: each device's ids sent
    to their owners and the rows back, two all-to-alls of ``parts * c`` slots."""
    parts = mesh.shape[axis]

    def body(block: Any, ids: Any) -> Any:
        dest, local = _plan(ids, block.shape[0], parts, c)
        asked = jax.lax.all_to_all(local, axis, 0, 0, tiled=True)  # what others ask of me
        got = jax.lax.all_to_all(_take(block, asked), axis, 0, 0, tiled=True)  # owner-major
        return jnp.take(got, dest, axis=0, mode="fill", fill_value=0)

    split = PartitionSpec(axis)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(split, split), out_specs=split))


def _spans_processes(state: KVState) -> bool:
    return _state_spans_processes(state.devices)


def _like_table(opt: Any, table: Any, split: PartitionSpec) -> Any:
    """The ``shard_map`` specs of an optimizer state beside a table split along ``split``: its
    leaves of the table's shape (per-parameter moments) split alike, the others replicated."""
    return jax.tree_util.tree_map(
        lambda x: split if tuple(x.shape) == tuple(table.shape) else PartitionSpec(), opt
    )


def _place(x: jax.Array, device: jax.Device) -> jax.Array:
    return replicate([x], (device,))[0]


@functools.lru_cache(maxsize=64)
def _per_device_take(mesh: Any, axis: str, sharded: bool) -> Any:
    def body(table: Any, ids: Any) -> Any:
        if not sharded:
            return _take(table, ids)
        asked = jax.lax.all_gather(ids, axis)
        part = _take(table, asked, jax.lax.axis_index(axis) * table.shape[0])
        return jax.lax.psum_scatter(part, axis, scatter_dimension=0)

    split = PartitionSpec(axis)
    table = split if sharded else PartitionSpec()
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(table, split), out_specs=split))


def _traced_leaves(state: KVState) -> bool:
    return any(is_traced(x) for x in state._leaves)


def _own_leaf(state: KVState, i: int) -> int | None:
    """The position among the leaves of key position ``i``'s own array, or ``None`` where it
    lives in a bucket."""
    flat = state._flat
    if flat is None:
        return i
    b, j, _ = flat.where[i]
    return None if b >= 0 else len(flat.buckets) + j


def _eager_take(state: KVState, key: Key, i: int, ids: np.ndarray) -> jax.Array:
    replicated = NamedSharding(state.mesh, PartitionSpec())
    dev_ids = jax.device_put(ids, replicated)
    leaf = _own_leaf(state, i)
    place = _in_bucket(state, i)
    if place is not None:  # its rows read straight from its bucket
        b, off, split = place
        fn = _bucket_rows_take(state.mesh, state.axis, off, state._shapes[i], split)
        return _dist.ordered("pull_rows", fn, state._leaves[b], dev_ids)
    if leaf is None:  # a view of a bucket: sliced and gathered in one computation
        return _dist.ordered("pull_rows", _bucket_take(key, replicated), state, dev_ids)
    table = state._leaves[leaf]
    sharded = state.is_sharded(state._shapes[i])
    fn = _sharded_take(state.mesh, state.axis) if sharded else _replicated_take(replicated)
    return _dist.ordered("pull_rows", fn, table, dev_ids)


@functools.lru_cache(maxsize=64)
def _replicated_take(sharding: NamedSharding) -> Any:
    return jax.jit(_take, out_shardings=sharding)


@functools.lru_cache(maxsize=64)
def _sharded_take(mesh: Any, axis: str) -> Any:
    def body(block: Any, ids: Any) -> Any:
        return jax.lax.psum(_take(block, ids, jax.lax.axis_index(axis) * block.shape[0]), axis)

    spec = PartitionSpec(axis)
    return jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(spec, PartitionSpec()), out_specs=PartitionSpec())
    )


# -- rows of a key in a flat bucket, addressed in place -------------------------------------------
# A key in a bucket is a run of its bucket (whole), or of each device's chunk (split, its rows
# dividing by the devices: device d's chunk holds rows [d*B, (d+1)*B) at the key's offset). Its
# rows are read and written there by element, so a step costs its rows, not its bucket. A key
# whose rows do not divide (a split bucket cuts it across rows) goes through its view.
def _in_bucket(state: KVState, i: int) -> tuple[int, int, bool] | None:
    """``(bucket, offset, split)`` of key position ``i`` where its rows can be addressed in its
    bucket, else ``None`` (an array of its own, or rows cut across devices)."""
    flat = state._flat
    if flat is None or any(is_traced(x) for x in state._leaves):
        return None
    b, off, _ = flat.where[i]
    if b < 0:
        return None
    parts = flat.parts_of(b)
    shape = state._shapes[i]
    if parts > 1 and shape[0] % parts:
        return None
    return b, off, parts > 1


def _elements(ids: Any, lo: Any, rows: int, off: int, width: int, size: int) -> Any:
    """The element positions ``(n, width)`` in a run (a bucket, or a device's chunk of
    ``size`` elements) of the rows ``ids`` of a key at ``off`` holding rows
    ``[lo, lo + rows)``; ``size`` (past the end) for rows elsewhere."""
    local = ids - lo
    inside = (local >= 0) & (local < rows)
    first = off + jnp.where(inside, local, 0) * width
    at = first[:, None] + jnp.arange(width, dtype=first.dtype)[None, :]
    return jnp.where(inside[:, None], at, size)


def _run_take(leaf: Any, ids: Any, lo: Any, rows: int, off: int, shape: tuple) -> Any:
    width = math.prod(shape[1:])
    at = _elements(ids, lo, rows, off, width, leaf.shape[0])
    got = jnp.take(leaf, at, mode="fill", fill_value=0)
    return got.reshape(ids.shape[0], *shape[1:])


def _run_put(leaf: Any, ids: Any, new: Any, lo: Any, rows: int, off: int, shape: tuple) -> Any:
    width = math.prod(shape[1:])
    at = _elements(ids, lo, rows, off, width, leaf.shape[0])
    values = new.reshape(ids.shape[0], width).astype(leaf.dtype)
    return leaf.at[at].set(values, mode="drop")


class _InRun(_Where):
    """``_Where`` for a key's run in a bucket (or in this device's chunk of a split one)."""

    def __init__(self, axis: Any, rows: int, off: int, shape: tuple) -> None:
        super().__init__(axis, rows)
        self.off, self.shape = off, shape

    def take_own(self, x: Any, ids: Any) -> Any:
        return _run_take(x, ids, self.lo(), self.block, self.off, self.shape)

    def take(self, x: Any, ids: Any) -> Any:
        mine = self.take_own(x, ids)
        return mine if self.axis is None else jax.lax.psum(mine, self.axis)

    def put(self, x: Any, ids: Any, rows: Any) -> Any:
        return _run_put(x, ids, rows, self.lo(), self.block, self.off, self.shape)


@functools.lru_cache(maxsize=256)
def _bucket_rows_take(mesh: Any, axis: str, off: int, shape: tuple, split: bool) -> Any:
    """``(bucket, ids) -> rows`` of a key at ``off`` in its bucket, read in place."""
    if not split:  # the result named whole on the devices: with no ids, XLA would pick one
        whole = NamedSharding(mesh, PartitionSpec())
        take = lambda leaf, ids: _run_take(leaf, ids, 0, shape[0], off, shape)  # noqa: E731
        return jax.jit(take, out_shardings=whole)
    parts = mesh.devices.size

    def body(chunk: Any, ids: Any) -> Any:
        rows = shape[0] // parts
        lo = jax.lax.axis_index(axis) * rows
        return jax.lax.psum(_run_take(chunk, ids, lo, rows, off, shape), axis)

    spec = PartitionSpec(axis)
    return jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(spec, PartitionSpec()), out_specs=PartitionSpec())
    )


def _bucket_push(
    state: KVState,
    key: Key,
    i: int,
    place: tuple[int, int, bool],
    n: int | None,
    ids: Any,
    rows: Any,
    updater: Any,
    donate: bool,
) -> KVState:
    """A push of rows into a key of a bucket, in place: the bucket, and for an optax updater
    its group's state (the key's own: its moments packed in buckets laid out as its value's),
    in and out of one computation."""
    b, off, split = place
    shape = state._shapes[i]
    packing = None if n is None else state._packings[n]
    opt: Any = None
    families: tuple[int, ...] = ()
    if n is not None and packing is not None:
        # one key alone in its group (and its bucket): each family bucket is laid out as the
        # value's, from offset 0
        opt, families = tuple(state._opt_states[n]), tuple(packing.packed_positions())
    fn = _bucket_pusher(
        state.mesh, state.axis, key, off, shape, split, updater, packing, families, donate
    )
    value, opt = _dist.ordered("push_rows", fn, state._leaves[b], opt, ids, rows)
    return state._replace_leaves({b: value}, {} if n is None else {n: opt})


@functools.lru_cache(maxsize=256)
def _bucket_pusher(
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
    """``(bucket, opt_state, ids, rows) -> (bucket, opt_state)`` for a key at ``off``."""
    parts = mesh.devices.size if split else 1
    rows_here = shape[0] // parts

    def update(leaf: Any, opt: Any, ids: Any, rows: Any) -> Any:
        where = _InRun(axis if split else None, rows_here, off, shape)
        if packing is None:
            return _update_rows(key, where, leaf, opt, ids, rows, shape[0], updater)
        # The packed leaves as optax's tree: each family bucket as the key's value (addressed
        # by the same run), the other leaves as they are.
        tree = jax.tree_util.tree_unflatten(packing.treedef, list(opt))
        value, new = _update_rows(key, where, leaf, tree, ids, rows, shape[0], updater)
        return value, tuple(jax.tree_util.tree_leaves(new))

    if not split:
        return jax.jit(update, donate_argnums=(0, 1) if donate else ())
    spec = PartitionSpec(axis)

    def run(leaf: Any, opt: Any, ids: Any, rows: Any) -> Any:
        if packing is None:
            opt_spec = _like_table(opt, leaf, spec)
        else:
            opt_spec = tuple(spec if j in families else PartitionSpec() for j in range(len(opt)))
        mapped = jax.shard_map(
            update,
            mesh=mesh,
            in_specs=(spec, opt_spec, PartitionSpec(), PartitionSpec()),
            out_specs=(spec, opt_spec),
            check_vma=False,
        )
        return mapped(leaf, opt, ids, rows)

    return jax.jit(run, donate_argnums=(0, 1) if donate else ())


@functools.lru_cache(maxsize=256)
def _bucket_take(key: Key, out: NamedSharding | None = None) -> Any:
    """The rows of a key read through its view of its bucket (``out``: where the result goes;
    across processes, each device's rows for its own ids, split along axis 0)."""
    return jax.jit(lambda state, ids: _take(state[key], ids), out_shardings=out)


# -- row_sparse_pull --------------------------------------------------------------------------
def row_sparse_pull(state: KVState, key: Any, row_ids: Any, *, devices: Any = None) -> jax.Array:
    """The value of ``key`` with only the rows in ``row_ids`` kept and the others zero.

    Only the rows asked for are read (and, for a sharded table, each stays on the device that
    holds it): the rest of the result is zeros written in place. :func:`pull_rows` gives the
    rows alone, ``(len(row_ids), ...)``.

    Eagerly, ids that are not whole numbers in ``[0, rows)`` are refused. Inside ``jit`` (traced
    ids) they cannot be: there an id outside ``[0, rows)`` selects no row.

    Examples:
      >>> import jax.numpy as jnp, jaxkv
      >>> s = jaxkv.init(jaxkv.empty(), {"e": jnp.ones((3, 2))})
      >>> jaxkv.row_sparse_pull(s, "e", [0, 2]).tolist()
      [[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]]
    """
    key, i, shape = _table(state, key, "row_sparse_pull")
    value = state[key]
    if is_traced(value) or is_traced(row_ids) or _traced_leaves(state):
        ids = _traced_ids(row_ids)
        ids = jnp.where(ids >= 0, ids, shape[0])
        lo: Any = 0
        block = _block_rows(state, key, value)
        if block is not None:
            lo = jax.lax.axis_index(_axis(state, None, key)) * block
        return _put(jnp.zeros_like(value), ids, _take(value, ids, lo), lo)
    ids = _host_ids(key, row_ids, shape[0])
    leaf = _own_leaf(state, i)
    # Whole on the store's devices where the store keeps it so, as a pull gives it (a result
    # that needs no input, no ids at all, would otherwise land on one device).
    replicated = NamedSharding(state.mesh, PartitionSpec())
    dev_ids = jax.device_put(ids, replicated)
    if leaf is None:
        out_to = state.sharding_for(shape)  # named for a key of a split bucket too
        out = _dist.ordered("row_sparse_pull", _bucket_keep(key, out_to), state, dev_ids)
    else:
        sharded = state.is_sharded(shape)
        fn = _sharded_keep(state.mesh, state.axis) if sharded else _replicated_keep(replicated)
        out = _dist.ordered("row_sparse_pull", fn, state._leaves[leaf], dev_ids)
    return out if devices is None else replicate([out], devices_of(devices))[0]


def _keep(x: Any, ids: Any, lo: Any = 0) -> Any:
    return _put(jnp.zeros_like(x), ids, _take(x, ids, lo), lo)


@functools.lru_cache(maxsize=64)
def _replicated_keep(out: NamedSharding) -> Any:
    return jax.jit(_keep, out_shardings=out)


@functools.lru_cache(maxsize=64)
def _sharded_keep(mesh: Any, axis: str) -> Any:
    def body(block: Any, ids: Any) -> Any:
        return _keep(block, ids, jax.lax.axis_index(axis) * block.shape[0])

    spec = PartitionSpec(axis)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, PartitionSpec()), out_specs=spec))


@functools.lru_cache(maxsize=256)
def _bucket_keep(key: Key, out: NamedSharding | None) -> Any:
    return jax.jit(lambda state, ids: _keep(state[key], ids), out_shardings=out)


# -- push -------------------------------------------------------------------------------------
def _pairs(key: Key, row_ids: Any, rows: Any) -> list[tuple[Any, Any]]:
    """``(row_ids, rows)`` as a list of pairs: one pair, or one per device."""
    many = isinstance(rows, list | tuple)  # rows decide: row ids may be a plain list of ints
    if many and (not isinstance(row_ids, list | tuple) or len(rows) != len(row_ids)):
        given = f"{len(row_ids)} row_ids" if isinstance(row_ids, list | tuple) else "one row_ids"
        raise ShapeError(
            f"key {key!r}: push_rows expects one (row_ids, rows) pair or a list of each of the "
            f"same length (one per device), given {given} and {len(rows)} rows"
        )
    if many and not rows:
        raise ShapeError(f"key {key!r}: push_rows expects at least one (row_ids, rows) pair")
    return list(zip(row_ids, rows)) if many else [(row_ids, rows)]


def _unwrapped(x: Any) -> Any:
    return x.asjax() if hasattr(x, "asjax") else as_array(x)


def _check_rows(key: Key, shape: tuple[int, ...], dtype: Any, n: int, rows: Any, what: str) -> None:
    want = (n, *shape[1:])
    if tuple(rows.shape) != want:
        raise ShapeError(
            f"key {key!r}: {what} has shape {tuple(rows.shape)}, expected {want} (one row of the "
            f"table {shape} per row id)"
        )
    if jnp.dtype(rows.dtype).kind == "c" and jnp.dtype(dtype).kind != "c":
        raise KVStoreError(
            f"key {key!r}: {what} has dtype {rows.dtype}, expected a real dtype castable to the "
            f"stored {dtype}"
        )


def push_rows(
    state: KVState,
    key: Any,
    row_ids: Any,
    rows: Any,
    *,
    updater: Any = None,
    axis_name: Any = None,
    donate: bool = False,
) -> KVState:
    """A new state with the rows ``rows`` pushed to the rows ``row_ids`` of ``key``: a
    row-sparse push.

    ``(row_ids, rows)`` is one pair, or a list of row ids and a list of rows, one pair per
    device (``rows[j]`` of shape ``(len(row_ids[j]), *shape[1:])``). Rows pushed to the same id,
    in one pair or across pairs (and, with ``axis_name``, across devices), are summed. Only the
    rows pushed change, and with an optax updater only those rows of its optimizer state, as
    MXNet's ``lazy_update=True``: the updater runs on the touched rows (its step count, a leaf
    that is not per parameter, advances once per push). ``updater=None`` assigns the summed rows.
    An MXNet-style ``updater(key, pushed, stored)`` gets, as MXNet gives it, the pushed rows
    summed into a value of the table's shape (zeros elsewhere) and the stored value.

    Args:
      state: the store.
      key: the table's key.
      row_ids: integer row ids of any shape (flattened), or a list of them (one per device).
      rows: the rows, ``(n, *shape[1:])`` for ``n`` ids, or a list of them.
      updater: ``None`` (assign), an ``optax.GradientTransformation`` (lazy: only the touched
        rows; the key must be an optimizer group of its own), or ``updater(key, pushed, stored)``.
      axis_name: inside ``pmap``/``shard_map``: the mapped axis. Each device pushes its own
        pair; pairs that JAX has made invariant along it (the same on every device) count once.
      donate: let the computation reuse the buffers of ``state`` (which then becomes invalid);
        the table is then updated in place, at a cost that grows with the rows alone.

    Raises:
      KVStoreError: eagerly, an id that is not a whole number in ``[0, rows)``; rows of another
        shape; a key in an optimizer group with other keys. Inside ``jit``, an id outside
        ``[0, rows)`` cannot be refused: it updates nothing. Nothing changes on a refusal.

    Examples:
      >>> import jax.numpy as jnp, jaxkv
      >>> s = jaxkv.init(jaxkv.empty(), {"e": jnp.zeros((3, 2))})
      >>> s = jaxkv.push_rows(s, "e", [[2, 0], [2]], [jnp.ones((2, 2)), jnp.ones((1, 2))])
      >>> jaxkv.pull(s, "e").tolist()
      [[1.0, 1.0], [0.0, 0.0], [2.0, 2.0]]
    """
    return _push(state, key, row_ids, rows, updater, axis_name, donate, None)[0]


def pushpull_rows(
    state: KVState,
    key: Any,
    row_ids: Any,
    rows: Any,
    *,
    pull_ids: Any = None,
    updater: Any = None,
    axis_name: Any = None,
    donate: bool = False,
) -> tuple[KVState, Any]:
    """:func:`push_rows`, then :func:`pull_rows` from the new state, fused: ``(state, rows)``,
    the rows of ``pull_ids`` (default: the pushed ``row_ids``) after the push; with a list of
    pairs, a list: each pair's rows, on the device its rows came from.

    Where the table is sharded, the pairs are one per device of as many rows each and the
    updater is elementwise (the routed push of :func:`push_rows`), the push and the pull are one
    computation: the pushed rows go to their owners, and the rows asked for come back (along the
    same routes when they are the pushed ids). This is the step of an embedding table's training
    loop: push the gradient of the rows a batch touched, read back the rows the next batch needs
    (MXNet's ``kv.push`` then ``kv.row_sparse_pull``). Arguments and refusals as
    :func:`push_rows` (and :func:`pull_rows` for ``pull_ids``, checked before anything runs);
    the result is what ``push_rows`` then ``pull_rows`` give.

    Examples:
      >>> import jax.numpy as jnp, jaxkv
      >>> s = jaxkv.init(jaxkv.empty(), {"e": jnp.zeros((3, 2))})
      >>> s, got = jaxkv.pushpull_rows(s, "e", [2, 0, 2], jnp.ones((3, 2)))
      >>> got.tolist()
      [[2.0, 2.0], [1.0, 1.0], [2.0, 2.0]]
    """
    asked = row_ids if pull_ids is None else pull_ids
    many = isinstance(rows, list | tuple)
    if (
        pull_ids is not None
        and many
        and (not isinstance(pull_ids, list | tuple) or len(pull_ids) != len(rows))
    ):
        with _checking(state, key):  # across processes, a refusal is every process's
            raise ShapeError(
                f"key {key!r}: pushpull_rows with {len(rows)} pairs expects a list of "
                f"{len(rows)} pull_ids, one per pair"
            )
    traced = _traced_leaves(state) or is_traced(asked) or many and any(map(is_traced, asked))
    plan: Any = _SAME if pull_ids is None else None
    if pull_ids is not None and not traced:  # checked before the push can donate
        n_rows = _table(state, key, "pushpull_rows")[2][0]
        with _checking(state, key):
            if many:
                plan = (list(pull_ids), [_host_ids(key, x, n_rows) for x in _fetched(asked)])
            else:
                _host_ids(key, pull_ids, n_rows)
    state, pulled = _push(state, key, row_ids, rows, updater, axis_name, donate, plan)
    if pulled is not None:
        return state, pulled
    if not many:
        return state, pull_rows(state, key, asked, axis_name=axis_name)
    if traced:
        return state, [pull_rows(state, key, x, axis_name=axis_name) for x in asked]
    homes = []
    for r in rows:
        r = _unwrapped(r)
        on = r.devices() if isinstance(r, jax.Array) else ()
        homes.append(next(iter(on)) if len(on) == 1 else state.devices[0])
    return state, pull_rows(state, key, list(asked), devices=homes)


_SAME = "the pushed ids"  # pushpull_rows pulls the ids it pushed: the same routes serve both


def _push(
    state: KVState,
    key: Any,
    row_ids: Any,
    rows: Any,
    updater: Any,
    axis_name: Any,
    donate: bool,
    pull: Any,
    checked: list[np.ndarray] | None = None,
) -> tuple[KVState, Any]:
    """``push_rows``, and, where one computation can also pull (see :func:`pushpull_rows`), the
    pulled rows (else ``None``). ``pull``: ``None`` (no pull), ``_SAME`` (the pushed ids), or
    ``(given, checked)``, the ids to pull per device as given and checked on the host.
    ``checked``: the pairs' ids, already checked on the host (:func:`check_push`)."""
    key, i, shape = _table(state, key, "push_rows")
    dtype = state._stored_types()[i].dtype
    with _checking(state, key):
        pairs = [(ids, _unwrapped(r)) for ids, r in _pairs(key, row_ids, rows)]
    optax_push = isinstance(updater, optax.GradientTransformation)
    group = None
    if optax_push:
        group, _ = optimizer_group(state, (key,), unpack=False)
    traced = (
        _traced_leaves(state)
        or any(is_traced(x) for x in jax.tree_util.tree_leaves(state._opt_states))
        or any(is_traced(ids) or is_traced(r) for ids, r in pairs)
    )
    if traced:
        return _push_traced(state, key, shape, pairs, updater, axis_name, group), None
    if axis_name is not None:
        raise KVStoreError(
            f"axis_name={axis_name!r}: expected to be called inside pmap or shard_map, given an "
            "eager call (eagerly, a list of per-device pairs is already summed over devices)"
        )
    if checked is not None:
        host = list(zip(checked, [r for _, r in pairs]))
    else:
        with _checking(state, key):
            host = _host_pairs(key, shape, dtype, pairs)
    across = None
    if _spans_processes(state):  # agreed before anything runs (init_opt_states may compute)
        across = _across_pairs(state, key, shape, host)
    if optax_push and state.opt_group(key) is None:
        from ._push import init_opt_states

        state = init_opt_states(state, updater, (key,))
    leaf = _own_leaf(state, i)
    n: int | None = None if group is None else state._groups.index(group)
    if across is not None:
        return _push_across(state, key, shape, *across, updater, n, leaf, donate), None
    if leaf is not None and (n is None or state._packings[n] is None):
        routed = _routed(state, key, shape, host, updater, n, [ids for ids, _ in pairs])
        if routed is not None:
            c, ids, rows = routed
            args = [ids, rows]
            back: int | None = None
            if pull is _SAME:
                back = 0
            elif pull is not None and len({x.size for x in pull[1]}) == 1:
                args.append(_split_ids(state, pull[0], pull[1]))
                back = slots(busiest(pull[1], shape[0] // len(state.devices), len(state.devices)))
            fn = _routed_push(state.mesh, state.axis, key, updater, donate, c, back)
            opt = None if n is None else state._opt_states[n]
            out = _dist.ordered("push_rows", fn, state._leaves[leaf], opt, *args)
            new = state._replace_leaves({leaf: out[0]}, {} if n is None else {n: out[1]})
            return new, None if back is None else per_device(out[2])
    ids, rows = _gathered(state, key, host, dtype)
    place = _in_bucket(state, i)
    if place is not None and (
        updater is None or (optax_push and n is not None and state._packings[n] is not None)
    ):
        return _bucket_push(state, key, i, place, n, ids, rows, updater, donate), None
    if leaf is not None and (n is None or state._packings[n] is None):
        fn = _own_push(
            state.mesh, state.axis, key, shape[0], state.is_sharded(shape), updater, donate
        )
        opt = None if n is None else state._opt_states[n]
        value, opt = _dist.ordered("push_rows", fn, state._leaves[leaf], opt, ids, rows)
        return state._replace_leaves({leaf: value}, {} if n is None else {n: opt}), None
    fn = _state_push(key, shape[0], updater, donate)
    return _dist.ordered("push_rows", fn, state, ids, rows), None


def _host_pairs(
    key: Key, shape: tuple[int, ...], dtype: Any, pairs: list[tuple[Any, Any]]
) -> list[tuple[np.ndarray, Any]]:
    """The pairs with their ids on the host, each pair checked."""
    host = []
    fetched = _fetched([ids for ids, _ in pairs])
    for j, (ids, r) in enumerate(zip(fetched, [r for _, r in pairs])):
        what = "the rows" if len(pairs) == 1 else f"rows {j}"
        ids = _host_ids(key, ids, shape[0])
        _check_rows(key, shape, dtype, ids.size, r, what)
        host.append((ids, r))
    return host


def check_push(state: KVState, key: Any, row_ids: Any, rows: Any, updater: Any) -> list[np.ndarray]:
    """Every refusal of an eager ``push_rows(state, key, row_ids, rows, updater=updater)``,
    raised now, for a push that runs later (the imperative store's held push); returns the
    checked ids on the host, one array per pair, for :func:`pushpull_checked`."""
    key, i, shape = _table(state, key, "push_rows")
    pairs = [(ids, _unwrapped(r)) for ids, r in _pairs(key, row_ids, rows)]
    if isinstance(updater, optax.GradientTransformation):
        optimizer_group(state, (key,), unpack=False)
    return [x for x, _ in _host_pairs(key, shape, state._stored_types()[i].dtype, pairs)]


def pushpull_checked(
    state: KVState,
    key: Key,
    pushed: tuple[list, list, list[np.ndarray]],
    pulled: tuple[list, list[np.ndarray]],
    updater: Any,
    donate: bool,
) -> tuple[KVState, list[jax.Array]]:
    """``pushpull_rows`` of pairs and pull ids already checked (one per device of the store,
    eagerly, in one process): ``pushed`` is ``(row_ids, rows, ids)`` and ``pulled``
    ``(placed, ids)``, ``ids`` the checked ids on the host (:func:`check_push`) and ``placed``
    the pull ids on their devices, used in place."""
    row_ids, rows, ids = pushed
    state, got = _push(state, key, row_ids, rows, updater, None, donate, pulled, ids)
    if got is None:
        got = pull_rows(state, key, pulled[1], devices=[next(iter(x.devices())) for x in pulled[0]])
    return state, got


def _routed(
    state: KVState,
    key: Key,
    shape: tuple[int, ...],
    host: list[tuple[np.ndarray, Any]],
    updater: Any,
    n: int | None,
    given: Sequence[Any],
) -> tuple[int, Any, Any] | None:
    """A push of one pair per device of the store, in place there, of as many rows each, into a
    sharded table, with an updater that needs no other device's rows (none, an MXNet-style
    updater on the block, an elementwise optax one): ``C`` and the ``(ids, rows)`` arguments of
    :func:`_routed_push`, each device's rows going straight to the owners of their ids
    (``given``: the row ids as given, used in place where they can be). Else ``None``: every
    device gets every pushed row (:func:`_gathered`)."""
    devices = state.devices
    parts = len(devices)
    if (
        not state.is_sharded(shape)
        or len(host) != parts
        or len({r.shape[0] for _, r in host}) != 1
        or [next(iter(r.devices())) if len(r.devices()) == 1 else None for _, r in host]
        != list(devices)
        or len({r.dtype for _, r in host}) != 1
        or _spans_processes(state)
    ):
        return None
    if not _owners_alone(state, key, shape, updater, n):
        return None
    c = slots(busiest([ids for ids, _ in host], shape[0] // parts, parts))
    split = NamedSharding(state.mesh, PartitionSpec(state.axis))
    rows = host[0][1].shape[0]
    stacked = assemble((rows * parts, *shape[1:]), split, [r for _, r in host])
    return c, _split_ids(state, given, [ids for ids, _ in host]), stacked


def _owners_alone(
    state: KVState, key: Key, shape: tuple[int, ...], updater: Any, n: int | None
) -> bool:
    """Whether each owner can update its own rows alone: no updater, an MXNet-style one (it
    gets this device's block), or an elementwise optax one."""
    if not isinstance(updater, optax.GradientTransformation):
        return True
    opt = state._opt_states[n]  # type: ignore[index]
    rows_state = optax.tree_utils.tree_map_params(
        updater, lambda x: jax.ShapeDtypeStruct((1, *shape[1:]), x.dtype), opt
    )
    name = np.dtype(state._stored_types()[state.index(key)].dtype).name
    return _elementwise(updater, (key,), ((1, *shape[1:]),), name, rows_state)


# -- across processes ---------------------------------------------------------------------------
# Each process brings its own ids: every device of every process is one source (or requester)
# of rows, padded to the largest count of any device, and a sharded table's routes are sized by
# the busiest route of any device; one host all-gather agrees on both before the computation.
def _local_devices(state: KVState) -> list[jax.Device]:
    me = jax.process_index()
    return [d for d in state.devices if d.process_index == me]


def _agreed(key: Key, values: tuple[int, int], refused: bool = False) -> tuple[int, int]:
    """The largest of each value over every process: one host all-gather, the one collective
    every process makes for a row operation before any computation, after checking its own
    arguments. Where a process refused them (``refused``: it raises its own error after this),
    every other process raises too, and nothing changes anywhere."""
    sent = np.array([int(refused), *values], np.int64)
    got = _dist.all_gather(sent, "sizes of a row operation")
    refusing = np.flatnonzero(got[:, 0]).tolist()
    if refused:
        return values
    if refusing:
        raise KVStoreError(
            f"key {key!r}: the row operation was refused on process(es) {refusing} (their "
            "error says why; each process checks its own ids and rows); nothing changed on any "
            "process"
        )
    return int(got[:, 1].max()), int(got[:, 2].max())


@contextlib.contextmanager
def _checking(state: KVState, key: Any) -> Iterator[None]:
    """Checks of this process's arguments to a row operation: where the store spans processes,
    a refusal is told to the others in the all-gather they meet next (:func:`_agreed`), so that
    every process raises, not this one alone while the others wait for it."""
    try:
        yield
    except KVStoreError:
        if _spans_processes(state):
            _agreed(key, (0, 0), refused=True)
        raise


def _global(state: KVState, shards: Sequence[Any]) -> jax.Array:
    """One array sharded along axis 0 over the store's mesh, whose block on each of this
    process's devices (in mesh order) is ``shards[j]``."""
    local = _local_devices(state)
    placed = jax.device_put(list(shards), local)
    shape = (shards[0].shape[0] * len(state.devices), *shards[0].shape[1:])
    split = NamedSharding(state.mesh, PartitionSpec(state.axis))
    return jax.make_array_from_single_device_arrays(shape, split, list(placed))


def _padded_ids(ids: np.ndarray, n: int, fill: int) -> np.ndarray:
    return np.concatenate([ids, np.full(n - ids.size, fill, np.int32)]).astype(np.int32)


def _pull_across(
    state: KVState, key: Key, i: int, shape: tuple[int, ...], row_ids: Any, devices: Any
) -> Any:
    """``pull_rows`` on a store across processes: this process's ids (one array, asked by its
    first device, or one per device of this process) and its rows, on its devices."""
    local = _local_devices(state)
    leaf = _own_leaf(state, i)
    per = _per_device(row_ids)
    with _checking(state, key):
        given = _fetched(list(row_ids) if per else [row_ids])
        asked = [_host_ids(key, x, shape[0]) for x in given]
        if per and len(asked) != len(local):
            raise ShapeError(
                f"key {key!r}: expected one row_ids per device of this process ({len(local)}), "
                f"given {len(asked)} row_ids"
            )
    mine = asked + [np.zeros(0, np.int32)] * (len(local) - len(asked))
    parts = len(state.devices)
    sharded = state.is_sharded(shape) and leaf is not None
    block = shape[0] // parts
    most = busiest(mine, block, parts) if sharded else 1
    n, most = _agreed(key, (max(x.size for x in mine), most))
    n = max(n, 1)  # no ids anywhere: one padded id (XLA may place a zero-size result whole)
    if sharded and leaf is not None:
        fn = _routed_take(state.mesh, state.axis, slots(most))
        ids = _global(state, [_padded_ids(x, n, -1) for x in mine])
        out = _dist.ordered("pull_rows", fn, state._leaves[leaf], ids)
    elif leaf is not None:
        fn = _per_device_take(state.mesh, state.axis, False)
        padded = [_padded_ids(x, n, 0) for x in mine]
        out = _dist.ordered("pull_rows", fn, state._leaves[leaf], _global(state, padded))
    else:  # in a bucket (whole on every device across processes): read from the view
        split = NamedSharding(state.mesh, PartitionSpec(state.axis))
        asked_all = _global(state, [_padded_ids(x, n, 0) for x in mine])
        out = _dist.ordered("pull_rows", _bucket_take(key, split), state, asked_all)
    rows = [x[: a.size] for x, a in zip(per_device(out), mine)]
    if per:
        targets = devices_of(devices) if devices is not None else tuple(local)
        return [_place(r, d) for r, d in zip(rows, targets)]
    return replicate([rows[0]], devices_of(devices) if devices is not None else tuple(local))[0]


def _across_pairs(
    state: KVState, key: Key, shape: tuple[int, ...], host: list[tuple[np.ndarray, Any]]
) -> tuple[list[tuple[np.ndarray, Any]], int, int]:
    """This process's checked pairs as one pair per device of this process (all of them from
    its first device, if not already so), with the largest count of ids of any device of any
    process and the busiest route of a sharded table, agreed (:func:`_agreed`)."""
    local = _local_devices(state)
    placed = [next(iter(r.devices())) if len(r.devices()) == 1 else None for _, r in host]
    dtype = state._stored_types()[state.index(key)].dtype
    if len(host) == len(local) and placed == local:
        pairs = [(ids, r.astype(dtype)) for ids, r in host]
    else:
        ids = np.concatenate([x for x, _ in host])
        moved = jax.device_put([r.astype(dtype) for _, r in host], [local[0]] * len(host))
        rows = jnp.concatenate(moved) if len(moved) > 1 else moved[0]
        pairs = [(ids, rows)] + [
            (np.zeros(0, np.int32), jax.device_put(np.zeros((0, *shape[1:]), dtype), d))
            for d in local[1:]
        ]
    parts = len(state.devices)
    sharded = state.is_sharded(shape) and _own_leaf(state, state.index(key)) is not None
    most = busiest([x for x, _ in pairs], shape[0] // parts, parts) if sharded else 1
    n, most = _agreed(key, (max(x.size for x, _ in pairs), most))
    return pairs, max(n, 1), most  # no rows anywhere: one padded row that selects nothing


def _push_across(
    state: KVState,
    key: Key,
    shape: tuple[int, ...],
    pairs: list[tuple[np.ndarray, Any]],
    n: int,
    most: int,
    updater: Any,
    n_group: int | None,
    leaf: int | None,
    donate: bool,
) -> KVState:
    """``push_rows`` on a store across processes: this process's pairs, one per device of this
    process, summed with every other process's (``n`` ids per device and the busiest route
    ``most`` agreed by :func:`_across_pairs`)."""
    sharded = state.is_sharded(shape) and leaf is not None
    alone = sharded and (n_group is None or state._packings[n_group] is None)
    alone = alone and _owners_alone(state, key, shape, updater, n_group)
    rows = [_pad_rows(r, n) for _, r in pairs]
    opt = None if n_group is None else state._opt_states[n_group]
    if alone and leaf is not None:
        fn = _routed_push(state.mesh, state.axis, key, updater, donate, slots(most), None)
        padded = _global(state, [_padded_ids(x, n, -1) for x, _ in pairs])
        value, opt = _dist.ordered(
            "push_rows", fn, state._leaves[leaf], opt, padded, _global(state, rows)
        )
        return state._replace_leaves({leaf: value}, {} if n_group is None else {n_group: opt})
    stacked_ids = _global(state, [_padded_ids(x, n, -1) for x, _ in pairs])
    stacked = _global(state, rows)
    if leaf is not None and (n_group is None or state._packings[n_group] is None):
        fn = _own_push(state.mesh, state.axis, key, shape[0], sharded, updater, donate)
        value, opt = _dist.ordered("push_rows", fn, state._leaves[leaf], opt, stacked_ids, stacked)
        return state._replace_leaves({leaf: value}, {} if n_group is None else {n_group: opt})
    fn = _state_push(key, shape[0], updater, donate)
    return _dist.ordered("push_rows", fn, state, stacked_ids, stacked)


def _pad_rows(rows: Any, n: int) -> Any:
    if rows.shape[0] == n:
        return rows
    device = next(iter(rows.devices()))
    zeros = jax.device_put(np.zeros((n - rows.shape[0], *rows.shape[1:]), rows.dtype), device)
    return jnp.concatenate([rows, zeros])


@functools.lru_cache(maxsize=256)
def _routed_push(
    mesh: Any, axis: str, key: Key, updater: Any, donate: bool, c: int, back: int | None
) -> Any:
    """``(table, opt_state, ids, rows) -> (table, opt_state)``, ids and rows split along axis 0:
    each device sends each owner its ids and rows for it (one all-to-all of ``parts * c`` slots,
    see :func:`_plan`), and each owner sums and updates the rows of its block alone.

    With ``back`` (not ``None``), also each device's rows after the update: ``back == 0``, the
    pushed ids, in their order (one more all-to-all, back along the same routes); ``back > 0``,
    the ids of one more argument, ``pull_ids`` (routed as a pull with ``C = back``: two more).
    Then ``(table, opt_state, rows)``."""
    split = PartitionSpec(axis)
    parts = mesh.shape[axis]

    def body(block: Any, opt: Any, ids: Any, rows: Any, *pull_ids: Any) -> Any:
        dest, local = _plan(ids, block.shape[0], parts, c)
        got_ids, got = _exchange(local, rows, dest, axis)
        block, opt = _update_rows(key, _Where(), block, opt, got_ids, got, block.shape[0], updater)
        if back is None:
            return block, opt
        if pull_ids:
            dest, local = _plan(pull_ids[0], block.shape[0], parts, back)
            got_ids = jax.lax.all_to_all(local, axis, 0, 0, tiled=True)
        rows = jax.lax.all_to_all(_take(block, got_ids), axis, 0, 0, tiled=True)
        return block, opt, jnp.take(rows, dest, axis=0, mode="fill", fill_value=0)

    def run(table: Any, opt: Any, ids: Any, rows: Any, *pull_ids: Any) -> Any:
        opt_spec = _like_table(opt, table, split)
        mapped = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(split, opt_spec, split, split, *[split] * len(pull_ids)),
            out_specs=(split, opt_spec) if back is None else (split, opt_spec, split),
            check_vma=False,
        )
        return mapped(table, opt, ids, rows, *pull_ids)

    return jax.jit(run, donate_argnums=(0, 1) if donate else ())


def _gathered(
    state: KVState, key: Key, host: list[tuple[np.ndarray, Any]], dtype: Any
) -> tuple[jax.Array, jax.Array]:
    """Every pair's ids and rows side by side, on the store's devices: rows already on the
    store's devices, one pair on each, are used in place (one array sharded over the mesh);
    others are copied there."""
    replicated = NamedSharding(state.mesh, PartitionSpec())
    ids = np.concatenate([ids for ids, _ in host])
    devices = state.devices
    placed = [next(iter(r.devices())) if len(r.devices()) == 1 else None for _, r in host]
    sizes = {r.shape[0] for _, r in host}
    if (
        len(host) == len(devices) > 1
        and len(sizes) == 1
        and placed == list(devices)
        and all(r.dtype == host[0][1].dtype for _, r in host)
        and all(d.process_index == jax.process_index() for d in devices)
    ):
        n = sizes.pop()
        spec = NamedSharding(state.mesh, PartitionSpec(state.axis))
        rows = assemble((n * len(devices), *host[0][1].shape[1:]), spec, [r for _, r in host])
        return jax.device_put(ids, spec), rows
    if len(host) == 1:
        rows = jax.device_put(host[0][1], replicated)
    else:
        rows = _concat(tuple(jax.device_put([r for _, r in host], [replicated] * len(host))))
    return jax.device_put(ids, replicated), rows


@jax.jit
def _concat(rows: tuple) -> Any:
    dtype = jnp.result_type(*rows)
    return jnp.concatenate([r.astype(dtype) for r in rows])


@functools.lru_cache(maxsize=256)
def _own_push(
    mesh: Any, axis: str, key: Key, n_rows: int, sharded: bool, updater: Any, donate: bool
) -> Any:
    """The eager push of rows into a key kept as an array of its own: ``(table, opt_state,
    ids, rows) -> (table, opt_state)``, in a ``shard_map`` over the store's mesh for a sharded
    table (its optimizer state's per-parameter leaves sharded like it)."""
    donated = (0, 1) if donate else ()
    if not sharded:

        def whole(table: Any, opt: Any, ids: Any, rows: Any) -> Any:
            return _update_rows(key, _Where(), table, opt, ids, rows, n_rows, updater)

        return jax.jit(whole, donate_argnums=donated)

    return jax.jit(_sharded_runner(mesh, axis, key, n_rows, updater), donate_argnums=donated)


def _sharded_runner(mesh: Any, axis: str, key: Key, n_rows: int, updater: Any) -> Any:
    """``(table, opt_state, ids, rows) -> (table, opt_state)`` for a table sharded over
    ``mesh``: the pairs, whether replicated or one block per device, are all-gathered where
    they are not whole on each device."""
    split = PartitionSpec(axis)

    def run(table: Any, opt: Any, ids: Any, rows: Any) -> Any:
        opt_spec = _like_table(opt, table, split)

        def body(block: Any, opt: Any, ids: Any, rows: Any) -> Any:
            # ids and rows arrive whole (replicated in_specs): XLA gathers stacked pairs once.
            where = _Where(axis, block.shape[0])
            return _update_rows(key, where, block, opt, ids, rows, n_rows, updater)

        mapped = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(split, opt_spec, PartitionSpec(), PartitionSpec()),
            out_specs=(split, opt_spec),
            check_vma=False,
        )
        return mapped(table, opt, ids, rows)

    return run


@functools.lru_cache(maxsize=256)
def _state_push(key: Key, n_rows: int, updater: Any, donate: bool) -> Any:
    """The eager push of rows into a key of a bucket (flat layout): the whole state in and
    out, the key's view read and written inside the one computation."""

    def run(state: KVState, ids: Any, rows: Any) -> KVState:
        return _push_whole(state, key, n_rows, ids, rows, updater)

    return jax.jit(run, donate_argnums=(0,) if donate else ())


def _push_whole(
    state: KVState, key: Key, n_rows: int, ids: Any, rows: Any, updater: Any
) -> KVState:
    stored = state[key]
    group = state.opt_group(key) if isinstance(updater, optax.GradientTransformation) else None
    opt = None if group is None else state.opt_states[group]
    if isinstance(updater, optax.GradientTransformation) and opt is None:
        opt = updater.init({key: stored})
        group = (key,)
    value, opt = _update_rows(key, _Where(), stored, opt, ids, rows, n_rows, updater)
    return state.replace({key: value}, None if group is None else {group: opt})


def _push_traced(
    state: KVState,
    key: Key,
    shape: tuple[int, ...],
    pairs: Sequence[tuple[Any, Any]],
    updater: Any,
    axis_name: Any,
    group: tuple[Key, ...] | None,
) -> KVState:
    """``push_rows`` inside the caller's trace (``jit``, ``pmap`` or ``shard_map``)."""
    dtype = state._stored_types()[state.index(key)].dtype
    ids_list, rows_list = [], []
    for n, (ids, r) in enumerate(pairs):
        ids = _traced_ids(ids)
        _check_rows(
            key, shape, dtype, ids.shape[0], r, "the rows" if len(pairs) == 1 else f"rows {n}"
        )
        ids_list.append(ids)
        rows_list.append(r.astype(dtype))
    ids = jnp.concatenate(ids_list) if len(ids_list) > 1 else ids_list[0]
    rows = jnp.concatenate(rows_list) if len(rows_list) > 1 else rows_list[0]
    ids = jnp.where(ids >= 0, ids, shape[0])
    stored = state[key]
    block = _block_rows(state, key, stored)
    axis = None
    if axis_name is not None or block is not None:
        axis = _axis(state, axis_name, key)
        # Each device's own pair, gathered from all; pairs already the same on every device
        # (invariant along the axis) are not gathered, so they count once.
        if unsummed_axes(rows, (axis,)) or unsummed_axes(ids, (axis,)):
            ids = jax.lax.all_gather(ids, axis, tiled=True)
            rows = jax.lax.all_gather(rows, axis, tiled=True)
    if block is None:
        return _push_whole(state, key, shape[0], ids, rows, updater)
    opt = None if group is None else state.opt_states[group]
    if isinstance(updater, optax.GradientTransformation) and opt is None:
        raise KVStoreError(
            f"key {key!r}: expected optimizer state made before the step for a row push of this "
            "device's block inside shard_map; call jaxkv.init_optimizer(state, optimizer, "
            f"[{key!r}]) before it"
        )
    where = _Where(axis, block)
    value, opt = _update_rows(key, where, stored, opt, ids, rows, shape[0], updater)
    return state.replace({key: value}, None if group is None else {group: opt})
