"""Push and pull inside the user's trace (``jit``, ``pmap``, ``shard_map``).

The updater runs in the caller's trace. With ``axis_name``, each value is summed over the
mapped axes exactly once. A state that entered ``shard_map`` with :func:`jaxkv.specs` holds,
for each sharded key, only this device's block (rows along axis 0) of the value; the shapes in
its aux data still say the whole value's shape. For such a key:

=====================================  ==================================================
pushed value                           what ``push`` does with it
=====================================  ==================================================
whole shape, varying along the axis    reduce-scatter: each device keeps the sum of its rows
whole shape, invariant (already summed) each device keeps its rows
block shape                            taken as this device's rows of the sum (what AD
                                       gives through :func:`gather`'s all-gather)
=====================================  ==================================================

then the updater updates the block: as it is when elementwise along the rows, on the block
with each reduction over the rows completed across devices when those are its only cross-row
steps, else on the gathered whole value, keeping this device's rows (``on_blocks.py``). The state
leaves the step in the layout it came in.

A key with its own sharding along other mesh axes (tensor parallelism, ``KVState.tp_spec``) is,
inside ``shard_map`` over those axes, its value on one device of them, and its block is split
along its own dimensions over its own axes too (:func:`_own_split`): the updater's reductions
are completed over those as well (``on_blocks.Split``). A push inside ``shard_map`` without
varying-axes tracking over other axes than the summed ones is refused (:func:`_check_tracking`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

from jaxkv._src.core.collectives import (
    PULL,
    PUSH,
    SUM,
    all_gather,
    all_gathers,
    axis_arg,
    axis_names,
    axis_size,
    fused_psum,
    fused_psum_scatter,
    psum_scatter,
    scoped,
    unsummed_axes,
)
from jaxkv._src.core.on_blocks import Split, is_blockwise, run_on_blocks
from jaxkv._src.core.on_buckets import update_bucket
from jaxkv._src.core.reduce import axis_count, divide, divisors
from jaxkv._src.core.updater import apply_updater
from jaxkv._src.core.verified import batched
from jaxkv._src.errors import KVStoreError, shown
from jaxkv._src.jax_internals import (
    CAN_MARK_VARYING,
    all_gather_invariant,
    manual_axes,
    varying_axes,
)
from jaxkv._src.state import buckets
from jaxkv._src.state.buckets import as_blocks, block_shape, from_blocks
from jaxkv._src.state.kvstate import Key, KVState
from jaxkv._src.state.placement import place_leaves
from jaxkv._src.state.policy import scatters_alone

__all__ = ["gather", "is_block", "push_in_trace", "whole_shape"]


def whole_shape(state: KVState, key: Key, leaf: Any = None) -> tuple[int, ...]:
    """The shape of ``key``'s whole value in this trace: its shape, or for a key with its own
    sharding along other axes (tensor parallelism), inside ``shard_map`` over them, its value
    on this device of those axes (``KVState.local_shape``); ``leaf`` of the whole shape says
    the trace is not such a ``shard_map`` (a plain ``jit``)."""
    shape = state.shapes[key]
    if state.tp_spec(key) is None or (leaf is not None and tuple(leaf.shape) == shape):
        return shape
    return state.local_shape(key)


def is_block(state: KVState, key: Key, leaf: Any) -> bool:
    """Whether ``leaf`` (the stored value of ``key``) is only this device's block."""
    i = state.index(key)
    if buckets.split_parts(state, i) > 1:  # in a split bucket: a block where the bucket is a chunk
        return buckets.chunked(state, i)
    return tuple(leaf.shape) != whole_shape(state, key, leaf)


def _expected_block(state: KVState, key: Key, n: int) -> tuple[int, ...] | None:
    """The shape of ``key``'s block over ``n`` devices, or ``None`` if it cannot have one: rows
    along axis 0, or in a split bucket its flattened value's ``1/n`` (padded)."""
    whole = whole_shape(state, key)
    parts = buckets.split_parts(state, state.index(key))
    if parts > 1:
        return block_shape(whole, parts) if parts == n else None
    if not whole or whole[0] % n:
        return None
    return (whole[0] // n, *whole[1:])


def _block_size(state: KVState, leaves: Mapping[Key, Any], names: tuple) -> int:
    """The number of devices along ``names``, checked against each key's block ``leaves``."""
    if not names:
        raise KVStoreError(
            f"keys {list(leaves)}: each is only this device's block of its value (the state "
            "entered shard_map with jaxkv.specs), expected axis_name=<the mapped axis it is "
            "sharded over>, given none"
        )
    n = axis_size(names)
    for key, leaf in leaves.items():
        whole = whole_shape(state, key)
        if tuple(leaf.shape) != _expected_block(state, key, n):
            raise KVStoreError(
                f"key {shown(key)}: its leaf has shape {tuple(leaf.shape)}, expected the whole "
                f"shape {whole} or its block over axis {names} ({n} devices); enter "
                "shard_map with in_specs=jaxkv.specs(state, axis_name) on the store's devices"
            )
    return n


@scoped(PULL)
def gather(state: KVState, values: Mapping[Key, Any], axis_name: Any) -> dict[Key, Any]:
    """The whole value of each key in ``values`` (leaves as in ``state.values``): blocks are
    all-gathered over ``axis_name``, whole values kept. ``jax.grad`` through it gives each
    block's gradient already summed over the axis (AD's reduce-scatter). The blocks of one
    split bucket's keys are gathered together: one all-gather per bucket (and one
    reduce-scatter per bucket for their gradients)."""
    keys = [state.keys()[state.index(k)] for k in values]
    blocked = [k for k, v in zip(keys, values.values()) if is_block(state, k, v)]
    names = axis_names(axis_name) if axis_name is not None else ()
    if blocked:
        _block_size(state, {k: v for k, v in zip(keys, values.values()) if k in blocked}, names)
    given = dict(zip(keys, values.values()))
    flat = state.flat_layout
    together: dict[int, list[Key]] = {}  # split bucket -> its blocked keys, in key order
    for key in sorted(set(blocked), key=state.index):
        if buckets.split_parts(state, state.index(key)) > 1:
            assert flat is not None  # split buckets exist only in a flat state
            together.setdefault(flat.where[state.index(key)][0], []).append(key)
    owners = None
    if len(state.mesh.axis_names) == 1 and names == tuple(state.mesh.axis_names):
        owners = tuple(d.process_index for d in state.mesh.devices.flat)
    whole: dict[Key, Any] = {}
    for members in together.values():
        cat = jnp.concatenate([jnp.ravel(given[k]) for k in members])
        # (devices, blocks side by side)
        grid = all_gather(cat, axis_arg(names), what=f"keys {members}", owners=owners)
        # Split, not sliced: AD's transpose of a split is one concatenation, where each
        # slice's would be a padding to the whole grid (measured: 8 s a step on ResNet-50).
        widths = [math.prod(given[k].shape) for k in members]
        for k, part in zip(members, jax.lax.split(grid, widths, axis=1)):
            whole[k] = from_blocks(part, math.prod(state.shapes[k]), state.shapes[k])
    alone = [k for k in keys if k in blocked and k not in whole]
    if alone:  # one by one (no copy into one buffer), their gradients' sums checked together
        gathered = all_gathers(
            [given[k] for k in alone],
            axis_arg(names),
            tiled=True,
            whats=tuple(f"key {shown(k)}" for k in alone),
            owners=owners,
        )
        whole.update(zip(alone, gathered))
    return {key: whole.get(key, value) for key, value in zip(keys, values.values())}


def _sum_blocks(
    whole: list[tuple[int, jax.Array]], names: tuple, n: int, fuse_all: bool = False
) -> dict[int, Any]:
    """This device's rows of the sum of whole-shape values over ``names``: reduce-scattered
    where still to be summed (small ones together, per dtype and set of other axes they vary
    along; with ``fuse_all``, all of those together: the keys of a split bucket), else just
    this device's rows."""
    out: dict[int, Any] = {}
    small: dict[Any, list[int]] = {}
    values = dict(whole)
    for i, x in whole:
        todo = unsummed_axes(x, names)
        if set(todo) == set(names):
            if scatters_alone(x.size) and not fuse_all:
                with jax.named_scope(SUM):
                    out[i] = psum_scatter(x, axis_arg(names), tiled=True)
            else:
                small.setdefault(x.dtype, []).append(i)
            continue
        if todo:
            x = fused_psum([x], todo)[0]
        rows = x.shape[0] // n
        me = jax.lax.axis_index(axis_arg(names))
        out[i] = jax.lax.dynamic_slice_in_dim(x, me * rows, rows, 0)
    for idx in small.values():
        for i, x in zip(idx, fused_psum_scatter([values[i] for i in idx], n, axis_arg(names))):
            out[i] = x
    return out


def _sum_whole(whole: list[tuple[int, jax.Array]], names: tuple) -> dict[int, Any]:
    """Each value summed over the axes of ``names`` it still varies along: one collective per
    set of axes and dtype (and of other axes the values vary along: ``fused_psum``)."""
    out: dict[int, Any] = {}
    groups: dict[tuple, list[int]] = {}
    values = dict(whole)
    for i, x in whole:
        todo = unsummed_axes(x, names) if names else ()
        if todo:
            groups.setdefault((todo, x.dtype), []).append(i)
        else:
            out[i] = x
    for (todo, _), idx in groups.items():
        for i, x in zip(idx, fused_psum([values[i] for i in idx], todo)):
            out[i] = x
    return out


def _check_structure(
    state: KVState, optimizer: Any, keys: Sequence[Key], stored: Sequence[Any], opt_state: Any
) -> Any:
    """``optimizer.init``'s state for the whole values (shapes only), having refused an
    ``opt_state`` of another tree structure."""
    whole = jax.eval_shape(
        optimizer.init,
        {k: jax.ShapeDtypeStruct(whole_shape(state, k, s), s.dtype) for k, s in zip(keys, stored)},
    )
    want = jax.tree_util.tree_structure(whole)
    # jaxlib ships no stub for PyTreeDef, so mypy cannot type the comparison.
    if want != jax.tree_util.tree_structure(opt_state):  # type: ignore[operator]
        raise KVStoreError(
            f"keys {list(keys)}: the optimizer state in the store does not have the structure "
            "this optimizer makes; pass the optimizer the state was made with"
        )
    return whole


def _opt_blocks(keys: Sequence[Key], whole: Any, opt_state: Any, n: int | None) -> Any:
    """Which leaves of ``opt_state`` are this device's blocks: those whose shape differs from
    the leaf of ``whole`` (what ``optimizer.init`` gives for the whole values,
    :func:`_check_structure`)."""

    def block(w: Any, x: Any) -> bool:
        if tuple(x.shape) == tuple(w.shape):
            return False
        if n is None or tuple(x.shape) != (w.shape[0] // n, *w.shape[1:]):
            raise KVStoreError(
                f"keys {list(keys)}: an optimizer-state leaf has shape {tuple(x.shape)}, "
                f"expected {tuple(w.shape)} or its block; enter shard_map with "
                "in_specs=jaxkv.specs(state, axis_name)"
            )
        return True

    return jax.tree_util.tree_map(block, whole, opt_state)


def _own_split(state: KVState, key: Key, leaf: Any) -> dict[int, tuple[str, ...]]:
    """``key``'s own split in this trace (tensor parallelism): each dimension its own sharding
    splits, with that dimension's axes, where ``leaf`` is its value on one device of those axes
    (inside ``shard_map`` over them); none elsewhere."""
    spec = state.tp_spec(key)
    if spec is None or whole_shape(state, key, leaf) == tuple(state.shapes[key]):
        return {}
    return {
        d: (entry,) if isinstance(entry, str) else tuple(entry)
        for d, entry in enumerate(spec)
        if entry is not None
    }


def _split(own: Mapping[int, tuple[str, ...]], block: bool, names: tuple) -> Split:
    """Where a leaf is split across the devices of this trace: along its own dimensions
    ``own``, and where it is a block (``block``) along axis 0 over ``names`` too, after its
    own axes there (as ``KVState.key_spec`` lays it out)."""
    dims = dict(own)
    if block:
        dims[0] = (*dims.get(0, ()), *names)
    return Split(tuple(sorted(dims.items())))


def _opt_splits(
    state: KVState,
    keys: Sequence[Key],
    stored: Sequence[Any],
    whole: Any,
    blocks: Any,
    names: tuple,
) -> Any:
    """Where each leaf of the optax state is split (:func:`_split`; ``whole``, its leaves for
    the whole values): a block of rows where ``blocks`` (:func:`_opt_blocks`) says so, and
    along its key's own dimensions where it is a leaf of that key's shape below the key (an
    optax state's ``{key: leaf}``)."""
    owns = {k: _own_split(state, k, s) for k, s in zip(keys, stored)}
    shapes = {k: whole_shape(state, k, s) for k, s in zip(keys, stored) if owns[k]}

    def one(path: Any, w: Any, block: bool) -> Split:
        owner = buckets.leaf_owner(path, tuple(w.shape), shapes) if shapes else None
        return _split(owns[owner] if owner is not None else {}, block, names)

    return jax.tree_util.tree_map_with_path(one, whole, blocks)


def _check_tracking(state: KVState, keys: Sequence[Key], names: tuple) -> None:
    """Refuses a push summing over ``names`` inside ``shard_map`` over other axes of a store's
    mesh of several axes too, where ``shard_map`` does not track varying axes
    (``check_vma=False``): a gradient's sum over those other axes (that of a parameter
    replicated along "model" used beside split ones) is then left to each device's part, and
    jaxkv cannot tell which gradients JAX has summed. Under ``pmap`` (no tracking either) the
    mapped axes are the summed ones: every value is per device, and summed."""
    if not names or not CAN_MARK_VARYING or not state.multi_axis:
        return
    manual = manual_axes()
    others = sorted(set(manual or ()) - set(names))
    if not others or any(a in varying_axes(jax.lax.axis_index(a)) for a in names):
        return
    raise KVStoreError(
        f"keys {list(keys)}: push inside shard_map over the axes {sorted(manual or ())} "
        "without varying-axes tracking (check_vma=False): jaxkv needs shard_map's tracking "
        f"to know which gradients JAX has already summed over {others} (without it a "
        "parameter replicated along them gets each device's part of its gradient, and the "
        "step is silently wrong); expected shard_map's default check_vma=True, given "
        "check_vma=False. Remove check_vma=False and fix the varying-axes errors it hid "
        "(docs/troubleshooting.md)"
    )


def _kept_in_place(state: KVState) -> KVState:
    """Inside ``jit`` (not ``shard_map``), a state with split buckets, or with keys of their
    own sharding (tensor parallelism), with every leaf constrained to where the store keeps it:
    XLA's propagation may leave a bucket written with a whole value replicated, or a small key
    split along "model" split along the store's axis too, and a step given its own result
    would compile again. Elsewhere ``state`` as it is (inside ``shard_map`` the mesh's axes are
    manual: no constraint)."""
    flat = state.flat_layout
    if (flat is None or not flat.split) and not state.tp_specs:
        return state
    if manual_axes() != frozenset():  # inside shard_map (or a JAX that cannot say)
        return state
    return place_leaves(state)


def _where_stored(
    state: KVState, keys: Sequence[Key], pushed: list[Any], blocks: Sequence[bool]
) -> list[Any]:
    """Inside ``jit`` (not ``shard_map``), on a store of one array per key over several
    devices: each summed value constrained to where the store keeps its key. A gradient that
    XLA lays out otherwise (whole along "data", where the store splits the key along it) is
    then cut to each device's part where it lies, and the updater runs in the store's layout;
    without it XLA gathered the optimizer state into the gradient's layout instead (28
    all-gathers in ``examples/gpt_mesh.py``'s step). Under a flat layout, the keys of a bucket
    kept whole too (replicated, as the bucket is): else XLA split their update along the
    gradient's layout and gathered the moments back (an MLP's biases: 6 all-gathers and 3
    collective-permutes a step). Elsewhere ``pushed`` as it is."""
    if len(state.devices) < 2 or any(blocks):
        return pushed
    if manual_axes() != frozenset():  # inside shard_map (or a JAX that cannot say)
        return pushed
    flat = state.flat_layout is not None
    return [
        p
        if flat and buckets.split_parts(state, state.index(k)) > 1  # a split bucket's view
        else jax.lax.with_sharding_constraint(p, NamedSharding(state.mesh, state.key_spec(k)))
        for k, p in zip(keys, pushed)
    ]


def _placed(push: Any) -> Any:
    """``push`` with its new state kept where the store keeps it (:func:`_kept_in_place`)."""

    @functools.wraps(push)
    def placed(*args: Any, **kwargs: Any) -> KVState:
        return _kept_in_place(push(*args, **kwargs))

    return placed


def _new_axes(before: Any, after: Any) -> frozenset:
    """The mesh axes ``after`` varies along and ``before`` (a traced leaf) does not; none
    where ``before`` is no tracer (a value closed over, whose axes say nothing)."""
    if not isinstance(before, jax.core.Tracer):
        return frozenset()
    return varying_axes(after) - varying_axes(before)


def _same_axes(state: KVState, new: KVState, keys: Sequence[Key]) -> None:
    """Refuse a push whose new value (or optimizer-state leaf) of one of ``keys`` varies along
    mesh axes its leaf in ``state`` does not: ``shard_map``'s ``out_specs`` would refuse the
    step without naming the key. It comes of a pushed value or an updater that mixes in a
    value varying along another axis: a gradient not summed over the model's own axis, or an
    updater combining keys (``optax.clip_by_global_norm``) over tensor-parallel ones."""
    for key in keys:
        extra = _new_axes(state[key], new[key])
        if extra:
            had = sorted(varying_axes(state[key]))
            raise KVStoreError(
                f"key {shown(key)}: its new value varies along mesh axes {sorted(extra)}, expected "
                f"only the axes its stored value varies along ({had}), as its out_specs "
                f"{state.key_spec(key)} say; its pushed value or the updater "
                f"mixed in a value varying along {sorted(extra)}: sum its gradient over those "
                "axes before the push; with keys split along them (tensor parallel), push with "
                "an updater that treats each key apart (such as optax.adam), not one that "
                "combines keys (such as optax.clip_by_global_norm)"
            )
    touched = {state.opt_group(k) for k in keys}
    for group in [g for g in state.groups if g in touched]:
        old_leaves = jax.tree_util.tree_flatten_with_path(state.opt_states[group])[0]
        new_leaves = jax.tree_util.tree_leaves(new.opt_states[group])
        for (path, before), after in zip(old_leaves, new_leaves):
            extra = _new_axes(before, after)
            if extra:
                raise KVStoreError(
                    f"keys {list(group)}: the optimizer-state leaf "
                    f"{jax.tree_util.keystr(path)} varies along mesh axes {sorted(extra)} after "
                    f"the push, expected the axes it varied along before "
                    f"({sorted(varying_axes(before))}); the updater mixed in a value varying "
                    f"along {sorted(extra)}: with keys split along them (tensor parallel), push "
                    "with an updater that treats each key apart (such as optax.adam), not one "
                    "that combines keys (such as optax.clip_by_global_norm)"
                )


def _checked_axes(push: Any) -> Any:
    """``push`` refusing a new state whose pushed keys vary along other mesh axes than their
    leaves did (:func:`_same_axes`)."""

    @functools.wraps(push)
    def checked(
        state: KVState, grouped: dict[Key, list[jax.Array]], *args: Any, **kw: Any
    ) -> KVState:
        new = push(state, grouped, *args, **kw)
        _same_axes(state, new, list(grouped))
        return new

    return checked


@scoped(PUSH)
@_placed
@_checked_axes
def push_in_trace(
    state: KVState,
    grouped: dict[Key, list[jax.Array]],
    stored: list[Any],
    opt_state: Any,
    updater: Any,
    axis_name: Any,
    reduce: str = "sum",
) -> KVState:
    """``push`` of the validated contributions ``grouped`` (with their keys' stored values,
    and for an optax updater their group's optimizer state) when any of them is traced;
    ``reduce``: ``'mean'`` divides each sum by its contributions times the axes' devices."""
    keys = list(grouped)
    if state.compression is not None:
        raise KVStoreError(
            f"keys {keys}: a store with gradient compression {state.compression} "
            "expects eager pushes, given traced values (inside jit, compress with the "
            "caller's own code)"
        )
    names = axis_names(axis_name) if axis_name is not None else ()
    _check_tracking(state, keys, names)
    blocks = [is_block(state, k, s) for k, s in zip(keys, stored)]
    n = None
    if any(blocks):
        n = _block_size(state, {k: s for k, s, b in zip(keys, stored, blocks) if b}, names)
    index = [state.index(k) for k in keys]
    chunked = [buckets.chunked(state, i) for i in index]

    # Sum each key's contributions on this device, then over the axes: those still to be
    # summed over the same axes together, so that a value already summed (invariant) is not
    # added into one that is not and then summed a second time.
    whole: list[tuple[int, Any]] = []
    to_scatter: list[tuple[int, Any]] = []
    in_chunks: list[tuple[int, Any]] = []  # whole values of keys of split buckets, as blocks
    local: dict[int, list[Any]] = {}
    owner: list[int] = []  # each sum's key position
    for i, (key, xs, s, b) in enumerate(zip(keys, grouped.values(), stored, blocks)):
        xs = [x.astype(s.dtype) for x in xs]
        entire = whole_shape(state, key, s)
        full = [x for x in xs if tuple(x.shape) == entire]
        parts = [x for x in xs if tuple(x.shape) != entire]  # blocks: summed
        by_axes: dict[tuple, list[Any]] = {}
        for x in full:
            by_axes.setdefault(unsummed_axes(x, names) if names else (), []).append(x)
        for same in by_axes.values():
            owner.append(i)
            x = functools.reduce(operator.add, same)
            if chunked[i]:  # its padded, flattened value: device d's block is row d
                assert n is not None
                in_chunks.append((len(owner) - 1, as_blocks(x, n).reshape(-1)))
            else:
                (to_scatter if b else whole).append((len(owner) - 1, x))
        if b:
            local[i] = parts
    # The push's sums over the whole of its axes are checked together (verified.batched).
    with batched(axis_arg(names)) if names else contextlib.nullcontext():
        sums = _sum_whole(whole, names)
        if to_scatter:
            assert n is not None  # set above: to_scatter holds only keys whose values are blocks
            sums.update(_sum_blocks(to_scatter, names, n))
        if in_chunks:  # one reduce-scatter per dtype: every split bucket's keys side by side
            assert n is not None
            for j, x in _sum_blocks(in_chunks, names, n, fuse_all=True).items():
                sums[j] = x.reshape(block_shape(state.shapes[keys[owner[j]]], n))
    totals: dict[int, Any] = {}
    for j in sorted(sums):
        i = owner[j]
        totals[i] = sums[j] if i not in totals else totals[i] + sums[j]
    for i, parts in local.items():
        if i in totals:
            parts = [totals[i], *parts]
        totals[i] = functools.reduce(operator.add, parts)
    pushed = [totals[i] for i in range(len(keys))]
    counts = [len(xs) for xs in grouped.values()]
    each = axis_count(names) if reduce == "mean" else 1
    pushed = divide(pushed, divisors(state, keys, counts, reduce, each))
    pushed = _where_stored(state, keys, pushed, blocks)

    # Update: once over the group's bucket where the updater is elementwise (flat layout),
    # else each block as the updater would update the whole value.
    optax_push = isinstance(updater, optax.GradientTransformation)
    if optax_push and opt_state is not None and (not any(blocks) or all(chunked)):
        new_state = update_bucket(state, keys, pushed, updater)
        if new_state is not None:
            return new_state
    if any(chunked):
        assert n is not None
        return _on_chunks(state, keys, pushed, stored, opt_state, updater, names, n)
    new, opt_state = _updated(state, keys, pushed, stored, opt_state, updater, blocks, n, names)
    return state.replace(
        dict(zip(keys, new)), None if opt_state is None else {tuple(keys): opt_state}
    )


def _updated(
    state: KVState,
    keys: list[Key],
    pushed: list[Any],
    stored: list[Any],
    opt_state: Any,
    updater: Any,
    blocks: list[bool],
    n: int | None,
    names: tuple,
) -> tuple[list[Any], Any]:
    """The new values of ``keys`` (and for an optax updater their group's new optimizer state,
    else ``None``): the updater applied to the summed ``pushed`` values, each block
    (``blocks``) as the updater would update the whole value."""
    if isinstance(updater, optax.GradientTransformation):
        if opt_state is None and any(blocks):
            raise KVStoreError(
                f"keys {keys}: expected optimizer state for the keys (their values are sharded "
                "blocks here), given none; call state = jaxkv.init_optimizer(state, optimizer) "
                "before the step"
            )
        splits = [
            _split(_own_split(state, k, s), b, names) for k, s, b in zip(keys, stored, blocks)
        ]
        opt_splits = None
        if opt_state is not None:
            whole = _check_structure(state, updater, keys, stored, opt_state)  # (traced once)
            opt_blocks = _opt_blocks(keys, whole, opt_state, n)
            opt_splits = _opt_splits(state, keys, stored, whole, opt_blocks, names)
        return run_on_blocks(
            _group_step(updater, keys),
            (stored, opt_state, pushed),
            (splits, opt_splits, splits),
            (splits, opt_splits),
            names,
        )
    new = []
    for key, s, p, b in zip(keys, stored, pushed, blocks):
        split = _split(_own_split(state, key, s), b, names)
        new.append(run_on_blocks(_key_step(updater, key), (s, p), (split, split), split, names))
    return new, None


def _group_step(updater: Any, keys: list[Key]) -> Any:
    """An optax ``updater``'s step over the group ``keys``: ``(stored, opt_state, pushed) ->
    (new values, new opt_state)``."""

    def step(stored: list[Any], opt_state: Any, pushed: list[Any]) -> tuple[list[Any], Any]:
        return apply_updater(updater, keys, pushed, stored, opt_state)

    return step


def _key_step(updater: Any, key: Key) -> Any:
    """A per-key ``updater``'s step on ``key``: ``(stored, pushed) -> new value``."""

    def one(stored: Any, pushed: Any) -> Any:
        return apply_updater(updater, [key], [pushed], [stored], None)[0][0]

    return one


def _on_chunks(
    state: KVState,
    keys: list[Key],
    pushed: list[Any],
    stored: list[Any],
    opt_state: Any,
    updater: Any,
    names: tuple,
    n: int,
) -> KVState:
    """The update of keys of split buckets held here as this device's chunks, by an updater
    that does not run over the bucket (not elementwise, or not optax over one bucket), as the
    per-key layout runs it: a key whose block is its rows updates its block (``on_blocks.py``:
    as it is, with reductions over the rows completed across devices, or gathered); a key
    whose block is a padded piece of its flattened value (its rows do not divide by the
    devices) is all-gathered whole, updated, and each device keeps its block."""
    optax_push = isinstance(updater, optax.GradientTransformation)
    if optax_push and tuple(keys) not in state.groups:
        raise KVStoreError(
            f"keys {keys}: expected optimizer state for the keys (their values are blocks of "
            "split buckets here), given none; call state = jaxkv.init_optimizer(state, "
            "optimizer) before the step"
        )
    axes = axis_arg(names)
    me = jax.lax.axis_index(axes)
    shapes = {k: state.shapes[k] for k in keys}
    gathered = {
        k
        for k in keys
        if buckets.chunked(state, state.index(k))
        and block_shape(shapes[k], n) != _rows(shapes[k], n)
    }

    def whole(k: Key, x: Any) -> Any:
        return from_blocks(
            all_gather_invariant(x, axes, tiled=True), math.prod(shapes[k]), shapes[k]
        )

    def mine(k: Key, x: Any) -> Any:
        return jax.lax.dynamic_index_in_dim(as_blocks(x, n), me, keepdims=False)

    family: dict[int, Any] = {}  # optimizer-state leaf index -> its key, where a block
    if optax_push:
        packing = state.packings[state.groups.index(tuple(keys))]
        if packing is not None and packing.parts > 1:
            for first, _ in packing.families:
                family.update((first + j, k) for j, k in enumerate(packing.keys))
    # Keys whose value is whole here but whose moments are blocks of a split packing (a
    # group mixing keys of split buckets with others): their moments are gathered whole for
    # the update, and each device keeps its block of the new ones.
    moments = {k for k, s in zip(keys, stored) if family and not is_block(state, k, s)}
    if gathered and not moments:  # a padded piece is a block where the updater is elementwise
        as_is = [buckets.chunked(state, state.index(k)) for k in keys]
        if optax_push:
            _check_structure(state, updater, keys, stored, opt_state)
            leaves, treedef = jax.tree_util.tree_flatten(opt_state)
            flags = jax.tree_util.tree_unflatten(treedef, [j in family for j in range(len(leaves))])
            step = _group_step(updater, keys)
            args = (stored, opt_state, pushed)
            if is_blockwise(step, args, (as_is, flags, as_is), (as_is, flags)):
                new, new_opt = step(*args)
                return state.replace(dict(zip(keys, new)), {tuple(keys): new_opt})
        else:
            for k, s, p in zip(keys, stored, pushed):
                if k in gathered and is_blockwise(
                    _key_step(updater, k), (s, p), (True, True), True
                ):
                    gathered.discard(k)
    stored = [whole(k, s) if k in gathered else s for k, s in zip(keys, stored)]
    pushed = [whole(k, p) if k in gathered else p for k, p in zip(keys, pushed)]
    blocks = [k not in gathered and is_block(state, k, s) for k, s in zip(keys, stored)]
    if optax_push:
        leaves, treedef = jax.tree_util.tree_flatten(opt_state)
        leaves = [
            whole(family[j], x) if family.get(j) in gathered | moments else x
            for j, x in enumerate(leaves)
        ]
        opt_state = jax.tree_util.tree_unflatten(treedef, leaves)
    new, new_opt = _updated(state, keys, pushed, stored, opt_state, updater, blocks, n, names)
    new = [mine(k, x) if k in gathered else x for k, x in zip(keys, new)]
    if not optax_push:
        return state.replace(dict(zip(keys, new)))
    leaves, treedef = jax.tree_util.tree_flatten(new_opt)
    leaves = [
        mine(family[j], x) if family.get(j) in gathered | moments else x
        for j, x in enumerate(leaves)
    ]
    new_opt = jax.tree_util.tree_unflatten(treedef, leaves)
    return state.replace(dict(zip(keys, new)), {tuple(keys): new_opt})


def _rows(shape: tuple[int, ...], n: int) -> tuple[int, ...] | None:
    """The shape of ``shape``'s block of rows over ``n`` devices, or ``None``."""
    return (shape[0] // n, *shape[1:]) if shape and shape[0] % n == 0 else None
