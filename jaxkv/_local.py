"""Running an updater on this device's blocks of sharded values, inside ``shard_map``.

An updater that is elementwise along axis 0 of the sharded values (sgd, momentum, adam, ...)
gives on a device's block exactly the block of what it gives on the whole value, so it runs on
the block as it is. Any other updater (``clip_by_global_norm``, trust ratios, custom reductions)
would see only a part of each value: for those the blocks are all-gathered, the updater runs on
the whole values, and each device keeps its block of the result. Which case applies is read from
the updater's jaxpr, once per trace.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex

__all__ = ["run_on_blocks"]

# Primitives whose output element i depends only on the input elements i (scalars broadcast).
_ELEMENTWISE = frozenset(
    """abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp complex conj
    convert_element_type copy copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1
    floor ge gt imag integer_pow is_finite le lgamma log log1p logistic lt max min mul ne neg
    nextafter not or pow real reduce_precision rem round rsqrt select_n sign sin sinh sqrt square
    stop_gradient sub tan tanh xor""".split()  # noqa: SIM905
)

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


def _sub_jaxpr(eqn: Any) -> Any:
    """The one jaxpr an equation calls with its own inputs and outputs (``jit``, custom
    derivatives), or ``None``."""
    found = [
        j
        for j in jex.jaxprs_in_params(eqn.params)
        if len(j.invars) == len(eqn.invars) and len(j.outvars) == len(eqn.outvars)
    ]
    return found[0] if len(found) == 1 else None


def _rule(eqn: Any, kinds: list[str]) -> list[str] | None:
    """The kinds of ``eqn``'s outputs, or ``None`` if it mixes rows of a block."""
    name = eqn.primitive.name
    shapes = [tuple(getattr(v.aval, "shape", ())) for v in eqn.invars]
    n_out = len(eqn.outvars)
    if name == "broadcast_in_dim":
        kind = _broadcast_kind(kinds[0], shapes[0], eqn.params)
        return None if kind is None else [kind]
    if name in _ELEMENTWISE:
        sized = [k for k, s in zip(kinds, shapes) if s]  # scalars broadcast to any block
        if _BLOCK in kinds:
            return None if _WHOLE in sized else [_BLOCK] * n_out
        return [_ROWS_ALIKE if sized and all(k == _ROWS_ALIKE for k in sized) else _WHOLE] * n_out
    if _BLOCK not in kinds and _ROWS_ALIKE not in kinds:
        return [_WHOLE] * n_out
    # A row-broadcast is a block too here: reducing it would count this device's rows only.
    kind = _BLOCK if _BLOCK in kinds else _ROWS_ALIKE
    if name == "reshape" and eqn.params.get("dimensions") is None:
        same_rows = tuple(eqn.params["new_sizes"][:1]) == shapes[0][:1]
        return [kind] if same_rows else None
    if name == "squeeze" and 0 not in eqn.params["dimensions"]:
        return [kind]
    sub = _sub_jaxpr(eqn)
    return None if sub is None else _kinds(sub, kinds)


def _kinds(jaxpr: Any, kinds: Sequence[str]) -> list[str] | None:
    """The kind of each output of ``jaxpr`` given its inputs' kinds, or ``None`` if some
    equation mixes the rows of a block."""
    if isinstance(jaxpr, jex.ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    env: dict[Any, str] = {v: _WHOLE for v in jaxpr.constvars}
    env.update(zip(jaxpr.invars, kinds))

    def read(v: Any) -> str:
        return _WHOLE if isinstance(v, jex.Literal) else env[v]

    for eqn in jaxpr.eqns:
        out = _rule(eqn, [read(v) for v in eqn.invars])
        if out is None:
            return None
        env.update(zip(eqn.outvars, out))
    return [read(v) for v in jaxpr.outvars]


def _constants(jaxpr: Any) -> list:
    """Every primitive and constant of ``jaxpr`` (and the jaxprs it calls), in order."""
    if isinstance(jaxpr, jex.ClosedJaxpr):
        consts = [("const", np.asarray(c).tolist()) for c in jaxpr.consts]
        return consts + _constants(jaxpr.jaxpr)
    out: list = []
    for eqn in jaxpr.eqns:
        out.append(eqn.primitive.name)
        out.extend(("literal", v.val) for v in eqn.invars if isinstance(v, jex.Literal))
        for sub in jex.jaxprs_in_params(eqn.params):
            out.extend(_constants(sub))
    return out


def _more_rows(x: Any) -> Any:
    return jax.ShapeDtypeStruct((2 * x.shape[0], *x.shape[1:]), x.dtype)


def is_blockwise(fn: Callable, args: Any, blocks: Any, out_blocks: Any) -> bool:
    """Whether ``fn(*args)`` may run on blocks: every output that ``out_blocks`` marks as a
    block is computed row by row from the blocks ``blocks`` marks in ``args``, every other
    output from whole values only, and nothing depends on how many rows a block has (``fn``
    traced with twice the rows uses the same primitives and constants: ``x / x.size`` does
    not)."""
    shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*shapes)
    flags = jax.tree_util.tree_leaves(blocks)
    kinds = _kinds(closed, [_BLOCK if b else _WHOLE for b in flags])
    if kinds is None:
        return False
    if jax.tree_util.tree_structure(out_shape) != jax.tree_util.tree_structure(out_blocks):
        return False
    want = jax.tree_util.tree_leaves(out_blocks)
    if not all((k != _WHOLE) if b else (k != _BLOCK) for k, b in zip(kinds, want)):
        return False
    leaves, treedef = jax.tree_util.tree_flatten(shapes)
    bigger = [_more_rows(x) if b else x for x, b in zip(leaves, flags)]
    twice = jax.make_jaxpr(fn)(*jax.tree_util.tree_unflatten(treedef, bigger))
    return _constants(closed) == _constants(twice)


def _axis_index(names: tuple) -> jax.Array:
    return jax.lax.axis_index(names if len(names) > 1 else names[0])


def _gather(x: jax.Array, names: tuple) -> jax.Array:
    axes = names if len(names) > 1 else names[0]
    try:  # the same whole value on every device, typed so (varying-axis tracking)
        return jax.lax.all_gather(x, axes, tiled=True, to="invarying")
    except (TypeError, ValueError):
        return jax.lax.all_gather(x, axes, tiled=True)


def run_on_blocks(fn: Callable, args: Any, blocks: Any, out_blocks: Any, names: tuple) -> Any:
    """``fn(*args)`` where the leaves ``blocks`` marks are this device's blocks (axis 0) of
    values sharded over the mapped axes ``names``: the outputs ``out_blocks`` marks are this
    device's blocks of what ``fn`` gives on the whole values, the others whole.

    Runs ``fn`` on the blocks when it is elementwise along them; otherwise gathers them, runs
    ``fn`` on the whole values, and keeps this device's block of each output.
    """
    flags = jax.tree_util.tree_leaves(blocks)
    if not any(flags) or is_blockwise(fn, args, blocks, out_blocks):
        return fn(*args)
    leaves, treedef = jax.tree_util.tree_flatten(args)
    whole = [_gather(x, names) if b else x for x, b in zip(leaves, flags)]
    out = fn(*jax.tree_util.tree_unflatten(treedef, whole))
    n = math.prod(jax.lax.axis_size(a) for a in names)
    me = _axis_index(names)
    out_leaves, out_def = jax.tree_util.tree_flatten(out)
    kept = [
        jax.lax.dynamic_slice_in_dim(x, me * (x.shape[0] // n), x.shape[0] // n, 0) if b else x
        for x, b in zip(out_leaves, jax.tree_util.tree_leaves(out_blocks))
    ]
    return jax.tree_util.tree_unflatten(out_def, kept)
