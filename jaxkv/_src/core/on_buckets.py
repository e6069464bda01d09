"""Running an elementwise optax updater once over a flat bucket instead of once per key.

Under the flat layout (``state/buckets.py``) an optimizer group of one dtype lives in one bucket,
and its optax state's per-key leaves (Adam's ``mu`` and ``nu``) in one bucket per family, with the
same offsets. An updater whose every step on a key's arrays is elementwise (each output element
depends only on the same element of the key's inputs, and on scalars shared by all keys: a step
count, a learning rate, a bias correction) gives on the concatenation of the keys' arrays exactly
the concatenation of what it gives per key. Such an updater runs once on the tree
``{bucket: flat}``: one fused loop over the bucket instead of one per key. (On CPU, only where the
updater keeps per-key state: see ``update_bucket``.) sgd, momentum, adam,
adamw, rmsprop, lion and most custom chains of them qualify. So does one whose other steps are
sums, maxima or minima over the whole group (each key's whole array reduced, the results
combined over every key by the same operation: ``clip_by_global_norm``), which equal the same
reduction over the bucket. A reduction used per key (LAMB's trust ratio), a reshape or a step
that mixes keys otherwise does not, and runs per key on views (``updater.apply_updater``), with
the same numbers.

Whether an updater qualifies is read from the jaxpr of its ``update`` on the group's per-key
tree, once per trace of a push. The update runs under ``jax.named_scope`` ``jaxkv.updater``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend import core as jex

from jaxkv._src.core.on_blocks import ELEMENTWISE, UPDATER, keeps_shape, sub_jaxpr
from jaxkv._src.state import buckets
from jaxkv._src.state.buckets import as_blocks, padding
from jaxkv._src.state.kvstate import Key, KVState

__all__ = ["elementwise", "uniform", "update_bucket"]

_BUCKET = "bucket"  # the one key of the tree an optimizer sees over a bucket


def update_bucket(
    state: KVState,
    keys: Sequence[Key],
    pushed: Sequence[Any] | None,
    updater: Any,
    grads: dict[int, Any] | None = None,
) -> KVState | None:
    """``state`` with the optax ``updater`` applied once over the bucket of the group ``keys``
    (their summed gradients ``pushed``, in key order, or ``grads[bucket]`` where given: the sum
    already laid out as the bucket), or ``None`` where it cannot be: the state is not flat, the
    group does not fill one bucket by itself, its optax state is not packed leaf for leaf as
    ``updater.init`` of one flat array would make it, or the updater is not elementwise (see
    the module doc).

    A split bucket is updated where it lies: whole (inside ``jit``, sharded over the mesh) or,
    inside ``shard_map``, this device's chunk, from the keys' blocks of the sum."""
    flat = state.flat_layout
    keys = tuple(keys)
    if flat is None or not isinstance(updater, optax.GradientTransformation):
        return None
    if keys not in state.groups:
        return None
    n = state.groups.index(keys)
    packing = state.packings[n]
    index = state.key_positions
    positions = [index[k] for k in keys]
    bucket_ids = {flat.where[i][0] for i in positions}
    if packing is None or len(bucket_ids) != 1:
        return None
    (b,) = bucket_ids
    chunked = buckets.chunked(state, positions[0])
    if not packing.families and state.devices[0].platform == "cpu" and flat.parts_of(b) == 1:
        # No per-key state (sgd): on CPU, writing each key's new value into the bucket in
        # place measured faster than gathering the gradients into one buffer first (ResNet-50's
        # 193 tensors cut small, in-jit step: 0.09 against 0.19 ms); with per-key state (adam:
        # three writes per key) the bucket wins (0.25 against 0.27 ms). docs/design.md.
        return None
    name, _ = flat.buckets[b]
    if b < 0 or sum(1 for w in flat.where if w[0] == b) != len(keys):
        return None  # the bucket holds other keys too (it cannot: one per group and dtype)
    leaf = state.leaves[b]
    packed = state.group_states[n]
    template = _template(updater, int(np.shape(leaf)[0]), name)
    if template is None or len(template[1]) != len(packed):
        return None
    treedef, leaves = template
    if any(
        tuple(np.shape(t)) != tuple(np.shape(x)) or np.dtype(t.dtype) != np.dtype(x.dtype)
        for t, x in zip(leaves, packed)
    ):
        return None
    shapes = tuple(flat.shapes[i] for i in positions)
    if chunked:  # its leaves are blocks: the check reads the updater on the whole values
        whole = {k: jax.ShapeDtypeStruct(s, name) for k, s in zip(keys, shapes)}
        opt_state = jax.eval_shape(updater.init, whole)
    else:
        opt_state = state.group_state(n)
    # A sum, maximum or minimum over the group runs as one over the bucket where the bucket
    # is the group's values and nothing else: not a chunk (a reduction there would need
    # completing across devices), not padded (padding would enter a maximum or a minimum, and
    # a sum over values that updates left in the padding).
    parts = flat.parts_of(b)
    padded = parts > 1 and any(padding(tuple(s), parts) for s in shapes)
    if not elementwise(updater, keys, shapes, name, opt_state, not (chunked or padded)):
        return None
    bucket_state = jax.tree_util.tree_unflatten(treedef, leaves)
    if not uniform(updater, keys, shapes, name, opt_state, int(np.shape(leaf)[0]), bucket_state):
        return None  # a step that differs by key (a mask by path or by ndim): per key
    dtype = np.dtype(name)
    summed = (grads or {}).get(b)
    if summed is None and parts > 1 and not chunked:  # whole values into their blocks
        assert pushed is not None
        grid = [as_blocks(jnp.asarray(g).astype(dtype), parts) for g in pushed]
        summed = jnp.concatenate(grid, axis=1).reshape(-1)
    elif summed is None:  # one after the other (in a chunk: each key's block of the sum)
        assert pushed is not None
        summed = jnp.concatenate([jnp.ravel(g).astype(dtype) for g in pushed])
    with jax.named_scope(UPDATER):
        params = {_BUCKET: leaf}
        opt_state = jax.tree_util.tree_unflatten(treedef, list(packed))
        try:
            updates, opt_state = updater.update({_BUCKET: summed}, opt_state, params)
            new = optax.apply_updates(params, updates)[_BUCKET].astype(dtype)
        except Exception:  # an update that reads the tree's keys: per key, where an error of
            return None  # its own is raised again, as a KVStoreError (``updater.py``)
    return buckets.with_leaves(state, {b: new}, {n: tuple(jax.tree_util.tree_leaves(opt_state))})


def _template(updater: Any, size: int, name: str) -> tuple[Any, list] | None:
    """The tree structure and leaves (shapes and dtypes) of ``updater.init`` of one flat array
    of ``size`` elements of dtype ``name``."""
    try:
        shape = jax.eval_shape(updater.init, {_BUCKET: jax.ShapeDtypeStruct((size,), name)})
    except Exception:  # an init that needs more than one array: not for buckets
        return None
    leaves, treedef = jax.tree_util.tree_flatten(shape)
    return treedef, leaves


def structure(tree: Any) -> tuple:
    """``tree``'s treedef and each leaf's shape and dtype: a hashable key for what depends on
    a tree's structure alone (:func:`abstract` gives the tree back, of ``ShapeDtypeStruct``)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple((tuple(np.shape(x)), np.dtype(x.dtype)) for x in leaves)


def abstract(sig: tuple) -> Any:
    """The tree of ``ShapeDtypeStruct`` whose :func:`structure` is ``sig``."""
    return jax.tree_util.tree_unflatten(sig[0], [jax.ShapeDtypeStruct(s, d) for s, d in sig[1]])


def _cached(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` through its ``functools.lru_cache``, or uncached where an argument cannot
    be hashed (an updater that cannot be: checked on each trace)."""
    try:
        return fn(*args)
    except TypeError:
        return fn.__wrapped__(*args)


def _input_owners(keys: tuple, opt_state: Any) -> list[int | None]:
    """Which key each input of ``update(tree, opt_state, tree)`` belongs to, by position in
    ``keys`` (``None``: shared by all keys): the gradients, the state's leaves (a leaf under a
    ``{key: leaf}`` mapping is that key's), the params."""
    owners: list[int | None] = list(range(len(keys)))
    for path, _ in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        last = path[-1] if path else None
        key = getattr(last, "key", None) if isinstance(last, jax.tree_util.DictKey) else None
        owners.append(keys.index(key) if key in keys else None)
    return owners + list(range(len(keys)))


@functools.lru_cache(maxsize=256)
def _traced_update(updater: Any, keys: tuple, shapes: tuple, name: str, opt_sig: Any) -> Any:
    """``updater.update``'s closed jaxpr on the tree ``{key: array}`` (``shapes``, dtype
    ``name``) and a state of ``opt_sig``, with which key each of its inputs belongs to; ``None``
    where it cannot be traced or its inputs do not line up with the tree's. Keyed on the
    updater object: jaxkv caches pushes per updater object the same way."""
    opt_state = abstract(opt_sig)
    tree = {k: jax.ShapeDtypeStruct(s, name) for k, s in zip(keys, shapes)}
    try:
        closed = jax.make_jaxpr(updater.update)(tree, opt_state, tree)
    except Exception:
        return None
    owners = _input_owners(keys, opt_state)
    return None if len(owners) != len(closed.jaxpr.invars) else (closed, owners)


@functools.lru_cache(maxsize=256)
def _elementwise_cached(
    updater: Any, keys: tuple, shapes: tuple, name: str, opt_sig: Any, reduce: bool
) -> bool:
    traced = _cached(_traced_update, updater, keys, shapes, name, opt_sig)
    if traced is None:
        return False
    closed, owners = traced
    outs = _owners(closed.jaxpr, owners, len(keys) if reduce else 0)
    # A reduction over some keys only may not leave the update (in its state, say).
    return outs is not None and not any(isinstance(o, _Partial) for o in outs)


def elementwise(
    updater: Any, keys: tuple, shapes: tuple, name: str, opt_state: Any, reduce: bool = False
) -> bool:
    """Whether every step ``updater.update`` takes on a key's arrays is elementwise, with no
    other key's arrays and only scalars beside them, or (with ``reduce``) a sum, maximum or
    minimum over the whole group (see the module doc)."""
    return _cached(_elementwise_cached, updater, keys, shapes, name, structure(opt_state), reduce)


# What a value is, seen from the bucket: the array of one key (its position in the group), or
# shared by all keys: _UNIFORM (every element the same: a scalar, a broadcast scalar) or _OTHER.
_UNIFORM, _OTHER = "uniform", "other"


# Primitives that call a jaxpr once on their own inputs (not a loop: scan's body sees rows).
_CALLS = frozenset(
    [
        "pjit",
        "jit",
        "closed_call",
        "core_call",
        "custom_jvp_call",
        "custom_vjp_call",
        "custom_vjp_call_jaxpr",
        "remat",
        "checkpoint",
    ]
)


def _shared(v: Any) -> str:
    return _UNIFORM if tuple(getattr(v.aval, "shape", ())) == () else _OTHER


@dataclasses.dataclass(frozen=True)
class _Partial:
    """A reduction (``op``: ``add``, ``max`` or ``min``) over the whole arrays of some of the
    group's keys (``keys``): over all of them it is what the same reduction over the bucket
    gives, so it is then shared by all keys (``_UNIFORM``); over some, it may only meet the
    others' by the same ``op``."""

    op: str
    keys: frozenset


# A reduction over all of an array's axes, and how two of its partial results combine.
_MONOIDS = {"reduce_sum": "add", "reduce_max": "max", "reduce_min": "min"}


def _combine(name: str, eqn: Any, ins: list, count: int) -> Any:
    """What an equation over partial reductions gives (see ``_Partial``), or ``None``."""
    parts = [o for o in ins if isinstance(o, _Partial)]
    if name == "copy" and len(ins) == 1:
        return parts[0]
    if name not in ("add", "max", "min") or len(ins) != 2:
        return None
    if len(parts) == 1:  # the other, a literal 0 added (Python's sum starts from 0)
        other = eqn.invars[1 - ins.index(parts[0])]
        ok = name == "add" == parts[0].op and isinstance(other, jex.Literal) and other.val == 0
        return parts[0] if ok else None
    a, b = parts
    if not (a.op == b.op == name) or a.keys & b.keys:
        return None
    keys = a.keys | b.keys
    return _UNIFORM if len(keys) == count else _Partial(name, keys)


def _owners(jaxpr: Any, owners: Sequence[Any], count: int = 0) -> list[Any] | None:
    """What each output of ``jaxpr`` is (a key's position, ``_UNIFORM`` or ``_OTHER``) given
    its inputs' (``None`` for an input shared by all keys), or ``None`` if some equation is not
    elementwise on a key's arrays, or mixes two keys' arrays. With ``count`` (the group's
    number of keys), a sum, maximum or minimum over each key's whole array, combined over all
    ``count`` keys by the same operation, is shared by all keys too (see ``_Partial``)."""
    env: dict[Any, Any] = {v: _shared(v) for v in jaxpr.constvars}
    env.update((v, _shared(v) if o is None else o) for v, o in zip(jaxpr.invars, owners))
    # (An input given as None is shared: uniform if it is a scalar.)

    def read(v: Any) -> Any:
        return _UNIFORM if isinstance(v, jex.Literal) else env[v]

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        keyed = {o for o in ins if isinstance(o, int)}
        name = eqn.primitive.name
        partial = any(isinstance(o, _Partial) for o in ins)
        if partial and name not in _CALLS:
            out = None if keyed else _combine(name, eqn, ins, count)
            if out is None:
                return None
            env.update((v, out) for v in eqn.outvars)
            continue
        if count and name in _MONOIDS and len(keyed) == 1 and len(ins) == 1:
            (owner,) = keyed
            if tuple(eqn.params.get("axes", ())) != tuple(range(len(eqn.invars[0].aval.shape))):
                return None  # over some axes only: not a reduction over the key's array
            out = _Partial(_MONOIDS[name], frozenset([owner]))
            env.update((v, _UNIFORM if count == 1 else out) for v in eqn.outvars)
            continue
        if not keyed and not partial:
            if name == "broadcast_in_dim" or name in ELEMENTWISE:
                kind = _UNIFORM if all(o == _UNIFORM for o in ins) else _OTHER
            else:
                kind = None
            env.update((v, kind or _shared(v)) for v in eqn.outvars)
            continue
        sub = sub_jaxpr(eqn) if name in _CALLS else None
        if sub is not None:  # a jitted or custom-derivative function: what it does inside
            out = _owners(sub[0], ins, count)
            if out is None:
                return None
            env.update(zip(eqn.outvars, out))
            continue
        if len(keyed) > 1:
            return None  # mixes two keys' arrays
        if name in ELEMENTWISE:
            if any(o == _OTHER for o in ins) or not keeps_shape(eqn):
                return None  # an array that is not one value for every element
            (owner,) = keyed
            env.update((v, owner) for v in eqn.outvars)
            continue
        return None
    return [read(v) for v in jaxpr.outvars]


# -- the same steps on every key, and on the bucket ------------------------------------------------
# Elementwise steps are not enough: a mask by path or by ``ndim`` (``optax.masked``, adamw's
# ``mask``) takes other steps on some keys, and on the bucket's one key the steps it takes for
# that key. The updater runs over the bucket only where it takes the very same steps on every
# key and on the bucket: each output of a key is numbered by what computes it (its primitives and
# their parameters other than shapes, from the key's own inputs by position, shared inputs by
# position, literals and small constants by value), and the numbers must agree.

# Parameters that hold a shape (which differs between the keys and the bucket).
_SHAPED = frozenset(
    ["shape", "broadcast_dimensions", "axes", "new_sizes", "dimensions", "sharding"]
)


class _Numbers:
    """Numbers for computations: the same number for the same computation."""

    def __init__(self) -> None:
        self.known: dict[Any, int] = {}

    def of(self, what: Any) -> int:
        return self.known.setdefault(what, len(self.known))


def _constant(numbers: _Numbers, c: Any) -> int:
    try:
        a = np.asarray(c)
    except Exception:
        return numbers.of(("const", id(c)))
    if a.size <= 64:
        return numbers.of(("const", a.dtype.str, a.shape, a.tobytes()))
    return numbers.of(("const", id(c)))


def _params(params: dict) -> Any:
    return tuple(sorted((k, repr(v)) for k, v in params.items() if k not in _SHAPED))


# A value: (owner, number). The owner is a key's position, None (shared by all keys), or a
# _Partial (a reduction over some keys' whole arrays), whose number is then a frozenset of the
# numbers of the reduced arrays.
def _numbered(jaxpr: Any, consts: Any, ins: list, count: int, numbers: _Numbers) -> list | None:
    """What each output of ``jaxpr`` is, as ``(owner, number)``, given its inputs'; ``None``
    where a step is not one :func:`elementwise` lets through."""
    env: dict[Any, Any] = {
        v: (None, _constant(numbers, c)) for v, c in zip(jaxpr.constvars, consts)
    }
    env.update(zip(jaxpr.invars, ins))

    def read(v: Any) -> Any:
        if isinstance(v, jex.Literal):
            return None, numbers.of(("lit", repr(v.val), str(getattr(v.aval, "dtype", ""))))
        return env[v]

    for eqn in jaxpr.eqns:
        values = [read(v) for v in eqn.invars]
        owners = [o for o, _ in values]
        name = eqn.primitive.name
        sub = sub_jaxpr(eqn) if name in _CALLS else None
        if sub is not None:
            outs = _numbered(sub[0], sub[1], values, count, numbers)
            if outs is None:
                return None
            env.update(zip(eqn.outvars, outs))
            continue
        parts = [(o, n) for o, n in values if isinstance(o, _Partial)]
        keyed = {o for o in owners if isinstance(o, int)}
        zero = [isinstance(v, jex.Literal) and np.all(np.asarray(v.val) == 0) for v in eqn.invars]
        if name == "add" and len(values) == 2 and any(zero):
            # A literal 0 added (Python's sum starts from 0): the other value, whichever
            # side it is on, so that a sum over the keys and one over the bucket agree.
            env[eqn.outvars[0]] = values[zero.index(False)] if not all(zero) else values[0]
            continue
        if name == "broadcast_in_dim" and len(values) == 1 and not keyed and not parts:
            # A shared value broadcast to a key's shape is that value (shapes are not numbered):
            # a scalar key takes the value as it is where the others broadcast it.
            env[eqn.outvars[0]] = values[0]
            continue
        if name in _MONOIDS and len(keyed) == 1 and len(values) == 1:
            out: Any = (_Partial(_MONOIDS[name], frozenset(keyed)), frozenset([values[0][1]]))
        elif parts:
            if name == "copy" and len(values) == 1:
                out = values[0]
            elif len(parts) == 2 and name in ("add", "max", "min"):
                (a, na), (b, nb) = parts
                out = (_Partial(name, a.keys | b.keys), na | nb)
            else:
                return None
        else:
            number = numbers.of((name, _params(eqn.params), tuple(n for _, n in values)))
            out = (next(iter(keyed)) if keyed else None, number)
        if isinstance(out[0], _Partial) and len(out[0].keys) == count:
            out = (None, numbers.of(("group", out[0].op, out[1])))  # over every key: shared
        env.update((v, out) for v in eqn.outvars)
    return [read(v) for v in jaxpr.outvars]


def _outputs(
    updater: Any, keys: tuple, shapes: tuple, name: str, opt_sig: Any, n: _Numbers
) -> tuple[list[list[int]], list[int]] | None:
    """Each key's outputs' numbers, in order, and the shared outputs' numbers, of
    ``updater.update`` on the tree ``{key: array}`` and a state of ``opt_sig`` (``None`` where
    it cannot be told)."""
    traced = _cached(_traced_update, updater, keys, shapes, name, opt_sig)
    if traced is None:
        return None
    closed, owners = traced
    slots: collections.Counter[Any] = collections.Counter()
    ins = []
    for owner in owners:  # a key's inputs by their position among its own, shared ones alike
        ins.append((owner, n.of(("in", owner is None, slots[owner]))))
        slots[owner] += 1
    outs = _numbered(closed.jaxpr, closed.consts, ins, len(keys), n)
    if outs is None or any(isinstance(o, _Partial) for o, _ in outs):
        return None
    per_key = [[x for o, x in outs if o == i] for i in range(len(keys))]
    return per_key, [x for o, x in outs if o is None]


@functools.lru_cache(maxsize=256)
def _uniform_cached(
    updater: Any, keys: tuple, shapes: tuple, name: str, opt_sig: Any, size: int, bucket_sig: Any
) -> bool:
    n = _Numbers()
    each = _outputs(updater, keys, shapes, name, opt_sig, n)
    whole = _outputs(updater, (_BUCKET,), ((size,),), name, bucket_sig, n)
    if each is None or whole is None:
        return False
    (one,), shared = whole
    return shared == each[1] and all(outs == one for outs in each[0])


def uniform(
    updater: Any,
    keys: tuple,
    shapes: tuple,
    name: str,
    opt_state: Any,
    size: int,
    bucket_state: Any,
) -> bool:
    """Whether ``updater.update`` takes the same steps on every key of the group (its state
    ``opt_state``) and on the bucket of ``size`` elements that holds them (its state
    ``bucket_state``, as ``updater.init`` of the bucket makes it: see above), so that running
    it once over the bucket gives each key what it gives per key."""
    sigs = (structure(opt_state), size, structure(bucket_state))
    return _cached(_uniform_cached, updater, keys, shapes, name, *sigs)
