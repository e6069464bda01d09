"""The imperative store's row-sparse values: MXNet's ``row_sparse`` init, push and
``row_sparse_pull`` over the functional row operations (``rows/ops.py``).

A key initialised with (or assigned) a row-sparse value is stored as its dense value (rows
absent are zeros), as every key is: the store keeps no storage type per key (MXNet's refusals
that depend on one are listed as differences in the README). A push of row-sparse values is one
:func:`jaxkv.push_rows` of each device's ``(indices, data)``:

* with an optimizer that updates lazily (an optax transformation, or ``mx.optimizer.SGD`` /
  ``Adam`` with ``lazy_update=True``): only the pushed rows and their optimizer state change;
* with ``lazy_update=False``: MXNet's standard update, every row (the gradient densified);
* with an MXNet-style ``updater(key, input, stored)``: the merged rows, summed into a value of
  the table's shape (zeros elsewhere), and the stored value, as ``NDArray`` handles;
* with none: the stored value becomes the merged sum (rows not pushed become zero), as MXNet
  replaces it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv._src.core.ops  # noqa: F401 - core.ops below
from jaxkv._src import core
from jaxkv._src.errors import ShapeError, shown
from jaxkv._src.mxnet.ndarray import NDArray
from jaxkv._src.mxnet.sparse import RowSparseNDArray
from jaxkv._src.rows import ops
from jaxkv._src.rows.ops import host_ids, ids_on_host
from jaxkv._src.state.kvstate import Key, KVState

__all__ = [
    "Held",
    "held",
    "is_row_sparse",
    "pull_into",
    "push",
    "pushpull_into",
    "replace_all",
    "lazy_push",
    "run_held",
    "wanted",
]


def is_row_sparse(x: Any) -> bool:
    return isinstance(x, RowSparseNDArray)


def replace_all(key: Key, pushed: jax.Array, stored: jax.Array) -> jax.Array:
    """MXNet's push without an updater: the stored value becomes the pushed sum."""
    return pushed


def dense_of(x: Any) -> Any:
    """A pushed value as a dense array (a row-sparse one scattered into zeros)."""
    return x.as_dense() if is_row_sparse(x) else x


class Held(NamedTuple):
    """A lazy row-sparse push, checked, to run later (the imperative store holds it until its
    next call): each pushed value's ids and rows as they were at the push (the arrays, not the
    ``RowSparseNDArray``, which the caller may change in place before the push runs), and the
    ids checked on the host; ``updater`` as :func:`lazy_push` runs it (``replace_all`` for
    none), with ``extra`` its extra arguments (an MXNet optimizer's scalars for this push)."""

    key: Key
    row_ids: list
    rows: list
    ids: list
    updater: Any
    donate: bool
    extra: dict | None = None
    counted: Any = None  # the MXNet optimizer's bookkeeping before the push counted it
    # Across processes: the store's calls held before this push (``held.Held``), none of them
    # of its key, run before it (and agreed with it where a row_sparse_pull takes it)
    before: Any = None


def held(
    state: KVState, key: Key, values: list, updater: Any, donate: bool, extra: dict | None = None
) -> Held:
    """A lazy push of ``values`` (one per device, the first row-sparse) to ``key``, with every
    refusal raised now: run it with :func:`run_held` or :func:`pushpull_into`."""
    values = _row_sparse_values(state, key, values)
    row_ids, rows = _parts(state, values)
    updater = replace_all if updater is None else updater
    ids = ops.check_push(state, key, row_ids, rows, updater)
    return Held(key, row_ids, rows, ids, updater, donate, extra)


def run_held(state: KVState, push: Held) -> KVState:
    """``state`` after a held push."""
    return lazy_push(
        state, push.key, push.row_ids, push.rows, push.updater, push.donate, push.extra
    )


def lazy_push(
    state: KVState,
    key: Key,
    row_ids: list,
    rows: list,
    updater: Any,
    donate: bool,
    extra: dict | None = None,
) -> KVState:
    """One ``push_rows`` of each device's ``(row_ids, rows)``: only the rows pushed (and their
    optimizer state) change; with no updater the stored value becomes the merged sum (MXNet)."""
    updater = replace_all if updater is None else updater
    return ops.push_rows_held(state, key, row_ids, rows, updater, donate, extra)


def _row_sparse_values(state: KVState, key: Key, values: list) -> list:
    shape = state.shapes[key]
    with ops.checking(state, key):  # across processes, a refusal here is every process's
        _check_shapes(key, shape, values)
    # MXNet sums a mixed list in the first value's storage type.
    return [v if is_row_sparse(v) else _as_row_sparse(v) for v in values]


def _check_shapes(key: Key, shape: tuple[int, ...], values: list) -> None:
    for v in values:
        if tuple(v.shape) != tuple(shape):
            raise ShapeError(
                f"key {shown(key)}: the pushed value has shape {tuple(v.shape)}, expected the "
                f"stored shape {tuple(shape)}"
            )


def push(
    state: KVState,
    key: Key,
    values: list,
    updater: Any,
    lazy: bool,
    donate: bool,
    extra: dict | None = None,
) -> KVState:
    """``state`` after a push of ``values`` (one per device, the first row-sparse) to ``key``
    (``extra``: the updater's extra arguments)."""
    values = _row_sparse_values(state, key, values)
    if not lazy:  # MXNet's standard update: every row, with the gradient densified
        dense = [dense_of(v) for v in values]
        return core.ops.push(state, key, dense, updater=updater, donate=donate, extra_args=extra)
    row_ids, rows = _parts(state, values)
    return lazy_push(state, key, row_ids, rows, updater, donate, extra)


def _parts(state: KVState, values: list[RowSparseNDArray]) -> tuple[list, list]:
    """Each value's ids and rows. Into a store of one device of this process (one device, or
    one device of each process), NumPy arrays where both are still on the host (a value made
    there: the push hands them to its computation as arguments, in its one put); else the
    value's arrays on its device (put there once, if made on the host: on several devices of
    a process a push routes each device's rows from where they lie, and a value pushed again
    is not put again)."""
    me = jax.process_index()
    alone = sum(d.process_index == me for d in state.devices) == 1
    row_ids, rows = [], []
    for v in values:
        host = v.host_parts() if alone else None
        ids, r = (v.row_ids, v.row_values) if host is None else (host[1], host[0])
        row_ids.append(ids)
        rows.append(r)
    return row_ids, rows


def _as_row_sparse(x: Any) -> RowSparseNDArray:
    from jaxkv._src.mxnet.sparse import from_dense

    data = x.asjax() if isinstance(x, NDArray) else jnp.asarray(x)
    return from_dense(data)


def pull_into(state: KVState, key: Key, outs: list, row_ids: list) -> list[tuple[Any, Any, Any]]:
    """What each row-sparse out of ``key`` receives: ``(out, rows, ids)``, the rows on the out's
    device and the ids on the host, for the distinct ids asked of it (sorted, as MXNet's
    ``row_sparse_pull`` gives them)."""
    with ops.checking(state, key):  # across processes, a refusal is every process's
        asked = wanted(state, key, row_ids)
    devices = [o.jax_device() for o in outs]
    rows: list[jax.Array]
    if any(d.process_index != jax.process_index() for d in state.devices):
        # Across processes: one pull of every out's ids (each process may have its own outs),
        # then each out's rows on its device.
        first = next(d for d in state.devices if d.process_index == jax.process_index())
        every = np.concatenate(asked) if asked else np.zeros(0, np.int32)
        got = ops.pull_rows(state, key, every, devices=[first])
        cuts = np.cumsum([x.size for x in asked])[:-1]
        pieces = [got[a:b] for a, b in zip([0, *cuts], [*cuts, every.size])]
        rows = list(jax.device_put(pieces, devices))
        return list(zip(outs, rows, asked))
    if tuple(devices) == state.devices and len({x.size for x in asked}) == 1 and len(devices) > 1:
        rows = ops.pull_rows(state, key, asked)  # one computation: each device its rows
    else:
        rows = [ops.pull_rows(state, key, x, devices=[d]) for x, d in zip(asked, devices)]
    return list(zip(outs, rows, asked))  # (the ids put on a device when an out is read)


def wanted(state: KVState, key: Key, row_ids: list) -> list[np.ndarray]:
    """The distinct ids each out of ``key`` asks for (sorted), checked."""
    return [_distinct(key, ids, state.shapes[key][0]) for ids in ids_on_host(row_ids)]


def pushpull_into(
    state: KVState,
    push: Held,
    outs: list,
    asked: list[np.ndarray],
    before: ops.Before | None = None,
) -> tuple[KVState, list[tuple[Any, Any, Any]]]:
    """A held push, then what each row-sparse out receives for its distinct ids ``asked`` (see
    :func:`wanted`), as :func:`pull_into` gives it (the rows possibly
    :class:`~jaxkv._src.rows.sizes.Padded`): in one computation where the outs are the
    store's devices, one each, asking as many rows each (the pushed values one per device of
    the store), a store of one device too; else the push, then the pull. ``before``: calls
    held before the push, across processes: agreed in the push's own all-gather where the pull
    is fused with it, and run before it (``rows.ops.Before``)."""
    devices = [o.jax_device() for o in outs]
    if ops.spans_processes(state):
        # Across processes: this process's outs, one on each of its devices, pulled in the
        # same agreement as the push (one host all-gather for both).
        local = [d for d in state.devices if d.process_index == jax.process_index()]
        fused = devices == local[: len(devices)] and len(set(devices)) == len(devices)
    else:
        fused = (
            tuple(devices) == state.devices
            and len(push.rows) == len(devices)
            and len({x.size for x in asked}) == 1
            and (len(outs) >= 2 or len(state.devices) == 1)
        )
    if not fused:
        if before is not None and before.holds_calls():  # agreed on their own, then run
            ops.agree_before(before, "push")
            state = before.run()
        state = run_held(state, push)
        return state, pull_into(state, push.key, outs, asked)
    state, rows = ops.pushpull_checked(
        state,
        push.key,
        (push.row_ids, push.rows, push.ids),
        asked,
        devices,
        push.updater,
        push.donate,
        push.extra,
        before,
    )
    return state, list(zip(outs, rows, asked))


def _distinct(key: Key, ids: Any, n_rows: int) -> np.ndarray:
    """The distinct ids of ``ids`` (checked as every row id is), sorted."""
    ids = host_ids(key, ids, n_rows)
    if ops.sorted_distinct(ids):  # already (as a batch's unique ids)
        return ids
    return np.unique(ids)
