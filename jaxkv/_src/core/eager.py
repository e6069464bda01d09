"""The eager push: each key's contributions laid out on the store's mesh, then one cached,
jitted computation for all keys (sum over devices, updater, placement); optimizer states
initialised ahead of the first optimizer push."""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec

from jaxkv._src.core import alike, checked, renamed
from jaxkv._src.core.collectives import PUSH, SUM, psum_scatter, scatters, scoped, sum_over_devices
from jaxkv._src.core.compression import compress, exchange, layout_compressed, on_one_device
from jaxkv._src.core.on_blocks import UPDATER
from jaxkv._src.core.on_buckets import update_bucket
from jaxkv._src.core.reduce import divide
from jaxkv._src.core.signature import KEEP_VALUES, Donate, Kind, PushKey, PushOptions
from jaxkv._src.core.tree_view import viewed
from jaxkv._src.core.updater import apply_updater, init_state
from jaxkv._src.core.verified import batched, verify_every
from jaxkv._src.errors import KVStoreError, shown
from jaxkv._src.jax_internals import single_device
from jaxkv._src.processes import order
from jaxkv._src.state import buckets
from jaxkv._src.state.buckets import as_blocks, block, from_blocks
from jaxkv._src.state.kvstate import Key, KVState
from jaxkv._src.state.placement import (
    Keyed,
    as_pushed,
    host_empty,
    keyed_shardings,
    place,
    place_keyed,
    place_leaves,
    stacked,
)

__all__ = ["KEEP_VALUES", "check_laid_out", "init_opt_states", "push_eager", "push_eager_flat"]

logger = logging.getLogger("jaxkv")


def _donated(donate: Donate) -> tuple[int, ...]:
    """The push computation's ``donate_argnums`` (stored, optimizer state, residuals)."""
    if donate == KEEP_VALUES:
        return (1, 2)
    return (0, 1, 2) if donate else ()


def init_opt_states(state: KVState, optimizer: Any, keys: Sequence[Key]) -> KVState:
    """``state`` with a fresh optimizer state for the group ``keys`` (one compiled
    computation): ``optimizer.init({key: value for key in keys})``, in the store's layout.

    Done before the first optimizer push, so that the push computation sees the same state
    structure from its first call on and never compiles a second time.
    """
    if not keys:
        return state
    optimizer = viewed(state, optimizer)  # it sees the trees given to init
    group = tuple(sorted(set(keys)))
    rules = (
        optimizer,
        state.devices,
        state.bigarray_bound,
        state.user_mesh,
        state.mesh_axes,
        keyed_shardings(state, group),
    )
    renamable = renamed.renamable(state, optimizer, group)
    index = tuple(state.index(k) for k in group)
    flat = state.flat_layout
    if flat is not None and not renamable and any(state.own_leaf(i) is None for i in index):
        # Keys in buckets: viewed inside the computation (slices XLA fuses into their
        # readers; an init of zeros reads none), not by an eager computation with an array
        # per key, whose compile grows with the keys (200 keys' views: 2.7 s).
        init = _opt_initialiser(*rules, (flat, group, index))
        opt_state = order.ordered("optimizer init", init, list(state.leaves))
        return state.replace(opt_states={group: opt_state})
    init = _opt_initialiser(*rules)
    tree = {k: state[k] for k in group}
    opt_state = None
    if renamable:  # one computation for keys of a shape
        opt_state = renamed.init(
            optimizer, lambda t: order.ordered("optimizer init", init, t), tree
        )
    if opt_state is None:
        opt_state = order.ordered("optimizer init", init, tree)
    return state.replace(opt_states={group: opt_state})


@functools.lru_cache(maxsize=64)
def _opt_initialiser(
    optimizer: Any,
    devices: tuple,
    bound: int | None,
    mesh: Any,
    axes: tuple[str, ...],
    keyed: Keyed,
    viewed: tuple[buckets.FlatLayout, tuple[Key, ...], tuple[int, ...]] | None = None,
) -> Callable:
    """``optimizer.init`` of a tree of keys, its state placed by the store's rules, jitted;
    ``viewed``, ``(flat, group, index)``: taking a flat state's leaves instead, the keys of
    ``group`` (at ``index``) viewed inside it."""
    # Its placement rules (and the keys with their own sharding: their leaves placed so).
    layout = KVState(
        keys=(),
        devices=devices,
        values=(),
        opt_states=(),
        bound=bound,
        mesh=mesh,
        mesh_axes=axes,
    )

    def init(tree: dict) -> Any:
        return place_keyed(layout, init_state(optimizer, tree), keyed)

    if viewed is None:
        return jax.jit(init)
    flat, group, index = viewed
    return jax.jit(lambda leaves: init(dict(zip(group, buckets.views(flat, leaves, index)))))


def _layout(
    state: KVState, stored: jax.Array, xs: list[jax.Array], target: Any = None
) -> tuple[str, jax.Array]:
    """Prepare one key's eager contributions for the push computation.

    Returns ``('one', x)`` with ``x`` on the store's devices (no reduction needed), or
    ``('stacked', x)`` with the per-device values laid side by side along axis 0 of one array
    sharded over the store's mesh (no copy), to be summed there.
    """
    multiprocess = jax.process_count() > 1  # each worker's values are summed over workers
    if len(xs) == 1 and not multiprocess:
        x = as_pushed(state, xs[0], single_device(xs[0]))
        return "one", x if x is not None else jax.device_put(
            xs[0], target or state.sharding_for(stored.shape)
        )
    devices = [single_device(x) for x in xs]
    positions = state.local_positions
    if multiprocess and (
        len(set(devices)) != len(devices) or not all(d in positions for d in devices)
    ):
        # Across processes a value cannot be moved onto other processes' devices: this
        # process's values are summed on its own devices first (in call order on each; a
        # value off the store's devices on its first device), then stacked as below.
        mine: dict[Any, jax.Array] = {}
        first = next(iter(positions))
        for x, d in zip(xs, devices):
            d = d if d in positions else first
            x = jax.device_put(x, d).astype(stored.dtype)
            mine[d] = x if d not in mine else mine[d] + x
        xs, devices = list(mine.values()), list(mine)
    if len(set(devices)) == len(devices) and all(d in positions for d in devices):
        dtype = xs[0].dtype
        if any(x.dtype != dtype for x in xs):
            xs, dtype = [x.astype(stored.dtype) for x in xs], stored.dtype
        if len(devices) == len(positions) and all(map(operator.eq, devices, positions)):
            return "stacked", stacked(state, stored, xs, dtype)  # one per device, in order
        return "stacked", stacked(state, stored, dict(zip(devices, xs)), dtype)
    # Several values on one device, or off the store's devices: sum them in call order there.
    target = target or state.sharding_for(stored.shape)
    placed = [jax.device_put(x.astype(stored.dtype), target) for x in xs]
    return "one", functools.reduce(operator.add, placed)


def one_device_per_process(state: KVState) -> bool:
    """Whether ``state`` is a multi-process store with one device in each process (the layout
    of a ``dist_sync`` ``KVStore``), whose pushes sum within each process first."""
    return jax.process_count() > 1 and len(state.local_positions) == 1


def local_sums(
    state: KVState, keys: list[Key], stored: list[jax.Array], xss: list[list[jax.Array]]
) -> list[jax.Array]:
    """Each key's contributions from this process's devices, summed on the process's store
    device: the first, within-process half of a hierarchical push.

    Several values on CPU devices are added in place by NumPy (CPU devices share host memory),
    in call order, into a buffer that ``home`` reads without a copy. Any others are copied to
    ``home`` and added in one computation, in call order. The sum across
    processes then runs over one device per process, so the bytes between processes do not
    grow with the devices in each, and no collective spans devices of one process (gloo would
    carry those over loopback TCP too).
    """
    (home,) = state.local_positions  # (every value is this process's own: _all_own, before)
    out: list[Any] = [None] * len(xss)
    rest = []
    on_host = {}
    for i, (xs, s) in enumerate(zip(xss, stored)):
        if len(xs) > 1 and _host_addable(xs, s.dtype):
            on_host[i] = _host_sum(xs)
        else:
            rest.append(i)
    if on_host:  # read in place by ``home``: no copy
        for i, x in zip(on_host, jax.device_put(list(on_host.values()), home)):
            out[i] = x
    # The others: copied to ``home`` where they are elsewhere, then added up in one computation.
    xss = [list(xs) for xs in xss]
    away = [(i, j) for i in rest for j, x in enumerate(xss[i]) if single_device(x) != home]
    if away:
        moved = jax.device_put([xss[i][j] for i, j in away], home)
        for (i, j), x in zip(away, moved):
            xss[i][j] = x
    several = [i for i in rest if len(xss[i]) > 1]
    for i in rest:
        x = xss[i][0]
        out[i] = x if x.dtype == stored[i].dtype else x.astype(stored[i].dtype)
    if several:
        dtypes = tuple(stored[i].dtype for i in several)
        for i, x in zip(several, _add_up([xss[i] for i in several], dtypes)):
            out[i] = x
    return out


def _own(key: Key, x: jax.Array) -> None:
    """Refuse a value pushed to ``key`` in a multi-process push that is not this process's
    own (an array over other processes' devices too)."""
    if not x.is_fully_addressable:
        devices: set[jax.Device] = x.sharding.device_set
        raise KVStoreError(
            f"key {shown(key)}: a multi-process push expects this process's own values "
            f"(arrays on its devices), given an array over several processes' devices "
            f"{sorted(d.id for d in devices)}; push each process's part"
        )


def _all_own(grouped: dict[Key, list[jax.Array]]) -> None:
    """Across processes, refuse any value that is not this process's own (:func:`_own`),
    whatever the devices of each process: one over several processes' devices cannot be laid
    out on this process's devices."""
    if jax.process_count() > 1:
        for key, xs in grouped.items():
            for x in xs:
                _own(key, x)


def check_laid_out(state: KVState, grouped: dict[Key, list[jax.Array]]) -> None:
    """The refusals an eager push makes as it lays its values out (``_layout``,
    ``layout_compressed``, ``local_sums``), made without laying them out: for a push checked
    now and run later."""
    if state.compression is not None:
        for key, xs in grouped.items():
            for x in xs:
                on_one_device(key, x)
    _all_own(grouped)


def _host_addable(xs: list[jax.Array], dtype: Any) -> bool:
    """Whether NumPy can add ``xs`` where they are, as XLA would: of the stored ``dtype``, a
    NumPy number type, each on one CPU device."""
    return np.dtype(dtype).kind in "fiu" and all(
        x.dtype == dtype and (d := single_device(x)) is not None and d.platform == "cpu" for x in xs
    )


def _host_sum(xs: list[jax.Array]) -> np.ndarray:
    """``xs`` (on CPU devices of this process) summed in order into one fresh, aligned host
    buffer, which a CPU device then reads in place: CPU devices share host memory, so each value
    is read where it is, with no copy to one device first (half the memory traffic of
    copy-then-add)."""
    out = host_empty(xs[0].shape, np.dtype(xs[0].dtype))
    np.add(np.asarray(xs[0]), np.asarray(xs[1]), out=out)
    for x in xs[2:]:
        np.add(out, np.asarray(x), out=out)
    return out


@functools.partial(jax.jit, static_argnums=1)
def _add_up(xss: list[list[jax.Array]], dtypes: tuple) -> list[jax.Array]:
    """Each list of ``xss`` summed in order, in its dtype of ``dtypes``."""
    return [functools.reduce(operator.add, [x.astype(t) for x in xs]) for xs, t in zip(xss, dtypes)]


class _Computations:
    """Jitted push computations, one per :class:`~jaxkv._src.core.signature.PushKey`, least
    recently used dropped first; each built from its key alone (its options hold the updater,
    compared by identity and kept alive with the key). Where pushes of the same keys, shapes
    and options but for the updater build one computation after another, each for an updater
    object of its own, a warning says so, once: an updater made anew at every call
    (``updater=optax.sgd(0.1)`` inside the loop) compiles the push at every call."""

    def __init__(self, size: int = 256):
        self._size = size
        self._fns: collections.OrderedDict = collections.OrderedDict()
        # The updater objects each push built a computation for (keyed by the key with no
        # updater, and the keys it names), until they reach _ANEW and the warning is given
        # (then None).
        self._updaters: dict[tuple[PushKey, str | None], set[int] | None] = {}

    def get(self, sig: PushKey, build: Callable[[PushKey], Callable]) -> Callable:
        fn = self._fns.get(sig)
        if fn is not None:
            self._fns.move_to_end(sig)
            return fn
        self._anew(sig)
        fn = build(sig)
        self._fns[sig] = fn
        if len(self._fns) > self._size:
            self._fns.popitem(last=False)
        return fn

    def _anew(self, sig: PushKey) -> None:
        options = getattr(sig, "options", None)  # (any hashable key: the cache is generic)
        if options is None or options.updater is None or len(self._updaters) > 4 * self._size:
            return
        # The same push for other updaters: the same computation but for its updater, for the
        # same keys (in the per-key layout one computation serves every key of a shape class,
        # so a key pushed with one updater object beside another made anew is not counted).
        alike = dataclasses.replace(sig, options=PushOptions(None, options.donate, options.reduce))
        named = checked.named_now()
        seen = self._updaters.setdefault((alike, named), set())
        if seen is None or options.updater_id in seen:
            return
        seen.add(options.updater_id)
        if len(seen) < _ANEW:
            return
        self._updaters[(alike, named)] = None  # (said once)
        logger.warning(
            "jaxkv: the push of %s compiled %d times for the same shapes and dtypes, each for "
            "a new updater object (%s): a push's computation is kept per updater object, so an "
            "updater made anew at every call (e.g. updater=optax.sgd(0.1) inside the loop) "
            "compiles the push at every call. Make it once, before the loop, and pass that one",
            named or "its keys",
            len(seen),
            type(options.updater).__name__,
        )


# Computations built for as many distinct updater objects of one push before the warning.
_ANEW = 4
_COMPUTATIONS = _Computations()


def push_fn(
    state: KVState,
    keys: tuple[Key, ...],
    kinds: tuple[Kind, ...],
    options: PushOptions,
    divisors: tuple[int, ...] | None = None,
    rename: bool = True,
) -> Callable:
    """The cached push computation ``fn(stored, opt_state, residuals, pushed)`` of this
    signature, for a state with one array per key; ``divisors``: a mean's, per key
    (``reduce.divisors``).

    Where the updater's numbers cannot depend on the keys' names (``renamed.renamable``) and
    ``rename``, the computation runs on the keys renamed by their rank, so that keys of the
    same shapes and dtypes share it (keys made one at a time compile nothing new)."""
    named, updater = keys, options.updater
    by_rank = rename and renamed.renamable(state, updater, keys)
    if by_rank:
        keys = renamed.ranks(keys)
    sig = PushKey(
        facts=state.facts(),
        layout="keys",
        keys=keys,
        kinds=kinds,
        options=options,
        divisors=divisors,
        by_rank=by_rank,
        keyed=keyed_shardings(state, keys) if state.tp_specs else (),
    )
    fn = _COMPUTATIONS.get(sig, _build_push)
    if not (by_rank and isinstance(updater, optax.GradientTransformation)):
        return fn

    def named_fn() -> Callable:
        return push_fn(state, named, kinds, options, divisors, rename=False)

    return functools.partial(renamed.call, fn, named_fn, updater, named)


def _sum_stacked(state: KVState, stacked: list[int], pushed: list[Any], stored: list[Any]) -> None:
    """Inside the push computation: the contributions at ``stacked`` (one block per device laid
    side by side, see ``_layout``) summed over the store's mesh in place in ``pushed``, each of
    its key's shape (``stored``), reduce-scattered where the store keeps it sharded."""
    axis = state.axis
    scatter = [scatters(state, stored[i].shape) for i in stacked]
    summed = checked.shard_map(
        functools.partial(sum_over_devices, scatter=scatter, axis=axis),
        mesh=state.mesh,
        in_specs=PartitionSpec(axis),
        out_specs=[PartitionSpec(axis) if s else PartitionSpec() for s in scatter],
    )([pushed[i] for i in stacked])
    for i, x in zip(stacked, summed):
        pushed[i] = x.reshape(stored[i].shape)


def _sum_split(
    placement: KVState, state: KVState, keys: tuple[Key, ...], at: list[int], pushed: list[Any]
) -> dict[int, Any]:
    """Inside the push computation: the stacked contributions at ``at``, of keys in split
    buckets, summed with one reduce-scatter per bucket (each key's ``(D, block)`` view side by
    side, so each device gets its chunk of the sum); ``pushed`` gets each key's whole sum, and
    the result maps each bucket whose every key was pushed to its summed gradient, laid out as
    the bucket (``on_buckets.update_bucket`` takes it as it is)."""
    flat = state.flat_layout
    assert flat is not None  # split buckets exist only in a flat state
    n = len(placement.devices)
    axis = placement.axis
    by_bucket: dict[int, list[int]] = {}
    for i in at:
        by_bucket.setdefault(flat.where[state.index(keys[i])][0], []).append(i)
    bucket_ids = list(by_bucket)

    @batched(axis)  # the buckets' sums checked together
    def body(blocks: list[Any]) -> list[Any]:
        out, j = [], 0
        for b in bucket_ids:
            count = len(by_bucket[b])
            part = blocks[j : j + count]
            j += count
            shapes = [state.shapes[keys[i]] for i in by_bucket[b]]
            grid = jnp.concatenate(
                [as_blocks(x.reshape(s), n) for x, s in zip(part, shapes)], axis=1
            )
            with jax.named_scope(SUM):
                out.append(psum_scatter(grid, axis, scatter_dimension=0, tiled=True))
        return out

    summed = checked.shard_map(
        body,
        mesh=placement.mesh,
        in_specs=PartitionSpec(axis),
        out_specs=PartitionSpec(axis),
    )([pushed[i] for b in bucket_ids for i in by_bucket[b]])
    grids = {}
    for b, grid in zip(bucket_ids, summed):
        offset = 0
        for i in by_bucket[b]:
            shape = state.shapes[keys[i]]
            size = math.prod(shape)
            width = block(shape, n)
            pushed[i] = from_blocks(grid[:, offset : offset + width], size, shape)
            offset += width
        if len(by_bucket[b]) == sum(1 for w in flat.where if w[0] == b):
            grids[b] = grid.reshape(-1)
    return grids


def _build_push(sig: PushKey) -> Callable:
    """The jitted push of ``sig`` (built from it alone: the cached computation keeps none of a
    state's arrays). Keys renamed by rank under an optax updater take the optimizer state as
    its leaves, its structure a static last argument."""
    updater, donate = sig.options.updater, sig.options.donate
    logger.debug("jaxkv: new push signature (%d keys, donate=%s)", len(sig.keys), donate)
    state = sig.placement()
    keys, kinds, divisors, keyed = sig.keys, sig.kinds, sig.divisors, sig.keyed
    leaves = sig.by_rank and isinstance(updater, optax.GradientTransformation)
    own = {k: sharding for k, _, sharding in keyed}  # keys with their own sharding
    axis = state.axis
    masks = {
        i: kind[1]
        for i, kind in enumerate(kinds)
        if isinstance(kind, tuple) and kind[0] == "compressed"
    }
    compressed = list(masks)  # the compressed keys' positions, with their masks above
    exchanged = [i for i, kind in enumerate(kinds) if kind == "exchanged"]
    stacked = [i for i, kind in enumerate(kinds) if kind not in ("one", "exchanged")]

    def run(
        stored: list[jax.Array],
        opt_state: Any,
        residuals: list[Any],
        pushed: list[jax.Array],
        extra_args: Any = None,
    ) -> tuple[Any, Any, list[Any]]:
        inputs = {id(x) for x in pushed}
        pushed = [x.astype(s.dtype) for x, s in zip(pushed, stored)]
        inputs.update(id(x) for x in pushed)
        residuals = list(residuals)
        if compressed:
            config = state.compression
            assert config is not None, "compressed layouts come only from a compressed store"
            quantized, kept = checked.shard_map(
                functools.partial(compress, config, list(masks.values()), axis=axis),
                mesh=state.mesh,
                in_specs=PartitionSpec(axis),
                out_specs=PartitionSpec(axis),
            )([pushed[i] for i in compressed], [residuals[i] for i in compressed])
            for i, q, r in zip(compressed, quantized, kept):
                pushed[i], residuals[i] = q, r
        if exchanged:
            config = state.compression
            assert config is not None, "exchanged layouts come only from a compressed store"
            split = [state.is_sharded(stored[i].shape) for i in exchanged]
            summed, kept = checked.shard_map(
                functools.partial(exchange, config, split, axis=axis),
                mesh=state.mesh,
                in_specs=PartitionSpec(axis),
                out_specs=(
                    [PartitionSpec(axis) if s else PartitionSpec() for s in split],
                    PartitionSpec(axis),
                ),
                # Every process decodes the same all-gathered words, so the sums agree; JAX
                # types an all-gather's result as varying and cannot see that.
                check_vma=False,
            )([pushed[i] for i in exchanged], [residuals[i] for i in exchanged])
            for i, x, r in zip(exchanged, summed, kept):
                pushed[i], residuals[i] = x.reshape(stored[i].shape), r
        if stacked:
            _sum_stacked(state, stacked, pushed, stored)
        pushed = divide(pushed, divisors)
        with jax.named_scope(UPDATER):
            values, opt_state = apply_updater(updater, keys, pushed, stored, opt_state, extra_args)
        # A pushed array returned as is (assign) would be forwarded by jit, and the store would
        # share the caller's buffer; a later donating push would then delete the caller's array.
        values = [jnp.copy(v) if id(v) in inputs else v for v in values]
        if keyed:  # keys with their own sharding: each placed as its key
            targets = [own.get(k) or state.sharding_for(s.shape) for k, s in zip(keys, stored)]
            placed = [jax.lax.with_sharding_constraint(v, t) for v, t in zip(values, targets)]
            return placed, place_keyed(state, opt_state, keyed), residuals
        return place(state, values), place(state, opt_state), residuals

    if leaves:

        def run_leaves(
            stored: list[jax.Array],
            opt_leaves: list[Any],
            residuals: list[Any],
            pushed: list[jax.Array],
            extra_args: Any,
            treedef: Any,
        ) -> tuple[Any, list[Any], list[Any]]:
            opt_state = jax.tree_util.tree_unflatten(treedef, opt_leaves)
            values, opt_state, residuals = run(stored, opt_state, residuals, pushed, extra_args)
            return values, jax.tree_util.tree_leaves(opt_state), residuals

        return checked.jit(
            scoped(PUSH)(run_leaves),
            verify_every(),
            donate_argnums=_donated(donate),
            static_argnums=5,
        )
    return checked.jit(scoped(PUSH)(run), verify_every(), donate_argnums=_donated(donate))


def push_eager(
    state: KVState,
    grouped: dict[Key, list[jax.Array]],
    index: list[int],
    stored: list[jax.Array],
    opt_state: Any,
    options: PushOptions,
    extra_args: Any = None,
    divisors: tuple[int, ...] | None = None,
    own: list[int] | None = None,
) -> KVState:
    """``push`` of the validated eager contributions ``grouped`` (keys at ``index`` in
    ``state``, with their stored values and, for an optax updater, their group's optimizer
    state and the ``extra_args`` of its update): one cached computation for all keys.
    ``own``: under a flat layout, the keys' own arrays' leaf positions (``stored`` those
    arrays; their group, if any, exactly these keys and not packed): the new ones are
    written back in their places, no bucket touched."""
    _all_own(grouped)
    if one_device_per_process(state):
        # Each process's values summed at full precision first; compressed after that, once.
        sums = local_sums(state, list(grouped), stored, list(grouped.values()))
        kind = "stacked" if state.compression is None else "exchanged"
        layouts: list[tuple[Kind, jax.Array]] = [
            (kind, stacked(state, s, [x], x.dtype)) for s, x in zip(stored, sums)
        ]
    elif state.compression is None:
        layouts = [
            _layout(state, s, xs, state.sharding_of(k) if state.tp_specs else None)
            for (k, xs), s in zip(grouped.items(), stored)
        ]
    else:
        layouts = [
            layout_compressed(state, k, s, xs) for (k, xs), s in zip(grouped.items(), stored)
        ]
    kinds, pushed = zip(*layouts)
    residuals = [state.residual_leaves[i] for i in index]
    fn = push_fn(state, tuple(grouped), kinds, options, divisors)
    # Over other processes' devices too, its collectives run after this process's earlier ones.
    new_values, new_opt, new_residuals = order.ordered(
        "push", fn, stored, opt_state, residuals, list(pushed), extra_args
    )
    optax_push = isinstance(options.updater, optax.GradientTransformation)
    if own is not None:  # keys of their own in a flat state: written back in their places
        group = state.groups.index(tuple(sorted(grouped))) if optax_push else None
        return buckets.with_leaves(
            state, dict(zip(own, new_values)), {} if group is None else {group: new_opt}
        )
    return state.replace(
        dict(zip(grouped, new_values)),
        {tuple(grouped): new_opt} if optax_push else None,
        dict(zip(grouped, new_residuals)),
    )


# -- a flat store -------------------------------------------------------------------------------
def push_eager_flat(
    state: KVState,
    grouped: dict[Key, list[jax.Array]],
    stored: list[Any],
    options: PushOptions,
    extra_args: Any = None,
    divisors: tuple[int, ...] | None = None,
) -> KVState:
    """``push`` of the validated eager contributions ``grouped`` to a state with a flat layout
    (``stored``: the pushed keys' shapes and dtypes): one cached computation that takes the
    whole state and gives the new one, each key's value a view of its bucket inside it and its
    new value written in place (the state's buffers reused where ``donate``)."""
    _all_own(grouped)
    if one_device_per_process(state):  # each process's values summed in it first
        sums = local_sums(state, list(grouped), stored, list(grouped.values()))
        layouts = [("stacked", stacked(state, s, [x], x.dtype)) for s, x in zip(stored, sums)]
    else:
        layouts = [_layout(state, s, xs) for s, xs in zip(stored, grouped.values())]
    kinds, pushed = zip(*layouts)
    fn = flat_push_fn(state, tuple(grouped), kinds, options, divisors)
    return order.ordered("push", fn, state, list(pushed), extra_args)


def flat_push_fn(
    state: KVState,
    keys: tuple[Key, ...],
    kinds: tuple[Kind, ...],
    options: PushOptions,
    divisors: tuple[int, ...] | None = None,
) -> Callable:
    """The cached flat push computation ``fn(state, pushed) -> new state`` of this signature
    (the state's layout is part of the computation's own cache key: its tree structure)."""
    sig = PushKey(
        facts=state.facts(),
        layout="flat",
        keys=keys,
        kinds=kinds,
        options=options,
        divisors=divisors,
    )
    return _COMPUTATIONS.get(sig, _build_push_flat)


def _build_push_flat(sig: PushKey) -> Callable:
    """The jitted push of ``sig.keys`` into a flat state: sums as :func:`_build_push`'s, the
    updater on each key's view (the same numbers as one array per key), the new values
    written into the buckets, every leaf placed where the store keeps it."""
    updater, donate = sig.options.updater, sig.options.donate
    logger.debug("jaxkv: new flat push signature (%d keys, donate=%s)", len(sig.keys), donate)
    placement = sig.placement()
    keys, kinds, divisors = sig.keys, sig.kinds, sig.divisors
    stacked = [i for i, kind in enumerate(kinds) if kind != "one"]
    optax_push = isinstance(updater, optax.GradientTransformation)

    def run(state: KVState, pushed: list[jax.Array], extra_args: Any = None) -> KVState:
        inputs = {id(x) for x in pushed}
        index = [state.index(k) for k in keys]
        held = state.stored_values
        stored = [held[i] for i in index]
        pushed = [x.astype(s.dtype) for x, s in zip(pushed, stored)]
        inputs.update(id(x) for x in pushed)
        split = [i for i in stacked if buckets.split_parts(state, index[i]) > 1]
        grids = _sum_split(placement, state, keys, split, pushed) if split else {}
        rest = [i for i in stacked if i not in split]
        if rest:
            _sum_stacked(placement, rest, pushed, stored)
        if divisors is not None:
            pushed = divide(pushed, divisors)
            grids = {}  # the bucket's update then reads the divided values
        new = None
        if optax_push and extra_args is None:
            new = update_bucket(state, keys, pushed, updater, grids)
        if new is None and optax_push and not split:  # keys alike in one batch
            new = alike.update(state, keys, pushed, updater, extra_args)
        if new is None:  # per key, on the views
            opt_state = state.opt_states[keys] if optax_push else None
            with jax.named_scope(UPDATER):
                values, opt_state = apply_updater(
                    updater, keys, pushed, stored, opt_state, extra_args
                )
            values = [jnp.copy(v) if id(v) in inputs else v for v in values]
            new = state.replace(dict(zip(keys, values)), {keys: opt_state} if optax_push else None)
        return new

    run = scoped(PUSH)(run)
    if donate is True:
        return checked.jit(
            lambda state, pushed, extra_args=None: place_leaves(run(state, pushed, extra_args)),
            verify_every(),
            donate_argnums=(0,),
        )
    # The values it keeps (not donated: all of them, or, under KEEP_VALUES, the keys kept as
    # arrays of their own, which the store lends to outs) come back as they went in where the
    # push leaves them unchanged: left out of the computation's outputs (``None`` there), not
    # copied (a big table beside the pushed keys would be, at every push of a small key).
    if not donate:
        jitted = checked.jit(
            lambda state, pushed, extra_args: _unchanged(state, run(state, pushed, extra_args), 0),
            verify_every(),
        )

        def call_kept(state: KVState, pushed: list[jax.Array], extra_args: Any = None) -> KVState:
            return _put_back(state, jitted(state, pushed, extra_args))

        return call_kept

    # KEEP_VALUES: only the buckets, the optimizer state and the residuals are donated: the
    # leaves split in two arguments.
    def split(
        treedef: Any, rest: list, alone: list, pushed: list, nb: int, extra_args: Any
    ) -> KVState:
        state = jax.tree_util.tree_unflatten(treedef, rest[:nb] + alone + rest[nb:])
        return _unchanged(state, run(state, pushed, extra_args), nb)

    jitted_split = checked.jit(split, verify_every(), static_argnums=(0, 4), donate_argnums=1)

    def call(state: KVState, pushed: list[jax.Array], extra_args: Any = None) -> KVState:
        leaves, treedef = jax.tree_util.tree_flatten(state)
        nb = 0 if state.flat_layout is None else len(state.flat_layout.buckets)
        nv = len(state.leaves)
        alone = leaves[nb:nv]
        return _put_back(
            state, jitted_split(treedef, leaves[:nb] + leaves[nv:], alone, pushed, nb, extra_args)
        )

    return call


def _unchanged(state: KVState, new: KVState, start: int) -> KVState:
    """Inside the flat push: ``new`` placed (:func:`place_leaves`), where each value leaf from
    position ``start`` on that is the same as ``state``'s (the push left it as it came: the same
    layout, the same tracer) is ``None``, for :func:`_put_back` to put back."""
    placed = place_leaves(new)
    if new.flat_layout != state.flat_layout or len(new.leaves) != len(state.leaves):
        return placed
    leaves = tuple(
        None if j >= start and x is y else z
        for j, (x, y, z) in enumerate(zip(new.leaves, state.leaves, placed.leaves))
    )
    children, aux = placed.tree_flatten()
    return type(placed).tree_unflatten(aux, (leaves, *children[1:]))


def _put_back(state: KVState, new: KVState) -> KVState:
    """``new`` with each value leaf the computation left out (:func:`_unchanged`) put back:
    ``state``'s own array, kept (not donated)."""
    if all(x is not None for x in new.leaves):
        return new
    leaves = tuple(y if x is None else x for x, y in zip(new.leaves, state.leaves))
    children, aux = new.tree_flatten()
    return type(new).tree_unflatten(aux, (leaves, *children[1:]))
