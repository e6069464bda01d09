"""Running an updater on this device's blocks of sharded values, inside ``shard_map``.

An updater that is elementwise along axis 0 of the sharded values (sgd, momentum, adam, ...)
gives on a device's block exactly the block of what it gives on the whole value, so it runs on
the block as it is. An updater whose only cross-row steps are sums, maxima or minima over the
rows (``clip_by_global_norm``, LAMB's trust ratio, a custom norm) runs on the blocks too, with
each such reduction completed across devices (``psum`` / ``pmax`` / ``pmin`` of the partial
results): its jaxpr is evaluated equation by equation. Anything else is run on the gathered
whole values, each device keeping its block of the result. Which case applies is read from the
updater's jaxpr, once per trace, and nothing that depends on a block's number of rows (``x /
x.size``) runs on blocks; nor does an updater that cannot be traced on a block (it writes the
whole value's shape into itself, as ``jnp.arange(64)[:, None] < 32`` does).

The updater runs under ``jax.named_scope(UPDATER)`` (``jaxkv.updater``), so the HLO's op names
and a profiler trace show it.
"""

from __future__ import annotations

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

__all__ = ["UPDATER", "run_on_blocks"]

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
# Reductions over the rows, and the collective that completes them across devices.
_REDUCTIONS = {"reduce_sum": "psum", "reduce_max": "pmax", "reduce_min": "pmin"}

# What a value is, seen from one device: the block (rows along axis 0) of a sharded whole
# value; a value that is the same in every row (a broadcast: valid as any device's block); or
# any other value, the same on every device.
_BLOCK, _ROWS_ALIKE, _WHOLE = "block", "rows-alike", "whole"


def _broadcast_kind(kind: str, operand_shape: tuple, params: dict) -> str | None:
    dims = tuple(params["broadcast_dimensions"])
    if kind == _BLOCK:
        # Kept as a block only if its rows stay the rows of the result.
        ok = dims and dims[0] == 0 and params["shape"][0] == operand_shape[0]
        return _BLOCK if ok else None
    if not operand_shape or 0 not in dims or operand_shape[dims.index(0)] == 1:
        return _ROWS_ALIKE
    return _ROWS_ALIKE if kind == _ROWS_ALIKE and dims.index(0) == 0 else _WHOLE


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


def _rule(eqn: Any, kinds: list[str], reduce: bool) -> tuple[list[str], str | None] | None:
    """The kinds of ``eqn``'s outputs and what to do beyond binding it (``'inline'`` its
    jaxpr, or the collective that completes a reduction over the rows), or ``None`` if it
    mixes rows. Reductions over the rows are allowed only with ``reduce``."""
    name = eqn.primitive.name
    shapes = [tuple(getattr(v.aval, "shape", ())) for v in eqn.invars]
    n_out = len(eqn.outvars)
    if name == "broadcast_in_dim":
        kind = _broadcast_kind(kinds[0], shapes[0], eqn.params)
        return None if kind is None else ([kind], None)
    if name in ELEMENTWISE:
        if not keeps_shape(eqn):
            return None  # a bitcast between types of different widths reshapes
        sized = [k for k, s in zip(kinds, shapes) if s]  # scalars broadcast to any block
        if _BLOCK in kinds:
            return None if _WHOLE in sized else ([_BLOCK] * n_out, None)
        alike = sized and all(k == _ROWS_ALIKE for k in sized)
        return [_ROWS_ALIKE if alike else _WHOLE] * n_out, None
    if _BLOCK not in kinds and _ROWS_ALIKE not in kinds:
        return [_WHOLE] * n_out, None
    # A row-broadcast counts as a block here: reducing it would count this device's rows only.
    kind = _BLOCK if _BLOCK in kinds else _ROWS_ALIKE
    if name == "reshape" and eqn.params.get("dimensions") is None:
        same_rows = tuple(eqn.params["new_sizes"][:1]) == shapes[0][:1]
        return ([kind], None) if same_rows else None
    if name == "squeeze" and 0 not in eqn.params["dimensions"]:
        return [kind], None
    if name in _REDUCTIONS and kinds[0] == _BLOCK:
        if 0 not in eqn.params["axes"]:
            return [_BLOCK], None  # a reduction within each row
        return ([_WHOLE], _REDUCTIONS[name]) if reduce else None
    if name == "dot_general" and reduce and kinds == [_BLOCK, _BLOCK]:
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        if 0 in lc and 0 in rc and lc.index(0) == rc.index(0) and 0 not in lb + rb:
            return [_WHOLE], "psum"  # contracts the rows: a sum of products over them
        return None
    sub = sub_jaxpr(eqn)
    if sub is None:
        return None
    out = _kinds(sub[0], kinds, reduce)
    return None if out is None else (out, "inline")


def _kinds(jaxpr: Any, kinds: Sequence[str], reduce: bool) -> list[str] | None:
    """The kind of each output of ``jaxpr`` given its inputs' kinds, or ``None`` if some
    equation mixes the rows of a block."""
    env: dict[Any, str] = {v: _WHOLE for v in jaxpr.constvars}
    env.update(zip(jaxpr.invars, kinds))

    def read(v: Any) -> str:
        return _WHOLE if isinstance(v, jex.Literal) else env[v]

    for eqn in jaxpr.eqns:
        rule = _rule(eqn, [read(v) for v in eqn.invars], reduce)
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


def _more_rows(x: Any) -> Any:
    return jax.ShapeDtypeStruct((2 * x.shape[0], *x.shape[1:]), x.dtype)


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


def _on_blocks(fn: Callable, args: Any, blocks: Any, out_blocks: Any, reduce: bool) -> Any:
    """``fn``'s closed jaxpr and output tree if it may run on blocks (see the module doc):
    ``fn`` traces on the blocks, every output ``out_blocks`` marks is a block, every other
    output a whole value, and ``fn`` traced with twice the rows has the same primitives and
    constants, and outputs whose rows doubled exactly where ``out_blocks`` marks; else
    ``None``."""
    shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    traced = _trace(fn, shapes)
    if traced is None:
        return None
    closed, out_shape = traced
    flags = jax.tree_util.tree_leaves(blocks)
    kinds = _kinds(closed.jaxpr, [_BLOCK if b else _WHOLE for b in flags], reduce)
    out_tree = jax.tree_util.tree_structure(out_shape)
    if kinds is None:
        return None
    # jaxlib ships no stub for PyTreeDef, so mypy cannot type the comparison.
    if out_tree != jax.tree_util.tree_structure(out_blocks):  # type: ignore[operator]
        return None
    want = jax.tree_util.tree_leaves(out_blocks)
    if not all((k != _WHOLE) if b else (k != _BLOCK) for k, b in zip(kinds, want)):
        return None
    leaves, treedef = jax.tree_util.tree_flatten(shapes)
    bigger = [_more_rows(x) if b else x for x, b in zip(leaves, flags)]
    traced = _trace(fn, jax.tree_util.tree_unflatten(treedef, bigger))
    if traced is None:
        return None
    twice, twice_shape = traced
    if _constants(closed.jaxpr, closed.consts) != _constants(twice.jaxpr, twice.consts):
        return None
    for x, y, b in zip(
        jax.tree_util.tree_leaves(out_shape), jax.tree_util.tree_leaves(twice_shape), want
    ):
        grown = (2 * x.shape[0], *x.shape[1:]) if b and x.shape else None
        if tuple(y.shape) != (grown if b else tuple(x.shape)):
            return None  # a result of a shape the updater fixes, not the block's
    return closed, out_tree


def is_blockwise(fn: Callable, args: Any, blocks: Any, out_blocks: Any) -> bool:
    """Whether ``fn(*args)`` may run as it is on the blocks ``blocks`` marks in ``args``."""
    return _on_blocks(fn, args, blocks, out_blocks, reduce=False) is not None


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
    jaxpr: Any, consts: Sequence, args: Sequence, kinds: Sequence, names: Any
) -> tuple[list[Any], list[str]]:
    """Evaluate ``jaxpr`` on blocks, completing each reduction over the rows with its
    collective over ``names``; returns the outputs and their kinds."""
    env: dict[Any, tuple[Any, str]] = {v: (c, _WHOLE) for v, c in zip(jaxpr.constvars, consts)}
    env.update(zip(jaxpr.invars, zip(args, kinds)))

    def read(v: Any) -> tuple[Any, str]:
        return (v.val, _WHOLE) if isinstance(v, jex.Literal) else env[v]

    for eqn in jaxpr.eqns:
        values, in_kinds = zip(*map(read, eqn.invars)) if eqn.invars else ((), ())
        rule = _rule(eqn, list(in_kinds), reduce=True)
        assert rule is not None  # checked by _on_blocks
        out_kinds, action = rule
        if action == "inline":
            called = sub_jaxpr(eqn)
            assert called is not None  # _rule inlines only an equation that calls one jaxpr
            sub, sub_consts = called
            outs, out_kinds = _evaluate(sub, sub_consts, values, in_kinds, names)
        else:
            outs = _bind(eqn, list(values))
            if action is not None:
                outs = [getattr(jax.lax, action)(outs[0], names)]
        env.update(zip(eqn.outvars, zip(outs, out_kinds)))
    results = [read(v) for v in jaxpr.outvars]
    return [r[0] for r in results], [r[1] for r in results]


def run_on_blocks(fn: Callable, args: Any, blocks: Any, out_blocks: Any, names: tuple) -> Any:
    """``fn(*args)`` where the leaves ``blocks`` marks are this device's blocks (axis 0) of
    values sharded over the mapped axes ``names``: the outputs ``out_blocks`` marks are this
    device's blocks of what ``fn`` gives on the whole values, the others whole.

    Runs ``fn`` on the blocks when it is elementwise along them, or evaluates its jaxpr on
    them when its only cross-row steps are reductions (completed by collectives); otherwise
    gathers the blocks, runs ``fn`` on the whole values, and keeps this device's block of each
    output.
    """
    with jax.named_scope(UPDATER):
        return _run_on_blocks(fn, args, blocks, out_blocks, names)


def _run_on_blocks(fn: Callable, args: Any, blocks: Any, out_blocks: Any, names: tuple) -> Any:
    flags = jax.tree_util.tree_leaves(blocks)
    if not any(flags) or is_blockwise(fn, args, blocks, out_blocks):
        return fn(*args)
    leaves, treedef = jax.tree_util.tree_flatten(args)
    found = _on_blocks(fn, args, blocks, out_blocks, reduce=True)
    axes = axis_arg(names)
    if found is not None and CAN_MARK_VARYING:
        closed, out_tree = found
        kinds = [_BLOCK if b else _WHOLE for b in flags]
        outs, _ = _evaluate(closed.jaxpr, closed.consts, leaves, kinds, axes)
        return jax.tree_util.tree_unflatten(out_tree, outs)
    # The same whole value on every device, typed so where JAX tracks varying axes.
    whole = [all_gather_invariant(x, axes, tiled=True) if b else x for x, b in zip(leaves, flags)]
    out = fn(*jax.tree_util.tree_unflatten(treedef, whole))
    n = axis_size(names)
    me = jax.lax.axis_index(axes)
    out_leaves, out_def = jax.tree_util.tree_flatten(out)
    kept = [
        jax.lax.dynamic_slice_in_dim(x, me * (x.shape[0] // n), x.shape[0] // n, 0) if b else x
        for x, b in zip(out_leaves, jax.tree_util.tree_leaves(out_blocks))
    ]
    return jax.tree_util.tree_unflatten(out_def, kept)
