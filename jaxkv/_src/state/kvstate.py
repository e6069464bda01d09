"""``KVState``: the immutable pytree at the heart of jaxkv.

The key set, the key kind and the store's devices are static (aux data), so ``jit`` specialises
on them; stored values and optimizer states are the leaves, so ``tree_map`` only touches arrays.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import numbers
import os
from collections.abc import Hashable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxkv._src import jax_internals
from jaxkv._src.errors import KeyTypeError, KVStoreError, shown, unknown_key
from jaxkv._src.processes import host
from jaxkv._src.state import buckets
from jaxkv._src.state.buckets import FlatLayout, Packing
from jaxkv._src.state.policy import (
    AUTO_CPU_BELOW,
    BIGARRAY_BOUND,
    BOUND_ENV,
    Placement,
    default_bound,
    is_sharded,
)
from jaxkv._src.state.tree_shapes import TreeShape

__all__ = ["AXIS", "LAYOUTS", "LAYOUT_ENV", "Facts", "KVState", "empty"]

logger = logging.getLogger("jaxkv")

Key = int | str
AXIS = "kv"  # The name of the store's one mesh axis.
_KEEP = object()
# The layouts a store can be asked for, and the environment variable that sets the default.
LAYOUTS = ("auto", "flat", "keys")
LAYOUT_ENV = "JAXKV_LAYOUT"
# A flat state of this many keys or more makes the views of a few keys read alone (values_at).
FEW_VIEWS_FROM = 64
# A store's layout policy: (the layout asked for, bucket the values with fewer elements than
# this, or None: one array per key, split buckets). "flat" buckets every value, and splits a
# bucket of at least the big-array bound over the devices (buckets.py); "auto" does the same on
# accelerators, and on CPU buckets the values below AUTO_CPU_BELOW elements (policy.py) that it
# does not shard, splitting no bucket (docs/design.md).
Policy = tuple[str, int | None, bool]
KEYS_POLICY: Policy = ("keys", None, False)
ALL = 1 << 62
# A state's aux data: keys, devices, big-array bound, compression, shapes, optimizer groups,
# the user's mesh (None: the store's own), the layout policy, the flat layout (None: one array
# per key), each optimizer group's packing (None: its optax state kept as it is), the paths of
# each tree given to init (core/trees.py), the reduction ('sum' or 'mean') and, on a user's mesh
# of several axes, the axes values are summed along (else ()), and there each key's own sharding
# along the other axes (tensor parallelism: (key, spec) pairs, sorted; other keys have none).
_Aux = tuple[
    tuple[Key, ...],
    tuple[jax.Device, ...],
    int | None,
    tuple | None,
    tuple[tuple[int, ...], ...],
    tuple[tuple[Key, ...], ...],
    Mesh | None,
    Policy,
    "FlatLayout | None",
    tuple["Packing | None", ...],
    tuple[tuple[str, ...], ...],
    str,
    tuple[str, ...],
    tuple[tuple[Key, PartitionSpec], ...],
]


@functools.lru_cache(maxsize=64)
def _placement(shards: int, bound: int | None) -> Placement:
    """The placement policy of a store over ``shards`` devices with ``bound``, made once."""
    return Placement(shards, bound)


# What _bucketed says of a value: an array of its own, a bucket shared under the policy, or a
# split bucket of its own (a big value whose rows the devices do not divide).
OWN, SHARED, PADDED = 0, 1, 2


@functools.lru_cache(maxsize=256)
def _bucketed(
    policy: Policy,
    compression: tuple | None,
    bound: int | None,
    devices: tuple[jax.Device, ...],
    shapes: tuple[tuple[int, ...], ...],
    pad: bool = True,
) -> tuple[int, ...]:
    """Where ``policy`` puts a value of each shape: ``OWN``, ``SHARED`` or ``PADDED``
    (``KVState._bucketed``); true for the values in buckets. ``pad``: whether a big value
    whose rows the devices do not divide gets a split bucket (not on a user's mesh of several
    axes, where the store's devices are not one axis)."""
    _, below, split = policy
    n = len(devices) if pad else 1
    place = _placement(n, bound)
    if compression is not None:  # each key keeps its own error-feedback residual
        whole = [shape for shape in shapes if place.pads(shape)]
        if whole:  # (cached: said once per key set)
            logger.warning(
                "values of shapes %s are kept whole on each of the %d devices: a store with "
                "gradient compression keeps one array per key, and %d does not divide their "
                "first dimension",
                whole,
                n,
                n,
            )
        return (OWN,) * len(shapes)
    if below is None:
        return tuple(PADDED if place.pads(shape) else OWN for shape in shapes)
    # Across processes no bucket the policy shares is split: a value too small to split
    # there stays whole in each process (a split would cost an all-gather at each pull).
    split = split and not spans_processes(devices)
    # A value to split goes to a bucket the policy shares where that bucket is split (it then
    # holds at least this value's elements, the bound), else to a split bucket of its own.
    return tuple(
        PADDED
        if place.pads(shape) and not (split and math.prod(shape) < below)
        else SHARED
        if math.prod(shape) < below and (split or not place.is_sharded(shape))
        else OWN
        for shape in shapes
    )


@functools.lru_cache(maxsize=256)
def _deferred(
    policy: Policy,
    compression: tuple | None,
    bound: int | None,
    devices: tuple[jax.Device, ...],
    shapes: tuple[tuple[int, ...], ...],
    flat: FlatLayout | None,
    pad: bool,
) -> bool:
    """``KVState.deferred``: whether a key that ``policy`` puts in a bucket lies outside
    ``flat``'s buckets. Cached: a push's state shares its layout with the state pushed."""
    inside = set(buckets.in_buckets(flat)) if flat is not None else set()
    bucketed = _bucketed(policy, compression, bound, devices, shapes, pad)
    return any(b and i not in inside for i, b in enumerate(bucketed))


@functools.lru_cache(maxsize=64)
def mesh_over(devices: tuple[jax.Device, ...]) -> Mesh:
    return Mesh(np.array(devices, dtype=object), (AXIS,))


@functools.lru_cache(maxsize=128)
def _sharding(mesh: Mesh, axis: Any, sharded: bool) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(axis) if sharded else PartitionSpec())


def _axes_size(mesh: Mesh, axes: tuple[str, ...]) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def _trimmed(entries: list[Any]) -> PartitionSpec:
    """A ``PartitionSpec`` of ``entries`` without trailing ``None``s (one spelling of each)."""
    while entries and entries[-1] is None:
        entries = entries[:-1]
    return PartitionSpec(*entries)


def _by_key(item: tuple[Any, Any]) -> Any:
    return item[0]


def split_shape(mesh: Mesh, spec: PartitionSpec, shape: tuple[int, ...]) -> tuple[int, ...]:
    """``shape`` with each dimension divided by the devices of the axes ``spec`` splits it
    along."""
    out = list(shape)
    for d, entry in enumerate(spec):
        if entry is None:
            continue
        names = (entry,) if isinstance(entry, str) else tuple(entry)
        out[d] //= _axes_size(mesh, names)
    return tuple(out)


@functools.lru_cache(maxsize=64)
def _local_positions(devices: tuple[jax.Device, ...]) -> dict[jax.Device, int]:
    me = jax.process_index()
    return {d: i for i, d in enumerate(d for d in devices if d.process_index == me)}


@functools.lru_cache(maxsize=64)
def _positions(devices: tuple[jax.Device, ...]) -> dict[jax.Device, int]:
    return {d: i for i, d in enumerate(devices)}


def normalize_key(key: Any) -> Key:
    """``key`` as a plain ``int`` or ``str``; anything else is refused."""
    if type(key) is int or type(key) is str:  # the common cases, before the ABC checks
        return key
    if isinstance(key, str):
        return key
    if isinstance(key, numbers.Integral) and not isinstance(key, bool):
        return int(key)
    raise KeyTypeError(f"key {shown(key)}: expected an int or a str, given {type(key).__name__}")


def key_kind(key: Key) -> str:
    return "str" if isinstance(key, str) else "int"


class ReadOnlyMapping(Mapping):
    """A read-only mapping that is a pytree of its values (``KVState.values``,
    ``KVState.opt_states``): its keys, in their order, are the pytree's structure."""

    __slots__ = ("_items",)

    def __init__(self, items: dict) -> None:
        self._items = items

    def __getitem__(self, key: Any) -> Any:
        return self._items[key]

    def __iter__(self) -> Any:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"ReadOnlyMapping({self._items!r})"


def _flatten_mapping(m: ReadOnlyMapping) -> tuple[list, tuple]:
    keys = tuple(m)
    return [(jax.tree_util.DictKey(k), m[k]) for k in keys], keys


jax.tree_util.register_pytree_with_keys(
    ReadOnlyMapping,
    _flatten_mapping,
    lambda keys, children: ReadOnlyMapping(dict(zip(keys, children))),
)


@dataclasses.dataclass(frozen=True)
class Facts:
    """A store's static facts, compared and hashed by value (:meth:`KVState.facts`)."""

    devices: tuple[jax.Device, ...]
    bound: int | None
    compression: tuple | None
    mesh: Mesh | None
    policy: Policy
    reduce: str
    mesh_axes: tuple[str, ...]
    _hash: int = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Hashed once: a fact of every push's cache keys (core/plans.py, core/signature.py).
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f) for f in _FACTS)))

    def __hash__(self) -> int:
        return self._hash

    def emptied(self) -> KVState:
        """A state with no keys and these facts."""
        return KVState(keys=(), values=(), opt_states=(), **{f: getattr(self, f) for f in _FACTS})


_FACTS = tuple(f.name for f in dataclasses.fields(Facts) if f.compare)


@functools.lru_cache(maxsize=256)
def _facts(*fields: Any) -> Facts:
    """The ``Facts`` of these field values, made once (states share it)."""
    return Facts(*fields)


@jax.tree_util.register_pytree_with_keys_class
class KVState:
    """An immutable key-value store of arrays over a set of devices.

    Leaves: one stored value per key (a ``jax.Array`` over the store's devices, shape and dtype
    fixed at ``init``), one optax optimizer state per *group* of keys (the keys one optimizer
    updates as one tree: made by :func:`jaxkv.init_optimizer`, or by the first optax push of a
    key set), and, under 2-bit gradient compression, one error-feedback residual per key (shape
    ``(D * n, ...)`` for a value of shape ``(n, ...)``: each device's residual in its own
    block). Aux data: the sorted key set, each key's (global) shape, the optimizer groups, the
    devices, the big-array bound and the compression. Inside ``shard_map`` with
    :func:`jaxkv.specs`, a sharded value's leaf is this device's block; the shapes in aux data
    still say the whole value's shape. A value with at least ``bigarray_bound`` elements whose
    first dimension divides by the number of devices is stored sharded along that dimension
    (each device holds 1/D of it, and of its optimizer state); one whose first dimension does
    not divide is split all the same, flattened and padded to a multiple of D in a split bucket
    (its own, or one its layout shares), with its optimizer state; smaller values are
    replicated on every device.

    Make one with :func:`jaxkv.empty` and :func:`jaxkv.init`; every operation returns a new state.

    Examples:
      >>> import jax.numpy as jnp, jaxkv
      >>> state = jaxkv.init(jaxkv.empty(), {"w": jnp.zeros(3)})
      >>> state.keys()
      ('w',)
      >>> state["w"].shape
      (3,)
    """

    __slots__ = (
        "_keys",
        "_devices",
        "leaves",
        "group_states",
        "_bound",
        "residual_leaves",
        "_compression",
        "_lookup",
        "_grouping",
        "_read",
        "key_shapes",
        "groups",
        "user_mesh",
        "policy",
        "flat_layout",
        "packings",
        "_views",
        "_deferral",
        "trees",
        "reduce",
        "mesh_axes",
        "tp_specs",
        "_tp",
        "_facts",
    )
    # The slots' types (annotations only: a class-level value would clash with the slot).
    _keys: tuple[Key, ...]
    _devices: tuple[jax.Device, ...]
    leaves: tuple[Any, ...]
    group_states: tuple[Any, ...]
    _bound: int | None
    residual_leaves: tuple[Any, ...]
    _compression: tuple | None
    _lookup: dict[Key, int] | None
    _grouping: dict[Key, tuple[Key, ...]] | None
    key_shapes: tuple[tuple[int, ...], ...]
    groups: tuple[tuple[Key, ...], ...]
    user_mesh: Mesh | None
    policy: Policy
    flat_layout: FlatLayout | None
    packings: tuple[Packing | None, ...]
    _views: tuple[Any, ...] | None
    _read: bool
    _deferral: bool | None
    trees: tuple[TreeShape, ...]
    reduce: str
    mesh_axes: tuple[str, ...]
    tp_specs: tuple[tuple[Key, PartitionSpec], ...]
    _tp: dict[Key, PartitionSpec] | None
    _facts: Facts | None

    def __init__(
        self,
        *,
        keys: tuple[Key, ...],
        devices: tuple[jax.Device, ...],
        values: Sequence[Any],
        opt_states: Sequence[Any],
        bound: int | None = BIGARRAY_BOUND,
        residuals: Sequence[Any] = (),
        compression: tuple | None = None,
        shapes: Sequence[tuple[int, ...]] | None = None,
        groups: Sequence[tuple[Key, ...]] = (),
        mesh: Mesh | None = None,
        policy: Policy = KEYS_POLICY,
        flat: FlatLayout | None = None,
        packings: Sequence[Packing | None] = (),
        trees: Sequence[tuple[str, ...]] = (),
        reduce: str = "sum",
        mesh_axes: tuple[str, ...] = (),
        tp_specs: Sequence[tuple[Key, PartitionSpec]] = (),
    ):
        # No validation here: pytree transformations rebuild states with arbitrary leaves.
        object.__setattr__(self, "_keys", keys)  # sorted, all int or all str
        object.__setattr__(self, "_devices", devices)
        # Aligned with _keys; under a flat layout, its leaves: the buckets, then the keys kept
        # as arrays of their own (see buckets.FlatLayout).
        object.__setattr__(self, "leaves", tuple(values))
        if shapes is None:  # a fresh state: its values are whole
            shapes = tuple(tuple(v.shape) for v in self.leaves)
        object.__setattr__(self, "key_shapes", tuple(shapes))  # whole values' shapes, as _keys
        object.__setattr__(self, "groups", tuple(groups))  # sorted tuples of keys, disjoint
        object.__setattr__(self, "group_states", tuple(opt_states))  # aligned with groups
        object.__setattr__(self, "_bound", bound)  # sharded storage from this many elements
        residuals = tuple(residuals) or (None,) * len(keys)  # aligned with _keys
        object.__setattr__(self, "residual_leaves", residuals)
        object.__setattr__(self, "_compression", compression)  # e.g. ("2bit", 0.5), or None
        object.__setattr__(self, "_lookup", None)  # key -> position, built on first use
        object.__setattr__(self, "_grouping", None)  # key -> its optimizer group, the same
        object.__setattr__(self, "user_mesh", mesh)  # the user's one-axis mesh, or None
        object.__setattr__(self, "policy", policy)
        object.__setattr__(self, "flat_layout", flat)
        # Aligned with groups: a group's packing, whose group_states entry is then the tuple of
        # its packed leaves (buckets.pack_opt); None where its optax state is kept as it is.
        object.__setattr__(self, "packings", tuple(packings) or (None,) * len(self.groups))
        object.__setattr__(self, "_views", None)  # each key's value under a flat layout, cached
        object.__setattr__(self, "_read", False)  # values_at made a few keys' values already
        object.__setattr__(self, "_deferral", None)  # `deferred`, once asked
        # The keys of each tree given to init, sorted (core/trees.py): a tree pushed must be
        # one of them; plain keys and trees do not mix.
        object.__setattr__(self, "trees", tuple(map(TreeShape.of, trees)))
        object.__setattr__(self, "reduce", reduce)  # how pushed values combine: 'sum', 'mean'
        # On a user's mesh of several axes, the axes values are summed (and sharded) along.
        object.__setattr__(self, "mesh_axes", tuple(mesh_axes))
        object.__setattr__(self, "tp_specs", tuple(tp_specs))
        object.__setattr__(self, "_tp", None)  # tp_specs as a dict, on first use
        object.__setattr__(self, "_facts", None)  # facts(), on first use

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("KVState is immutable: operations return a new state")

    def facts(self) -> Facts:
        """The store's static facts (devices, mesh, big-array bound, compression, layout
        policy, reduce): hashable, the part of a cached computation's key that comes from the
        store, and all a computation built from it may read (``Facts.emptied``)."""
        facts = self._facts
        if facts is None:
            facts = _facts(
                self._devices,
                self._bound,
                self._compression,
                self.user_mesh,
                self.policy,
                self.reduce,
                self.mesh_axes,
            )
            object.__setattr__(self, "_facts", facts)
        return facts

    def emptied(self) -> KVState:
        """A state with no keys and this one's static facts (:meth:`facts`): what a cached
        computation may keep without keeping any of the arrays alive."""
        return self.facts().emptied()

    # -- pytree protocol -------------------------------------------------------------------
    def tree_flatten_with_keys(
        self,
    ) -> tuple[tuple[tuple[jax.tree_util.GetAttrKey, tuple[Any, ...]], ...], _Aux]:
        children = (
            (jax.tree_util.GetAttrKey("values"), self.leaves),
            (jax.tree_util.GetAttrKey("opt_states"), self.group_states),
            (jax.tree_util.GetAttrKey("residuals"), self.residual_leaves),
        )
        return children, self._aux()

    def tree_flatten(self) -> tuple[tuple[tuple[Any, ...], ...], _Aux]:
        return (self.leaves, self.group_states, self.residual_leaves), self._aux()

    def _aux(self) -> _Aux:
        return (
            self._keys,
            self._devices,
            self._bound,
            self._compression,
            self.key_shapes,
            self.groups,
            self.user_mesh,
            self.policy,
            self.flat_layout,
            self.packings,
            self.trees,
            self.reduce,
            self.mesh_axes,
            self.tp_specs,
        )

    @classmethod
    def tree_unflatten(cls, aux: _Aux, children: Sequence[Sequence[Any]]) -> KVState:
        keys, devices, bound, compression, shapes, groups, mesh, policy, flat, packings = aux[:10]
        trees, reduce, mesh_axes, tp_specs = aux[10:]
        values, opt_states, residuals = children
        return cls(
            keys=keys,
            devices=devices,
            values=values,
            opt_states=opt_states,
            bound=bound,
            residuals=residuals,
            compression=compression,
            shapes=shapes,
            groups=groups,
            mesh=mesh,
            policy=policy,
            flat=flat,
            packings=packings,
            trees=trees,
            reduce=reduce,
            mesh_axes=mesh_axes,
            tp_specs=tp_specs,
        )

    # -- the flat layout -------------------------------------------------------------------
    @property
    def layout(self) -> str:
        """The layout asked for at :func:`empty`, one of ``'auto'``, ``'flat'`` and ``'keys'``."""
        return self.policy[0]

    @property
    def buckets(self) -> int:
        """How many flat buckets hold values, 0 where every key has an array of its own."""
        return 0 if self.flat_layout is None else len(self.flat_layout.buckets)

    @property
    def stored_values(self) -> tuple[Any, ...]:
        """Each key's stored value, in key order: the leaves themselves, or under a flat layout
        each key's view of its bucket (traced: slices XLA fuses into their readers; eager: one
        computation makes them all, kept with this state)."""
        flat = self.flat_layout
        if flat is None:
            return self.leaves
        views = self._views
        if views is not None:
            return views
        leaves = self.leaves
        if jax_internals.any_tracer(leaves):
            views = tuple(buckets.views(flat, leaves))
        elif all(isinstance(x, jax.Array) for x in leaves):
            views = tuple(buckets.eager_values(flat, leaves))
            if jax_internals.any_tracer(views):
                return views  # a state closed over by a trace: its views belong to the trace
        elif all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):  # jax.eval_shape's
            views = buckets.stored_types(self)
        else:  # other leaves (specs' PartitionSpecs): each key's is its bucket's
            views = tuple(leaves[flat.leaf(i)] for i in range(len(flat.where)))
        object.__setattr__(self, "_views", views)
        return views

    def group_state(self, n: int) -> Any:
        """The optax state of the ``n``-th optimizer group (unpacked: views of its buckets)."""
        packing = self.packings[n]
        opt = self.group_states[n]
        if packing is None:
            return opt
        if jax_internals.any_tracer(opt):
            return buckets.unpack_opt(packing, opt)
        if not all(isinstance(x, jax.Array) for x in opt):  # specs, or jax.eval_shape's
            return buckets.unpack_opt_like(packing, opt)
        return buckets.run("flat optimizer state", buckets.eager_unpack_opt(packing), list(opt))

    # -- read-only views -------------------------------------------------------------------
    def keys(self) -> tuple[Key, ...]:
        """The keys, sorted."""
        return self._keys

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        """The devices the store's values live on."""
        return self._devices

    @property
    def mesh(self) -> Mesh:
        """The store's mesh over :attr:`devices`: the mesh given to :func:`empty`, or a one-axis
        mesh of its own (axis name ``'kv'``, or the ``axis_name`` given to :func:`empty`)."""
        mesh = self.user_mesh
        return mesh_over(self._devices) if mesh is None else mesh

    @property
    def axis(self) -> Any:
        """The name of the mesh axis that values are summed and sharded values split along (on
        a mesh of several axes, the ``axis_name`` given: a name, or a tuple of names)."""
        if self.mesh_axes:
            return self.mesh_axes[0] if len(self.mesh_axes) == 1 else self.mesh_axes
        mesh = self.user_mesh
        return AXIS if mesh is None else mesh.axis_names[0]

    @property
    def multi_axis(self) -> bool:
        """Whether the store lives on a user's mesh of several axes."""
        mesh = self.user_mesh
        return mesh is not None and len(mesh.axis_names) > 1

    def tp_spec(self, key: Key) -> PartitionSpec | None:
        """``key``'s own sharding along other axes than the store's (its tensor-parallel
        split, kept from the value given to ``init``), or ``None``."""
        if not self.tp_specs:
            return None
        tp = self._tp
        if tp is None:
            tp = dict(self.tp_specs)
            object.__setattr__(self, "_tp", tp)
        return tp.get(key)

    def local_shape(self, key: Key) -> tuple[int, ...]:
        """The shape of ``key``'s value on one device of the axes it is split along by its own
        sharding (inside ``shard_map`` over the whole mesh, before the store's axis splits it):
        its whole shape where it has none."""
        shape = self.key_shapes[self.index(key)]
        spec = self.tp_spec(key)
        return shape if spec is None else split_shape(self.mesh, spec, shape)

    def key_spec(self, key: Key, axis: Any = None) -> PartitionSpec:
        """Where ``key``'s value (and each optimizer-state leaf of its shape) lives: its own
        sharding, with the store's axis (or ``axis``) added along dimension 0 where the store
        shards it (its value on one device of the other axes is big enough, and its rows
        divide by the store's devices)."""
        return self.spec_with(self.key_shapes[self.index(key)], self.tp_spec(key), axis)

    def spec_with(
        self, shape: tuple[int, ...], tp: PartitionSpec | None, axis: Any = None
    ) -> PartitionSpec:
        """:meth:`key_spec` of a value of ``shape`` with its own sharding ``tp``."""
        axis = self.axis if axis is None else axis
        local = shape if tp is None else split_shape(self.mesh, tp, shape)
        sharded = self.is_sharded(local)
        if tp is None:
            return PartitionSpec(axis) if sharded else PartitionSpec()
        if not sharded:
            return tp
        entries = list(tp) + [None] * (len(shape) - len(tp))
        first = entries[0]
        mine = (axis,) if isinstance(axis, str) else tuple(axis)
        theirs = () if first is None else (first,) if isinstance(first, str) else tuple(first)
        entries[0] = (*theirs, *mine)
        return _trimmed(entries)

    def own_spec(self, key: Any, x: Any) -> PartitionSpec | None:
        """The sharding along other axes than the store's that a value ``x`` given to ``init``
        for ``key`` carries (a ``NamedSharding`` over the store's mesh of several axes), or
        ``None``; refused where it does not divide the value."""
        sharding = getattr(x, "sharding", None)
        if not self.multi_axis or not isinstance(sharding, NamedSharding):
            return None
        if sharding.mesh.shape != self.mesh.shape or tuple(sharding.mesh.axis_names) != tuple(
            self.mesh.axis_names
        ):
            return None
        mine = set(self.mesh_axes)
        entries: list[Any] = []
        for entry in sharding.spec:
            names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
            kept = tuple(a for a in names if a not in mine)
            entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
        if all(e is None for e in entries):
            return None
        spec = _trimmed(entries)
        shape = tuple(x.shape)
        for d, entry in enumerate(entries):
            if entry is not None:
                n = _axes_size(self.mesh, (entry,) if isinstance(entry, str) else tuple(entry))
                if shape[d] % n:
                    raise KVStoreError(
                        f"key {shown(key)}: its sharding {spec} splits dimension {d} of shape "
                        f"{shape} over {n} devices, expected a size that divides"
                    )
        return spec

    def sharding_of(self, key: Key) -> NamedSharding:
        """:meth:`key_spec` over the store's mesh."""
        if self.tp_spec(key) is None:
            return self.sharding_for(self.key_shapes[self.index(key)])
        return NamedSharding(self.mesh, self.key_spec(key))

    @property
    def shards(self) -> int:
        """The number of blocks a sharded value is split into (the devices along
        :attr:`axis`)."""
        if not self.multi_axis:
            return len(self._devices)
        return _axes_size(self.mesh, self.mesh_axes)

    @property
    def positions(self) -> dict[jax.Device, int]:
        """Each device's position in :attr:`devices`."""
        return _positions(self._devices)

    @property
    def local_positions(self) -> dict[jax.Device, int]:
        """This process's devices, each with its position among them (in mesh order)."""
        return _local_positions(self._devices)

    @property
    def sharding(self) -> NamedSharding:
        """The replicated sharding over :attr:`devices`, where small values live."""
        return _sharding(self.mesh, self.axis, False)

    @property
    def compression(self) -> tuple | None:
        """``('2bit', threshold)``, ``('fp16',)``, ``('bf16',)``, or ``None``."""
        return self._compression

    @property
    def residuals(self) -> Mapping[Key, Any]:
        """A read-only mapping from key to its error-feedback residual (``None`` without one);
        a pytree, as :attr:`values`."""
        return ReadOnlyMapping(dict(zip(self._keys, self.residual_leaves)))

    @property
    def bigarray_bound(self) -> int | None:
        """Values with at least this many elements are stored sharded (see the class doc)."""
        return self._bound

    @property
    def placement(self) -> Placement:
        """Which values the store splits over its devices, in what blocks, and which sums of a
        push share a collective: its placement policy, a :class:`~jaxkv.Placement`."""
        return _placement(self.shards, self._bound)

    def is_sharded(self, shape: tuple[int, ...]) -> bool:
        """Whether a value (or optimizer-state leaf) of ``shape`` is stored sharded (its
        :attr:`placement` says; asked without making it, on every push's path)."""
        return is_sharded(tuple(shape), self.shards, self._bound)

    def splits(self, shape: tuple[int, ...]) -> bool:
        """Whether a value of ``shape`` is stored split across the devices for its size alone:
        sharded by rows (:meth:`is_sharded`), or padded in a split bucket of its own (rows the
        devices do not divide; not in a compressed store, which keeps it whole). A layout may
        split smaller values too, in the buckets it shares (``buckets.is_split``)."""
        shape = tuple(shape)
        return self.is_sharded(shape) or (
            self._compression is None and not self.multi_axis and self.placement.pads(shape)
        )

    def sharding_for(self, shape: tuple[int, ...]) -> NamedSharding:
        """Where a stored array of ``shape`` lives: sharded along axis 0, or replicated."""
        return _sharding(self.mesh, self.axis, self.is_sharded(tuple(shape)))

    @property
    def values(self) -> Mapping[Key, Any]:
        """A read-only mapping from key to stored value, and a pytree of them:
        ``jax.tree.leaves(state.values)`` are the values, ``jax.tree.map(f, state.values)``
        maps them.

        Under a flat layout a key kept in a bucket is read through a view: reading the values
        builds a copy of each such key (the views are computed, and kept with this state while
        it lives), so ``state.values`` can hold more memory than the store. The bytes the store
        holds are its leaves': ``sum(x.nbytes for x in jax.tree.leaves(state))`` (values,
        optimizer state and residuals; a leaf split across devices counts its whole size).

        Examples:
          >>> import jax, jax.numpy as jnp, jaxkv
          >>> s = jaxkv.init(jaxkv.empty(), {"a": jnp.ones(3), "b": jnp.zeros((2, 2))})
          >>> sum(x.nbytes for x in jax.tree.leaves(s.values))
          28
          >>> jax.tree.map(lambda x: x.shape, s.values)["b"]
          (2, 2)
        """
        return ReadOnlyMapping(dict(zip(self._keys, self.stored_values)))

    def tree(self) -> Any:
        """The stored values as the tree given to :func:`init` (a flax ``params`` dict stays
        one): what to differentiate with respect to inside a step, ``jax.grad(loss)(
        state.tree())``, and push back as it is. Inside ``shard_map`` a value the store splits
        is this device's block, as in :attr:`values`.

        Raises:
          KVStoreError: the store holds plain keys, or several trees (then
            ``jaxkv.pull(state, like)`` with one of them gives it).

        Examples:
          >>> import jax.numpy as jnp, jaxkv
          >>> s = jaxkv.init(jaxkv.empty(), {"dense": {"w": jnp.ones(2), "b": jnp.zeros(1)}})
          >>> s.tree()["dense"]["w"].tolist()
          [1.0, 1.0]
        """
        if len(self.trees) != 1:
            raise KVStoreError(
                "state.tree(): expected a store of one tree given to init, given a store of "
                + (f"{len(self.trees)} trees" if self.trees else "plain keys")
                + "; use jaxkv.pull(state, like) with the tree (or its shapes) you want"
            )
        shape = self.trees[0].known()
        values = dict(zip(self._keys, self.stored_values))
        return jax.tree_util.tree_unflatten(shape.treedef, [values[k] for k in shape.leaf_keys])

    @property
    def shapes(self) -> Mapping[Key, tuple[int, ...]]:
        """A read-only mapping from key to the shape of its whole value (also inside
        ``shard_map``, where a sharded value's leaf is only this device's block)."""
        return MappingProxyType(dict(zip(self._keys, self.key_shapes)))

    @property
    def opt_states(self) -> Mapping[tuple[Key, ...], Any]:
        """A read-only mapping from each optimizer group (a sorted tuple of keys) to its optax
        state, the state of ``optimizer.init({key: value for key in group})``; a pytree of
        those states' arrays, as :attr:`values`."""
        return ReadOnlyMapping({g: self.group_state(n) for n, g in enumerate(self.groups)})

    def opt_group(self, key: Any) -> tuple[Key, ...] | None:
        """The optimizer group ``key`` belongs to, or ``None`` if it has no optimizer state."""
        return self._groups_of().get(self._keys[self.index(key)])

    def _groups_of(self) -> dict[Key, tuple[Key, ...]]:
        """Each key's optimizer group (asked per key at every push: built once per state)."""
        grouping = self._grouping
        if grouping is None:
            grouping = {k: g for g in self.groups for k in g}
            object.__setattr__(self, "_grouping", grouping)
        return grouping

    @property
    def key_kind(self) -> str | None:
        """``'int'`` or ``'str'``, or ``None`` while the store is empty."""
        return key_kind(self._keys[0]) if self._keys else None

    def __contains__(self, key: Hashable) -> bool:
        try:
            return normalize_key(key) in self.key_positions
        except KVStoreError:
            return False

    def __getitem__(self, key: Key) -> Any:
        return self.stored_value(self.index(key))

    def values_at(self, index: Sequence[int]) -> list[Any]:
        """The stored values of key positions ``index`` (``stored_values``): under a flat
        layout of at least ``FEW_VIEWS_FROM`` keys, eagerly, at the first read of this state,
        where they are fewer than half the keys, made for those keys alone
        (``buckets.eager_values_at``: compiled per shapes read), so that a read of a few keys
        costs them, not every key of the buckets; a second read makes every view, once (keys
        read one at a time: two computations a state, not one a key). A store of fewer keys
        makes every view at its first read (one compile for its layout)."""
        flat = self.flat_layout
        if (
            flat is not None
            and self._views is None
            and not self._read
            and len(flat.where) >= FEW_VIEWS_FROM
            and 2 * len(index) < len(flat.where)
        ):
            object.__setattr__(self, "_read", True)
            leaves = self.leaves
            if jax_internals.all_eager(leaves):
                got = buckets.eager_values_at(flat, leaves, index)
                if got is not None:
                    return got
        held = self.stored_values
        return [held[i] for i in index]

    def own_leaf(self, i: int) -> int | None:
        """The position among ``leaves`` of key position ``i``'s array of its own (every key's,
        under one array per key), or ``None`` where it lives in a bucket."""
        flat = self.flat_layout
        if flat is None:
            return i
        b, j, _ = flat.where[i]
        return None if b >= 0 else len(flat.buckets) + j

    def in_buckets(self, index: Sequence[int]) -> list[bool]:
        """Whether each key at ``index`` lies in a bucket, or will once this state is
        :meth:`settled` (a key the policy buckets, added one at a time, keeps an array of its
        own until then): where its policy puts it, with no computation made."""
        if not self.deferred:
            return [self.own_leaf(i) is None for i in index]
        if self._compression is not None:  # (no buckets: each key keeps its residual)
            return [False] * len(index)
        policy = self._bucketed(self.key_shapes)
        return [bool(policy[i]) for i in index]

    def own_leaves(self, index: Sequence[int]) -> list[int] | None:
        """Under a flat layout, the positions among ``leaves`` of the keys at ``index`` where
        each is an array of its own and its optimizer state, if any, is not packed into
        buckets: all a computation on those keys takes of the state (a flat push's
        computation takes the whole state: its compile and dispatch grow with every key).
        ``None`` where one is not, or under one array per key."""
        flat = self.flat_layout
        if flat is None:
            return None
        own, groups_of = [], self._groups_of()
        for i in index:
            leaf = self.own_leaf(i)
            group = groups_of.get(self._keys[i])
            if leaf is None or (
                group is not None and self.packings[self.groups.index(group)] is not None
            ):
                return None
            own.append(leaf)
        return own

    def stored_value(self, i: int) -> Any:
        """Key position ``i``'s stored value (``stored_values``): under a flat layout, a
        key with an array of its own is that array, with no view of any bucket made."""
        flat = self.flat_layout
        if flat is None:
            return self.leaves[i]
        own = self.own_leaf(i)
        if self._views is None and own is not None:
            leaf = self.leaves[own]
            if isinstance(leaf, jax.Array):  # (as stored_values gives it: itself)
                return leaf
        return self.stored_values[i]

    def __len__(self) -> int:
        return len(self._keys)

    def __repr__(self) -> str:
        shown = ", ".join(repr(k) for k in self._keys[:6])
        more = ", ..." if len(self._keys) > 6 else ""
        return f"KVState(keys=[{shown}{more}], devices={len(self._devices)})"

    # -- helpers for the operations ----------------------------------------------------------
    @property
    def key_positions(self) -> dict[Key, int]:
        lookup = self._lookup
        if lookup is None:
            lookup = {k: i for i, k in enumerate(self._keys)}
            object.__setattr__(self, "_lookup", lookup)
        return lookup

    def index(self, key: Any) -> int:
        """Position of ``key`` in :meth:`keys`; refuses unknown keys and the wrong key kind."""
        kind = type(key)
        if kind is int or kind is str:  # asked several times a push: a held key at once
            lookup = self._lookup
            i = (self.key_positions if lookup is None else lookup).get(key)
            if i is not None:  # (an int key is found among int keys only, a str among str)
                return i
        key = normalize_key(key)
        self.check_kind(key)
        try:
            return self.key_positions[key]
        except KeyError:
            raise unknown_key(key, self._keys) from None

    def check_kind(self, key: Key) -> None:
        kind = self.key_kind
        if kind is not None and key_kind(key) != kind:
            raise KeyTypeError(
                f"key {shown(key)}: this store holds {kind} keys, given a {key_kind(key)} key "
                "(one store holds one kind of key, as in MXNet)"
            )

    def replace(
        self,
        values: Mapping[Key, Any] | None = None,
        opt_states: Mapping[tuple[Key, ...], Any] | None = None,
        residuals: Mapping[Key, Any] | None = None,
        compression: Any = _KEEP,
        defer: bool | None = None,
        trees: Sequence[tuple[str, ...]] = (),
        tp_specs: Mapping[Key, PartitionSpec] | None = None,
    ) -> KVState:
        """A new state with some keys' leaves replaced or added (and maybe the compression).

        ``opt_states`` maps optimizer groups (tuples of keys) to their state; a group replaces
        every group that shares a key with it, and a state of ``None`` removes the group.
        Keys keep their recorded shapes; new keys take their value's shape. Under a flat
        layout the new values are written into their buckets (in place, where the key set and
        groups stay), or the buckets are made anew.

        ``defer``: the buckets stay as they are, and the keys not in one (the new keys among
        them) keep arrays of their own until a state is :meth:`settled` (an eager push of
        several keys settles it): keys added one at a time, each read at once (MXNet's
        ``init`` then ``pull``), cost no computation over the other keys. By default (``None``)
        a state that defers keys goes on deferring them (a push of one key keeps them so).

        ``trees``: the paths of trees given to ``init`` with these values, added to the state's;
        ``tp_specs``: the new keys' own shardings along other axes than the store's.
        """
        if defer is None:
            defer = self.deferred
        values = dict(values or {})
        compression = self._compression if compression is _KEEP else compression
        shapes = dict(zip(self._keys, self.key_shapes))
        types = dict(zip(self._keys, buckets.stored_types(self)))
        for k, v in values.items():
            shapes.setdefault(k, tuple(v.shape))
            types[k] = v
        old_r = dict(zip(self._keys, self.residual_leaves))
        old_r.update(residuals or {})
        keys = tuple(sorted(types))
        # Optimizer groups: (state, or None: kept as it is) by group.
        groups: dict[tuple[Key, ...], Any] = {g: _KEEP for g in self.groups}
        for group, opt in (opt_states or {}).items():
            group = tuple(sorted(group))
            for other in [g for g in groups if set(g) & set(group)]:
                del groups[other]
            if opt is not None:
                groups[group] = opt
        position = {k: i for i, k in enumerate(keys)}
        order = sorted(groups, key=lambda g: position[g[0]])
        flat = self._plan(
            keys,
            [shapes[k] for k in keys],
            [types[k] for k in keys],
            order,
            compression,
            self._in_buckets() if defer else None,
        )
        leaves = buckets.kept_leaves(self, keys, values, flat)
        kept = leaves is not None
        if leaves is None:
            leaves = buckets.new_leaves(self, keys, values, flat)
        old_n = {g: n for n, g in enumerate(self.groups)}
        opts, packings = [], []
        for g in order:
            opt = groups[g]
            # A group is packed where its keys are in buckets, or where one of them is in a
            # split bucket (its moments then split as its value is, however the others live).
            where = [flat.where[position[k]][0] for k in g] if flat is not None else []
            split_parts = max((flat.parts_of(b) for b in where if b >= 0), default=1) if flat else 1
            packable = bool(where) and (all(b >= 0 for b in where) or split_parts > 1)
            if opt is _KEEP:
                n = old_n[g]
                if (self.packings[n] is not None) == packable:
                    opts.append(self.group_states[n])
                    packings.append(self.packings[n])
                    continue
                opt = self.group_state(n)
            if packable:
                assert flat is not None  # packable says so
                packing, packed = buckets.packed_group_state(
                    g, [shapes[k] for k in g], opt, self, old_n.get(g), split_parts
                )
                opts.append(tuple(packed))
                packings.append(packing)
            else:
                opts.append(opt)
                packings.append(None)
        new = KVState(
            keys=keys,
            devices=self._devices,
            values=leaves,
            opt_states=opts,
            bound=self._bound,
            residuals=[old_r.get(k) for k in keys],
            compression=compression,
            shapes=[shapes[k] for k in keys],
            groups=order,
            mesh=self.user_mesh,
            policy=self.policy,
            flat=flat,
            packings=packings,
            trees=self.trees + tuple(trees),
            reduce=self.reduce,
            mesh_axes=self.mesh_axes,
            tp_specs=tuple(
                sorted({**dict(self.tp_specs), **(tp_specs or {})}.items(), key=_by_key)
            ),
        )
        # Placed where the store keeps each leaf: a split bucket and its moments sharded, and
        # values laid out anew (from a flat layout to one array per key, say, when compression
        # is set) where their layout keeps them, not where XLA put their views.
        relaid = flat is not self.flat_layout and (flat is not None or self.flat_layout is not None)
        if (relaid and not kept) or (flat is not None and flat.split):
            new = new._placed()
        return new

    def _placed(self) -> KVState:
        """This state with each eager leaf where the store keeps it (split buckets and their
        optimizer state sharded over the mesh, the rest as :meth:`leaf_specs` says), so that
        a push sees the same placement from its first call on and never compiles again."""
        leaves = jax.tree_util.tree_leaves(self)
        if not leaves or not all(isinstance(x, jax.Array) for x in leaves):
            return self  # traced, or abstract: a computation places its own results
        if jax_internals.any_tracer(leaves):
            return self
        mesh = self.mesh
        shardings = jax.tree_util.tree_map(
            lambda spec: NamedSharding(mesh, spec), buckets.leaf_specs(self, self.axis)
        )
        # Over several processes' devices a reshard is a computation there: it takes its
        # collective turn, as the layout's other eager computations do.
        return buckets.run("placement of split buckets", buckets.put, self, shardings)

    def _plan(
        self,
        keys: tuple[Key, ...],
        shapes: list[tuple[int, ...]],
        types: list[Any],
        groups: list[tuple[Key, ...]],
        compression: tuple | None,
        inside: frozenset[Key] | None = None,
    ) -> FlatLayout | None:
        """The flat layout of a state of ``keys`` under this state's policy, or ``None`` (one
        array per key): no value is bucketed in a compressed store (each key keeps its own
        error-feedback residuals) or in a store across processes. Where the policy splits
        buckets, a bucket of at least the big-array bound is split over the devices; where it
        does not, a value the store shards keeps an array of its own. ``inside``: only these
        keys may be in buckets (:meth:`replace`'s ``defer``)."""
        _, below, split = self.policy
        if not keys:
            return None
        bucketed = self._bucketed(shapes, compression)  # (compressed: warns of whole values)
        if compression is not None:
            return None
        if inside is not None:
            bucketed = [b and k in inside for k, b in zip(keys, bucketed)]
        split = split and not spans_processes(self._devices)
        if not any(bucketed):
            return None
        flat = buckets.plan(
            keys,
            shapes,
            [t.dtype for t in types],
            groups,
            bucketed,
            # (where the policy splits no shared bucket, only a padded value's is split)
            self.placement if split else _placement(self.shards, None),
        )
        if self.flat_layout is not None and flat == self.flat_layout:
            return self.flat_layout  # the same object: cached computations key on it
        return flat

    def _bucketed(self, shapes: Sequence[tuple[int, ...]], compression: Any = _KEEP) -> list[int]:
        """Where this state's policy puts a value of each shape (``OWN``, ``SHARED`` or
        ``PADDED``; with this state's compression, or ``compression``)."""
        compression = self._compression if compression is _KEEP else compression
        return list(
            _bucketed(
                self.policy,
                compression,
                self._bound,
                self._devices,
                tuple(shapes),
                not self.multi_axis,
            )
        )

    def _in_buckets(self) -> frozenset[Key]:
        """The keys that live in buckets."""
        flat = self.flat_layout
        if flat is None:
            return frozenset()
        return frozenset(self._keys[i] for i in buckets.in_buckets(flat))

    @property
    def deferred(self) -> bool:
        """Whether some keys keep arrays of their own that this state's policy would put in
        buckets (added with :meth:`replace`'s ``defer``): :meth:`settled` lays them out."""
        if self._deferral is None:  # asked at every push: cached by layout, not per state
            deferral = _deferred(
                self.policy,
                self._compression,
                self._bound,
                self._devices,
                self.key_shapes,
                self.flat_layout,
                not self.multi_axis,
            )
            object.__setattr__(self, "_deferral", deferral)
        return bool(self._deferral)

    def settled(self) -> KVState:
        """This state with every key where its policy puts it (see :meth:`replace`'s
        ``defer``): the same state where nothing was deferred, or where it is traced."""
        if not self.deferred:
            return self
        if jax_internals.any_tracer(jax.tree_util.tree_leaves(self)):
            return self
        return self.replace(defer=False)


def spans_processes(devices: tuple[jax.Device, ...]) -> bool:
    """Whether ``devices`` include another process's."""
    return _spans(devices, jax.process_index())


@functools.lru_cache(maxsize=256)  # asked several times a push, of a store's few device sets
def _spans(devices: tuple[jax.Device, ...], me: int) -> bool:
    return any(d.process_index != me for d in devices)


def empty(
    devices: Iterable[Any] | None = None,
    *,
    bigarray_bound: int | None | str = "default",
    compression: Mapping[str, Any] | None = None,
    mesh: Mesh | None = None,
    axis_name: str | tuple[str, ...] | None = None,
    layout: str | None = None,
    reduce: str = "sum",
) -> KVState:
    """An empty store over ``devices`` (JAX devices or contexts; default: ``jax.devices()``,
    every device of the job, so in a joined multi-process job every process's; a store over
    one process's devices alone is ``empty(jax.local_devices())``).

    Values with at least ``bigarray_bound`` elements are stored split across the devices, with
    their optimizer state: along their first dimension where it divides by the number of
    devices, else flattened and padded (a split bucket); smaller ones are replicated.
    ``'default'``: the environment variable ``JAXKV_BIGARRAY_BOUND`` (a number, or ``none``),
    else 16384. ``bigarray_bound=None`` replicates everything, which ``pmap`` needs: it accepts
    a state passed with ``in_axes=None`` only if every leaf is replicated. The store's
    :attr:`KVState.placement` answers which shapes it splits.

    ``compression`` takes MXNet's gradient-compression parameters: ``{'type': '2bit',
    'threshold': t}`` (t > 0; error feedback per device, as MXNet), or ``{'type': 'fp16'}`` /
    ``{'type': 'bf16'}`` (each device's value rounded to that type before the sum).

    ``mesh`` adopts the user's ``jax.sharding.Mesh``: the store lives on its devices, in its
    order, and its arrays carry shardings over that very mesh, so a ``shard_map`` step over it
    (``in_specs=jaxkv.specs(state, axis)``) takes the state in and out unchanged and compiles
    once. ``axis_name`` alone names the axis of the store's own mesh (default ``'kv'``); with a
    one-axis ``mesh`` it must be that mesh's axis. On a mesh of several axes (data beside model
    parallelism), ``axis_name`` names the axis (or a tuple of axes) that values are summed
    along, and that values above the big-array bound are sharded along (the other axes
    replicate them); pushes there run inside ``shard_map`` with that ``axis_name``, or eagerly
    with one value per key, and the layout is ``'keys'``.

    ``layout`` says how values are kept: ``'keys'``, one array per key; ``'flat'``, the values
    of one dtype and optimizer group in one contiguous buffer (a *bucket*), each key a view of
    it, and their optimizer state likewise, so a jitted step moves a few buffers instead of
    one per key; ``'auto'`` (the default, or the environment variable ``JAXKV_LAYOUT``),
    flat on accelerators and, on CPU, flat for values below 4096 elements. Values the store
    shards, stores with gradient compression and stores across processes keep one array per
    key in every layout. Every operation gives the same results in every layout.

    ``reduce`` says how a push combines a key's contributions: ``'sum'`` (MXNet's, the
    default) or ``'mean'`` (their sum divided once by how many there were, as
    ``jax.lax.pmean``); a push's own ``reduce=`` overrides it.

    Examples:
      >>> import jaxkv
      >>> len(jaxkv.empty().devices) >= 1
      True
    """
    from jaxkv._src.devices import Context

    if mesh is not None and not isinstance(mesh, Mesh):
        raise KVStoreError(f"mesh: expected a jax.sharding.Mesh, given {type(mesh).__name__}")
    axes: tuple[str, ...] = ()
    if mesh is not None and len(mesh.axis_names) > 1:
        axes = _mesh_axes(mesh, axis_name)
        if layout == "flat":
            raise KVStoreError(
                f"layout: on a mesh of several axes {tuple(mesh.axis_names)} expected 'keys' "
                "or 'auto' (one array per key), given 'flat'"
            )
        if compression is not None:
            raise KVStoreError(
                f"compression: on a mesh of several axes {tuple(mesh.axis_names)} expected "
                f"none, given {compression!r}; compress on a one-axis mesh"
            )
        layout = "keys"
    elif axis_name is not None and not isinstance(axis_name, str):
        raise KVStoreError(f"axis_name: expected a str, given {axis_name!r}")
    if mesh is not None and not axes and axis_name is not None and axis_name != mesh.axis_names[0]:
        raise KVStoreError(
            f"axis_name: expected the mesh's axis {mesh.axis_names[0]!r}, given {axis_name!r}"
        )
    if devices is None:
        # Every device of the job: in a joined multi-process job, every process's (a store
        # over this process's devices alone is asked for with devices=jax.local_devices()).
        devs = tuple(jax.devices()) if mesh is None else tuple(mesh.devices.flat)
    else:
        devs = tuple(d.device if isinstance(d, Context) else d for d in devices)
        if mesh is not None and devs != tuple(mesh.devices.flat):
            raise KVStoreError(
                f"devices: expected the mesh's devices in its order {list(mesh.devices.flat)}, "
                f"given {list(devs)}; pass the mesh alone"
            )
    if not devs or not all(isinstance(d, jax.Device) for d in devs):
        raise KVStoreError(f"devices: expected a non-empty list of JAX devices, given {devices!r}")
    if len(set(devs)) != len(devs):
        raise KVStoreError(f"devices: expected distinct devices, given {list(devs)}")
    if isinstance(bigarray_bound, str) and bigarray_bound == "default":
        bigarray_bound = default_bound()
    if bigarray_bound is not None and (
        not isinstance(bigarray_bound, int)
        or isinstance(bigarray_bound, bool)
        or bigarray_bound < 1
    ):
        raise KVStoreError(
            f"bigarray_bound: expected a positive int, None or 'default', given {bigarray_bound!r}"
        )
    config = compression_config(compression)
    check_compression_devices(config, devs)
    if mesh is None and axis_name is not None and axis_name != AXIS:
        mesh = Mesh(np.array(devs, dtype=object), (axis_name,))
    policy = layout_policy(layout, devs)
    if reduce not in ("sum", "mean"):
        raise KVStoreError(f"reduce: expected one of ['sum', 'mean'], given {reduce!r}")
    if any(d.process_index != jax.process_index() for d in devs):
        _agree_across(devs, bigarray_bound, config, reduce, axes)
    return KVState(
        keys=(),
        devices=devs,
        values=(),
        opt_states=(),
        bound=bigarray_bound,
        compression=config,
        mesh=mesh,
        policy=policy,
        reduce=reduce,
        mesh_axes=axes,
    )


def _agree_across(
    devices: tuple[jax.Device, ...],
    bound: int | None,
    compression: tuple | None,
    reduce: str,
    axes: tuple[str, ...],
) -> None:
    """A store over several processes' devices is made alike by every process: each places
    and sums values as the others do (else their collectives do not match: seen, a push that
    waited until the watchdog ended the job). What may differ unseen is what comes from each
    process's environment (its ``JAXKV_BIGARRAY_BOUND``; a ``dist_sync`` store's
    ``MXNET_KVSTORE_BIGARRAY_BOUND``), so every process compares what it made in one host
    all-gather of a digest (one more, of the texts, where they differ: every process then
    raises, naming each one's). The layout is not compared: across processes every layout
    keeps one array per key."""
    mine = (
        f"bigarray_bound={bound}, reduce={reduce!r}, "
        f"compression={compression!r}, axes={list(axes)}, devices={[d.id for d in devices]}"
    ).encode()
    texts = host.texts_if_differ(mine, "the stores each process made")
    if texts is None:
        return
    per = "; ".join(f"process {p}: {t.decode()}" for p, t in enumerate(texts))
    raise KVStoreError(
        f"empty: expected every process to make the store over {len(devices)} devices alike, "
        f"given {per}. Set {BOUND_ENV} (a dist_sync store: MXNET_KVSTORE_BIGARRAY_BOUND) or "
        "pass bigarray_bound the same in every process"
    )


def _mesh_axes(mesh: Mesh, axis_name: Any) -> tuple[str, ...]:
    """The axes of a mesh of several axes that values are summed along, checked."""
    names = mesh.axis_names
    given = (axis_name,) if isinstance(axis_name, str) else axis_name
    if not isinstance(given, tuple | list) or not given:
        raise KVStoreError(
            f"axis_name: on a mesh of several axes {tuple(names)} expected the axis (or a tuple "
            f"of axes) values are summed along, such as {names[0]!r}, given {axis_name!r}"
        )
    for a in given:
        if a not in names:
            raise KVStoreError(f"axis_name: expected axes of the mesh {tuple(names)}, given {a!r}")
    if len(set(given)) != len(given):
        raise KVStoreError(
            f"axis_name: expected distinct axes of the mesh {tuple(names)}, given {tuple(given)!r}"
        )
    return tuple(given)


def layout_policy(layout: str | None, devices: tuple[jax.Device, ...]) -> Policy:
    """The policy for ``layout`` (default: ``JAXKV_LAYOUT``, else ``'auto'``) on ``devices``."""
    given = layout
    if layout is None:
        layout = os.environ.get(LAYOUT_ENV) or "auto"
    if layout not in LAYOUTS:
        where = "layout" if given is not None else LAYOUT_ENV
        raise KVStoreError(f"{where}: expected one of {list(LAYOUTS)}, given {layout!r}")
    if layout == "keys":
        return KEYS_POLICY
    if layout == "flat":
        return ("flat", ALL, True)
    if devices[0].platform == "cpu":
        return ("auto", AUTO_CPU_BELOW, False)
    return ("auto", ALL, True)


_COMPRESSION_TYPES = ("2bit", "fp16", "bf16", "none")


def compression_config(params: Mapping[str, Any] | None) -> tuple | None:
    """MXNet's compression parameters as the static tuple a state keeps."""
    if params is None:
        return None
    if not isinstance(params, Mapping) or params.get("type") not in _COMPRESSION_TYPES:
        raise KVStoreError(
            f"gradient compression: expected {{'type': one of {list(_COMPRESSION_TYPES)}, ...}}, "
            f"given {params!r}"
        )
    kind = params["type"]
    extra = sorted(set(params) - {"type", "threshold"})
    if extra or (kind != "2bit" and "threshold" in params):
        raise KVStoreError(
            f"gradient compression {kind!r}: unexpected parameters {extra or ['threshold']}"
        )
    if kind == "none":
        return None
    if kind != "2bit":
        return (kind,)
    threshold = params.get("threshold", 0.5)  # MXNet's default
    if not isinstance(threshold, int | float) or isinstance(threshold, bool) or threshold <= 0:
        raise KVStoreError(
            f"gradient compression '2bit': threshold expected a number greater than 0 (as in "
            f"MXNet), given {threshold!r}"
        )
    return ("2bit", float(threshold))


def check_compression_devices(config: tuple | None, devices: tuple[jax.Device, ...]) -> None:
    """Refuse compression for a store over several processes with other than one device in
    each: across processes, each process compresses the sum of its own devices' values once
    (MXNet's ``dist_sync``), which needs the ``dist_sync`` layout."""
    if config is None or jax.process_count() == 1:
        return
    me = jax.process_index()
    mine = [d for d in devices if d.process_index == me]
    if len(mine) != len(devices) and len(mine) != 1:
        raise KVStoreError(
            f"gradient compression {config[0]!r}: across processes expected a store with one "
            f"device per process (a dist_sync KVStore), given {len(mine)} devices of this "
            f"process among {len(devices)}; use jaxkv.create('dist_sync'), or "
            "jaxkv.empty(one device of each process, compression=...)"
        )


def check_compressible(config: tuple | None, key: Key, dtype: Any) -> None:
    """Refuse a value that ``config``'s compression cannot carry: only floating-point values are
    compressed (as in MXNet). A 2-bit threshold cast to an integer dtype would be 0 or round the
    value, and fp16/bf16 rounding of large integers changes them: both silently."""
    if config is not None and not jnp.issubdtype(dtype, jnp.floating):
        raise KVStoreError(
            f"key {shown(key)}: gradient compression {config[0]!r} expects a floating-point value "
            f"(as in MXNet), given dtype {np.dtype(dtype)}; store this key in a store without "
            "compression"
        )
