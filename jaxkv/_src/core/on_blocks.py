"""Running an updater on this device's blocks of sharded values, inside ``shard_map``.

A leaf's block is where it is split across devices (:class:`Split`): along axis 0 over the
summed axes (a value the store shards), and for a key with its own sharding (tensor
parallelism) along its own dimensions over its own axes too (``P(None, "model")``: dimension 1
over ``"model"``). An updater that is elementwise along the split dimensions of the sharded
values (sgd, momentum, adam, ...) gives on a device's block exactly the block of what it gives
on the whole value, so it runs on the block as it is. An updater whose only steps across the
split dimensions are sums, maxima or minima (``clip_by_global_norm``, LAMB's trust ratio, a
custom norm) runs on the blocks too, with each such reduction completed across devices
(``psum`` / ``pmax`` / ``pmin`` of the partial results over exactly the axes of the dimensions
it reduces): its jaxpr is evaluated equation by equation. Anything else is run on the gathered
whole values (each leaf all-gathered along each split dimension over that dimension's axes),
each device keeping its block of the result. Which case applies is read from the updater's
jaxpr, once per trace, and nothing that depends on a block's shape (``x / x.size``) runs on
blocks; nor does an updater that cannot be traced on a block (it writes the whole value's shape
into itself, as ``jnp.arange(64)[:, None] < 32`` does).

The updater runs under ``jax.named_scope(UPDATER)`` (``jaxkv.updater``), so the HLO's op names
and a profiler trace show it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex

from jaxkv._src.core.collectives import axis_arg, axis_size
from jaxkv._src.jax_internals import (
    CAN_MARK_VARYING,
    all_gather_invariant,
    to_varying,
    varying_axes,
)

__all__ = ["UPDATER", "Split", "run_on_blocks"]

logger = logging.getLogger("jaxkv")

# The named scope of an updater's run (``jax.named_scope``).
UPDATER = "jaxkv.updater"

# Primitives whose output element i depends only on the input elements i (scalars broadcast).
ELEMENTWISE = frozenset(
    """abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp complex conj
    convert_element_type copy copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1
    floor ge gt imag integer_pow is_finite le lgamma log log1p logistic lt max min mul ne neg
    nextafter not or pow real reduce_precision rem round rsqrt select_n sign sin sinh sqrt square
    stop_gradient sub tan tanh xor shift_left shift_right_logical shift_right_arithmetic
    bitcast_convert_type""".split()  # noqa: SIM905
)
# (bitcast_convert_type is elementwise only between types of one width: between others JAX
# adds or drops a trailing axis, which changes the shape, and the checks refuse that.)
# Reductions, and the collective that completes each across the devices a block is split over.
_REDUCTIONS = {"reduce_sum": "psum", "reduce_max": "pmax", "reduce_min": "pmin"}


@dataclasses.dataclass(frozen=True)
class Split:
    """Where a leaf is split across devices, seen from one device: for each split dimension,
    the mapped axes along it, the major one first (``((0, ("data",)), (1, ("model",)))`` for a
    ``P("data", "model")`` leaf); ``()`` for a value that is the same on every device. A pytree
    leaf, so that a tree of them marks the leaves of another tree."""

    dims: tuple[tuple[int, tuple[str, ...]], ...] = ()

    @staticmethod
    def rows(names: tuple) -> Split:
        """A block of rows (axis 0) over the axes ``names``."""
        return Split(((0, tuple(names)),))

    def __bool__(self) -> bool:
        return bool(self.dims)


def as_split(mark: Any, names: tuple) -> Split:
    """A leaf's mark as a :class:`Split`: ``True`` (a block of rows over ``names``), ``False``
    or ``None`` (the same on every device), or a :class:`Split` as it is."""
    if isinstance(mark, Split):
        return mark
    return Split.rows(names) if mark else Split()


# What a value is, seen from one device: a block of a whole value split as its ``Split`` says
# (``("block", dims)``); a value the same on every device and constant along some of the
# dimensions blocks are split along (a broadcast: valid as any device's block split along
# them, ``("alike", dims)``); or any other value, the same on every device.
_WHOLE = "whole"
Kind = Any  # _WHOLE, ("block", ((dim, axes), ...)) or ("alike", frozenset of dims)


def _block(dims: Sequence[tuple[int, tuple[str, ...]]]) -> Kind:
    return ("block", tuple(dims)) if dims else _WHOLE


def _alike(dims: Any) -> Kind:
    return ("alike", frozenset(dims)) if dims else _WHOLE


def _is_block(kind: Kind) -> bool:
    return isinstance(kind, tuple) and kind[0] == "block"


def _is_alike(kind: Kind) -> bool:
    return isinstance(kind, tuple) and kind[0] == "alike"


def _split_dims(kind: Kind) -> frozenset:
    """The dimensions a block is split along, or along which a broadcast is constant."""
    if _is_block(kind):
        return frozenset(d for d, _ in kind[1])
    return kind[1] if _is_alike(kind) else frozenset()


# The kinds of a block of rows along axis 0 over the axes ``names`` (the store's split), and of
# a broadcast constant along its rows.
def _rows(names: tuple) -> Kind:
    return _block([(0, tuple(names))])


_ROWS_ALIKE = _alike({0})


def _kind_of(split: Split) -> Kind:
    return _block(split.dims)


def _broadcast_kind(
    kind: Kind, operand_shape: tuple, params: dict, watch: frozenset = frozenset({0})
) -> Kind | None:
    """The kind of ``broadcast_in_dim``'s result; ``watch``: the dimensions blocks are split
    along here (a broadcast's constant dimensions are tracked among those only)."""
    dims = tuple(params["broadcast_dimensions"])
    shape = tuple(params["shape"])
    if _is_block(kind):
        # Kept as a block only if each split dimension stays where it is, of its size.
        for d, _ in kind[1]:
            if d >= len(dims) or dims[d] != d or shape[d] != operand_shape[d]:
                return None
        return kind
    constant = set(range(len(shape))) - set(dims)
    given = _split_dims(kind)
    constant |= {dims[i] for i, size in enumerate(operand_shape) if size == 1 or i in given}
    return _alike(constant & watch)


def _called(params: dict) -> list[tuple[Any, list]]:
    """The jaxprs in an equation's parameters, each with its constants."""
    out = []
    for value in params.values():
        for item in value if isinstance(value, tuple | list) else [value]:
            if isinstance(item, jex.ClosedJaxpr):
                out.append((item.jaxpr, list(item.consts)))
            elif isinstance(item, jex.Jaxpr):
                out.append((item, []))
    return out


def sub_jaxpr(eqn: Any) -> tuple[Any, list] | None:
    """The one jaxpr an equation calls with its own inputs and outputs (``jit``, custom
    derivatives), with its constants, or ``None``."""
    found = [
        (j, c)
        for j, c in _called(eqn.params)
        if len(j.invars) == len(eqn.invars) and len(j.outvars) == len(eqn.outvars)
    ]
    return found[0] if len(found) == 1 else None


def keeps_shape(eqn: Any) -> bool:
    """Whether an elementwise equation keeps its operand's shape (a ``bitcast_convert_type``
    between types of different widths does not)."""
    if eqn.primitive.name != "bitcast_convert_type":
        return True
    return tuple(eqn.outvars[0].aval.shape) == tuple(eqn.invars[0].aval.shape)


def _axes_of(pairs: Sequence[tuple[int, tuple[str, ...]]]) -> tuple[str, ...]:
    """The axes of the split dimensions ``pairs``, each once, in order."""
    out: list[str] = []
    for _, axes in pairs:
        out.extend(a for a in axes if a not in out)
    return tuple(out)


def _renumbered(
    pairs: Sequence[tuple[int, tuple[str, ...]]], dropped: Any
) -> list[tuple[int, tuple[str, ...]]]:
    """The split dimensions ``pairs`` once the dimensions ``dropped`` are gone."""
    return [(d - sum(1 for q in dropped if q < d), a) for d, a in pairs if d not in dropped]


def _elementwise(kinds: list[Kind], shapes: list[tuple], n_out: int) -> list[Kind] | None:
    sized = [k for k, s in zip(kinds, shapes) if s]  # scalars broadcast to any block
    blocks = {k for k in sized if _is_block(k)}
    if len(blocks) > 1:
        return None  # blocks of differently split values
    if blocks:
        (kind,) = blocks
        need = _split_dims(kind)
        for k in sized:
            if not _is_block(k) and not (_is_alike(k) and need <= k[1]):
                return None  # a whole value of a block's shape, or one differing along a split
        return [kind] * n_out
    if sized and all(_is_alike(k) for k in sized):
        return [_alike(frozenset.intersection(*(k[1] for k in sized)))] * n_out
    return [_WHOLE] * n_out


def _rule(
    eqn: Any, kinds: list[Kind], reduce: bool, watch: frozenset = frozenset({0})
) -> tuple[list[Kind], Any] | None:
    """The kinds of ``eqn``'s outputs and what to do beyond binding it (``'inline'`` its
    jaxpr, or ``(collective, axes)``: the collective that completes a reduction across the
    devices of ``axes``), or ``None`` if it mixes the elements of a block with others along a
    split dimension. Reductions across a split dimension are allowed only with ``reduce``."""
    name = eqn.primitive.name
    shapes = [tuple(getattr(v.aval, "shape", ())) for v in eqn.invars]
    n_out = len(eqn.outvars)
    if name == "broadcast_in_dim":
        kind = _broadcast_kind(kinds[0], shapes[0], eqn.params, watch)
        return None if kind is None else ([kind], None)
    if name in ELEMENTWISE:
        if not keeps_shape(eqn):
            return None  # a bitcast between types of different widths reshapes
        out = _elementwise(kinds, shapes, n_out)
        return None if out is None else (out, None)
    if not any(_is_block(k) or _is_alike(k) for k in kinds):
        return [_WHOLE] * n_out, None
    # A broadcast counts as a block here: reducing it would count this device's rows only.
    kind = kinds[0]
    split = _split_dims(kind)
    if name == "reshape" and eqn.params.get("dimensions") is None:
        new = tuple(eqn.params["new_sizes"])
        same = all(new[: d + 1] == shapes[0][: d + 1] for d in split)
        return ([kind], None) if same and (_is_block(kind) or _is_alike(kind)) else None
    if name == "squeeze":
        dropped = set(eqn.params["dimensions"])
        if split & dropped or not (_is_block(kind) or _is_alike(kind)):
            return None
        if _is_block(kind):
            return [_block(_renumbered(kind[1], dropped))], None
        return [_alike(d - sum(1 for q in dropped if q < d) for d in split)], None
    if name in _REDUCTIONS and _is_block(kind):
        axes = set(eqn.params["axes"])
        kept = _block(_renumbered(kind[1], axes))
        reduced = [(d, a) for d, a in kind[1] if d in axes]
        if not reduced:
            return [kept], None  # a reduction within each block's split slices
        return ([kept], (_REDUCTIONS[name], _axes_of(reduced))) if reduce else None
    if name == "dot_general" and reduce and all(map(_is_block, kinds)):
        return _contraction(eqn, kinds)
    sub = sub_jaxpr(eqn)
    if sub is None:
        return None
    out = _kinds(sub[0], kinds, reduce, watch)
    return None if out is None else (out, "inline")


def _contraction(eqn: Any, kinds: list[Kind]) -> tuple[list[Kind], Any] | None:
    """A ``dot_general`` of two blocks that contracts every split dimension of each with the
    other's dimension split alike: a sum of products, completed by ``psum``; else ``None``."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    left, right = dict(kinds[0][1]), dict(kinds[1][1])
    for mine, theirs, my_c, their_c in ((left, right, lc, rc), (right, left, rc, lc)):
        for d, axes in mine.items():
            if d not in my_c or theirs.get(their_c[list(my_c).index(d)]) != axes:
                return None
    if set(left) & set(lb) or set(right) & set(rb):
        return None
    return [_WHOLE], ("psum", _axes_of(kinds[0][1]))


def _watched(kinds: Sequence[Kind]) -> frozenset:
    """The dimensions the blocks among ``kinds`` are split along (axis 0 where none is)."""
    dims = frozenset().union(*(_split_dims(k) for k in kinds if _is_block(k)))
    return dims or frozenset({0})


def _kinds(
    jaxpr: Any, kinds: Sequence[Kind], reduce: bool, watch: frozenset | None = None
) -> list[Kind] | None:
    """The kind of each output of ``jaxpr`` given its inputs' kinds, or ``None`` if some
    equation mixes the elements of a block along a split dimension."""
    watch = _watched(kinds) if watch is None else watch
    env: dict[Any, Kind] = {v: _WHOLE for v in jaxpr.constvars}
    env.update(zip(jaxpr.invars, kinds))

    def read(v: Any) -> Kind:
        return _WHOLE if isinstance(v, jex.Literal) else env[v]

    for eqn in jaxpr.eqns:
        rule = _rule(eqn, [read(v) for v in eqn.invars], reduce, watch)
        if rule is None:
            return None
        env.update(zip(eqn.outvars, rule[0]))
    return [read(v) for v in jaxpr.outvars]


def _constants(jaxpr: Any, consts: Sequence[Any] = ()) -> list:
    """Every primitive and constant of ``jaxpr`` (and the jaxprs it calls), in order."""
    out: list = [("const", np.asarray(c).tolist()) for c in consts]
    for eqn in jaxpr.eqns:
        out.append(eqn.primitive.name)
        out.extend(("literal", v.val) for v in eqn.invars if isinstance(v, jex.Literal))
        for sub, sub_consts in _called(eqn.params):
            out.extend(_constants(sub, sub_consts))
    return out


def _grown(shape: tuple, split: Split) -> tuple:
    """``shape`` with each dimension ``split`` splits doubled."""
    out = list(shape)
    for d, _ in split.dims:
        out[d] *= 2
    return tuple(out)


def _trace(fn: Callable, args: Any) -> tuple[Any, Any] | None:
    """``fn``'s closed jaxpr and output shapes on arguments of the shapes of ``args``, or
    ``None`` if tracing it there raises."""
    try:
        return jax.make_jaxpr(fn, return_shape=True)(*args)
    except Exception as e:
        # An updater that fixes the whole value's shape (``jnp.arange(64)[:, None] < 32``, 64
        # rows sliced out of the value) raises on a block: a shape error from jnp or lax, an
        # IndexError, an assertion, jaxkv's ShapeError on its result. It then runs on the
        # gathered whole value, where an error that is not about the block's shape is raised
        # again.
        logger.debug(
            "jaxkv: the updater cannot run on blocks (%s: %s); gathering", type(e).__name__, e
        )
        return None


def _fits(kind: Kind, want: Split) -> bool:
    """Whether an output of ``kind`` may be given where ``want`` marks its leaf: a block split
    just so (or a broadcast constant along those dimensions), or else no block."""
    if not want:
        return not _is_block(kind)
    return kind == _kind_of(want) or (_is_alike(kind) and _split_dims(_kind_of(want)) <= kind[1])


def _on_blocks(
    fn: Callable, args: Any, flags: list[Split], want: list[Split], out_def: Any, reduce: bool
) -> Any:
    """``fn``'s closed jaxpr and output tree if it may run on blocks (see the module doc):
    ``fn`` traces on the blocks, every output ``want`` marks is a block split as it says,
    every other output a whole value, and ``fn`` traced with each split dimension doubled has
    the same primitives and constants, and outputs grown exactly where ``want`` marks; else
    ``None``."""
    shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    traced = _trace(fn, shapes)
    if traced is None:
        return None
    closed, out_shape = traced
    kinds = _kinds(closed.jaxpr, [_kind_of(f) for f in flags], reduce)
    out_tree = jax.tree_util.tree_structure(out_shape)
    if kinds is None:
        return None
    if out_tree != out_def:
        return None
    if not all(_fits(k, w) for k, w in zip(kinds, want)):
        return None
    leaves, treedef = jax.tree_util.tree_flatten(shapes)
    bigger = [
        jax.ShapeDtypeStruct(_grown(x.shape, f), x.dtype) if f else x for x, f in zip(leaves, flags)
    ]
    traced = _trace(fn, jax.tree_util.tree_unflatten(treedef, bigger))
    if traced is None:
        return None
    twice, twice_shape = traced
    if _constants(closed.jaxpr, closed.consts) != _constants(twice.jaxpr, twice.consts):
        return None
    for x, y, w in zip(
        jax.tree_util.tree_leaves(out_shape), jax.tree_util.tree_leaves(twice_shape), want
    ):
        if tuple(y.shape) != _grown(tuple(x.shape), w):
            return None  # a result of a shape the updater fixes, not the block's
    return closed, out_tree


def _marks(tree: Any, names: tuple) -> tuple[list[Split], Any]:
    """The leaves of a tree of marks (``bool`` or :class:`Split`) as splits, and its
    structure."""
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=lambda x: x is None)
    return [as_split(m, names) for m in leaves], treedef


def is_blockwise(fn: Callable, args: Any, blocks: Any, out_blocks: Any, names: tuple = ()) -> bool:
    """Whether ``fn(*args)`` may run as it is on the blocks ``blocks`` marks in ``args``
    (each mark ``True`` for a block of rows over ``names``, or a :class:`Split`)."""
    flags, _ = _marks(blocks, names)
    want, out_def = _marks(out_blocks, names)
    return _on_blocks(fn, args, flags, want, out_def, reduce=False) is not None


def _bind(eqn: Any, values: list) -> list:
    """Bind ``eqn``'s primitive to ``values``, first marking invariant inputs as varying
    where others vary (what ``jax.lax`` does for its own functions under ``shard_map``)."""
    every = frozenset().union(*(varying_axes(v) for v in values))
    if every:
        values = [
            to_varying(v, tuple(sorted(every - varying_axes(v)))) if every - varying_axes(v) else v
            for v in values
        ]
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns: Sequence = ()
    if isinstance(params, tuple):  # older JAX: (subfuns, params)
        subfuns, params = params
    out = eqn.primitive.bind(*subfuns, *values, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _evaluate(
    jaxpr: Any, consts: Sequence, args: Sequence, kinds: Sequence, watch: frozenset
) -> tuple[list[Any], list[Kind]]:
    """Evaluate ``jaxpr`` on blocks, completing each reduction across a split dimension with
    its collective over that dimension's axes; returns the outputs and their kinds."""
    env: dict[Any, tuple[Any, Kind]] = {v: (c, _WHOLE) for v, c in zip(jaxpr.constvars, consts)}
    env.update(zip(jaxpr.invars, zip(args, kinds)))

    def read(v: Any) -> tuple[Any, Kind]:
        return (v.val, _WHOLE) if isinstance(v, jex.Literal) else env[v]

    for eqn in jaxpr.eqns:
        values, in_kinds = zip(*map(read, eqn.invars)) if eqn.invars else ((), ())
        rule = _rule(eqn, list(in_kinds), True, watch)
        assert rule is not None  # checked by _on_blocks
        out_kinds, action = rule
        if action == "inline":
            called = sub_jaxpr(eqn)
            assert called is not None  # _rule inlines only an equation that calls one jaxpr
            sub, sub_consts = called
            outs, out_kinds = _evaluate(sub, sub_consts, values, in_kinds, watch)
        else:
            outs = _bind(eqn, list(values))
            if action is not None:
                collective, axes = action
                outs = [getattr(jax.lax, collective)(outs[0], axis_arg(axes))]
        env.update(zip(eqn.outvars, zip(outs, out_kinds)))
    results = [read(v) for v in jaxpr.outvars]
    return [r[0] for r in results], [r[1] for r in results]


def run_on_blocks(fn: Callable, args: Any, blocks: Any, out_blocks: Any, names: tuple) -> Any:
    """``fn(*args)`` where the leaves ``blocks`` marks are this device's blocks of split
    values (a mark ``True``: rows along axis 0 over the mapped axes ``names``; a
    :class:`Split`: as it says): the outputs ``out_blocks`` marks are this device's blocks of
    what ``fn`` gives on the whole values, the others whole.

    Runs ``fn`` on the blocks when it is elementwise along their split dimensions, or
    evaluates its jaxpr on them when its only steps across those are reductions (completed by
    collectives over the reduced dimensions' axes); otherwise gathers the blocks, runs ``fn``
    on the whole values, and keeps this device's block of each output.
    """
    with jax.named_scope(UPDATER):
        return _run_on_blocks(fn, args, blocks, out_blocks, names)


def _run_on_blocks(fn: Callable, args: Any, blocks: Any, out_blocks: Any, names: tuple) -> Any:
    flags, _ = _marks(blocks, names)
    want, out_def = _marks(out_blocks, names)
    if not any(flags) or _on_blocks(fn, args, flags, want, out_def, reduce=False) is not None:
        return fn(*args)
    leaves, treedef = jax.tree_util.tree_flatten(args)
    found = _on_blocks(fn, args, flags, want, out_def, reduce=True)
    if found is not None and CAN_MARK_VARYING:
        closed, out_tree = found
        kinds = [_kind_of(f) for f in flags]
        outs, _ = _evaluate(closed.jaxpr, closed.consts, leaves, kinds, _watched(kinds))
        return jax.tree_util.tree_unflatten(out_tree, outs)
    # The same whole value on every device, typed so where JAX tracks varying axes.
    whole = [_gathered(x, f) for x, f in zip(leaves, flags)]
    out = fn(*jax.tree_util.tree_unflatten(treedef, whole))
    out_leaves, out_tree = jax.tree_util.tree_flatten(out)
    kept = [_mine(x, w) for x, w in zip(out_leaves, want)]
    return jax.tree_util.tree_unflatten(out_tree, kept)


def _gathered(x: Any, split: Split) -> Any:
    """The whole value of the block ``x``: all-gathered along each split dimension over its
    axes."""
    for d, axes in split.dims:
        x = all_gather_invariant(x, axis_arg(axes), axis=d, tiled=True)
    return x


def _mine(x: Any, split: Split) -> Any:
    """This device's block of the whole value ``x`` split as ``split`` says."""
    for d, axes in split.dims:
        size = x.shape[d] // axis_size(axes)
        me = jax.lax.axis_index(axis_arg(axes))
        x = jax.lax.dynamic_slice_in_dim(x, me * size, size, d)
    return x
