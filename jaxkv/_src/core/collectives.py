"""What runs inside ``shard_map``: summing each key's per-device blocks over the mesh axis
(fused ``psum`` for small values, reduce-scatter for big ones), and summing over the user's own
mapped axes exactly once.

Every reduce-scatter jaxkv puts in a computation goes through :func:`psum_scatter`, and every
all-gather whose gradient AD takes through :func:`all_gather`: across processes on CPU devices
(XLA:CPU's collectives are gloo's) the reduce-scatter is an all-reduce and a slice, because
gloo's reduce-scatter intermittently leaves wrong values at the end of rank 0's part
(docs/distributed.md, "Reduce-scatters across processes").

Every sum is traced under ``jax.named_scope(SUM)`` (``jaxkv.sum``), so the HLO's op names and a
profiler trace show it."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv._src.errors import KVStoreError, SumError  # noqa: F401 (SumError: collectives.SumError)
from jaxkv._src.jax_internals import varying_axes
from jaxkv._src.state.kvstate import AXIS, BIGARRAY_BOUND, KVState

__all__ = [
    "PULL",
    "PUSH",
    "SUM",
    "axis_arg",
    "axis_names",
    "axis_size",
    "axis_sum",
    "fused_psum",
    "all_gather",
    "fused_psum_scatter",
    "psum_scatter",
    "reduce_scatter_safe",
    "verify_sums",
    "scatters",
    "scoped",
    "sum_over_devices",
    "unsummed_axes",
]


# The named scope of the sums (``jax.named_scope``): the HLO's op names under it read
# ``.../jaxkv.sum/psum``.
SUM = "jaxkv.sum"
# The scopes of a whole push and of a pull's gathers (the sums and the updater inside a push
# read ``jaxkv.push/jaxkv.sum``, ``jaxkv.push/jaxkv.updater``), and the host-side trace
# annotations of the eager calls (``jax.profiler.TraceAnnotation``).
PUSH = "jaxkv.push"
PULL = "jaxkv.pull"

_F = TypeVar("_F", bound=Callable[..., Any])


def scoped(name: str) -> Callable[[_F], _F]:
    """A function traced under ``jax.named_scope(name)``."""

    def wrap(f: _F) -> _F:
        @functools.wraps(f)
        def in_scope(*args: Any, **kwargs: Any) -> Any:
            with jax.named_scope(name):
                return f(*args, **kwargs)

        return in_scope  # type: ignore[return-value]

    return wrap


def axis_names(axis_name: Any) -> tuple:
    """``axis_name`` (one mapped axis or several) as a tuple of names."""
    return tuple(axis_name) if isinstance(axis_name, tuple | list) else (axis_name,)


def axis_arg(names: tuple) -> Any:
    """``names`` as JAX's collectives take them: one name alone, several as a tuple."""
    return names if len(names) > 1 else names[0]


def axis_size(names: tuple) -> int:
    """The number of devices along the mapped axes ``names``; refuses an unbound name."""
    try:
        return math.prod(jax.lax.axis_size(name) for name in names)
    except NameError as e:
        raise KVStoreError(
            f"axis_name {names[0] if len(names) == 1 else names!r}: expected an axis bound by "
            f"an enclosing pmap or shard_map, given one that is not bound here ({e})"
        ) from None


def unsummed_axes(x: jax.Array, names: tuple) -> tuple:
    """The axes among ``names`` over which ``x`` still has to be summed.

    Under ``shard_map`` with varying-axis tracking, a value invariant along an axis (e.g. the
    gradient of a replicated parameter, which JAX has already summed) needs no sum over it.
    Under ``pmap`` (no tracking) every value is per-device and is summed.
    """
    axis_size(names)  # refuses unbound names
    todo = []
    for name in names:
        tracked = name in varying_axes(jax.lax.axis_index(name))
        if not tracked or name in varying_axes(x):
            todo.append(name)
    return tuple(todo)


def axis_sum(x: jax.Array, axis_name: Any) -> jax.Array:
    """Sum ``x`` over the mapped axes ``axis_name`` exactly once (see :func:`unsummed_axes`)."""
    todo = unsummed_axes(x, axis_names(axis_name))
    if not todo:
        return x
    with jax.named_scope(SUM):
        return jax.lax.psum(x, todo)


# Set to 1, this lets jaxkv emit gloo's reduce-scatter across processes again: only for the tests
# that show what the all-reduce in its place prevents.
ENV_GLOO_REDUCE_SCATTER = "JAXKV_GLOO_REDUCE_SCATTER"


def reduce_scatter_safe() -> bool:
    """Whether a reduce-scatter in this job's computations gives the right sums.

    Not across processes on CPU devices: XLA:CPU runs them with gloo's reduce-scatter
    (``ReduceScatterHalvingDoubling``), which sends from the caller's buffer while the other
    ranks write into it, and intermittently leaves the end of rank 0's part wrong, silently
    (measured: most runs of 2 processes summing 16 MiB values on a loaded 2-core machine).
    There an all-reduce and a slice take its place, which measured faster on gloo too (25.6M
    float32, 2 processes: ``psum`` 223 ms, ``psum_scatter`` 368 ms).
    """
    if jax.process_count() == 1 or jax.default_backend() != "cpu":
        return True
    return os.environ.get(ENV_GLOO_REDUCE_SCATTER) == "1"


def psum_scatter(
    x: jax.Array,
    axis: Any,
    *,
    scatter_dimension: int = 0,
    tiled: bool = False,
    what: str = "",
    owners: tuple[int, ...] | None = None,
) -> jax.Array:
    """``jax.lax.psum_scatter``, or where that is not safe (:func:`reduce_scatter_safe`) the
    same values by a ``psum`` and this device's slice of the sum. Where :func:`verify_sums`
    says so, the result is checked (:func:`check_sum`); ``what`` names the values and
    ``owners`` the process of each device along ``axis``, for the error."""
    if reduce_scatter_safe():
        out = jax.lax.psum_scatter(x, axis, scatter_dimension=scatter_dimension, tiled=tiled)
    else:
        n = axis_size(axis_names(axis))
        whole = jax.lax.psum(x, axis)
        size = x.shape[scatter_dimension] // n
        me = jax.lax.axis_index(axis)
        part = jax.lax.dynamic_slice_in_dim(whole, me * size, size, scatter_dimension)
        out = part if tiled else jnp.squeeze(part, scatter_dimension)
    if verify_sums() and scatter_dimension == 0:
        check_sum(x, out, axis, what or "a reduce-scatter", owners)
    return out


def all_gather(
    x: jax.Array,
    axis: Any,
    *,
    tiled: bool = False,
    what: str = "",
    owners: tuple[int, ...] | None = None,
) -> jax.Array:
    """``jax.lax.all_gather`` whose gradient is summed by :func:`psum_scatter` (AD's own
    transpose of an all-gather is ``lax.psum_scatter``, which is neither safe everywhere nor
    verified); ``what`` and ``owners`` as there."""
    if reduce_scatter_safe() and not verify_sums():
        return jax.lax.all_gather(x, axis, tiled=tiled)
    return _gathered(x, axis, tiled, what, owners)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _gathered(x: jax.Array, axis: Any, tiled: bool, what: str, owners: Any) -> jax.Array:
    return jax.lax.all_gather(x, axis, tiled=tiled)


def _gathered_fwd(
    x: jax.Array, axis: Any, tiled: bool, what: str, owners: Any
) -> tuple[jax.Array, None]:
    return jax.lax.all_gather(x, axis, tiled=tiled), None


def _gathered_bwd(
    axis: Any, tiled: bool, what: str, owners: Any, _: None, g: jax.Array
) -> tuple[jax.Array]:
    with jax.named_scope(SUM):
        return (psum_scatter(g, axis, tiled=tiled, what=what, owners=owners),)


_gathered.defvjp(_gathered_fwd, _gathered_bwd)


# Verified sums. ``JAXKV_VERIFY_SUMS=1`` checks every sum jaxkv makes across devices, ``0``
# none; by default those across processes are checked.
ENV_VERIFY_SUMS = "JAXKV_VERIFY_SUMS"


def verify_sums() -> bool:
    """Whether jaxkv checks its reduce-scatters and all-reduces with a checksum
    (:func:`check_sum`): ``JAXKV_VERIFY_SUMS`` if set to 0 or 1, else across processes only,
    where the sums are an engine's network collectives (gloo's, NCCL's)."""
    setting = os.environ.get(ENV_VERIFY_SUMS)
    if setting in ("0", "1"):
        return setting == "1"
    return jax.process_count() > 1


def _weights(size: int) -> jax.Array:
    """A fixed pseudo-random vector in [-1, 1) of ``size``, the same on every device: an
    integer hash of each position (computed where it is used, never stored)."""
    h = jax.lax.iota(jnp.uint32, size) * jnp.uint32(0x9E3779B1)
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    return (h >> 8).astype(jnp.float32) * jnp.float32(2.0**-23) - 1.0


def _dots(rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's dot (over its last axis) with :func:`_weights`, and its dot of absolute values
    (the scale of the rounding errors), in float32; elementwise products and sums, so no matrix
    unit rounds. The vector repeats with a period of up to ``PERIOD`` elements (the largest
    power of two that divides the row), so that it costs nothing to make."""
    size = rows.shape[-1]
    period = math.gcd(size, PERIOD)
    r = _weights(period)
    rows = rows.astype(jnp.float32).reshape(*rows.shape[:-1], size // period, period)
    return jnp.sum(rows * r, axis=(-2, -1)), jnp.sum(jnp.abs(rows) * jnp.abs(r), axis=(-2, -1))


# The period of the checksums' pseudo-random vector.
PERIOD = 4096


# Each device's part of a checked sum is dotted in this many segments (where its size divides),
# so that a few wrong elements stand out against the rounding of a segment, not of the part.
SEGMENTS = 64


def check_sum(
    x: jax.Array, out: jax.Array, axis: Any, what: str, owners: tuple[int, ...] | None = None
) -> None:
    """Inside ``shard_map``: check that ``out`` is this device's part of the sum of ``x`` over
    ``axis`` (a reduce-scatter along axis 0; ``out`` of ``x``'s shape: an all-reduce).

    A sum is linear, so the checksum of a sum is the sum of the inputs' checksums: each device
    dots its ``x`` (each device's part, in :data:`SEGMENTS` segments) with a fixed
    pseudo-random vector, and its part of the result; one small all-gather brings every
    device's dots, and the inputs' are added. A part whose dots differ from the expected ones
    by more than float rounding raises a :class:`SumError` on the host, in every process, naming
    ``what`` and the devices (and ``owners``' processes) whose part was wrong. JAX raises it
    when the step's results are read, as a ``JaxRuntimeError`` carrying its text.
    """
    names = axis_names(axis)
    n = axis_size(names)
    whole = tuple(out.shape) == tuple(x.shape)
    size = out.size
    segments = next(s for s in (SEGMENTS, 32, 16, 8, 4, 2, 1) if size % s == 0)
    expected, scale = _dots(x.reshape(1 if whole else n, segments, -1))  # (parts, segments)
    got = _dots(out.reshape(segments, -1))[0]
    # One all-gather of every device's dots: the inputs' are summed here.
    with jax.named_scope(SUM):
        every = jax.lax.all_gather(jnp.concatenate([expected.ravel(), scale.ravel(), got]), axis)
    k = expected.size
    expected = every[:, :k].sum(0).reshape(expected.shape)
    scale = every[:, k : 2 * k].sum(0).reshape(expected.shape)
    got = every[:, 2 * k :]  # (devices, segments)
    eps = float(jnp.finfo(x.dtype).eps) if jnp.issubdtype(x.dtype, jnp.floating) else 0.0
    tolerance = (2 * n * eps + 64 * float(jnp.finfo(jnp.float32).eps)) * scale + 1e-30
    off = jnp.isfinite(expected) & ~(jnp.abs(got - expected) <= tolerance)
    report = functools.partial(_compare, what=what, owners=owners, eps=eps, devices=n, whole=whole)
    # The host is called only when a part is off: a right sum costs no host round trip.
    jax.lax.cond(
        jnp.any(off),
        lambda: jax.debug.callback(report, jnp.stack([expected, scale]), got),
        lambda: None,
    )


def _compare(
    totals: Any,
    got: Any,
    *,
    what: str,
    owners: tuple[int, ...] | None,
    eps: float,
    devices: int,
    whole: bool,
) -> None:
    """On the host: refuse parts of a sum whose checksum is off by more than rounding."""
    expected, scale = np.asarray(totals, np.float64)  # (parts, segments) each
    got = np.asarray(got, np.float64).reshape(-1, expected.shape[-1])  # (devices, segments)
    if whole:  # every device holds the whole sum: each is checked against the one total
        expected = np.broadcast_to(expected, got.shape)
        scale = np.broadcast_to(scale, got.shape)
    # The sum's own rounding (in the values' dtype, over the devices) and the checksum's.
    tolerance = (2 * devices * eps + 64 * float(np.finfo(np.float32).eps)) * scale + 1e-30
    with np.errstate(invalid="ignore"):  # inf - inf: a sum that cannot be checked
        off = np.isfinite(expected) & ~(np.abs(got - expected) <= tolerance)
    wrong = np.flatnonzero(off.any(axis=1))
    if wrong.size:
        where = ", ".join(
            f"device {d}" + (f" (process {owners[d]})" if owners and d < len(owners) else "")
            for d in wrong
        )
        first = [int(np.flatnonzero(off[d])[0]) for d in wrong]

        def listed(a: Any) -> str:
            return ", ".join(f"{a[d, j]:.7g}" for d, j in zip(wrong, first))

        raise SumError(
            f"{what}: the sum across {devices} devices failed its checksum on {where}: in "
            f"segment {', '.join(map(str, first))} of {off.shape[1]}, expected "
            f"{listed(expected)}, given {listed(got)} (tolerance {listed(tolerance)}); a "
            "collective of this backend gave wrong values. Rerun; if it recurs, report it with "
            "docs/distributed.md's repro"
        )


# Values below this many elements are summed together through one flat buffer (one collective
# for many small arrays); larger ones are reduce-scattered one by one, which XLA's CPU
# collectives do much faster than an all-reduce.
_FUSE_LIMIT = BIGARRAY_BOUND


def scatters(state: KVState, shape: tuple[int, ...]) -> bool:
    """Whether a pushed value of ``shape`` is reduce-scattered (else fused into an all-reduce)."""
    n = len(state.devices)
    if jax.process_count() > 1:
        # Across processes a reduce-scatter costs what an all-reduce does (gloo runs one), and
        # the value would then need an all-gather as well.
        return state.is_sharded(shape)
    return state.is_sharded(shape) or (
        len(shape) > 0 and shape[0] % n == 0 and math.prod(shape) >= _FUSE_LIMIT
    )


# Scattered values below this many elements are reduce-scattered together, through one flat
# buffer: XLA's CPU collectives cost ~0.3 ms each however small the array.
SCATTER_FUSE_LIMIT = 1 << 18


def fused_psum(
    blocks: list[jax.Array], axis: Any = AXIS, what: str = "an all-reduce"
) -> list[jax.Array]:
    """``psum`` of several blocks of one dtype through one flat buffer (one collective),
    checked where :func:`verify_sums` says so."""
    with jax.named_scope(SUM):
        if len(blocks) == 1:
            out = jax.lax.psum(blocks[0], axis)
            if verify_sums():
                check_sum(blocks[0], out, axis, what)
            return [out]
        cat = jnp.concatenate([b.reshape(-1) for b in blocks])
        flat = jax.lax.psum(cat, axis)
        if verify_sums():
            check_sum(cat, flat, axis, what)
        offsets = np.cumsum([0] + [b.size for b in blocks])
        return [flat[a:z].reshape(b.shape) for b, a, z in zip(blocks, offsets[:-1], offsets[1:])]


def fused_psum_scatter(blocks: list[jax.Array], n: int, axis: Any = AXIS) -> list[jax.Array]:
    """Tiled ``psum_scatter`` along axis 0 of several blocks through one flat buffer.

    Each block (first dimension divisible by ``n``) is viewed as ``(n, -1)``, so that row ``i``
    holds the rows device ``i`` keeps; the views are concatenated along axis 1, reduce-scattered
    once, and split back.
    """
    with jax.named_scope(SUM):
        if len(blocks) == 1:
            return [psum_scatter(blocks[0], axis, scatter_dimension=0, tiled=True)]
        cat = jnp.concatenate([b.reshape(n, -1) for b in blocks], axis=1)
        mine = psum_scatter(cat, axis, scatter_dimension=0, tiled=True)[0]
        offsets = np.cumsum([0] + [b.size // n for b in blocks])
        return [
            mine[a:z].reshape((b.shape[0] // n, *b.shape[1:]))
            for b, a, z in zip(blocks, offsets[:-1], offsets[1:])
        ]


def sum_over_devices(
    blocks: list[jax.Array], scatter: list[bool], axis: str = AXIS
) -> list[jax.Array]:
    """Inside ``shard_map``: sum each key's per-device block over the mesh axis.

    Where ``scatter`` says so the sum is reduce-scattered (each device keeps its 1/D of it;
    callers all-gather values that are stored replicated); big blocks one by one, smaller ones
    together. The others are summed with one ``psum`` per dtype over their concatenation.
    Tensor fusion matters: one collective per small array would cost far more than the data.
    """
    n = jax.lax.axis_size(axis)
    out: list[Any] = [None] * len(blocks)
    groups: dict[tuple, list[int]] = {}
    for i, (b, s) in enumerate(zip(blocks, scatter)):
        if s and b.size >= SCATTER_FUSE_LIMIT:
            with jax.named_scope(SUM):
                out[i] = psum_scatter(b, axis, scatter_dimension=0, tiled=True)
        elif b.size >= SCATTER_FUSE_LIMIT and jax.process_count() > 1:
            with jax.named_scope(SUM):  # across processes: no copy into a fused buffer
                out[i] = jax.lax.psum(b, axis)
        else:
            groups.setdefault((s, b.dtype), []).append(i)
    for (s, _), idx in groups.items():
        parts = [blocks[i] for i in idx]
        summed = fused_psum_scatter(parts, n, axis) if s else fused_psum(parts, axis)
        for i, x in zip(idx, summed):
            out[i] = x
    return out
