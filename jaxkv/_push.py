"""The eager push: each key's contributions laid out on the store's mesh, then one cached,
jitted computation for all keys (sum over devices, updater, placement); optimizer states
initialised ahead of the first optimizer push."""

from __future__ import annotations

import collections
import functools
import logging
import operator
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from ._args import as_array
from ._arrays import place, stacked
from ._collectives import scatters, sum_over_devices
from ._compression import compress, layout_compressed
from ._errors import KVStoreError, ShapeError
from ._fast import single_device
from ._state import AXIS, Key, KVState

__all__ = ["Updater", "apply_updater", "init_opt_states", "push_eager"]

logger = logging.getLogger("jaxkv")


class Updater(Protocol):
    """How a pushed value is merged into the stored one.

    Called once per distinct key of a push, inside ``jit``, with the key (a Python ``int`` or
    ``str``), the pushed value summed over devices (already cast to the stored dtype) and the
    stored value; returns the new stored value, of the stored shape. The default is assign.
    An ``optax.GradientTransformation`` may be given instead: the pushed value is then the
    gradient, and the optimizer state is kept in the ``KVState``.
    """

    def __call__(self, key: Key, pushed: jax.Array, stored: jax.Array) -> jax.Array: ...


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


def apply_updater(updater: Any, key: Key, pushed: jax.Array, stored: jax.Array, opt_state: Any):
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
    new = as_array(new)
    if tuple(new.shape) != tuple(stored.shape):
        raise ShapeError(
            f"key {key!r}: the updater returned shape {tuple(new.shape)}, expected the stored "
            f"shape {tuple(stored.shape)}"
        )
    return new.astype(stored.dtype), opt_state


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
            return "stacked", stacked(state, stored, xs, dtype)  # one per device, in order
        return "stacked", stacked(state, stored, dict(zip(devices, xs)), dtype)
    # Several values on one device, or off the store's devices: sum them in call order there.
    target = state.sharding_for(stored.shape)
    placed = [jax.device_put(x.astype(stored.dtype), target) for x in xs]
    return "one", functools.reduce(operator.add, placed)


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
                functools.partial(compress, state.compression, [kinds[i][1] for i in compressed]),
                mesh=state.mesh,
                in_specs=PartitionSpec(AXIS),
                out_specs=PartitionSpec(AXIS),
            )([pushed[i] for i in compressed], [residuals[i] for i in compressed])
            for i, q, r in zip(compressed, quantized, kept):
                pushed[i], residuals[i] = q, r
        if stacked:
            scatter = [scatters(state, stored[i].shape) for i in stacked]
            summed = jax.shard_map(
                functools.partial(sum_over_devices, scatter=scatter),
                mesh=state.mesh,
                in_specs=PartitionSpec(AXIS),
                out_specs=[PartitionSpec(AXIS) if s else PartitionSpec() for s in scatter],
            )([pushed[i] for i in stacked])
            for i, x in zip(stacked, summed):
                pushed[i] = x.reshape(stored[i].shape)
        results = [apply_updater(updater, *args) for args in zip(keys, pushed, stored, opt_states)]
        # A pushed array returned as is (assign) would be forwarded by jit, and the store would
        # share the caller's buffer; a later donating push would then delete the caller's array.
        values = [jnp.copy(v) if id(v) in inputs else v for v, _ in results]
        return place(state, values), place(state, [o for _, o in results]), residuals

    return jax.jit(run, donate_argnums=(0, 1, 2) if donate else ())


_PUSH_CACHE = _PushCache()


def push_eager(
    state: KVState,
    grouped: dict[Key, list[jax.Array]],
    index: list[int],
    stored: list[jax.Array],
    opts: list[Any],
    updater: Any,
    donate: bool,
) -> KVState:
    """``push`` of the validated eager contributions ``grouped`` (keys at ``index`` in
    ``state``, with their stored values and optimizer states): one cached computation for all
    keys."""
    if state.compression is None:
        layouts = [_layout(state, s, xs) for s, xs in zip(stored, grouped.values())]
    else:
        layouts = [
            layout_compressed(state, k, s, xs) for (k, xs), s in zip(grouped.items(), stored)
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
