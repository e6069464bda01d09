"""What runs inside ``shard_map``: summing each key's per-device blocks over the mesh axis
(fused ``psum`` for small values, reduce-scatter for big ones), and summing over the user's own
mapped axes exactly once.

Every reduce-scatter jaxkv puts in a computation goes through :func:`psum_scatter`, and every
all-gather whose gradient AD takes through :func:`all_gather`: across processes on CPU devices
(XLA:CPU's collectives are gloo's) the reduce-scatter is an all-to-all and a sum on each device,
because gloo's reduce-scatter intermittently leaves wrong values at the end of rank 0's part
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

from jaxkv._src.core.verified import batched, check_sum, check_sums, verify_sums
from jaxkv._src.errors import KVStoreError
from jaxkv._src.jax_internals import varying_axes
from jaxkv._src.state.kvstate import AXIS, KVState
from jaxkv._src.state.policy import scatters_alone

__all__ = [
    "PULL",
    "PUSH",
    "SUM",
    "axis_arg",
    "axis_names",
    "axis_size",
    "axis_sum",
    "all_gather",
    "all_gathers",
    "fused_psum",
    "fused_psum_scatter",
    "fusion_groups",
    "fusion_key",
    "psum_scatter",
    "reduce_scatter_safe",
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
    return fused_psum([x], todo, "a sum over the mapped axes")[0]  # under the SUM scope


# Set to 1, this lets jaxkv emit gloo's reduce-scatter across processes again: only for the tests
# that show what the all-reduce in its place prevents.
ENV_GLOO_REDUCE_SCATTER = "JAXKV_GLOO_REDUCE_SCATTER"


def reduce_scatter_safe() -> bool:
    """Whether a reduce-scatter in this job's computations gives the right sums.

    Not across processes on CPU devices: XLA:CPU runs them with gloo's reduce-scatter
    (``ReduceScatterHalvingDoubling``), which sends from the caller's buffer while the other
    ranks write into it, and intermittently leaves the end of rank 0's part wrong, silently
    (measured: most runs of 2 processes summing 16 MiB values on a loaded 2-core machine).
    There an all-to-all and each device's sum of what it received take its place
    (:func:`_all_to_all_sum`): XLA:CPU's all-to-all is gloo's point-to-point sends and
    receives, from and into buffers of their own, and it sends what a reduce-scatter sends,
    half an all-reduce's bytes (8M float32, 30 runs each on a loaded 2-core machine: 0 wrong,
    27 ms at 2 processes, 50-59 ms at 4, where ``psum`` and a slice took 83 and 76-80 ms and
    ``psum_scatter`` 40 and 91 ms, 2 of its 30 runs wrong at 2 processes).
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
    says so, the result is checked (``verified.check_sum``); ``what`` names the values and
    ``owners`` the process of each device along ``axis``, for the error."""
    if reduce_scatter_safe():
        out = jax.lax.psum_scatter(x, axis, scatter_dimension=scatter_dimension, tiled=tiled)
    elif len(axis_names(axis)) == 1:
        part = _all_to_all_sum(x, axis, scatter_dimension)
        out = part if tiled else jnp.squeeze(part, scatter_dimension)
    else:  # an all-to-all over several axes at once: an all-reduce and this device's slice
        n = axis_size(axis_names(axis))
        whole = jax.lax.psum(x, axis)
        size = x.shape[scatter_dimension] // n
        me = jax.lax.axis_index(axis)
        part = jax.lax.dynamic_slice_in_dim(whole, me * size, size, scatter_dimension)
        out = part if tiled else jnp.squeeze(part, scatter_dimension)
    if verify_sums() and scatter_dimension == 0:
        check_sum(x, out, axis, what or "a reduce-scatter", owners)
    return out


def _all_to_all_sum(x: jax.Array, axis: Any, dim: int) -> jax.Array:
    """Device d's part of the sum of ``x`` over ``axis`` (the d-th of ``n`` equal parts along
    ``dim``, kept as a dimension): each device sends every other device that device's part
    (an all-to-all), then adds the ``n`` parts it has, in device order."""
    (name,) = axis_names(axis)
    n = axis_size((name,))
    moved = jnp.moveaxis(x, dim, 0)
    parts = moved.reshape(n, moved.shape[0] // n, *moved.shape[1:])
    got = jax.lax.all_to_all(parts, name, 0, 0, tiled=True)  # row j: device j's part of mine
    return jnp.moveaxis(jnp.sum(got, axis=0), 0, dim)


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
    verified); ``what`` names the values and ``owners`` the process of each device along
    ``axis``, for a failed check's error. :func:`all_gathers` of one array."""
    return all_gathers([x], axis, tiled=tiled, whats=(what,), owners=owners)[0]


def all_gathers(
    xs: list[jax.Array],
    axis: Any,
    *,
    tiled: bool = False,
    whats: tuple[str, ...] = (),
    owners: tuple[int, ...] | None = None,
) -> list[jax.Array]:
    """:func:`all_gather` of each of ``xs`` (``whats`` naming each), whose gradients' sums are
    checked together (``verified.batched``): one all-gather of their checksums, not one each."""
    if reduce_scatter_safe() and not verify_sums():
        return [jax.lax.all_gather(x, axis, tiled=tiled) for x in xs]
    return list(_gathered_many(tuple(xs), axis, tiled, whats, owners))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _gathered_many(xs: tuple, axis: Any, tiled: bool, whats: tuple, owners: Any) -> tuple:
    return tuple(jax.lax.all_gather(x, axis, tiled=tiled) for x in xs)


def _gathered_many_fwd(
    xs: tuple, axis: Any, tiled: bool, whats: tuple, owners: Any
) -> tuple[tuple, None]:
    return _gathered_many(xs, axis, tiled, whats, owners), None


def _gathered_many_bwd(
    axis: Any, tiled: bool, whats: tuple, owners: Any, _: None, gs: tuple
) -> tuple[tuple]:
    with jax.named_scope(SUM), batched(axis, owners):
        return (
            tuple(
                psum_scatter(g, axis, tiled=tiled, what=what, owners=owners)
                for g, what in zip(gs, whats)
            ),
        )


_gathered_many.defvjp(_gathered_many_fwd, _gathered_many_bwd)


def scatters(state: KVState, shape: tuple[int, ...]) -> bool:
    """Whether a pushed value of ``shape`` is reduce-scattered (else fused into an all-reduce):
    the store's placement policy says (``Placement.scatters``)."""
    return state.placement.scatters(shape, jax.process_count())


def fusion_key(block: jax.Array, axis: Any) -> tuple:
    """What blocks summed over ``axis`` through one flat buffer must share: their dtype, and
    the mesh axes other than ``axis``'s along which they vary (a tensor-parallel key's block
    varies along its own axes, a replicated key's along none). A buffer joining blocks of
    different axes would vary along all of them, and so would every block cut from it: a
    replicated key's sum typed as varying along the model axis, which ``shard_map``'s
    ``out_specs`` refuse."""
    return (np.dtype(block.dtype), varying_axes(block) - frozenset(axis_names(axis)))


def fusion_groups(blocks: list[jax.Array], axis: Any) -> list[list[int]]:
    """The positions of ``blocks`` grouped by :func:`fusion_key` (in order of first
    appearance, each group in ``blocks``' order): the blocks one flat buffer may join."""
    groups: dict[tuple, list[int]] = {}
    for i, b in enumerate(blocks):
        groups.setdefault(fusion_key(b, axis), []).append(i)
    return list(groups.values())


def _per_group(
    blocks: list[jax.Array], axis: Any, fused: Callable[[list[jax.Array]], list[jax.Array]]
) -> list[jax.Array] | None:
    """``fused`` run on each :func:`fusion_groups` group of ``blocks`` apart, the results in
    ``blocks``' order; ``None`` where they form one group (``fused`` runs on them all)."""
    groups = fusion_groups(blocks, axis)
    if len(groups) == 1:
        return None
    out: list[Any] = [None] * len(blocks)
    for idx in groups:
        for i, x in zip(idx, fused([blocks[i] for i in idx])):
            out[i] = x
    return out


def fused_psum(
    blocks: list[jax.Array], axis: Any = AXIS, what: str = "an all-reduce"
) -> list[jax.Array]:
    """``psum`` of several blocks through one flat buffer per :func:`fusion_groups` group (one
    collective per dtype and set of other varying axes), checked where :func:`verify_sums`
    says so."""
    with jax.named_scope(SUM):
        apart = _per_group(blocks, axis, lambda part: fused_psum(part, axis, what))
        if apart is not None:
            return apart
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
    """Tiled ``psum_scatter`` along axis 0 of several blocks through one flat buffer per
    :func:`fusion_groups` group.

    Each block (first dimension divisible by ``n``) is viewed as ``(n, -1)``, so that row ``i``
    holds the rows device ``i`` keeps; the views are concatenated along axis 1, reduce-scattered
    once, and split back.
    """
    with jax.named_scope(SUM):
        apart = _per_group(blocks, axis, lambda part: fused_psum_scatter(part, n, axis))
        if apart is not None:
            return apart
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
    Only blocks of one :func:`fusion_key` (dtype, and the other mesh axes they vary along)
    share a collective.
    """
    with batched(axis):  # every sum's check in one all-gather (verified.batched)
        return _sum_over_devices(blocks, scatter, axis)


def _sum_over_devices(blocks: list[jax.Array], scatter: list[bool], axis: str) -> list[jax.Array]:
    n = jax.lax.axis_size(axis)
    out: list[Any] = [None] * len(blocks)
    groups: dict[tuple, list[int]] = {}
    alone: list[int] = []  # big blocks summed one by one across processes
    for i, (b, s) in enumerate(zip(blocks, scatter)):
        if s and scatters_alone(b.size):
            with jax.named_scope(SUM):
                out[i] = psum_scatter(b, axis, scatter_dimension=0, tiled=True)
        elif scatters_alone(b.size) and jax.process_count() > 1:
            # Across processes: no copy into a fused buffer.
            with jax.named_scope(SUM):
                out[i] = jax.lax.psum(b, axis)
            alone.append(i)
        else:
            groups.setdefault((s, *fusion_key(b, axis)), []).append(i)
    if alone and verify_sums():
        check_sums(
            [(blocks[i], out[i], f"an all-reduce of {blocks[i].shape}") for i in alone], axis
        )
    for (s, *_), idx in groups.items():
        parts = [blocks[i] for i in idx]
        summed = fused_psum_scatter(parts, n, axis) if s else fused_psum(parts, axis)
        for i, x in zip(idx, summed):
            out[i] = x
    return out
