"""Pure operations on a :class:`KVState`: ``init``, ``push``, ``pull``, ``pushpull``,
``row_sparse_pull``.

Eagerly, one ``push`` is one jitted computation for all its keys: per-device contributions are
assembled (without copying) into one array sharded over the store's mesh and summed with a
``psum``; then the updater runs once per distinct key. The compiled computation is cached per
(devices, key set, contribution layout, updater, donation); JAX adds shapes and dtypes, so
pushing the same structure again never recompiles.

Inside a trace (the user's ``jit``, ``pmap`` or ``shard_map``) the same updater logic runs in
the caller's trace, and ``axis_name`` sums each value over the mapped axis exactly once.
"""

from __future__ import annotations

import collections
import functools
import logging
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from ._errors import DuplicateKeyError, KeyTypeError, KVStoreError, ShapeError
from ._state import (
    AXIS,
    BIGARRAY_BOUND,
    Key,
    KVState,
    _mesh,
    check_compressible,
    compression_config,
    key_kind,
    normalize_key,
)

__all__ = ["Updater", "init", "pull", "push", "pushpull", "row_sparse_pull", "set_compression"]

try:  # the concrete class of eager jax.Arrays: cheaper to test for than the jax.Array ABC
    from jax._src.array import ArrayImpl as _ArrayImpl
except ImportError:  # another JAX: the public routes below still work
    _ArrayImpl = None

logger = logging.getLogger("jaxkv")
_MISSING = object()


class Updater(Protocol):
    """How a pushed value is merged into the stored one.

    Called once per distinct key of a push, inside ``jit``, with the key (a Python ``int`` or
    ``str``), the pushed value summed over devices (already cast to the stored dtype) and the
    stored value; returns the new stored value, of the stored shape. The default is assign.
    An ``optax.GradientTransformation`` may be given instead: the pushed value is then the
    gradient, and the optimizer state is kept in the ``KVState``.
    """

    def __call__(self, key: Key, pushed: jax.Array, stored: jax.Array) -> jax.Array: ...


# ---------------------------------------------------------------------------------------------
# Pairing keys with values, as MXNet does.
# ---------------------------------------------------------------------------------------------
def _as_list(v: Any) -> list:
    return list(v) if isinstance(v, list | tuple) else [v]


def pairs(keys: Any, values: Any, what: str) -> list[tuple[Key, list]]:
    """MXNet's pairing: ``(key, value)``, ``(key, [per-device values])``, ``([keys], [values])``,
    ``([keys], [[per-device values], ...])``, or one mapping ``{key: value}``.

    Returns a list of ``(key, [values])`` in call order; keys may repeat.
    """
    if values is _MISSING:
        if not isinstance(keys, Mapping):
            raise KVStoreError(
                f"expected a mapping {{key: {what[:-1]}}} or keys and {what}, "
                f"given only {type(keys).__name__} {keys!r}"
            )
        keys, values = list(keys.keys()), list(keys.values())
    if isinstance(keys, list | tuple):
        if not isinstance(values, list | tuple) or len(values) != len(keys):
            given = f"{len(values)} {what}" if isinstance(values, list | tuple) else "one"
            raise ShapeError(
                f"keys {list(keys)!r}: expected {len(keys)} {what} (one per key), given {given}"
            )
        out = [(normalize_key(k), _as_list(v)) for k, v in zip(keys, values)]
    else:
        out = [(normalize_key(keys), _as_list(values))]
    for k, vs in out:
        if not vs:
            raise ShapeError(f"key {k!r}: expected at least one {what[:-1]}, given an empty list")
    return out


def _is_traced(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def _as_array(x: Any) -> jax.Array:
    if type(x) is _ArrayImpl or isinstance(x, jax.Array):  # the first test is the cheap one
        return x
    if hasattr(x, "__jax_array__"):
        return x.__jax_array__()
    return jnp.asarray(x)


def _check_value(key: Key, x: jax.Array, stored: Any, what: str) -> None:
    if tuple(x.shape) != tuple(stored.shape):
        raise ShapeError(
            f"key {key!r}: {what} has shape {tuple(x.shape)}, expected the stored shape "
            f"{tuple(stored.shape)} (dtype {stored.dtype})"
        )
    if x.dtype.kind == "c" and stored.dtype.kind != "c":
        raise KVStoreError(
            f"key {key!r}: {what} has dtype {x.dtype}, expected a real dtype castable to the "
            f"stored {stored.dtype}"
        )


# ---------------------------------------------------------------------------------------------
# init
# ---------------------------------------------------------------------------------------------
def init(state: KVState, keys: Any, values: Any = _MISSING) -> KVState:
    """A new state with ``keys`` added, holding copies of ``values`` on the store's devices.

    Args:
      state: the store.
      keys: a key, a list of keys, or a mapping ``{key: value}`` (then omit ``values``).
      values: one array per key.

    Returns:
      The new state; ``state`` is unchanged.

    Raises:
      DuplicateKeyError: a key is already in the store, or repeats in the call.
      KeyTypeError: a key is not int/str, or its kind differs from the store's keys.

    Examples:
      >>> import jax.numpy as jnp, jaxkv
      >>> s = jaxkv.init(jaxkv.empty(), [3, 5], [jnp.ones(2), jnp.zeros(2)])
      >>> s.keys()
      (3, 5)
    """
    new: dict[Key, jax.Array] = {}
    kind = state.key_kind
    for key, vs in pairs(keys, values, "values"):
        kind = kind or key_kind(key)
        if key_kind(key) != kind:
            raise KeyTypeError(
                f"key {key!r}: expected {kind} keys, given a {key_kind(key)} key (one store "
                "holds one kind of key, as in MXNet)"
            )
        if key in state or key in new:
            raise DuplicateKeyError(
                f"duplicate init of key {key!r}: expected a key not yet in the store, given "
                f"{key!r}, which is already there"
                + (" (init takes one value per key)" if len(vs) > 1 else "")
            )
        if len(vs) != 1:
            raise ShapeError(
                f"key {key!r}: init expects one value, given a list of {len(vs)} values"
            )
        new[key] = _as_array(vs[0])
        check_compressible(state.compression, key, new[key].dtype)
    eager = [k for k, x in new.items() if not _is_traced(x)]
    if eager:
        xs = [new[k] for k in eager]
        placed = jax.device_put(xs, [state.sharding_for(x.shape) for x in xs])
        new.update(zip(eager, copies(placed)))
    residuals = {}
    if state.compression is not None and state.compression[0] == "2bit":
        if len(eager) < len(new):
            raise KVStoreError(
                f"keys {list(new)}: a store with gradient compression expects "
                "eager values, given traced ones"
            )
        residuals = {k: residual_zeros(state, x) for k, x in new.items()}
    return state.replace(values=new, residuals=residuals)


def set_compression(state: KVState, params: Mapping[str, Any] | None) -> KVState:
    """``state`` with MXNet-style gradient compression set (or removed with ``None``).

    ``{'type': '2bit', 'threshold': t}`` starts every key's residual at zero.
    """
    config = compression_config(params)
    for key in state.keys():
        check_compressible(config, key, state[key].dtype)
    with_config = state.replace(compression=config, residuals={k: None for k in state.keys()})
    if config is None or config[0] != "2bit":
        return with_config
    return with_config.replace(residuals={k: residual_zeros(state, state[k]) for k in state.keys()})


@jax.jit
def copies(values: list[jax.Array]) -> list[jax.Array]:
    """Fresh buffers holding ``values``, with the same shardings.

    ``device_put`` may let a shard alias its source even with ``may_alias=False``; a stored
    value that aliased a user's array (or another key's value) would break donation.
    """
    return [jnp.copy(v) for v in values]


def replicated_copies(state: KVState, keys: Sequence[Key]) -> list[jax.Array]:
    """Fresh buffers holding the values of ``keys``, replicated on the store's devices.

    Sharded values are all-gathered by ``device_put`` (measured faster than XLA's all-gather on
    CPU devices); replicated ones are copied, so nothing handed out aliases the store.
    """
    values = [state[k] for k in keys]
    sharded = [i for i, v in enumerate(values) if state.is_sharded(v.shape)]
    replicated = [i for i, v in enumerate(values) if not state.is_sharded(v.shape)]
    out: list[Any] = [None] * len(values)
    if sharded:
        parts = [values[i] for i in sharded]
        if jax.process_count() > 1:  # device_put cannot reach other processes' shards
            gathered = _all_gather(parts, state.sharding)
        else:
            gathered = _device_put(parts, state.sharding)
        for i, x in zip(sharded, gathered):
            out[i] = x
    if replicated:
        for i, x in zip(replicated, copies([values[i] for i in replicated])):
            out[i] = x
    return out


def init_opt_states(state: KVState, optimizer: Any, keys: Sequence[Key]) -> KVState:
    """``state`` with fresh optimizer states for ``keys`` (one compiled computation).

    Done before the first optimizer push, so that the push computation sees the same state
    structure from its first call on and never compiles a second time.
    """
    if not keys:
        return state
    init = _opt_initialiser(optimizer, state.devices, state.bigarray_bound)
    return state.replace(opt_states=dict(zip(keys, init([state[k] for k in keys]))))


@functools.lru_cache(maxsize=64)
def _opt_initialiser(optimizer: Any, devices: tuple, bound: int | None) -> Callable:
    layout = KVState((), devices, (), (), bound)  # only its placement rules are used
    return jax.jit(lambda vs: place(layout, [optimizer.init(v) for v in vs]))


@functools.partial(jax.jit, static_argnums=1)
def _all_gather(values: list[jax.Array], sharding: NamedSharding) -> list[jax.Array]:
    return [jax.lax.with_sharding_constraint(jnp.copy(v), sharding) for v in values]


def place(state: KVState, tree: Any) -> Any:
    """Inside ``jit``: constrain every leaf of ``tree`` to where the store keeps such a leaf."""
    return jax.tree_util.tree_map(
        lambda x: jax.lax.with_sharding_constraint(x, state.sharding_for(x.shape)), tree
    )


# ---------------------------------------------------------------------------------------------
# push
# ---------------------------------------------------------------------------------------------
def _group(state: KVState, keys: Any, values: Any) -> dict[Key, list[jax.Array]]:
    """Validated contributions per distinct key, in a canonical (sorted) key order."""
    grouped: dict[Key, list[jax.Array]] = {}
    for key, vs in pairs(keys, values, "values"):
        i = state.index(key)
        stored = state._values[i]
        arrays = []
        for n, v in enumerate(vs):
            x = _as_array(v)
            what = "the pushed value" if len(vs) == 1 else f"pushed value {n}"
            _check_value(key, x, stored, what)
            arrays.append(x)
        grouped.setdefault(key, []).extend(arrays)
    return {k: grouped[k] for k in sorted(grouped)}


def _apply(updater: Any, key: Key, pushed: jax.Array, stored: jax.Array, opt_state: Any):
    """Run ``updater`` for one key; returns ``(new_stored, new_opt_state)``."""
    if updater is None:
        new = pushed
    elif isinstance(updater, optax.GradientTransformation):
        if opt_state is None:
            opt_state = updater.init(stored)
        updates, opt_state = updater.update(pushed, opt_state, stored)
        new = optax.apply_updates(stored, updates)
    else:
        new = updater(key, pushed, stored)
        if new is None:
            raise KVStoreError(
                f"key {key!r}: the updater returned None, expected the new stored value. "
                "MXNet-style in-place updaters (stored += ...) work through jaxkv.KVStore; "
                "a functional updater must return the new value"
            )
    new = _as_array(new)
    if tuple(new.shape) != tuple(stored.shape):
        raise ShapeError(
            f"key {key!r}: the updater returned shape {tuple(new.shape)}, expected the stored "
            f"shape {tuple(stored.shape)}"
        )
    return new.astype(stored.dtype), opt_state


def _axis_sum(x: jax.Array, axis_name: Any) -> jax.Array:
    """Sum ``x`` over the mapped axes ``axis_name`` exactly once.

    Under ``shard_map`` with varying-axis tracking, a value invariant along an axis (e.g. the
    gradient of a replicated parameter, which JAX has already summed) is left as it is. Under
    ``pmap`` (no tracking) every value is per-device and is summed.
    """
    names = axis_name if isinstance(axis_name, tuple | list) else (axis_name,)
    todo = []
    for name in names:
        try:
            tracked = name in jax.typeof(jax.lax.axis_index(name)).manual_axis_type.varying
        except NameError as e:
            raise KVStoreError(
                f"axis_name {name!r}: expected an axis bound by an enclosing pmap or shard_map, "
                f"given one that is not bound here ({e})"
            ) from None
        if not tracked or name in jax.typeof(x).manual_axis_type.varying:
            todo.append(name)
    return jax.lax.psum(x, tuple(todo)) if todo else x


def single_device(x: jax.Array) -> jax.Device | None:
    """The device ``x`` lives on, or ``None`` if it spans several."""
    sharding = x.sharding
    if type(sharding) is SingleDeviceSharding:  # the common case, without building a set
        return sharding._device
    devices = sharding.device_set
    return next(iter(devices)) if len(devices) == 1 else None


@functools.lru_cache(maxsize=256)
def _zeros(shape: tuple[int, ...], dtype: Any, device: jax.Device) -> jax.Array:
    return jnp.zeros(shape, dtype, device=device)


@functools.lru_cache(maxsize=64)
def _stacked_sharding(devices: tuple[jax.Device, ...]) -> NamedSharding:
    return NamedSharding(_mesh(devices), PartitionSpec(AXIS))


def _assemble(shape: tuple[int, ...], sharding: NamedSharding, shards: list[jax.Array]):
    """``jax.make_array_from_single_device_arrays`` for shards already in the mesh's device
    order, with the same shape and dtype; skips the public function's per-call checks (a third
    of a push's host time on 193 keys) where this JAX offers that."""
    try:
        aval = _aval(shape, shards[0].dtype)
        return _ArrayImpl(aval, sharding, shards, committed=True, _skip_checks=True)
    except TypeError:
        return jax.make_array_from_single_device_arrays(shape, sharding, shards)


@functools.lru_cache(maxsize=4096)
def _aval(shape: tuple[int, ...], dtype: Any) -> Any:
    from jax._src.core import ShapedArray

    return ShapedArray(shape, dtype)


def _layout(state: KVState, stored: jax.Array, xs: list[jax.Array]) -> tuple[str, jax.Array]:
    """Prepare one key's eager contributions for the push computation.

    Returns ``('one', x)`` with ``x`` on the store's devices (no reduction needed), or
    ``('stacked', x)`` with the per-device values laid side by side along axis 0 of one array
    sharded over the store's mesh (no copy), to be summed there.
    """
    multiprocess = jax.process_count() > 1  # each worker's values are summed over workers
    if len(xs) == 1 and not multiprocess:
        return "one", jax.device_put(xs[0], state.sharding_for(stored.shape))
    devices = [single_device(x) for x in xs]
    positions = state.local_positions
    if len(set(devices)) == len(devices) and all(d in positions for d in devices):
        dtype = xs[0].dtype
        if any(x.dtype != dtype for x in xs):
            xs, dtype = [x.astype(stored.dtype) for x in xs], stored.dtype
        if len(devices) == len(positions) and all(map(operator.eq, devices, positions)):
            return "stacked", _stacked(state, stored, xs, dtype)  # one per device, in order
        return "stacked", _stacked(state, stored, dict(zip(devices, xs)), dtype)
    # Several values on one device, or off the store's devices: sum them in call order there.
    target = state.sharding_for(stored.shape)
    placed = [jax.device_put(x.astype(stored.dtype), target) for x in xs]
    return "one", functools.reduce(operator.add, placed)


# Values below this many elements are summed together through one flat buffer (one collective
# for many small arrays); larger ones are reduce-scattered one by one, which XLA's CPU
# collectives do much faster than an all-reduce.
_FUSE_LIMIT = BIGARRAY_BOUND


def _scatters(state: KVState, shape: tuple[int, ...]) -> bool:
    """Whether a pushed value of ``shape`` is reduce-scattered (else fused into an all-reduce)."""
    n = len(state.devices)
    return state.is_sharded(shape) or (
        len(shape) > 0 and shape[0] % n == 0 and math.prod(shape) >= _FUSE_LIMIT
    )


# Scattered values below this many elements are reduce-scattered together, through one flat
# buffer: XLA's CPU collectives cost ~0.3 ms each however small the array.
_SCATTER_FUSE_LIMIT = 1 << 18


def _fused_psum(blocks: list[jax.Array]) -> list[jax.Array]:
    """``psum`` of several blocks of one dtype through one flat buffer (one collective)."""
    if len(blocks) == 1:
        return [jax.lax.psum(blocks[0], AXIS)]
    flat = jax.lax.psum(jnp.concatenate([b.reshape(-1) for b in blocks]), AXIS)
    offsets = np.cumsum([0] + [b.size for b in blocks])
    return [flat[a:z].reshape(b.shape) for b, a, z in zip(blocks, offsets[:-1], offsets[1:])]


def _fused_psum_scatter(blocks: list[jax.Array], n: int) -> list[jax.Array]:
    """Tiled ``psum_scatter`` along axis 0 of several blocks through one flat buffer.

    Each block (first dimension divisible by ``n``) is viewed as ``(n, -1)``, so that row ``i``
    holds the rows device ``i`` keeps; the views are concatenated along axis 1, reduce-scattered
    once, and split back.
    """
    if len(blocks) == 1:
        return [jax.lax.psum_scatter(blocks[0], AXIS, scatter_dimension=0, tiled=True)]
    cat = jnp.concatenate([b.reshape(n, -1) for b in blocks], axis=1)
    mine = jax.lax.psum_scatter(cat, AXIS, scatter_dimension=0, tiled=True)[0]
    offsets = np.cumsum([0] + [b.size // n for b in blocks])
    return [
        mine[a:z].reshape((b.shape[0] // n, *b.shape[1:]))
        for b, a, z in zip(blocks, offsets[:-1], offsets[1:])
    ]


def _sum_over_devices(blocks: list[jax.Array], scatter: list[bool]) -> list[jax.Array]:
    """Inside ``shard_map``: sum each key's per-device block over the mesh axis.

    Where ``scatter`` says so the sum is reduce-scattered (each device keeps its 1/D of it;
    callers all-gather values that are stored replicated); big blocks one by one, smaller ones
    together. The others are summed with one ``psum`` per dtype over their concatenation.
    Tensor fusion matters: one collective per small array would cost far more than the data.
    """
    n = jax.lax.axis_size(AXIS)
    out: list[Any] = [None] * len(blocks)
    groups: dict[tuple, list[int]] = {}
    for i, (b, s) in enumerate(zip(blocks, scatter)):
        if s and b.size >= _SCATTER_FUSE_LIMIT:
            out[i] = jax.lax.psum_scatter(b, AXIS, scatter_dimension=0, tiled=True)
        else:
            groups.setdefault((s, b.dtype), []).append(i)
    for (s, _), idx in groups.items():
        parts = [blocks[i] for i in idx]
        summed = _fused_psum_scatter(parts, n) if s else _fused_psum(parts)
        for i, x in zip(idx, summed):
            out[i] = x
    return out


class _PushCache:
    """Jitted push computations, one per static signature, least recently used dropped first."""

    def __init__(self, size: int = 256):
        self._size = size
        self._fns: collections.OrderedDict = collections.OrderedDict()

    def get(self, state: KVState, keys, kinds, updater, donate) -> Callable:
        sig = (
            state.devices,
            state.bigarray_bound,
            state.compression,
            keys,
            kinds,
            id(updater),
            donate,
        )
        entry = self._fns.get(sig)
        if entry is not None and entry[0] is updater:
            self._fns.move_to_end(sig)
            return entry[1]
        fn = _build_push(state, keys, kinds, updater, donate)
        logger.debug("jaxkv: new push signature (%d keys, donate=%s)", len(keys), donate)
        self._fns[sig] = (updater, fn)  # holding updater keeps its id from being reused
        if len(self._fns) > self._size:
            self._fns.popitem(last=False)
        return fn


def _build_push(state: KVState, keys, kinds, updater, donate) -> Callable:
    """The jitted push for one signature. ``state`` supplies only static facts (mesh, bound,
    compression); the cached computation keeps none of its arrays."""
    state = state._placement()
    compressed = [i for i, kind in enumerate(kinds) if kind[0] == "compressed"]
    stacked = [i for i, kind in enumerate(kinds) if kind != "one"]

    def run(stored, opt_states, residuals, pushed):
        inputs = {id(x) for x in pushed}
        pushed = [x.astype(s.dtype) for x, s in zip(pushed, stored)]
        inputs.update(id(x) for x in pushed)
        residuals = list(residuals)
        if compressed:
            quantized, kept = jax.shard_map(
                functools.partial(_compress, state.compression, [kinds[i][1] for i in compressed]),
                mesh=state.mesh,
                in_specs=PartitionSpec(AXIS),
                out_specs=PartitionSpec(AXIS),
            )([pushed[i] for i in compressed], [residuals[i] for i in compressed])
            for i, q, r in zip(compressed, quantized, kept):
                pushed[i], residuals[i] = q, r
        if stacked:
            scatter = [_scatters(state, stored[i].shape) for i in stacked]
            summed = jax.shard_map(
                functools.partial(_sum_over_devices, scatter=scatter),
                mesh=state.mesh,
                in_specs=PartitionSpec(AXIS),
                out_specs=[PartitionSpec(AXIS) if s else PartitionSpec() for s in scatter],
            )([pushed[i] for i in stacked])
            for i, x in zip(stacked, summed):
                pushed[i] = x.reshape(stored[i].shape)
        results = [_apply(updater, *args) for args in zip(keys, pushed, stored, opt_states)]
        # A pushed array returned as is (assign) would be forwarded by jit, and the store would
        # share the caller's buffer; a later donating push would then delete the caller's array.
        values = [jnp.copy(v) if id(v) in inputs else v for v, _ in results]
        return place(state, values), place(state, [o for _, o in results]), residuals

    return jax.jit(run, donate_argnums=(0, 1, 2) if donate else ())


def _compress(config: tuple, masks: list[tuple[bool, ...]], blocks, residuals):
    """Inside ``shard_map``: each device compresses its own block before the sum, as MXNet does.

    ``('2bit', t)``: error feedback. The device adds its block to its residual, sends ``+t``
    where that reaches ``t``, ``-t`` where it reaches ``-t``, else 0, and keeps the rest as its
    new residual. ``('fp16',)`` / ``('bf16',)``: the block is rounded to that type. ``masks``
    say which devices pushed a value for the key; the others send 0 and keep their residual.
    """
    me = jax.lax.axis_index(AXIS)
    quantized, kept = [], []
    for block, residual, mask in zip(blocks, residuals, masks):
        present = jnp.asarray(mask)[me]
        if config[0] == "2bit":
            t = jnp.asarray(config[1], block.dtype)
            acc = residual + block
            q = jnp.where(acc >= t, t, jnp.where(acc <= -t, -t, jnp.zeros_like(t)))
            q = jnp.where(present, q, jnp.zeros_like(q))
            kept.append(jnp.where(present, acc - q, residual))
        else:
            low = jnp.float16 if config[0] == "fp16" else jnp.bfloat16
            q = block.astype(low).astype(block.dtype)
            kept.append(residual)
        quantized.append(q)
    return quantized, kept


def _layout_compressed(state: KVState, key: Key, stored: jax.Array, xs: list[jax.Array]):
    """Like :func:`_layout` for a compressed store: always one block per device (devices that
    pushed nothing get zeros), plus the static mask of devices that pushed."""
    positions = state.local_positions
    by_device: dict[jax.Device, list[jax.Array]] = {}
    for x in xs:
        device = single_device(x)
        if device not in positions:
            raise KVStoreError(
                f"key {key!r}: a compressed push expects each value on one of the store's "
                f"devices {list(state.devices)}, given one on {sorted(x.devices(), key=str)}"
            )
        by_device.setdefault(device, []).append(x)
    blocks = {}
    for device, parts in by_device.items():
        x = functools.reduce(operator.add, parts)  # several values on one device: their sum
        blocks[device] = x if x.dtype == stored.dtype else x.astype(stored.dtype)
    mask = tuple(d in blocks for d in state.devices)
    return ("compressed", mask), _stacked(state, stored, blocks, stored.dtype)


def _stacked(state: KVState, stored: jax.Array, blocks: dict | list, dtype: Any) -> jax.Array:
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
    return _assemble(global_shape, _stacked_sharding(state.devices), shards)


def residual_layout(state: KVState, shape: tuple[int, ...]) -> tuple[tuple, NamedSharding]:
    """Shape and sharding of the residual of a value of ``shape``: one block per device."""
    block = tuple(shape) or (1,)
    return (block[0] * len(state.devices), *block[1:]), _stacked_sharding(state.devices)


def residual_zeros(state: KVState, stored: jax.Array) -> jax.Array:
    """A zero residual for a value like ``stored``."""
    shape, sharding = residual_layout(state, stored.shape)
    return jnp.zeros(shape, stored.dtype, device=sharding)


_PUSH_CACHE = _PushCache()


def push(
    state: KVState,
    keys: Any,
    values: Any = _MISSING,
    *,
    updater: Updater | optax.GradientTransformation | None = None,
    axis_name: Any = None,
    donate: bool = False,
) -> KVState:
    """A new state with ``values`` pushed to ``keys``.

    Each value is one array or a list of arrays (one per device), which are summed; duplicate
    keys in one call are summed together. Then ``updater(key, pushed, stored)`` runs once per
    distinct key (default: assign). Values of another dtype are cast to the stored dtype.

    Args:
      state: the store.
      keys: a key, a list of keys, or a mapping ``{key: value}`` (then omit ``values``).
      values: per key, an array or a list of per-device arrays.
      updater: an :class:`Updater` or an ``optax.GradientTransformation``; ``None`` assigns.
      axis_name: inside ``pmap``/``shard_map``, the mapped axis (or axes) to sum over. Values
        that JAX has already made invariant along it (``shard_map``) are not summed again.
      donate: let the computation reuse the buffers of ``state`` (which then becomes invalid).

    Returns:
      The new state. Unless ``donate=True``, ``state`` stays valid and unchanged.

    Raises:
      UnknownKeyError: a key was never initialised.
      ShapeError: a value's shape differs from the stored one, or keys and values do not pair.
      KVStoreError: any other refusal; in every case nothing has changed.

    Examples:
      >>> import jax.numpy as jnp, jaxkv
      >>> s = jaxkv.init(jaxkv.empty(), {"w": jnp.zeros(2)})
      >>> s = jaxkv.push(s, "w", [jnp.ones(2), jnp.ones(2)])
      >>> jaxkv.pull(s, "w").tolist()
      [2.0, 2.0]
    """
    grouped = _group(state, keys, values)
    if isinstance(updater, optax.GradientTransformation):
        opt_states = state.opt_states
        fresh = [k for k in grouped if opt_states[k] is None]
        eager = not any(_is_traced(x) for k in fresh for x in (state[k], *grouped[k]))
        if fresh and eager:
            state = init_opt_states(state, updater, fresh)
    index = [state.index(k) for k in grouped]
    stored = [state._values[i] for i in index]
    opts = [state._opt_states[i] for i in index]
    traced = any(_is_traced(x) for xs in grouped.values() for x in xs) or any(
        _is_traced(x) for x in jax.tree_util.tree_leaves((stored, opts))
    )
    if traced:
        if state.compression is not None:
            raise KVStoreError(
                f"keys {list(grouped)}: a store with gradient compression {state.compression} "
                "expects eager pushes, given traced values (inside jit, compress with the "
                "caller's own code)"
            )
        new_v, new_o = {}, {}
        for (key, xs), s, o in zip(grouped.items(), stored, opts):
            total = functools.reduce(operator.add, [x.astype(s.dtype) for x in xs])
            if axis_name is not None:
                total = _axis_sum(total, axis_name)
            new_v[key], new_o[key] = _apply(updater, key, total, s, o)
        return state.replace(new_v, new_o)
    if axis_name is not None:
        raise KVStoreError(
            f"axis_name={axis_name!r}: expected to be called inside pmap or shard_map, given an "
            "eager call (eagerly, a list of per-device values is already summed over devices)"
        )
    if state.compression is None:
        layouts = [_layout(state, s, xs) for s, xs in zip(stored, grouped.values())]
    else:
        layouts = [
            _layout_compressed(state, k, s, xs) for (k, xs), s in zip(grouped.items(), stored)
        ]
    kinds, pushed = zip(*layouts)
    residuals = [state._residuals[i] for i in index]
    fn = _PUSH_CACHE.get(state, tuple(grouped), kinds, updater, donate)
    new_values, new_opts, new_residuals = fn(stored, opts, residuals, list(pushed))
    return state.replace(
        dict(zip(grouped, new_values)),
        dict(zip(grouped, new_opts)),
        dict(zip(grouped, new_residuals)),
    )


# ---------------------------------------------------------------------------------------------
# pull
# ---------------------------------------------------------------------------------------------
def devices_of(devices: Any) -> tuple[jax.Device, ...]:
    """A device, a context, or a list of them, as a tuple of JAX devices."""
    from ._context import Context

    items = list(devices) if isinstance(devices, list | tuple) else [devices]
    out = tuple(d.device if isinstance(d, Context) else d for d in items)
    if not out or not all(isinstance(d, jax.Device) for d in out) or len(set(out)) != len(out):
        raise KVStoreError(
            f"devices: expected a device or a list of distinct devices, given {devices!r}"
        )
    return out


def replicate(values: Sequence[jax.Array], devices: tuple[jax.Device, ...]) -> list[jax.Array]:
    """``values`` replicated on exactly ``devices`` (no copy where they already are)."""
    if any(_is_traced(v) for v in values):
        raise KVStoreError(
            f"devices={list(devices)}: expected an eager call; inside jit the caller's "
            "shardings decide where values live"
        )
    if len(devices) == 1:
        sharding = SingleDeviceSharding(devices[0])
    else:
        sharding = NamedSharding(_mesh(devices), PartitionSpec())
    return _device_put(list(values), sharding)


def _device_put(values: list[jax.Array], sharding: Any) -> list[jax.Array]:
    """``jax.device_put`` of each of ``values`` to ``sharding``; values sharded over CPU devices
    of this process go through one host buffer of their own (see :func:`host_copy`)."""
    sources = [host_copy(v) for v in values]
    sources = [v if h is None else h for v, h in zip(values, sources)]
    return list(jax.device_put(sources, [sharding] * len(values)))


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
    if (
        len(sharding.device_set) < 2
        or x.is_fully_replicated
        or not x.is_fully_addressable
        or any(d.platform != "cpu" for d in sharding.device_set)
    ):
        return None
    host = _aligned_empty(x.shape, np.dtype(x.dtype))
    where = _indices(sharding, x.shape)
    for shard in per_device(x):
        host[where[single_device(shard)]] = np.asarray(shard)  # reads the buffer in place
    return host


@functools.lru_cache(maxsize=1024)
def _indices(sharding: Any, shape: tuple[int, ...]) -> Mapping[jax.Device, Any]:
    """Which part of an array of ``shape`` each device holds (cached: JAX computes it anew for
    every shard it describes)."""
    return sharding.devices_indices_map(shape)


def per_device(x: jax.Array) -> list[jax.Array]:
    """The single-device arrays of ``x``, one per device that holds a part of it."""
    arrays = getattr(x, "_arrays", None)  # fast; the public route below is ~10x slower
    return list(arrays) if arrays is not None else [s.data for s in x.addressable_shards]


_ALIGN = 64  # bytes; XLA's CPU runtime reads host buffers in place only if so aligned


def _aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def pull(state: KVState, keys: Any, *, devices: Any = None) -> Any:
    """The stored value of ``keys`` (one key: one array; a list: a list, repeats allowed).

    Args:
      state: the store.
      keys: a key or a list of keys.
      devices: where to place the result: a device or context, or a list of them; each result
        is one ``jax.Array`` replicated on exactly those devices. ``None`` returns the stored
        arrays themselves (replicated over the store's devices, or sharded across them for
        values above the big-array bound).

    Examples:
      >>> import jax, jax.numpy as jnp, jaxkv
      >>> s = jaxkv.init(jaxkv.empty(), {1: jnp.arange(3.0)})
      >>> jaxkv.pull(s, 1, devices=jax.devices()[0]).tolist()
      [0.0, 1.0, 2.0]
    """
    single = not isinstance(keys, list | tuple)
    values = [state[k] for k in ([keys] if single else keys)]
    if devices is not None:
        target = devices_of(devices)
        if target != state.devices or any(state.is_sharded(v.shape) for v in values):
            values = replicate(values, target)
    return values[0] if single else values


def pushpull(
    state: KVState,
    keys: Any,
    values: Any = _MISSING,
    *,
    updater: Updater | optax.GradientTransformation | None = None,
    devices: Any = None,
    donate: bool = False,
) -> tuple[KVState, Any]:
    """``push`` then ``pull`` of the same keys: returns ``(new_state, pulled)``.

    ``donate=True`` lets the push reuse the buffers of ``state``, as in :func:`push`.

    Examples:
      >>> import jax.numpy as jnp, jaxkv
      >>> s = jaxkv.init(jaxkv.empty(), {0: jnp.zeros(2)})
      >>> s, v = jaxkv.pushpull(s, 0, jnp.ones(2))
      >>> v.tolist()
      [1.0, 1.0]
    """
    if values is _MISSING and isinstance(keys, Mapping):
        keys, values = list(keys.keys()), list(keys.values())
    new = push(state, keys, values, updater=updater, donate=donate)
    return new, pull(new, keys, devices=devices)


@jax.jit
def _keep_rows(value: jax.Array, mask: jax.Array) -> jax.Array:
    mask = mask.reshape(mask.shape + (1,) * (value.ndim - 1))
    return jnp.where(mask, value, jnp.zeros((), value.dtype))


def row_sparse_pull(state: KVState, key: Any, row_ids: Any, *, devices: Any = None) -> jax.Array:
    """The value of ``key`` with only the rows in ``row_ids`` kept and the others zero.

    Eagerly, ids that are not whole numbers in ``[0, rows)`` are refused. Inside ``jit`` (traced
    ids) they cannot be: there an id outside ``[0, rows)`` selects no row.

    Examples:
      >>> import jax.numpy as jnp, jaxkv
      >>> s = jaxkv.init(jaxkv.empty(), {"e": jnp.ones((3, 2))})
      >>> jaxkv.row_sparse_pull(s, "e", [0, 2]).tolist()
      [[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]]
    """
    value = state[key]
    if value.ndim == 0:
        raise ShapeError(f"key {key!r}: row_sparse_pull expects a value with rows, given a scalar")
    rows = value.shape[0]
    if _is_traced(row_ids) or _is_traced(value):
        # Traced ids cannot be refused: those outside [0, rows) select no row. (JAX's own
        # indexing would wrap -1 around to the last row.)
        ids = jnp.asarray(row_ids).ravel().astype(jnp.int32)
        ids = jnp.where(ids < 0, rows, ids)
        mask = jnp.zeros(rows, bool).at[ids].set(True, mode="drop")
    else:
        ids = np.asarray(jax.device_get(row_ids) if isinstance(row_ids, jax.Array) else row_ids)
        ids = ids.ravel()
        # MXNet's row ids are often float32 (mx.nd.array's default): whole numbers are fine.
        if ids.size and (
            not np.issubdtype(ids.dtype, np.number)
            or np.any(ids != np.round(ids))
            or ids.min() < 0
            or ids.max() >= rows
        ):
            raise KVStoreError(
                f"key {key!r}: row_ids expected integers in [0, {rows}), given {ids.tolist()}"
            )
        ids = ids.astype(np.int64)
        mask = np.zeros(rows, bool)
        mask[ids] = True
        mask = jax.device_put(mask, state.sharding)  # replicated: it is small
    out = _keep_rows(value, mask)
    return out if devices is None else replicate([out], devices_of(devices))[0]
