"""``jaxkv.pull_rows`` and ``jaxkv.push_rows`` against a NumPy model of a table, eagerly, inside
``jit``, ``shard_map`` and ``pmap``, for replicated and sharded tables in every layout.

The model: a push sums every pushed row by id (across pairs, duplicates included), then for the
distinct ids only: assign (no updater), ``stored + 2 * pushed`` (an MXNet-style updater, which
sees the summed rows in a table of zeros), or optax on the rows (the touched rows of the value
and of the per-parameter state; the step count once per push). Rows not pushed never change.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _devices import SPLIT_BOUND, cpu_empty
from _variants import covering
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import jaxkv

NDEV = 8
# (rows, width): replicated (8 x 3), sharded by rows (2048 x 8 = 16K elements, the big-array
# bound), and a table of 2050 rows, whose rows do not divide by 8: split all the same, in blocks
# of 257 rows (the last one ending in 6 rows of zeros), read and written in place.
TABLES = {"small": (8, 3), "sharded": (2048, 8), "odd": (2050, 8)}
LAYOUTS = ["keys", "flat", "auto"]
SGD = optax.sgd(0.5, momentum=0.9)
ADAM = optax.adam(0.25)


def _add(key, pushed, stored):
    return stored + 2 * pushed


def _table(rows: int, width: int) -> np.ndarray:
    return (np.arange(rows * width, dtype=np.float32).reshape(rows, width) % 97) / 4


def _store(layout: str, table: str = "sharded", **options) -> jaxkv.KVState:
    rows, width = TABLES[table]
    values = {"e": jnp.asarray(_table(rows, width)), "b": jnp.ones(3, jnp.float32)}
    options.setdefault("bigarray_bound", SPLIT_BOUND)  # (a table at least that big is split)
    return jaxkv.init(cpu_empty(layout=layout, **options), values)


def _model_push(table, opt, ids, rows, updater):
    """The NumPy model of one push: ``(table, opt)`` after it."""
    table = table.copy()
    ids = np.asarray(ids).ravel()
    summed: dict[int, np.ndarray] = {}
    for i, r in zip(ids.tolist(), np.asarray(rows)):
        summed[i] = summed.get(i, 0) + r
    unique = np.array(sorted(summed), dtype=np.int64)
    if not unique.size:
        return table, opt
    grads = np.stack([summed[i] for i in unique.tolist()]).astype(np.float32)
    if updater is None:
        table[unique] = grads
    elif updater is _add:
        table[unique] = table[unique] + 2 * grads
    else:  # optax on the touched rows
        if opt is None:
            opt = updater.init({"e": jnp.asarray(table)})
        rows_of = optax.tree_utils.tree_map_params(updater, lambda x: x[unique], opt)
        updates, new = updater.update(
            {"e": jnp.asarray(grads)}, rows_of, {"e": jnp.asarray(table[unique])}
        )
        table[unique] = np.asarray(
            optax.apply_updates({"e": jnp.asarray(table[unique])}, updates)["e"]
        )
        mask = optax.tree_utils.tree_map_params(
            updater, lambda x: True, opt, transform_non_params=lambda x: False
        )
        opt = jax.tree_util.tree_map(
            lambda rowwise, old, n: _set_rows(old, unique, n) if rowwise else n, mask, opt, new
        )
    return table, opt


def _set_rows(old, unique, new):
    out = np.array(old, copy=True)
    out[unique] = np.asarray(new)
    return out


def _close(got, want, exact: bool):
    if exact:
        np.testing.assert_array_equal(np.asarray(got), want)
    else:
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-6, atol=2e-6)


# -- the model, eagerly ------------------------------------------------------------------------
ID_COUNTS = (1, 6)  # a small fixed pool of request sizes: each compiles once
UPDATERS = {"assign": None, "add": _add, "sgd": SGD, "adam": ADAM}


@st.composite
def _pushes(draw, n_rows):
    """A push: 1 pair, or one per device (8), or 3 pairs; ids with repeats, unsorted."""
    pairs = draw(st.sampled_from([1, 3, NDEV]))
    n = draw(st.sampled_from(ID_COUNTS))
    out = []
    for _ in range(pairs):
        ids = draw(st.lists(st.integers(0, n_rows - 1), min_size=n, max_size=n))
        scale = draw(st.sampled_from([0.5, 1.0, -2.0]))
        out.append((np.array(ids, np.int32), scale))
    return out


@pytest.mark.standard_promotion  # optax's Adam
# Each pair of an updater, a table and a layout in make test; all 36 in make test-deep.
@pytest.mark.parametrize(
    ("updater", "table", "layout"), covering(list(UPDATERS), list(TABLES), LAYOUTS)
)
@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_pushes_and_pulls_of_rows_follow_the_model(layout, table, updater, data):
    devices = jax.devices("cpu")
    rows, width = TABLES[table]
    state = _store(layout, table)
    model, opt = _table(rows, width), None
    upd = UPDATERS[updater]
    exact = updater in ("assign", "add")
    for _ in range(data.draw(st.integers(1, 3))):
        push = data.draw(_pushes(rows))
        ids = [i for i, _ in push]
        values = [
            jax.device_put(
                jnp.full((len(i), width), s, jnp.float32) + jnp.arange(width, dtype=jnp.float32),
                devices[j % NDEV],
            )
            for j, (i, s) in enumerate(push)
        ]
        one = len(push) == 1 and data.draw(st.booleans())
        args = (ids[0], values[0]) if one else (ids, values)
        fused = data.draw(st.booleans())
        if fused:  # push then pull of the same ids, in one computation where it can be
            state, pulled = jaxkv.pushpull_rows(state, "e", *args, updater=upd)
        else:
            state = jaxkv.push_rows(state, "e", *args, updater=upd)
        model, opt = _model_push(
            model, opt, np.concatenate(ids), np.concatenate([np.asarray(v) for v in values]), upd
        )
        if fused and one:
            _close(pulled, model[ids[0]], exact)
        elif fused:
            assert len(pulled) == len(ids)
            for x, got, j in zip(ids, pulled, range(len(ids))):
                assert got.devices() == {devices[j]}
                _close(got, model[x], exact)
        _close(jaxkv.pull(state, "e"), model, exact)
        asked = data.draw(st.lists(st.integers(0, rows - 1), min_size=5, max_size=5))
        _close(jaxkv.pull_rows(state, "e", asked), model[asked], exact)
        kept = np.zeros_like(model)
        kept[asked] = model[asked]
        _close(jaxkv.row_sparse_pull(state, "e", asked), kept, exact)
    np.testing.assert_array_equal(jaxkv.pull(state, "b"), np.ones(3))  # the other key untouched


# -- what a pull gives ---------------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
def test_pull_rows_keeps_order_repeats_and_the_id_shape_flattened(layout):
    state = _store(layout)
    want = _table(*TABLES["sharded"])
    ids = np.array([[7, 2047], [0, 7]])
    out = jaxkv.pull_rows(state, "e", ids)
    assert out.shape == (4, 8)
    np.testing.assert_array_equal(out, want[ids.ravel()])
    np.testing.assert_array_equal(jaxkv.pull_rows(state, "e", np.array([3.0, 1.0])), want[[3, 1]])


def test_pull_rows_to_devices_is_replicated_on_exactly_those(devices):
    state = _store("keys")
    out = jaxkv.pull_rows(state, "e", [5, 9], devices=[devices[2], devices[5]])
    assert out.sharding.device_set == {devices[2], devices[5]}
    assert out.is_fully_replicated
    np.testing.assert_array_equal(out, _table(*TABLES["sharded"])[[5, 9]])


def test_pull_rows_of_no_rows():
    out = jaxkv.pull_rows(_store("keys"), "e", np.zeros(0, np.int64))
    assert out.shape == (0, 8)


@pytest.mark.parametrize(
    "ids", [[-1], [2048], [0.5], ["a"], [2**40]], ids=["negative", "past", "fraction", "str", "big"]
)
def test_ids_outside_the_table_are_refused_eagerly(ids):
    state = _store("keys")
    with pytest.raises(
        jaxkv.KVStoreError, match=r"key 'e': row_ids expected integers in \[0, 2048\)"
    ):
        jaxkv.pull_rows(state, "e", ids)
    with pytest.raises(jaxkv.KVStoreError, match="row_ids expected integers"):
        jaxkv.push_rows(state, "e", ids, jnp.ones((1, 8)))
    np.testing.assert_array_equal(jaxkv.pull(state, "e"), _table(*TABLES["sharded"]))


def test_a_scalar_has_no_rows():
    state = jaxkv.init(cpu_empty(), {"s": jnp.float32(1)})
    with pytest.raises(jaxkv.ShapeError, match="key 's': pull_rows expects a value with rows"):
        jaxkv.pull_rows(state, "s", [0])
    with pytest.raises(jaxkv.ShapeError, match="push_rows expects a value with rows"):
        jaxkv.push_rows(state, "s", [0], jnp.ones(1))


def test_rows_of_the_wrong_shape_or_pairing_are_refused():
    state = _store("keys")
    with pytest.raises(jaxkv.ShapeError, match=r"has shape \(2, 7\), expected \(2, 8\)"):
        jaxkv.push_rows(state, "e", [0, 1], jnp.ones((2, 7)))
    with pytest.raises(jaxkv.ShapeError, match="given 2 row_ids and 3 rows"):
        jaxkv.push_rows(state, "e", [[0], [1]], [jnp.ones((1, 8))] * 3)
    with pytest.raises(jaxkv.ShapeError, match=r"rows 1 has shape \(2, 8\), expected \(1, 8\)"):
        jaxkv.push_rows(state, "e", [[0], [1]], [jnp.ones((1, 8)), jnp.ones((2, 8))])
    with pytest.raises(jaxkv.UnknownKeyError):
        jaxkv.push_rows(state, "nope", [0], jnp.ones((1, 8)))


def test_an_optimizer_group_of_several_keys_is_refused():
    state = jaxkv.init_optimizer(_store("keys"), SGD)  # one group: ('b', 'e')
    with pytest.raises(jaxkv.KVStoreError, match="expected exactly the keys of group"):
        jaxkv.push_rows(state, "e", [0], jnp.ones((1, 8)), updater=SGD)


def test_the_push_is_pure_unless_donated():
    state = _store("keys")
    new = jaxkv.push_rows(state, "e", [3], jnp.zeros((1, 8)))
    np.testing.assert_array_equal(jaxkv.pull(state, "e"), _table(*TABLES["sharded"]))
    assert float(jaxkv.pull(new, "e")[3].sum()) == 0
    donated = jaxkv.push_rows(new, "e", [4], jnp.zeros((1, 8)), donate=True)
    assert float(jaxkv.pull(donated, "e")[3:5].sum()) == 0


@pytest.mark.standard_promotion
def test_a_sharded_table_stays_sharded_and_its_optimizer_state_too(devices):
    state = _store("keys")
    state = jaxkv.push_rows(state, "e", [1, 2000], jnp.ones((2, 8)), updater=ADAM)
    assert state["e"].sharding.spec == P("kv")
    mu = state.opt_states[("e",)][0].mu["e"]
    assert mu.sharding.spec == P("kv")
    touched = np.flatnonzero(np.asarray(mu).any(axis=1))
    assert touched.tolist() == [1, 2000]


@pytest.mark.standard_promotion
def test_repeated_pushes_compile_once(compiles):
    state = _store("keys")
    step = 0
    with compiles() as c:
        for _ in range(4):
            ids = np.random.default_rng(step).integers(0, 2048, 6)
            state = jaxkv.push_rows(state, "e", ids, jnp.ones((6, 8)), updater=ADAM, donate=True)
            jaxkv.pull_rows(state, "e", ids)
            step += 1
        first = c.count
        for _ in range(3):
            ids = np.random.default_rng(step).integers(0, 2048, 6)
            state = jaxkv.push_rows(state, "e", ids, jnp.ones((6, 8)), updater=ADAM, donate=True)
            jaxkv.pull_rows(state, "e", ids)
            step += 1
    assert c.count == first


# -- inside the user's trace ---------------------------------------------------------------------
@pytest.mark.standard_promotion
@pytest.mark.parametrize("layout", LAYOUTS)
def test_inside_jit_the_same_as_eagerly(layout):
    state = _store(layout)
    ids = jnp.array([5, 1, 5, 2047], jnp.int32)
    rows = jnp.arange(32, dtype=jnp.float32).reshape(4, 8)

    @jax.jit
    def step(s, ids, rows):
        s, fused = jaxkv.pushpull_rows(s, "e", ids, rows, updater=ADAM)
        s = jaxkv.push_rows(s, "e", ids, -rows, updater=ADAM)
        s = jaxkv.push_rows(s, "e", ids, rows, updater=ADAM)
        pulled = jaxkv.pull_rows(s, "e", ids)
        return s, fused, pulled, jaxkv.row_sparse_pull(s, "e", ids)

    eager = jaxkv.push_rows(state, "e", np.asarray(ids), rows, updater=ADAM)
    first = jaxkv.pull_rows(eager, "e", np.asarray(ids))
    eager = jaxkv.push_rows(eager, "e", np.asarray(ids), -rows, updater=ADAM)
    eager = jaxkv.push_rows(eager, "e", np.asarray(ids), rows, updater=ADAM)
    traced = jaxkv.init_optimizer(state, ADAM, ["e"])
    new, fused, pulled, kept = step(traced, ids, rows)
    np.testing.assert_allclose(fused, first, rtol=1e-6)
    np.testing.assert_allclose(jaxkv.pull(new, "e"), jaxkv.pull(eager, "e"), rtol=1e-6)
    np.testing.assert_allclose(pulled, jaxkv.pull_rows(eager, "e", np.asarray(ids)), rtol=1e-6)
    np.testing.assert_allclose(kept, jaxkv.row_sparse_pull(eager, "e", np.asarray(ids)), rtol=1e-6)


def test_inside_jit_ids_outside_the_table_select_and_update_nothing():
    state = _store("keys")
    ids = jnp.array([-1, 2048, 3], jnp.int32)

    @jax.jit
    def step(s, ids):
        s = jaxkv.push_rows(s, "e", ids, jnp.full((3, 8), 100.0))
        return s, jaxkv.pull_rows(s, "e", ids)

    new, pulled = step(state, ids)
    want = _table(*TABLES["sharded"])
    want[3] = 100.0
    np.testing.assert_array_equal(jaxkv.pull(new, "e"), want)
    np.testing.assert_array_equal(pulled, np.stack([np.zeros(8), np.zeros(8), want[3]]))


def _shard_map(state, body, in_specs, out_specs):
    return jax.jit(jax.shard_map(body, mesh=state.mesh, in_specs=in_specs, out_specs=out_specs))


@pytest.mark.parametrize("layout", ["keys", "flat"])
def test_inside_shard_map_each_device_pushes_and_pulls_its_own_rows(layout):
    state = jaxkv.init_optimizer(_store(layout), SGD, ["e"])
    spec = jaxkv.specs(state, "kv")
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 2048, (NDEV, 5)).astype(np.int32)
    ids[3, 0] = ids[0, 0]  # the same row from two devices: summed
    rows = rng.normal(size=(NDEV, 5, 8)).astype(np.float32)

    def body(s, ids, rows):
        s = jaxkv.push_rows(s, "e", ids[0], rows[0], updater=SGD, axis_name="kv")
        return s, jaxkv.pull_rows(s, "e", ids[0], axis_name="kv")[None]

    def fused(s, ids, rows):
        s, got = jaxkv.pushpull_rows(s, "e", ids[0], rows[0], updater=SGD, axis_name="kv")
        return s, got[None]

    eager = jaxkv.push_rows(state, "e", list(ids), [jnp.asarray(r) for r in rows], updater=SGD)
    want = np.stack([np.asarray(jaxkv.pull_rows(eager, "e", i)) for i in ids])
    for fn in (body, fused):
        step = _shard_map(state, fn, (spec, P("kv"), P("kv")), (spec, P("kv")))
        new, pulled = step(state, ids, rows)
        np.testing.assert_allclose(jaxkv.pull(new, "e"), jaxkv.pull(eager, "e"), rtol=1e-6)
        np.testing.assert_allclose(pulled, want, rtol=1e-6)


def test_inside_shard_map_a_pair_the_same_on_every_device_counts_once():
    state = _store("keys")
    spec = jaxkv.specs(state, "kv")

    def body(s, ids, rows):  # ids and rows replicated: invariant along the axis
        return jaxkv.push_rows(s, "e", ids, rows, updater=_add, axis_name="kv")

    step = _shard_map(state, body, (spec, P(), P()), spec)
    new = step(state, jnp.array([9, 1500], jnp.int32), jnp.ones((2, 8), jnp.float32))
    want = _table(*TABLES["sharded"])
    want[[9, 1500]] += 2
    np.testing.assert_array_equal(jaxkv.pull(new, "e"), want)


def test_under_pmap_per_device_pairs_are_summed(devices):
    state = jaxkv.init(cpu_empty(bigarray_bound=None), {"e": jnp.zeros((6, 2))})
    ids = np.array([[d % 6] for d in range(NDEV)], np.int32)
    rows = np.ones((NDEV, 1, 2), np.float32)

    def step(s, ids, rows):
        return jaxkv.pull(jaxkv.push_rows(s, "e", ids, rows, axis_name="i"), "e")

    new = jax.pmap(step, axis_name="i", in_axes=(None, 0, 0), devices=devices)(state, ids, rows)
    want = np.zeros((6, 2))
    np.add.at(want, ids.ravel(), 1.0)
    for d in range(NDEV):  # the same on every device
        np.testing.assert_array_equal(np.asarray(new)[d], want)


@pytest.mark.parametrize("table", ["small", "sharded"])
def test_pull_rows_with_ids_per_device_gives_each_device_its_rows(table, devices):
    rows, width = TABLES[table]
    state = _store("keys", table)
    want = _table(rows, width)
    ids = [np.array([d % rows, rows - 1, (3 * d) % rows]) for d in range(NDEV)]
    out = jaxkv.pull_rows(state, "e", ids)
    assert len(out) == NDEV
    for d, x in enumerate(out):
        assert x.devices() == {devices[d]}
        np.testing.assert_array_equal(x, want[ids[d]])
    some = jaxkv.pull_rows(state, "e", [[1], [2, 3]], devices=[devices[6], devices[1]])
    assert some[0].devices() == {devices[6]} and some[1].devices() == {devices[1]}
    np.testing.assert_array_equal(some[1], want[[2, 3]])
    with pytest.raises(jaxkv.ShapeError, match="expected one row_ids per device"):
        jaxkv.pull_rows(state, "e", [[1], [2]], devices=[devices[0]])


@pytest.mark.parametrize("spread", ["one-block", "every-block", "mixed"])
def test_rows_routed_to_their_owners_whatever_the_spread(spread, devices):
    """One pair per device into a sharded table goes straight to the owners of its ids (an
    all-to-all sized by the busiest owner): skewed, even and mixed requests give the model."""
    rows, width = TABLES["sharded"]
    block = rows // NDEV
    rng = np.random.default_rng(len(spread))
    if spread == "one-block":  # every id in device 3's block: the busiest route takes them all
        ids = [rng.integers(3 * block, 4 * block, 9) for _ in range(NDEV)]
    elif spread == "every-block":
        ids = [np.arange(NDEV) * block + d for d in range(NDEV)]
        ids = [np.concatenate([x, x[:1]]) for x in ids]  # and one repeat each
    else:
        ids = [rng.integers(0, rows, 9) for _ in range(NDEV)]
    values = [
        jax.device_put(jnp.asarray(rng.normal(size=(len(x), width)), jnp.float32), devices[d])
        for d, x in enumerate(ids)
    ]
    state = _store("keys")
    model = _table(rows, width)
    for upd in (None, _add, SGD):
        state = jaxkv.push_rows(state, "e", ids, values, updater=upd)
        model, _ = _model_push(
            model,
            None,
            np.concatenate(ids),
            np.concatenate([np.asarray(v) for v in values]),
            upd,
        )
        _close(jaxkv.pull(state, "e"), model, exact=False)
        pulled = jaxkv.pull_rows(state, "e", ids)
        for x, got in zip(ids, pulled):
            _close(got, model[x], exact=False)
        again, fused = jaxkv.pushpull_rows(state, "e", ids, values, updater=upd)
        pushed = jaxkv.push_rows(state, "e", ids, values, updater=upd)
        _close(jaxkv.pull(again, "e"), np.asarray(jaxkv.pull(pushed, "e")), exact=True)
        for got, want in zip(fused, jaxkv.pull_rows(pushed, "e", ids)):
            _close(got, np.asarray(want), exact=True)


@pytest.mark.parametrize(
    ("dtype", "shape"),
    [("float32", (2048, 4, 2)), ("int32", (2048, 8)), ("bfloat16", (2048, 8)), ("bool", (2048, 8))],
)
def test_routed_rows_of_any_dtype_and_row_shape(dtype, shape, devices):
    """The routed push carries each row's id beside it (a column of the rows bit cast to int32
    where their items are 4 bytes, else in an all-to-all of its own): every dtype and row shape
    arrives whole, and pushpull_rows gives what push_rows then pull_rows give."""
    rng = np.random.default_rng(7)
    table = (rng.integers(0, 5, shape) > 2) if dtype == "bool" else rng.integers(-9, 9, shape)
    state = jaxkv.init(
        cpu_empty(layout="keys", bigarray_bound=SPLIT_BOUND), {"e": jnp.asarray(table, dtype)}
    )
    assert state.is_sharded(shape)
    ids = [rng.integers(0, shape[0], 7).astype(np.int32) for _ in range(NDEV)]
    ids[2][:3] = ids[5][:3]  # repeats across devices: assigned their sum
    values = [
        jax.device_put(jnp.asarray(rng.integers(0, 2, (7, *shape[1:])), dtype), d) for d in devices
    ]
    want = np.asarray(jnp.asarray(table, dtype)).copy()
    summed: dict[int, np.ndarray] = {}
    for x, v in zip(ids, values):
        for i, r in zip(x.tolist(), np.asarray(v)):
            summed[i] = summed[i] + r if i in summed else r
    for i, r in summed.items():
        want[i] = r
    for fused in (False, True):
        if fused:
            new, pulled = jaxkv.pushpull_rows(state, "e", ids, values)
        else:
            new = jaxkv.push_rows(state, "e", ids, values)
            pulled = jaxkv.pull_rows(new, "e", ids)
        got = jaxkv.pull(new, "e")
        assert got.dtype == jnp.dtype(dtype)
        np.testing.assert_array_equal(np.asarray(got), want)
        for x, p, d in zip(ids, pulled, devices):
            assert p.devices() == {d}
            np.testing.assert_array_equal(np.asarray(p), want[x])


@pytest.mark.standard_promotion  # optax's Adam
@pytest.mark.parametrize("table", ["small", "sharded"])
@pytest.mark.parametrize("updater", ["assign", "adam"])
def test_pushpull_rows_with_other_pull_ids_gives_push_then_pull(table, updater, devices):
    """The next batch's rows pulled in the push's computation (``pull_ids``): per device, as
    many each (one computation on a sharded table) or not, and for one pair."""
    rows, width = TABLES[table]
    upd = UPDATERS[updater]
    rng = np.random.default_rng(3)
    ids = [rng.integers(0, rows, 6).astype(np.int32) for _ in range(NDEV)]
    values = [
        jax.device_put(jnp.asarray(rng.normal(size=(6, width)), jnp.float32), d) for d in devices
    ]
    same = [jax.device_put(rng.integers(0, rows, 5).astype(np.int32), d) for d in devices]
    uneven = [np.arange(d % 3) for d in range(NDEV)]
    state = _store("keys", table)
    pushed = jaxkv.push_rows(state, "e", ids, values, updater=upd)
    for asked in (same, uneven):
        new, got = jaxkv.pushpull_rows(state, "e", ids, values, pull_ids=asked, updater=upd)
        np.testing.assert_array_equal(jaxkv.pull(new, "e"), jaxkv.pull(pushed, "e"))
        for g, w, d in zip(got, jaxkv.pull_rows(pushed, "e", asked), devices):
            assert g.devices() == {d}
            np.testing.assert_array_equal(g, w)
    new, got = jaxkv.pushpull_rows(state, "e", ids[0], values[0], pull_ids=[1, 0, 1], updater=upd)
    alone = jaxkv.push_rows(state, "e", ids[0], values[0], updater=upd)
    np.testing.assert_array_equal(got, jaxkv.pull_rows(alone, "e", [1, 0, 1]))


@pytest.mark.standard_promotion  # optax's Adam
@pytest.mark.parametrize("updater", ["assign", "adam"])
def test_a_store_of_one_device_pulls_in_the_push_whatever_the_order_of_the_ids(updater, devices):
    """On one device the pull runs in the push's computation, told when its ids are sorted and
    distinct: ids in any order, repeated, or past the padding give what a pull after the push
    gives; rows made on the host (NumPy) push as the same rows on the device."""
    upd = UPDATERS[updater]
    rows, width = TABLES["odd"]
    state = jaxkv.init(jaxkv.empty(devices[:1]), {"e": jnp.asarray(_table(rows, width))})
    rng = np.random.default_rng(5)
    ids = np.sort(rng.choice(rows, 37, replace=False)).astype(np.int32)
    values = rng.normal(size=(37, width)).astype(np.float32)
    alone = jaxkv.push_rows(state, "e", ids, jnp.asarray(values), updater=upd)
    for asked in (ids, ids[::-1], [5, 1, 5, 0, rows - 1], [0], np.arange(41)):
        for pushed in (values, jnp.asarray(values)):
            # (a list of one pair per device: the pull fused into the push's computation)
            new, got = jaxkv.pushpull_rows(
                state, "e", [ids], [pushed], pull_ids=[asked], updater=upd
            )
            np.testing.assert_array_equal(jaxkv.pull(new, "e"), jaxkv.pull(alone, "e"))
            np.testing.assert_array_equal(got[0], jaxkv.pull_rows(alone, "e", asked))
            assert got[0].shape == (len(asked), width)


def test_pushpull_rows_refuses_pull_ids_before_it_pushes():
    state = _store("keys")
    ids = [np.array([d]) for d in range(NDEV)]
    values = [jnp.ones((1, 8)) for _ in range(NDEV)]
    bad = [np.array([0])] * (NDEV - 1) + [np.array([4096])]
    with pytest.raises(jaxkv.KVStoreError, match="4096"):
        jaxkv.pushpull_rows(state, "e", ids, values, pull_ids=bad, donate=True)
    with pytest.raises(jaxkv.ShapeError, match="one per pair"):
        jaxkv.pushpull_rows(state, "e", ids, values, pull_ids=[0, 1], donate=True)
    with pytest.raises(jaxkv.KVStoreError, match="-1"):
        jaxkv.pushpull_rows(state, "e", [0], jnp.ones((1, 8)), pull_ids=[-1], donate=True)
    np.testing.assert_array_equal(jaxkv.pull(state, "e"), _table(*TABLES["sharded"]))  # not donated


@pytest.mark.parametrize("table", ["small", "sharded"])
@pytest.mark.parametrize("updater", ["assign", "sgd"])
def test_a_push_of_no_rows_changes_nothing(table, updater, devices):
    rows, width = TABLES[table]
    state = _store("keys", table)
    upd = UPDATERS[updater]
    none = np.zeros(0, np.int32)
    empty = [jax.device_put(jnp.zeros((0, width), jnp.float32), d) for d in devices]
    for new in (
        jaxkv.push_rows(state, "e", [none] * NDEV, empty, updater=upd),
        jaxkv.push_rows(state, "e", none, jnp.zeros((0, width), jnp.float32), updater=upd),
    ):
        np.testing.assert_array_equal(jaxkv.pull(new, "e"), _table(rows, width))
    assert [x.shape for x in jaxkv.pull_rows(state, "e", [none] * NDEV)] == [(0, width)] * NDEV


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bound", [None, 16])
def test_rows_of_no_ids_are_whole_on_the_stores_devices(layout, bound, devices):
    """Found by the deep stateful run: with no ids the result needs no input, and it landed on
    one device, so a compressed store took it as one device's push. With the bound 16 the
    three small keys fill a bucket split over the devices (the second finding)."""
    values = {k: jnp.full((2, 3), k + 1.0) for k in range(3)}
    state = jaxkv.init(cpu_empty(layout=layout, bigarray_bound=bound), values)
    for ids in ([], [1]):
        out = jaxkv.row_sparse_pull(state, 0, ids)
        assert out.sharding.device_set == set(devices) and out.is_fully_replicated
        want = np.zeros((2, 3))
        want[ids] = 1
        np.testing.assert_array_equal(out, want)
        rows = jaxkv.pull_rows(state, 0, ids)
        assert rows.sharding.device_set == set(devices) and rows.is_fully_replicated
        np.testing.assert_array_equal(rows, np.ones((len(ids), 3)))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_compressed_store_refuses_its_own_row_sparse_pull_of_no_rows(layout, monkeypatch):
    """The imperative form of the finding above: what ``kv.row_sparse_pull`` returns spans the
    store's devices, as ``kv.pull``'s does, so a 2-bit store refuses it as a push value."""
    monkeypatch.setenv("MXNET_KVSTORE_BIGARRAY_BOUND", "16")
    kv = jaxkv.KVStore("device", devices=jax.devices("cpu"), layout=layout)
    kv.init([0, 1], [jaxkv.nd.zeros((2, 3))] * 2)
    kv.init(2, jaxkv.nd.zeros((2, 3)))  # a bucket split over the devices under "flat"
    pulled = [kv.row_sparse_pull(0, row_ids=jaxkv.nd.array(ids)) for ids in ([], [1])]
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    for got in pulled:
        assert got.sharding.device_set == set(jax.devices("cpu"))
        with pytest.raises(jaxkv.KVStoreError, match="several devices"):
            kv.push(0, got)
