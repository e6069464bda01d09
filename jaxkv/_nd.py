"""``NDArray``: MXNet's mutable array handle over an immutable ``jax.Array``.

An ``NDArray`` holds one ``jax.Array`` on one device. In-place operations (``+=``, ``a[:] = v``)
rebind the handle to a new array, which is how ``kv.pull(key, out=a)`` fills ``a`` and how an
MXNet-style updater (``stored += input * 2``) works inside ``jit``.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jax.typing import ArrayLike

from ._context import Context, current_context
from ._errors import KVStoreError, ShapeError

__all__ = ["NDArray", "array", "empty", "full", "ones", "waitall", "zeros"]

_DEFAULT_DTYPE = np.float32  # MXNet's mx_real_t


def _unwrap(x: Any) -> Any:
    return x._data if isinstance(x, NDArray) else x


def _is_traced(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


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

    __slots__ = ("_data", "_where", "__weakref__")
    __array_priority__ = 1000.0  # numpy defers to our reflected operators

    def __init__(self, data: jax.Array) -> None:
        self._data = data
        self._where: tuple[Any, Any] = (None, None)  # (array, its device), see _device

    def _device(self) -> jax.Device:
        """The device of the held array; cached per array, since pulls ask for it each time."""
        data, device = self._where
        if data is not self._data:
            device = min(self._data.devices(), key=lambda d: d.id)
            self._where = (self._data, device)
        return device

    def _set(self, data: jax.Array, device: jax.Device) -> None:
        """Hold ``data``, known to live on ``device``."""
        self._data = data
        self._where = (data, device)

    # -- properties ------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._data.shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self._data.dtype)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def context(self) -> Context:
        """The context of the device this array lives on."""
        return Context.from_device(self._device())

    ctx = context

    def __len__(self) -> int:
        return self.shape[0]

    # -- conversion --------------------------------------------------------------------------
    def asnumpy(self) -> np.ndarray:
        """A NumPy copy of the value (waits for it)."""
        return np.array(self._data)

    def asjax(self) -> jax.Array:
        """The ``jax.Array`` this handle currently holds."""
        return self._data

    def asscalar(self) -> int | float | complex:
        if self.size != 1:
            raise ShapeError(f"asscalar: expected an array of size 1, given shape {self.shape}")
        return self.asnumpy().reshape(()).item()

    def __array__(self, dtype: npt.DTypeLike | None = None, copy: bool | None = None) -> np.ndarray:
        out = np.asarray(self._data)
        return out.astype(dtype) if dtype is not None else out

    def __jax_array__(self) -> jax.Array:
        return self._data

    def wait_to_read(self) -> None:
        self._data.block_until_ready()

    def astype(self, dtype: npt.DTypeLike, copy: bool = True) -> NDArray:
        return NDArray(self._data.astype(_dtype(dtype)))

    def reshape(self, *shape: Any) -> NDArray:
        """A new array with the same values in another shape (``a.reshape((2, 2))``)."""
        if len(shape) == 1 and not isinstance(shape[0], numbers.Integral):
            shape = tuple(shape[0])
        return NDArray(self._data.reshape(shape))

    def copy(self) -> NDArray:
        return NDArray(jnp.copy(self._data))

    def copyto(self, other: Context | NDArray) -> NDArray:
        """Copy into ``other``: a context (a new array there) or an ``NDArray`` (filled)."""
        if isinstance(other, Context):
            return NDArray(jax.device_put(self._data, other.device, may_alias=False))
        if isinstance(other, NDArray):
            other[:] = self
            return other
        raise KVStoreError(f"copyto: expected a Context or an NDArray, given {type(other)}")

    def as_in_context(self, context: Context) -> NDArray:
        """This array if it is already on ``context``, else a copy there."""
        return self if self.context == context else self.copyto(context)

    # -- indexing ----------------------------------------------------------------------------
    def __getitem__(self, index: Any) -> NDArray:
        return NDArray(self._data[_unwrap(index)])

    def __setitem__(self, index: Any, value: NDArray | ArrayLike) -> None:
        new = jnp.asarray(_unwrap(value), dtype=self._data.dtype)
        if isinstance(index, slice) and index == slice(None):
            if new.shape != self.shape:
                try:
                    new = jnp.broadcast_to(new, self.shape)
                except ValueError:
                    raise ShapeError(
                        f"a[:] = value: expected a value of shape {self.shape} (or one that "
                        f"broadcasts to it), given shape {tuple(new.shape)}"
                    ) from None
            if not (_is_traced(new) or _is_traced(self._data)):
                new = jax.device_put(new, self._data.sharding)
            self._data = new
        else:
            self._data = self._data.at[_unwrap(index)].set(new)

    # -- arithmetic ----------------------------------------------------------------------------
    def _binary(
        self,
        other: NDArray | ArrayLike,
        op: Callable[[Any, Any], jax.Array],
        reflected: bool = False,
    ) -> NDArray:
        a, b = self._data, _unwrap(other)
        return NDArray(op(b, a) if reflected else op(a, b))

    def _inplace(self, other: NDArray | ArrayLike, op: Callable[[Any, Any], jax.Array]) -> NDArray:
        self._data = op(self._data, _unwrap(other)).astype(self._data.dtype)
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
        return NDArray(-self._data)

    def __abs__(self) -> NDArray:
        return NDArray(jnp.abs(self._data))

    def __iadd__(self, o: NDArray | ArrayLike) -> NDArray:
        return self._inplace(o, jnp.add)

    def __isub__(self, o: NDArray | ArrayLike) -> NDArray:
        return self._inplace(o, jnp.subtract)

    def __imul__(self, o: NDArray | ArrayLike) -> NDArray:
        return self._inplace(o, jnp.multiply)

    def __itruediv__(self, o: NDArray | ArrayLike) -> NDArray:
        return self._inplace(o, jnp.true_divide)

    def __repr__(self) -> str:
        if _is_traced(self._data):
            return f"<NDArray {'x'.join(map(str, self.shape))} traced {self._data.aval}>"
        shape = "x".join(str(s) for s in self.shape) or "scalar"
        return f"\n{self.asnumpy()}\n<NDArray {shape} @{self.context}>"


# ---------------------------------------------------------------------------------------------
# Creation, as mxnet.nd does it: float32 by default, on the current context by default.
# ---------------------------------------------------------------------------------------------
def _shape(shape: Any) -> tuple[int, ...]:
    if isinstance(shape, numbers.Integral):
        return (int(shape),)
    return tuple(int(s) for s in shape)


def _ctx(ctx: Context | None) -> Context:
    if ctx is None:
        return current_context()
    if isinstance(ctx, Context):
        return ctx
    raise KVStoreError(f"ctx: expected a jaxkv.Context such as cpu(0), given {ctx!r}")


def _check_kwargs(kwargs: dict) -> None:
    stype = kwargs.pop("stype", "default")
    if kwargs.get("out", 0) is None:
        del kwargs["out"]
    if stype != "default" or kwargs:
        raise KVStoreError(
            f"expected only dense arrays (stype='default'), given stype={stype!r} and "
            f"other arguments {sorted(kwargs)}"
        )


def _dtype(dtype: Any) -> np.dtype:
    """``dtype`` as JAX stores it: 64-bit types become 32-bit unless ``jax_enable_x64``."""
    return jax.dtypes.canonicalize_dtype(np.dtype(dtype or _DEFAULT_DTYPE))


def _fill(
    shape: int | Sequence[int],
    value: ArrayLike,
    ctx: Context | None,
    dtype: npt.DTypeLike | None,
    kwargs: dict[str, Any],
) -> NDArray:
    _check_kwargs(dict(kwargs))
    dtype = _dtype(dtype)
    return NDArray(jnp.full(_shape(shape), value, dtype, device=_ctx(ctx).device))


def zeros(
    shape: int | Sequence[int],
    ctx: Context | None = None,
    dtype: npt.DTypeLike | None = None,
    **kwargs: Any,
) -> NDArray:
    """An array of zeros (float32 unless ``dtype``) on ``ctx`` (default: current context)."""
    return _fill(shape, 0, ctx, dtype, kwargs)


def ones(
    shape: int | Sequence[int],
    ctx: Context | None = None,
    dtype: npt.DTypeLike | None = None,
    **kwargs: Any,
) -> NDArray:
    """An array of ones (float32 unless ``dtype``) on ``ctx`` (default: current context)."""
    return _fill(shape, 1, ctx, dtype, kwargs)


def empty(
    shape: int | Sequence[int],
    ctx: Context | None = None,
    dtype: npt.DTypeLike | None = None,
    **kwargs: Any,
) -> NDArray:
    """An array of the given shape; JAX has no uninitialised memory, so it holds zeros."""
    return _fill(shape, 0, ctx, dtype, kwargs)


def full(
    shape: int | Sequence[int],
    val: ArrayLike,
    ctx: Context | None = None,
    dtype: npt.DTypeLike | None = None,
    **kwargs: Any,
) -> NDArray:
    """An array filled with ``val`` (float32 unless ``dtype``) on ``ctx``."""
    return _fill(shape, val, ctx, dtype, kwargs)


def array(
    source: NDArray | npt.ArrayLike, ctx: Context | None = None, dtype: npt.DTypeLike | None = None
) -> NDArray:
    """An array copied from ``source`` onto ``ctx``.

    As in MXNet, the dtype is ``source.dtype`` for an ``NDArray`` (or ``jax.Array``) and
    float32 for anything else, unless ``dtype`` is given.
    """
    if isinstance(source, NDArray | jax.Array):
        data = _unwrap(source)
        dtype = _dtype(dtype or data.dtype)
    else:
        dtype = _dtype(dtype)
        data = np.asarray(source, dtype=dtype)
    data = jnp.asarray(data, dtype=dtype)
    return NDArray(jax.device_put(data, _ctx(ctx).device, may_alias=False))


def waitall() -> None:
    """Wait until every computation issued so far has finished."""
    jax.block_until_ready(jax.live_arrays())
