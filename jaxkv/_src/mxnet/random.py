"""Random NDArrays as MXNet 1.9.1 draws them (``uniform``, ``normal``, ...) and ``seed``.

Each device has its own generator, as in MXNet: a ``jax.random`` key made from the seed, the
kind of device and its index among this process's devices, and a counter kept on the host that
every draw on that device folds in and advances. So after ``seed(s)`` the same calls give the
same numbers (in every process of a job alike), and a draw on one device leaves the others'
streams as they were. ``seed(s, ctx)`` seeds one device's generator only, with a stream that
does not depend on its index (``cpu(1)`` seeded so draws what ``cpu(0)`` seeded so draws). The
numbers are not MXNet's (its generators are its own); their shapes, dtypes, devices and
distributions are. Before any ``seed`` call the streams are those of ``seed(0)``.

Shapes are MXNet's: an int ``n`` is ``(n,)``, a draw with neither ``shape`` nor ``out`` has
shape ``(1,)`` (``random_uniform``/``random_normal``, MXNet's operators, need one of them), and
a dimension of 0 is refused, as MXNet 1.x refuses it. Distribution parameters given as NDArrays
draw ``shape`` samples for each element: the result has shape ``low.shape + shape``, on
``low``'s device. Under ``jit`` a draw is made once, when the function is traced.
"""

from __future__ import annotations

import functools
import numbers
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import numpy.typing as npt

from jaxkv._src.devices import Context
from jaxkv._src.errors import KVStoreError
from jaxkv._src.mxnet.ndarray import NDArray, as_context, held_dtype

__all__ = [
    "RandomArgumentError",
    "RandomAssertionError",
    "normal",
    "randint",
    "randn",
    "random_normal",
    "random_uniform",
    "seed",
    "shuffle",
    "uniform",
]

# The dtypes MXNet's samplers give, the default first.
_FLOATS = ("float32", "float16", "float64")
_INTS = ("int32", "int64")  # randint's
_KINDS = {"cpu": 1, "gpu": 2}  # a device's kind, folded into its key


class RandomArgumentError(KVStoreError, ValueError):
    """An argument of a draw or of :func:`jaxkv.nd.random.seed` that MXNet refuses (a shape,
    dtype, bound, device or seed); caught as ``mx.MXNetError`` or as ``ValueError``."""


class RandomAssertionError(KVStoreError, AssertionError):
    """Distribution parameters of mixed kinds (an NDArray and a number), or ``shuffle`` of
    something that is not an NDArray: MXNet asserts these, so this is also an
    ``AssertionError``."""


# ---------------------------------------------------------------------------------------------
# The generators: per device, a (seed, index) pair and a counter, all on the host.
# ---------------------------------------------------------------------------------------------
class _Generators:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seed = 0  # seed(s) with ctx='all'
        self.seeded: dict[jax.Device, int] = {}  # devices seeded alone: their seed
        self.counters: dict[jax.Device, int] = {}

    def reseed(self, seed_word: int, device: jax.Device | None) -> None:
        with self.lock:
            if device is None:
                self.seed = seed_word
                self.seeded.clear()
                self.counters.clear()
            else:
                self.seeded[device] = seed_word
                self.counters[device] = 0

    def next_words(self, device: jax.Device) -> np.ndarray:
        """The words of ``device``'s next key: seed, kind, index and counter (advanced)."""
        ctx = Context.from_device(device)
        with self.lock:
            alone = device in self.seeded
            seed_word = self.seeded[device] if alone else self.seed
            count = self.counters.get(device, 0)
            self.counters[device] = count + 1
        index = 0 if alone else ctx.device_id
        kind = _KINDS.get(ctx.device_type, 0)
        return np.array([seed_word, kind, index, count & 0xFFFFFFFF], np.uint32)


_GENERATORS = _Generators()


def seed(seed_state: int, ctx: Context | str = "all") -> None:
    """Seed the generators: every device's (``ctx='all'``) or one device's.

    As in MXNet, ``seed_state`` is an int taken modulo 2**32 (``seed(2**32 + 7)`` is
    ``seed(7)``), and after ``seed(s)`` the same draws give the same numbers. With ``ctx='all'``
    each device draws its own stream (``cpu(0)`` and ``cpu(1)`` differ); a device seeded alone
    draws a stream that does not depend on its index.

    Args:
      seed_state: the seed, an ``int`` (NumPy integers too).
      ctx: ``'all'``, a :class:`jaxkv.Context`, or a device type (``'cpu'`` is ``cpu(0)``).

    Raises:
      RandomArgumentError: ``seed_state`` is not an int, or ``ctx`` names no device.

    Examples:
      >>> import jaxkv.mx as mx
      >>> mx.random.seed(128)
      >>> a = mx.nd.random.uniform(shape=(2, 2)).asnumpy()
      >>> mx.random.seed(128)
      >>> bool((mx.nd.random.uniform(shape=(2, 2)).asnumpy() == a).all())
      True
    """
    if not isinstance(seed_state, numbers.Integral):
        raise RandomArgumentError(
            f"seed: expected seed_state an int, given {type(seed_state).__name__} {seed_state!r}"
        )
    if isinstance(ctx, str) and ctx == "all":
        _GENERATORS.reseed(int(seed_state) & 0xFFFFFFFF, None)
        return
    if not isinstance(ctx, Context | str):
        raise RandomArgumentError(
            f"seed: expected ctx 'all', a Context or a device type such as 'cpu', given {ctx!r}"
        )
    _GENERATORS.reseed(int(seed_state) & 0xFFFFFFFF, Context(ctx).device)


# ---------------------------------------------------------------------------------------------
# The draws: one jitted computation per distribution, shape and dtype.
# ---------------------------------------------------------------------------------------------
def _key(words: jax.Array) -> jax.Array:
    key = jax.random.wrap_key_data(words[:2], impl="threefry2x32")  # (seed, kind)
    return jax.random.fold_in(jax.random.fold_in(key, words[2]), words[3])  # index, counter


def _per_sample(param: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """A parameter broadcast against samples of ``shape`` (its own shape leads)."""
    return param.astype(dtype).reshape(param.shape + (1,) * (len(shape) - param.ndim))


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _uniform(words: jax.Array, low: jax.Array, high: jax.Array, shape: Any, dtype: Any) -> Any:
    low, high = _per_sample(low, shape, dtype), _per_sample(high, shape, dtype)
    return low + (high - low) * jax.random.uniform(_key(words), shape, dtype)


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _normal(words: jax.Array, loc: jax.Array, scale: jax.Array, shape: Any, dtype: Any) -> Any:
    loc, scale = _per_sample(loc, shape, dtype), _per_sample(scale, shape, dtype)
    return loc + scale * jax.random.normal(_key(words), shape, dtype)


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _randint(words: jax.Array, low: jax.Array, high: jax.Array, shape: Any, dtype: Any) -> Any:
    return jax.random.randint(_key(words), shape, low, high, dtype)


@jax.jit
def _shuffle(words: jax.Array, data: jax.Array) -> jax.Array:
    return jax.random.permutation(_key(words), data, axis=0, independent=False)


# ---------------------------------------------------------------------------------------------
# Checking arguments as MXNet does.
# ---------------------------------------------------------------------------------------------
def _is_number(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool | np.bool_)


def _shape(where: str, shape: Any) -> tuple[int, ...]:
    dims = (shape,) if isinstance(shape, numbers.Integral) else shape
    try:
        ok = isinstance(dims, tuple | list) and len(dims) > 0
        ok = ok and all(isinstance(d, numbers.Integral) and not isinstance(d, bool) for d in dims)
        ok = ok and all(int(d) > 0 for d in dims)
    except TypeError:
        ok = False
    if not ok:
        raise RandomArgumentError(
            f"{where}: expected shape an int or a tuple of ints, each at least 1 (MXNet 1.x "
            f"draws no empty array), given shape={shape!r}"
        )
    return tuple(int(d) for d in dims)


def _dtype(where: str, dtype: Any, allowed: tuple[str, ...], out: NDArray | None) -> np.dtype:
    """The dtype asked for: ``dtype``, else ``out``'s, else the first of ``allowed``."""
    if dtype is None:
        wanted = out.dtype if out is not None else np.dtype(allowed[0])
    else:
        try:
            wanted = np.dtype(dtype)
        except TypeError:
            wanted = None
    if wanted is None or wanted.name not in allowed:
        raise RandomArgumentError(
            f"{where}: expected dtype one of {list(allowed)}, given dtype={dtype!r}"
            + ("" if dtype is not None or out is None else f" (out's dtype {out.dtype})")
        )
    if out is not None and held_dtype(out.dtype) != held_dtype(wanted):
        raise RandomArgumentError(
            f"{where}: expected out of dtype {wanted.name} (the dtype asked for), given out of "
            f"dtype {out.dtype}"
        )
    return wanted


def _out(where: str, out: Any) -> NDArray | None:
    if out is None:
        return None
    if not isinstance(out, NDArray) or out.stype != "default":
        raise RandomArgumentError(
            f"{where}: expected out a dense NDArray, given {type(out).__name__} "
            f"(stype {getattr(out, 'stype', None)!r})"
        )
    return out


def _no_more(where: str, kwargs: dict[str, Any]) -> None:
    kwargs = {k: v for k, v in kwargs.items() if k != "name"}  # MXNet's op name: ignored
    if kwargs:
        raise RandomArgumentError(
            f"{where}: expected no arguments but low/high, loc/scale, shape, dtype, ctx, out and "
            f"name, given {sorted(kwargs)}"
        )


def _sample_shape(where: str, shape: Any, out: NDArray | None, lead: tuple[int, ...]) -> Any:
    """The samples' shape (each parameter's, under NDArray parameters): ``shape``, else what
    ``out`` leaves after the parameters' shape ``lead``, else ``(1,)`` (``()`` under NDArray
    parameters)."""
    if shape is not None:
        return _shape(where, shape)
    if out is not None:
        return out.shape[len(lead) :]
    return () if lead else (1,)


def _draw(
    where: str,
    kernel: Callable[..., jax.Array],
    params: tuple[Any, Any],
    shape: Any,
    dtype: np.dtype,
    ctx: Context | None,
    out: NDArray | None,
) -> NDArray:
    """Draw with ``kernel`` on the device of the first NDArray parameter, else ``out``'s, else
    ``ctx``'s, and return the new array (or ``out``, filled)."""
    first, second = params
    if isinstance(first, NDArray):
        device = first.jax_device()
        lead = first.shape
        if second.shape != lead:
            raise RandomArgumentError(
                f"{where}: expected distribution parameters of one shape, given shapes "
                f"{first.shape} and {second.shape}"
            )
        a, b = first.asjax(), jax.device_put(second.asjax(), device)
    else:
        device = out.jax_device() if out is not None else as_context(ctx).device
        lead = ()
        a = jax.device_put(np.asarray(first, held_dtype(dtype)), device)
        b = jax.device_put(np.asarray(second, held_dtype(dtype)), device)
    samples = _sample_shape(where, shape, out, lead)
    full = lead + samples
    if out is not None and out.shape != full:
        raise RandomArgumentError(
            f"{where}: expected out of shape {full} (the parameters' shape and shape), given "
            f"out of shape {out.shape}"
        )
    words = jax.device_put(_GENERATORS.next_words(device), device)
    data = kernel(words, a, b, shape=full, dtype=held_dtype(dtype))
    if out is None:
        return NDArray(data, dtype)
    out[:] = data
    return out


def _params(where: str, names: tuple[str, str], first: Any, second: Any) -> tuple[Any, Any]:
    """Both parameters NDArrays (dense) or both numbers, as MXNet's ``_random_helper`` wants."""
    if isinstance(first, NDArray):
        if not isinstance(second, NDArray):
            raise RandomAssertionError(
                f"{where}: expected {names[0]} and {names[1]} of one kind (NDArrays or numbers), "
                f"given {type(first).__name__} and {type(second).__name__}"
            )
        for name, p in zip(names, (first, second), strict=True):
            if p.stype != "default":
                raise RandomArgumentError(
                    f"{where}: expected {name} a dense NDArray, given stype {p.stype!r}"
                )
        return first, second
    if not _is_number(first):
        raise RandomArgumentError(
            f"{where}: expected {names[0]} a number or an NDArray, given "
            f"{type(first).__name__} {first!r}"
        )
    if not _is_number(second):
        kind = RandomAssertionError if isinstance(second, NDArray) else RandomArgumentError
        raise kind(
            f"{where}: expected {names[1]} a number like {names[0]}, given "
            f"{type(second).__name__} {second!r}"
        )
    return first, second


# ---------------------------------------------------------------------------------------------
# MXNet's nd.random functions.
# ---------------------------------------------------------------------------------------------
def uniform(
    low: float | NDArray = 0,
    high: float | NDArray = 1,
    shape: int | tuple[int, ...] | None = None,
    dtype: npt.DTypeLike | None = None,
    ctx: Context | None = None,
    out: NDArray | None = None,
    **kwargs: Any,
) -> NDArray:
    """Samples from the uniform distribution on ``[low, high)`` (MXNet's ``nd.random.uniform``).

    Args:
      low: the lower bound, a number or an NDArray (then ``shape`` samples per element).
      high: the upper bound, of the same kind; at least ``low`` when numbers.
      shape: an int ``n`` (shape ``(n,)``) or a tuple; default ``out``'s shape, else ``(1,)``.
      dtype: ``'float16'``, ``'float32'`` or ``'float64'``; default ``out``'s, else float32.
      ctx: the device (default: the current context); ``low``'s or ``out``'s device wins.
      out: a dense NDArray to fill (and return).

    Raises:
      RandomArgumentError: a shape, dtype, bound, ``out`` or argument MXNet refuses.
      RandomAssertionError: ``low`` and ``high`` of different kinds.

    Examples:
      >>> import jaxkv.mx as mx
      >>> a = mx.nd.random.uniform(-1, 1, shape=(2, 3), ctx=mx.cpu(1))
      >>> a.shape, a.dtype, a.context
      ((2, 3), dtype('float32'), cpu(1))
      >>> bool(((a.asnumpy() >= -1) & (a.asnumpy() < 1)).all())
      True
      >>> mx.nd.random.uniform(mx.nd.array([0, 10]), mx.nd.array([1, 11]), shape=3).shape
      (2, 3)
    """
    where = "uniform"
    _no_more(where, kwargs)
    low, high = _params(where, ("low", "high"), low, high)
    out = _out(where, out)
    wanted = _dtype(where, dtype, _FLOATS, out)
    if _is_number(low) and low > high:  # type: ignore[operator]
        raise RandomArgumentError(f"{where}: expected low <= high, given low={low}, high={high}")
    return _draw(where, _uniform, (low, high), shape, wanted, ctx, out)


def normal(
    loc: float | NDArray = 0,
    scale: float | NDArray = 1,
    shape: int | tuple[int, ...] | None = None,
    dtype: npt.DTypeLike | None = None,
    ctx: Context | None = None,
    out: NDArray | None = None,
    **kwargs: Any,
) -> NDArray:
    """Samples from the normal distribution of mean ``loc`` and standard deviation ``scale``
    (MXNet's ``nd.random.normal``); arguments as :func:`jaxkv.nd.random.uniform`'s,
    ``scale`` > 0 for numbers.

    Examples:
      >>> import jaxkv.mx as mx
      >>> a = mx.nd.random.normal(5, 2, shape=(100000,))
      >>> a.shape, a.dtype
      ((100000,), dtype('float32'))
      >>> bool(abs(a.asnumpy().mean() - 5) < 0.05), bool(abs(a.asnumpy().std() - 2) < 0.05)
      (True, True)
    """
    where = "normal"
    _no_more(where, kwargs)
    loc, scale = _params(where, ("loc", "scale"), loc, scale)
    out = _out(where, out)
    wanted = _dtype(where, dtype, _FLOATS, out)
    if _is_number(scale) and not scale > 0:  # type: ignore[operator]
        raise RandomArgumentError(f"{where}: expected scale > 0, given scale={scale}")
    return _draw(where, _normal, (loc, scale), shape, wanted, ctx, out)


def randint(
    low: int,
    high: int,
    shape: int | tuple[int, ...] | None = None,
    dtype: npt.DTypeLike | None = None,
    ctx: Context | None = None,
    out: NDArray | None = None,
    **kwargs: Any,
) -> NDArray:
    """Integers drawn uniformly from ``[low, high)`` (MXNet's ``nd.random.randint``): int32
    unless ``dtype='int64'`` (or ``out``'s dtype); ``low`` and ``high`` are ints, ``low < high``.

    An int64 result holds int32 values unless ``jax_enable_x64`` is set (see
    :mod:`jaxkv.nd`'s note on 64-bit integers), so its bounds must fit 32 bits then.

    Examples:
      >>> import jaxkv.mx as mx
      >>> a = mx.nd.random.randint(-10, 10, shape=(2, 5), dtype='int64')
      >>> a.dtype, bool(((a.asnumpy() >= -10) & (a.asnumpy() < 10)).all())
      (dtype('int64'), True)
    """
    where = "randint"
    _no_more(where, kwargs)
    for name, bound in (("low", low), ("high", high)):
        if not isinstance(bound, numbers.Integral) or isinstance(bound, bool | np.bool_):
            raise RandomArgumentError(
                f"{where}: expected {name} an int, given {type(bound).__name__} {bound!r}"
            )
    if not low < high:
        raise RandomArgumentError(f"{where}: expected low < high, given low={low}, high={high}")
    out = _out(where, out)
    wanted = _dtype(where, dtype, _INTS, out)
    info = np.iinfo(held_dtype(wanted))
    if low < info.min or high - 1 > info.max:
        raise RandomArgumentError(
            f"{where}: expected bounds in [{info.min}, {info.max}] (dtype {wanted.name} is held "
            f"as {info.dtype.name}), given low={low}, high={high}"
        )
    return _draw(where, _randint, (int(low), int(high)), shape, wanted, ctx, out)


def randn(*shape: int, **kwargs: Any) -> NDArray:
    """Normal samples of shape ``shape`` (MXNet's ``nd.random.randn(2, 3, loc=0, scale=1)``);
    ``loc``, ``scale``, ``dtype``, ``ctx`` and ``out`` as keywords, as
    :func:`jaxkv.nd.random.normal` takes them.

    Examples:
      >>> import jaxkv.mx as mx
      >>> mx.nd.random.randn(2, 3, loc=5, dtype='float16').shape
      (2, 3)
    """
    loc = kwargs.pop("loc", 0)
    scale = kwargs.pop("scale", 1)
    if not shape and kwargs.get("out") is None:
        raise RandomArgumentError("randn: expected a shape (randn(2, 3)), given none")
    return normal(loc, scale, shape or None, **kwargs)


def shuffle(data: NDArray, out: NDArray | None = None, **kwargs: Any) -> NDArray:
    """A copy of ``data`` with its first axis permuted at random (MXNet's
    ``nd.random.shuffle``), on ``data``'s device, in its dtype; ``out`` is filled if given.

    Examples:
      >>> import jaxkv.mx as mx
      >>> a = mx.nd.random.shuffle(mx.nd.array([[0, 1], [2, 3], [4, 5]]))
      >>> sorted(a.asnumpy().tolist())
      [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    """
    where = "shuffle"
    _no_more(where, kwargs)
    if not isinstance(data, NDArray) or data.stype != "default":
        raise RandomAssertionError(
            f"{where}: expected data a dense NDArray, given {type(data).__name__}"
        )
    out = _out(where, out)
    if out is not None and (out.shape != data.shape or out.dtype != data.dtype):
        raise RandomArgumentError(
            f"{where}: expected out of data's shape {data.shape} and dtype {data.dtype}, given "
            f"shape {out.shape} and dtype {out.dtype}"
        )
    device = data.jax_device()
    words = jax.device_put(_GENERATORS.next_words(device), device)
    mixed = _shuffle(words, data.asjax())
    if out is None:
        return NDArray(mixed, data.dtype)
    out[:] = mixed
    return out


# ---------------------------------------------------------------------------------------------
# MXNet's operators nd.random_uniform and nd.random_normal: numbers only, shape or out needed.
# ---------------------------------------------------------------------------------------------
def _operator(where: str, shape: Any, out: Any, params: tuple[Any, Any]) -> None:
    for p in params:
        if not _is_number(p):
            raise RandomArgumentError(
                f"{where}: expected numbers for the distribution's parameters (NDArrays are "
                f"for nd.random.{where.removeprefix('random_')}), given {type(p).__name__} {p!r}"
            )
    if shape is None and out is None:
        raise RandomArgumentError(f"{where}: expected a shape or an out, given neither")


def random_uniform(
    low: float = 0,
    high: float = 1,
    shape: int | tuple[int, ...] | None = None,
    ctx: Context | None = None,
    dtype: npt.DTypeLike | None = None,
    out: NDArray | None = None,
    name: str | None = None,
    **kwargs: Any,
) -> NDArray:
    """MXNet's operator ``nd.random_uniform``: :func:`jaxkv.nd.random.uniform` with number
    bounds and a ``shape`` (or an ``out``) required; ``ctx`` comes before ``dtype``, as there.

    Examples:
      >>> import jaxkv.mx as mx
      >>> a = mx.nd.random_uniform(-0.6, 0.6, shape=(2, 3), ctx=mx.cpu(1))
      >>> a.shape, a.dtype, a.context
      ((2, 3), dtype('float32'), cpu(1))
    """
    _operator("random_uniform", shape, out, (low, high))
    return uniform(low, high, shape, dtype, ctx, out, **kwargs)


def random_normal(
    loc: float = 0,
    scale: float = 1,
    shape: int | tuple[int, ...] | None = None,
    ctx: Context | None = None,
    dtype: npt.DTypeLike | None = None,
    out: NDArray | None = None,
    name: str | None = None,
    **kwargs: Any,
) -> NDArray:
    """MXNet's operator ``nd.random_normal``: :func:`jaxkv.nd.random.normal` with number
    parameters and a ``shape`` (or an ``out``) required.

    Examples:
      >>> import jaxkv.mx as mx
      >>> mx.nd.random_normal(shape=(4, 4)).shape
      (4, 4)
    """
    _operator("random_normal", shape, out, (loc, scale))
    return normal(loc, scale, shape, dtype, ctx, out, **kwargs)
