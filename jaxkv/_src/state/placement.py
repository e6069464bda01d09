"""Arrays on the store's devices: copies, per-device blocks stacked into one sharded array,
placement, and gathering sharded values through one host copy."""

from __future__ import annotations

import functools
import math
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxkv._src.errors import KVStoreError
from jaxkv._src.jax_internals import assemble, per_device, single_device, single_device_sharding
from jaxkv._src.processes import order
from jaxkv._src.state import buckets
from jaxkv._src.state.kvstate import FEW_VIEWS_FROM, Key, KVState, mesh_over
from jaxkv._src.state.pairing import is_traced

__all__ = [
    "Later",
    "as_pushed",
    "copies",
    "for_outs",
    "local_parts",
    "host_copy",
    "host_empty",
    "keyed_shardings",
    "place",
    "place_keyed",
    "place_leaves",
    "put",
    "replicate",
    "replicated_copies",
    "spare",
    "stacked",
    "stacked_sharding",
]


# Copies a computation made beside the values it stored (:func:`spare`), by the stored array's
# id: (a weak reference to that array, its copy). Each is handed out once, by :func:`copies`.
_SPARES: dict[int, tuple[Any, jax.Array]] = {}


def spare(values: Sequence[jax.Array], made: Sequence[jax.Array]) -> None:
    """Note ``made[j]``, a fresh buffer a computation made beside ``values[j]`` and equal to
    it (the same result returned twice: XLA gives each its own buffer), as the copy
    :func:`copies` gives of ``values[j]`` the first time it is asked for one, with no
    computation: a dense key updated in a push of rows across processes, then pulled into an
    out, costs no copy computation (and no wait for one). A spare is forgotten with its value
    (a store's next push replaces it) or once handed out."""
    for x, y in zip(values, made):
        key = id(x)
        _SPARES[key] = (weakref.ref(x, functools.partial(_forget, key)), y)


def _forget(key: int, ref: Any) -> None:
    got = _SPARES.get(key)
    if got is not None and got[0] is ref:
        _SPARES.pop(key, None)


def _spare_of(x: jax.Array) -> jax.Array | None:
    """The spare copy of ``x`` (:func:`spare`), taken (given once, to one caller of several
    threads), or ``None``."""
    got = _SPARES.pop(id(x), None)  # (an entry under a live array's id is its, or a dead one's)
    if got is None or got[0]() is not x:
        return None
    return got[1]


def copies(values: list[jax.Array]) -> list[jax.Array]:
    """Fresh buffers holding ``values``, with the same shardings.

    ``device_put`` may let a shard alias its source even with ``may_alias=False``; a stored
    value that aliased a user's array (or another key's value) would break donation. A value
    on other processes' devices too is copied shard by shard on this process's devices (one
    computation per device, none spanning processes): no collective, so no collective turn to
    wait for. A value with a spare copy made beside it (:func:`spare`) gets that copy.
    """
    if _SPARES:
        made = [_spare_of(v) for v in values]
        if any(x is not None for x in made):
            others = [v for v, x in zip(values, made) if x is None]
            more = iter(copies(others) if others else [])
            return [x if x is not None else next(more) for x in made]
    parts = [None if v.is_fully_addressable else local_parts(v) for v in values]
    across = [i for i, p in enumerate(parts) if p is not None]
    if not across:
        return order.ordered("copy", _copies, values)
    out = list(values)
    rest = [i for i in range(len(values)) if parts[i] is None]
    if rest:
        for i, x in zip(rest, order.ordered("copy", _copies, [values[i] for i in rest])):
            out[i] = x
    shards = [p for p in parts if p is not None]  # (in the order of across)
    by_device: dict[Any, list[tuple[int, int]]] = {}
    for j, own in enumerate(shards):
        for k, shard in enumerate(own):
            by_device.setdefault(single_device(shard), []).append((j, k))
    copied: list[list[Any]] = [[None] * len(own) for own in shards]
    for where in by_device.values():
        for (j, k), x in zip(where, _copies([shards[j][k] for j, k in where])):
            copied[j][k] = x
    for j, i in enumerate(across):
        v = values[i]
        out[i] = jax.make_array_from_single_device_arrays(v.shape, v.sharding, copied[j])
    return out


def local_parts(x: jax.Array) -> list[jax.Array] | None:
    """This process's single-device arrays of ``x``, or ``None`` where JAX holds them typed
    with ``x``'s whole sharding (a host value ``jax.device_put`` on several processes' devices
    is held so: its shards cannot be read one by one)."""
    try:
        parts = per_device(x)
    except ValueError:  # (the public route, JAXKV_NO_FAST_PATHS=1, refuses to read them)
        return None
    return parts if all(single_device(p) is not None for p in parts) else None


def for_outs(state: KVState, index: Sequence[int], lend: bool) -> list[jax.Array]:
    """The values at positions ``index`` of ``state`` (none split across devices) to give to a
    pull's outs: with ``lend``, the stored arrays themselves (the store keeps its values);
    else a key read through a view of its bucket gets that view (a fresh array no push
    donates) and a key kept as an array of its own a copy (one computation for all)."""
    values = state.values_at(index)
    if lend:
        return values
    layout = state.flat_layout
    own = [j for j, i in enumerate(index) if layout is None or layout.where[i][0] < 0]
    if own:
        for j, x in zip(own, copies([values[j] for j in own])):
            values[j] = x
    return values


class Later:
    """The values of keys in buckets that a pull into outs gives them (each key's view of its
    bucket), made when one of the outs is first read: a store that pulls a list into outs at
    every step and reads none of them before the next pull (MXNet's loop with ``nd.waitall``)
    makes none. Made, they are one computation with an array per key, as :func:`for_outs`
    makes them. Until then this holds the buckets (and nothing else of the state), so a push
    that may donate them must call :meth:`spare` first (the store's lending does)."""

    __slots__ = ("_layout", "_buckets", "_index", "_noted", "_values", "_lock", "__weakref__")

    def __init__(self, state: KVState, index: Sequence[int], noted: Any = None) -> None:
        layout = state.flat_layout
        assert layout is not None and all(layout.where[i][0] >= 0 for i in index)
        self._layout = layout
        self._buckets: list[jax.Array] | None = list(state.leaves[: len(layout.buckets)])
        self._index = index
        self._noted = noted  # called with the values made (the store notes what it lent)
        self._values: list[jax.Array] | None = None
        # Held while the values are made and while the buckets are spared: a push in another
        # thread then donates the store's buckets only once no making is still dispatching a
        # computation that reads them (JAX on CPU crashes calling one with a donated array).
        self._lock = threading.Lock()

    def values(self) -> list[jax.Array]:
        """The values, in the order of the key positions given (made at the first call)."""
        values = self._values
        if values is not None:
            return values
        with self._lock:
            if self._values is not None:  # (made meanwhile, by a read in another thread)
                return self._values
            leaves = self._buckets
            assert leaves is not None
            if any(x.is_deleted() for x in leaves):
                # (JAX on CPU crashes reading a donated array; the store spares its own)
                raise KVStoreError(
                    "an out of a pull is read after the store's arrays it was pulled from "
                    "were donated to a computation the store did not spare them for: its "
                    "value is lost; pull again"
                )
            layout = self._layout
            values = None
            keys = len(layout.where)
            if keys >= FEW_VIEWS_FROM and 2 * len(self._index) < keys:  # (those keys alone)
                values = buckets.eager_values_at(layout, leaves, self._index)
            if values is None:
                made = buckets.run(
                    "flat views", buckets.eager_views(buckets.bucket_layout(layout)), leaves
                )
                at = {i: n for n, i in enumerate(buckets.in_buckets(layout))}
                values = [made[at[i]] for i in self._index]
            self._buckets = None
            self._values = values
        if self._noted is not None:
            self._noted(values)
        return values

    def spare(self) -> None:
        """Hold copies of the buckets the values are made from, where they are not made yet:
        a push may then donate the store's own. Waits for a making under way in another
        thread (then there is nothing to spare)."""
        with self._lock:
            leaves = self._buckets
            if leaves is None or any(x.is_deleted() for x in leaves):
                return  # (made already; or lost already: a read raises)
            self._buckets = copies(leaves)


def put(values: Sequence[Any], shardings: Sequence[Any], agreed: bool = False) -> list[jax.Array]:
    """``jax.device_put`` of each value with its sharding. ``agreed``: every process holds the
    same values (:func:`jaxkv._src.processes.host.from_rank_zero`'s), so one put on the devices of
    several processes is made from this process's copy, without JAX's check that every process holds
    the same bytes (an all-gather of the whole value: most of an ``init``'s time across
    processes)."""
    out: list[Any] = [None] * len(values)
    rest = []
    for i, (x, sharding) in enumerate(zip(values, shardings)):
        if agreed and not sharding.is_fully_addressable:
            host: np.ndarray = np.asarray(x)
            out[i] = jax.make_array_from_callback(host.shape, sharding, host.__getitem__)
        else:
            rest.append(i)
    # A value already on other processes' devices too is moved by a computation with
    # collectives (a reshard; a collective-permute where the device orders differ): one value
    # per collective turn, as every computation over several processes takes its turn (those
    # issued together by one batched put hung in XLA:CPU's collective-permute, 2 processes of 4
    # devices moving a flax tree from a 2 x 4 mesh onto the store's).
    for i in [i for i in rest if _spans(values[i])]:
        out[i] = order.ordered("put", jax.device_put, values[i], shardings[i])
    # Any other value put on several processes' devices, in a turn of its own (order.put):
    # JAX checks that every process gives the same host value by an all-gather.
    for i in [i for i in rest if out[i] is None and not shardings[i].is_fully_addressable]:
        out[i] = order.put(values[i], shardings[i])
    rest = [i for i in rest if out[i] is None]
    if rest:
        placed = jax.device_put([values[i] for i in rest], [shardings[i] for i in rest])
        for i, x in zip(rest, placed):
            out[i] = x
    return out


def _spans(x: Any) -> bool:
    return isinstance(x, jax.Array) and not x.is_fully_addressable


@jax.jit
def _copies(values: list[jax.Array]) -> list[jax.Array]:
    return [jnp.copy(v) for v in values]


def replicated_copies(state: KVState, keys: Sequence[Key]) -> list[jax.Array]:
    """Fresh buffers holding the values of ``keys``, replicated on the store's devices.

    Sharded values are all-gathered by ``device_put`` (measured faster than XLA's all-gather on
    CPU devices); replicated ones are copied, so nothing handed out aliases the store.
    """
    values = [state[k] for k in keys]
    split = [buckets.is_split(state, state.index(k)) for k in keys]
    sharded = [i for i, s in enumerate(split) if s]
    replicated = [i for i, s in enumerate(split) if not s]
    out: list[Any] = [None] * len(values)
    if sharded:
        parts = [values[i] for i in sharded]
        if jax.process_count() > 1:  # device_put cannot reach other processes' shards
            gathered = _gathered(parts, state.sharding)
        else:
            gathered = _device_put(parts, state.sharding)
        for i, x in zip(sharded, gathered):
            out[i] = x
    if replicated:
        for i, x in zip(replicated, copies([values[i] for i in replicated])):
            out[i] = x
    return out


def _gathered(values: list[jax.Array], sharding: NamedSharding) -> list[jax.Array]:
    """``values`` (split across processes) replicated by ``sharding``: an all-gather across
    processes, run after this process's earlier collectives (see ``order._Order``)."""
    return order.ordered("all-gather of split values", _all_gather, values, sharding, spans=True)


@functools.partial(jax.jit, static_argnums=1)
def _all_gather(values: list[jax.Array], sharding: NamedSharding) -> list[jax.Array]:
    return [jax.lax.with_sharding_constraint(jnp.copy(v), sharding) for v in values]


def place(state: KVState, tree: Any) -> Any:
    """Inside ``jit``: constrain every leaf of ``tree`` to where the store keeps such a leaf."""
    return jax.tree_util.tree_map(
        lambda x: jax.lax.with_sharding_constraint(x, state.sharding_for(x.shape)), tree
    )


def place_leaves(state: KVState) -> KVState:
    """Inside ``jit``: ``state`` with every leaf constrained to where the store keeps it
    (``buckets.leaf_specs``: split buckets and their moments sharded, and so on)."""
    mesh = state.mesh
    return jax.tree_util.tree_map(
        lambda spec, x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec)),
        buckets.leaf_specs(state, state.axis),
        state,
    )


Keyed = tuple[tuple[Key, tuple[int, ...], NamedSharding], ...]


def keyed_shardings(state: KVState, keys: Sequence[Key]) -> Keyed:
    """For the keys of ``keys`` that have their own sharding along other axes (tensor
    parallelism): each key, its shape and where its value lives (hashable: a cache key)."""
    return tuple(
        (k, state.key_shapes[state.index(k)], state.sharding_of(k))
        for k in keys
        if state.tp_spec(k) is not None
    )


def place_keyed(state: KVState, tree: Any, keyed: Keyed) -> Any:
    """:func:`place`, where a leaf of a key's shape below that key in ``tree`` (an optax
    state's ``{key: leaf}``) lives as that key's value does (``keyed``)."""
    if not keyed:
        return place(state, tree)
    shapes = {k: shape for k, shape, _ in keyed}
    shardings = {k: sharding for k, _, sharding in keyed}

    def one(path: Any, x: Any) -> Any:
        k = buckets.leaf_owner(path, tuple(x.shape), shapes)
        where = state.sharding_for(x.shape) if k is None else shardings[k]
        return jax.lax.with_sharding_constraint(x, where)

    return jax.tree_util.tree_map_with_path(one, tree)


@functools.lru_cache(maxsize=256)
def _zeros(shape: tuple[int, ...], dtype: Any, device: jax.Device) -> jax.Array:
    return jnp.zeros(shape, dtype, device=device)


def as_pushed(state: KVState, x: jax.Array, device: jax.Device | None) -> jax.Array | None:
    """One contribution ``x`` (on ``device``, ``single_device(x)``) as a push computation takes
    it without a put: on a store of one device, ``x`` where it lies on that device, whatever
    sharding it was given; else ``None`` (it is put on the key's sharding first). The general
    path and a replayed plan both ask this, so that they pass alike placed values and run
    one computation, compiled once."""
    return x if len(state.devices) == 1 and device == state.devices[0] else None


@functools.lru_cache(maxsize=64)
def stacked_sharding(mesh: Mesh) -> NamedSharding:
    """Blocks laid side by side along axis 0, one per device of the store's ``mesh``."""
    return NamedSharding(mesh, PartitionSpec(mesh.axis_names[0]))


def stacked(state: KVState, stored: jax.Array, blocks: dict | list, dtype: Any) -> jax.Array:
    """One array of shape ``(D * n, ...)`` sharded over the mesh, whose block on each of this
    process's devices is ``blocks[device]`` (zeros where absent), for a value of shape
    ``(n, ...)``; the blocks are used in place, not copied. Scalars travel as shape ``(1,)``.
    ``blocks`` may also be a list holding one block per device of this process, in mesh order.
    """
    shard_shape = stored.shape or (1,)
    if isinstance(blocks, dict):  # mesh order; all devices in a single-process job
        blocks = [
            blocks[d] if d in blocks else _zeros(shard_shape, dtype, d)
            for d in state.local_positions
        ]
    shards = [x if x.shape == shard_shape else x.reshape(shard_shape) for x in blocks]
    global_shape = (shard_shape[0] * len(state.devices), *shard_shape[1:])
    return assemble(global_shape, stacked_sharding(state.mesh), shards)


def replicate(values: Sequence[jax.Array], devices: tuple[jax.Device, ...]) -> list[jax.Array]:
    """``values`` replicated on exactly ``devices`` (no copy where they already are)."""
    if any(is_traced(v) for v in values):
        raise KVStoreError(
            f"devices={list(devices)}: expected an eager call; inside jit the caller's "
            "shardings decide where values live"
        )
    sharding: jax.sharding.Sharding
    if len(devices) == 1:
        sharding = single_device_sharding(devices[0])
    else:
        sharding = NamedSharding(mesh_over(devices), PartitionSpec())
    if all(v.is_fully_addressable for v in values):
        return _device_put(list(values), sharding)
    # A multi-process job: each process copies from a whole copy of its own (gathered first
    # where the value is split across processes); a target beyond this process's devices is
    # filled from host memory, as device_put cannot move arrays between processes.
    values = list(values)
    split = [i for i, v in enumerate(values) if not v.is_fully_replicated]
    if split:
        gathered = _gathered([values[i] for i in split], _whole(values[split[0]]))
        for i, x in zip(split, gathered):
            values[i] = x
    local = [v.addressable_shards[0].data if not v.is_fully_addressable else v for v in values]
    me = jax.process_index()
    if any(d.process_index != me for d in devices):
        # Every process holds the same whole copies (of replicated values): each fills its own
        # devices from its own, with no all-gather checking that they agree (JAX's, at a put of
        # a host value onto several processes' devices: a collective outside jaxkv's turns).
        hosts = [np.asarray(v) for v in local]
        return put(hosts, [sharding] * len(hosts), agreed=True)
    return _device_put(local, sharding)


def _whole(x: jax.Array) -> NamedSharding:
    """Replicated over the mesh of ``x``'s sharding, or where it has none (an eager view of a
    split bucket placed by XLA: a ``GSPMDSharding`` on older JAX) over its devices in id
    order, the same in every process."""
    mesh = getattr(x.sharding, "mesh", None)
    if mesh is None:
        mesh = mesh_over(tuple(sorted(x.sharding.device_set, key=lambda d: d.id)))  # type: ignore[attr-defined]
    return NamedSharding(mesh, PartitionSpec())


def _device_put(values: list[jax.Array], sharding: Any) -> list[jax.Array]:
    """``jax.device_put`` of each of ``values`` to ``sharding``; values sharded over CPU devices
    of this process go through one host buffer of their own (see :func:`host_copy`)."""
    copies = [host_copy(v) for v in values]
    sources = [v if h is None else h for v, h in zip(values, copies)]
    # An array already placed so (a view XLA made whole on every device) is copied all the
    # same: what is handed out must never be the store's own array.
    alias = [False if h is None else None for h in copies]
    return list(jax.device_put(sources, [sharding] * len(values), may_alias=alias))


def host_copy(x: jax.Array) -> np.ndarray | None:
    """``x``'s value gathered into a fresh 64-byte-aligned host buffer, if ``x`` is split over
    several CPU devices of this process; else ``None``.

    CPU devices share host memory, and ``device_put`` of an aligned NumPy array to CPU devices
    lets every device read that one buffer (JAX's own behaviour; an executable given such an
    array with donation writes its result elsewhere), so a pull writes one copy, not one per
    device. JAX's route from a sharded array would also keep a host copy cached on the stored
    value for as long as that lives.
    """
    sharding = x.sharding
    devices: set[jax.Device] = sharding.device_set
    if (
        len(devices) < 2
        or x.is_fully_replicated
        or not x.is_fully_addressable
        or any(d.platform != "cpu" for d in devices)
    ):
        return None
    host = host_empty(x.shape, np.dtype(x.dtype))
    where = _indices(sharding, x.shape)
    for shard in per_device(x):
        host[where[single_device(shard)]] = np.asarray(shard)  # reads the buffer in place
    return host


@functools.lru_cache(maxsize=1024)
def _indices(sharding: Any, shape: tuple[int, ...]) -> Mapping[jax.Device, Any]:
    """Which part of an array of ``shape`` each device holds (cached: JAX computes it anew for
    every shard it describes)."""
    return sharding.devices_indices_map(shape)


_ALIGN = 64  # bytes; XLA's CPU runtime reads host buffers in place only if so aligned


def host_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return raw[start : start + nbytes].view(dtype).reshape(shape)
