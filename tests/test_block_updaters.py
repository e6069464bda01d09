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
from jaxkv._fast import varying_axes

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
