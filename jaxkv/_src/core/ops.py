"""The functional core's operations: ``init``, ``push``, ``pull``, ``pushpull`` (the row
operations are in ``jaxkv/_src/rows/ops.py``).

Eagerly, one ``push`` is one jitted computation for all its keys: per-device contributions are
assembled (without copying) into one array sharded over the store's mesh and summed with a
``psum``; then the updater runs once per distinct key. The compiled computation is cached per
(devices, key set, contribution layout, updater, donation); JAX adds shapes and dtypes, so
pushing the same structure again never recompiles (``eager.py``).
A call of a signature already seen replays a plan of that work instead (``plans.py``): no
per-key pairing, lookups or ``device_put`` of values already in place, one dispatch per push.

Inside a trace (the user's ``jit``, ``pmap`` or ``shard_map``) the same updater logic runs in
the caller's trace, and ``axis_name`` sums each value over the mapped axis exactly once
(``traced.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import jax
import optax
from jax.sharding import NamedSharding

from jaxkv._src.core import checked, plans, tree_view, trees
from jaxkv._src.core import reduce as _reduce
from jaxkv._src.core.collectives import PULL, PUSH
from jaxkv._src.core.compression import residual_zeros
from jaxkv._src.core.eager import init_opt_states, push_eager, push_eager_flat
from jaxkv._src.core.signature import PushOptions
from jaxkv._src.core.traced import gather as gather_blocks
from jaxkv._src.core.traced import is_block, push_in_trace
from jaxkv._src.core.updater import (
    Updater,
    as_transformation,
    as_updater,
    init_state,
    optimizer_group,
)
from jaxkv._src.errors import DuplicateKeyError, KeyTypeError, KVStoreError, ShapeError, shown
from jaxkv._src.state import buckets
from jaxkv._src.state.kvstate import Key, KVState, check_compressible, key_kind, spans_processes
from jaxkv._src.state.pairing import (
    MISSING,
    as_value,
    devices_of,
    group,
    is_traced,
    pairs,
)
from jaxkv._src.state.placement import copies, put, replicate

__all__ = [
    "Updater",
    "checked_inits",
    "gather",
    "init",
    "init_optimizer",
    "pull",
    "push",
    "pushpull",
    "specs",
]


_F = TypeVar("_F", bound=Callable[..., Any])


def _annotated(name: str) -> Callable[[_F], _F]:
    """The call on the host timeline of a profiler trace, as ``name``
    (``jax.profiler.TraceAnnotation``: nearly free while no trace runs)."""

    def wrap(f: _F) -> _F:
        @functools.wraps(f)
        def annotated(*args: Any, **kwargs: Any) -> Any:
            with jax.profiler.TraceAnnotation(name):
                return f(*args, **kwargs)

        return annotated  # type: ignore[return-value]

    return wrap


def init(state: KVState, keys: Any, values: Any = MISSING) -> KVState:
    """A new state with ``keys`` added, holding copies of ``values`` on the store's devices.

    Args:
      state: the store.
      keys: a key, a list of keys, a mapping ``{key: value}`` or a tree of arrays such as a
        flax ``params`` dict (then omit ``values``): a tree's leaves become keys named by
        their paths, ``'params/Dense_0/kernel'``.
      values: one array per key.

    Returns:
      The new state; ``state`` is unchanged.

    Raises:
      DuplicateKeyError: a key is already in the store, or repeats in the call.
      KeyTypeError: a key is not int/str, or its kind differs from the store's keys, or plain
        keys and trees are mixed in one store.

    Examples:
      >>> import jax.numpy as jnp, jaxkv
      >>> s = jaxkv.init(jaxkv.empty(), [3, 5], [jnp.ones(2), jnp.zeros(2)])
      >>> s.keys()
      (3, 5)
    """
    return init_keys(state, keys, values, defer=False)


def init_keys(
    state: KVState, keys: Any, values: Any = MISSING, *, defer: bool, agreed: bool = False
) -> KVState:
    """:func:`init`; ``defer``: the new keys keep arrays of their own until the state is
    settled (``KVState.replace``'s ``defer``: the imperative store's ``init`` one key at a
    time); ``agreed``: every process gives the same values (``placement.put``)."""
    tree = trees.split(keys) if values is MISSING else None
    if tree is not None:
        keys = tree.mapping
    first = list(keys)[:1] if isinstance(keys, Mapping | list | tuple) else [keys]
    trees.check_init(state, tree, first)
    new = checked_inits(state, keys, values)
    eager = [k for k, x in new.items() if not is_traced(x)]
    # On a mesh of several axes, a value's own sharding along the other axes is kept.
    own = {k: spec for k in eager if (spec := state.own_spec(k, new[k])) is not None}
    if eager:
        xs = [new[k] for k in eager]
        targets = [
            NamedSharding(state.mesh, state.spec_with(tuple(x.shape), own[k]))
            if k in own
            else state.sharding_for(x.shape)
            for k, x in zip(eager, xs)
        ]
        placed = put(xs, targets, agreed)
        new.update(zip(eager, copies(placed)))
    residuals = {}
    if state.compression is not None and state.compression[0] == "2bit":
        if len(eager) < len(new):
            raise KVStoreError(
                f"keys {list(new)}: a store with gradient compression expects "
                "eager values, given traced ones"
            )
        residuals = {k: residual_zeros(state, x) for k, x in new.items()}
    init_trees = [tree.shape()] if tree is not None and tree.keys else []
    return state.replace(
        values=new, residuals=residuals, defer=defer, trees=init_trees, tp_specs=own or None
    )


def checked_inits(
    state: KVState, keys: Any, values: Any = MISSING, pending: Mapping[Key, Any] | None = None
) -> dict[Key, jax.Array]:
    """The values an ``init`` of ``keys`` adds, by key in call order, once every check has
    passed: one kind of key (the store's, or that of the keys in ``pending``, inits not yet
    run), no key already there or in ``pending`` or twice, one value per key, a dtype the
    store's compression takes."""
    pending = pending or {}
    new: dict[Key, jax.Array] = {}
    kind = state.key_kind or next((key_kind(k) for k in pending), None)
    for key, vs in pairs(keys, values, "values"):
        kind = kind or key_kind(key)
        if key_kind(key) != kind:
            raise KeyTypeError(
                f"key {shown(key)}: expected {kind} keys, given a {key_kind(key)} key (one store "
                "holds one kind of key, as in MXNet)"
            )
        if key in state or key in pending or key in new:
            raise DuplicateKeyError(
                f"duplicate init of key {shown(key)}: expected a key not yet in the store, given "
                f"{shown(key)}, which is already there"
                + (" (init takes one value per key)" if len(vs) > 1 else "")
            )
        if len(vs) != 1:
            raise ShapeError(
                f"key {shown(key)}: init expects one value, given a list of {len(vs)} values"
            )
        new[key] = as_value(key, vs[0], "the value")
        check_compressible(state.compression, key, new[key].dtype)
    return new


@_annotated(PUSH)
def push(
    state: KVState,
    keys: Any,
    values: Any = MISSING,
    *,
    updater: Updater | optax.GradientTransformation | None = None,
    axis_name: Any = None,
    donate: bool = False,
    extra_args: dict[str, Any] | None = None,
    reduce: str | None = None,
) -> KVState:
    """A new state with ``values`` pushed to ``keys``.

    Each value is one array or a list of arrays (one per device), which are summed; duplicate
    keys in one call are summed together. Then ``updater(key, pushed, stored)`` runs once per
    distinct key (default: assign). A value of another dtype is taken where the stored dtype
    holds it without loss (a safe widening, cast before the sum; a Python number of a kind the
    key holds) and refused otherwise (:class:`jaxkv.DtypeError`: cast it on purpose).

    Args:
      state: the store.
      keys: a key, a list of keys, a mapping ``{key: value}``, or a tree of arrays with the
        structure of a tree given to :func:`init` (then omit ``values``).
      values: per key, an array or a list of per-device arrays.
      updater: an :class:`Updater` or an ``optax.GradientTransformation`` (or an optax
        wrapper with a ``gradient_transformation()`` method, ``optax.MultiSteps``: its
        transformation); ``None`` assigns.
      axis_name: inside ``pmap``/``shard_map``, the mapped axis (or axes) to sum over. Values
        that JAX has already made invariant along it (``shard_map``) are not summed again.
      donate: let the computation reuse the buffers of ``state`` (which then becomes invalid).
      extra_args: for an optax updater, keyword arguments of its ``update`` (optax's
        ``GradientTransformationExtraArgs``: a loss for ``reduce_on_plateau``, a learning
        rate fed each step), arrays passed into the computation, not compiled into it.
        Eager pushes only.
      reduce: ``'sum'`` or ``'mean'`` (default: the store's, :func:`empty`'s ``reduce``): a
        mean divides each key's sum once by its contributions (the values pushed to it; inside
        ``pmap``/``shard_map``, times the devices of ``axis_name``), as ``jax.lax.pmean``.

    Returns:
      The new state. Unless ``donate=True``, ``state`` stays valid and unchanged.

    Raises:
      UnknownKeyError: a key was never initialised.
      ShapeError: a value's shape differs from the stored one, or keys and values do not pair.
      DtypeError: a value's dtype is one the stored dtype cannot hold without loss.
      KVStoreError: any other refusal (a value that is not an array); in every case nothing
        has changed.

    Examples:
      >>> import jax.numpy as jnp, jaxkv
      >>> s = jaxkv.init(jaxkv.empty(), {"w": jnp.zeros(2)})
      >>> s = jaxkv.push(s, "w", [jnp.ones(2), jnp.ones(2)])
      >>> jaxkv.pull(s, "w").tolist()
      [2.0, 2.0]
    """
    updater = as_updater(updater)  # an optax wrapper (MultiSteps): its transformation
    if not _one_key(keys):
        # Keys added one at a time are laid out now, once; pushed one at a time, they keep
        # arrays of their own (each key's computations are then those of its shape).
        state = state.settled()
    updater = tree_view.viewed(state, updater)  # optax sees the trees given to init
    reduce = _reduce.effective(state, reduce)
    tree = trees.split(keys) if values is MISSING else None
    if tree is not None:
        trees.check_push(state, tree)
        keys = tree.mapping
    if extra_args is not None and not isinstance(updater, optax.GradientTransformation):
        raise KVStoreError(
            f"extra_args={sorted(extra_args)!r}: expected an optax updater to receive them, "
            f"given updater {updater!r}"
        )
    # Every cache of the push (its plans, its computations) keys on this one object.
    options = PushOptions(updater=updater, donate=donate, reduce=reduce)
    with checked.naming(keys):  # (a wrong sum's error, found at a later call, names them)
        return _push(state, keys, values, options, extra_args, axis_name)


def _push(
    state: KVState,
    keys: Any,
    values: Any,
    options: PushOptions,
    extra_args: Any,
    axis_name: Any,
) -> KVState:
    """:func:`push` once its options are made."""
    updater, reduce = options.updater, options.reduce
    if axis_name is None and values is not MISSING:
        fast = plans.push(state, keys, values, options, extra_args)
        if fast is not None:
            return fast
    grouped = group(state, keys, values)
    index = [state.index(k) for k in grouped]
    flat = state.flat_layout is not None
    if flat:  # its views are slices of the buckets: made inside the push's computation
        stored = [buckets.stored_type(state, i) for i in index]
        traced = any(is_traced(x) for x in jax.tree_util.tree_leaves(state))
    else:
        stored = [state.stored_values[i] for i in index]
        traced = any(is_traced(x) for x in stored)
    traced = traced or any(is_traced(x) for xs in grouped.values() for x in xs)
    opt_state = None
    if isinstance(updater, optax.GradientTransformation):
        group_keys, opt_state = optimizer_group(state, tuple(grouped), unpack=traced or not flat)
        traced = traced or any(is_traced(x) for x in jax.tree_util.tree_leaves(opt_state))
        if opt_state is None and not traced:
            state = init_opt_states(state, updater, group_keys)
            opt_state = True if flat else state.opt_states[group_keys]
    if traced:
        if extra_args is not None:
            raise KVStoreError(
                f"keys {list(grouped)}: extra_args={sorted(extra_args)!r} are taken by eager "
                "pushes only, given a push inside a trace (there, call the optimizer's update "
                "with them in your own step)"
            )
        if flat:
            stored = [state.stored_values[i] for i in index]
        return push_in_trace(state, grouped, stored, opt_state, updater, axis_name, reduce)
    if axis_name is not None:
        raise KVStoreError(
            f"axis_name={axis_name!r}: expected to be called inside pmap or shard_map, given an "
            "eager call (eagerly, a list of per-device values is already summed over devices)"
        )
    if state.multi_axis and any(len(xs) > 1 for xs in grouped.values()):
        key = next(k for k, xs in grouped.items() if len(xs) > 1)
        raise KVStoreError(
            f"key {shown(key)}: a store on a mesh of several axes {tuple(state.mesh.axis_names)} "
            f"sums along {state.axis!r} inside shard_map; eagerly it expects one value per "
            f"key, given {len(grouped[key])}; push them inside your shard_map step with "
            f"axis_name={state.axis!r}, or sum them first"
        )
    counts = [len(xs) for xs in grouped.values()]
    if reduce == "mean" and spans_processes(state.devices):
        counts = _reduce.job_counts(counts)  # every process's values counted
    means = _reduce.divisors(state, list(grouped), counts, reduce)
    alone = plans.own_leaves(state, index, tuple(grouped), opt_state is not None) if flat else None
    if alone is not None:  # keys of their own in a flat state: their arrays alone
        own, at = alone
        if at is not None:
            opt_state = state.group_states[at]
        stored = [state.leaves[j] for j in own]
        return push_eager(
            state, grouped, index, stored, opt_state, options, extra_args, means, own=own
        )
    if flat:
        return push_eager_flat(state, grouped, stored, options, extra_args, means)
    return push_eager(state, grouped, index, stored, opt_state, options, extra_args, means)


def with_opt_state(state: KVState, keys: list[Key], updater: Any) -> KVState:
    """``state`` with the optimizer state an eager push of ``keys`` under the optax
    ``updater`` makes first, where none of them has any yet (else ``state`` itself): the same
    group and the same computation as the push's (under a flat layout, the keys' views made
    inside it), so that a caller may make it before pushing."""
    updater = tree_view.viewed(state, as_updater(updater))
    group_keys, opt_state = optimizer_group(state, tuple(keys), unpack=False)
    return state if opt_state is not None else init_opt_states(state, updater, group_keys)


def _one_key(keys: Any) -> bool:
    """Whether a push names one key: alone, or in a list or tuple of it (a mapping or a tree
    is taken as several)."""
    if isinstance(keys, int | str):
        return True
    if not isinstance(keys, list | tuple) or not keys:
        return False
    first = keys[0]
    # (C-level passes: the types first, so that the count compares ints or strs alone)
    return (
        isinstance(first, int | str)
        and set(map(type, keys)) == {type(first)}
        and keys.count(first) == len(keys)
    )


@_annotated(PULL)
def pull(
    state: KVState,
    keys: Any,
    *,
    devices: Any = None,
    axis_name: Any = None,
    local: bool = False,
) -> Any:
    """The stored value of ``keys`` (one key: one array; a list: a list, repeats allowed).

    Args:
      state: the store.
      keys: a key, a list of keys, or a tree whose leaves' paths are keys (its leaves are not
        read): the same tree is returned with the stored values as its leaves.
      devices: where to place the result: a device or context, or a list of them; each result
        is one ``jax.Array`` replicated on exactly those devices. ``None`` returns the stored
        arrays themselves (replicated over the store's devices, or sharded across them for
        values above the big-array bound).
      axis_name: inside ``shard_map``, with a state that entered with :func:`specs`: the
        mapped axis the sharded values are split over. Their blocks are all-gathered, so each
        device gets the whole value, as MXNet's pull gives.
      local: inside ``shard_map``: give each sharded value's block on this device instead (no
        communication); elsewhere the stored value as it is.

    Examples:
      >>> import jax, jax.numpy as jnp, jaxkv
      >>> s = jaxkv.init(jaxkv.empty(), {1: jnp.arange(3.0)})
      >>> jaxkv.pull(s, 1, devices=jax.devices()[0]).tolist()
      [0.0, 1.0, 2.0]
    """
    tree = trees.structure(keys)
    if tree is not None:
        got = pull(state, tree.keys, devices=devices, axis_name=axis_name, local=local)
        return trees.fill(tree, got)
    if axis_name is None:
        fast = plans.pull(state, keys, devices)
        if fast is not plans.NO_PLAN:
            return fast
    single = not isinstance(keys, list | tuple)
    keys = [keys] if single else list(keys)
    values = [state[k] for k in keys]
    if not local and any(is_traced(v) and is_block(state, k, v) for k, v in zip(keys, values)):
        whole = gather_blocks(state, {k: state[k] for k in set(keys)}, axis_name)
        values = [whole[state.keys()[state.index(k)]] for k in keys]
    if devices is not None:
        target = devices_of(devices)
        if target != state.devices or any(buckets.is_split(state, state.index(k)) for k in keys):
            values = replicate(values, target)
    return values[0] if single else values


def gather(state: KVState, values: Any, axis_name: Any) -> Any:
    """The whole value of each key in ``values`` (a mapping ``{key: leaf}`` with leaves as in
    ``state.values``, or a tree whose leaves' paths are keys), in the same structure: inside
    ``shard_map``, blocks are all-gathered over ``axis_name``, whole values kept. ``jax.grad``
    through it gives each block's gradient already summed over the axis (AD's
    reduce-scatter). The blocks of one split bucket's keys are gathered together."""
    tree = trees.split(values)
    if tree is None:
        return gather_blocks(state, values, axis_name)
    whole = gather_blocks(state, tree.mapping, axis_name)
    return trees.fill(tree, [whole[k] for k in tree.keys])


def specs(state: KVState, axis_name: Any, tree: Any = None) -> Any:
    """The ``PartitionSpec`` of every leaf of ``state``, for ``shard_map``'s ``in_specs`` and
    ``out_specs``: values the store keeps sharded (and their optimizer-state leaves of the same
    shape) are split along ``axis_name`` (``P(axis_name)``), all others replicated (``P()``).

    Inside the step each sharded key's leaf is then this device's block; :func:`push` with
    ``axis_name`` updates it in place and the state leaves the step in the same layout. Use
    the store's devices in the same order for the mesh (``state.mesh`` is one).

    With ``tree`` (a tree whose leaves' paths are keys, or a key or list of keys), the
    ``PartitionSpec`` of each of those keys' values instead, in the same structure: the specs
    of the blocks :func:`pull` with ``local=True`` gives inside the step.

    Examples:
      >>> import jax, jax.numpy as jnp, jaxkv
      >>> devices = jax.devices("cpu")  # 8 simulated CPU devices in the tests
      >>> s = jaxkv.init(jaxkv.empty(devices), {"w": jnp.zeros((8, 4096)), "b": jnp.zeros(3)})
      >>> sp = jaxkv.specs(s, "d")
      >>> tuple(sp.values["b"]), tuple(sp.values["w"])
      ((), ('d',))
    """
    every = buckets.leaf_specs(state, axis_name)
    if tree is None:
        return every
    split = trees.structure(tree)
    if split is not None:
        return trees.fill(split, [every.values[k] for k in split.keys])
    if isinstance(tree, list | tuple):
        return [every.values[state.keys()[state.index(k)]] for k in tree]
    return every.values[state.keys()[state.index(tree)]]


def init_optimizer(state: KVState, optimizer: Any, keys: Any = None) -> KVState:
    """``state`` with a fresh optax optimizer state for ``keys`` (default: every key), made
    ahead of the first step in the store's layout, so that a jitted step sees the same tree
    in and out and compiles once.

    The keys form one optimizer group: a push with ``updater=optimizer`` then updates them as
    one tree, exactly as ``optax.update`` on ``{key: value}`` would (``clip_by_global_norm``
    uses the norm over all of them), and must push all of them. Groups that lie inside
    ``keys`` are replaced.

    Raises:
      KVStoreError: ``optimizer`` is not an optax transformation (nor a wrapper of one with
        a ``gradient_transformation()`` method, ``optax.MultiSteps``), its ``init`` raised
        (the original as the ``__cause__``), or a key already belongs to
        a group that reaches beyond ``keys``.

    Examples:
      >>> import jax.numpy as jnp, jaxkv, optax
      >>> s = jaxkv.init(jaxkv.empty(), {"a": jnp.ones(3), "b": jnp.ones(2)})
      >>> s = jaxkv.init_optimizer(s, optax.adam(0.1))
      >>> list(s.opt_states)
      [('a', 'b')]
    """
    optimizer = tree_view.viewed(state, as_transformation(optimizer, "init_optimizer"))
    if keys is None:
        keys = state.keys()
    tree = trees.structure(keys)
    if tree is not None:
        keys = tree.keys
    given = keys if isinstance(keys, list | tuple) else [keys]
    keys = sorted({state.keys()[state.index(k)] for k in given})
    for known in state.opt_states:
        outside = [k for k in known if k not in keys]
        if outside and len(outside) < len(known):
            raise KVStoreError(
                f"keys {keys}: key {next(k for k in known if k in keys)!r} belongs to the "
                f"optimizer group {list(known)}, expected a group inside the keys given, given "
                f"keys without {outside}; include them, or leave the group's keys out"
            )
    values = [state[k] for k in keys]
    if any(is_traced(v) for v in values):
        if any(is_block(state, k, v) for k, v in zip(keys, values)):
            raise KVStoreError(
                f"keys {keys}: expected whole values to make optimizer state for, given this "
                "device's blocks (inside shard_map); call jaxkv.init_optimizer before the step"
            )
        whole = dict(zip(keys, values))
        return state.replace(opt_states={tuple(keys): init_state(optimizer, whole)})
    return init_opt_states(state, optimizer, keys)


@_annotated("jaxkv.pushpull")
def pushpull(
    state: KVState,
    keys: Any,
    values: Any = MISSING,
    *,
    updater: Updater | optax.GradientTransformation | None = None,
    devices: Any = None,
    axis_name: Any = None,
    donate: bool = False,
    reduce: str | None = None,
) -> tuple[KVState, Any]:
    """``push`` then ``pull`` of the same keys: returns ``(new_state, pulled)``.

    ``donate=True`` lets the push reuse the buffers of ``state``, ``reduce`` is the push's,
    and ``axis_name`` (inside ``pmap``/``shard_map``) is used by both, as in :func:`push` and
    :func:`pull`.

    Examples:
      >>> import jax.numpy as jnp, jaxkv
      >>> s = jaxkv.init(jaxkv.empty(), {0: jnp.zeros(2)})
      >>> s, v = jaxkv.pushpull(s, 0, jnp.ones(2))
      >>> v.tolist()
      [1.0, 1.0]
    """
    tree = trees.split(keys) if values is MISSING else None
    if tree is not None:  # flattened once: the push gets its leaves by path
        trees.check_push(state, tree)
        new = push(
            state, tree.mapping, updater=updater, axis_name=axis_name, donate=donate, reduce=reduce
        )
        got = pull(new, tree.keys, devices=devices, axis_name=axis_name)
        return new, trees.fill(tree, got)
    if values is MISSING and isinstance(keys, Mapping):
        keys, values = list(keys.keys()), list(keys.values())
    new = push(
        state, keys, values, updater=updater, axis_name=axis_name, donate=donate, reduce=reduce
    )
    return new, pull(new, keys, devices=devices, axis_name=axis_name)
