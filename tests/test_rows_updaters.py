"""Updaters at a row push's door, as at a dense push's (tests/test_updater_errors.py): an optax
wrapper that is not a transformation itself (``optax.MultiSteps``) is taken as its
``gradient_transformation()``, compiled once; anything else that is no updater is refused with
what is accepted; and an exception an updater raises (traced or run: a Python updater, an optax
one's ``init`` or ``update``) is a ``jaxkv.KVStoreError`` naming the key and the updater, the
original as its ``__cause__``, with nothing changed. For ``push_rows`` and ``pushpull_rows``,
one pair and one per device, eagerly, donated and inside ``jit``, replicated and sharded tables,
per key and flat; and for the imperative store's push of row-sparse values."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _devices import cpu_empty, cpu_store
from _updaters import (
    FAILING_OPTAX,
    WRAPPER_NAMED,
    BrokenWrapper,
    NoTransformation,
    in_place,
    transformation,
)

import jaxkv
import jaxkv.mx as mx

NDEV = 8
LAYOUTS = ["keys", "flat"]
# (rows, width): replicated (8 x 3), and sharded by rows (2048 x 8, the big-array bound).
TABLES = {"small": (8, 3), "sharded": (2048, 8)}
# Each device's ids, the same at every push (with repeats, within a pair and across pairs):
# the rows a push touches are then the same each time, and lazy MultiSteps on them is
# MultiSteps on the sub-table of those rows.
IDS = {
    name: [np.array([(5 * j) % rows, (3 * j + 1) % rows], np.int32) for j in range(NDEV)]
    for name, (rows, _) in TABLES.items()
}
STEPS = 6  # with MultiSteps(k=2): the 1st, 3rd and 5th only accumulate
# Each layout with each table: a replicated array or one split over the devices, per key; a
# bucket kept whole or one split over the devices, flat. Every push form runs on the split
# bucket (the most bookkeeping); the plain push on all four.
SETUPS = [(layout, table) for layout in LAYOUTS for table in TABLES]
SPLIT_BUCKET = ("flat", "sharded")


def _table(rows, width):
    return (np.arange(rows * width, dtype=np.float32).reshape(rows, width) % 97) / 4


def _state(layout, table):
    rows, width = TABLES[table]
    values = {"e": jnp.asarray(_table(rows, width)), "b": jnp.ones(3, jnp.float32)}
    return jaxkv.init(cpu_empty(layout=layout), values)


def _grads(table, step):
    """Each device's rows of push ``step``, on the host."""
    width = TABLES[table][1]
    return [
        np.sin(np.arange(2 * width, dtype=np.float32) * (j + 1) + 3 * step)
        .reshape(2, width)
        .astype(np.float32)
        for j in range(NDEV)
    ]


def _by_hand(wrapper, table, steps):
    """``wrapper.gradient_transformation()`` by hand, with optax, on the rows the pushes touch
    (each push's rows summed by id): the table after each of ``steps`` pushes."""
    tx = wrapper.gradient_transformation()
    full = _table(*TABLES[table])
    ids = np.concatenate(IDS[table])
    touched = np.unique(ids)
    params = {"e": jnp.asarray(full[touched])}
    state = tx.init(params)
    out = []
    for step in range(steps):
        summed = np.zeros_like(full[touched])
        for i, r in zip(ids.tolist(), np.concatenate(_grads(table, step))):
            summed[np.searchsorted(touched, i)] += r
        updates, state = tx.update({"e": jnp.asarray(summed)}, state, params)
        params = optax.apply_updates(params, updates)
        full = full.copy()
        full[touched] = np.asarray(params["e"])
        out.append(full)
    return out


def _placed(rows):
    cpus = jax.devices("cpu")
    return [jax.device_put(r, cpus[j]) for j, r in enumerate(rows)]


def _one_pair(table, rows):
    return np.concatenate(IDS[table]), np.concatenate(rows)


# How a push is made: (state, table, updater, rows) -> (state, the pushed rows after it or None)
def _push_one(s, table, upd, rows):
    return jaxkv.push_rows(s, "e", *_one_pair(table, rows), updater=upd), None


def _push_donated(s, table, upd, rows):
    return jaxkv.push_rows(s, "e", *_one_pair(table, rows), updater=upd, donate=True), None


def _push_per_device(s, table, upd, rows):
    return jaxkv.push_rows(s, "e", list(IDS[table]), _placed(rows), updater=upd), None


def _pushpull_one(s, table, upd, rows):
    return jaxkv.pushpull_rows(s, "e", *_one_pair(table, rows), updater=upd)


def _pushpull_per_device(s, table, upd, rows):
    return jaxkv.pushpull_rows(s, "e", list(IDS[table]), _placed(rows), updater=upd)


def _jitted(s, table, upd, rows):
    step = jax.jit(lambda s, ids, r: jaxkv.push_rows(s, "e", ids, r, updater=upd))
    ids, r = _one_pair(table, rows)
    return step(s, jnp.asarray(ids), jnp.asarray(r)), None


HOWS = {
    "push": _push_one,
    "donated": _push_donated,
    "per-device": _push_per_device,
    "pushpull": _pushpull_one,
    "pushpull-per-device": _pushpull_per_device,
    "jit": _jitted,
}


def _pulled_ok(pulled, table, want):
    if pulled is None:
        return
    if isinstance(pulled, list):
        for ids, got in zip(IDS[table], pulled):
            np.testing.assert_allclose(np.asarray(got), want[ids], rtol=2e-6, atol=2e-6)
    else:
        want_rows = want[np.concatenate(IDS[table])]
        np.testing.assert_allclose(np.asarray(pulled), want_rows, rtol=2e-6, atol=2e-6)


INNERS = {"sgd": lambda: optax.sgd(0.1), "momentum": lambda: optax.sgd(0.1, momentum=0.9)}
# jit pushes need the optimizer state made before the step: the eager hows only, with each
# inner optimizer; jit below with init_optimizer.
_MULTISTEPS = [
    *[(layout, table, "push", "momentum") for layout, table in SETUPS],
    *[(*SPLIT_BUCKET, how, "momentum") for how in HOWS if how not in ("push", "jit")],
    (*SPLIT_BUCKET, "push", "sgd"),
]


# -- optax.MultiSteps and other wrappers with gradient_transformation() -------------------------
@pytest.mark.standard_promotion  # MultiSteps counts in int32 beside float32
@pytest.mark.parametrize(("layout", "table", "how", "inner"), _MULTISTEPS)
def test_multisteps_pushed_by_rows_equals_its_transformation_by_hand(
    layout, table, how, inner, compiles
):
    ms = optax.MultiSteps(INNERS[inner](), every_k_schedule=2)
    want = _by_hand(ms, table, STEPS)
    state = _state(layout, table)
    for step in range(STEPS):
        rows = _grads(table, step)
        if step == 2:  # from the third push on, the same computations run again
            with compiles() as c:
                state, pulled = HOWS[how](state, table, ms, rows)
            assert c.count == 0
        else:
            state, pulled = HOWS[how](state, table, ms, rows)
        np.testing.assert_allclose(np.asarray(jaxkv.pull(state, "e")), want[step], rtol=2e-6)
        _pulled_ok(pulled, table, want[step])
    # the first push applied nothing, the second did
    np.testing.assert_array_equal(want[0], _table(*TABLES[table]))
    assert not np.array_equal(want[1], want[0])
    assert list(state.opt_states) == [("e",)]
    assert isinstance(state.opt_states[("e",)], optax.MultiStepsState)
    np.testing.assert_array_equal(np.asarray(jaxkv.pull(state, "b")), np.ones(3))


@pytest.mark.standard_promotion  # MultiSteps counts in int32 beside float32
@pytest.mark.parametrize(("layout", "table"), [SPLIT_BUCKET, ("keys", "small")])
def test_multisteps_pushed_by_rows_inside_jit(layout, table, compiles):
    ms = optax.MultiSteps(optax.sgd(0.1, momentum=0.9), every_k_schedule=2)
    want = _by_hand(ms, table, 4)
    state = jaxkv.init_optimizer(_state(layout, table), ms, ["e"])
    step = jax.jit(lambda s, ids, r: jaxkv.push_rows(s, "e", ids, r, updater=ms))
    for i in range(4):
        ids, rows = _one_pair(table, _grads(table, i))
        ids, rows = jnp.asarray(ids), jnp.asarray(rows)
        if i == 2:
            with compiles() as c:
                state = step(state, ids, rows)
            assert c.count == 0
        else:
            state = step(state, ids, rows)
        np.testing.assert_allclose(np.asarray(jaxkv.pull(state, "e")), want[i], rtol=2e-6)


def _rs_values(table, rows):
    shape = TABLES[table]
    return [
        mx.nd.sparse.row_sparse_array((r, ids), shape=shape, ctx=mx.cpu(j))
        for j, (ids, r) in enumerate(zip(IDS[table], rows))
    ]


@pytest.mark.standard_promotion  # MultiSteps counts in int32 beside float32
@pytest.mark.parametrize(("layout", "setter"), [("keys", "set_optimizer"), ("flat", "set_updater")])
def test_multisteps_on_the_imperative_stores_row_sparse_push(layout, setter):
    table = "sharded"
    ms = optax.MultiSteps(optax.sgd(0.1, momentum=0.9), every_k_schedule=2)
    want = _by_hand(ms, table, 4)
    kv = cpu_store(layout=layout)
    kv.init("e", mx.nd.array(_table(*TABLES[table])))
    getattr(kv, setter)(ms)
    for i in range(4):
        kv.push("e", _rs_values(table, _grads(table, i)))
        np.testing.assert_allclose(np.asarray(kv.pull("e")), want[i], rtol=2e-6)


# -- what is refused as an updater --------------------------------------------------------------
ACCEPTED = r"expected None \(assign\), a callable updater\(key, pushed, stored\), an optax"
REFUSED = {
    "int": (3, r"given int 3(\n|$)"),
    "str": ("sgd", r"given str 'sgd'(\n|$)"),
    "object": (object(), r"given object <object object at 0x[0-9a-f]+>(\n|$)"),
}
# The hows that refuse before anything runs (donated: the same door as push).
_REFUSING = [h for h in HOWS if h != "donated"]


def _unchanged(state, table):
    np.testing.assert_array_equal(np.asarray(jaxkv.pull(state, "e")), _table(*TABLES[table]))
    np.testing.assert_array_equal(np.asarray(jaxkv.pull(state, "b")), np.ones(3))
    assert not state.opt_states


@pytest.mark.parametrize("given", list(REFUSED))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("how", _REFUSING)
def test_anything_else_is_refused_as_a_row_updater_naming_it_and_what_is_accepted(
    layout, given, how
):
    updater, named = REFUSED[given]
    table = "small"
    state = _state(layout, table)
    with pytest.raises(jaxkv.KVStoreError, match=f"updater: {ACCEPTED}.*{named}") as err:
        HOWS[how](state, table, updater, _grads(table, 0))
    assert "gradient_transformation()" in str(err.value)
    assert "optax.MultiSteps" in str(err.value)
    _unchanged(state, table)


@pytest.mark.parametrize(
    ("wrapper", "why"),
    [
        (NoTransformation(), r"gradient_transformation\(\) gave str, expected an optax"),
        (BrokenWrapper(), r"gradient_transformation\(\) raised RuntimeError: cannot make one"),
    ],
)
@pytest.mark.parametrize("how", ["push", "pushpull"])
def test_a_wrapper_that_gives_no_transformation_is_refused_by_a_row_push(wrapper, why, how):
    state = _state("keys", "small")
    with pytest.raises(jaxkv.KVStoreError, match=f"{WRAPPER_NAMED}.*{why}"):
        HOWS[how](state, "small", wrapper, _grads("small", 0))
    _unchanged(state, "small")


# -- an updater's own errors --------------------------------------------------------------------
def converts_a_tracer(key, pushed, stored):
    return stored + float(pushed[0, 0])


def raises(key, pushed, stored):
    raise ValueError("this updater refuses")


def returns_none(key, pushed, stored):
    return None


def _update_raising(updates, state, params=None):
    raise ValueError("this optimizer refuses")


# name: (updater, what names it in the message, the cause's type (None: jaxkv's own check))
ERRORS = {
    "tracer": (converts_a_tracer, "converts_a_tracer", jax.errors.ConcretizationTypeError),
    "raise": (raises, "raises", ValueError),
    "none": (returns_none, "returns_none", None),
    "optax-update": (
        transformation(optax.init_empty_state, _update_raising),
        "_update_raising",
        ValueError,
    ),
    **FAILING_OPTAX,
}


def _check(err, name, cause):
    message = str(err.value)
    assert name in message, message
    assert "'e'" in message, message
    if cause is None:
        assert err.value.__cause__ is None
    else:
        assert isinstance(err.value.__cause__, cause), repr(err.value.__cause__)
        assert type(err.value.__cause__).__name__ in message


# Every error on the plain push of each layout and table; two (a Python updater's and an optax
# one's) through every push form on the split bucket.
_FAILING = [(layout, table, error, "push") for layout, table in SETUPS for error in ERRORS] + [
    (*SPLIT_BUCKET, error, how)
    for error in ("raise", "optax-update")
    for how in HOWS
    if how != "push"
]


@pytest.mark.parametrize(("layout", "table", "error", "how"), _FAILING)
def test_a_row_updaters_error_is_a_kvstore_error_and_the_push_changes_nothing(
    layout, table, error, how
):
    updater, name, cause = ERRORS[error]
    state = _state(layout, table)
    with pytest.raises(jaxkv.KVStoreError) as err:
        HOWS[how](state, table, updater, _grads(table, 0))
    _check(err, name, cause)
    _unchanged(state, table)
    np.testing.assert_array_equal(  # and the state still takes pushes
        np.asarray(
            jaxkv.pull(jaxkv.push_rows(state, "e", [1], np.ones((1, TABLES[table][1]))), "e")
        )[1],
        np.ones(TABLES[table][1]),
    )


# The imperative store's updaters: Python ones are traced for a row push (they see the rows
# summed into a dense value), pure ones too; optax ones through set_optimizer.
_IMPERATIVE = [
    (error, setter)
    for error in ERRORS
    for setter in (
        ["set_optimizer"] if error.startswith("optax") else ["set_updater", "pure_updater"]
    )
    if error != "none"  # an in-place updater that returns None is MXNet's way: accepted
]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("error", "setter"), _IMPERATIVE)
def test_a_row_updaters_error_on_the_imperative_store_changes_nothing(layout, error, setter):
    updater, name, cause = ERRORS[error]
    table = "sharded"
    kv = cpu_store(layout=layout)
    kv.init("e", mx.nd.array(_table(*TABLES[table])))
    if setter == "set_optimizer":
        kv.set_optimizer(updater)
    elif setter == "set_updater":
        kv.set_updater(in_place(updater))
    else:
        kv.set_updater(jaxkv.pure_updater(in_place(updater)))
    with pytest.raises(jaxkv.KVStoreError) as err:
        kv.push("e", _rs_values(table, _grads(table, 0)))
        kv.pull("e")  # the store may hold the push until something reads
    _check(err, name, cause)
    np.testing.assert_array_equal(np.asarray(kv.pull("e")), _table(*TABLES[table]))
    assert not kv.state.opt_states
