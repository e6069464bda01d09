"""The eager fast path: a push's or pull's pairing, checks and layout worked out once per call
signature and reused, so that a repeated call is one dispatch with no per-key host work beyond
reading each value's type, shape, dtype and device.

A *plan* is made by the first call of a signature, after the general path's own checks
(``pairing.group``) have passed, and only for calls it can replay exactly: one process, no
gradient compression, distinct keys, every value a single-device ``jax.Array`` of the stored
shape, one value per key or one per store device in mesh order. Every later call with the same
signature is compared with the plan, value by value, in C-level passes (types, shapes, dtypes,
devices); anything that differs goes the general way, which decides, refuses or recompiles as
it always does. So the fast path never gives another result than the general one: it only
skips the work whose outcome it already knows.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import jax
import optax

from jaxkv._src.core.eager import flat_push_fn, push_fn
from jaxkv._src.core.reduce import divisors
from jaxkv._src.core.signature import Kind, PushOptions
from jaxkv._src.core.updater import optimizer_group
from jaxkv._src.errors import KVStoreError
from jaxkv._src.jax_internals import all_eager, assemble, per_device, single_devices
from jaxkv._src.state import buckets
from jaxkv._src.state.kvstate import Key, KVState, normalize_key
from jaxkv._src.state.pairing import devices_of, group
from jaxkv._src.state.placement import Later, as_pushed, for_outs, stacked_sharding

__all__ = ["NO_PLAN", "checked_group", "prepare_fill", "pull", "push"]

_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")
_AVAL = operator.attrgetter("aval")


def _typed_as(flat: Sequence[jax.Array], avals: tuple, shapes: tuple, dtypes: tuple) -> bool:
    """Whether the eager arrays ``flat`` have ``shapes`` and ``dtypes``: asked first by their
    avals, the very objects ``avals`` holds (JAX makes one per shape, dtype and weak type: one
    C-level pass with no comparison called, 8 us at 193 values where shapes and dtypes took
    31), then, where one is another object, by shape and dtype."""
    return (len(flat) == len(avals) and all(map(operator.is_, map(_AVAL, flat), avals))) or (
        tuple(map(_SHAPE, flat)) == shapes and tuple(map(_DTYPE, flat)) == dtypes
    )


_KEY_TYPES = {int, str}
NO_PLAN = _NO_PLAN = object()  # a signature the fast path cannot replay: the general path
# This call's values cannot be replayed (their devices, say), but another call of the same
# signature may be: nothing is cached.
_NOT_NOW = object()


class _Plans:
    """Plans per signature, least recently used dropped first."""

    def __init__(self, size: int = 256):
        self._size = size
        self._plans: collections.OrderedDict = collections.OrderedDict()

    def get(self, sig: tuple) -> Any:
        plan = self._plans.get(sig)
        if plan is not None:
            # Dropped by another thread meanwhile: still a valid plan.
            with contextlib.suppress(KeyError):
                self._plans.move_to_end(sig)
        return plan

    def put(self, sig: tuple, plan: Any) -> None:
        self._plans[sig] = plan
        while len(self._plans) > self._size:
            try:
                self._plans.popitem(last=False)
            except KeyError:  # emptied by another thread
                break

    def clear(self) -> None:
        self._plans.clear()


_PUSHES = _Plans()
_PULLS = _Plans()


def _anchored(plan: Any, state: KVState) -> bool:
    """Whether ``plan`` was made for ``state``'s key set, shapes and optimizer groups (the
    very objects: a plan keeps them alive, so their ids in the signature cannot be reused)."""
    return (
        plan.keys is state.keys()
        and plan.shapes_of is state.key_shapes
        and plan.groups is state.groups
    )


@dataclasses.dataclass(slots=True, eq=False)
class _PushPlan:
    keys: tuple  # the state's key set, shapes and groups this plan was made for
    shapes_of: tuple
    groups: tuple
    index: list[int]  # each pushed key's position in the state, in sorted key order
    whole: bool  # the push updates every key of the state
    perm: list[int] | None  # each sorted key's position in the call (None: the call's order)
    per: int  # values per key
    shapes: tuple  # each value's expected shape, dtype and device, in call order
    dtypes: tuple
    devices: tuple
    avals: tuple  # the avals of the values the plan was made from (see _typed_as)
    puts: list[tuple[int, Any]]  # (sorted position, where the value must be put first)
    stacks: list[tuple[int, tuple, Any]]  # (sorted position, global shape, sharding)
    group: int | None  # the optimizer group's position in the state's groups
    residuals: list[None]
    fn: Callable
    flat: bool  # fn is a flat push: fn(state, pushed) -> new state
    # Under a flat layout where every pushed key is an array of its own (and its optimizer
    # group's state is not packed): those arrays' positions among the leaves, pushed by the
    # per-key computation (fn) and written back in place of them, no bucket touched.
    own: list[int] | None = None


def _call(keys: Any, values: Any) -> tuple[tuple, Sequence[Any], int, Sequence[Any]] | None:
    """A call's keys and values (or outs) in MXNet's forms a plan can replay: ``(call keys,
    values per key, values per key count, every value in call order)``, for a key or a list of
    plain ``int``/``str`` keys, each with one item or each with a list of as many items; else
    ``None``."""
    if isinstance(keys, list | tuple):
        if not isinstance(values, list | tuple) or len(values) != len(keys) or not keys:
            return None
        ckeys = tuple(keys)
    else:
        ckeys, values = (keys,), (values,)
    if not set(map(type, ckeys)) <= _KEY_TYPES:
        return None
    kinds = set(map(type, values))
    if len(kinds) != 1:
        return None
    if kinds <= {list, tuple}:
        lengths = set(map(len, values))
        if len(lengths) != 1:
            return None
        (per,) = lengths
        flat: Sequence[Any] = list(itertools.chain.from_iterable(values))
    else:
        per, flat = 1, values
    if not flat:
        return None
    return ckeys, values, per, flat


class _Grouped(NamedTuple):
    """What ``pairing.group`` found for a call (see :func:`checked_group`): the state's key set and
    shapes it checked against (by identity), each value's shape, dtype and device in call
    order, and the keys in sorted order with their place in the call."""

    keys: tuple
    shapes_of: tuple
    shapes: tuple
    dtypes: tuple
    devices: tuple
    avals: tuple
    order: tuple
    at: tuple


_GROUPS = _Plans()


def checked_group(state: KVState, keys: Any, values: Any) -> dict[Key, list[jax.Array]]:
    """``pairing.group(state, keys, values)``: each key's checked values, sorted by key. A call
    whose values have the shapes, dtypes and devices of one grouped before against the same
    key set and shapes is grouped again without its per-value checks (C-level passes over the
    values): a 1000-key push from 8 devices checks 8,000 values once, not at every step."""
    call = _call(keys, values) if jax.process_count() == 1 and state.compression is None else None
    if call is not None:
        ckeys, given, per, flat = call
        # (whether each key's values come as a list is part of the form: `push(k, [x])` and
        # `push([k], [x])` name the same keys with one value each, grouped differently)
        form = (ckeys, per, isinstance(given[0], list | tuple))
        seen = _GROUPS.get(form)
        if (
            seen is not None
            and seen.keys is state.keys()
            and seen.shapes_of is state.key_shapes
            and all_eager(flat)
            and _typed_as(flat, seen.avals, seen.shapes, seen.dtypes)
            and single_devices(flat) == seen.devices
        ):
            if form[2]:
                return {k: list(given[i]) for k, i in zip(seen.order, seen.at)}
            return {k: [given[i]] for k, i in zip(seen.order, seen.at)}
    grouped = group(state, keys, values)
    if call is not None and len(grouped) == len(ckeys) and all_eager(flat):
        where = {normalize_key(k): i for i, k in enumerate(ckeys)}
        seen = _Grouped(
            keys=state.keys(),
            shapes_of=state.key_shapes,
            shapes=tuple(map(_SHAPE, flat)),
            dtypes=tuple(map(_DTYPE, flat)),
            devices=single_devices(flat),
            avals=tuple(map(_AVAL, flat)),
            order=tuple(grouped),
            at=tuple(where[k] for k in grouped),
        )
        _GROUPS.put(form, seen)
    return grouped


def push(
    state: KVState,
    keys: Any,
    values: Any,
    options: PushOptions,
    extra_args: Any = None,
) -> KVState | None:
    """``jaxkv.push`` of eager values by a plan, or ``None`` where the general path must run
    (see the module doc)."""
    if state.compression is not None or jax.process_count() > 1:
        return None
    call = _call(keys, values)
    if call is None:
        return None
    ckeys, values, per, flat = call
    if not all_eager(flat) or (per > 1 and state.multi_axis):
        return None
    # The plan's key: the state it was made for (anchored by the very objects, which the plan
    # keeps alive) and its facts, the call's keys and values per key, and the push's options
    # (one object: an option added to it is part of this key).
    sig = (
        id(state.keys()),
        id(state.key_shapes),
        id(state.groups),
        state.facts(),
        ckeys,
        per,
        options,
    )
    plan = _PUSHES.get(sig)
    if plan is None or (plan is not _NO_PLAN and not _anchored(plan, state)):
        plan = _push_plan(state, ckeys, values, per, flat, options)
        if plan is _NOT_NOW:
            return None
        _PUSHES.put(sig, plan)
    if plan is _NO_PLAN:
        return None
    if (
        not _typed_as(flat, plan.avals, plan.shapes, plan.dtypes)
        or single_devices(flat) != plan.devices
    ):
        return None
    return _run_push(plan, state, flat, extra_args)


def _push_plan(
    state: KVState,
    ckeys: tuple,
    values: Sequence[Any],
    per: int,
    flat: Sequence[jax.Array],
    options: PushOptions,
) -> Any:
    """The plan for a push like this one, ``_NO_PLAN`` (never for this signature), or
    ``_NOT_NOW`` (not for these values); raises what the general path would raise for this
    call (its own checks run first)."""
    grouped = group(state, list(ckeys), list(values))
    order = tuple(grouped)
    if len(order) != len(ckeys):  # a key repeats: the general path sums its values
        return _NO_PLAN
    devices = single_devices(flat)
    n_devices = len(state.devices)
    if per > 1 and (per != n_devices or n_devices == 1):
        return _NO_PLAN
    if None in devices:
        return _NOT_NOW
    call = [normalize_key(k) for k in ckeys]
    where = {k: i for i, k in enumerate(call)}
    perm = [where[k] for k in order]
    index = [state.index(k) for k in order]
    shapes = []
    for k in call:
        shapes += [state.key_shapes[state.index(k)]] * per
    if tuple(map(_SHAPE, flat)) != tuple(shapes):  # a block's shape, accepted in shard_map
        return _NOT_NOW
    kinds: list[Kind] = []
    puts: list[tuple[int, Any]] = []  # (sorted position, where the value must be put)
    stacks: list[tuple[int, tuple, Any]] = []  # (sorted position, global shape, sharding)
    for p, i in enumerate(index):
        mine = flat[perm[p] * per : (perm[p] + 1) * per]
        if len({x.dtype for x in mine}) != 1:
            return _NOT_NOW
        shape = state.key_shapes[i]
        if per == 1:
            kinds.append("one")
            if as_pushed(state, mine[0], devices[perm[p]]) is None:
                puts.append((p, state.sharding_of(state.keys()[i])))
            continue
        if devices[perm[p] * per : (perm[p] + 1) * per] != state.devices:
            return _NOT_NOW
        if not shape:  # scalars travel as shape (1,): the general path reshapes them
            return _NO_PLAN
        kinds.append("stacked")
        block = shape
        stacks.append((p, (block[0] * n_devices, *block[1:]), stacked_sharding(state.mesh)))
    group_at = None
    if isinstance(options.updater, optax.GradientTransformation):
        group_keys, opt_state = optimizer_group(state, order, unpack=state.flat_layout is None)
        if opt_state is None:  # made by the general path's first push; then a new signature
            return _NO_PLAN
        group_at = state.groups.index(group_keys)
    means = divisors(state, order, [per] * len(order), options.reduce)
    own = state.own_leaves(index)
    if state.flat_layout is None or own is not None:
        fn = push_fn(state, order, tuple(kinds), options, means)
    else:
        fn = flat_push_fn(state, order, tuple(kinds), options, means)
    return _PushPlan(
        keys=state.keys(),
        shapes_of=state.key_shapes,
        groups=state.groups,
        index=index,
        whole=index == list(range(len(state.keys()))),
        perm=None if perm == list(range(len(perm))) else perm,
        per=per,
        shapes=tuple(shapes),
        dtypes=tuple(map(_DTYPE, flat)),
        devices=devices,
        avals=tuple(map(_AVAL, flat)),
        puts=puts,
        stacks=stacks,
        group=group_at,
        residuals=[None] * len(order),
        fn=fn,
        flat=state.flat_layout is not None and own is None,
        own=own,
    )


def own_leaves(
    state: KVState, index: list[int], keys: tuple[Key, ...], optax_push: bool
) -> tuple[list[int], int | None] | None:
    """For a push of ``keys`` (at ``index``) whose arrays are their own in a flat state
    (``KVState.own_leaves``), those arrays' positions among the leaves and, for an optax push,
    the position of their optimizer group, which must be exactly those keys, its state made
    already; ``None`` otherwise (the push then takes the buckets)."""
    group = None
    if optax_push:
        keys = tuple(sorted(keys))
        if keys not in state.groups:
            return None
        group = state.groups.index(keys)
    own = state.own_leaves(index)
    return None if own is None else (own, group)


def _run_push(
    plan: _PushPlan, state: KVState, flat: Sequence[jax.Array], extra_args: Any = None
) -> KVState:
    per = plan.per
    pushed: list[Any]
    if per == 1:
        pushed = list(flat) if plan.perm is None else [flat[j] for j in plan.perm]
    else:
        pushed = [None] * len(plan.index)
        blocks = cast(list, flat)  # a list: made by push() from the per-device lists
        perm = plan.perm
        for p, shape, sharding in plan.stacks:
            j = p if perm is None else perm[p]
            pushed[p] = assemble(shape, sharding, blocks[j * per : (j + 1) * per])
    if plan.puts:
        moved = jax.device_put([pushed[p] for p, _ in plan.puts], [s for _, s in plan.puts])
        for (p, _), x in zip(plan.puts, moved):
            pushed[p] = x
    if plan.flat:
        return cast(KVState, plan.fn(state, pushed, extra_args))
    if plan.own is not None:  # (keys of their own in a flat state)
        leaves = state.leaves
        opt = None if plan.group is None else state.group_states[plan.group]
        new, new_opt, _ = plan.fn(
            [leaves[j] for j in plan.own], opt, plan.residuals, pushed, extra_args
        )
        return buckets.with_leaves(
            state,
            dict(zip(plan.own, new)),
            {} if plan.group is None else {plan.group: new_opt},
        )
    held = state.stored_values
    stored = list(held) if plan.whole else [held[i] for i in plan.index]
    opts = state.group_states
    opt_state = None if plan.group is None else opts[plan.group]
    new, new_opt, _ = plan.fn(stored, opt_state, plan.residuals, pushed, extra_args)
    if plan.whole:
        values = new
    else:
        values = list(held)
        for i, v in zip(plan.index, new):
            values[i] = v
    if plan.group is not None:
        opts = (*opts[: plan.group], new_opt, *opts[plan.group + 1 :])
    return KVState(
        keys=state.keys(),
        devices=state.devices,
        values=values,
        opt_states=opts,
        bound=state.bigarray_bound,
        residuals=state.residual_leaves,
        compression=state.compression,
        shapes=state.key_shapes,
        groups=state.groups,
        mesh=state.user_mesh,
        policy=state.policy,  # a per-key state (no flat layout, no packings) under its policy
        trees=state.trees,
        reduce=state.reduce,
        mesh_axes=state.mesh_axes,
    )


def _planned(plans: _Plans, state: KVState, ckeys: tuple, how: Any, make: Callable) -> Any:
    """The plan of a read of ``ckeys`` (``how``: where to, or how many outs per key) from
    states of ``state``'s key set, shapes and placement: cached in ``plans``, made by
    ``make()`` where none is cached or the cached one was made for another key set."""
    sig = (id(state.keys()), id(state.key_shapes), state.facts(), ckeys, how)
    plan = plans.get(sig)
    if plan is None or (plan is not _NO_PLAN and not _anchored(plan, state)):
        plan = make()
        plans.put(sig, plan)
    return plan


@dataclasses.dataclass(slots=True, eq=False)
class _PullPlan:
    keys: tuple
    shapes_of: tuple
    groups: tuple
    index: list[int]
    whole: bool  # every key of the state, in its order


def pull(state: KVState, keys: Any, devices: Any) -> Any:
    """``jaxkv.pull`` of eager values that stay where the store keeps them (``devices`` is
    ``None`` or the store's own devices, and no pulled value is sharded or in a split bucket),
    by a plan (under a flat layout, the state's views of its buckets); or ``_NO_PLAN`` where
    the general path must run."""
    single = not isinstance(keys, list | tuple)
    ckeys = (keys,) if single else tuple(keys)
    if not ckeys or not set(map(type, ckeys)) <= _KEY_TYPES:
        return _NO_PLAN
    if devices is None:
        where = None
    elif isinstance(devices, list | tuple):
        where = tuple(devices)
    else:
        where = (devices,)
    plan = _planned(_PULLS, state, ckeys, where, lambda: _pull_plan(state, ckeys, devices))
    if plan is _NO_PLAN:
        return _NO_PLAN
    held = state.stored_values
    values = list(held) if plan.whole else [held[i] for i in plan.index]
    if not all_eager(values):
        return _NO_PLAN
    return values[0] if single else values


def _pull_plan(state: KVState, ckeys: tuple, devices: Any) -> Any:
    index = [state.index(k) for k in ckeys]  # refuses what the general path refuses
    if devices is not None:
        if devices_of(devices) != state.devices:
            return _NO_PLAN
        if any(buckets.is_split(state, i) for i in index):
            return _NO_PLAN
    whole = index == list(range(len(state.keys())))
    return _PullPlan(state.keys(), state.key_shapes, state.groups, index, whole)


@dataclasses.dataclass(slots=True, eq=False)
class _FillPlan:
    keys: tuple
    shapes_of: tuple
    groups: tuple
    unique: list[int]  # the distinct keys' positions in the state, whose values are copied
    of: list[int]  # each out's value among those copies
    shapes: tuple  # each out's expected shape and dtype
    dtypes: tuple
    at: dict[tuple, list[int]]  # the outs' devices -> their positions in the store's devices


_DATA = operator.methodcaller("held_value")  # (shape and dtype, nothing read)


def prepare_fill(state: KVState, keys: Any, outs: Any, handle: type) -> Callable | None:
    """``KVStore.pull(keys, out=outs)`` by a plan, checked now and done by the function
    returned: called with a state of the same key set and shapes (this one, or the one a push
    made from it) and ``lend``, it gives each ``handle`` (``NDArray``) of ``outs`` its key's
    value on the out's own device, and returns ``True``. With ``lend`` the value is the stored
    array itself (or its part on that device, taken out of it when read: ``set_part``), with
    no copy: the store must then not donate a value to a push while an out holds it (``lent``
    is called once, with the stored arrays handed out); without, a fresh copy (one
    computation for all). It returns ``False``, having done nothing, for a state of other keys
    or shapes.

    ``None`` where the general path must run: another process, a sharded value, an out of
    another type, shape or dtype than the stored value, or on a device outside the store.

    Under a flat layout a key in a bucket is read through its view, a fresh array that no push
    ever donates: it is handed out as it is, with or without ``lend``."""
    call = _call(keys, outs)
    if call is None:
        return None
    ckeys, _, per, flat = call
    if set(map(type, flat)) != {handle}:
        return None
    plan = _planned(_FILLS, state, ckeys, per, lambda: _fill_plan(state, ckeys, per))
    if plan is _NO_PLAN:
        return None
    data = list(map(_DATA, flat))
    if tuple(map(_SHAPE, data)) != plan.shapes or tuple(map(_DTYPE, data)) != plan.dtypes:
        return None
    devices = tuple(map(handle.jax_device, flat))  # type: ignore[attr-defined]
    at = plan.at.get(devices)
    if at is None:
        positions = state.positions
        if not all(d in positions for d in devices):
            return None
        at = plan.at[devices] = [positions[d] for d in devices]

    def go(
        now: KVState, lend: bool, lent: Callable | None = None, later: Callable | None = None
    ) -> bool:
        if not (now.keys() is plan.keys and now.key_shapes is plan.shapes_of):
            return False
        layout = now.flat_layout
        if later is not None and lend and layout is not None:
            # The keys in buckets: their views made when an out is first read (one computation
            # for all, as below), ``later`` noting them for the store, which spares them before
            # it donates; the keys kept as arrays of their own lent as they are.
            own = {i: now.leaves[layout.leaf(i)] for i in plan.unique if layout.where[i][0] < 0}
            viewed = [i for i in plan.unique if i not in own]
            made = Later(now, viewed, lent) if viewed else None
            slot = {i: n for n, i in enumerate(viewed)}
            for o, j, p, d, shape, dtype in zip(
                flat, plan.of, at, devices, plan.shapes, plan.dtypes
            ):
                i = plan.unique[j]
                if i in own:
                    o.set_part(own[i], p, d)
                else:
                    o.set_later(made, slot[i], p, d, shape, dtype)
            if own and lent is not None:
                lent(list(own.values()))
            if made is not None:
                later(made)
            return True
        fresh = for_outs(now, plan.unique, lend)
        if len(now.devices) == 1:
            for o, j, d in zip(flat, plan.of, devices):
                o.set_value(fresh[j], d)
        else:  # each out its device's part, taken out of the array when read
            for o, j, p, d in zip(flat, plan.of, at, devices):
                o.set_part(fresh[j], p, d)
        if lend and lent is not None:  # the store notes the arrays it lent
            lent(fresh)
        return True

    return go


def _fill_plan(state: KVState, ckeys: tuple, per: int) -> Any:
    if jax.process_count() > 1:
        return _NO_PLAN
    try:
        index = [state.index(k) for k in ckeys]
    except KVStoreError:  # the general path refuses it
        return _NO_PLAN
    if any(buckets.is_split(state, i) for i in index):
        return _NO_PLAN
    held = buckets.stored_types(state)  # (no computation: a flat state's views not made)
    if not all_eager(list(state.leaves)):
        return _NO_PLAN
    if len(state.devices) > 1:  # the copies' shards must come in the store's device order
        first = per_device(state.leaves[0])
        if single_devices(first) != state.devices:
            return _NO_PLAN
    unique = sorted(set(index))
    slot = {i: j for j, i in enumerate(unique)}
    return _FillPlan(
        keys=state.keys(),
        shapes_of=state.key_shapes,
        groups=state.groups,
        unique=unique,
        of=[slot[i] for i in index for _ in range(per)],
        shapes=tuple(state.key_shapes[i] for i in index for _ in range(per)),
        dtypes=tuple(held[i].dtype for i in index for _ in range(per)),
        at={},
    )


_FILLS = _Plans()
