"""The flat layout's bookkeeping: which keys share a bucket (one contiguous 1-D buffer), where
each key lives in it, each key's value as a view of its bucket, and an optimizer state's
per-key leaves packed into buckets the same way.

Keys share a bucket when they have one dtype and one optimizer group (or none). A key's view is
a slice and a reshape of its bucket, which XLA fuses into its readers; a write puts the new
value in place with ``dynamic_update_slice`` into the old bucket, which XLA does in place when
the bucket is donated (a concatenation would copy every bucket once more). The math stays per
key: an updater sees the same per-key values as in the per-key layout and gives the same
numbers; what the layout saves is the buffers that cross a computation's boundary (3 for
ResNet-50's 193 tensors with Adam, instead of 580).

A bucket of many bytes is *split* over the store's D devices (``parts`` = D), as FSDP and ZeRO
split their flat parameters: each key's value is flattened, padded with zeros to D equal blocks
and cut in them, and device d's chunk of the bucket is the d-th block of every key, in key
order. A block is whole rows where the rows divide by D or padding them adds at most 1/16 of
them (:func:`block_rows`), else a piece of the flattened value padded to a multiple of D. So
every key has a block of its own on every device (``jaxkv.gather``, ``pull(local=True)`` and a
push of a block work per key), a value of any shape is split, a table's rows are addressed in
place, and the sum of a push is one reduce-scatter per bucket (every key's ``(D, block)`` view
side by side). The padding is at most D - 1 elements, or rows, per key. Seen whole, the bucket
is ``(D * chunk,)``, sharded along its one axis; inside ``shard_map`` with ``jaxkv.specs`` a
device holds its ``(chunk,)``.

Measured on one CPU device (in-jit Adam step with gradients by AD, ResNet-50's structure with
each tensor cut to at most 16 elements): per-key layout 0.70 ms, flat storage with per-key math
and in-place writes 0.058 ms; with concatenations instead of in-place writes 0.13 ms. On the
full-size tensors XLA:CPU's slices and writes cost more than they save (54 ms per key, 201 ms
flat): which layout to use is a choice, not a rule.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxkv._src import jax_internals
from jaxkv._src.errors import KVStoreError
from jaxkv._src.processes import order
from jaxkv._src.state.policy import Placement, block_rows

if TYPE_CHECKING:  # (a type only: kvstate imports this module)
    from jaxkv._src.state.kvstate import KVState

Key = int | str  # as kvstate.Key (this module sits below kvstate.py)
PADDED = 2  # as kvstate.PADDED: a key in a split bucket of its own

__all__ = [
    "FlatLayout",
    "Packing",
    "leaf_owner",
    "pack",
    "pack_opt",
    "plan",
    "put",
    "unpack_opt",
    "views",
    "write",
    "write_opt",
]


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """Where each key lives: ``buckets[b]`` is ``(dtype name, size)``; ``where[i]`` is
    ``(bucket, offset, size)`` of the i-th key (in the store's key order), or ``(-1, j, size)``
    for a key kept as an array of its own (the j-th such key); ``shapes[i]`` and ``dtypes[i]``
    are its shape and dtype name. The leaves are the buckets, then the keys kept on their own.
    ``parts[b]`` (default 1) is how many devices bucket ``b`` is split over; the offset of a key
    in a split bucket is that of its block in each device's chunk (see the module doc), and the
    bucket's size is ``parts * chunk``. Static and hashable: it is part of a state's aux data."""

    buckets: tuple[tuple[str, int], ...]
    where: tuple[tuple[int, int, int], ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    parts: tuple[int, ...] = ()

    def __hash__(self) -> int:
        # Computed once: a layout is a key of the caches every eager read and push asks (its
        # tuples, one entry a key, took a push of 193 keys 7 us a hash).
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.buckets, self.where, self.shapes, self.dtypes, self.parts))
            object.__setattr__(self, "_hash", h)
        return h

    def parts_of(self, b: int) -> int:
        """How many devices bucket ``b`` is split over (1: replicated)."""
        return self.parts[b] if self.parts else 1

    @property
    def split(self) -> bool:
        """Whether any bucket is split over the devices."""
        return any(p > 1 for p in self.parts)

    @property
    def leaves(self) -> int:
        """How many arrays hold the values: the buckets and the keys kept on their own."""
        return len(self.buckets) + sum(1 for b, _, _ in self.where if b < 0)

    def leaf(self, i: int) -> int:
        """The index among the leaves of the array that holds key position ``i``."""
        b, j, _ = self.where[i]
        return b if b >= 0 else len(self.buckets) + j


_ONE_DEVICE = Placement(1, None)  # (nothing split)


def plan(
    keys: Sequence[Key],
    shapes: Sequence[tuple[int, ...]],
    dtypes: Sequence[Any],
    groups: Sequence[Sequence[Key]] = (),
    bucketed: Sequence[int] | None = None,
    placement: Placement = _ONE_DEVICE,
) -> FlatLayout:
    """The layout of ``keys`` (sorted, with their shapes and dtypes): one bucket per (optimizer
    group or none, dtype), buckets in the order of their first key, keys in key order inside.
    Keys whose ``bucketed`` is false are kept as arrays of their own; a key whose ``bucketed``
    is ``PADDED`` has a bucket of its own, split over the ``placement``'s devices whatever its
    size. A shared bucket is split where the ``placement`` says (:meth:`Placement.splits_bucket`:
    see the module doc)."""
    group_of = {k: g for g in map(tuple, groups) for k in g}
    bucket_of: dict[tuple, int] = {}
    padded: list[bool] = []  # whether each bucket is one PADDED key's
    sizes: list[int] = []
    names: list[str] = []
    where = []
    alone = 0
    for n, (key, shape, dtype) in enumerate(zip(keys, shapes, dtypes)):
        size = math.prod(shape)
        if bucketed is not None and not bucketed[n]:
            where.append((-1, alone, size))
            alone += 1
            continue
        name = np.dtype(dtype).name
        pad = bucketed is not None and bucketed[n] == PADDED
        tag = (group_of.get(key), name, key if pad else None)
        if tag not in bucket_of:
            bucket_of[tag] = len(sizes)
            sizes.append(0)
            names.append(name)
            padded.append(pad)
        b = bucket_of[tag]
        where.append((b, sizes[b], size))
        sizes[b] += size
    devices = placement.shards
    parts = [
        devices if devices > 1 and (pad or placement.splits_bucket(size)) else 1
        for size, pad in zip(sizes, padded)
    ]
    if any(p > 1 for p in parts):  # offsets within each device's chunk; sizes padded
        chunks = [0] * len(sizes)
        for n, (b, _, size) in enumerate(where):
            if b >= 0 and parts[b] > 1:
                where[n] = (b, chunks[b], size)
                chunks[b] += block(tuple(shapes[n]), parts[b])
        sizes = [c * p if p > 1 else size for c, p, size in zip(chunks, parts, sizes)]
    return FlatLayout(
        tuple(zip(names, sizes)),
        tuple(where),
        tuple(map(tuple, shapes)),
        tuple(np.dtype(t).name for t in dtypes),
        tuple(parts) if any(p > 1 for p in parts) else (),
    )


def block(shape: tuple[int, ...], parts: int) -> int:
    """The number of elements of each of a ``shape`` value's blocks over ``parts`` devices:
    whole rows (:func:`block_rows`), else the flattened value padded to a multiple of
    ``parts``, cut in ``parts``."""
    rows = block_rows(shape, parts)
    if rows is not None:
        return rows * math.prod(shape[1:])
    return -(-math.prod(shape) // parts)


def padding(shape: tuple[int, ...], parts: int) -> int:
    """How many zeros pad a ``shape`` value's blocks over ``parts`` devices."""
    return block(shape, parts) * parts - math.prod(shape)


def block_shape(shape: tuple[int, ...], parts: int) -> tuple[int, ...]:
    """The shape of a key's block over ``parts`` devices in a split bucket: its rows (axis 0)
    where they are whole rows (:func:`block_rows`), as a value the store shards has; else
    ``(block(shape, parts),)``."""
    rows = block_rows(shape, parts)
    if rows is not None:
        return (rows, *shape[1:])
    return (block(shape, parts),)


def split_view(
    leaf: Any, offset: int, size: int, shape: tuple[int, ...], parts: int, total: int
) -> Any:
    """A key's value in a bucket of ``total`` elements split over ``parts`` devices: from the
    whole bucket, its blocks gathered into its shape; from one device's chunk (inside
    ``shard_map``), its block there (:func:`block_shape`)."""
    n = block(shape, parts)
    if leaf.shape[0] != total:  # this device's chunk
        return jax.lax.slice_in_dim(leaf, offset, offset + n).reshape(block_shape(shape, parts))
    blocks = leaf.reshape(parts, -1)[:, offset : offset + n]
    return from_blocks(blocks, size, shape)


def split_write(leaf: Any, offset: int, value: Any, parts: int, total: int) -> Any:
    """``leaf`` (a whole split bucket, or one device's chunk of it) with a key's value written
    at ``offset``: a whole value into every device's block, or a block into this chunk."""
    if leaf.shape[0] != total:
        flat = jnp.ravel(value).astype(leaf.dtype)
        return jax.lax.dynamic_update_slice_in_dim(leaf, flat, offset, axis=0)
    blocks = as_blocks(value.astype(leaf.dtype), parts)
    grid = jax.lax.dynamic_update_slice(leaf.reshape(parts, -1), blocks, (0, offset))
    return grid.reshape(-1)


def as_blocks(value: Any, parts: int) -> Any:
    """``value`` flattened, padded with zeros to ``parts`` blocks (:func:`block`), as
    ``(parts, block)``: row d is device d's block. The zeros come after the value's elements
    whether its blocks are whole rows or not (padding rows are appended rows)."""
    flat = jnp.ravel(value)
    pad = padding(tuple(value.shape), parts)
    if pad:
        flat = jnp.concatenate([flat, jnp.zeros((pad,), flat.dtype)])
    return flat.reshape(parts, -1)


def from_blocks(blocks: Any, size: int, shape: tuple[int, ...]) -> Any:
    """The value whose :func:`as_blocks` (its padding dropped) is ``blocks``, of any leading
    shape whose elements are the blocks in device order."""
    return blocks.reshape(-1)[:size].reshape(shape)


def views(
    layout: FlatLayout, leaves: Sequence[Any], positions: Sequence[int] | None = None
) -> list[Any]:
    """Each key's value (or those at ``positions``): a view (slice and reshape) of its bucket,
    or its own array. Inside ``shard_map``, a key in a split bucket whose leaf is this
    device's chunk gives its block there."""
    nb = len(layout.buckets)
    out = []
    for i in range(len(layout.where)) if positions is None else positions:
        b, start, size = layout.where[i]
        if b < 0:
            out.append(leaves[nb + start])
        elif layout.parts_of(b) > 1:
            parts, total = layout.parts_of(b), layout.buckets[b][1]
            out.append(split_view(leaves[b], start, size, layout.shapes[i], parts, total))
        else:
            view = jax.lax.slice_in_dim(leaves[b], start, start + size)
            out.append(view.reshape(layout.shapes[i]))
    return out


@functools.lru_cache(maxsize=256)
def in_buckets(layout: FlatLayout) -> tuple[int, ...]:
    """The positions of the keys that live in buckets (not as arrays of their own)."""
    return tuple(i for i, (b, _, _) in enumerate(layout.where) if b >= 0)


def eager_values(layout: FlatLayout, leaves: Sequence[Any]) -> list[Any]:
    """Each key's value, eagerly: the keys in buckets sliced out by one jitted computation
    (fresh arrays; a key of a split bucket placed as XLA places it, sharded or gathered), the
    keys kept on their own as the arrays they are (a jitted computation would copy them)."""
    nb = len(layout.buckets)
    positions = in_buckets(layout)
    if not positions:
        return [leaves[nb + j] for _, j, _ in layout.where]
    # One computation per set of buckets, whatever keys of their own lie between theirs.
    views = run("flat views", eager_views(bucket_layout(layout)), list(leaves[:nb]))
    if len(positions) == len(layout.where):  # (every key in a bucket: the views in key order)
        return list(views)
    out = [leaves[nb + j] if b < 0 else None for b, j, _ in layout.where]
    for i, x in zip(positions, views):
        out[i] = x
    return out


def eager_values_at(
    layout: FlatLayout, leaves: Sequence[Any], positions: Sequence[int]
) -> list[Any] | None:
    """The values of the keys at ``positions``, eagerly, as :func:`eager_values` gives them,
    made for those keys alone: a key kept on its own is its array, and the keys in buckets
    are sliced by one computation whose offsets are arguments (compiled once per buckets
    and shapes, whatever keys of those shapes are read), so a read of a few keys costs
    those keys, not every key of the buckets. ``None`` where one lies in a split bucket
    (:func:`eager_values` then makes them all)."""
    nb = len(layout.buckets)
    out: list[Any] = []
    sliced, offsets, shapes, where = [], [], [], []
    for n, i in enumerate(positions):
        b, start, _ = layout.where[i]
        if b < 0:
            out.append(leaves[nb + start])
            continue
        if layout.parts_of(b) > 1:
            return None
        out.append(None)
        sliced.append(n)
        offsets.append(start)
        shapes.append(layout.shapes[i])
        where.append(b)
    if sliced:
        fn = _views_at(tuple(where), tuple(shapes))
        made = run("flat views", fn, list(leaves[:nb]), np.asarray(offsets, np.int32))
        for n, x in zip(sliced, made):
            out[n] = x
    return out


@functools.lru_cache(maxsize=256)
def _views_at(where: tuple[int, ...], shapes: tuple[tuple[int, ...], ...]) -> Any:
    """The jitted views of :func:`eager_values_at`: key ``n`` is ``math.prod(shapes[n])``
    elements of bucket ``where[n]`` from ``offsets[n]`` on."""

    def views(leaves: list[jax.Array], offsets: jax.Array) -> list[jax.Array]:
        return [
            jax.lax.dynamic_slice_in_dim(leaves[b], offsets[n], math.prod(shape)).reshape(shape)
            for n, (b, shape) in enumerate(zip(where, shapes))
        ]

    return jax.jit(views)


@functools.lru_cache(maxsize=256)
def bucket_layout(layout: FlatLayout) -> FlatLayout:
    """``layout`` without its keys kept as arrays of their own: the keys in its buckets, in
    the same places (so that keys added on their own do not make their views anew)."""
    positions = in_buckets(layout)
    if len(positions) == len(layout.where):
        return layout
    return FlatLayout(
        layout.buckets,
        tuple(layout.where[i] for i in positions),
        tuple(layout.shapes[i] for i in positions),
        tuple(layout.dtypes[i] for i in positions),
        layout.parts,
    )


@functools.lru_cache(maxsize=256)
def eager_views(layout: FlatLayout, positions: tuple[int, ...] | None = None) -> Any:
    """:func:`views` as one jitted computation (eagerly, each view is a fresh array)."""
    return jax.jit(lambda leaves: views(layout, leaves, positions))


def put(tree: Any, shardings: Any) -> Any:
    """``jax.device_put(tree, shardings)``, except that an array over several processes'
    devices whose sharding is not a ``NamedSharding`` (a computation's result, on JAX 0.8) and
    not the one asked for is laid out by a jitted copy: JAX 0.8's ``device_put`` asserts a
    ``NamedSharding`` there (``_different_device_order_reshard``), where later versions take
    any sharding."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    wanted = jax.tree_util.tree_leaves(
        shardings, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding)
    )
    copied = {
        i: _laid_out(s)(x)
        for i, (x, s) in enumerate(zip(leaves, wanted))
        if isinstance(x, jax.Array)
        and not x.is_fully_addressable
        and not isinstance(x.sharding, jax.sharding.NamedSharding)
        and x.sharding != s
    }
    if not copied:
        return jax.device_put(tree, shardings)
    rest = [i for i in range(len(leaves)) if i not in copied]
    put_rest = jax.device_put([leaves[i] for i in rest], [wanted[i] for i in rest])
    copied.update(zip(rest, put_rest))
    return jax.tree_util.tree_unflatten(treedef, [copied[i] for i in range(len(leaves))])


@functools.lru_cache(maxsize=64)
def _laid_out(sharding: Any) -> Any:
    """A jitted copy of an array to ``sharding``."""
    return jax.jit(lambda x: x, out_shardings=sharding)


def run(what: str, fn: Any, *args: Any) -> Any:
    """``fn(*args)``, one of this module's eager computations: over several processes' devices
    it takes its turn among their collectives, as every computation there does
    (``processes/order.py``: XLA may add collectives to any of them)."""
    return order.ordered(what, fn, *args)


def pack(layout: FlatLayout, values: Sequence[Any]) -> list[Any]:
    """Fresh leaves holding ``values`` (one per key, in key order): a concatenation per
    bucket (of each key's ``(parts, block)`` view along axis 1 for a split bucket), then the
    keys kept on their own."""
    parts: list[list[Any]] = [[] for _ in layout.buckets]
    alone = []
    for (b, _, _), value, name in zip(layout.where, values, layout.dtypes):
        if b < 0:
            alone.append(value)
        elif layout.parts_of(b) > 1:
            parts[b].append(as_blocks(jnp.asarray(value).astype(name), layout.parts_of(b)))
        else:
            parts[b].append(jnp.ravel(value).astype(name))
    out = []
    for b, ((name, size), ps) in enumerate(zip(layout.buckets, parts)):
        if not ps:
            out.append(jnp.zeros((size,), name))
        elif layout.parts_of(b) > 1:
            out.append(jnp.concatenate(ps, axis=1).reshape(-1))
        else:
            out.append(jnp.concatenate(ps))
    return out + alone


@functools.lru_cache(maxsize=256)
def eager_pack(layout: FlatLayout) -> Any:
    """:func:`pack` as one jitted computation."""
    return jax.jit(lambda values: pack(layout, values))


@functools.lru_cache(maxsize=256)
def eager_write(layout: FlatLayout, positions: tuple[int, ...]) -> Any:
    """:func:`write` of the keys at ``positions`` as one jitted computation."""
    return jax.jit(lambda leaves, values: write(layout, leaves, dict(zip(positions, values))))


def write(layout: FlatLayout, leaves: Sequence[Any], values: Mapping[int, Any]) -> list[Any]:
    """``leaves`` with the keys at the positions in ``values`` (key position -> new value)
    written in place (``dynamic_update_slice``), each cast to its bucket's dtype; a key kept
    on its own is replaced. Inside ``shard_map``, a key of a split bucket whose leaf is this
    device's chunk is written as its block."""
    out = list(leaves)
    nb = len(layout.buckets)
    for i, value in sorted(values.items()):
        b, start, _ = layout.where[i]
        if b < 0:
            out[nb + start] = value
            continue
        parts = layout.parts_of(b)
        if parts > 1:
            out[b] = split_write(out[b], start, value, parts, layout.buckets[b][1])
            continue
        flat = jnp.ravel(value).astype(out[b].dtype)
        out[b] = jax.lax.dynamic_update_slice_in_dim(out[b], flat, start, axis=0)
    return out


# -- optimizer states ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Packing:
    """How one optimizer group's optax state is kept: its tree structure (``treedef``, over the
    leaves in ``jax.tree_util`` order), and which leaves are *families* (one leaf per key of
    the group, in the group's key order, each of its key's shape and of one dtype: Adam's ``mu``
    and ``nu``), packed into one bucket each; every other leaf (a step count) is kept as it is.
    ``families[f]`` is ``(first leaf index, dtype name)``. A family's bucket is laid out as its
    group's value bucket is: split over ``parts`` devices where that is.

    A family's leaves lie end to end in the tree (``stride`` 0: optax's state of a tree of keys,
    ``mu = {key: ...}``), or ``stride`` apart: a state kept per key (``mxnet/per_key.py``'s,
    each key's own state after the one before), whose families are each key's leaf at one
    place of its own state, and whose ``scalars`` are the same for a leaf of shape ``()`` on
    every key (each key's step count), packed into one ``(keys,)`` array each."""

    treedef: Any
    keys: tuple[Key, ...]
    shapes: tuple[tuple[int, ...], ...]
    families: tuple[tuple[int, str], ...]
    leaves: int
    parts: int = 1
    stride: int = 0
    scalars: tuple[tuple[int, str], ...] = ()

    def offsets(self) -> tuple[list[int], int]:
        """Each key's offset in a family's bucket (in a device's chunk, if split), and the
        bucket's size."""
        sizes = [math.prod(s) for s in self.shapes]
        if self.parts > 1:
            sizes = [block(tuple(s), self.parts) for s in self.shapes]
        starts = np.cumsum([0, *sizes]).tolist()
        return starts[:-1], starts[-1] * self.parts

    def members(self, first: int) -> range:
        """The leaf indices of the family (or scalars) whose first leaf is ``first``: one per
        key, in key order."""
        n = len(self.keys)
        if self.stride:
            return range(first, first + n * self.stride, self.stride)
        return range(first, first + n)

    def slots(self) -> tuple[tuple[str, int], ...]:
        """The packed leaves, in order: ``("leaf", i)`` for leaf ``i`` kept as it is,
        ``("family", first)`` for a family's bucket, ``("scalars", first)`` for a
        ``(keys,)`` array; each bucket where its first leaf is in the tree's order."""
        return _slots(self)

    def packed_positions(self) -> list[int]:
        """The positions of the family buckets (and per-key scalars) among the packed leaves."""
        return [j for j, (kind, _) in enumerate(self.slots()) if kind != "leaf"]


@functools.lru_cache(maxsize=256)
def _slots(packing: Packing) -> tuple[tuple[str, int], ...]:
    firsts = {i: "family" for i, _ in packing.families}
    firsts.update({i: "scalars" for i, _ in packing.scalars})
    taken = {m for i in firsts for m in packing.members(i)}
    out = []
    for i in range(packing.leaves):
        if i in firsts:
            out.append((firsts[i], i))
        elif i not in taken:
            out.append(("leaf", i))
    return tuple(out)


def opt_packing(
    keys: Sequence[Key], shapes: Sequence[tuple[int, ...]], opt_state: Any, parts: int = 1
) -> Packing:
    """How :func:`pack_opt` packs the optax state of the group ``keys`` (sorted, with their
    shapes): its families, read from the tree's paths, shapes and dtypes alone."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(opt_state)
    n = len(keys)
    families = []
    i = 0
    while i < len(flat):
        run = flat[i : i + n]
        if n and len(run) == n and _is_family(run, keys, shapes):
            families.append((i, np.dtype(run[0][1].dtype).name))
            i += n
        else:
            i += 1
    packing = Packing(
        treedef, tuple(keys), tuple(map(tuple, shapes)), tuple(families), len(flat), parts
    )
    if not families and parts == 1:
        return _per_key_packing(packing, flat) or packing
    return packing


def _per_key_packing(packing: Packing, flat: list) -> Packing | None:
    """``packing`` for a state kept per key (each key's own leaves after the one before, under
    its key's name: ``per_key``'s), with its families and scalars ``stride`` apart; ``None``
    where the state is not so, or has neither."""
    n, total = len(packing.keys), len(flat)
    if n < 2 or total % n:
        return None
    stride = total // n
    for j, key in enumerate(packing.keys):
        for path, _ in flat[j * stride : (j + 1) * stride]:
            first = path[0] if path else None
            if not isinstance(first, jax.tree_util.DictKey) or first.key != key:
                return None
    families, scalars = [], []
    for p in range(stride):
        leaves = [leaf for _, leaf in flat[p::stride]]
        dtypes = {np.dtype(getattr(x, "dtype", object)) for x in leaves}
        if len(dtypes) != 1 or not all(hasattr(x, "shape") for x in leaves):
            continue
        (dtype,) = dtypes
        if all(tuple(x.shape) == () for x in leaves):
            scalars.append((p, dtype.name))
        elif all(tuple(x.shape) == s for x, s in zip(leaves, packing.shapes)):
            families.append((p, dtype.name))
    if not families and not scalars:
        return None
    return dataclasses.replace(
        packing, families=tuple(families), stride=stride, scalars=tuple(scalars)
    )


def pack_opt_leaves(packing: Packing, opt_state: Any) -> list[Any]:
    """The leaves of ``opt_state`` packed as ``packing`` says: each family's leaves in one
    bucket (split over ``packing.parts`` devices as the group's value bucket is), each run of
    per-key scalars in one array."""
    flat = jax.tree_util.tree_leaves(opt_state)
    out: list[Any] = []
    for kind, i in packing.slots():
        if kind == "leaf":
            out.append(flat[i])
            continue
        run = [flat[m] for m in packing.members(i)]
        if kind == "scalars":
            out.append(jnp.stack(run))
        elif packing.parts > 1:
            grid = jnp.concatenate([as_blocks(x, packing.parts) for x in run], axis=1)
            out.append(grid.reshape(-1))
        else:
            out.append(jnp.concatenate([jnp.ravel(x) for x in run]))
    return out


def pack_opt(
    keys: Sequence[Key], shapes: Sequence[tuple[int, ...]], opt_state: Any, parts: int = 1
) -> tuple:
    """``(packing, leaves)``: the optax state of the group ``keys`` (sorted, with their shapes)
    with each family of per-key leaves packed into one bucket (split over ``parts``
    devices as the group's value bucket is)."""
    packing = opt_packing(keys, shapes, opt_state, parts)
    return packing, pack_opt_leaves(packing, opt_state)


@functools.lru_cache(maxsize=256)
def eager_pack_opt(packing: Packing) -> Any:
    """:func:`pack_opt_leaves` as one jitted computation."""
    return jax.jit(functools.partial(pack_opt_leaves, packing))


def _is_family(run: list, keys: Sequence[Key], shapes: Sequence[tuple[int, ...]]) -> bool:
    """Whether ``run`` (path, leaf pairs) is one leaf per key, in key order, at the same place
    of the tree but for the key, each of its key's shape, all of one dtype."""
    prefix = run[0][0][:-1]
    dtype = getattr(run[0][1], "dtype", None)
    for (path, leaf), key, shape in zip(run, keys, shapes):
        last = path[-1] if path else None
        if (
            path[:-1] != prefix
            or not isinstance(last, jax.tree_util.DictKey)
            or last.key != key
            or getattr(leaf, "shape", None) != tuple(shape)
            or getattr(leaf, "dtype", None) != dtype
        ):
            return False
    return True


def _unpacked(packing: Packing, leaves: Sequence[Any], one: Any) -> Any:
    """The optax state's tree from its packed ``leaves``: each family's bucket (or per-key
    scalars) gives one leaf per key, ``one(bucket, j, kind)`` for the j-th key of the group;
    other leaves are kept."""
    out: list[Any] = [None] * packing.leaves
    for (kind, i), leaf in zip(packing.slots(), leaves):
        if kind == "leaf":
            out[i] = leaf
            continue
        for j, m in enumerate(packing.members(i)):
            out[m] = one(leaf, j, kind)
    return jax.tree_util.tree_unflatten(packing.treedef, out)


def unpack_opt(packing: Packing, leaves: Sequence[Any]) -> Any:
    """The optax state packed by :func:`pack_opt`, each family's leaves views of its bucket."""
    offsets, total = packing.offsets()
    parts = packing.parts

    def one(bucket: Any, j: int, kind: str) -> Any:
        if kind == "scalars":
            return bucket[j]
        offset, shape = offsets[j], packing.shapes[j]
        size = math.prod(shape)
        if parts > 1:
            return split_view(bucket, offset, size, shape, parts, total)
        return jax.lax.slice_in_dim(bucket, offset, offset + size).reshape(shape)

    return _unpacked(packing, leaves, one)


def unpack_opt_like(packing: Packing, leaves: Sequence[Any]) -> Any:
    """The optax state's tree over leaves that are not arrays (``jaxkv.specs``'
    ``PartitionSpec``, ``jax.eval_shape``'s ``ShapeDtypeStruct``): each key of a family gets its
    bucket's (a ``ShapeDtypeStruct`` of the key's shape)."""

    def one(bucket: Any, j: int, kind: str) -> Any:
        if isinstance(bucket, jax.ShapeDtypeStruct):
            shape = () if kind == "scalars" else packing.shapes[j]
            return jax.ShapeDtypeStruct(shape, bucket.dtype)
        return bucket

    return _unpacked(packing, leaves, one)


@functools.lru_cache(maxsize=256)
def eager_unpack_opt(packing: Packing) -> Any:
    """:func:`unpack_opt` as one jitted computation."""
    return jax.jit(lambda leaves: unpack_opt(packing, leaves))


@functools.lru_cache(maxsize=256)
def eager_write_opt(packing: Packing) -> Any:
    """:func:`write_opt` as one jitted computation."""
    return jax.jit(lambda old, opt_state: write_opt(packing, old, opt_state))


def write_opt(packing: Packing, old: Sequence[Any], opt_state: Any) -> list[Any]:
    """The leaves of ``opt_state`` (of ``packing``'s structure) packed as :func:`pack_opt`
    packs them, each family written in place into its old bucket in ``old``."""
    flat = jax.tree_util.tree_leaves(opt_state)
    offsets, total = packing.offsets()
    parts = packing.parts
    out: list[Any] = []
    for (kind, i), previous in zip(packing.slots(), old):
        if kind == "leaf":
            out.append(flat[i])
            continue
        leaves = [flat[m] for m in packing.members(i)]
        if kind == "scalars":
            out.append(jnp.stack(leaves).astype(previous.dtype))
            continue
        bucket = previous
        for leaf, offset in zip(leaves, offsets):
            if parts > 1:
                bucket = split_write(bucket, offset, leaf, parts, total)
                continue
            flat_leaf = jnp.ravel(leaf).astype(bucket.dtype)
            bucket = jax.lax.dynamic_update_slice_in_dim(bucket, flat_leaf, offset, axis=0)
        out.append(bucket)
    return out


# -- a state's keys in its buckets ----------------------------------------------------------
def chunked(state: KVState, i: int) -> bool:
    """Whether key position ``i`` lives in a split bucket whose leaf here is only this
    device's chunk (inside ``shard_map`` with ``jaxkv.specs``): its value is then its
    block."""
    flat = state.flat_layout
    if flat is None:
        return False
    b = flat.where[i][0]
    return (
        b >= 0
        and flat.parts_of(b) > 1
        and tuple(np.shape(state.leaves[b])) != (flat.buckets[b][1],)
    )


def is_split(state: KVState, i: int) -> bool:
    """Whether the value of key position ``i`` is split across the devices rather than
    whole on each: a value the store shards, or a key of a split bucket (whose eager
    view XLA may place either way; a pull gathers it)."""
    if split_parts(state, i) > 1:
        return True
    return state.is_sharded(state.key_shapes[i])


def split_parts(state: KVState, i: int) -> int:
    """How many devices key position ``i``'s bucket is split over (1: not split)."""
    flat = state.flat_layout
    if flat is None or flat.where[i][0] < 0:
        return 1
    return flat.parts_of(flat.where[i][0])


def stored_types(state: KVState) -> tuple[Any, ...]:
    """Each key's stored value, or under a flat layout, for a key in a bucket, a
    ``jax.ShapeDtypeStruct`` of it: what a check of shapes and dtypes needs, with no
    computation."""
    if state.flat_layout is None:
        return state.leaves
    return tuple(stored_type(state, i) for i in range(len(state.keys())))


def stored_type(state: KVState, i: int) -> Any:
    """:func:`stored_types` of the key at position ``i`` alone."""
    flat = state.flat_layout
    if flat is None:
        return state.leaves[i]
    (b, j, _), shape, name = flat.where[i], flat.shapes[i], flat.dtypes[i]
    if b < 0:
        return state.leaves[len(flat.buckets) + j]
    if chunked(state, i):  # inside shard_map: its block of the split bucket
        return jax.ShapeDtypeStruct(block_shape(shape, flat.parts_of(b)), np.dtype(name))
    return jax.ShapeDtypeStruct(shape, np.dtype(name))


def leaf_specs(state: KVState, axis_name: Any) -> KVState:
    """This state with each leaf's ``PartitionSpec`` in its place (see ``jaxkv.specs``):
    sharded values and their optimizer-state leaves split along ``axis_name``; buckets,
    packed optimizer state and everything else replicated."""
    split = PartitionSpec(axis_name)

    def spec(x: Any) -> PartitionSpec:
        return split if state.is_sharded(tuple(x.shape)) else PartitionSpec()

    flat = state.flat_layout
    if flat is None and state.tp_specs:  # keys with their own sharding (tensor parallelism)
        return _keyed_specs(state, axis_name)
    if flat is None:
        leaves = [
            split if state.is_sharded(shape) else PartitionSpec() for shape in state.key_shapes
        ]
    else:
        leaves = [
            split if flat.parts_of(b) > 1 else PartitionSpec() for b in range(len(flat.buckets))
        ] + [spec(x) for x in state.leaves[len(flat.buckets) :]]
    opts: list[Any] = []
    for opt, packing in zip(state.group_states, state.packings):
        if packing is None:
            opts.append(jax.tree_util.tree_map(spec, opt))
        else:
            bucket = set(packing.packed_positions())
            family = split if packing.parts > 1 else PartitionSpec()
            opts.append(tuple(family if j in bucket else spec(x) for j, x in enumerate(opt)))
    residuals = [None if r is None else split for r in state.residual_leaves]
    return type(state).tree_unflatten(state.tree_flatten()[1], (leaves, opts, residuals))


def leaf_owner(
    path: Sequence[Any], shape: tuple[int, ...], shapes: Mapping[Key, tuple[int, ...]]
) -> Key | None:
    """The key of ``shapes`` that an optimizer-state leaf at ``path`` (a ``jax.tree_util`` key
    path) of ``shape`` belongs to: the nearest key on its path whose value has that shape (an
    optax state's ``{key: leaf}``, such as Adam's ``mu[key]``), else ``None``."""
    for entry in reversed(path):
        k = getattr(entry, "key", None)
        if isinstance(k, int | str) and k in shapes and tuple(shape) == shapes[k]:
            return k
    return None


def _keyed_specs(state: KVState, axis_name: Any) -> KVState:
    """:func:`leaf_specs` of a state of one array per key where some keys have their own
    sharding along other axes: each value's spec is its key's (``KVState.key_spec``), and so is
    that of each optimizer-state leaf of the key's shape below the key."""
    keys = state.keys()
    leaves = [state.key_spec(k, axis_name) for k in keys]
    specs = dict(zip(keys, leaves))
    shapes = dict(zip(keys, state.key_shapes))

    def one(path: Any, x: Any) -> PartitionSpec:
        k = leaf_owner(path, tuple(x.shape), shapes)
        if k is not None:
            return specs[k]
        return PartitionSpec(axis_name) if state.is_sharded(tuple(x.shape)) else PartitionSpec()

    opts = [jax.tree_util.tree_map_with_path(one, opt) for opt in state.group_states]
    residuals = [None for _ in state.residual_leaves]
    return type(state).tree_unflatten(state.tree_flatten()[1], (leaves, opts, residuals))


def with_leaves(state: KVState, leaves: dict[int, Any], opts: dict[int, Any]) -> KVState:
    """This state with some of its value leaves (by position) and optimizer-state entries
    (by group position; a packed group's entry is its tuple of packed leaves) replaced:
    the same key set, layout and packings."""
    replaced = list(state.leaves)
    for i, x in leaves.items():
        replaced[i] = x
    new_opts = list(state.group_states)
    for n, x in opts.items():
        new_opts[n] = x
    return type(state).tree_unflatten(
        state.tree_flatten()[1], (replaced, new_opts, state.residual_leaves)
    )


# -- a state's leaves laid out anew -------------------------------------------------------
def kept_leaves(
    state: KVState, keys: tuple[Key, ...], values: dict[Key, Any], flat: FlatLayout | None
) -> list[Any] | None:
    """The leaves of a state of ``keys`` in ``flat`` where ``flat`` has this state's
    buckets, each holding the same keys in the same places (only keys of their own added,
    removed or moved) and no key in a bucket gets a value: the buckets as they are, and
    each key of its own's array. ``None`` otherwise (:func:`new_leaves` makes them)."""
    old = state.flat_layout
    if flat is None or old is None or flat is old:
        return None
    if flat.buckets != old.buckets or flat.parts != old.parts:
        return None
    mine = {state.keys()[i]: old.where[i] for i in in_buckets(old)}
    theirs = in_buckets(flat)
    if len(theirs) != len(mine) or any(mine.get(keys[i]) != flat.where[i] for i in theirs):
        return None
    if any(k in mine for k in values):  # written into its bucket in place
        return None
    nb = len(old.buckets)
    index = state.key_positions
    own = []
    for k, (b, _, _) in zip(keys, flat.where):
        if b >= 0:
            continue
        if k in values:
            own.append(values[k])
        else:
            _, j, _ = old.where[index[k]]
            own.append(state.leaves[nb + j])
    return list(state.leaves[:nb]) + own


def new_leaves(
    state: KVState, keys: tuple[Key, ...], values: dict[Key, Any], flat: FlatLayout | None
) -> list[Any]:
    """The leaves of a state of ``keys`` in layout ``flat``, holding ``values`` (by key)
    and this state's values for the others."""
    if flat is None and state.flat_layout is None:
        held = dict(zip(state.keys(), state.leaves))
        return [values[k] if k in values else held[k] for k in keys]
    traced = jax_internals.any_tracer([*state.leaves, *values.values()])
    if flat is not None and flat is state.flat_layout:  # the same keys: write in place
        index = state.key_positions
        new = {index[k]: v for k, v in values.items()}
        if traced or not new:
            return write(flat, state.leaves, new)
        positions = tuple(sorted(new))
        writer = eager_write(flat, positions)
        return list(run("flat write", writer, state.leaves, [new[i] for i in positions]))
    blocks = [k for i, k in enumerate(state.keys()) if chunked(state, i)]
    if blocks:  # its values here are blocks: they cannot be laid out anew
        raise KVStoreError(
            f"keys {blocks[:4]}{' ...' if len(blocks) > 4 else ''}: expected whole values "
            "to lay out anew (new keys, or new optimizer groups, change a flat store's "
            "buckets), given this device's blocks of split buckets (inside shard_map); "
            "add keys and make optimizer state before the step"
        )
    old: dict[Key, Any] = {}
    if any(k not in values for k in keys):
        current = state.stored_values
        if flat is None and state.flat_layout is not None and not traced:
            # Fresh views: those cached with this state may be read from it later, and the
            # new state's pushes may donate its own leaves.
            current = tuple(eager_values(state.flat_layout, state.leaves))
        old = dict(zip(state.keys(), current))
    whole = [values[k] if k in values else old[k] for k in keys]
    if flat is None:
        return whole
    if traced:
        return pack(flat, whole)
    return list(run("flat pack", eager_pack(flat), whole))


def packed_group_state(
    group: tuple[Key, ...],
    shapes: list[tuple[int, ...]],
    opt: Any,
    old: KVState,
    n: int | None,
    parts: int,
) -> tuple[Packing, list[Any]]:
    """The optax state ``opt`` of ``group`` packed by family: written in place into the
    group's old buckets where it had them, with the same packing."""
    packing = None if n is None else old.packings[n]
    if (
        packing is not None
        and packing.parts == parts
        and packing.treedef == jax.tree_util.tree_structure(opt)
    ):
        leaves = old.group_states[n]  # type: ignore[index]
        if jax_internals.any_tracer([*leaves, *jax.tree_util.tree_leaves(opt)]):
            return packing, write_opt(packing, leaves, opt)
        writer = eager_write_opt(packing)
        return packing, list(run("flat optimizer write", writer, list(leaves), opt))
    if jax_internals.any_tracer(jax.tree_util.tree_leaves(opt)):
        return pack_opt(group, shapes, opt, parts)
    packing = opt_packing(group, shapes, opt, parts)
    return packing, list(run("flat optimizer pack", eager_pack_opt(packing), opt))
