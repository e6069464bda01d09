"""Every use of a private JAX name, each with its public fallback.

These save host time per value on the eager path (a push or pull of ResNet-50's 193 tensors
handles thousands of arrays). Each is feature-checked: another JAX without the private name
takes the public route, with the same results. ``JAXKV_NO_FAST_PATHS=1`` in the environment
(read at import) turns every one of them off; the test suite runs a check that way.

It also reads the cluster environments JAX's ``jax.distributed.initialize()`` detects
(:func:`cluster_environments`: SLURM, Open MPI, Cloud TPU, Kubernetes), so that jaxkv joins
exactly the jobs JAX would; without them jaxkv reads SLURM's and Open MPI's variables itself.

It also reaches two private hooks of ``jax.distributed`` (:func:`gloo_cpu_backend`,
:func:`distributed_state`) that let gloo bind to the interface toward the coordinator; without
them gloo binds to the host name's address.

It also traces the computations over several processes with no Python stack frames in their
locations (:func:`no_frames_in_locations`: a private context of one thread, or the public
option for the block's length).

It also holds the feature detection of public names that moved between JAX versions
(:func:`varying_axes`, :func:`to_varying`, :func:`all_gather_invariant`, :func:`manual_axes`,
:func:`single_device_sharding`, :func:`is_single_device_sharding`):
each detected by
attribute, or by trying the keyword, never by version. Where a JAX has a public route, it is
taken whatever ``JAXKV_NO_FAST_PATHS`` says.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import operator
import os
from collections.abc import Iterator, Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding

__all__ = [
    "CAN_MARK_VARYING",
    "ENABLED",
    "ArrayImpl",
    "all_eager",
    "all_gather_invariant",
    "assemble",
    "cluster_environments",
    "distributed_state",
    "gloo_cpu_backend",
    "is_single_device_sharding",
    "manual_axes",
    "no_frames_in_locations",
    "per_device",
    "single_device",
    "single_device_sharding",
    "single_devices",
    "to_varying",
    "varying_axes",
]

ENABLED = os.environ.get("JAXKV_NO_FAST_PATHS", "") in ("", "0")

ArrayImpl: Any = None  # the concrete class of eager jax.Arrays, cheaper to test for than the ABC
ShapedArray: Any = None
SingleDevice: Any = None  # the concrete class of one device's sharding (a type test, no call)
if ENABLED:
    try:
        from jax._src.array import ArrayImpl
        from jax._src.core import ShapedArray
    except ImportError:  # another JAX: the public routes below still work
        ArrayImpl = ShapedArray = None
    try:
        from jax._src.sharding_impls import SingleDeviceSharding as SingleDevice
    except ImportError:
        SingleDevice = None


_LOCATIONS_LIMIT: Any = None  # the option as a context of one thread's (jax._src.config)
if ENABLED:
    try:
        from jax._src.config import traceback_in_locations_limit as _LOCATIONS_LIMIT
    except ImportError:
        _LOCATIONS_LIMIT = None


@contextlib.contextmanager
def no_frames_in_locations() -> Iterator[None]:
    """JAX traces and lowers what the ``with`` block computes with no Python stack frames in
    its locations (the compiled program's metadata). JAX 0.12 pairs the collectives of one
    compiled program alone across processes, and a program's metadata is part of it: a
    computation first traced from ``out.asnumpy()`` in one process and from ``nd.waitall()``
    in another (the same computation, other callers) was two programs, and the job hung in
    their first collective. The private route sets ``jax_traceback_in_locations_limit`` for this
    thread alone; the public one sets the option for the block's length (every thread's; a
    collective turn holds a lock) and puts it back."""
    if _LOCATIONS_LIMIT is not None:
        with _LOCATIONS_LIMIT(0):
            yield
        return
    was = getattr(jax.config, _LIMIT)
    jax.config.update(_LIMIT, 0)
    try:
        yield
    finally:
        jax.config.update(_LIMIT, was)


_LIMIT = "jax_traceback_in_locations_limit"


# JAX 0.12's public names for one device's sharding, looked up once (None on older JAX).
_MAKE_SINGLE: Any = getattr(jax.sharding, "make_single_device_sharding", None)
_IS_SINGLE: Any = getattr(jax.sharding, "is_single_device_sharding", None)


def single_device_sharding(device: jax.Device) -> jax.sharding.Sharding:
    """The sharding that places a whole array on ``device``: JAX 0.12's public
    ``jax.sharding.make_single_device_sharding``, else the class older JAX exports (0.12
    deprecates the class's public name)."""
    if _MAKE_SINGLE is not None:
        return _MAKE_SINGLE(device)
    return jax.sharding.SingleDeviceSharding(device)


def is_single_device_sharding(sharding: jax.sharding.Sharding) -> bool:
    """Whether ``sharding`` is one device's sharding as :func:`single_device_sharding` makes it
    (not a one-device ``NamedSharding``): JAX 0.12's public test, else the class's."""
    if _IS_SINGLE is not None:
        return bool(_IS_SINGLE(sharding))
    return isinstance(sharding, jax.sharding.SingleDeviceSharding)


def all_eager(xs: Any) -> bool:
    """Whether every item of the sequence ``xs`` is an eager ``jax.Array`` (no tracer, no other
    type): one C-level pass over the types where this JAX names its concrete array class."""
    if ArrayImpl is not None:
        return set(map(type, xs)) <= {ArrayImpl}
    return all(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) for x in xs)


def any_tracer(xs: Any) -> bool:
    """Whether any item of the sequence ``xs`` is a tracer (asked of every leaf at each push:
    no Python call per item)."""
    return any(map(isinstance, xs, itertools.repeat(jax.core.Tracer, len(xs))))


def single_device(x: jax.Array) -> jax.Device | None:
    """The device ``x`` lives on, or ``None`` if it spans several."""
    sharding = x.sharding
    if SingleDevice is not None and type(sharding) is SingleDevice:  # the common case, no set
        device = getattr(sharding, "_device", None)
        if device is not None:
            return device
    devices = sharding.device_set
    return next(iter(devices)) if len(devices) == 1 else None


_SHARDING = operator.attrgetter("_sharding")  # (the public ``sharding`` is a Python property)
_DEVICE = operator.attrgetter("_device")


def single_devices(xs: Sequence[jax.Array]) -> tuple[jax.Device | None, ...]:
    """:func:`single_device` of each eager array of ``xs``: where each is one device's
    sharding as this JAX makes it, its device read in C-level passes (a plan checks every
    value's device at every push), else asked one by one."""
    if SingleDevice is not None:
        try:
            shardings = tuple(map(_SHARDING, xs))
            if set(map(type, shardings)) == {SingleDevice}:
                return tuple(map(_DEVICE, shardings))
        except AttributeError:  # this JAX keeps them elsewhere
            pass
    return tuple(map(single_device, xs))


def assemble(shape: tuple[int, ...], sharding: NamedSharding, shards: list[jax.Array]) -> jax.Array:
    """``jax.make_array_from_single_device_arrays`` for shards already in the mesh's device
    order, with the same shape and dtype; skips the public function's per-call checks (a third
    of a push's host time on 193 keys) where this JAX offers that."""
    if ArrayImpl is not None and ShapedArray is not None:
        try:
            aval = _aval(shape, shards[0].dtype)
            return ArrayImpl(aval, sharding, shards, committed=True, _skip_checks=True)
        except TypeError:  # this JAX's constructor takes other arguments
            pass
    return jax.make_array_from_single_device_arrays(shape, sharding, shards)


@functools.lru_cache(maxsize=4096)
def _aval(shape: tuple[int, ...], dtype: Any) -> Any:
    return ShapedArray(shape, dtype)


def per_device(x: jax.Array) -> list[jax.Array]:
    """The single-device arrays of ``x``, one per device that holds a part of it."""
    arrays = getattr(x, "_arrays", None) if ENABLED else None  # the public route: ~10x slower
    return list(arrays) if arrays is not None else [s.data for s in x.addressable_shards]


def varying_axes(x: Any) -> frozenset:
    """The mapped axes (of an enclosing ``shard_map``) along which ``x`` varies; empty where
    JAX does not track them (under ``pmap``, or outside any map).

    ``jax.typeof(x).manual_axis_type.varying`` on JAX 0.10 and later, ``jax.typeof(x).vma`` on
    the earlier versions that track varying axes.
    """
    aval = jax.typeof(x)
    kind = getattr(aval, "manual_axis_type", None)
    if kind is not None:
        return frozenset(kind.varying)
    return frozenset(getattr(aval, "vma", None) or ())


# jax.lax.pcast(x, axes, to="varying"), called jax.lax.pvary before JAX 0.8.2 (and deprecated
# after: it is looked up only where pcast is missing).
CAN_MARK_VARYING = hasattr(jax.lax, "pcast") or hasattr(jax.lax, "pvary")


def to_varying(x: Any, axes: tuple) -> Any:
    """``x`` typed as varying along the mapped axes ``axes`` (its value unchanged), as
    ``jax.lax`` does for its own functions when invariant and varying inputs meet."""
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, axes, to="varying")
    return jax.lax.pvary(x, axes)  # type: ignore[attr-defined]  # gone from JAX 0.10's lax


# JAX 0.8.2 to 0.9.2 have no public all-gather typed invariant, but a private one.
_private_gather: Any = None
if ENABLED:
    try:
        from jax._src.lax import parallel as _parallel

        # Looked up by name: later JAX renamed it (and typing the import would fail there).
        _private_gather = getattr(_parallel, "all_gather_invariant", None)
    except ImportError:  # another JAX: the public routes below
        _private_gather = None


def all_gather_invariant(x: Any, axis_name: Any, *, axis: int = 0, tiled: bool = False) -> Any:
    """``jax.lax.all_gather`` (along dimension ``axis``) whose result is typed invariant along
    ``axis_name``: the same whole value on every device, usable where ``shard_map``'s
    ``out_specs`` says replicated.

    ``all_gather(..., to="invarying")`` from JAX 0.10, ``jax.lax.all_gather_invariant`` until
    0.8.1, the private function of that name in between; without any of them (or with
    ``JAXKV_NO_FAST_PATHS=1`` there) a plain ``all_gather``: the same values, typed varying.
    """
    try:
        return jax.lax.all_gather(x, axis_name, axis=axis, tiled=tiled, to="invarying")
    except (TypeError, ValueError):  # an older JAX: no `to`, or no "invarying"
        pass
    gather = getattr(jax.lax, "all_gather_invariant", None) or _private_gather
    if gather is not None:
        try:
            return gather(x, axis_name, axis=axis, tiled=tiled)
        except TypeError:  # another signature
            pass
    return jax.lax.all_gather(x, axis_name, axis=axis, tiled=tiled)


def gloo_cpu_backend(binding: dict[str, str]) -> Any:
    """A factory for JAX's CPU backend whose gloo collectives bind as ``binding`` says (gloo's
    ``hostname`` or ``interface``), or ``None`` where this JAX has no such hook. JAX offers no
    public setting for gloo's address; without it gloo binds to the host name's address."""
    if not ENABLED:
        return None
    try:
        from jax._src import distributed as jax_distributed
        from jax._src import xla_bridge
        from jax._src.lib import _jax

        make_collectives = _jax.make_gloo_tcp_collectives
        make_cpu_client = xla_bridge.make_cpu_client
    except (ImportError, AttributeError):  # another JAX
        return None

    def cpu_backend() -> Any:
        client = jax_distributed.global_state.client
        return make_cpu_client(collectives=make_collectives(distributed_client=client, **binding))

    return cpu_backend


def distributed_state() -> Any:
    """JAX's record of the job this process joined (coordinator address, process id), or
    ``None`` where this JAX does not expose it."""
    if not ENABLED:
        return None
    try:
        from jax._src import distributed as jax_distributed
    except ImportError:  # another JAX
        return None
    return jax_distributed.global_state


def cluster_environments() -> list[Any] | None:
    """The cluster environments ``jax.distributed.initialize()`` with no arguments tries, in its
    order (``jax._src.clusters.ClusterEnv`` subclasses, those it tries only when asked by name
    left out), or ``None`` where this JAX does not expose them."""
    if not ENABLED:
        return None
    try:
        from jax._src.clusters import ClusterEnv
    except ImportError:  # another JAX
        return None
    kinds = getattr(ClusterEnv, "_cluster_types", None)
    if kinds is None:
        return None
    return [env for env in kinds if not getattr(env, "opt_in_only_method", False)]


def manual_axes() -> frozenset | None:
    """The mesh axes the trace being built is manual along (inside ``shard_map``; empty in
    plain ``jit`` or eagerly), from the public ``jax.sharding.get_abstract_mesh``; ``None``
    where this JAX has no such name (callers then take the manual case, the safe one)."""
    get = getattr(jax.sharding, "get_abstract_mesh", None)
    if get is None:
        return None
    axes = getattr(get(), "manual_axes", None)
    return None if axes is None else frozenset(axes)
