"""jaxkv/_src/core/on_buckets.py: which updaters run once over a bucket (elementwise on each key,
reductions over the whole group), and the bucket's numbers equal the per-key ones, split or not."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxkv
from jaxkv._src.core import on_buckets

KEYS = ("a", "b")
SHAPES = ((4,), (2, 3))


def _custom(update):
    """An optax transformation with no state whose update is ``update(grads)``."""
    return optax.GradientTransformation(
        lambda params: optax.EmptyState(), lambda g, s, p=None: (update(g), s)
    )


def _scaled(total):
    return _custom(lambda g: jax.tree_util.tree_map(lambda x: x / total(g), g))


def _sum_from(start):
    return _scaled(lambda g: sum((jnp.sum(x) for x in jax.tree_util.tree_leaves(g)), start))


_CONST = np.arange(1.0, 5.0, dtype=np.float32)

UPDATERS = {
    "sgd": (optax.sgd(0.1), True, True),
    "adam": (optax.adam(0.1), True, True),
    "clip": (optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)), False, True),
    "lamb": (optax.lamb(0.1), False, False),  # its trust ratio is a norm per key
    "sum_from_0": (_sum_from(0.0), False, True),  # Python's sum starts from a literal 0
    "sum_from_1": (_sum_from(1.0), False, False),
    "sum_of_maxima": (_scaled(lambda g: jnp.max(g["a"]) + jnp.max(g["b"])), False, False),
    "max_of_maxima": (
        _scaled(lambda g: jnp.maximum(jnp.max(g["a"]), jnp.max(g["b"]))),
        False,
        True,
    ),
    "a_counted_twice": (
        _scaled(lambda g: jnp.sum(g["a"]) + jnp.sum(g["a"]) + jnp.sum(g["b"])),
        False,
        False,
    ),
    "one_key_only": (_scaled(lambda g: jnp.sum(g["a"])), False, False),
    "per_row": (
        _custom(lambda g: {"a": g["a"], "b": g["b"] / jnp.sum(g["b"], axis=1, keepdims=True)}),
        False,
        False,
    ),
    "times_an_array": (_custom(lambda g: {"a": g["a"] * _CONST, "b": g["b"]}), False, False),
    "swap": (_custom(lambda g: {"a": g["a"][::-1], "b": g["b"]}), False, False),
}


@pytest.mark.standard_promotion  # optax's Adam casts implicitly
@pytest.mark.parametrize("name", list(UPDATERS))
def test_an_updater_runs_over_the_bucket_only_if_elementwise_or_reducing_the_whole_group(name):
    updater, plain, reduced = UPDATERS[name]
    tree = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in zip(KEYS, SHAPES)}
    opt = jax.eval_shape(updater.init, tree)
    assert on_buckets.elementwise(updater, KEYS, SHAPES, "float32", opt) is plain
    assert on_buckets.elementwise(updater, KEYS, SHAPES, "float32", opt, reduce=True) is reduced


def test_a_maximum_over_some_axes_of_each_key_is_no_maximum_over_the_bucket():
    shapes = ((2, 3), (2, 3))
    # Over axis 1 of each key, then across the keys: one number per row, not per group.
    per_row = _scaled(lambda g: jnp.max(jnp.maximum(jnp.max(g["a"], 1), jnp.max(g["b"], 1))))
    whole = _scaled(lambda g: jnp.maximum(jnp.max(g["a"]), jnp.max(g["b"])))
    tree = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in zip(KEYS, shapes)}
    opt = jax.eval_shape(per_row.init, tree)
    assert not on_buckets.elementwise(per_row, KEYS, shapes, "float32", opt, reduce=True)
    assert on_buckets.elementwise(whole, KEYS, shapes, "float32", opt, reduce=True)


def test_a_sum_over_only_some_of_the_group_s_keys_is_no_sum_over_the_bucket():
    keys, shapes = ("a", "b", "c"), ((4,), (2, 3), (5,))
    tree = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in zip(keys, shapes)}
    two = _scaled(lambda g: jnp.sum(g["a"]) + jnp.sum(g["b"]))
    three = _scaled(lambda g: jnp.sum(g["a"]) + jnp.sum(g["b"]) + jnp.sum(g["c"]))
    opt = jax.eval_shape(two.init, tree)
    assert not on_buckets.elementwise(two, keys, shapes, "float32", opt, reduce=True)
    assert on_buckets.elementwise(three, keys, shapes, "float32", opt, reduce=True)


def test_a_step_that_mixes_two_keys_arrays_is_not_elementwise():
    shapes = ((4,), (4,))
    mix = _custom(lambda g: {"a": g["a"] + g["b"], "b": g["b"]})
    tree = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in zip(KEYS, shapes)}
    opt = jax.eval_shape(mix.init, tree)
    assert not on_buckets.elementwise(mix, KEYS, shapes, "float32", opt, reduce=True)


def test_a_group_of_one_key_reduces_over_its_bucket():
    clip = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))
    opt = jax.eval_shape(clip.init, {"a": jax.ShapeDtypeStruct((4,), jnp.float32)})
    assert on_buckets.elementwise(clip, ("a",), ((4,),), "float32", opt, reduce=True)
    assert not on_buckets.elementwise(clip, ("a",), ((4,),), "float32", opt)


def test_structure_is_a_hashable_key_that_abstract_turns_back_into_the_tree():
    tree = {"m": (np.zeros((2, 3)), np.zeros((), np.int32)), "v": [np.zeros(4, np.float16)]}
    sig = on_buckets.structure(tree)
    assert hash(sig) == hash(on_buckets.structure(jax.tree_util.tree_map(np.ones_like, tree)))
    back = on_buckets.abstract(sig)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(tree)
    for x, y in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(tree)):
        assert isinstance(x, jax.ShapeDtypeStruct) and x.shape == y.shape and x.dtype == y.dtype
    other = {"m": (np.zeros((2, 3)), np.zeros((), np.float32)), "v": [np.zeros(4, np.float16)]}
    assert on_buckets.structure(other) != sig  # a dtype differs


# -- update_bucket on states over 2 devices, made and updated inside one jit ----------------
D = 2
P0 = {
    "a": np.array([1.0, 2.0, 3.0, 4.0], np.float32),
    "b": np.arange(6, dtype=np.float32).reshape(2, 3),
}
G = {
    "a": np.array([2.0, -4.0, 6.0, 0.5], np.float32),
    "b": -np.arange(1, 7, dtype=np.float32).reshape(2, 3),
}
MOMENTUM = optax.sgd(0.5, momentum=0.5)


def _values(source, shapes):
    return [source[k].ravel()[: int(np.prod(s))].reshape(s) for k, s in zip(KEYS, shapes)]


def _update(updater, shapes=SHAPES, split=False, layout="flat", keys=KEYS, **options):
    """A store of ``KEYS`` holding ``P0``, with ``updater``'s state, made inside ``jit`` (one
    compile, as a push in the caller's trace sees it) and ``update_bucket`` of ``G`` on
    ``keys``: each key's new value and the group's new optimizer state, or ``None``. With
    ``laid_out=True``, the sum is given already laid out as the bucket (unsplit only). With
    ``run=False`` only traced: enough to see a ``None``. ``init_with``: the optimizer that
    made the state (default ``updater``)."""
    laid_out, run = options.get("laid_out", False), options.get("run", True)
    init_with = options.get("init_with", updater)
    bound = 1 if split else None  # "flat" splits a bucket of at least the big-array bound
    empty = jaxkv.empty(jax.devices("cpu")[:D], bigarray_bound=bound, layout=layout)

    def step(values, grads):
        state = jaxkv.init(empty, dict(zip(KEYS, values)))
        state = jaxkv.init_optimizer(state, init_with)
        assert (state.flat_layout is not None and state.flat_layout.split) is split
        if laid_out:
            summed = {0: jnp.concatenate([jnp.ravel(g) for g in grads])}
            new = on_buckets.update_bucket(state, keys, None, updater, summed)
        else:
            new = on_buckets.update_bucket(state, keys, grads[: len(keys)], updater)
        if new is None:
            return None
        return [new[k] for k in KEYS], new.opt_states[keys]

    args = (_values(P0, shapes), _values(G, shapes))
    if run:
        return jax.jit(step)(*args)
    seen = []
    jax.make_jaxpr(lambda *a: seen.append(step(*a)) or 0)(*args)
    return seen[0]


@pytest.mark.parametrize(
    ("shapes", "split"),
    [(SHAPES, False), (SHAPES, True), (((4,), (3,)), True), (((3,), (5,)), True)],
)
def test_a_bucket_update_gives_each_key_the_per_key_numbers_split_padded_or_not(shapes, split):
    new, (trace, _) = _update(MOMENTUM, shapes, split)
    for x, k, p, g in zip(new, KEYS, _values(P0, shapes), _values(G, shapes)):
        np.testing.assert_array_equal(np.asarray(x), p - 0.5 * g)
        # the momentum after one step: the gradient itself
        np.testing.assert_array_equal(np.asarray(trace.trace[k]), g)


def test_a_sum_already_laid_out_as_the_bucket_is_taken_as_it_is():
    new, _ = _update(MOMENTUM, laid_out=True)
    for x, p, g in zip(new, _values(P0, SHAPES), _values(G, SHAPES)):
        np.testing.assert_array_equal(np.asarray(x), p - 0.5 * g)


def test_an_updater_without_per_key_state_runs_over_the_bucket_on_cpu_only_when_split():
    sgd = optax.sgd(0.5)
    # unsplit, per key into the bucket measured faster on CPU: left to the per-key update
    assert _update(sgd, run=False) is None
    new, _ = _update(sgd, split=True)
    for x, p, g in zip(new, _values(P0, SHAPES), _values(G, SHAPES)):
        np.testing.assert_array_equal(np.asarray(x), p - 0.5 * g)


def test_a_reduction_over_the_group_runs_over_a_split_bucket_only_without_padding():
    clip = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.5, momentum=0.5))
    # 3 elements over 2 devices: the padding would enter the reduction
    assert _update(clip, ((4,), (3,)), split=True, run=False) is None
    new, _ = _update(clip, SHAPES, split=True)
    grads = _values(G, SHAPES)
    norm = np.sqrt(sum((g.astype(np.float64) ** 2).sum() for g in grads))
    for x, p, g in zip(new, _values(P0, SHAPES), grads):
        np.testing.assert_allclose(np.asarray(x), p - 0.5 * g / norm, rtol=1e-6)


@pytest.mark.parametrize(
    "case",
    [
        dict(updater=optax.lamb(0.1)),  # not elementwise
        dict(updater=MOMENTUM, layout="keys"),  # no buckets
        dict(updater=MOMENTUM, keys=KEYS[:1]),  # not the group
        dict(updater=optax.adam(0.1), init_with=MOMENTUM),  # a state another optimizer made
    ],
)
def test_what_cannot_run_over_one_bucket_is_left_to_the_per_key_update(case):
    assert _update(**case, run=False) is None
