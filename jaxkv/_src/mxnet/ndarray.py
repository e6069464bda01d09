"""``NDArray``: MXNet's mutable array handle over an immutable ``jax.Array``.

An ``NDArray`` holds one ``jax.Array`` on one device. In-place operations (``+=``, ``a[:] = v``)
rebind the handle to a new array, which is how ``kv.pull(key, out=a)`` fills ``a`` and how an
MXNet-style updater (``stored += input * 2``) works inside ``jit``.

Dense arrays have MXNet's storage type ``'default'``; ``a.tostype('row_sparse')`` and
``zeros(shape, stype='row_sparse')`` give the row-sparse arrays of :mod:`jaxkv.nd.sparse`.

64-bit integers: JAX runs with 64-bit types off unless ``jax_enable_x64`` is set, so an array
asked for as ``int64`` (MXNet's type for row ids) holds ``int32`` values and still reports
``dtype`` int64 (``asnumpy()`` gives int64 too), as MXNet code expects. Its values are exact
while they fit 32 bits; one that does not is refused when the array is made. Floating types are
not treated so: ``float64`` asked for gives (and reports) ``float32``, since its values would
not be exact.
"""

from __future__ import annotations

import functools
import numbers
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jax.typing import ArrayLike

from jaxkv._src.core import checked
from jaxkv._src.devices import Context, current_context
from jaxkv._src.errors import KVStoreError, ShapeError
from jaxkv._src.jax_internals import per_device

__all__ = ["NDArray", "arange", "array", "empty", "full", "ones", "waitall", "zeros"]

_DEFAULT_DTYPE = np.float32  # MXNet's mx_real_t


# The row-sparse arrays (sparse.py) build on this module, so it never imports them: sparse.py
# registers its constructors here as it is imported (as every import of jaxkv imports it).
_ROW_SPARSE: dict[str, Callable[..., Any]] = {}


def register_row_sparse(
    from_dense: Callable[..., Any], zeros: Callable[..., Any], array: Callable[..., Any]
) -> None:
    """Give ``tostype('row_sparse')``, ``zeros(stype='row_sparse')`` and ``array`` of a
    row-sparse source their constructors (called once, by sparse.py)."""
    _ROW_SPARSE.update(from_dense=from_dense, zeros=zeros, array=array)


def stype_error(where: str, stype: object) -> KVStoreError:
    """The refusal of a storage type jaxkv does not have."""
    return KVStoreError(
        f"{where}: expected stype 'default' or 'row_sparse' (the storage types jaxkv has; "
        f"MXNet's 'csr' is not provided), given stype={stype!r}"
    )


def unwrap(x: Any) -> Any:
    return x.asjax() if isinstance(x, NDArray) else x


def is_traced(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


class Part:
    """One device's copy of an array replicated over several (``whole``, its copy at
    ``position`` of its addressable shards), held by an out of a pull and taken out of it only
    when the out is read: a pull into many outs hands each its part without making a
    single-device array for each. Once taken, ``whole`` is let go. Or the array is the
    ``slot``-th value of a ``placement.Later`` (``later``), made when first read."""

    __slots__ = ("whole", "position", "shape", "dtype", "later", "slot")

    def __init__(
        self,
        whole: jax.Array | None,
        position: int,
        later: Any = None,
        slot: int = 0,
        shape: Any = None,
        dtype: Any = None,
    ) -> None:
        self.whole: jax.Array | None = whole
        self.position = position
        self.later = later
        self.slot = slot
        self.shape = whole.shape if whole is not None else shape
        self.dtype = whole.dtype if whole is not None else dtype

    def take(self) -> jax.Array:
        """This device's copy (once)."""
        whole = self.whole if self.later is None else self.later.values()[self.slot]
        assert whole is not None  # (let go only once taken)
        self.whole = self.later = None
        return per_device(whole)[self.position]


# What an NDArray may hold before it is read: a NumPy array (put on its device when read) or a
# part of a replicated array (taken out when read).
_LAZY = (np.ndarray, Part)


class NDArray:
    """A mutable handle to a ``jax.Array`` on one device, with MXNet's NDArray interface.

    Examples:
      >>> import jaxkv.nd as nd
      >>> a = nd.ones((2, 3)) * 2
      >>> a += 1
      >>> a.asnumpy().tolist()
      [[3.0, 3.0, 3.0], [3.0, 3.0, 3.0]]
      >>> a[:] = 0
      >>> float(a.asnumpy().sum())
      0.0
    """

    __slots__ = ("_value", "owed_by", "_where", "_dtype", "__weakref__")
    __array_priority__ = 1000.0  # numpy defers to our reflected operators

    def __init__(self, data: jax.Array, dtype: npt.DTypeLike | None = None) -> None:
        # (or, until read, a NumPy array or a Part: see lazily and set_part)
        self._value: Any = data
        # The store that owes this array a pulled value (a pull held until something reads,
        # ``held.py``), or ``None``. Reading the value makes that store run what it holds.
        self.owed_by: Any = None
        self._where: tuple[Any, Any] = (None, None)  # (array, its device), see _device
        # The dtype to report when it is not the one held: int64 asked for, int32 held (x64
        # off). It counts only while the held array has that dtype's JAX form (see dtype).
        self._dtype: np.dtype | None = declared_dtype(dtype)

    @classmethod
    def lazily(
        cls, host: np.ndarray, device: jax.Device, dtype: npt.DTypeLike | None = None
    ) -> NDArray:
        """An array of the NumPy array ``host`` (this array's own: nothing else may write it),
        put on ``device`` when first read as a ``jax.Array``: what is made on the host and only
        read there (row ids handed to ``row_sparse_pull``) never goes to the device."""
        out = cls(host, dtype)  # type: ignore[arg-type]
        out._where = (host, device)
        return out

    def _land(self) -> None:
        """Put a value still on the host (:meth:`lazily`) on its device, or take a part
        (:meth:`set_part`) out of its array."""
        value, device = self._value, self._where[1]
        if type(value) is Part:
            self._value = value.take()
        else:
            self._value = jax.device_put(value, device)
        self._where = (self._value, device)

    def host_value(self) -> np.ndarray | None:
        """The value as a NumPy array, where it is still on the host (:meth:`lazily`) and no
        pull is held for it; else ``None``. Not to be written."""
        if type(self._value) is np.ndarray and self.owed_by is None:
            return self._value
        return None

    @property
    def _data(self) -> jax.Array:
        """The held array, once any pull held for it has run (see ``owed_by``)."""
        if self.owed_by is not None:
            self.owed_by.run_held()
        if type(self._value) in _LAZY:
            self._land()
        return self._value

    @_data.setter
    def _data(self, value: jax.Array) -> None:
        if self.owed_by is not None:  # a write after a held pull lands after it
            self.owed_by.run_held()
        self._value = value

    def held_value(self) -> Any:
        """The value held, once any pull held for it has run, as it is held: a ``jax.Array``,
        or not yet read, a NumPy array (:meth:`lazily`) or a ``Part`` (each with the shape
        and dtype of the array it becomes)."""
        if self.owed_by is not None:
            self.owed_by.run_held()
        return self._value

    def jax_device(self) -> jax.Device:
        """The device of the held array; cached per array, since pulls ask for it each time.
        A pull held for this array lands on the same device, so it need not run first."""
        data, device = self._where
        if data is not self._value:
            device = min(self._value.devices(), key=lambda d: d.id)
            self._where = (self._value, device)
        return device

    def set_value(self, data: jax.Array, device: jax.Device) -> None:
        """Hold ``data``, known to live on ``device``."""
        self._value = data
        self.owed_by = None
        self._where = (data, device)

    def set_part(self, whole: jax.Array, position: int, device: jax.Device) -> None:
        """Hold the copy of the replicated array ``whole`` at ``position`` of its addressable
        shards, known to live on ``device``: taken out of it when read (``Part``)."""
        part = Part(whole, position)
        self._value = part
        self.owed_by = None
        self._where = (part, device)

    def set_later(
        self, later: Any, slot: int, position: int, device: jax.Device, shape: Any, dtype: Any
    ) -> None:
        """Hold this device's copy (``position``) of the ``slot``-th value of ``later`` (a
        ``placement.Later``, of ``shape`` and ``dtype``), made when first read."""
        part = Part(None, position, later, slot, shape, dtype)
        self._value = part
        self.owed_by = None
        self._where = (part, device)

    # -- properties ------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._value.shape)  # a held pull keeps it: no need to run it

    @property
    def dtype(self) -> np.dtype:
        """The dtype as MXNet reports it (``int64`` for an array asked for as ``int64``)."""
        held = np.dtype(self._value.dtype)  # a held pull keeps it too
        declared = self._dtype
        return declared if declared is not None and held_dtype(declared) == held else held

    @property
    def stype(self) -> str:
        """MXNet's storage type, ``'default'`` (dense) for an ``NDArray``."""
        return "default"

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def context(self) -> Context:
        """The context of the device this array lives on."""
        return Context.from_device(self.jax_device())

    ctx = context

    def __len__(self) -> int:
        return self.shape[0]

    # -- conversion --------------------------------------------------------------------------
    def asnumpy(self) -> np.ndarray:
        """A NumPy copy of the value (waits for it), in :attr:`dtype`."""
        host = self.host_value()
        out = np.array(self._data if host is None else host)
        checked.settle(wait=True)  # a wrong sum raises at the read, as a host callback would
        dtype = self.dtype
        return out if out.dtype == dtype else out.astype(dtype)

    def asjax(self) -> jax.Array:
        """The ``jax.Array`` this handle currently holds."""
        return self._data

    def asscalar(self) -> int | float | complex:
        if self.size != 1:
            raise ShapeError(f"asscalar: expected an array of size 1, given shape {self.shape}")
        return self.asnumpy().reshape(()).item()

    def __array__(self, dtype: npt.DTypeLike | None = None, copy: bool | None = None) -> np.ndarray:
        out = np.asarray(self._data)
        checked.settle(wait=True)
        dtype = self.dtype if dtype is None else np.dtype(dtype)
        return out if out.dtype == dtype else out.astype(dtype)

    def __jax_array__(self) -> jax.Array:
        return self._data

    def wait_to_read(self) -> None:
        if self.host_value() is None:  # (a value still on the host is ready: not put)
            self._data.block_until_ready()
        checked.settle(wait=True)

    def astype(self, dtype: npt.DTypeLike, copy: bool = True) -> NDArray:
        return NDArray(self._data.astype(held_dtype(dtype)), dtype)

    def reshape(self, *shape: Any) -> NDArray:
        """A new array with the same values in another shape (``a.reshape((2, 2))``)."""
        if len(shape) == 1 and not isinstance(shape[0], numbers.Integral):
            shape = tuple(shape[0])
        return NDArray(self._data.reshape(shape), self._dtype)

    def copy(self) -> NDArray:
        return NDArray(jnp.copy(self._data), self._dtype)

    def tostype(self, stype: str) -> NDArray:
        """A copy in storage type ``stype``: ``'default'`` (dense) or ``'row_sparse'``.

        The row-sparse copy keeps the rows that hold a non-zero value, as MXNet's
        ``cast_storage`` does; under ``jit`` (where that set is not known) it keeps every row.

        Raises:
          KVStoreError: ``stype`` is neither (jaxkv has no ``'csr'``).

        Examples:
          >>> import jaxkv.nd as nd
          >>> rsp = nd.array([[0, 0], [1, 2], [0, 0]]).tostype('row_sparse')
          >>> rsp.indices.asnumpy().tolist(), rsp.data.asnumpy().tolist()
          ([1], [[1.0, 2.0]])
        """
        if stype == "default":
            return self.copy()
        if stype == "row_sparse":
            return _ROW_SPARSE["from_dense"](self._data, self._dtype)
        raise stype_error("tostype", stype)

    def copyto(self, other: Context | NDArray) -> NDArray:
        """Copy into ``other``: a context (a new array there) or an ``NDArray`` (filled)."""
        if isinstance(other, Context):
            moved = jax.device_put(self._data, other.device, may_alias=False)
            return NDArray(moved, self._dtype)
        if isinstance(other, NDArray):
            other[:] = self
            return other
        raise KVStoreError(f"copyto: expected a Context or an NDArray, given {type(other)}")

    def as_in_context(self, context: Context) -> NDArray:
        """This array if it is already on ``context``, else a copy there."""
        return self if self.context == context else self.copyto(context)

    # -- indexing ----------------------------------------------------------------------------
    def __getitem__(self, index: Any) -> NDArray:
        """``a[index]``, as MXNet 1.9's NDArray gives it: an element comes as shape ``(1,)``,
        not a 0-d array (``nd.array([1, 2, 3])[1].shape == (1,)``, as ``ones((2, 3))[1, 2]``)."""
        out = self._data[unwrap(index)]
        if out.ndim == 0:
            out = out.reshape(1)
        return NDArray(out, self._dtype)

    def __setitem__(self, index: Any, value: NDArray | ArrayLike) -> None:
        new = jnp.asarray(unwrap(value), dtype=self._data.dtype)
        if isinstance(index, slice) and index == slice(None):
            if new.shape != self.shape:
                try:
                    new = jnp.broadcast_to(new, self.shape)
                except ValueError:
                    raise ShapeError(
                        f"a[:] = value: expected a value of shape {self.shape} (or one that "
                        f"broadcasts to it), given shape {tuple(new.shape)}"
                    ) from None
            if not (is_traced(new) or is_traced(self._data)):
                new = jax.device_put(new, self._data.sharding)
            self._data = new
        else:
            self._data = self._data.at[unwrap(index)].set(new)

    # -- arithmetic ----------------------------------------------------------------------------
    def _binary(
        self,
        other: NDArray | ArrayLike,
        op: Callable[[Any, Any], jax.Array],
        reflected: bool = False,
    ) -> NDArray:
        a, b = self._data, unwrap(other)
        return NDArray(op(b, a) if reflected else op(a, b), self._dtype)

    def _inplace(self, other: NDArray | ArrayLike, op: Callable[[Any, Any], jax.Array]) -> NDArray:
        self._data = op(self._data, unwrap(other)).astype(self._data.dtype)
        return self

    def __add__(self, o: NDArray | ArrayLike) -> NDArray:
        return self._binary(o, jnp.add)

    def __radd__(self, o: NDArray | ArrayLike) -> NDArray:
        return self._binary(o, jnp.add, True)

    def __sub__(self, o: NDArray | ArrayLike) -> NDArray:
        return self._binary(o, jnp.subtract)

    def __rsub__(self, o: NDArray | ArrayLike) -> NDArray:
        return self._binary(o, jnp.subtract, True)

    def __mul__(self, o: NDArray | ArrayLike) -> NDArray:
        return self._binary(o, jnp.multiply)

    def __rmul__(self, o: NDArray | ArrayLike) -> NDArray:
        return self._binary(o, jnp.multiply, True)

    def __truediv__(self, o: NDArray | ArrayLike) -> NDArray:
        return self._binary(o, jnp.true_divide)

    def __rtruediv__(self, o: NDArray | ArrayLike) -> NDArray:
        return self._binary(o, jnp.true_divide, True)

    def __pow__(self, o: NDArray | ArrayLike) -> NDArray:
        return self._binary(o, jnp.power)

    def __neg__(self) -> NDArray:
        return NDArray(-self._data, self._dtype)  # (int64 stays int64, as a * -1 does)

    def __abs__(self) -> NDArray:
        return NDArray(jnp.abs(self._data), self._dtype)

    def __iadd__(self, o: NDArray | ArrayLike) -> NDArray:
        return self._inplace(o, jnp.add)

    def __isub__(self, o: NDArray | ArrayLike) -> NDArray:
        return self._inplace(o, jnp.subtract)

    def __imul__(self, o: NDArray | ArrayLike) -> NDArray:
        return self._inplace(o, jnp.multiply)

    def __itruediv__(self, o: NDArray | ArrayLike) -> NDArray:
        return self._inplace(o, jnp.true_divide)

    def __repr__(self) -> str:
        if is_traced(self._data):
            return f"<NDArray {'x'.join(map(str, self.shape))} traced {self._data.aval}>"
        shape = "x".join(str(s) for s in self.shape) or "scalar"
        return f"\n{self.asnumpy()}\n<NDArray {shape} @{self.context}>"


# ---------------------------------------------------------------------------------------------
# Creation, as mxnet.nd does it: float32 by default, on the current context by default.
# ---------------------------------------------------------------------------------------------
def as_shape(shape: Any) -> tuple[int, ...]:
    if isinstance(shape, numbers.Integral):
        return (int(shape),)
    return tuple(int(s) for s in shape)


def as_context(ctx: Context | None) -> Context:
    if ctx is None:
        return current_context()
    if isinstance(ctx, Context):
        return ctx
    raise KVStoreError(f"ctx: expected a jaxkv.Context such as cpu(0), given {ctx!r}")


def _check_kwargs(where: str, kwargs: dict[str, Any], hint: str = "") -> None:
    """Refuse arguments MXNet's creator would refuse: only ``stype='default'``, ``out=None``."""
    kwargs = dict(kwargs)
    stype = kwargs.pop("stype", "default")
    if kwargs.get("out", 0) is None:
        del kwargs["out"]
    if stype not in (None, "default") or kwargs:
        raise KVStoreError(
            f"{where}: expected only dense arrays (stype='default'), given stype={stype!r} "
            f"and other arguments {sorted(kwargs)}{hint}"
        )


def held_dtype(dtype: Any) -> np.dtype:
    """``dtype`` as JAX stores it: 64-bit types become 32-bit unless ``jax_enable_x64``."""
    return jax.dtypes.canonicalize_dtype(np.dtype(dtype or _DEFAULT_DTYPE))


def declared_dtype(dtype: Any) -> np.dtype | None:
    """The dtype an array reports over the one it holds: a 64-bit integer type with x64 off
    (``int64`` reported, ``int32`` held, exact while the values fit). ``None``: report the
    held dtype (floats are not declared: their held values would not be exact)."""
    if dtype is None:
        return None
    wanted = np.dtype(dtype)
    return wanted if wanted.kind in "iu" and held_dtype(wanted) != wanted else None


def host_values(source: Any, wanted: np.dtype, held: np.dtype) -> np.ndarray:
    """``source`` as a NumPy array of the dtype JAX holds, refusing 64-bit integers that do
    not fit the 32-bit type that holds them."""
    values = np.asarray(source, dtype=wanted)
    if wanted != held and wanted.kind in "iu" and values.size:
        info = np.iinfo(held)
        low, high = values.min(), values.max()
        if low < info.min or high > info.max:
            raise KVStoreError(
                f"dtype {wanted.name}: JAX holds it as {held.name} (64-bit types are off), "
                f"expected values in [{info.min}, {info.max}], given values in [{low}, {high}]; "
                f"set jax.config.update('jax_enable_x64', True) for 64-bit values"
            )
    return values.astype(held)


def _fill(
    shape: int | Sequence[int],
    value: ArrayLike,
    ctx: Context | None,
    dtype: npt.DTypeLike | None,
) -> NDArray:
    wanted = np.dtype(dtype or _DEFAULT_DTYPE)
    held = held_dtype(wanted)
    if isinstance(value, numbers.Real):
        value = host_values(value, wanted, held)
    return NDArray(jnp.full(as_shape(shape), value, held, device=as_context(ctx).device), wanted)


def zeros(
    shape: int | Sequence[int],
    ctx: Context | None = None,
    dtype: npt.DTypeLike | None = None,
    stype: str | None = None,
    **kwargs: Any,
) -> NDArray:
    """An array of zeros (float32 unless ``dtype``) on ``ctx`` (default: current context).

    ``stype='row_sparse'`` gives an empty :class:`jaxkv.nd.sparse.RowSparseNDArray` (no rows
    stored), as in MXNet.

    Examples:
      >>> import jaxkv.nd as nd
      >>> nd.zeros((2, 3), stype='row_sparse')
      <BLANKLINE>
      <RowSparseNDArray 2x3 @cpu(0)>
    """
    if stype not in (None, "default"):
        if stype != "row_sparse":
            raise stype_error("zeros", stype)
        _check_kwargs("zeros", kwargs)
        return _ROW_SPARSE["zeros"]("row_sparse", shape, ctx, dtype)
    _check_kwargs("zeros", kwargs)
    return _fill(shape, 0, ctx, dtype)


def ones(
    shape: int | Sequence[int],
    ctx: Context | None = None,
    dtype: npt.DTypeLike | None = None,
    **kwargs: Any,
) -> NDArray:
    """An array of ones (float32 unless ``dtype``) on ``ctx`` (default: current context).

    Dense only, as MXNet's ``ones``: for a row-sparse array of ones, use
    ``ones(shape).tostype('row_sparse')``.
    """
    _check_kwargs("ones", kwargs, _DENSE_ONLY.format("ones(shape)"))
    return _fill(shape, 1, ctx, dtype)


def empty(
    shape: int | Sequence[int],
    ctx: Context | None = None,
    dtype: npt.DTypeLike | None = None,
    stype: str | None = None,
    **kwargs: Any,
) -> NDArray:
    """An array of the given shape; JAX has no uninitialised memory, so it holds zeros.

    ``stype='row_sparse'`` gives an empty row-sparse array, as :func:`zeros` does.
    """
    if stype not in (None, "default"):
        return zeros(shape, ctx, dtype, stype, **kwargs)
    _check_kwargs("empty", kwargs)
    return _fill(shape, 0, ctx, dtype)


def full(
    shape: int | Sequence[int],
    val: ArrayLike,
    ctx: Context | None = None,
    dtype: npt.DTypeLike | None = None,
    **kwargs: Any,
) -> NDArray:
    """An array filled with ``val`` (float32 unless ``dtype``) on ``ctx``; dense only."""
    _check_kwargs("full", kwargs, _DENSE_ONLY.format("full(shape, val)"))
    return _fill(shape, val, ctx, dtype)


_DENSE_ONLY = (
    "; MXNet's {0} makes dense arrays only: for a row-sparse one use {0}.tostype('row_sparse')"
)


def array(
    source: NDArray | npt.ArrayLike, ctx: Context | None = None, dtype: npt.DTypeLike | None = None
) -> NDArray:
    """An array copied from ``source`` onto ``ctx``.

    As in MXNet, the dtype is ``source.dtype`` for an ``NDArray`` (or ``jax.Array``) and
    float32 for anything else, unless ``dtype`` is given; a row-sparse ``source`` gives a
    row-sparse copy. ``dtype='int64'`` gives an array that reports int64 (see the module's
    note on 64-bit integers).

    Examples:
      >>> import jaxkv.nd as nd
      >>> ids = nd.array([3, 1], dtype='int64')
      >>> ids.dtype, ids.asnumpy().tolist()
      (dtype('int64'), [3, 1])
    """
    if getattr(source, "stype", "default") == "row_sparse":
        return _ROW_SPARSE["array"](source, ctx, dtype)
    if isinstance(source, NDArray | jax.Array):
        wanted = np.dtype(dtype or source.dtype)
        held = held_dtype(wanted)
        data: jax.Array | np.ndarray = jnp.asarray(unwrap(source), dtype=held)
    else:
        wanted = np.dtype(dtype or _DEFAULT_DTYPE)
        held = held_dtype(wanted)
        # Straight from the host (jnp.asarray of a NumPy array compiles once per shape), and
        # put on the device when first read there (host_values made a copy of its own).
        return NDArray.lazily(host_values(source, wanted, held), as_context(ctx).device, wanted)
    return NDArray(jax.device_put(data, as_context(ctx).device, may_alias=False), wanted)


def arange(
    start: float,
    stop: float | None = None,
    step: float = 1.0,
    repeat: int = 1,
    infer_range: bool | None = None,
    ctx: Context | None = None,
    dtype: npt.DTypeLike = _DEFAULT_DTYPE,
) -> NDArray:
    """Evenly spaced values in ``[start, stop)`` (``[0, start)`` without ``stop``), each
    repeated ``repeat`` times, as MXNet's ``arange`` (float32 unless ``dtype``).

    Examples:
      >>> import jaxkv.nd as nd
      >>> nd.arange(0, 3, dtype='int64').asnumpy().tolist()
      [0, 1, 2]
      >>> nd.arange(2, repeat=2).asnumpy().tolist()
      [0.0, 0.0, 1.0, 1.0]
    """
    if stop is None:
        start, stop = 0, start
    values = np.repeat(np.arange(start, stop, step), int(repeat))
    return array(values, ctx, dtype)


def waitall() -> None:
    """Wait until every computation issued so far has finished (a store's held calls run
    first). A computation that failed raises its error here once, as MXNet's engine rethrows
    it at one ``waitall`` and clears it: a later ``waitall`` does not raise it again, though
    its arrays are still alive (held by the caught error's traceback, say)."""
    from jaxkv._src.mxnet import held  # (the stores import this module)

    held.run_everything_held()
    arrays = jax.live_arrays()
    try:
        jax.block_until_ready(arrays)
    except Exception:  # (JAX's runtime error: some array's computation failed)
        _raise_once(arrays)
    checked.settle(wait=True)


# The failed arrays a waitall has raised the error of, by id (a weak reference each: JAX's
# arrays are unhashable).
_raised: dict[int, Any] = {}


def _raise_once(arrays: list[jax.Array]) -> None:
    """Wait for each of ``arrays``; raise the first error no waitall has raised yet, having
    marked every failed one as raised."""
    first = None
    for a in arrays:
        try:
            a.block_until_ready()
        except Exception as e:
            seen = _raised.get(id(a))
            if seen is not None and seen() is a:
                continue
            _raised[id(a)] = weakref.ref(a, functools.partial(_forget, id(a)))
            first = first or e
    if first is not None:
        raise first


def _forget(key: int, _: Any) -> None:
    _raised.pop(key, None)
