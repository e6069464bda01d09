"""Updaters at a push's door: optax wrappers that are not transformations themselves
(``optax.MultiSteps``: its ``gradient_transformation()``), what is refused as an updater, and
an exception raised by an updater (traced or run, a Python updater or an optax one) surfacing
as ``jaxkv.KVStoreError`` naming the keys and the updater, the original as its ``__cause__``,
with nothing changed: the functional push and the imperative store, one key and lists, the
per-key and flat layouts, eagerly, inside ``jit`` and inside ``shard_map``."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _updaters import (
    FAILING_OPTAX,
    WRAPPER_NAMED,
    BrokenWrapper,
    NoTransformation,
    in_place,
    transformation,
)
from _variants import covering
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxkv
from jaxkv import nd

LAYOUTS = ["keys", "flat"]
VALUES = {"a": np.array([1.0, 2.0, 3.0], np.float32), "b": np.array([[4.0, 5.0]], np.float32)}
# Gradients for six pushes: with MultiSteps(k=2) the 1st, 3rd and 5th only accumulate, the
# 2nd, 4th and 6th apply the mean of the last two.
GRADS = [
    {
        k: np.asarray(np.sin(np.arange(v.size) * (j + 1) + 3 * i + 1), np.float32).reshape(v.shape)
        for j, (k, v) in enumerate(VALUES.items())
    }
    for i in range(6)
]


def _state(layout):
    return jaxkv.init(jaxkv.empty(layout=layout), {k: jnp.asarray(v) for k, v in VALUES.items()})


def _store(layout):
    kv = jaxkv.KVStore("local", layout=layout)
    kv.init(list(VALUES), [nd.array(v) for v in VALUES.values()])
    return kv


def _by_hand(wrapper, keys, steps):
    """``wrapper.gradient_transformation()`` applied by hand to the tree ``{key: value}`` of
    ``keys``: the values after each of ``steps`` pushes of GRADS."""
    tx = wrapper.gradient_transformation()
    params = {k: jnp.asarray(VALUES[k]) for k in keys}
    state = tx.init(params)
    out = []
    for grads in GRADS[:steps]:
        updates, state = tx.update({k: jnp.asarray(grads[k]) for k in keys}, state, params)
        params = optax.apply_updates(params, updates)
        out.append({k: np.asarray(v) for k, v in params.items()})
    return out


def _close(got, want):
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), want[k], rtol=2e-6, atol=2e-6)


INNERS = {"sgd": lambda: optax.sgd(0.1), "momentum": lambda: optax.sgd(0.1, momentum=0.9)}


@pytest.mark.standard_promotion  # MultiSteps counts in int32 beside float32
# -- optax.MultiSteps and other wrappers with gradient_transformation() --------------------------
@pytest.mark.parametrize(("layout", "inner", "keys"), covering(LAYOUTS, list(INNERS), ["a", "ab"]))
def test_multisteps_pushed_equals_its_transformation_by_hand(layout, inner, keys, compiles):
    keys = list(keys)
    ms = optax.MultiSteps(INNERS[inner](), every_k_schedule=2)
    want = _by_hand(ms, keys, 6)
    state = _state(layout)
    for i, grads in enumerate(GRADS):
        if i == 2:  # from the third push on, the same computations run again
            with compiles() as c:
                state = jaxkv.push(state, keys, [grads[k] for k in keys], updater=ms)
            assert c.count == 0
        else:
            state = jaxkv.push(state, keys, [grads[k] for k in keys], updater=ms)
        _close({k: state[k] for k in keys}, want[i])
    # the first push applied nothing, the second did
    np.testing.assert_array_equal(want[0][keys[0]], VALUES[keys[0]])
    assert not np.array_equal(want[1][keys[0]], VALUES[keys[0]])
    (group,) = state.opt_states
    assert group == tuple(keys)
    assert isinstance(state.opt_states[group], optax.MultiStepsState)


@pytest.mark.standard_promotion  # MultiSteps counts in int32 beside float32
@pytest.mark.parametrize("layout", LAYOUTS)
def test_multisteps_through_pushpull_init_optimizer_and_jit(layout):
    ms = optax.MultiSteps(optax.sgd(0.1, momentum=0.9), every_k_schedule=2)
    keys = ["a", "b"]
    want = _by_hand(ms, keys, 4)
    state = jaxkv.init_optimizer(_state(layout), ms)
    assert isinstance(state.opt_states[("a", "b")], optax.MultiStepsState)
    step = jax.jit(lambda s, g: jaxkv.push(s, keys, g, updater=ms))
    for i, grads in enumerate(GRADS[:4]):
        if i % 2:
            state = step(state, [jnp.asarray(grads[k]) for k in keys])
            got = {k: state[k] for k in keys}
        else:
            state, pulled = jaxkv.pushpull(state, keys, [grads[k] for k in keys], updater=ms)
            got = dict(zip(keys, pulled))
        _close(got, want[i])


@pytest.mark.standard_promotion  # MultiSteps counts in int32 beside float32
@pytest.mark.parametrize(
    ("layout", "setter", "keys"), covering(LAYOUTS, ["set_optimizer", "set_updater"], ["a", "ab"])
)
def test_multisteps_on_the_imperative_store(layout, setter, keys):
    keys = list(keys)
    ms = optax.MultiSteps(optax.sgd(0.1, momentum=0.9), every_k_schedule=2)
    want = _by_hand(ms, keys, 6)
    kv = _store(layout)
    getattr(kv, setter)(ms)
    outs = [nd.zeros(VALUES[k].shape) for k in keys]
    for i, grads in enumerate(GRADS[:5]):
        kv.push(keys, [nd.array(grads[k]) for k in keys])
        kv.pull(keys, out=outs)
        _close({k: o.asnumpy() for k, o in zip(keys, outs)}, want[i])
    # The same wrapper set again keeps the optimizer state: the 6th push applies the mean of
    # the 5th and 6th gradients (a fresh state would only accumulate the 6th).
    getattr(kv, setter)(ms)
    kv.push(keys, [nd.array(GRADS[5][k]) for k in keys])
    _close({k: np.asarray(v) for k, v in zip(keys, kv.pull(keys))}, want[5])
    assert not np.allclose(want[5][keys[0]], want[4][keys[0]])


ACCEPTED = r"expected None \(assign\), a callable updater\(key, pushed, stored\), an optax"
REFUSED = [
    (3, r"given int 3(\n|$)"),
    ("sgd", r"given str 'sgd'(\n|$)"),
    (object(), r"given object <object object at 0x[0-9a-f]+>(\n|$)"),
]


@pytest.mark.parametrize(("given", "named"), REFUSED)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_anything_else_is_refused_as_an_updater_naming_it_and_what_is_accepted(
    layout, given, named
):
    state = _state(layout)
    calls = {
        "push": lambda: jaxkv.push(state, "a", jnp.ones(3), updater=given),
        "pushpull": lambda: jaxkv.pushpull(state, ["a"], [jnp.ones(3)], updater=given),
        "jit": lambda: jax.jit(lambda s: jaxkv.push(s, "a", jnp.ones(3), updater=given))(state),
    }
    for call in calls.values():
        with pytest.raises(jaxkv.KVStoreError, match=f"updater: {ACCEPTED}.*{named}") as err:
            call()
        assert "gradient_transformation()" in str(err.value)
        assert "optax.MultiSteps" in str(err.value)
    with pytest.raises(jaxkv.KVStoreError, match=f"init_optimizer: expected an optax.*{named}"):
        jaxkv.init_optimizer(state, given)
    kv = _store(layout)
    with pytest.raises(jaxkv.KVStoreError, match=f"set_updater: {ACCEPTED}.*{named}"):
        kv.set_updater(given)
    with pytest.raises(jaxkv.KVStoreError, match=f"set_optimizer: expected an optax.*{named}"):
        kv.set_optimizer(given)
    kv.push("a", nd.ones((3,)))  # the store still assigns
    np.testing.assert_array_equal(np.asarray(kv.pull("a")), np.ones(3))


@pytest.mark.parametrize(
    ("wrapper", "why"),
    [
        (NoTransformation(), r"gradient_transformation\(\) gave str, expected an optax"),
        (BrokenWrapper(), r"gradient_transformation\(\) raised RuntimeError: cannot make one"),
    ],
)
def test_a_wrapper_that_gives_no_transformation_is_refused(wrapper, why):
    state = _state("keys")
    with pytest.raises(jaxkv.KVStoreError, match=f"{WRAPPER_NAMED}.*{why}"):
        jaxkv.push(state, "a", jnp.ones(3), updater=wrapper)
    with pytest.raises(jaxkv.KVStoreError, match=why):
        jaxkv.init_optimizer(state, wrapper)
    with pytest.raises(jaxkv.KVStoreError, match=why):
        _store("keys").set_optimizer(wrapper)


# -- an updater's own errors --------------------------------------------------------------------
def converts_a_tracer(key, pushed, stored):
    return stored + np.asarray(pushed)


def asserts(key, pushed, stored):
    assert pushed.shape == (99,), "not the shape this updater wants"
    return stored


def returns_another_shape(key, pushed, stored):
    return jnp.zeros((7,))


def _update_of_another_shape(updates, state, params=None):
    return {k: jnp.zeros((5, 7)) for k in updates}, state


def _update_asserting(updates, state, params=None):
    assert not updates, "this optimizer takes no gradients"
    return updates, state


# name: (updater, what names it in the message, the cause's type (None: jaxkv's own check))
ERRORS = {
    "tracer": (converts_a_tracer, "converts_a_tracer", jax.errors.TracerArrayConversionError),
    "assert": (asserts, "asserts", AssertionError),
    "shape": (returns_another_shape, "returns_another_shape", None),
    "optax-shape": (
        transformation(optax.init_empty_state, _update_of_another_shape),
        "_update_of_another_shape",
        ValueError,
    ),
    "optax-assert": (
        transformation(optax.init_empty_state, _update_asserting),
        "_update_asserting",
        AssertionError,
    ),
    **FAILING_OPTAX,
}
KEYS = {"one": "a", "list": ["a", "b"]}


def _check(err, name, cause, keys):
    message = str(err.value)
    assert name in message, message
    assert any(f"'{k}'" in message for k in ([keys] if isinstance(keys, str) else keys))
    if cause is None:
        assert isinstance(err.value, jaxkv.ShapeError)
    else:
        assert isinstance(err.value.__cause__, cause), repr(err.value.__cause__)
        assert type(err.value.__cause__).__name__ in message


def _values(keys):
    return jnp.ones(3) if isinstance(keys, str) else [jnp.ones(3), jnp.ones((1, 2))]


def _unchanged(state):
    for k, v in VALUES.items():
        np.testing.assert_array_equal(np.asarray(jaxkv.pull(state, k)), v)
    assert not state.opt_states


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("keys", list(KEYS))
@pytest.mark.parametrize("error", list(ERRORS))
@pytest.mark.parametrize("how", ["push", "donated", "pushpull", "jit"])
def test_an_updaters_error_is_a_kvstore_error_and_the_push_changes_nothing(
    layout, keys, error, how
):
    updater, name, cause = ERRORS[error]
    keys = KEYS[keys]
    state = _state(layout)
    calls = {
        "push": lambda: jaxkv.push(state, keys, _values(keys), updater=updater),
        "donated": lambda: jaxkv.push(state, keys, _values(keys), updater=updater, donate=True),
        "pushpull": lambda: jaxkv.pushpull(state, keys, _values(keys), updater=updater),
        "jit": lambda: jax.jit(lambda s, v: jaxkv.push(s, keys, v, updater=updater))(
            state, _values(keys)
        ),
    }
    with pytest.raises(jaxkv.KVStoreError) as err:
        calls[how]()
    _check(err, name, cause, keys)
    _unchanged(state)
    # the state still takes pushes
    new = jaxkv.push(state, keys, _values(keys))
    np.testing.assert_array_equal(np.asarray(new["a"]), np.ones(3))


# A Python updater sees concrete values (no tracer to convert), and optax is always traced.
_IMPERATIVE = [
    (error, python)
    for error in ERRORS
    for python in (False, True)
    if not (python and (error.startswith("optax") or error == "tracer"))
]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("keys", list(KEYS))
@pytest.mark.parametrize(
    ("error", "python"),
    _IMPERATIVE,
    ids=[f"{e}-{'python' if p else 'traced'}" for e, p in _IMPERATIVE],
)
def test_an_updaters_error_on_the_imperative_store_changes_nothing(layout, keys, error, python):
    updater, name, cause = ERRORS[error]
    keys = KEYS[keys]
    kv = _store(layout)
    if isinstance(updater, optax.GradientTransformation):
        kv.set_optimizer(updater)
    elif python:
        kv.set_updater(in_place(updater))
    else:
        kv.set_updater(jaxkv.pure_updater(in_place(updater)))
    outs = [nd.zeros((3,))] if isinstance(keys, str) else [nd.zeros((3,)), nd.zeros((1, 2))]
    with pytest.raises(jaxkv.KVStoreError) as err:
        # The store may hold the push until something reads: the error comes at the read.
        kv.push(
            keys, [nd.array(v) for v in _values(keys)] if isinstance(keys, list) else nd.ones(3)
        )
        kv.pull(keys, out=outs if isinstance(keys, list) else outs[0])
        [o.asnumpy() for o in outs]
    _check(err, name, cause, keys)
    for k, v in VALUES.items():
        np.testing.assert_array_equal(np.asarray(kv.pull(k)), v)
    assert not kv.state.opt_states
    kv.set_updater(None)  # and the store still takes pushes
    kv.push("a", nd.ones((3,)))
    np.testing.assert_array_equal(np.asarray(kv.pull("a")), np.ones(3))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("error", ["tracer", "assert", "optax-tracer", "optax-shape"])
def test_an_updaters_error_inside_shard_map_is_a_kvstore_error(devices, layout, error):
    updater, name, cause = ERRORS[error]
    values = {"w": jnp.zeros((8, 3)), "b": jnp.zeros(3)}
    state = jaxkv.init(jaxkv.empty(devices, bigarray_bound=8, layout=layout), values)
    if isinstance(updater, optax.GradientTransformation):
        state = jaxkv.init_optimizer(state, updater)
    specs = jaxkv.specs(state, "kv")

    def step(s, w, b):
        return jaxkv.push(s, {"w": w, "b": b[0]}, updater=updater, axis_name="kv")

    mesh = state.mesh
    w = jax.device_put(jnp.ones((64, 3)), NamedSharding(mesh, P("kv")))
    b = jax.device_put(jnp.ones((8, 3)), NamedSharding(mesh, P("kv")))
    run = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(specs, P("kv"), P("kv")), out_specs=specs)
    )
    with pytest.raises(jaxkv.KVStoreError) as err:
        run(state, w, b)
    _check(err, name, cause, ["b", "w"])
    np.testing.assert_array_equal(np.asarray(jaxkv.pull(state, "w")), np.zeros((8, 3)))


def _only_named_keys(updates, state, params=None):
    # an update that reads the tree's keys: it cannot run over a flat bucket ({"bucket": ...})
    assert set(updates) <= {"a", "b"}, f"unknown keys {sorted(updates)}"
    return updates, state


def test_an_update_that_cannot_run_over_a_bucket_runs_per_key_with_the_same_numbers():
    tx = optax.chain(
        transformation(optax.init_empty_state, _only_named_keys), optax.sgd(0.1, momentum=0.9)
    )
    keys = ["a", "b"]
    got = {}
    for layout in LAYOUTS:
        state = _state(layout)
        for grads in GRADS[:3]:
            state = jaxkv.push(state, keys, [grads[k] for k in keys], updater=tx)
        got[layout] = {k: np.asarray(state[k]) for k in keys}
    _close(got["flat"], got["keys"])
