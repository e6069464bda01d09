"""Updaters on sharded blocks inside the user's ``jit`` + ``shard_map`` step, and whole-shape
values pushed to sharded keys there.

Each result is compared with the same updater run on one device on the whole value (or with the
value the key must then hold). The data differ by row and by device, so a reduction over the
rows left incomplete on a block (a maximum taken over this device's rows only), or a device
keeping rows other than its own, changes the numbers.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _devices import cpu_empty
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxkv
from jaxkv._src.jax_internals import varying_axes

D = 8
AXIS = "kv"  # the store's own mesh axis: state.mesh
SHAPE = (64, 96)  # sharded over the D devices with BOUND: 8 rows per device
BOUND = 1024

_rng = np.random.RandomState(0)
DATA = _rng.standard_normal((D, *SHAPE)).astype(np.float32)  # device d's gradient: DATA[d]
TOTAL = DATA.sum(0)  # what the push sums over the devices
START = _rng.standard_normal(SHAPE).astype(np.float32)
BIAS_DATA = _rng.standard_normal((D, SHAPE[1])).astype(np.float32)  # a small, replicated key
BIAS_START = _rng.standard_normal(SHAPE[1]).astype(np.float32)


def assert_close(actual, expected, tol=1e-5):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=tol, atol=tol)


def sharded(values):
    state = jaxkv.init(cpu_empty(bigarray_bound=BOUND), values)
    assert jaxkv.specs(state, AXIS).values["w"] == P(AXIS)
    return state


def in_store_mesh(state, fn, in_specs, out_specs):
    return jax.jit(jax.shard_map(fn, mesh=state.mesh, in_specs=in_specs, out_specs=out_specs))


def on_axis(state, x):
    """``x``'s leading axis split over the store's devices (device d gets ``x[d]``)."""
    return jax.device_put(x.reshape(-1, *x.shape[2:]), NamedSharding(state.mesh, P(AXIS)))


def push_each_device(updater):
    """The jitted step pushing device d's ``DATA[d]`` (whole shape, varying) to the sharded key
    "w" holding ``START``, with ``updater``; returns it, the state and the data."""
    state = sharded({"w": jnp.asarray(START)})
    specs = jaxkv.specs(state, AXIS)

    def step(state, g):
        return jaxkv.push(state, "w", g, updater=updater, axis_name=AXIS)

    return in_store_mesh(state, step, (specs, P(AXIS)), specs), state, on_axis(state, DATA)


# -- reductions over the rows that are maxima or minima ----------------------------------------


def _max_abs(key, pushed, stored):
    return stored - pushed / jnp.max(jnp.abs(pushed))


def _min_max(key, pushed, stored):
    low, high = jnp.min(pushed), jnp.max(pushed)
    return stored - (pushed - low) / (high - low)


def _column_max(key, pushed, stored):
    return stored - pushed / jnp.max(jnp.abs(pushed), axis=0)  # over the rows only


def _clipped_to_stored(key, pushed, stored):
    return jnp.clip(stored - pushed, jnp.min(stored), jnp.max(stored))  # of the stored value


def _inf_norm(key, pushed, stored):
    return stored - pushed / jnp.linalg.norm(pushed, ord=jnp.inf)  # max over rows of row sums


@pytest.mark.parametrize(
    "updater", [_max_abs, _min_max, _column_max, _clipped_to_stored, _inf_norm]
)
def test_a_maximum_or_minimum_over_the_rows_is_taken_over_every_device(updater):
    fn, state, data = push_each_device(updater)
    new = fn(state, data)
    assert_close(new["w"], updater("w", jnp.asarray(TOTAL), jnp.asarray(START)))
    # On the blocks, the reduction completed by an all-reduce: nothing gathered.
    text = fn.lower(state, data).as_text()
    assert "stablehlo.all_gather" not in text and "stablehlo.all_reduce" in text


def _tree_max(tree):
    return functools.reduce(jnp.maximum, [jnp.max(x) for x in jax.tree_util.tree_leaves(tree)])


def _tree_min(tree):
    return functools.reduce(jnp.minimum, [jnp.min(x) for x in jax.tree_util.tree_leaves(tree)])


def clip_by_inf_norm(max_norm):
    """``optax.clip_by_global_norm`` with the infinity norm: the largest element's magnitude
    over every pushed key."""

    def update(updates, state, params=None):
        norm = _tree_max(jax.tree_util.tree_map(jnp.abs, updates))
        scale = jnp.minimum(1.0, max_norm / norm)
        return jax.tree_util.tree_map(lambda x: x * scale, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def scale_to_unit_range():
    """Each update moved and scaled into [0, 1] by the minimum and maximum over every key."""

    def update(updates, state, params=None):
        low, high = _tree_min(updates), _tree_max(updates)
        return jax.tree_util.tree_map(lambda x: (x - low) / (high - low), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def scale_by_max_abs():
    """Each key's update divided by its own largest magnitude (``jnp.max`` over the value)."""
    return optax.stateless(
        lambda updates, params: jax.tree_util.tree_map(lambda x: x / jnp.max(jnp.abs(x)), updates)
    )


OPTIMIZERS = {
    "clip-inf-norm+momentum": optax.chain(clip_by_inf_norm(1.0), optax.sgd(0.1, momentum=0.9)),
    "unit-range+sgd": optax.chain(scale_to_unit_range(), optax.sgd(0.1)),
    "max-abs+momentum": optax.chain(scale_by_max_abs(), optax.sgd(0.1, momentum=0.9)),
}
STEPS = 2


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optax_with_a_maximum_or_minimum_over_the_value_matches_one_device(name):
    opt = OPTIMIZERS[name]
    params = {"w": jnp.asarray(START), "b": jnp.asarray(BIAS_START)}
    state = jaxkv.init_optimizer(sharded(params), opt)
    specs = jaxkv.specs(state, AXIS)

    def step(state, g, b):
        return jaxkv.push(state, {"w": g, "b": b[0]}, updater=opt, axis_name=AXIS)

    fn = in_store_mesh(state, step, (specs, P(AXIS), P(AXIS)), specs)
    data = on_axis(state, DATA), on_axis(state, BIAS_DATA[:, None])
    for _ in range(STEPS):
        state = fn(state, *data)

    grads = {"w": jnp.asarray(TOTAL), "b": jnp.asarray(BIAS_DATA.sum(0))}
    opt_state = opt.init(params)
    for _ in range(STEPS):
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    assert_close(state["w"], params["w"])
    assert_close(state["b"], params["b"])
    (kept,) = state.opt_states.values()
    for x, y in zip(jax.tree_util.tree_leaves(kept), jax.tree_util.tree_leaves(opt_state)):
        assert_close(x, y)
    text = fn.lower(state, *data).as_text()
    assert "stablehlo.all_gather" not in text


def keep_max_at_fixed_shape():
    """A transformation whose state is written at the value's shape, spelled out: on a block
    it is a whole value, not the block's rows (run on a block, the state left the step with D
    times the rows)."""

    def update(updates, state, params=None):
        new = jax.tree_util.tree_map(lambda g: jnp.broadcast_to(jnp.max(g), SHAPE), updates)
        return jax.tree_util.tree_map(lambda g: -0.1 * g, updates), new

    return optax.GradientTransformation(
        lambda params: jax.tree_util.tree_map(jnp.zeros_like, params), update
    )


def test_an_optimizer_state_written_at_the_values_fixed_shape_keeps_that_shape():
    opt = keep_max_at_fixed_shape()
    params = {"w": jnp.asarray(START)}
    state = jaxkv.init_optimizer(sharded(params), opt)
    specs = jaxkv.specs(state, AXIS)

    def step(state, g):
        return jaxkv.push(state, "w", g, updater=opt, axis_name=AXIS)

    state = in_store_mesh(state, step, (specs, P(AXIS)), specs)(state, on_axis(state, DATA))
    grads = {"w": jnp.asarray(TOTAL)}
    updates, opt_state = opt.update(grads, opt.init(params), params)
    assert_close(state["w"], optax.apply_updates(params, updates)["w"])
    (kept,) = state.opt_states.values()
    assert kept["w"].shape == SHAPE
    assert_close(kept["w"], opt_state["w"])


# -- a whole-shape value already summed, pushed to a sharded key --------------------------------


def _arange(g):
    return jnp.arange(np.prod(SHAPE), dtype=jnp.float32).reshape(SHAPE)  # made in the step


def _psum(g):
    return lax.psum(g, AXIS)  # summed by the caller: the same on every device


def _sgd(key, pushed, stored):
    return stored - 0.5 * pushed


@pytest.mark.parametrize(
    ("made", "expected"),
    [(_arange, np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)), (_psum, TOTAL)],
    ids=["arange", "psum"],
)
@pytest.mark.parametrize("updater", [None, _sgd], ids=["assign", "sgd"])
def test_an_already_summed_whole_value_leaves_each_device_its_own_rows(made, expected, updater):
    state = sharded({"w": jnp.asarray(START)})
    specs = jaxkv.specs(state, AXIS)

    def step(state, g):
        value = made(g)
        assert AXIS not in varying_axes(value)  # invariant: pushed as it is, not summed
        state = jaxkv.push(state, "w", value, updater=updater, axis_name=AXIS)
        return state, jaxkv.pull(state, "w", axis_name=AXIS)[None]

    fn = in_store_mesh(state, step, (specs, P(AXIS)), (specs, P(AXIS)))
    new, pulled = fn(state, on_axis(state, DATA))
    want = expected if updater is None else updater("w", jnp.asarray(expected), jnp.asarray(START))
    assert_close(new["w"], want)
    assert_close(pulled, np.broadcast_to(want, (D, *SHAPE)))  # every device, the whole value


# -- updaters that move, order, index or condition on rows: one-device numbers -----------------

ADVERSARIAL = {
    "cumsum": lambda k, p, s: s - jnp.cumsum(p, axis=0) * 0.01,
    "sort": lambda k, p, s: s - jnp.sort(p, axis=0),
    "roll": lambda k, p, s: s - jnp.roll(p, 3, axis=0),
    "reverse": lambda k, p, s: s - p[::-1],
    "diff": lambda k, p, s: s - jnp.diff(p, axis=0, prepend=0.0),
    "cummax": lambda k, p, s: s - lax.cummax(p, axis=0),
    "gram-rows": lambda k, p, s: s - (p @ p.T) @ s * 1e-3,
    "gram-columns": lambda k, p, s: s - s @ (p.T @ p) * 1e-3,
    "vdot": lambda k, p, s: s - jnp.vdot(p, s) * p * 1e-4,
    "argmax": lambda k, p, s: s - jnp.argmax(p, axis=0).astype(s.dtype) * 0.01,
    "row-index": lambda k, p, s: s - p * jnp.arange(p.shape[0], dtype=s.dtype)[:, None],
    "scatter-add": lambda k, p, s: s.at[0].add(p.sum(0)),
    "scatter-at-argmax": lambda k, p, s: s.at[jnp.argmax(p[:, 0])].set(0.0) - p,
    "first-row": lambda k, p, s: s - p[0],
    "median": lambda k, p, s: s - jnp.median(p, axis=0),
    "where-on-sum": lambda k, p, s: jnp.where(p.sum() > 0, s - p, s + p),
    "cond-on-sum": lambda k, p, s: lax.cond(p.sum() > 0, lambda: s - p, lambda: s + 2 * p),
    "mean": lambda k, p, s: s - p / jnp.mean(jnp.abs(p)),
    "size": lambda k, p, s: s - p / p.size,
    "column-norm": lambda k, p, s: s - p / jnp.linalg.norm(p, axis=0, keepdims=True),
    "row-norm": lambda k, p, s: s - p / jnp.linalg.norm(p, axis=1, keepdims=True),
    "softmax-over-rows": lambda k, p, s: s - jax.nn.softmax(p, axis=0),
    "reshape-across-rows": lambda k, p, s: s - p.reshape(-1, 64).reshape(p.shape),
    "random": lambda k, p, s: s - p * jax.random.uniform(jax.random.key(0), p.shape),
    # The value's shape written into the updater: it cannot be traced on a block.
    "where-on-fixed-rows": lambda k, p, s: s - jnp.where(jnp.arange(64)[:, None] < 32, p, 0.0),
    "slice-of-fixed-rows": lambda k, p, s: (
        s - lax.dynamic_slice_in_dim(jnp.concatenate([p, p]), 3, 64, 0)
    ),
    "fixed-shape-result": lambda k, p, s: jnp.zeros(SHAPE, s.dtype) + (s - p)[:, :1],
}


@pytest.mark.parametrize("name", list(ADVERSARIAL))
def test_an_updater_across_rows_gives_on_blocks_what_it_gives_on_one_device(name):
    updater = ADVERSARIAL[name]
    fn, state, data = push_each_device(updater)
    assert_close(fn(state, data)["w"], updater("w", jnp.asarray(TOTAL), jnp.asarray(START)))
