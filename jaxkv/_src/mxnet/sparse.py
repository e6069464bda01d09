"""Row-sparse NDArrays: MXNet's `row_sparse` storage type for the drop-in.

A :class:`RowSparseNDArray` stands for a dense array of ``shape`` that is zero except in the
rows it lists: ``dense[indices[i]] = data[i]``. MXNet hands a KVStore such arrays for the
gradient of an embedding table, where a step changes a few rows of a large table, and
``kv.row_sparse_pull`` fills them with the rows a worker asks for.

What it holds (the layout the KVStore reads and fills):

* ``_rows``: a ``jax.Array`` of shape ``(nnz, *shape[1:])``, the stored rows;
* ``_ids``: an ``int32`` ``jax.Array`` of shape ``(nnz,)``, their row ids, sorted ascending,
  unique, each in ``[0, shape[0])``;
* ``_shape``: the dense shape; both arrays live on the array's device.

MXNet reports row ids as ``int64``. JAX runs with 64-bit types off, so they are held as
``int32`` and ``.indices`` reports ``int64`` (see :mod:`jaxkv.nd`); a table of more than
``2**31 - 1`` rows is refused when it is made.

Where jaxkv departs from MXNet, on purpose:

* ``row_sparse_array((data, indices))`` checks its input when it is made, where MXNet leaves
  most of it to ``check_format()``: indices must be whole numbers in ``[0, shape[0])``, one
  per row of ``data``, with no duplicates; ``data`` must have the trailing shape of ``shape``.
  MXNet documents that indices must be sorted ascending but does not sort them (an unsorted
  array fails ``check_format``); jaxkv sorts them, with their rows, which gives the same dense
  array, so every array it makes passes ``check_format``.
* Where the set of rows would depend on the values (``tostype('row_sparse')`` keeps the rows
  that hold a non-zero value, ``a + b`` keeps the union of both row sets), the result is
  computed eagerly, reading the row ids on the host. Under ``jit`` the same operations keep
  every row instead: the dense value is the same, only ``indices`` differ.
* Operations keep MXNet's storage types: ``rsp * scalar``, ``rsp / scalar``, ``rsp * dense``,
  ``rsp + rsp``, ``rsp - rsp``, ``-rsp``, ``abs(rsp)`` are row-sparse; ``rsp + scalar`` (a
  non-zero scalar), ``rsp + dense``, ``rsp / array`` and powers are dense ``NDArray``\\ s, and
  ``dense += rsp`` stays dense. ``reshape``, ``size`` and indexing other than ``[:]`` are
  refused, as in MXNet.

Examples:
  >>> import jaxkv.nd as nd
  >>> a = nd.sparse.row_sparse_array(([[1, 2], [3, 4]], [1, 4]), shape=(6, 2))
  >>> a.asnumpy().tolist()
  [[0.0, 0.0], [1.0, 2.0], [0.0, 0.0], [0.0, 0.0], [3.0, 4.0], [0.0, 0.0]]
  >>> a.stype, a.indices.dtype, (a * 2).data.asnumpy().tolist()
  ('row_sparse', dtype('int64'), [[2.0, 4.0], [6.0, 8.0]])
"""

from __future__ import annotations

import functools
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt

from jaxkv._src.core import checked
from jaxkv._src.devices import Context
from jaxkv._src.errors import KVStoreError, ShapeError
from jaxkv._src.mxnet.ndarray import (
    NDArray,
    as_context,
    as_shape,
    declared_dtype,
    held_dtype,
    host_values,
    is_traced,
    register_row_sparse,
    stype_error,
    unwrap,
)
from jaxkv._src.mxnet.ndarray import zeros as _dense_zeros
from jaxkv._src.rows.sizes import on_host_cheaply, sorted_distinct

__all__ = [
    "RowSparseNDArray",
    "add",
    "array",
    "divide",
    "empty",
    "multiply",
    "retain",
    "row_sparse_array",
    "subtract",
    "zeros",
]

_INDEX_DTYPE = np.dtype(np.int64)  # the type MXNet reports for row ids
_HELD_IDS = np.dtype(np.int32)  # the type they are held in (64-bit types off)
_MAX_ROWS = int(np.iinfo(np.int32).max)  # rows an int32 id can name


class NotSupportedForSparseNDArray(KVStoreError, NotImplementedError):
    """An operation MXNet does not have for row-sparse arrays (``reshape``, ``size``, ``a[i]``).

    Caught as ``KVStoreError`` (``mx.MXNetError``) or as ``NotImplementedError``, the two
    exceptions MXNet raises for them.
    """


# ---------------------------------------------------------------------------------------------
# Kernels: jitted once per shape, and inlined when called inside the user's trace.
# ---------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames="num_rows")
def _scatter(rows: jax.Array, ids: jax.Array, num_rows: int) -> jax.Array:
    """The dense array: zeros with ``rows`` at ``ids`` (sorted, unique)."""
    dense = jnp.zeros((num_rows, *rows.shape[1:]), rows.dtype)
    return dense.at[ids].set(rows, indices_are_sorted=True, unique_indices=True, mode="drop")


@jax.jit
def _row_mask(dense: jax.Array) -> jax.Array:
    """Which rows of ``dense`` hold a value other than zero (NaN counts, as in MXNet)."""
    width = int(np.prod(dense.shape[1:], dtype=np.int64))
    return jnp.any(dense.reshape(dense.shape[0], width) != 0, axis=1)


@jax.jit
def _take(dense: jax.Array, ids: jax.Array) -> jax.Array:
    """The rows ``ids`` (in range) of ``dense``."""
    return jnp.take(dense, ids, axis=0, unique_indices=True, mode="clip")


@jax.jit
def _take_found(rows: jax.Array, at: jax.Array, found: jax.Array) -> jax.Array:
    """The rows ``at`` of ``rows`` where ``found``, zero rows elsewhere."""
    taken = jnp.take(rows, at, axis=0, mode="clip")
    mask = found.reshape(-1, *(1,) * (rows.ndim - 1))
    return jnp.where(mask, taken, jnp.zeros((), rows.dtype))


@functools.partial(jax.jit, static_argnames=("num_rows", "op"))
def _merge(
    a: jax.Array, at_a: jax.Array, b: jax.Array, at_b: jax.Array, num_rows: int, op: str
) -> jax.Array:
    """The rows of ``a op b`` (``op``: 'add', 'subtract' or 'multiply') over the union of
    their ids: ``at_a``/``at_b`` are the positions of each operand's rows in the union, and an
    operand that stores no row there counts as zero."""
    zeros = jnp.zeros((num_rows, *a.shape[1:]), a.dtype)
    full_a = zeros.at[at_a].set(a, unique_indices=True)
    full_b = zeros.at[at_b].set(b, unique_indices=True)
    return getattr(jnp, op)(full_a, full_b)


# ---------------------------------------------------------------------------------------------
# Checks and conversions shared by the constructors.
# ---------------------------------------------------------------------------------------------
def _device_of(x: jax.Array) -> jax.Device:
    return min(x.devices(), key=lambda d: d.id)


def _check_table(shape: tuple[int, ...], where: str) -> None:
    if not shape:
        raise ShapeError(
            f"{where}: a row-sparse array has rows: expected 1 or more dimensions, "
            f"given shape {shape}"
        )
    if shape[0] > _MAX_ROWS:
        raise ShapeError(
            f"{where}: row ids are held as int32 (JAX's 64-bit types are off): expected at most "
            f"{_MAX_ROWS} rows, given shape {shape}"
        )


def _host_ids(indices: Any, where: str) -> np.ndarray:
    """Row ids as a 1-D int64 NumPy array: integers, or floats that are whole numbers."""
    host = indices.asnumpy() if isinstance(indices, NDArray) else np.asarray(indices)
    if host.ndim != 1:
        raise ShapeError(f"{where}: expected 1-D indices (row ids), given shape {host.shape}")
    if host.dtype.kind == "f":
        whole = np.isfinite(host) & (host == np.round(host))
        if not whole.all():
            raise KVStoreError(
                f"{where}: expected whole-number row ids, given {host[~whole][:8].tolist()}"
            )
    elif host.dtype.kind not in "iu" and host.size:
        raise KVStoreError(f"{where}: expected integer row ids, given dtype {host.dtype}")
    return host.astype(np.int64)


def _as_scalar(x: Any) -> Any:
    """A Python scalar from a NumPy one (MXNet passes scalars as ``float``): JAX's strict
    promotion would refuse a float64 NumPy scalar next to float32 rows."""
    return x.item() if isinstance(x, np.generic) else x


def _is_scalar(x: Any) -> bool:
    return isinstance(x, numbers.Number)


def _settle(rows: jax.Array, ids: jax.Array, device: jax.Device) -> tuple[jax.Array, jax.Array]:
    """``rows`` and ``ids`` on ``device``: a computation whose result has no elements can
    leave it on JAX's default device (JAX makes it a constant), whatever its inputs' device."""
    if (rows.size and ids.size) or is_traced(rows) or is_traced(ids):
        return rows, ids
    return jax.device_put((rows, ids), device)


def _empty(shape: tuple[int, ...], device: jax.Device, wanted: np.dtype) -> RowSparseNDArray:
    """A row-sparse array with no rows stored (all zeros)."""
    held = held_dtype(wanted)
    rows = jnp.zeros((0, *shape[1:]), held, device=device)
    ids = jnp.zeros((0,), _HELD_IDS, device=device)
    return RowSparseNDArray(rows, ids, shape, wanted)


def from_dense(dense: jax.Array, dtype: npt.DTypeLike | None = None) -> RowSparseNDArray:
    """The row-sparse form of a dense ``jax.Array``, on its device.

    Eagerly it keeps the rows that hold a non-zero value, as MXNet's ``cast_storage``; under a
    trace (where that set is unknown) it keeps every row.

    Args:
      dense: the dense value, 1-D or more.
      dtype: the dtype to report (``int64`` over held ``int32``), if not the held one.
    """
    shape = tuple(int(s) for s in dense.shape)
    _check_table(shape, "tostype('row_sparse')")
    if is_traced(dense):
        return RowSparseNDArray(dense, jnp.arange(shape[0], dtype=_HELD_IDS), shape, dtype)
    device = _device_of(dense)
    kept = np.flatnonzero(np.asarray(_row_mask(dense))).astype(_HELD_IDS)
    ids = jax.device_put(kept, device)
    rows = dense if len(kept) == shape[0] else _take(dense, ids)
    return RowSparseNDArray(*_settle(rows, ids, device), shape, dtype)


class RowSparseNDArray(NDArray):
    """MXNet's ``RowSparseNDArray``: the rows of a dense array that may be non-zero.

    Make one with :func:`row_sparse_array`, :func:`zeros` (``nd.zeros(shape,
    stype='row_sparse')``) or ``dense.tostype('row_sparse')``. It is an ``NDArray`` (as in
    MXNet), with ``stype == 'row_sparse'``; ``asnumpy()`` gives the dense array.

    ``data`` is an ``NDArray`` of the stored rows, shape ``(nnz, *shape[1:])``; ``indices``
    an ``NDArray`` of their row ids (sorted, unique), dtype int64 as MXNet's.

    Internals the KVStore uses: ``_rows`` and ``_ids`` (the stored rows and their int32 ids,
    ``jax.Array``\\ s on the array's device), ``_shape``; ``_set_rows(rows, ids, device)``
    replaces the content in place (as ``NDArray.set_value`` does for dense arrays);
    ``_set(dense, device)`` holds a dense value's non-zero rows; ``_dense()`` is the dense
    ``jax.Array``.

    Examples:
      >>> import jaxkv, jaxkv.nd as nd
      >>> rsp = nd.sparse.zeros('row_sparse', (4, 2), ctx=jaxkv.cpu(1))
      >>> rsp
      <BLANKLINE>
      <RowSparseNDArray 4x2 @cpu(1)>
      >>> rsp[:] = nd.array([[0, 0], [1, 1], [0, 0], [2, 2]])
      >>> rsp.indices.asnumpy().tolist(), rsp.context
      ([1, 3], cpu(1))
      >>> float(rsp.tostype('default').asnumpy().sum())
      6.0
    """

    __slots__ = ("_rows", "_ids", "_pending", "_shape")

    def __init__(
        self,
        rows: Any,
        ids: Any,
        shape: tuple[int, ...],
        dtype: npt.DTypeLike | None = None,
    ) -> None:
        """Wrap parts that already hold the invariants (no checks): use
        :func:`row_sparse_array` to make one from user input (``rows`` and ``ids``:
        ``jax.Array``\\ s, or anything :meth:`hold_lazily` then replaces)."""
        self._rows = rows
        self._ids = ids
        # Parts not yet on the device: ``(rows, count, ids, device)``, see :meth:`hold_lazily`.
        self._pending: tuple[Any, int, np.ndarray, jax.Device] | None = None
        self._shape = tuple(int(s) for s in shape)
        self._where: tuple[Any, Any] = (None, None)  # (rows, their device), see _device
        self._dtype = declared_dtype(dtype)
        self.owed_by = None  # a store never holds a pull for a row-sparse array

    # -- parts held lazily -----------------------------------------------------------------
    @classmethod
    def rows_lazily(
        cls,
        rows: Any,
        count: int,
        ids: np.ndarray,
        device: jax.Device,
        shape: tuple[int, ...],
        dtype: npt.DTypeLike | None = None,
    ) -> RowSparseNDArray:
        """An array whose parts reach ``device`` when first read: see :meth:`hold_lazily`."""
        out = cls(rows, ids, shape, dtype)
        out.hold_lazily(rows, count, ids, device)
        return out

    def hold_lazily(self, rows: Any, count: int, ids: np.ndarray, device: jax.Device) -> None:
        """Hold the first ``count`` rows of ``rows`` (host NumPy, or a padded ``jax.Array`` on
        ``device``) at the host ids ``ids`` (int32, sorted, unique, in range: not checked),
        put on ``device`` when first read: a store that only hands them on (a push of rows
        made on the host, a pulled out read once) puts nothing itself."""
        self._pending = (rows, count, ids, device)
        self._where = (None, device)

    def host_parts(self) -> tuple[np.ndarray, np.ndarray] | None:
        """``(rows, ids)`` as NumPy arrays where both are still on the host, else ``None``."""
        pending = self._pending
        if pending is None or not isinstance(pending[0], np.ndarray):
            return None
        return pending[0][: pending[1]], pending[2]

    def _host_rows(self) -> np.ndarray | None:
        """The pending rows cut to their count on the host, where they are cut there: rows
        held on the host, or pulled padded on a CPU device (no copy, nothing compiled); else
        ``None`` (rows of their exact count, or padded off CPU: a slice compiled per count)."""
        assert self._pending is not None
        rows, count = self._pending[:2]
        if isinstance(rows, np.ndarray) or rows.shape[0] != count and on_host_cheaply(rows):
            return np.asarray(rows)[:count]  # (waits for a pull)
        return None

    def _land(self) -> None:
        host = self._host_rows()
        assert self._pending is not None
        rows, count, ids, device = self._pending
        self._pending = None
        if host is not None:
            self._rows, self._ids = jax.device_put((host, ids), device)
        else:
            self._rows = rows if rows.shape[0] == count else rows[:count]
            self._ids = jax.device_put(ids, device)
        self._where = (self._rows, device)

    @property
    def row_values(self) -> jax.Array:
        if self._pending is not None:
            self._land()
        return self._rows

    @row_values.setter
    def row_values(self, rows: jax.Array) -> None:
        if self._pending is not None:
            self._land()
        self._rows = rows

    @property
    def row_ids(self) -> jax.Array:
        if self._pending is not None:
            self._land()
        return self._ids

    @row_ids.setter
    def row_ids(self, ids: jax.Array) -> None:
        if self._pending is not None:
            self._land()
        self._ids = ids

    # -- what the KVStore uses ---------------------------------------------------------------
    @property
    def _data(self) -> jax.Array:
        """The dense value (it builds the whole array: prefer ``_rows``/``_ids``)."""
        return self.as_dense()

    @_data.setter
    def _data(self, value: jax.Array) -> None:
        self._assign(value)

    def as_dense(self) -> jax.Array:
        """The dense ``jax.Array`` this array stands for (traceable), on its device."""
        if not self.row_values.shape[0] and not is_traced(self.row_values):  # see _settle
            return jnp.zeros(self._shape, self.row_values.dtype, device=self.jax_device())
        return _scatter(self.row_values, self.row_ids, num_rows=self._shape[0])

    def jax_device(self) -> jax.Device:
        rows, device = self._where
        if self._pending is not None:
            return self._pending[3]
        if rows is not self.row_values:
            device = _device_of(self.row_values)
            self._where = (self.row_values, device)
        return device

    def set_rows(self, rows: jax.Array, ids: jax.Array, device: jax.Device | None) -> None:
        """Hold ``rows`` at ``ids`` (both on ``device``), in place: what ``row_sparse_pull``
        does to its outs.

        ``ids`` must be sorted, unique and in range (not checked: the caller made them so);
        they are cast to int32, and ``rows`` to this array's dtype, when they differ.

        Raises:
          ShapeError: ``rows`` and ``ids`` do not pair up, or ``rows`` has another row shape.
        """
        if rows.shape[1:] != self._shape[1:] or rows.shape[0] != ids.shape[0]:
            raise ShapeError(
                f"_set_rows: expected rows of shape (n, {', '.join(map(str, self._shape[1:]))}) "
                f"and n ids, given rows of shape {tuple(rows.shape)} and {ids.shape[0]} ids"
            )
        if rows.dtype != self._held():
            rows = rows.astype(self._held())
        if ids.dtype != _HELD_IDS:
            ids = ids.astype(_HELD_IDS)
        self._pending = None
        self._rows, self._ids = rows, ids
        self._where = (rows, device)

    def set_rows_lazily(self, rows: jax.Array, count: int, ids: np.ndarray) -> None:
        """Hold the first ``count`` rows of the padded ``rows`` (on this array's device) at the
        host ids ``ids`` (sorted, unique, in range: not checked), put in place when first read
        (:meth:`hold_lazily`): what ``row_sparse_pull`` does to its outs where it can."""
        if rows.shape[1:] != self._shape[1:] or rows.shape[0] < count or ids.shape[0] != count:
            raise ShapeError(
                f"_set_rows: expected rows of shape (n, {', '.join(map(str, self._shape[1:]))}) "
                f"and {count} ids, given rows of shape {tuple(rows.shape)} and {ids.shape[0]} ids"
            )
        if rows.dtype != self._held():
            rows = rows.astype(self._held())
        self.hold_lazily(rows, count, ids.astype(_HELD_IDS, copy=False), self.jax_device())

    def _held(self) -> np.dtype:
        """The dtype the rows are held in (without putting lazily held ones on the device)."""
        return np.dtype((self._rows if self._pending is None else self._pending[0]).dtype)

    def set_value(self, data: jax.Array, device: jax.Device) -> None:
        """Hold the dense value ``data`` (on ``device``): its non-zero rows, eagerly."""
        if data.dtype != self.row_values.dtype:
            data = data.astype(self.row_values.dtype)
        other = from_dense(data)
        self.set_rows(other.row_values, other.row_ids, device)

    def _put(self, rows: jax.Array, ids: jax.Array) -> None:
        """Hold ``rows``/``ids``, moved onto this array's device (eagerly)."""
        if is_traced(rows) or is_traced(ids) or is_traced(self.row_values):
            self.row_values, self.row_ids = rows, ids
            return
        device = self.jax_device()
        rows, ids = jax.device_put((rows, ids), device)
        self.set_rows(rows, ids, device)

    def _assign(self, value: Any) -> None:
        """``self[:] = value``: a row-sparse or dense value of the same shape, in this array's
        dtype and on its device (MXNet's ``copyto`` into a row-sparse array)."""
        if isinstance(value, RowSparseNDArray):
            shape, dense = value.shape, None
        else:
            dense = jnp.asarray(unwrap(value), dtype=self.row_values.dtype)
            shape = tuple(dense.shape)
        if shape != self._shape:
            raise ShapeError(
                f"a[:] = value: expected a value of shape {self._shape}, given shape {shape}"
            )
        source = value if dense is None else from_dense(dense)
        rows = source.row_values
        if rows.dtype != self.row_values.dtype:
            rows = rows.astype(self.row_values.dtype)
        self._put(rows, source.row_ids)

    # -- properties ------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def dtype(self) -> np.dtype:
        held = self._held()
        declared = self._dtype
        return declared if declared is not None and held_dtype(declared) == held else held

    @property
    def stype(self) -> str:
        """MXNet's storage type, ``'row_sparse'``."""
        return "row_sparse"

    @property
    def size(self) -> int:
        raise NotSupportedForSparseNDArray(
            "size is not defined for a row-sparse array (as in MXNet): use "
            "tostype('default').size, or data.size for the stored values"
        )

    @property
    def data(self) -> NDArray:
        """The stored rows, an ``NDArray`` of shape ``(nnz, *shape[1:])``. Rows still held on
        the host, or pulled padded on a CPU device, stay on the host until the ``NDArray`` is
        used on its device (``NDArray.lazily``), and the ids are not put: MXNet's loop that
        only waits for the rows or reads them with ``asnumpy`` puts nothing on the device."""
        if self._pending is not None:
            rows, count, _, device = self._pending
            host = self._host_rows()
            if host is not None:
                return NDArray.lazily(host, device, self._dtype)
            if rows.shape[0] == count:  # (the ids, not asked for, stay on the host)
                return NDArray(rows, self._dtype)
        return NDArray(self.row_values, self._dtype)

    @property
    def indices(self) -> NDArray:
        """The stored rows' ids (sorted and unique), an ``NDArray`` that reports int64."""
        if held_dtype(_INDEX_DTYPE) == _INDEX_DTYPE:  # jax_enable_x64: int64 is held as such
            return NDArray(self.row_ids.astype(_INDEX_DTYPE))
        return NDArray(self.row_ids, _INDEX_DTYPE)

    # -- conversion --------------------------------------------------------------------------
    def asnumpy(self) -> np.ndarray:
        """The dense array, as a NumPy array in :attr:`dtype` (built on the host)."""
        dtype = self.dtype
        out = np.zeros(self._shape, dtype)
        rows = np.asarray(self.row_values)
        if len(rows):
            out[np.asarray(self.row_ids)] = rows
        checked.settle(wait=True)  # a wrong sum raises at the read, as a host callback would
        return out

    def asjax(self) -> jax.Array:
        """The dense value as a ``jax.Array`` on this array's device."""
        return self.as_dense()

    def asscalar(self) -> int | float | complex:
        if int(np.prod(self._shape, dtype=np.int64)) != 1:
            raise ShapeError(f"asscalar: expected an array of size 1, given shape {self._shape}")
        return self.asnumpy().reshape(()).item()

    def __array__(self, dtype: npt.DTypeLike | None = None, copy: bool | None = None) -> np.ndarray:
        out = self.asnumpy()
        return out if dtype is None else out.astype(dtype)

    def __jax_array__(self) -> jax.Array:
        return self.as_dense()

    def wait_to_read(self) -> None:
        jax.block_until_ready((self.row_values, self.row_ids))
        checked.settle(wait=True)

    def astype(self, dtype: npt.DTypeLike, copy: bool = True) -> RowSparseNDArray:
        """A copy with values of ``dtype`` (``self`` when ``copy=False`` and it already is)."""
        wanted = np.dtype(dtype)
        if not copy and wanted == self.dtype:
            return self
        return self.like(self.row_values.astype(held_dtype(wanted)), dtype=wanted)

    def tostype(self, stype: str) -> NDArray:
        """A dense ``NDArray`` (``'default'``) or a row-sparse copy (``'row_sparse'``).

        Raises:
          KVStoreError: any other ``stype`` (jaxkv has no ``'csr'``).
        """
        if stype == "default":
            return NDArray(self.as_dense(), self._dtype)
        if stype == "row_sparse":
            return self.copy()
        raise stype_error("tostype", stype)

    def reshape(self, *shape: Any) -> NDArray:
        raise NotSupportedForSparseNDArray(
            f"reshape is not supported for a row-sparse array (as in MXNet), given {shape}: "
            f"use tostype('default').reshape(...)"
        )

    def copy(self) -> RowSparseNDArray:
        """A copy on the same device."""
        return self.like(jnp.copy(self.row_values), jnp.copy(self.row_ids))

    def copyto(self, other: Context | NDArray) -> NDArray:
        """Copy into ``other``: a context (a new row-sparse array there), a row-sparse array
        (given these rows, in its dtype, on its device) or a dense ``NDArray`` (given the
        dense value).

        Raises:
          ShapeError: ``other`` has another shape.
          KVStoreError: ``other`` is neither a context nor an array.
        """
        if isinstance(other, Context):
            rows, ids = jax.device_put(
                (self.row_values, self.row_ids), other.device, may_alias=False
            )
            return RowSparseNDArray(rows, ids, self._shape, self._dtype)
        if isinstance(other, NDArray):
            if other.shape != self._shape:
                raise ShapeError(
                    f"copyto: expected a destination of shape {self._shape}, given shape "
                    f"{other.shape}"
                )
            if other is not self:
                other[:] = self
            return other
        raise KVStoreError(f"copyto: expected a Context or an NDArray, given {type(other)}")

    def check_format(self, full_check: bool = True) -> None:
        """Check MXNet's invariants: one id per stored row and, with ``full_check``, ids
        sorted ascending, unique and in ``[0, shape[0])``.

        Raises:
          KVStoreError: with MXNet's message for the broken invariant.
        """
        if (
            self.row_ids.shape != (self.row_values.shape[0],)
            or self.row_values.shape[1:] != self._shape[1:]
        ):
            raise ShapeError(
                f"Shape mismatch of this row_sparse NDArray: expected data of shape "
                f"(n, {', '.join(map(str, self._shape[1:]))}) and n indices, given data of shape "
                f"{tuple(self.row_values.shape)} and indices of shape {tuple(self.row_ids.shape)}"
            )
        if not full_check or not self.row_ids.shape[0]:
            return
        ids = np.asarray(self.row_ids)
        if (np.diff(ids) <= 0).any() or ids[0] < 0 or ids[-1] >= self._shape[0]:
            raise KVStoreError(
                f"Indices of row_sparse NDArray should be non-negative, less than the size of "
                f"first dimension ({self._shape[0]}) and in ascending order, given "
                f"{ids[:16].tolist()}"
            )

    def retain(self, indices: Any) -> RowSparseNDArray:
        """The rows ``indices`` of this array, as MXNet's ``retain`` (see :func:`retain`)."""
        return retain(self, indices)

    # -- indexing ----------------------------------------------------------------------------
    def __getitem__(self, index: Any) -> RowSparseNDArray:
        if isinstance(index, slice) and index == slice(None):
            return self
        raise NotSupportedForSparseNDArray(
            f"a row-sparse array supports only [:] (as MXNet), given [{index!r}]: use "
            f"tostype('default')[...]"
        )

    def __setitem__(self, index: Any, value: Any) -> None:
        """``a[:] = value``: a row-sparse array, a dense array of the same shape (its non-zero
        rows are kept), or a scalar (every row holds it, as in MXNet)."""
        if not (isinstance(index, slice) and index == slice(None)):
            raise NotSupportedForSparseNDArray(
                f"a row-sparse array supports only [:] for assignment (as MXNet), given [{index!r}]"
            )
        if value is self:
            return
        if _is_scalar(value):
            rows = jnp.full(self._shape, _as_scalar(value), self.row_values.dtype)
            self._put(rows, jnp.arange(self._shape[0], dtype=_HELD_IDS))
            return
        if not isinstance(value, NDArray | np.ndarray | jax.Array | list | tuple):
            raise KVStoreError(
                f"a[:] = value: expected an NDArray, an array or a scalar, given {type(value)}"
            )
        self._assign(value)

    # -- arithmetic ----------------------------------------------------------------------------
    def _dense_op(self, other: Any, op: Any, reflected: bool = False) -> NDArray:
        """``op`` on the dense values: a dense ``NDArray``, as MXNet's storage fallback (an
        array ``other`` on another device is brought to this one's)."""
        a, b = self.as_dense(), _as_scalar(unwrap(other))
        if isinstance(b, jax.Array) and not (is_traced(a) or is_traced(b)):
            b = jax.device_put(b, self.jax_device())
        return NDArray(op(b, a) if reflected else op(a, b), self._dtype)

    def like(
        self, rows: jax.Array, ids: jax.Array | None = None, dtype: npt.DTypeLike | None = None
    ) -> RowSparseNDArray:
        """A row-sparse array of this shape and device: ``rows`` at ``ids`` (default: this
        array's), reporting ``dtype`` (default: this array's)."""
        ids = self.row_ids if ids is None else ids
        if not (is_traced(self.row_values) or is_traced(rows) or is_traced(ids)):
            rows, ids = _settle(rows, ids, self.jax_device())
        return RowSparseNDArray(rows, ids, self._shape, self._dtype if dtype is None else dtype)

    def _scaled(self, scalar: Any, op: Any) -> RowSparseNDArray:
        """Each stored row ``op`` a scalar, cast to the rows' dtype first (as MXNet does)."""
        held = self.row_values.dtype
        value = jnp.asarray(np.asarray(_as_scalar(scalar)).astype(held))
        return self.like(op(self.row_values, value).astype(held))

    def _rows_of(self, other: NDArray | jax.Array) -> jax.Array:
        """The rows of a dense ``other`` at this array's ids, in its dtype, on its device."""
        dense = jnp.asarray(unwrap(other), dtype=self.row_values.dtype)
        if not (is_traced(dense) or is_traced(self.row_values)):
            dense = jax.device_put(dense, self.jax_device())
        return _take(dense, self.row_ids)

    def _same_shape(self, other: Any) -> bool:
        shape = getattr(other, "shape", None)
        return shape is not None and tuple(shape) == self._shape

    def _sum(self, other: Any, negate: bool, reflected: bool = False) -> NDArray:
        """``self + other`` (or ``-``): row-sparse for a row-sparse ``other`` (the union of
        the row sets) and for a zero scalar, dense otherwise (MXNet's storage types)."""
        op = jnp.subtract if negate else jnp.add
        if _is_scalar(other) and other == 0 and not (negate and reflected):
            return self.copy()
        if not isinstance(other, RowSparseNDArray) or other.shape != self._shape:
            return self._dense_op(other, op, reflected)
        return self._union(other, op)

    def _union(self, other: RowSparseNDArray, op: Any) -> RowSparseNDArray:
        """``op`` on two row-sparse arrays of this shape: row-sparse over the union of their
        row sets (MXNet's ``elemwise_add``/``_sub``/``_mul`` of two row-sparse arrays)."""
        b_rows = other.row_values.astype(self.row_values.dtype)
        if any(map(is_traced, (self.row_values, self.row_ids, other.row_values, other.row_ids))):
            b_dense = _scatter(b_rows, other.row_ids, num_rows=self._shape[0])
            return from_dense(op(self.as_dense(), b_dense), self._dtype)
        device = self.jax_device()
        b_rows, b_ids = jax.device_put((b_rows, other.row_ids), device)
        ids_a, ids_b = np.asarray(self.row_ids), np.asarray(b_ids)
        union = np.union1d(ids_a, ids_b).astype(_HELD_IDS)
        at_a = np.searchsorted(union, ids_a).astype(_HELD_IDS)
        at_b = np.searchsorted(union, ids_b).astype(_HELD_IDS)
        placed = jax.device_put((at_a, at_b, union), device)
        rows = _merge(self.row_values, placed[0], b_rows, placed[1], len(union), op.__name__)
        return self.like(rows, placed[2])

    def _product(self, other: Any) -> NDArray:
        """``self * other``: row-sparse for a scalar or an array of the same shape, dense
        when ``other`` broadcasts (MXNet's ``elemwise_mul`` / ``broadcast_mul``)."""
        if _is_scalar(other):
            return self._scaled(other, jnp.multiply)
        if not self._same_shape(other):
            return self._dense_op(other, jnp.multiply)
        if not isinstance(other, RowSparseNDArray):
            return self.like(self.row_values * self._rows_of(other))
        return self._union(other, jnp.multiply)

    def __add__(self, o: Any) -> NDArray:
        return self._sum(o, negate=False)

    def __radd__(self, o: Any) -> NDArray:
        return self._sum(o, negate=False, reflected=True)

    def __sub__(self, o: Any) -> NDArray:
        return self._sum(o, negate=True)

    def __rsub__(self, o: Any) -> NDArray:
        return self._sum(o, negate=True, reflected=True)

    def __mul__(self, o: Any) -> NDArray:
        return self._product(o)

    def __rmul__(self, o: Any) -> NDArray:
        return self._product(o)

    def __truediv__(self, o: Any) -> NDArray:
        if _is_scalar(o):
            return self._scaled(o, jnp.true_divide)
        return self._dense_op(o, jnp.true_divide)

    def __rtruediv__(self, o: Any) -> NDArray:
        return self._dense_op(o, jnp.true_divide, reflected=True)

    def __pow__(self, o: Any) -> NDArray:
        return self._dense_op(o, jnp.power)

    def __neg__(self) -> RowSparseNDArray:
        return self.like(-self.row_values)

    def __abs__(self) -> RowSparseNDArray:
        return self.like(jnp.abs(self.row_values))

    def _in_place(self, result: NDArray) -> RowSparseNDArray:
        self._assign(result)  # MXNet: (self op other).copyto(self)
        return self

    def __iadd__(self, o: Any) -> RowSparseNDArray:
        return self._in_place(self + o)

    def __isub__(self, o: Any) -> RowSparseNDArray:
        return self._in_place(self - o)

    def __imul__(self, o: Any) -> RowSparseNDArray:
        return self._in_place(self * o)

    def __itruediv__(self, o: Any) -> RowSparseNDArray:
        return self._in_place(self / o)

    def __repr__(self) -> str:
        shape = "x".join(str(s) for s in self._shape)
        if is_traced(self.row_values) or is_traced(self.row_ids):
            return f"<RowSparseNDArray {shape} traced {self.row_values.aval}>"
        return f"\n<RowSparseNDArray {shape} @{self.context}>"


# ---------------------------------------------------------------------------------------------
# Creation, as mxnet.nd.sparse does it.
# ---------------------------------------------------------------------------------------------
def _check_shape(given: tuple[int, ...], shape: Any, where: str) -> None:
    if shape is not None and tuple(as_shape(shape)) != tuple(given):
        raise ShapeError(f"{where}: shape mismatch: expected shape {given}, given shape={shape}")


def row_sparse_array(
    arg1: Any,
    shape: Any = None,
    ctx: Context | None = None,
    dtype: npt.DTypeLike | None = None,
) -> RowSparseNDArray:
    """A :class:`RowSparseNDArray`, made as MXNet's ``row_sparse_array`` makes it.

    ``arg1`` is one of:

    * ``(data, indices)``: the rows and their ids, ``dense[indices[i]] = data[i]``. ``data``
      has shape ``(len(indices), *shape[1:])``; ``indices`` is 1-D, of integers or of whole
      floats (``mx.nd.array``'s default float32 ids work). Without ``shape`` the table has
      ``max(indices) + 1`` rows. Ids need not be sorted (they are sorted with their rows) but
      must be unique and in ``[0, shape[0])``. The dtype is ``data``'s for an array (NDArray,
      NumPy, JAX), float32 for a list, unless ``dtype``.
    * a shape tuple of two or more ints: an empty array (all zeros) of that shape;
    * a dense array (``NDArray``, NumPy array, list): its non-zero rows;
    * a ``RowSparseNDArray``: a copy.

    The array lives on ``ctx`` (default: the current context).

    Raises:
      ShapeError: ``shape`` disagrees with the data, indices are not 1-D, or the table has
        more rows than int32 ids can name.
      KVStoreError: indices are out of range, duplicated, or not whole numbers.

    Examples:
      >>> import jaxkv, jaxkv.nd as nd
      >>> a = nd.sparse.row_sparse_array(([[3, 4], [1, 2]], [4, 1]), shape=(6, 2),
      ...                                ctx=jaxkv.cpu(2))
      >>> a.indices.asnumpy().tolist(), a.data.asnumpy().tolist(), a.context
      ([1, 4], [[1.0, 2.0], [3.0, 4.0]], cpu(2))
      >>> nd.sparse.row_sparse_array((3, 2)).data.shape
      (0, 2)
    """
    where = "row_sparse_array"
    if isinstance(arg1, tuple):
        if len(arg1) < 2:
            raise ShapeError(
                f"{where}: expected (data, indices) or a shape of 2 or more ints, given a tuple "
                f"of length {len(arg1)}"
            )
        if all(isinstance(s, numbers.Integral) for s in arg1):
            table = as_shape(arg1)
            _check_shape(table, shape, where)
            _check_table(table, where)
            return _empty(table, as_context(ctx).device, np.dtype(dtype or np.float32))
        if len(arg1) != 2:
            raise ShapeError(f"{where}: expected (data, indices), given {len(arg1)} items")
        return _from_definition(arg1[0], arg1[1], shape, ctx, dtype)
    if isinstance(arg1, RowSparseNDArray):
        _check_shape(arg1.shape, shape, where)
        return array(arg1, ctx, dtype)
    from jaxkv._src.mxnet.ndarray import array as dense_array

    if dtype is None and isinstance(arg1, NDArray | np.ndarray | jax.Array):
        dtype = arg1.dtype
    dense = dense_array(arg1, ctx, dtype)
    _check_shape(dense.shape, shape, where)
    return from_dense(dense.asjax(), dense.dtype)


def _from_definition(
    data: Any, indices: Any, shape: Any, ctx: Context | None, dtype: npt.DTypeLike | None
) -> RowSparseNDArray:
    where = "row_sparse_array((data, indices))"
    device = as_context(ctx).device
    if isinstance(data, RowSparseNDArray):
        raise KVStoreError(f"{where}: expected dense data, given a RowSparseNDArray")
    on_device = isinstance(data, NDArray | jax.Array)
    if dtype is None:
        dtype = data.dtype if on_device or isinstance(data, np.ndarray) else np.float32
    wanted = np.dtype(dtype)
    held = held_dtype(wanted)
    values = jnp.asarray(unwrap(data), dtype=held) if on_device else host_values(data, wanted, held)
    ids = _host_ids(indices, where)
    if shape is None:
        if not len(ids):
            raise ShapeError(f"{where}: expected shape= when indices is empty, given neither")
        shape = (int(ids.max()) + 1, *values.shape[1:])
    shape = as_shape(shape)
    _check_table(shape, where)
    given = tuple(values.shape)
    if len(given) != len(shape) or given[1:] != shape[1:]:
        raise ShapeError(
            f"{where}: expected data of shape (n, {', '.join(map(str, shape[1:]))}) for shape "
            f"{shape}, given data of shape {given}"
        )
    if given[0] != len(ids):
        raise ShapeError(
            f"{where}: expected one row of data per index, given {given[0]} rows of data and "
            f"{len(ids)} indices"
        )
    bad = ids[(ids < 0) | (ids >= shape[0])]
    if len(bad):
        raise KVStoreError(
            f"{where}: expected indices in [0, {shape[0]}) for shape {shape}, given "
            f"{bad[:8].tolist()}"
        )
    if not sorted_distinct(ids):  # (a batch's ids come sorted)
        order = np.argsort(ids, kind="stable")
        ids = ids[order]
        repeated = ids[1:][np.diff(ids) == 0]
        if len(repeated):
            raise KVStoreError(
                f"{where}: expected unique indices (one row each), given repeated ids "
                f"{np.unique(repeated)[:8].tolist()}"
            )
        values = values[order.astype(_HELD_IDS)]
    if not on_device:  # made on the host: put on the device when first read (a push need not)
        held_ids = ids.astype(_HELD_IDS)
        return RowSparseNDArray.rows_lazily(values, len(held_ids), held_ids, device, shape, wanted)
    rows, held_ids = jax.device_put((values, ids.astype(_HELD_IDS)), device, may_alias=False)
    return RowSparseNDArray(rows, held_ids, shape, wanted)


def zeros(
    stype: str,
    shape: Any,
    ctx: Context | None = None,
    dtype: npt.DTypeLike | None = None,
    **kwargs: Any,
) -> NDArray:
    """An array of zeros of storage type ``stype`` (MXNet's order: ``stype`` first).

    ``'row_sparse'`` gives a :class:`RowSparseNDArray` with no rows stored; ``'default'`` a
    dense ``NDArray``. The dtype is float32 unless ``dtype``; the context the current one
    unless ``ctx``.

    Raises:
      KVStoreError: ``stype`` is neither (jaxkv has no ``'csr'``).

    Examples:
      >>> import jaxkv.nd as nd
      >>> z = nd.sparse.zeros('row_sparse', (3, 2), dtype='float16')
      >>> z.dtype, z.asnumpy().tolist()
      (dtype('float16'), [[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    """
    if stype in (None, "default"):
        return _dense_zeros(shape, ctx, dtype, **kwargs)
    if stype != "row_sparse":
        raise stype_error("sparse.zeros", stype)
    if kwargs.get("out", 0) is None:
        del kwargs["out"]
    if kwargs:
        raise KVStoreError(f"sparse.zeros: unexpected arguments {sorted(kwargs)}")
    table = as_shape(shape)
    _check_table(table, "sparse.zeros")
    return _empty(table, as_context(ctx).device, np.dtype(dtype or np.float32))


def empty(
    stype: str, shape: Any, ctx: Context | None = None, dtype: npt.DTypeLike | None = None
) -> NDArray:
    """An array of storage type ``stype`` with nothing stored: :func:`zeros`."""
    if stype is None:
        raise stype_error("sparse.empty", stype)
    return zeros(stype, shape, ctx, dtype)


def array(
    source_array: Any, ctx: Context | None = None, dtype: npt.DTypeLike | None = None
) -> RowSparseNDArray:
    """A copy of a row-sparse array on ``ctx`` (default: the current context, as in MXNet),
    in ``dtype`` (default: the source's).

    Raises:
      KVStoreError: ``source_array`` is not row-sparse (use ``tostype('row_sparse')`` for a
        dense ``NDArray``, ``nd.array`` for a NumPy array, as MXNet says).
    """
    if isinstance(source_array, RowSparseNDArray):
        wanted = np.dtype(dtype) if dtype is not None else source_array.dtype
        rows = source_array.row_values
        if rows.dtype != held_dtype(wanted):
            rows = rows.astype(held_dtype(wanted))
        rows, ids = jax.device_put(
            (rows, source_array.row_ids), as_context(ctx).device, may_alias=False
        )
        return RowSparseNDArray(rows, ids, source_array.shape, wanted)
    if isinstance(source_array, NDArray):
        hint = "use tostype('row_sparse') to make a RowSparseNDArray from an NDArray"
    elif isinstance(source_array, np.ndarray | np.generic):
        hint = "use nd.array to make an NDArray from a NumPy array"
    else:
        hint = "jaxkv has no csr arrays"
    raise KVStoreError(
        f"sparse.array: expected a RowSparseNDArray, given {type(source_array).__name__}; {hint}"
    )


def retain(data: RowSparseNDArray, indices: Any) -> RowSparseNDArray:
    """The rows ``indices`` of ``data``, as MXNet's ``sparse.retain`` (what
    ``row_sparse_pull`` hands each out).

    As in MXNet, the result stores every id asked for, once and sorted (``indices`` need not
    be sorted or unique), with a zero row for an id that ``data`` does not store; when ``data``
    stores no row, the result stores none. Under a trace (ids unknown) the result stores
    ``data``'s ids instead, with the rows not asked for set to zero: the same dense value.

    Raises:
      KVStoreError: an id is not a row of ``data`` (MXNet does not check; its result would not
        be a valid row-sparse array).

    Examples:
      >>> import jaxkv.nd as nd
      >>> rsp = nd.array([[1, 1], [0, 0], [2, 2], [3, 3]]).tostype('row_sparse')
      >>> kept = nd.sparse.retain(rsp, nd.array([3, 1, 3]))
      >>> kept.indices.asnumpy().tolist(), kept.data.asnumpy().tolist()
      ([1, 3], [[0.0, 0.0], [3.0, 3.0]])
    """
    if not isinstance(data, RowSparseNDArray):
        raise KVStoreError(f"retain: expected a RowSparseNDArray, given {type(data).__name__}")
    wanted = unwrap(indices)
    if is_traced(wanted) or is_traced(data.row_values) or is_traced(data.row_ids):
        asked = jnp.ravel(jnp.asarray(wanted)).astype(_HELD_IDS)
        keep = jnp.isin(data.row_ids, asked)
        mask = keep.reshape(-1, *(1,) * (data.row_values.ndim - 1))
        return data.like(jnp.where(mask, data.row_values, jnp.zeros((), data.row_values.dtype)))
    asked_ids = np.unique(_host_ids(np.ravel(np.asarray(wanted)), "retain"))
    bad = asked_ids[(asked_ids < 0) | (asked_ids >= data.shape[0])]
    if len(bad):
        raise KVStoreError(
            f"retain: expected row ids in [0, {data.shape[0]}) for shape {data.shape}, given "
            f"{bad[:8].tolist()}"
        )
    ids = np.asarray(data.row_ids)
    device = data.jax_device()
    if not len(ids) or not len(asked_ids):
        return _empty(data.shape, device, data.dtype)
    at = np.minimum(np.searchsorted(ids, asked_ids), len(ids) - 1)
    found = ids[at] == asked_ids
    placed = jax.device_put((at.astype(_HELD_IDS), found, asked_ids.astype(_HELD_IDS)), device)
    return data.like(_take_found(data.row_values, placed[0], placed[1]), placed[2])


def add(lhs: Any, rhs: Any) -> Any:
    """``lhs + rhs`` with MXNet's storage types (row-sparse for two row-sparse arrays)."""
    return lhs + rhs


def subtract(lhs: Any, rhs: Any) -> Any:
    """``lhs - rhs`` with MXNet's storage types (row-sparse for two row-sparse arrays)."""
    return lhs - rhs


def multiply(lhs: Any, rhs: Any) -> Any:
    """``lhs * rhs`` with MXNet's storage types (row-sparse times a scalar or an array of the
    same shape is row-sparse)."""
    return lhs * rhs


def divide(lhs: Any, rhs: Any) -> Any:
    """``lhs / rhs`` with MXNet's storage types (row-sparse divided by a scalar is
    row-sparse; by an array, dense)."""
    return lhs / rhs


register_row_sparse(from_dense=from_dense, zeros=zeros, array=array)
