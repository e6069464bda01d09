"""Rows of a table: ``pull_rows``, ``push_rows``, ``pushpull_rows`` and ``row_sparse_pull``,
which read, sum and update only the rows a step touches (MXNet's ``row_sparse`` values and
``lazy_update``).

How rows move. A table the store replicates is read and written where it is, on every device:
a gather of the rows asked for, a scatter of the rows pushed. A table the store shards (its rows
split over the D devices of the mesh, each holding ``R / D`` consecutive rows) is handled in one
``shard_map`` over the store's mesh. With one request (or pair) per device, the ids are routed:
the host checks them and counts the busiest route (``C``), each device places its ids in
``D * C`` slots, owner-major (:func:`kernels.plan`), one all-to-all takes them (and a push's
rows, its ids a column beside them) to their owners, and another brings a pull's rows back. An
owner sums the duplicate ids it gets (one sort, see :func:`kernels.dedupe`) and updates its own
rows alone where the updater is elementwise. Otherwise every device gets every pair (an
all-gather), reads the touched rows it holds, and one ``psum`` (or ``psum_scatter``) adds the D
partial answers. Cost: O(rows touched x D) per device at most, nothing proportional to the
table (with ``donate=True``: without it, a pure function must leave the old table intact, which
copies it). This module checks and dispatches; the computations are in ``kernels.py``.

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
import hashlib
import json
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jaxkv._src.core.checked import naming
from jaxkv._src.core.collectives import axis_names, psum_scatter, unsummed_axes
from jaxkv._src.core.on_buckets import abstract as _abstract
from jaxkv._src.core.on_buckets import elementwise as _elementwise
from jaxkv._src.core.on_buckets import structure as _structure
from jaxkv._src.core.tree_view import viewed
from jaxkv._src.core.updater import as_updater, optimizer_group, updater_errors
from jaxkv._src.errors import KVStoreError, ShapeError, shown
from jaxkv._src.jax_internals import (
    ArrayImpl,
    any_tracer,
    assemble,
    per_device,
    single_device,
    single_device_sharding,
    single_devices,
)
from jaxkv._src.processes import host, order
from jaxkv._src.rows import inband
from jaxkv._src.rows.kernels import (
    ROUTE,
    Dense,
    Where,
    bucket_keep,
    bucket_pusher,
    bucket_rows_take,
    bucket_take,
    own_push,
    per_device_take,
    push_whole,
    put,
    replicated_keep,
    replicated_take,
    routed_push,
    routed_take,
    sharded_keep,
    sharded_take,
    state_push,
    take,
    update_rows,
)
from jaxkv._src.rows.sizes import (
    Padded,
    concat_rows,
    cut,
    exact,
    fit,
    pad_ids,
    pad_rows,
    padded,
    route,
    slots,
    sorted_distinct,
)
from jaxkv._src.state import buckets
from jaxkv._src.state.dtypes import check_dtype
from jaxkv._src.state.kvstate import Key, KVState, normalize_key
from jaxkv._src.state.kvstate import spans_processes as _state_spans_processes
from jaxkv._src.state.pairing import as_array, devices_of, is_traced
from jaxkv._src.state.placement import copies, local_parts, replicate, spare
from jaxkv._src.state.policy import block_rows

__all__ = [
    "PullRefusedElsewhere",
    "pull_rows",
    "push_rows",
    "pushpull_rows",
    "row_sparse_pull",
    "slots",
    "sorted_distinct",
]

_ID_DTYPE = jnp.int32  # row ids on device (JAX's default integer); tables below 2**31 rows


# -- checks -----------------------------------------------------------------------------------
def _table(state: KVState, key: Any, what: str) -> tuple[Key, int, tuple[int, ...]]:
    key = normalize_key(key)
    i = state.index(key)
    shape = state.key_shapes[i]
    if not shape:
        raise ShapeError(f"key {shown(key)}: {what} expects a value with rows, given a scalar")
    if shape[0] >= 2**31:
        raise KVStoreError(
            f"key {shown(key)}: {what} expects a table of fewer than 2**31 rows, given {shape[0]}"
        )
    if state.multi_axis:
        raise KVStoreError(
            f"key {shown(key)}: {what} expects a store on one mesh axis, given a store on the axes "
            f"{tuple(state.mesh.axis_names)}; keep row-sparse tables in a store of their own "
            "(jaxkv.empty over the same devices)"
        )
    return key, i, shape


def host_ids(key: Key, row_ids: Any, n_rows: int) -> np.ndarray:
    """Eager row ids, flattened, as int32 on the host; refused unless whole numbers in
    ``[0, n_rows)`` (MXNet's ids are often float32, ``mx.nd.array``'s default)."""
    if hasattr(row_ids, "asnumpy"):
        row_ids = row_ids.asnumpy()
    ids = np.asarray(jax.device_get(row_ids) if isinstance(row_ids, jax.Array) else row_ids)
    ids = ids.ravel()
    whole = np.issubdtype(ids.dtype, np.integer)
    if ids.size and (
        not (whole or np.issubdtype(ids.dtype, np.floating))
        or not whole
        and np.any(ids != np.round(ids))
        or ids.min() < 0
        or ids.max() >= n_rows
    ):
        given = ids.tolist() if ids.size <= 16 else f"{ids[:16].tolist()} ... ({ids.size} ids)"
        raise KVStoreError(
            f"key {shown(key)}: row_ids expected integers in [0, {n_rows}), given {given}"
        )
    if ids.size == 0 and not np.issubdtype(ids.dtype, np.number):
        ids = ids.astype(np.int32)
    return ids.astype(np.int32)


def _given(x: Any) -> Any:
    """Row ids as given: an ``NDArray``'s value (its NumPy array while it is still on the
    host), or ``x`` itself."""
    if hasattr(x, "host_value") and (host := x.host_value()) is not None:
        return host
    return x.asjax() if hasattr(x, "asjax") else x


def ids_on_host(row_ids: list) -> list:
    """``row_ids`` with every id array on a device copied to the host in one transfer (one
    ``device_get`` each would wait for each in turn)."""
    row_ids = [_given(x) for x in row_ids]
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
    if tuple(leaf.shape) == shape and not buckets.chunked(state, state.index(key)):
        return None
    if tuple(leaf.shape[1:]) != shape[1:]:
        raise KVStoreError(
            f"key {shown(key)}: expected this device's block to be whole rows of the table "
            f"{shape}, given a block of shape {tuple(leaf.shape)} (a split bucket cuts a table "
            "whose rows do not divide by the devices across rows); use layout='keys' for this "
            "table, or call this outside shard_map"
        )
    return int(leaf.shape[0])


def _axis(state: KVState, axis_name: Any, key: Key) -> Any:
    names = axis_names(axis_name) if axis_name is not None else (state.axis,)
    if len(names) != 1:
        raise KVStoreError(
            f"key {shown(key)}: expected one mapped axis for the rows of a table, given {names}"
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
            return take(value, jnp.where(ids >= 0, ids, shape[0]))
        axis = _axis(state, axis_name, key)
        ids = jnp.where(ids >= 0, ids, shape[0])
        with jax.named_scope(ROUTE):
            asked = jax.lax.all_gather(ids, axis)  # every device's request
            part = take(value, asked, jax.lax.axis_index(axis) * block)
            return psum_scatter(part, axis, scatter_dimension=0)
    if spans_processes(state):
        return _pull_across(state, key, i, shape, row_ids, devices)
    if _per_device(row_ids):
        return _pull_per_device(state, key, i, shape, list(row_ids), devices)
    ids = host_ids(key, row_ids, shape[0])
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
            f"key {shown(key)}: expected one row_ids per device ({len(targets)} devices), given "
            f"{len(row_ids)} row_ids"
        )
    ids = [host_ids(key, x, shape[0]) for x in ids_on_host(row_ids)]
    leaf = state.own_leaf(i)
    sizes = {x.size for x in ids}
    if (
        targets != state.devices
        or len(sizes) != 1
        or leaf is None
        or len(targets) == 1
        or spans_processes(state)
    ):
        return [_place(_eager_take(state, key, i, x), d) for x, d in zip(ids, targets)]
    n = ids[0].size
    to = fit(("pull per device", key), n)
    asked = _split_ids(state, row_ids, [pad_ids(x, to) for x in ids])
    if state.is_sharded(shape):
        c = route(busiest(ids, shape[0] // len(targets), len(targets)), to, len(targets))
        fn = routed_take(state.mesh, state.axis, c)
    else:
        fn = per_device_take(state.mesh, state.axis, False)
    got = per_device(order.ordered("pull_rows", fn, state.leaves[leaf], asked))
    return [cut(x, n) for x in got]


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
    return order.put(np.concatenate(ids), split)


def busiest(ids: Sequence[np.ndarray], block: int, parts: int) -> int:
    """The most ids one of ``ids`` (one array of checked ids per device) sends to one owner of a
    table cut in ``parts`` blocks of ``block`` rows."""
    return max(
        (int(np.bincount(x // block, minlength=parts).max()) for x in ids if x.size), default=1
    )


def spans_processes(state: KVState) -> bool:
    return _state_spans_processes(state.devices)


def _place(x: jax.Array, device: jax.Device) -> jax.Array:
    return replicate([x], (device,))[0]


def _traced_leaves(state: KVState) -> bool:
    return any_tracer(state.leaves)


def _eager_take(state: KVState, key: Key, i: int, ids: np.ndarray) -> jax.Array:
    """The rows ``ids`` (checked), whole on the store's devices: read for the ids padded to a
    few sizes (:func:`sizes.padded`), then cut, so that a new count compiles nothing."""
    replicated = NamedSharding(state.mesh, PartitionSpec())
    dev_ids = order.put(pad_ids(ids, fit(("take", key), ids.size)), replicated)
    leaf = state.own_leaf(i)
    place = _in_bucket(state, i)
    if place is not None:  # its rows read straight from its bucket
        b, off, split = place
        fn = bucket_rows_take(state.mesh, state.axis, off, state.key_shapes[i], split)
        out = order.ordered("pull_rows", fn, state.leaves[b], dev_ids)
    elif leaf is None:  # a view of a bucket: sliced and gathered in one computation
        fn = bucket_take(key, replicated)
        out = order.ordered("pull_rows", fn, state, dev_ids)
    else:
        table = state.leaves[leaf]
        sharded = state.is_sharded(state.key_shapes[i])
        fn = sharded_take(state.mesh, state.axis) if sharded else replicated_take(replicated)
        out = order.ordered("pull_rows", fn, table, dev_ids)
    return cut(out, ids.size)


# -- rows of a key in a flat bucket, addressed in place -------------------------------------------
# A key in a bucket is a run of its bucket (whole), or of each device's chunk (split, its blocks
# whole rows: device d's chunk holds rows [d*B, (d+1)*B) at the key's offset, B = ceil(R / D),
# the last block ending in rows of zeros where D does not divide R). Its rows are read and
# written there by element, so a step costs its rows, not its bucket. A key whose blocks are not
# whole rows (few rows: buckets.block_rows) goes through its view.
def _in_bucket(state: KVState, i: int) -> tuple[int, int, bool] | None:
    """``(bucket, offset, split)`` of key position ``i`` where its rows can be addressed in its
    bucket, else ``None`` (an array of its own, or rows cut across devices)."""
    flat = state.flat_layout
    if flat is None or _traced_leaves(state):
        return None
    b, off, _ = flat.where[i]
    if b < 0:
        return None
    parts = flat.parts_of(b)
    shape = state.key_shapes[i]
    if parts > 1 and block_rows(shape, parts) is None:
        return None
    return b, off, parts > 1


def _pushes_in_place(state: KVState, updater: Any, n: int | None) -> bool:
    """Whether a push of rows with ``updater`` (into optimizer group ``n``) can write a key's
    rows in its bucket: no updater (assign), or an optax one whose group state is packed as
    the value is (see :func:`_bucket_push`)."""
    optax_push = isinstance(updater, optax.GradientTransformation)
    return updater is None or (optax_push and n is not None and state.packings[n] is not None)


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
    extra: dict,
) -> KVState:
    """A push of rows into a key of a bucket, in place: the bucket, and for an optax updater
    its group's state (the key's own: its moments packed in buckets laid out as its value's),
    in and out of one computation."""
    b, off, split = place
    shape = state.key_shapes[i]
    packing = None if n is None else state.packings[n]
    opt: Any = None
    families: tuple[int, ...] = ()
    if n is not None and packing is not None:
        # one key alone in its group (and its bucket): each family bucket is laid out as the
        # value's, from offset 0
        opt, families = tuple(state.group_states[n]), tuple(packing.packed_positions())
    fn = bucket_pusher(
        state.mesh, state.axis, key, off, shape, split, updater, packing, families, donate
    )
    value, opt = order.ordered("push_rows", fn, state.leaves[b], opt, ids, rows, extra)
    return buckets.with_leaves(state, {b: value}, {} if n is None else {n: opt})


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
        return put(jnp.zeros_like(value), ids, take(value, ids, lo), lo)
    ids = host_ids(key, row_ids, shape[0])
    leaf = state.own_leaf(i)
    # Whole on the store's devices where the store keeps it so, as a pull gives it (a result
    # that needs no input, no ids at all, would otherwise land on one device).
    replicated = NamedSharding(state.mesh, PartitionSpec())
    dev_ids = order.put(pad_ids(ids, fit(("keep", key), ids.size)), replicated)  # -1: none
    if leaf is None:
        out_to = state.sharding_for(shape)  # named for a key of a split bucket too
        out = order.ordered("row_sparse_pull", bucket_keep(key, out_to), state, dev_ids)
    else:
        sharded = state.is_sharded(shape)
        fn = sharded_keep(state.mesh, state.axis) if sharded else replicated_keep(replicated)
        out = order.ordered("row_sparse_pull", fn, state.leaves[leaf], dev_ids)
    return out if devices is None else replicate([out], devices_of(devices))[0]


# -- push -------------------------------------------------------------------------------------
def _pairs(key: Key, row_ids: Any, rows: Any) -> list[tuple[Any, Any]]:
    """``(row_ids, rows)`` as a list of pairs: one pair, or one per device."""
    many = isinstance(rows, list | tuple)  # rows decide: row ids may be a plain list of ints
    if many and (not isinstance(row_ids, list | tuple) or len(rows) != len(row_ids)):
        given = f"{len(row_ids)} row_ids" if isinstance(row_ids, list | tuple) else "one row_ids"
        raise ShapeError(
            f"key {shown(key)}: push_rows expects one (row_ids, rows) pair or a list of each "
            f"of the same length (one per device), given {given} and {len(rows)} rows"
        )
    if many and not rows:
        raise ShapeError(f"key {shown(key)}: push_rows expects at least one (row_ids, rows) pair")
    return list(zip(row_ids, rows)) if many else [(row_ids, rows)]


def _unwrapped(x: Any) -> Any:
    """Pushed rows as an array: host NumPy rows stay on the host (the push's computation takes
    them as arguments: one transfer, where a ``device_put`` here would be a second)."""
    if isinstance(x, np.ndarray):
        return x
    return x.asjax() if hasattr(x, "asjax") else as_array(x)


def _one_device(rows: Any) -> Any:
    """The one device ``rows`` is on, or ``None`` (host NumPy rows, or rows on several)."""
    return single_device(rows) if isinstance(rows, jax.Array) else None


def _check_rows(key: Key, shape: tuple[int, ...], dtype: Any, n: int, rows: Any, what: str) -> None:
    want = (n, *shape[1:])
    if tuple(rows.shape) != want:
        raise ShapeError(
            f"key {shown(key)}: {what} has shape {tuple(rows.shape)}, expected {want} (one row "
            f"of the table {shape} per row id)"
        )
    check_dtype(key, rows, jax.ShapeDtypeStruct(want, dtype), what)


def push_rows(
    state: KVState,
    key: Any,
    row_ids: Any,
    rows: Any,
    *,
    updater: Any = None,
    axis_name: Any = None,
    donate: bool = False,
    extra_args: dict[str, Any] | None = None,
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
        rows; the key must be an optimizer group of its own), or ``updater(key, pushed, stored)``;
        an optax wrapper with a ``gradient_transformation()`` method (``optax.MultiSteps``) is
        taken as its transformation, as :func:`jaxkv.push` takes it.
      axis_name: inside ``pmap``/``shard_map``: the mapped axis. Each device pushes its own
        pair; pairs that JAX has made invariant along it (the same on every device) count once.
      donate: let the computation reuse the buffers of ``state`` (which then becomes invalid);
        the table is then updated in place, at a cost that grows with the rows alone.
      extra_args: for an ``optax.GradientTransformationExtraArgs`` updater, keyword arguments
        of its ``update`` (an MXNet optimizer's ``scalars``: its learning rate for this step),
        passed as arguments of the computation: a new value compiles nothing.

    Raises:
      KVStoreError: eagerly, an id that is not a whole number in ``[0, rows)``; rows of another
        shape; a key in an optimizer group with other keys; an updater that is none of the
        above; an exception the updater raises (traced or run), naming the key and the updater,
        the original as its ``__cause__``. Inside ``jit``, an id outside ``[0, rows)`` cannot be
        refused: it updates nothing. Nothing changes on a refusal.

    Examples:
      >>> import jax.numpy as jnp, jaxkv
      >>> s = jaxkv.init(jaxkv.empty(), {"e": jnp.zeros((3, 2))})
      >>> s = jaxkv.push_rows(s, "e", [[2, 0], [2]], [jnp.ones((2, 2)), jnp.ones((1, 2))])
      >>> jaxkv.pull(s, "e").tolist()
      [[1.0, 1.0], [0.0, 0.0], [2.0, 2.0]]
    """
    new, _ = _push(
        state, key, row_ids, rows, updater, axis_name, donate, None, extra=extra_args, in_band=True
    )
    return new


def push_rows_held(
    state: KVState,
    key: Any,
    row_ids: Any,
    rows: Any,
    updater: Any,
    donate: bool,
    extra: dict[str, Any] | None = None,
) -> KVState:
    """:func:`push_rows` for the imperative store: across processes agreed on the host alone
    (never kept to start with its computation: ``inband``)."""
    new, _ = _push(state, key, row_ids, rows, updater, None, donate, None, extra=extra)
    return new


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
    extra_args: dict[str, Any] | None = None,
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
        with checking(state, key):  # across processes, a refusal is every process's
            raise ShapeError(
                f"key {shown(key)}: pushpull_rows with {len(rows)} pairs expects a list of "
                f"{len(rows)} pull_ids, one per pair"
            )
    traced = _traced_leaves(state) or is_traced(asked) or many and any(map(is_traced, asked))
    plan: Any = _SAME if pull_ids is None else None
    if pull_ids is not None and not traced:  # checked before the push can donate
        n_rows = _table(state, key, "pushpull_rows")[2][0]
        with checking(state, key):
            if many:
                plan = (list(pull_ids), [host_ids(key, x, n_rows) for x in ids_on_host(asked)])
            elif len(state.devices) == 1:  # (the push's computation can pull them)
                plan = ([pull_ids], [host_ids(key, pull_ids, n_rows)])
            else:
                host_ids(key, pull_ids, n_rows)
    state, pulled = _push(
        state, key, row_ids, rows, updater, axis_name, donate, plan, extra=extra_args, in_band=True
    )
    if pulled is not None and not many:
        one = exact(pulled[0])
        local = _local_devices(state)
        if spans_processes(state) and len(local) > 1:  # (as pull_rows gives it: on every one)
            one = replicate([one], tuple(local))[0]
        return state, one
    if not many:
        return state, pull_rows(state, key, asked, axis_name=axis_name)
    if traced:
        return state, [pull_rows(state, key, x, axis_name=axis_name) for x in asked]
    homes = []  # each pair's rows come back to the device they came from
    for r in rows:
        r = _unwrapped(r)
        on = r.devices() if isinstance(r, jax.Array) else ()
        homes.append(next(iter(on)) if len(on) == 1 else state.devices[0])
    if pulled is not None:
        got = [exact(x) for x in pulled]
        if len(state.devices) == 1:  # (pulled by the push's computation, on the store's device)
            got = [x if x.devices() == {d} else _place(x, d) for x, d in zip(got, homes)]
        return state, got
    return state, pull_rows(state, key, list(asked), devices=homes)


_NO_IDS = np.zeros(0, np.int32)  # (no pull)
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
    extra: dict[str, Any] | None = None,
    before: Before | None = None,
    in_band: bool = False,
) -> tuple[KVState, Any]:
    """``push_rows``, and, where one computation can also pull (see :func:`pushpull_rows`), the
    pulled rows (else ``None``). ``pull``: ``None`` (no pull), ``_SAME`` (the pushed ids), or
    ``(given, checked)``, the ids to pull per device as given and checked on the host.
    ``checked``: the pairs' ids, already checked on the host (:func:`check_push`); ``extra``:
    the updater's extra arguments; ``before``: calls held before the push, agreed with it and
    run before its computation (a store across processes); ``in_band``: across processes, a
    functional push, which may be kept to start with its computation (``inband``)."""
    with naming(key):  # (a wrong sum's error, found at a later call, names the key)
        updater = as_updater(updater)  # an optax wrapper (MultiSteps): its transformation
        updater = viewed(state, updater)  # optax sees the tree given to init
        extra = {} if extra is None else dict(extra)
        if state.reduce != "sum":
            raise KVStoreError(
                f"key {shown(key)}: a row-sparse push sums its rows, given a store with "
                f"reduce={state.reduce!r}; push the rows to a store with reduce='sum' (and "
                "scale them), or push the dense value"
            )
        key, i, shape, pairs, group = _opened(state, key, row_ids, rows, updater)
        dtype = buckets.stored_type(state, i).dtype
        optax_push = isinstance(updater, optax.GradientTransformation)
        traced = (
            _traced_leaves(state)
            or any_tracer(jax.tree_util.tree_leaves(state.group_states))
            or any_tracer([x for pair in pairs for x in pair])
        )
        if traced:
            return _push_traced(state, key, shape, pairs, updater, axis_name, group, extra), None
        if axis_name is not None:
            raise KVStoreError(
                f"axis_name={axis_name!r}: expected to be called inside pmap or shard_map, given "
                "an eager call (eagerly, a list of per-device pairs is already summed over "
                "devices)"
            )
        if checked is not None:
            host_pairs = list(zip(checked, [r for _, r in pairs]))
        else:
            with checking(state, key):
                host_pairs = _host_pairs(key, shape, dtype, pairs)
        across = None
        if spans_processes(state):  # agreed before anything runs (init_opt_states may compute)
            here = _here(state, key, shape, host_pairs)
            # A pull of one id array per device of this process, fused: agreed with the push
            # (the pushed ids of one pair: this process's, on its first device).
            fused = None
            if pull is _SAME and len(host_pairs) == 1:
                fused = [x for x, _ in here]
            elif (
                pull is not None
                and pull is not _SAME
                and len(pull[1]) <= len(_local_devices(state))
            ):
                fused = _asked_here(state, list(pull[1]))
            asked_n = 0 if pull is None else 1 if pull is _SAME else len(pull[1])
            where = inband.site(state.devices, key, shape, dtype)
            kept = inband.kept_push(where) if in_band else None
            cls = None if kept is None else kept.cls
            holds = before is not None and before.holds_calls()
            dense = made = None
            if kept is not None and kept.dense is not None:
                # Kept with the dense pushes held before it, made in its computation: every
                # process runs that program, with its own held pushes where they match, else
                # with gradients of zeros (its status says so). Where no process can (the state
                # no longer holds those keys so: alike everywhere), the host agrees.
                pushes = before.pushes if before is not None and holds else None
                made = None if pushes is None else _dense_push(state, pushes, *kept.dense)
                dense = made or _dense_push(state, None, *kept.dense)
                if dense is None:
                    cls = None
            if cls is not None and _routed_alone(state, key, i, shape, updater, group):
                assert kept is not None  # (cls is its class)
                # Calls held before it are agreed in its words and made in its computation, or
                # run after it, where they may (else this process says so, and every process
                # agrees on the host).
                if kept.dense is not None:
                    ready = made is not None
                else:
                    ready = not holds or before is not None and before.later is not None
                ok, state, rows = _in_band(
                    state,
                    key,
                    shape,
                    cls,
                    updater,
                    group,
                    extra,
                    here,
                    fused,
                    kept.donate,  # (its program's, alike everywhere; copies given where not mine)
                    asked=pull is not None,
                    ready=ready,
                    mine=donate,
                    held=None if before is None else before.digest,
                    dense=dense,
                )
                if ok:
                    if holds and made is None:
                        assert before is not None and before.later is not None  # (ready)
                        before.later()
                    return state, None if pull is None else rows[:asked_n]
                inband.failed(where)  # (every process: the verdict is every device's)
            across = _across_pairs(state, key, shape, here, extra, fused, before, donate)
        if before is not None:  # (held calls of other keys: the same key, shape and layout)
            state = before.run()
        if optax_push and state.opt_group(key) is None:
            from jaxkv._src.core.eager import init_opt_states

            state = init_opt_states(state, updater, (key,))
        leaf = state.own_leaf(i)
        n: int | None = None if group is None else state.groups.index(group)
        if across is not None:
            m, most, pull_sizes, first, donate = across
            # The pull asks every process's pushed ids back (MXNet's push, then row_sparse_pull of
            # the batch): along the push's own routes, in its computation.
            along = pull_sizes is not None and pull_sizes[2]
            alone = _routed_alone(state, key, i, shape, updater, group)
            if in_band:  # (agreed: alike on every process)
                keep = None
                if alone and (pull is None or along):  # (a pull rides only as the pushed ids)
                    to = padded(m)
                    c = route(most, to, len(state.devices))
                    cls = inband.Class(to, c, pull_sizes is not None)
                    # (the dense pushes held before it, where its computation can make them)
                    pushes = None if before is None else before.pushes
                    part = None if pushes is None else _dense_push(state, pushes, args=False)
                    kept_dense = None
                    if part is not None and pushes is not None and not first:
                        kept_dense = (part.spec, pushes.scalars)
                    keep = inband.Kept(where, key, updater, donate, dict(extra), cls, kept_dense)
                    if first:  # (some process holds calls before it that must run before it,
                        # a held pull among them: its next push could not start so either)
                        keep = None
                inband.agreed_push(where, keep)
            new, rows = _push_across(
                state,
                key,
                shape,
                here,
                m,
                most,
                updater,
                n,
                leaf,
                donate,
                extra,
                along,
                alone,
            )
            if pull_sizes is None:
                return new, None
            if rows is None:
                mine = fused if fused is not None else _asked_here(state, list(pull[1]))
                rows = _pull_agreed(new, key, i, shape, mine, pull_sizes[0], pull_sizes[1])
            return new, rows[:asked_n]
        if leaf is not None and (n is None or state.packings[n] is None):
            routed = _routed(state, key, shape, host_pairs, updater, n, [ids for ids, _ in pairs])
            if routed is not None:
                c, ids, rows = routed
                args = [ids, rows]
                back: int | None = None
                if pull is _SAME:
                    back = 0
                elif pull is not None and len({x.size for x in pull[1]}) == 1:
                    to = fit(("pull ids", key), pull[1][0].size)
                    args.append(_split_ids(state, pull[0], [pad_ids(x, to) for x in pull[1]]))
                    parts = len(state.devices)
                    back = route(busiest(pull[1], shape[0] // parts, parts), to, parts)
                fn = routed_push(state.mesh, state.axis, key, updater, donate, c, back)
                opt = None if n is None else state.group_states[n]
                out = order.ordered(
                    "push_rows", fn, state.leaves[leaf], opt, args[0], args[1], extra, *args[2:]
                )
                new = buckets.with_leaves(state, {leaf: out[0]}, {} if n is None else {n: out[1]})
                if back is None:
                    return new, None
                wanted = (
                    [ids.size for ids, _ in host_pairs] if back == 0 else [x.size for x in pull[1]]
                )
                return new, [Padded(x, m) for x, m in zip(per_device(out[2]), wanted)]
        ids, rows = _gathered(state, key, host_pairs, dtype)
        place = _in_bucket(state, i)
        if place is not None and _pushes_in_place(state, updater, n):
            return _bucket_push(state, key, i, place, n, ids, rows, updater, donate, extra), None
        if leaf is not None and (n is None or state.packings[n] is None):
            sharded = state.is_sharded(shape)
            # One pair of sorted distinct ids (as a row-sparse value holds them): nothing to sum.
            distinct = len(host_pairs) == 1 and sorted_distinct(host_pairs[0][0])
            # A pull from the one device of a store of one, in the same computation.
            back = (
                not sharded
                and len(state.devices) == 1
                and pull is not None
                and len(host_pairs if pull is _SAME else pull[1]) == 1
            )
            asked: np.ndarray = _NO_IDS
            mode = None
            if back:
                asked = host_pairs[0][0] if pull is _SAME else pull[1][0]
                # The pull asks the pushed ids (MXNet's push, then row_sparse_pull of the
                # batch): the rows the update made are the pull, no gather after the scatter.
                if distinct and (pull is _SAME or np.array_equal(asked, host_pairs[0][0])):
                    mode = "pushed"
                else:
                    mode = "sorted ids" if sorted_distinct(asked) else "ids"
            fn = own_push(
                state.mesh, state.axis, key, shape[0], sharded, updater, donate, distinct, mode
            )
            opt = None if n is None else state.group_states[n]
            args = [state.leaves[leaf], opt, ids, rows, extra]
            if mode in ("ids", "sorted ids"):  # (the ids an argument, no put of their own)
                args.append(pad_ids(asked, fit(("take", key), asked.size)))
            out = order.ordered("push_rows", fn, *args)
            new = buckets.with_leaves(state, {leaf: out[0]}, {} if n is None else {n: out[1]})
            return new, [Padded(out[2], asked.size)] if back else None
        fn = state_push(key, shape[0], updater, donate)
        return order.ordered("push_rows", fn, state, ids, rows, extra), None


def _host_pairs(
    key: Key, shape: tuple[int, ...], dtype: Any, pairs: list[tuple[Any, Any]]
) -> list[tuple[np.ndarray, Any]]:
    """The pairs with their ids on the host, each pair checked."""
    host_pairs = []
    fetched = ids_on_host([ids for ids, _ in pairs])
    for j, (ids, r) in enumerate(zip(fetched, [r for _, r in pairs])):
        what = "the rows" if len(pairs) == 1 else f"rows {j}"
        ids = host_ids(key, ids, shape[0])
        _check_rows(key, shape, dtype, ids.size, r, what)
        host_pairs.append((ids, r))
    return host_pairs


def _opened(
    state: KVState, key: Any, row_ids: Any, rows: Any, updater: Any
) -> tuple[Key, int, tuple[int, ...], list[tuple[Any, Any]], tuple[Key, ...] | None]:
    """The first checks of a push of rows, traced or eager: the table, the pairs (one, or one
    per device) and, for an optax updater, the optimizer group it updates. Returns ``(key,
    position, shape, pairs, group)``."""
    key, i, shape = _table(state, key, "push_rows")
    with checking(state, key):
        pairs = [(ids, _unwrapped(r)) for ids, r in _pairs(key, row_ids, rows)]
    group = None
    if isinstance(updater, optax.GradientTransformation):
        group, _ = optimizer_group(state, (key,), unpack=False)
    return key, i, shape, pairs, group


def check_push(state: KVState, key: Any, row_ids: Any, rows: Any, updater: Any) -> list[np.ndarray]:
    """Every refusal of an eager ``push_rows(state, key, row_ids, rows, updater=updater)``,
    raised now, for a push that runs later (the imperative store's held push); returns the
    checked ids on the host, one array per pair, for :func:`pushpull_checked`."""
    updater = viewed(state, as_updater(updater))  # (an optax wrapper: its transformation)
    key, i, shape, pairs, _ = _opened(state, key, row_ids, rows, updater)
    with checking(state, key):
        host_pairs = _host_pairs(key, shape, buckets.stored_type(state, i).dtype, pairs)
    return [x for x, _ in host_pairs]


def pushpull_checked(
    state: KVState,
    key: Key,
    pushed: tuple[list, list, list[np.ndarray]],
    pulled: list[np.ndarray],
    devices: list[Any],
    updater: Any,
    donate: bool,
    extra: dict[str, Any] | None = None,
    before: Before | None = None,
) -> tuple[KVState, list[Any]]:
    """``pushpull_rows`` of pairs and pull ids already checked (eagerly): ``pushed`` is
    ``(row_ids, rows, ids)``, ``ids`` the checked ids on the host (:func:`check_push`);
    ``pulled`` the checked ids to pull on the host, one array per device of ``devices``.
    Each device's rows may come back as :class:`~jaxkv._src.rows.sizes.Padded` (cut them when
    read). ``before``: calls held before the push, across processes (see :class:`Before`).
    Across processes the push may be kept between host agreements (``inband``), as a
    functional one is."""
    row_ids, rows, ids = pushed
    pull = (pulled, pulled)
    state, got = _push(
        state, key, row_ids, rows, updater, None, donate, pull, ids, extra, before, in_band=True
    )
    if got is None:
        got = pull_rows(state, key, pulled, devices=devices)
    return state, got


def _routed(
    state: KVState,
    key: Key,
    shape: tuple[int, ...],
    host_pairs: list[tuple[np.ndarray, Any]],
    updater: Any,
    n: int | None,
    given: Sequence[Any],
) -> tuple[int, Any, Any] | None:
    """A push of one pair per device of the store, in place there, of as many rows each, into a
    sharded table, with an updater that needs no other device's rows (none, an MXNet-style
    updater on the block, an elementwise optax one): ``C`` and the ``(ids, rows)`` arguments of
    :func:`kernels.routed_push`, each device's rows going straight to the owners of their ids
    (``given``: the row ids as given, used in place where they can be). Else ``None``: every
    device gets every pushed row (:func:`_gathered`)."""
    devices = state.devices
    parts = len(devices)
    if (
        not state.is_sharded(shape)
        or len(host_pairs) != parts
        or len({r.shape[0] for _, r in host_pairs}) != 1
        or [_one_device(r) for _, r in host_pairs] != list(devices)
        or len({r.dtype for _, r in host_pairs}) != 1
        or spans_processes(state)
    ):
        return None
    if not _owners_alone(state, key, shape, updater, n):
        return None
    to = fit(("routed", key), host_pairs[0][1].shape[0])  # a few sizes: few compiles
    c = route(busiest([ids for ids, _ in host_pairs], shape[0] // parts, parts), to, parts)
    split = NamedSharding(state.mesh, PartitionSpec(state.axis))
    stacked = assemble((to * parts, *shape[1:]), split, [pad_rows(r, to) for _, r in host_pairs])
    return c, _split_ids(state, given, [pad_ids(ids, to) for ids, _ in host_pairs]), stacked


def _owners_alone(
    state: KVState, key: Key, shape: tuple[int, ...], updater: Any, n: int | None
) -> bool:
    """Whether each owner can update its own rows alone: no updater, an MXNet-style one (it
    gets this device's block), or an elementwise optax one."""
    if not isinstance(updater, optax.GradientTransformation):
        return True
    opt = state.group_states[n]  # type: ignore[index]
    name = np.dtype(buckets.stored_type(state, state.index(key)).dtype).name
    sig = _structure(opt)
    try:
        return _elementwise_rows(updater, key, tuple(shape), name, sig)
    except TypeError:  # an updater that cannot be hashed: checked each push
        return _elementwise_rows.__wrapped__(updater, key, tuple(shape), name, sig)


@functools.lru_cache(maxsize=256)
def _elementwise_rows(updater: Any, key: Key, shape: tuple, name: str, sig: tuple) -> bool:
    """Whether ``updater`` updates one row of a table of ``shape`` (its state's structure
    ``sig``) from that row alone (``tree_map_params`` traces ``updater.init``: 0.3 ms a push)."""
    with updater_errors(updater, [key]):  # tree_map_params calls updater.init
        rows_state = optax.tree_utils.tree_map_params(
            updater, lambda x: jax.ShapeDtypeStruct((1, *shape[1:]), x.dtype), _abstract(sig)
        )
    return _elementwise(updater, (key,), ((1, *shape[1:]),), name, rows_state)


# -- across processes ---------------------------------------------------------------------------
# Each process brings its own ids: every device of every process is one source (or requester)
# of rows, padded to the largest count of any device, and a sharded table's routes are sized by
# the busiest route of any device; one host all-gather agrees on both before the computation.
def _local_devices(state: KVState) -> list[jax.Device]:
    """This process's devices of the store, in the store's order (a fresh list)."""
    return list(_devices_here(state.devices))


@functools.lru_cache(maxsize=64)
def _devices_here(devices: tuple[jax.Device, ...]) -> tuple[jax.Device, ...]:
    me = jax.process_index()
    return tuple(d for d in devices if d.process_index == me)


# A row operation's agreed sizes: a push's ids and route, a fused pull's count, route and flag,
# whether any process holds calls before it that must run before it (a held pull), and whether
# any may not donate its table.
_AGREED = 7


class Across(NamedTuple):
    """What the processes agreed for a push of rows (:func:`_across_pairs`): ``n`` ids per
    device, the busiest route ``most``, the fused pull's count, route and whether every process
    pulls the ids it pushed (``pulled``, or ``None``), whether some process holds calls before
    it that must run before it (``first``), and whether every process donates its table
    (``donates``: else none does, so that every process runs one program)."""

    n: int
    most: int
    pulled: tuple[int, int, bool] | None
    first: bool
    donates: bool


class HeldPushes(NamedTuple):
    """Calls held before a row push that are one push of each of ``keys`` (sorted), as one
    optimizer group under ``updater`` (each key's update alone), with ``values`` (each key's
    list, as pushed) and the updater's numbers (``scalars``: a row per key): what a kept push
    of rows may make in its own computation (:func:`_dense_push`)."""

    keys: tuple
    values: list[list[Any]]
    scalars: np.ndarray
    updater: Any


class Before(NamedTuple):
    """Calls an imperative store held before a row push (none of them of its key), agreed in
    the push's own all-gather and run once it is agreed, before its computation: ``text``
    describes them and ``digest`` is its SHA-256 (32 bytes; ``held.described``);
    ``differ(texts)`` raises, given every process's text, where the digests differ; ``run()``
    runs them and returns the store's state after them. ``later`` (where they may run after
    the push instead: pushes of other keys, no pull among them): called by a push kept between
    host agreements (``inband``), which agrees them in its own computation (their digest in
    its words) and leaves them to the store to run once it has run, as in one process."""

    text: bytes
    digest: np.ndarray
    differ: Callable[[list[bytes]], None]
    run: Callable[[], KVState]
    later: Callable[[], None] | None = None
    pushes: HeldPushes | None = None  # (where they are one generation of pushes, as data)

    def holds_calls(self) -> bool:
        """Whether any call is held (``held.nothing`` describes none: a digest of zeros)."""
        return bool(self.digest.any())


class PullRefusedElsewhere(KVStoreError):
    """A ``row_sparse_pull`` fused with a held push of rows, refused on another process: the
    push (an earlier call, accepted) stays held on every process."""


# Why a process refused a row operation, as the agreement's all-gather tells the others.
REFUSED = 1  # its arguments: nothing of the operation runs on any process
REFUSED_PULL = 2  # the ids of a row_sparse_pull fused with a held push: the push stays held


def _agreed(
    key: Key,
    values: tuple[int, ...],
    refused: int = 0,
    extra: dict | None = None,
    before: Before | None = None,
    what: str = "sizes of a row operation",
    state: KVState | None = None,
) -> tuple[int, ...]:
    """The largest of each value (at most ``_AGREED``) over every process: one host all-gather
    of a fixed size, the one collective every process makes for a row operation before any
    computation, after checking its own arguments. Where a process refused them (``refused``:
    :data:`REFUSED` or :data:`REFUSED_PULL`; it raises its own error after this), every other
    process raises too (:class:`PullRefusedElsewhere` for a pull), and nothing changes
    anywhere. ``key`` and ``extra`` (an updater's extra arguments: an MXNet optimizer's
    numbers) must be the same in every process (two keys of one shape would otherwise meet in
    one computation: a process's rows added into another's table), else every process raises,
    naming each one's; so must the calls held ``before`` the push, compared in the same
    all-gather (else ``before.differ``). Held calls agreed alone (:func:`agree_before`) take
    the same all-gather, so that processes whose held calls differ meet in all-gathers of one
    size and all raise. ``what`` names the turn for the watchdog."""
    # (a push kept: the others may start with its computation)
    inband.agreeing(functools.partial(_meet, state))
    held = np.zeros(4, np.int64) if before is None else before.digest.view(np.int64)
    named = _named(key)
    sent = np.array(
        [refused, *values, *[0] * (_AGREED - len(values)), *_digest(extra), *named, *held],
        np.int64,
    )
    got = host.all_gather(sent, what)
    refusing = np.flatnonzero(got[:, 0]).tolist()
    if refused:
        return values
    if refusing and (got[:, 0] == REFUSED_PULL).any() and not (got[:, 0] == REFUSED).any():
        raise PullRefusedElsewhere(
            f"key {shown(key)}: the row_sparse_pull was refused on process(es) {refusing} (their "
            "error says why; each process checks its own ids); the push of rows before it, and "
            "the calls held before that, are held still on every process and run at the next "
            "call; nothing else changed on any process"
        )
    if refusing:
        raise KVStoreError(
            f"key {shown(key)}: the row operation was refused on process(es) {refusing} (their "
            "error says why; each process checks its own ids and rows); nothing changed on any "
            "process"
        )
    if not (got[:, -4:] == got[0, -4:]).all():  # (every process gathers the texts)
        texts = host.all_gather_text(b"{}" if before is None else before.text, "the held keys")
        if before is not None:
            before.differ(texts)
        raise KVStoreError(
            f"key {shown(key)}: expected every process to hold the same calls before this row "
            "push, given different ones; nothing changed on any process"
        )
    if not (got[:, -8:-4] == got[0, -8:-4]).all():
        per = _each_process(repr(key).encode(), "the keys of a row operation")
        raise KVStoreError(
            f"key {shown(key)}: expected every process to make this row operation on the same "
            f"key (one program on every process), given {per}; nothing changed on any process"
        )
    if not (got[:, 1 + _AGREED : -8] == got[0, 1 + _AGREED : -8]).all():
        _extra_differs(key, extra)
    return tuple(int(got[:, 1 + j].max()) for j in range(len(values)))


def agree_before(before: Before, what: str) -> None:
    """Check that every process holds the same calls ``before`` (an imperative store's, run
    alone: ``before.run`` is not called), in the all-gather of a row operation's agreement
    (:func:`_agreed`): else every process raises (``before.differ``)."""
    _agreed("", (), before=before, what=what)


def _digest(extra: dict | None) -> np.ndarray:
    """Four int64s of the SHA-256 of ``extra``'s names and bytes (zeros for none)."""
    if not extra:
        return np.zeros(4, np.int64)
    h = hashlib.sha256()
    for name in sorted(extra):
        x = np.ascontiguousarray(np.asarray(extra[name]))
        h.update(f"{name}:{x.dtype}:{x.shape}:".encode())
        h.update(x.tobytes())
    return np.frombuffer(h.digest(), np.int64).copy()


def _named(key: Any) -> np.ndarray:
    """Four int64s of the SHA-256 of a key (its ``repr``), which processes compare (a copy:
    the caller's to keep)."""
    return _key_digest(key).copy()


@functools.lru_cache(maxsize=1024, typed=True)  # (1 and True: two keys, two reprs)
def _key_digest(key: Any) -> np.ndarray:
    return _digest({"key": np.frombuffer(repr(key).encode(), np.uint8)})


def _extra_differs(key: Key, extra: dict | None) -> None:
    """Every process's ``extra``, gathered to name them (every process calls it): raises."""
    mine = json.dumps(
        {n: np.asarray(v).tolist() for n, v in sorted((extra or {}).items())}
    ).encode()
    per = _each_process(mine, "the numbers of a row push")
    raise KVStoreError(
        f"key {shown(key)}: expected every process to push with the same numbers (an MXNet "
        f"optimizer's learning rate, ...), given {per}; nothing changed on any process"
    )


def _each_process(mine: bytes, what: str) -> str:
    """Every process's text (this one's ``mine``), gathered (every process calls it) and
    named for an error: ``process 0: ...; process 1: ...``."""
    texts = host.all_gather_text(mine, what)
    return "; ".join(f"process {p}: {t.decode()}" for p, t in enumerate(texts))


@contextlib.contextmanager
def checking(state: KVState, key: Any, refused: int = REFUSED) -> Iterator[None]:
    """Checks of this process's arguments to a row operation: where the store spans processes,
    a refusal is told to the others in the all-gather they meet next (:func:`_agreed`), so that
    every process raises, not this one alone while the others wait for it. ``refused``:
    :data:`REFUSED_PULL` for the ids of a ``row_sparse_pull`` fused with a held push."""
    try:
        yield
    except KVStoreError:
        if spans_processes(state):
            _agreed(key, (0, 0), refused=refused, state=state)
        raise


def _global(state: KVState, shards: Sequence[Any]) -> jax.Array:
    """One array sharded along axis 0 over the store's mesh, whose block on each of this
    process's devices (in mesh order) is ``shards[j]`` (arrays already there are used as
    they are: no put)."""
    local, split, in_order = _split_here(state.devices, state.mesh, state.axis)
    if (
        in_order
        and all(type(x) is ArrayImpl for x in shards)
        and single_devices(shards) == tuple(local)
    ):
        shape = (shards[0].shape[0] * len(state.devices), *shards[0].shape[1:])
        return assemble(shape, split, list(shards))
    return _globals(state, shards)[0]


def _globals(state: KVState, *shard_lists: Sequence[Any]) -> list[jax.Array]:
    """:func:`_global` of each of ``shard_lists``, their shards put by one ``device_put``."""
    local, split, in_order = _split_here(state.devices, state.mesh, state.axis)
    placed = jax.device_put([x for shards in shard_lists for x in shards], local * len(shard_lists))
    out = []
    for k, shards in enumerate(shard_lists):
        mine = list(placed[k * len(local) : (k + 1) * len(local)])
        shape = (shards[0].shape[0] * len(state.devices), *shards[0].shape[1:])
        if in_order:
            out.append(assemble(shape, split, mine))
        else:
            out.append(jax.make_array_from_single_device_arrays(shape, split, mine))
    return out


@functools.lru_cache(maxsize=64)
def _split_here(
    devices: tuple[jax.Device, ...], mesh: Any, axis: Any
) -> tuple[list[jax.Device], NamedSharding, bool]:
    """For :func:`_global`, made once per store: this process's devices among ``devices``
    (the store's, in its order), the sharding along ``axis`` of ``mesh``, and whether those
    devices are in the mesh's order (then the shards are assembled without JAX's checks:
    with them, and the sharding made anew, a global array took 0.16-0.23 ms, now 0.13)."""
    local = list(_devices_here(devices))
    in_mesh = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    return local, NamedSharding(mesh, PartitionSpec(axis)), local == in_mesh


def _pull_across(
    state: KVState, key: Key, i: int, shape: tuple[int, ...], row_ids: Any, devices: Any
) -> Any:
    """``pull_rows`` on a store across processes: this process's ids (one array, asked by its
    first device, or one per device of this process) and its rows, on its devices."""
    local = _local_devices(state)
    per = _per_device(row_ids)
    with checking(state, key):
        given = ids_on_host(list(row_ids) if per else [row_ids])
        asked = [host_ids(key, x, shape[0]) for x in given]
        if per and len(asked) != len(local):
            raise ShapeError(
                f"key {shown(key)}: expected one row_ids per device of this process "
                f"({len(local)}), "
                f"given {len(asked)} row_ids"
            )
    mine = _asked_here(state, asked)
    sizes = (max(x.size for x in mine), _pull_route(state, i, shape, mine))
    n, most = _agreed(key, sizes, state=state)
    rows = _pull_agreed(state, key, i, shape, mine, n, most)
    if per:
        targets = devices_of(devices) if devices is not None else tuple(local)
        return [_place(r, d) for r, d in zip(rows, targets)]
    return replicate([rows[0]], devices_of(devices) if devices is not None else tuple(local))[0]


def _asked_here(state: KVState, asked: list[np.ndarray]) -> list[np.ndarray]:
    """Checked ids asked of the first devices of this process, as one array per device of it."""
    return asked + [np.zeros(0, np.int32)] * (len(_local_devices(state)) - len(asked))


def _pull_route(state: KVState, i: int, shape: tuple[int, ...], mine: list[np.ndarray]) -> int:
    """The busiest route of a pull of ``mine`` from a sharded table (1 for any other)."""
    parts = len(state.devices)
    sharded = state.is_sharded(shape) and state.own_leaf(i) is not None
    return busiest(mine, shape[0] // parts, parts) if sharded else 1


def _pull_agreed(
    state: KVState,
    key: Key,
    i: int,
    shape: tuple[int, ...],
    mine: list[np.ndarray],
    n: int,
    most: int,
) -> list[jax.Array]:
    """Each device of this process's rows for its ids ``mine``, once the largest count ``n``
    and busiest route ``most`` of every process are agreed (:func:`_agreed`)."""
    leaf = state.own_leaf(i)
    sharded = state.is_sharded(shape) and leaf is not None
    # no ids anywhere: padded ids (XLA may place a zero-size result whole)
    n = fit(("pull across", key), max(n, 1))
    if sharded and leaf is not None:
        fn = routed_take(state.mesh, state.axis, route(most, n, len(state.devices)))
        ids = _global(state, [pad_ids(x, n, -1) for x in mine])
        out = order.ordered("pull_rows", fn, state.leaves[leaf], ids)
    elif leaf is not None and (own := local_parts(state.leaves[leaf])) is not None:
        # A whole table: each device of this process reads its own copy (no collective, so no
        # collective turn: nothing waits for the push before it on the host).
        copies = {single_device(t): t for t in own}
        return [
            cut(replicated_take(single_device_sharding(d))(copies[d], pad_ids(x, n, 0)), x.size)
            for d, x in zip(_local_devices(state), mine)
        ]
    elif leaf is not None:
        fn = per_device_take(state.mesh, state.axis, False)
        zeros_past = [pad_ids(x, n, 0) for x in mine]
        out = order.ordered("pull_rows", fn, state.leaves[leaf], _global(state, zeros_past))
    else:  # in a bucket: read in place where its blocks are rows, else from its view
        split = NamedSharding(state.mesh, PartitionSpec(state.axis))
        asked_all = _global(state, [pad_ids(x, n, 0) for x in mine])
        place = _in_bucket(state, i)
        if place is not None and place[2]:  # a split bucket
            b, off, _ = place
            fn = bucket_rows_take(state.mesh, state.axis, off, shape, True, each=True)
            out = order.ordered("pull_rows", fn, state.leaves[b], asked_all)
        else:
            out = order.ordered("pull_rows", bucket_take(key, split), state, asked_all)
    return [cut(x, a.size) for x, a in zip(per_device(out), mine)]


def _here(
    state: KVState, key: Key, shape: tuple[int, ...], host_pairs: list[tuple[np.ndarray, Any]]
) -> list[tuple[np.ndarray, Any]]:
    """This process's checked pairs as one pair per device of this process, in the table's
    dtype (all of them from its first device, if not already so)."""
    local = _local_devices(state)
    placed = [_one_device(r) for _, r in host_pairs]
    dtype = buckets.stored_type(state, state.index(key)).dtype
    if len(host_pairs) == len(local) and placed == local:
        return [(ids, r.astype(dtype)) for ids, r in host_pairs]
    ids = np.concatenate([x for x, _ in host_pairs])
    if len(local) == 1 and all(isinstance(r, np.ndarray) for _, r in host_pairs):
        # Rows made on the host stay there until the computation's one put (padded there).
        return [(ids, np.concatenate([r for _, r in host_pairs]).astype(dtype, copy=False))]
    first = single_device_sharding(local[0])
    rows = concat_rows([r for _, r in host_pairs], first, ids.size, dtype)  # (no compile per count)
    return [(ids, rows)] + [
        (np.zeros(0, np.int32), jax.device_put(np.zeros((0, *shape[1:]), dtype), d))
        for d in local[1:]
    ]


# -- a push agreed inside its computation (``inband``) -------------------------------------------
def _routed_alone(
    state: KVState,
    key: Key,
    i: int,
    shape: tuple[int, ...],
    updater: Any,
    group: tuple[Key, ...] | None,
) -> bool:
    """Whether a push of rows of ``key`` across processes is routed, each owner updating its
    rows alone (:func:`_push_across`), its optimizer state made: a push that can be kept."""
    if group is not None and state.opt_group(key) is None:
        return False
    n = None if group is None else state.groups.index(group)
    if state.own_leaf(i) is None or not state.is_sharded(shape):
        return False
    if n is not None and state.packings[n] is not None:
        return False
    return _owners_alone(state, key, shape, updater, n)


class RoutedSpec(NamedTuple):
    """What a routed push's computation is made of (:func:`kernels.routed_push`), beside the
    rows: the key, its leaf, its optimizer group's index, the updater, whether it donates,
    ``c`` slots a route, and where the pushed rows come back (``None``: they do not)."""

    key: Any
    leaf: int
    group: int | None
    updater: Any
    donate: bool
    c: int
    back: int | None
    dense: Dense | None = None  # dense keys' pushes made in it too (:func:`_dense_push`)


class DensePart(NamedTuple):
    """Dense keys' pushes a routed push makes in its computation (``kernels.Dense``): the
    spec, the keys' leaves and optimizer group, and the four arguments (this process's
    gradients, flat; the values; the group's state; the numbers)."""

    spec: Dense
    leaves: list[int]
    group: int
    args: tuple


def _dense_push(
    state: KVState,
    pushes: HeldPushes | None,
    spec: Dense | None = None,
    numbers: np.ndarray | None = None,
    args: bool = True,
) -> DensePart | None:
    """The held pushes ``pushes`` as a part of a routed push's computation, where it can make
    them (a process of one device, each key an array of its own whole on every device, the
    keys one optimizer group of their own, its state whole, the stored items 4 bytes), else
    ``None``; ``spec``: the part a kept push was kept with, which they must match. Decided from
    the state and the held calls' keys alone, which every process's words agree
    (``held.described``): every process decides alike. Each key's values of this process are
    summed here first (:func:`_flat_summed`). With ``pushes=None``, a ``spec`` and
    ``numbers`` (the kept push's, their shape): the part with gradients and numbers of zeros
    (a process meeting the others in a kept push it does not make). ``args=False``: the
    spec, leaves and group alone (no arguments)."""
    local = _local_devices(state)
    if len(local) != 1 or _traced_leaves(state):
        return None
    keys = spec.keys if pushes is None and spec is not None else pushes.keys if pushes else None
    if not keys or keys not in state.groups:
        return None
    n = state.groups.index(keys)
    if state.packings[n] is not None:
        return None
    opt = state.group_states[n]
    if opt is None or not all(_whole(state, x) for x in jax.tree_util.tree_leaves(opt)):
        return None
    leaves, shapes, dtypes = [], [], set()
    for k in keys:
        i = state.index(k)
        leaf = state.own_leaf(i)
        if leaf is None or not _whole(state, state.leaves[leaf]):
            return None
        dtype = buckets.stored_type(state, i).dtype
        leaves.append(leaf)
        shapes.append(tuple(state.key_shapes[i]))
        dtypes.add(np.dtype(dtype))
    if len(dtypes) != 1 or next(iter(dtypes)).itemsize != 4:
        return None
    dtype = dtypes.pop()
    updater = pushes.updater if pushes is not None else spec.updater if spec else None
    made = Dense(keys, tuple(shapes), dtype, updater)
    if spec is not None and made != spec:
        return None
    if not args:
        return DensePart(made, leaves, n, ())
    if (  # (the kept push's program takes numbers of its shape and dtype)
        pushes is not None
        and numbers is not None
        and (pushes.scalars.shape, pushes.scalars.dtype) != (numbers.shape, numbers.dtype)
    ):
        return None
    if pushes is None:
        if numbers is None:
            return None
        flat: Any = np.zeros(sum(math.prod(x) for x in shapes), dtype)
        scalars = np.zeros_like(numbers)
    else:
        flat = _flat_summed([[as_array(x) for x in v] for v in pushes.values], np.dtype(dtype))
        scalars = pushes.scalars
    values = tuple(state.leaves[x] for x in leaves)
    return DensePart(made, leaves, n, (_global(state, [flat]), values, opt, {"scalars": scalars}))


@functools.partial(jax.jit, static_argnums=1)
def _flat_summed(values: list[list[Any]], dtype: np.dtype) -> Any:
    """Each key's values pushed by this process (``values[k]``, in push order) summed in their
    order in the stored ``dtype`` (which holds each without loss: checked when each was
    pushed), flattened, the keys end to end: one computation (eager casts, reshapes and a
    concatenation were a dispatch each: 0.41 ms of a 2-process step's dense part, now 0.17)."""
    flat = []
    for own in values:
        total = own[0].astype(dtype)
        for x in own[1:]:
            total = total + x.astype(dtype)
        flat.append(total.reshape(-1))
    return flat[0] if len(flat) == 1 else jnp.concatenate(flat)


def _whole(state: KVState, x: Any) -> bool:
    """Whether ``x`` is an eager array whole on every device of ``state``'s mesh."""
    sharding = getattr(x, "sharding", None)
    return (
        isinstance(sharding, NamedSharding)
        and sharding.mesh == state.mesh
        and sharding.is_fully_replicated
    )


def _in_band(
    state: KVState,
    key: Key,
    shape: tuple[int, ...],
    cls: inband.Class,
    updater: Any,
    group: tuple[Key, ...] | None,
    extra: dict[str, Any],
    pairs: list[tuple[np.ndarray, Any]],
    pulled: list[np.ndarray] | None,
    donate: bool,
    asked: bool = False,
    ready: bool = True,
    held: np.ndarray | None = None,
    dense: DensePart | None = None,
    mine: bool = True,
) -> tuple[bool, KVState, list[Any]]:
    """The push kept (class ``cls``), this process's words behind its rows
    (:func:`kernels.routed_push`): its ``pairs``, one per device of this process
    (:func:`_here`), and the ids it pulls (``pulled``: one array per device of this process,
    or ``None``; ``asked``: whether the call pulls at all). Only a pull of the pushed ids rides
    in a class that pulls; any other pull, or none in a class that pulls, does not fit it.
    ``ready``: whether this process can run the push now (else it meets the others with rows
    that select nothing); ``held``: the digest of the calls held before it (32 bytes), which
    every process must share; ``dense``: the dense pushes the kept push makes too (with this
    process's gradients where it makes them, else zeros); ``donate``: whether the kept program
    donates (alike on every process), ``mine``: whether this process may give its table up
    (else it gives copies: :func:`_run_routed`). Returns ``(agreed, state, rows)``:
    where every process agreed,
    the new state and, for a class that pulls, each device's pushed rows after the update;
    else ``state``, as it was (refilled, where this process donated its table to the
    computation: :func:`_refill`)."""
    parts = len(state.devices)
    counts = max(x.size for x, _ in pairs)
    most = busiest([x for x, _ in pairs], shape[0] // parts, parts)
    pulls_pushed = asked and _pulls_pushed(pulled, pairs)
    fits = (
        ready
        and counts <= cls.n
        and most <= cls.c
        and asked == pulls_pushed == cls.back  # (a pull rides only as the pushed ids)
    )
    i = state.index(key)
    leaf = state.own_leaf(i)
    assert leaf is not None  # (:func:`_routed_alone`)
    n = None if group is None else state.groups.index(group)
    spec = RoutedSpec(
        key, leaf, n, updater, donate, cls.c, 0 if cls.back else None, dense and dense.spec
    )
    status = inband.AGREE if fits else inband.OTHER
    calls = np.zeros(4, np.int64) if held is None else held.view(np.int64)
    words = inband.words(status, cls, _named(key), _digest(extra), calls)
    if not fits:  # (it runs the push all the same, with rows that select nothing)
        _meeting(state, spec, cls, words, extra, dense, mine)
        return False, state, []
    sent = [pad_ids(x, cls.n, -1) for x, _ in pairs]
    rows = [pad_rows(r, cls.n) for _, r in pairs]
    new, out = _run_routed(state, spec, sent, rows, extra, words, dense, mine)
    if not _verdict(out, dense is not None):
        if donate and mine:  # (it gave its table to a push that did not run)
            _refill(state, new)
        return False, state, []
    return True, new, _pushed_back(out, pairs) if cls.back else []


def _run_routed(
    state: KVState,
    spec: RoutedSpec,
    sent: list[Any],
    rows: list[Any],
    extra: dict[str, Any],
    words: np.ndarray | None = None,
    dense: DensePart | None = None,
    mine: bool = True,
) -> tuple[KVState, Any]:
    """The routed push (:func:`kernels.routed_push`) on a store across processes: ``spec``
    names it, ``sent`` and ``rows`` are each device of this process's padded ids and rows,
    ``words`` (optional) its agreement and ``dense`` the dense pushes it makes too (with
    ``words``). Where the program donates and this process may not give its table up
    (``mine`` false: an out of its own holds it), it gives copies of its shards: every process
    runs one program (JAX 0.12 pairs the collectives of one compiled program alone), and the
    copies cost what a program that does not donate would. Returns the new state and the
    computation's results."""
    key, leaf, n, updater, donate, c, back, _ = spec
    agree = () if words is None else (words.size,)  # (one cached computation per variant)
    fn = routed_push(
        state.mesh, state.axis, key, updater, donate, c, back, *agree, dense=spec.dense
    )
    if words is None:
        ids, pushed_rows = _globals(state, sent, rows)
        more: tuple = ()
    else:
        ids, pushed_rows, agreement = _globals(state, sent, rows, [words] * len(sent))
        more = (agreement,)
    if spec.dense is not None:
        assert dense is not None and words is not None
        more = (*more, *dense.args)
    table, opt = state.leaves[leaf], None if n is None else state.group_states[n]
    if donate and not mine:  # (each process copies its own shards: no collective)
        given, tree = jax.tree_util.tree_flatten((table, opt))
        table, opt = jax.tree_util.tree_unflatten(tree, copies(given))
    out = order.ordered(
        "push_rows",
        fn,
        table,
        opt,
        ids,
        pushed_rows,
        extra,
        *more,
    )
    leaves = {leaf: out[0]}
    groups = {} if n is None else {n: out[1]}
    if spec.dense is not None:
        assert dense is not None
        leaves.update(zip(dense.leaves, out[-3]))
        groups[dense.group] = out[-2]
        spare(out[-3], out[-1])  # (a pull of those keys takes the copy made beside them)
    return buckets.with_leaves(state, leaves, groups), out


def _pushed_back(out: Any, pairs: list[tuple[np.ndarray, Any]]) -> list[Any]:
    """Each device's pushed rows after the update, from a routed push's results."""
    return [Padded(x, ids.size) for x, (ids, _) in zip(per_device(out[2]), pairs)]


def _verdict(out: Any, dense: bool = False) -> bool:
    """Whether every process agreed, from a routed push's results (``dense``: with dense
    pushes' results after it; the host waits for it)."""
    return bool(np.asarray(per_device(out[-4 if dense else -1])[0]).reshape(-1)[0])


def _meeting(
    state: KVState,
    spec: RoutedSpec,
    cls: inband.Class,
    words: np.ndarray,
    extra: dict[str, Any],
    dense: DensePart | None = None,
    mine: bool = True,
) -> None:
    """The routed push ``spec`` of class ``cls`` run with rows that select nothing, by a
    process that does not run it (``words``: its status not ``AGREE``), so no process updates
    (``dense``: its dense pushes' part, any arguments of their shapes); its table comes back
    refilled where it donated (``mine``: it may; else it gives copies, :func:`_run_routed`)."""
    key = spec.key
    local = _local_devices(state)
    shape = state.key_shapes[state.index(key)]
    dtype = buckets.stored_type(state, state.index(key)).dtype
    sent = [np.full(cls.n, -1, np.int32)] * len(local)
    rows = [np.zeros((cls.n, *shape[1:]), dtype)] * len(local)
    new, _ = _run_routed(state, spec, sent, rows, extra, words, dense, mine)
    if spec.donate and mine:  # (it gave its table to a push that did not run)
        _refill(state, new)


def _refill(given: KVState, got: KVState) -> None:
    """``given``, whose table and optimizer state were donated to a push that did not run
    (the processes did not agree), takes the computation's (the same values): a call that
    then raises leaves the caller's state as it was, usable."""
    object.__setattr__(given, "leaves", got.leaves)
    object.__setattr__(given, "group_states", got.group_states)
    object.__setattr__(given, "_views", None)


def _meet(state: KVState | None, kept: inband.Kept) -> None:
    """The computation of the push ``kept``, run on ``state`` by a process making another row
    operation on it (or refusing its arguments) where the others may be running that push:
    rows that select nothing and its status :data:`inband.OTHER`, so that no process updates
    (a table given to it comes back refilled). The same program as theirs (the updater,
    donation and extra arguments the push was kept with): JAX 0.12 pairs only the
    collectives of one program across processes. Where ``state`` does not hold that table (a
    call on another store: so do the others', in one program), nothing runs."""
    table = _holds(state, kept)
    if table is None or state is None:
        return
    leaf, n = table
    cls = kept.cls
    dense = None if kept.dense is None else _dense_push(state, None, *kept.dense)
    if kept.dense is not None and dense is None:  # (not the kept push's keys either)
        return
    spec = RoutedSpec(
        kept.key,
        leaf,
        n,
        kept.updater,
        kept.donate,
        cls.c,
        0 if cls.back else None,
        dense and dense.spec,
    )
    nothing = np.zeros(4, np.int64)
    words = inband.words(inband.OTHER, cls, _named(kept.key), nothing, nothing)
    # (its values: nothing is updated; their types: the same program; copies of the table
    # given, where it donates: an out of this store's may hold it, which only the store knows)
    _meeting(state, spec, cls, words, kept.extra, dense, mine=False)


def _holds(state: KVState | None, kept: inband.Kept) -> tuple[int, int | None] | None:
    """Where ``state`` holds the table of the push ``kept`` as that push found it (its leaf and
    optimizer group), else ``None``."""
    if state is None or _traced_leaves(state):
        return None
    try:
        i = state.index(kept.key)
    except (KeyError, KVStoreError):
        return None
    shape = state.key_shapes[i]
    dtype = buckets.stored_type(state, i).dtype
    if inband.site(state.devices, kept.key, shape, dtype) != kept.site:
        return None
    group = None
    if isinstance(kept.updater, optax.GradientTransformation):
        group = state.opt_group(kept.key)
        if group is None:
            return None
    try:
        if not _routed_alone(state, kept.key, i, shape, kept.updater, group):
            return None
    except KVStoreError:
        return None
    leaf = state.own_leaf(i)
    assert leaf is not None  # (:func:`_routed_alone`)
    return leaf, None if group is None else state.groups.index(group)


def _across_pairs(
    state: KVState,
    key: Key,
    shape: tuple[int, ...],
    pairs: list[tuple[np.ndarray, Any]],
    extra: dict | None = None,
    pull: list[np.ndarray] | None = None,
    before: Before | None = None,
    donate: bool = False,
) -> Across:
    """For this process's checked pairs, one per device of this process (:func:`_here`), the
    largest count of ids of any device of any process and the busiest route of a sharded table,
    agreed (:func:`_agreed`, with the updater's ``extra`` arguments), and, for the pull fused
    with it (``pull``: this process's checked ids, one per device of it), its count and route
    and whether every process pulls the ids it pushes, agreed in the same all-gather, as are the
    calls held ``before``; whether any process holds calls ``before`` the push that must run
    before it (a held pull); and whether every process may ``donate`` its table."""
    parts = len(state.devices)
    sharded = state.is_sharded(shape) and state.own_leaf(state.index(key)) is not None
    most = busiest([x for x, _ in pairs], shape[0] // parts, parts) if sharded else 1
    sizes: tuple[int, ...] = (max(x.size for x, _ in pairs), most)
    if pull is not None:
        i = state.index(key)
        same = _pulls_pushed(pull, pairs)
        sizes += (max(x.size for x in pull), _pull_route(state, i, shape, pull), int(not same))
    # (held pulls of values whole on every process are no part of the held calls' digest:
    # whether a push may be kept with its held calls must be agreed here, alike everywhere)
    first = before is not None and before.holds_calls() and before.later is None
    # (and whether each may donate its table, which its own outs may hold: JAX 0.12 pairs the
    # collectives of one compiled program alone, and a donating program is another program)
    sizes += (0,) * (_AGREED - 2 - len(sizes)) + (int(first), int(not donate))
    agreed = _agreed(key, sizes, extra=extra, before=before, state=state)
    # (the pull's count and route, and whether every process pulls the ids it pushed)
    pulled = None if pull is None else (agreed[2], agreed[3], not agreed[4])
    # no rows anywhere: padded rows that select nothing
    n = fit(("push across", key), max(agreed[0], 1))
    return Across(n, agreed[1], pulled, bool(agreed[5]), not agreed[6])


def _pulls_pushed(pull: list[np.ndarray] | None, pairs: list[tuple[np.ndarray, Any]]) -> bool:
    """Whether this process pulls, per device, the ids it pushes (``pull``: its checked ids
    to pull, one per device; ``None``: no pull)."""
    return (
        pull is not None
        and len(pull) == len(pairs)
        and all(np.array_equal(p, x) for p, (x, _) in zip(pull, pairs))
    )


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
    extra: dict[str, Any],
    back: bool = False,
    alone: bool = False,
) -> tuple[KVState, list[Any] | None]:
    """``push_rows`` on a store across processes: this process's pairs, one per device of this
    process, summed with every other process's (``n`` ids per device and the busiest route
    ``most`` agreed by :func:`_across_pairs`); ``alone``: routed, each owner updating alone
    (:func:`_routed_alone`); then, with ``back``, each device's pushed rows after the update
    too, along the same routes (else ``None``)."""
    sharded = state.is_sharded(shape) and leaf is not None
    rows = [pad_rows(r, n) for _, r in pairs]
    opt = None if n_group is None else state.group_states[n_group]
    if alone and leaf is not None:
        c = route(most, n, len(state.devices))
        sent = [pad_ids(x, n, -1) for x, _ in pairs]
        spec = RoutedSpec(key, leaf, n_group, updater, donate, c, 0 if back else None)
        new, out = _run_routed(state, spec, sent, rows, extra)
        return new, _pushed_back(out, pairs) if back else None
    stacked_ids = _global(state, [pad_ids(x, n, -1) for x, _ in pairs])
    stacked = _global(state, rows)
    if leaf is not None and (n_group is None or state.packings[n_group] is None):
        fn = own_push(state.mesh, state.axis, key, shape[0], sharded, updater, donate)
        value, opt = order.ordered(
            "push_rows", fn, state.leaves[leaf], opt, stacked_ids, stacked, extra
        )
        return buckets.with_leaves(
            state, {leaf: value}, {} if n_group is None else {n_group: opt}
        ), None
    i = state.index(key)
    place = _in_bucket(state, i)
    # A split bucket's rows written in place (every process's pairs gathered inside it).
    if place is not None and place[2] and _pushes_in_place(state, updater, n_group):
        return _bucket_push(
            state, key, i, place, n_group, stacked_ids, stacked, updater, donate, extra
        ), None
    fn = state_push(key, shape[0], updater, donate)
    return order.ordered("push_rows", fn, state, stacked_ids, stacked, extra), None


def _gathered(
    state: KVState, key: Key, host_pairs: list[tuple[np.ndarray, Any]], dtype: Any
) -> tuple[Any, Any]:
    """Every pair's ids and rows side by side, on the store's devices: rows already on the
    store's devices, one pair on each, are used in place (one array sharded over the mesh);
    others are copied there."""
    replicated = NamedSharding(state.mesh, PartitionSpec())
    ids = np.concatenate([ids for ids, _ in host_pairs])
    devices = state.devices
    placed = [_one_device(r) for _, r in host_pairs]
    sizes = {r.shape[0] for _, r in host_pairs}
    # Counts padded to a few sizes (ids -1, rows of zeros), so a new count compiles nothing.
    if (
        len(host_pairs) == len(devices) > 1
        and len(sizes) == 1
        and placed == list(devices)
        and all(r.dtype == host_pairs[0][1].dtype for _, r in host_pairs)
        and all(d.process_index == jax.process_index() for d in devices)
    ):
        to = fit(("stacked", key), sizes.pop())
        spec = NamedSharding(state.mesh, PartitionSpec(state.axis))
        shards = [pad_rows(r, to) for _, r in host_pairs]
        rows = assemble((to * len(devices), *host_pairs[0][1].shape[1:]), spec, shards)
        return order.put(np.concatenate([pad_ids(x, to) for x, _ in host_pairs]), spec), rows
    to = fit(("gathered", key), ids.size)
    if len(host_pairs) == 1 and isinstance(host_pairs[0][1], np.ndarray):
        # Rows made on the host: padded there, and handed to a store of one device as the
        # computation's arguments (one transfer, no put of their own); else put at once.
        r = host_pairs[0][1]
        host = np.zeros((to, *r.shape[1:]), r.dtype)
        host[: r.shape[0]] = r
        if len(devices) == 1:
            return pad_ids(ids, to), host
        padded, rows = order.put((pad_ids(ids, to), host), replicated)
        return padded, rows
    if len(host_pairs) == 1:
        rows = pad_rows(order.put(host_pairs[0][1], replicated), to)
    else:
        rows = concat_rows([r for _, r in host_pairs], replicated, to)
    return order.put(pad_ids(ids, to), replicated), rows


def _push_traced(
    state: KVState,
    key: Key,
    shape: tuple[int, ...],
    pairs: Sequence[tuple[Any, Any]],
    updater: Any,
    axis_name: Any,
    group: tuple[Key, ...] | None,
    extra: dict[str, Any],
) -> KVState:
    """``push_rows`` inside the caller's trace (``jit``, ``pmap`` or ``shard_map``)."""
    dtype = buckets.stored_type(state, state.index(key)).dtype
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
            with jax.named_scope(ROUTE):
                ids = jax.lax.all_gather(ids, axis, tiled=True)
                rows = jax.lax.all_gather(rows, axis, tiled=True)
    if block is None:
        return push_whole(state, key, shape[0], ids, rows, updater, extra)
    opt = None if group is None else state.opt_states[group]
    if isinstance(updater, optax.GradientTransformation) and opt is None:
        raise KVStoreError(
            f"key {shown(key)}: expected optimizer state made before the step for a row push "
            "of this device's block inside shard_map; call jaxkv.init_optimizer(state, optimizer, "
            f"[{shown(key)}]) before it"
        )
    where = Where(axis, block)
    value, opt, _ = update_rows(key, where, stored, opt, ids, rows, shape[0], updater, extra)
    return state.replace({key: value}, None if group is None else {group: opt})
