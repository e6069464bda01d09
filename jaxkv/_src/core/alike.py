"""Per-key updates of keys alike (one shape, dtype and state, end to end in a bucket) run as one
update mapped over the keys (``jax.vmap``), written back into their bucket as one.

An updater run on each key alone (MXNet's optimizers through the imperative store: each key its
own state and its own row of numbers) makes a computation whose size grows with the keys: XLA
compiles each key's update apart (1000 keys of 16 x 16 with MXNet's SGD: a minute to compile,
thousands of small kernels to run a step). Where the per-key rule cannot depend on the key's
name (a transformation marked ``updater.positional``) and is elementwise (no reduction, which a
batch could sum in another order), the keys of a bucket that lie end to end with one shape,
dtype and state are updated as one batch: their values read as one slice of the bucket, the
per-key rule mapped over them with each key's state and row of numbers, the new values written
as one update of the bucket. The numbers are each key's alone: elementwise, a batch computes
what each key computes. The new values must reach the bucket whole: where each key's new value
is written apart, XLA moves each key's slice back through the update (measured: the computation
then compiles as long as the per-key one).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv._src.core.updater import apply_updater, is_positional
from jaxkv._src.state import buckets
from jaxkv._src.state.kvstate import Key, KVState

__all__ = ["PerKey", "per_key_of", "register", "update"]


@dataclasses.dataclass(frozen=True)
class PerKey:
    """How a transformation runs ``inner`` on each key alone: ``states(state)`` is each key's
    own state (by key) in the group's ``state``, ``joined(states)`` the group's state again."""

    inner: Any
    states: Callable[[Any], dict[Key, Any] | None]
    joined: Callable[[dict[Key, Any]], Any]


# id(transformation) -> (transformation, PerKey): the per-key transformations made (the newest).
_REGISTERED: dict[int, tuple[Any, PerKey]] = {}
_MOST = 512


def register(transformation: Any, per_key: PerKey) -> Any:
    """Note that ``transformation`` runs ``per_key.inner`` on each key alone; returns it."""
    _REGISTERED[id(transformation)] = (transformation, per_key)
    while len(_REGISTERED) > _MOST:
        _REGISTERED.pop(next(iter(_REGISTERED)))
    return transformation


def per_key_of(updater: Any) -> PerKey | None:
    """How ``updater`` runs each key alone (:func:`register`), or ``None``."""
    found = _REGISTERED.get(id(updater))
    return found[1] if found is not None and found[0] is updater else None


def update(
    state: KVState,
    keys: tuple[Key, ...],
    pushed: Sequence[Any],
    updater: Any,
    extra_args: dict[str, Any] | None,
) -> KVState | None:
    """``state`` with the group ``keys`` updated by the per-key ``updater`` (inside the push's
    trace: ``pushed`` are the summed values, in key order), the keys alike in batches (see the
    module doc), or ``None`` where no batch of two keys or more can be made (the per-key push
    then runs as it is)."""
    per_key = per_key_of(updater)
    flat = state.flat_layout
    if per_key is None or flat is None or not is_positional(per_key.inner):
        return None
    group = state.opt_states[keys] if keys in state.groups else None
    own = None if group is None else per_key.states(group)
    if own is None or set(own) != set(keys):
        return None
    index = state.key_positions
    runs = _runs(state, keys, [index[k] for k in keys], own, pushed)
    if not runs:
        return None
    n = state.groups.index(keys)
    packed = _Packed.of(state, n, keys)
    stored = state.stored_values
    extra = extra_args or {}
    leaves: dict[int, Any] = {}
    new_of: dict[int, tuple[list[int], list[Any]]] = {}  # run's first -> (run, new leaves)
    states: dict[Key, Any] = {}
    for run in runs:
        first = run[0]
        b, start, size = flat.where[index[keys[first]]]
        treedef = jax.tree_util.tree_structure(own[keys[first]])
        first_leaves = jax.tree_util.tree_leaves(own[keys[first]])
        first_row = {name: x[first] for name, x in extra.items()}
        avals = _avals(pushed[first], stored[index[keys[first]]], first_leaves, first_row)
        if not _batches(per_key.inner, treedef, avals):
            continue
        fn = _rule(per_key.inner, treedef)
        bucket = leaves.get(b, state.leaves[b])
        shape = tuple(np.shape(pushed[first]))
        values = jax.lax.slice_in_dim(bucket, start, start + size * len(run)).reshape(
            (len(run), *shape)
        )
        own_leaves = [jax.tree_util.tree_leaves(own[keys[j]]) for j in run]
        stacked = [
            jnp.stack(xs) if packed is None else packed.read(p, run, xs)
            for p, xs in enumerate(zip(*own_leaves))
        ]
        rows = {name: x[run[0] : run[-1] + 1] for name, x in extra.items()}  # (run: in a row)
        # (raveled, then joined: the sums are often slices of one array, which XLA then reads
        # whole; stacked, each would be copied out and in again)
        grads = jnp.concatenate([jnp.ravel(pushed[j]) for j in run]).reshape((len(run), *shape))
        new, new_leaves = jax.vmap(fn)(grads, values, stacked, rows)
        flat_new = new.reshape(-1).astype(bucket.dtype)
        leaves[b] = jax.lax.dynamic_update_slice_in_dim(bucket, flat_new, start, axis=0)
        new_of[first] = (run, new_leaves)
        for j, k in enumerate(keys[i] for i in run):
            treedef = jax.tree_util.tree_structure(own[k])
            states[k] = jax.tree_util.tree_unflatten(treedef, [x[j] for x in new_leaves])
    if not new_of:
        return None
    done = {j for run, _ in new_of.values() for j in run}
    values_rest: dict[Key, Any] = {}
    for j, k in enumerate(keys):
        if j in done:
            continue
        row = {name: x[j] for name, x in extra.items()}
        new_values, states[k] = apply_updater(
            per_key.inner, (k,), [pushed[j]], [stored[index[k]]], own[k], row
        )
        values_rest[k] = new_values[0]
    if packed is not None:  # the group's packed leaves, each batch's written as one
        lone = {
            j: jax.tree_util.tree_leaves(states[k]) for j, k in enumerate(keys) if j not in done
        }
        state = buckets.with_leaves(state, leaves, {n: packed.written(new_of, lone)})
        return state.replace(values_rest) if values_rest else state
    state = buckets.with_leaves(state, leaves, {})
    return state.replace(values_rest, {keys: per_key.joined(states)})


@dataclasses.dataclass(frozen=True)
class _Packed:
    """A per-key group's state packed ``stride`` apart (``buckets.Packing``): its families and
    per-key scalars read for a batch of keys as one slice, and written back whole."""

    packing: buckets.Packing
    leaves: tuple[Any, ...]  # the packed leaves (inside the push's trace)
    at: dict[int, tuple[int, str]]  # a key's leaf position -> (its packed leaf, kind)

    @classmethod
    def of(cls, state: KVState, n: int, keys: tuple[Key, ...]) -> _Packed | None:
        packing = state.packings[n]
        if packing is None or not packing.stride or packing.parts > 1 or packing.keys != keys:
            return None
        at = {i: (j, kind) for j, (kind, i) in enumerate(packing.slots()) if kind != "leaf"}
        return cls(packing, tuple(state.group_states[n]), at)

    def read(self, p: int, run: list[int], own: Sequence[Any]) -> Any:
        """The ``p``-th leaf of the keys of ``run`` (positions in the group), stacked: one
        slice of its packed leaf where it has one, else ``own`` (each key's) stacked."""
        found = self.at.get(p)
        if found is None:
            return jnp.stack(own)
        j, kind = found
        if kind == "scalars":
            return jax.lax.slice_in_dim(self.leaves[j], run[0], run[-1] + 1)
        offsets, _ = self.packing.offsets()
        shape = self.packing.shapes[run[0]]
        start = offsets[run[0]]
        flat = jax.lax.slice_in_dim(self.leaves[j], start, start + math.prod(shape) * len(run))
        return flat.reshape((len(run), *shape))

    def written(
        self, new_of: dict[int, tuple[list[int], list[Any]]], lone: dict[int, list[Any]]
    ) -> tuple[Any, ...]:
        """The group's new packed leaves: each family and run of scalars joined in key order
        from each batch's new leaves (``new_of``: a run's first position -> the run, its
        stacked new leaves) and each other key's (``lone``: position -> its new leaves)."""
        packing = self.packing
        stride, count = packing.stride, len(packing.keys)
        out: list[Any] = []
        for (kind, i), old in zip(packing.slots(), self.leaves):
            if kind == "leaf":
                j, p = divmod(i, stride)
                out.append(lone[j][p] if j in lone else _row_of(new_of, j)[p])
                continue
            parts, j = [], 0  # (a family's first leaf is its place in each key's state)
            while j < count:
                if j in new_of:
                    run, new = new_of[j]
                    parts.append(jnp.ravel(new[i]))
                    j = run[-1] + 1
                else:
                    parts.append(jnp.ravel(lone[j][i]))
                    j += 1
            out.append(jnp.concatenate([x.astype(old.dtype) for x in parts]))
        return tuple(out)


def _row_of(new_of: dict[int, tuple[list[int], list[Any]]], j: int) -> list[Any]:
    """Key position ``j``'s new leaves, from the batch it was in."""
    for run, new in new_of.values():
        if run[0] <= j <= run[-1]:
            return [x[j - run[0]] for x in new]
    raise AssertionError(j)


def _runs(
    state: KVState,
    keys: tuple[Key, ...],
    positions: list[int],
    own: dict[Key, Any],
    pushed: Sequence[Any],
) -> list[list[int]]:
    """The runs (positions in ``keys``) of two keys or more lying end to end in one bucket that
    is not split, of one shape and dtype and state leaves of one shape and dtype each."""
    flat = state.flat_layout
    assert flat is not None
    out: list[list[int]] = []
    run: list[int] = []
    last: tuple | None = None
    for j, (k, i) in enumerate(zip(keys, positions)):
        b, start, size = flat.where[i]
        alike = None
        if b >= 0 and flat.parts_of(b) == 1:
            leaves = jax.tree_util.tree_leaves(own[k])
            alike = (
                b,
                tuple(np.shape(pushed[j])),
                jnp.result_type(pushed[j]).name,
                flat.dtypes[i],
                tuple((tuple(np.shape(x)), jnp.result_type(x).name) for x in leaves),
            )
        if alike is not None and last is not None and alike == last[0] and start == last[1]:
            run.append(j)
        else:
            if len(run) > 1:
                out.append(run)
            run = [j] if alike is not None else []
        last = None if alike is None else (alike, start + size)
    if len(run) > 1:
        out.append(run)
    return out


@functools.lru_cache(maxsize=256)
def _rule(inner: Any, treedef: Any) -> Callable:
    """``(grad, value, state leaves, row) -> (new value, new state leaves)``: ``inner`` on one
    key alone (named 0: a positional transformation computes the same for any name)."""

    def one(grad: Any, value: Any, leaves: list, row: dict) -> tuple[Any, list]:
        own = jax.tree_util.tree_unflatten(treedef, leaves)
        new, state = apply_updater(inner, (0,), [grad], [value], own, row)
        return new[0], jax.tree_util.tree_leaves(state)

    return one


@functools.lru_cache(maxsize=256)
def _batches(inner: Any, treedef: Any, avals: tuple) -> bool:
    """Whether :func:`_rule` on arguments of ``avals`` (a tree of ``(shape, dtype)``, as
    :func:`_avals` makes it) is elementwise: traced once (not compiled)."""

    def struct(a: tuple) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(a[0], a[1])

    grad, value, leaves, row = avals
    args = (
        struct(grad),
        struct(value),
        [struct(x) for x in leaves],
        {name: struct(x) for name, x in row},
    )
    try:
        jaxpr = jax.make_jaxpr(_rule(inner, treedef))(*args)
    except Exception:  # (the per-key push then runs, and raises as it does)
        return False
    return _elementwise(jaxpr.jaxpr)


def _avals(grad: Any, value: Any, leaves: list, row: dict) -> tuple:
    def aval(x: Any) -> tuple:
        return (tuple(np.shape(x)), jnp.result_type(x).name)

    return (
        aval(grad),
        aval(value),
        tuple(aval(x) for x in leaves),
        tuple(sorted((name, aval(x)) for name, x in row.items())),
    )


# Primitives whose result at an element reads other elements (or loops): a batch of keys could
# compute them in another order, or across keys.
_NOT_ELEMENTWISE = (
    "reduce_",
    "argmax",
    "argmin",
    "dot_general",
    "cum",
    "scan",
    "while",
    "sort",
    "conv_general",
    "reduce_window",
    "select_and_",
    "gather",
    "scatter",
    "cond",
    "fft",
    "top_k",
    "all_",
    "psum",
    "pmax",
    "pmin",
    "ppermute",
    "axis_index",
)


def _elementwise(jaxpr: Any) -> bool:
    """Whether no equation of ``jaxpr``, nor of a jaxpr it calls, is of :data:`_NOT_ELEMENTWISE`."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name != "reduce_precision" and name.startswith(_NOT_ELEMENTWISE):
            return False
        for param in eqn.params.values():
            for one in param if isinstance(param, tuple | list) else (param,):
                inner = getattr(one, "jaxpr", one)  # (a closed jaxpr's own, or a jaxpr)
                if hasattr(inner, "eqns") and not _elementwise(inner):
                    return False
    return True
