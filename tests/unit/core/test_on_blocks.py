"""jaxkv/_src/core/on_blocks.py: which steps keep a device's block its own rows, which reductions
over the rows are completed across devices, and each device keeping its own rows otherwise."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxkv._src.core import on_blocks

# A block of rows over the axis "d"; a broadcast constant along the rows; a whole value.
BLOCK, ALIKE, WHOLE = on_blocks._rows(("d",)), on_blocks._ROWS_ALIKE, on_blocks._WHOLE
# A block split along its rows over "d" and its columns over "m" (a P("d", "m") value), one
# split along its columns only (P(None, "m")), and one along its rows over ("m", "d").
GRID = on_blocks._block([(0, ("d",)), (1, ("m",))])
COLS = on_blocks._block([(1, ("m",))])
ROWS2 = on_blocks._rows(("m", "d"))
X = jax.ShapeDtypeStruct((4, 3), jnp.float32)  # a device's block: 4 rows
SQ = jax.ShapeDtypeStruct((4, 4), jnp.float32)
ONE = jax.ShapeDtypeStruct((1, 3), jnp.float32)  # a block of one row


def _loop(x):
    """A loop whose condition and body both take and give one value (the body moves rows)."""
    return jax.lax.while_loop(lambda v: jnp.array(True), lambda v: v[::-1], x)


def _params(dims, shape):
    return {"broadcast_dimensions": dims, "shape": shape}


@pytest.mark.parametrize(
    ("kind", "operand", "dims", "shape", "expected"),
    [
        (BLOCK, (4,), (0,), (4, 3), BLOCK),  # each row repeated along a new axis
        (BLOCK, (4, 3), (0, 1), (4, 3, 2), BLOCK),
        (BLOCK, (4,), (1,), (3, 4), None),  # its rows become columns
        (BLOCK, (4, 4), (1, 0), (4, 4), None),  # a transpose, though the sizes agree
        (BLOCK, (1, 3), (0, 1), (4, 3), None),  # a one-row block stretched to four rows
        (WHOLE, (), (), (4, 3), ALIKE),  # a scalar: every row alike
        (WHOLE, (3,), (1,), (4, 3), ALIKE),  # one row repeated
        (WHOLE, (1, 3), (0, 1), (4, 3), ALIKE),  # a size-one axis 0 stretched
        (WHOLE, (3, 1), (1, 0), (4, 3), ALIKE),  # the size-one axis (1) becomes the rows
        (WHOLE, (4, 1), (0, 1), (4, 3), WHOLE),  # the rows differ
        (ALIKE, (4, 3), (0, 1), (4, 3, 2), ALIKE),  # rows alike stay rows alike
        (ALIKE, (3, 4), (1, 0), (4, 3), WHOLE),  # its axis 1, which differs, becomes the rows
    ],
)
def test_a_broadcast_keeps_a_block_only_where_its_rows_stay_the_rows(
    kind, operand, dims, shape, expected
):
    assert on_blocks._broadcast_kind(kind, operand, _params(dims, shape)) == expected


def _kinds(fn, args, kinds, reduce):
    closed = jax.make_jaxpr(fn)(*args)
    return on_blocks._kinds(closed.jaxpr, kinds, reduce)


@pytest.mark.parametrize(
    ("fn", "args", "kinds", "plain", "reduced"),
    [
        (lambda x: x * 2.0 + 1.0, [X], [BLOCK], [BLOCK], [BLOCK]),
        (
            lambda x, s: x * s,
            [X, jax.ShapeDtypeStruct((), jnp.float32)],
            [BLOCK, WHOLE],
            [BLOCK],
            [BLOCK],
        ),
        (lambda x, w: x + w, [X, X], [BLOCK, WHOLE], None, None),  # a whole value of block shape
        (lambda x, y: x * y, [X, X], [BLOCK, BLOCK], [BLOCK], [BLOCK]),
        (lambda x: x - jnp.ones_like(x), [X], [BLOCK], [BLOCK], [BLOCK]),  # rows alike
        (lambda x: x.sum(axis=1), [X], [BLOCK], [BLOCK], [BLOCK]),  # within each row
        (lambda x: x.sum(axis=0), [X], [BLOCK], None, [WHOLE]),  # over the rows
        (lambda x: jnp.max(x), [X], [BLOCK], None, [WHOLE]),
        (lambda x: jnp.sum(jnp.ones_like(x)), [X], [BLOCK], None, None),  # counts the rows
        (lambda x, y: jnp.einsum("ij,ij->", x, y), [X, X], [BLOCK, BLOCK], None, [WHOLE]),
        (lambda x, y: jnp.tensordot(x, y, ([0, 1], [1, 0])), [SQ, SQ], [BLOCK, BLOCK], None, None),
        (lambda x: x.reshape(4, 3, 1), [X], [BLOCK], [BLOCK], [BLOCK]),
        (lambda x: x.reshape(12), [X], [BLOCK], None, None),
        (lambda x: x.reshape(2, 6), [X], [BLOCK], None, None),
        (lambda x: jnp.squeeze(x.reshape(4, 1, 3), 1), [X], [BLOCK], [BLOCK], [BLOCK]),
        (lambda x: jnp.squeeze(x, 0), [ONE], [BLOCK], None, None),  # drops the rows' axis
        (lambda x: jax.jit(lambda y: y * 3.0)(x), [X], [BLOCK], [BLOCK], [BLOCK]),  # inlined
        (lambda x: x[::-1], [X], [BLOCK], None, None),  # moves rows
        (_loop, [X], [BLOCK], None, None),  # calls two jaxprs of its arity: neither inlined
        (lambda w: w.sum(axis=0), [X], [WHOLE], [WHOLE], [WHOLE]),  # no block: anything goes
    ],
)
def test_each_step_keeps_a_block_mixes_its_rows_or_reduces_over_them(
    fn, args, kinds, plain, reduced
):
    assert _kinds(fn, args, kinds, reduce=False) == plain
    assert _kinds(fn, args, kinds, reduce=True) == reduced


def test_only_a_bitcast_between_types_of_one_width_keeps_the_shape():
    def eqn(fn, x):
        (e,) = jax.make_jaxpr(fn)(x).jaxpr.eqns
        return e

    x32 = jax.ShapeDtypeStruct((4, 2), jnp.float32)
    assert on_blocks.keeps_shape(eqn(lambda x: jax.lax.bitcast_convert_type(x, jnp.int32), x32))
    assert not on_blocks.keeps_shape(eqn(lambda x: jax.lax.bitcast_convert_type(x, jnp.int16), x32))
    wide = eqn(lambda x: jax.lax.bitcast_convert_type(x, jnp.int16), x32)
    assert on_blocks._rule(wide, [BLOCK], reduce=True) is None
    assert on_blocks.keeps_shape(eqn(lambda x: x + 1.0, x32))


def _blockwise(fn, args, blocks, out_blocks):
    return on_blocks.is_blockwise(fn, args, blocks, out_blocks)


def test_an_updater_that_reads_the_block_s_number_of_rows_is_not_blockwise():
    assert _blockwise(lambda x: x * 2.0, (X,), (True,), True)
    assert not _blockwise(lambda x: x / x.shape[0], (X,), (True,), True)  # 4.0 here, 8.0 whole
    assert not _blockwise(lambda x: x / x.size, (X,), (True,), True)


def test_an_updater_that_fixes_the_whole_value_s_shape_is_not_blockwise():
    mask = lambda x: x * (jnp.arange(4)[:, None] < 2)  # noqa: E731  (4 rows, written in)
    assert not _blockwise(mask, (X,), (True,), True)
    # an output of a fixed shape is no block, however its kind reads
    pair = lambda x: (x * 2.0, jnp.zeros((4, 3)))  # noqa: E731
    assert not _blockwise(pair, (X,), (True,), (True, True))
    assert _blockwise(pair, (X,), (True,), (True, False))


def test_outputs_must_be_blocks_exactly_where_marked():
    both = lambda x, w: (x * 2.0, w * 2.0)  # noqa: E731
    assert _blockwise(both, (X, X), (True, False), (True, False))
    assert not _blockwise(both, (X, X), (True, False), (False, False))  # a block given as whole
    assert not _blockwise(both, (X, X), (True, False), (True, True))  # a whole value as a block
    assert not _blockwise(both, (X, X), (True, False), [True, False])  # another tree


# -- on the devices: 4 devices, 3 rows each (rows per device differ from the device count) --
N = 4
VALUE = np.arange(12 * 2, dtype=np.float32).reshape(12, 2) - 7.0
OTHER = (np.arange(12 * 2, dtype=np.float32).reshape(12, 2) % 5) + 1.0


def _on_devices(fn, monkeypatch=None, can_mark=True):
    """``run_on_blocks(fn)`` on each device's 3 rows of ``VALUE`` and ``OTHER`` (both blocks),
    the output a block; the whole result, and the collectives in the program."""
    if monkeypatch is not None:
        monkeypatch.setattr(on_blocks, "CAN_MARK_VARYING", can_mark)
    mesh = Mesh(np.array(jax.devices("cpu")[:N]), ("d",))

    def body(x, y):
        return on_blocks.run_on_blocks(fn, (x, y), (True, True), True, ("d",))

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("d"), P("d")), out_specs=P("d")))
    text = step.lower(VALUE, OTHER).as_text()
    ops = {op for op in ("all_reduce", "all_gather") if f"stablehlo.{op}" in text}
    return np.asarray(step(VALUE, OTHER)), ops


def _scale(x, y):
    return x * 0.5 - y


def _normalise(x, y):
    return x - y / jnp.sqrt(jnp.sum(y * y)) + jnp.max(x)


def _reverse(x, y):
    return x - y[::-1]


def test_an_elementwise_updater_runs_on_each_block_as_it_is():
    got, ops = _on_devices(_scale)
    np.testing.assert_array_equal(got, VALUE * 0.5 - OTHER)
    assert ops == set()


def test_reductions_over_the_rows_are_completed_across_every_device():
    got, ops = _on_devices(_normalise)
    np.testing.assert_allclose(
        got, VALUE - OTHER / np.sqrt((OTHER**2).sum()) + VALUE.max(), rtol=1e-6
    )
    assert ops == {"all_reduce"}


def test_an_updater_that_moves_rows_runs_whole_and_each_device_keeps_its_own_rows():
    got, ops = _on_devices(_reverse)
    np.testing.assert_array_equal(got, VALUE - OTHER[::-1])
    assert ops == {"all_gather"}


def test_where_jax_cannot_mark_values_varying_reductions_run_on_the_gathered_value(monkeypatch):
    got, ops = _on_devices(_normalise, monkeypatch, can_mark=False)
    np.testing.assert_allclose(
        got, VALUE - OTHER / np.sqrt((OTHER**2).sum()) + VALUE.max(), rtol=1e-6
    )
    assert ops == {"all_gather"}


def _rule_of(fn, args, kinds):
    """The rule of the one equation ``fn`` makes, given its inputs' ``kinds``."""
    (eqn,) = jax.make_jaxpr(fn)(*args).jaxpr.eqns
    return on_blocks._rule(eqn, kinds, True, on_blocks._watched(kinds))


@pytest.mark.parametrize(
    ("fn", "kinds", "expected"),
    [
        (lambda x: x * 2.0, [GRID], ([GRID], None)),
        (lambda x: jnp.sum(x), [GRID], ([WHOLE], ("psum", ("d", "m")))),  # over both axes
        (lambda x: jnp.sum(x), [COLS], ([WHOLE], ("psum", ("m",)))),
        (lambda x: jnp.max(x), [ROWS2], ([WHOLE], ("pmax", ("m", "d")))),
        (lambda x: x.sum(axis=0), [GRID], ([on_blocks._rows(("m",))], ("psum", ("d",)))),
        (lambda x: x.sum(axis=1), [GRID], ([on_blocks._rows(("d",))], ("psum", ("m",)))),
        (lambda x: x.sum(axis=0), [COLS], ([on_blocks._rows(("m",))], None)),  # within columns
        (lambda x: x.reshape(4, 3, 1), [GRID], ([GRID], None)),
        (lambda x: x.reshape(12), [COLS], None),  # mixes the split columns
    ],
)
def test_a_block_split_along_several_dimensions_completes_reductions_over_their_axes(
    fn, kinds, expected
):
    assert _rule_of(fn, [X], kinds) == expected


def test_blocks_split_differently_do_not_mix_and_broadcasts_must_be_constant_along_splits():
    assert _kinds(lambda x, y: x * y, [X, X], [GRID, COLS], reduce=True) is None
    assert _kinds(lambda x, y: x * y, [X, X], [GRID, GRID], reduce=True) == [GRID]
    # constant along both split dimensions: a scalar broadcast
    assert _kinds(lambda x: x - jnp.ones_like(x), [X], [GRID], reduce=True) == [GRID]
    # one row repeated: constant along the rows only, not along the split columns
    row = jax.ShapeDtypeStruct((3,), jnp.float32)
    assert _kinds(lambda x, r: x - r[None, :], [X, row], [GRID, WHOLE], reduce=True) is None
    assert _kinds(lambda x, r: x - r[None, :], [X, row], [BLOCK, WHOLE], reduce=True) == [BLOCK]
    # a dot product contracting both split dimensions of each, split alike
    dot = lambda x, y: jnp.einsum("ij,ij->", x, y)  # noqa: E731
    assert _kinds(dot, [X, X], [GRID, GRID], reduce=True) == [WHOLE]
    assert _kinds(dot, [X, X], [GRID, COLS], reduce=True) is None


# -- on a 2 x 4 mesh: each device's 8 x 2 block of a 16 x 8 value split P("d", "m") ---------
GRID_VALUE = np.arange(16 * 8, dtype=np.float32).reshape(16, 8) - 40.0
GRID_OTHER = (np.arange(16 * 8, dtype=np.float32).reshape(16, 8) % 7) + 1.0


def _on_grid(fn, spec=None):
    """``run_on_blocks(fn)`` on each device's block of ``GRID_VALUE`` and ``GRID_OTHER`` (both
    split as ``spec`` says: rows over "d" and columns over "m", or rows over ("m", "d")), the
    output such a block too; the whole result, and the collectives in the program."""
    spec = P("d", "m") if spec is None else spec
    mesh = Mesh(np.array(jax.devices("cpu")).reshape(2, 4), ("d", "m"))
    split = on_blocks.Split(
        tuple((d, (e,) if isinstance(e, str) else e) for d, e in enumerate(spec) if e)
    )

    def body(x, y):
        return on_blocks.run_on_blocks(fn, (x, y), (split, split), split, ("d",))

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=spec))
    text = step.lower(GRID_VALUE, GRID_OTHER).as_text()
    ops = {op for op in ("all_reduce", "all_gather") if f"stablehlo.{op}" in text}
    return np.asarray(step(GRID_VALUE, GRID_OTHER)), ops


def test_reductions_of_a_block_split_along_two_dimensions_are_completed_over_both_axes():
    got, ops = _on_grid(_normalise)
    want = GRID_VALUE - GRID_OTHER / np.sqrt((GRID_OTHER**2).sum()) + GRID_VALUE.max()
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert ops == {"all_reduce"}


def test_a_block_split_along_two_dimensions_is_gathered_along_both_for_an_updater_that_moves_rows():
    got, ops = _on_grid(lambda x, y: x - y[::-1, ::-1])
    np.testing.assert_array_equal(got, GRID_VALUE - GRID_OTHER[::-1, ::-1])
    assert ops == {"all_gather"}


def test_a_block_of_rows_over_two_axes_is_gathered_in_the_mesh_order_of_its_split():
    got, ops = _on_grid(_reverse, P(("m", "d")))
    np.testing.assert_array_equal(got, GRID_VALUE - GRID_OTHER[::-1])
    assert ops == {"all_gather"}
    got, ops = _on_grid(_normalise, P(("m", "d")))
    want = GRID_VALUE - GRID_OTHER / np.sqrt((GRID_OTHER**2).sum()) + GRID_VALUE.max()
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert ops == {"all_reduce"}
