"""A value big enough to split whose first dimension the device count does not divide is split all
the same in a split bucket, in every layout, with its optimizer state: never kept whole (issue
37). A value of few rows (7 over 3 devices) is flattened and padded; a table of many (35 rows)
is padded by whole rows (blocks of 12 rows, one row of zeros), so its rows are read and written
in place. Their numbers are one device's optax numbers, eagerly, in the imperative store and
inside ``shard_map``, with no recompiles."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _devices import held_per_device
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxkv

D = 3
BOUND = 64
# 84 elements in 7 rows (3 does not divide them: flattened and padded), 140 in 35 rows (padded
# by one row), 96 in 6 rows (split by rows where the layout keeps arrays of their own), 5 (below
# the bound: whole).
SHAPES = {"odd": (7, 12), "table": (35, 4), "w": (6, 16), "b": (5,)}
LAYOUTS = ["auto", "flat", "keys"]
OPT = optax.adam(0.05)
_rng = np.random.default_rng(3)
START = {k: _rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}


@pytest.fixture
def three(devices):
    return devices[:D]


def _store(devices, layout):
    s = jaxkv.empty(devices, layout=layout, bigarray_bound=BOUND)
    s = jaxkv.init(s, {k: jnp.asarray(v) for k, v in START.items()})
    return jaxkv.init_optimizer(s, OPT)


def _grads(step):
    rng = np.random.default_rng(100 + step)
    return [{k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()} for _ in range(D)]


def _reference(steps):
    params = {k: jnp.asarray(v) for k, v in START.items()}
    state = OPT.init(params)
    for step in range(steps):
        total = {k: sum(g[k] for g in _grads(step)) for k in SHAPES}
        updates, state = OPT.update(total, state, params)
        params = optax.apply_updates(params, updates)
    return params


def _close(state, want, tol=2e-6):
    for k in SHAPES:
        np.testing.assert_allclose(np.asarray(state[k]), np.asarray(want[k]), rtol=tol, atol=tol)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_big_value_three_does_not_divide_is_split_with_its_moments(layout, three):
    s = _store(three, layout)
    assert set(held_per_device(s, "odd").values()) == {-(-84 // D) * 4}  # its padded third
    assert len(held_per_device(s, "odd")) == D
    assert set(held_per_device(s, "table").values()) == {12 * 4 * 4}  # 12 of its 36 rows
    # No array of at least the bound's elements is whole on every device: values, moments.
    for x in jax.tree_util.tree_leaves(s):
        if x.size >= BOUND:
            assert x.sharding.spec == P("kv"), (layout, x.shape)
            assert {sh.data.size for sh in x.addressable_shards} == {x.size // D}
    ((adam, _),) = jaxkv.specs(s, "kv").opt_states.values()
    assert adam.mu["odd"] == adam.nu["odd"] == P("kv")


@pytest.mark.standard_promotion
@pytest.mark.parametrize("layout", LAYOUTS)
def test_eager_pushes_from_three_devices_give_optax_numbers(layout, three, compiles):
    s = _store(three, layout)
    for step in range(3):
        grads = {k: [jax.device_put(g[k], d) for g, d in zip(_grads(step), three)] for k in SHAPES}
        if step == 2:
            with compiles() as counted:
                s = jaxkv.push(s, grads, updater=OPT)
            assert counted.count == 0, layout
        else:
            s = jaxkv.push(s, grads, updater=OPT)
    _close(s, _reference(3))
    assert set(held_per_device(s, "odd").values()) == {-(-84 // D) * 4}


@pytest.mark.standard_promotion
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_shard_map_step_over_three_devices_matches_one_device_optax(layout, three, compiles):
    s = _store(three, layout)
    spec = jaxkv.specs(s, "kv")
    mesh = s.mesh

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(spec, P("kv")), out_specs=spec)
    def step(state, g):
        (g,) = jax.tree_util.tree_map(lambda x: x[0], [g])  # this device's own gradients
        return jaxkv.push(state, g, updater=OPT, axis_name="kv")

    for n in range(3):
        stacked = {k: np.stack([g[k] for g in _grads(n)]) for k in SHAPES}
        g = jax.device_put(stacked, NamedSharding(mesh, P("kv")))
        if n == 2:
            with compiles() as counted:
                s = step(s, g)
            assert counted.count == 0, layout
        else:
            s = step(s, g)
    _close(s, _reference(3), tol=2e-5)
    assert set(held_per_device(s, "odd").values()) == {-(-84 // D) * 4}


@pytest.mark.standard_promotion
def test_the_imperative_store_over_three_devices_splits_and_pulls_whole(
    three, monkeypatch, compiles
):
    """One key at a time, as MXNet code pushes: each key is its own optimizer group. From the
    third step on, nothing compiles."""
    monkeypatch.setenv("MXNET_KVSTORE_BIGARRAY_BOUND", str(BOUND))
    kv = jaxkv.KVStore("device", devices=three)
    kv.set_optimizer(OPT)
    for k in SHAPES:
        kv.init(k, jaxkv.nd.array(START[k]))
    for step in range(4):
        grads = _grads(step)
        outs = {k: [jaxkv.nd.zeros(SHAPES[k], jaxkv.cpu(i)) for i in range(D)] for k in SHAPES}
        with compiles() as counted:
            for k in SHAPES:
                kv.push(k, [jaxkv.nd.array(g[k], jaxkv.cpu(i)) for i, g in enumerate(grads)])
                kv.pull(k, out=outs[k])
            jaxkv.nd.waitall()
        if step >= 2:
            assert counted.count == 0, step
    want = _reference(4)
    for k in SHAPES:
        for o in outs[k]:
            np.testing.assert_allclose(o.asnumpy(), np.asarray(want[k]), rtol=2e-6, atol=2e-6)
    assert set(held_per_device(kv.state, "odd").values()) == {-(-84 // D) * 4}


def test_a_compressed_store_keeps_it_whole_and_says_so(three, caplog):
    s = jaxkv.empty(three, bigarray_bound=BOUND, compression={"type": "2bit", "threshold": 0.5})
    with caplog.at_level("WARNING", logger="jaxkv"):
        s = jaxkv.init(s, {k: jnp.asarray(v) for k, v in START.items()})
    assert s.flat_layout is None
    assert set(held_per_device(s, "odd").values()) == {START["odd"].nbytes}
    assert "(7, 12)" in caplog.text and "kept whole" in caplog.text


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_rows_of_a_table_padded_by_rows_are_read_and_written_in_place(layout, three):
    """A push of 2 rows costs its rows, not the table: they are addressed in the table's
    bucket (device d's block holds rows [12 d, 12 d + 12)), eagerly and inside shard_map."""
    from jaxkv._src.rows import ops as row_ops

    s = jaxkv.empty(three, layout=layout, bigarray_bound=BOUND)
    s = jaxkv.init(s, {k: jnp.asarray(v) for k, v in START.items()})
    assert row_ops._in_bucket(s, s.index("table")) is not None
    assert row_ops._in_bucket(s, s.index("odd")) is None  # its blocks are not rows
    want = START["table"].copy()
    for ids in ([0, 34, 11, 12], [34, 23, 24, 34]):  # each block's edges, the last row, repeats
        rows = np.arange(len(ids) * 4, dtype=np.float32).reshape(-1, 4) + ids[0]
        s = jaxkv.push_rows(s, "table", ids, jnp.asarray(rows), updater=lambda k, g, w: w - g)
        summed = np.zeros_like(want)  # duplicates summed, then the updater once per row
        np.add.at(summed, ids, rows)
        want[ids] = want[ids] - summed[ids]
        np.testing.assert_array_equal(np.asarray(s["table"]), want)
        np.testing.assert_array_equal(np.asarray(jaxkv.pull_rows(s, "table", ids)), want[ids])
    assert set(held_per_device(s, "table").values()) == {12 * 4 * 4}

    spec = jaxkv.specs(s, "kv")
    asked = np.array([[0, 11, 12, 34], [35, 24, 23, 1], [34, 34, 2, 13]], np.int32)

    @jax.jit
    @functools.partial(
        jax.shard_map, mesh=s.mesh, in_specs=(spec, P("kv")), out_specs=(P("kv"), P("kv"))
    )
    def blocks_and_rows(state, ids):
        block = state["table"]
        return block[None], jaxkv.pull_rows(state, "table", ids[0], axis_name="kv")[None]

    blocks, got = blocks_and_rows(s, jnp.asarray(asked))
    padded = np.concatenate([want, np.zeros((1, 4), np.float32)])
    np.testing.assert_array_equal(np.asarray(blocks), padded.reshape(D, 12, 4))
    for d in range(D):  # an id outside the table (35) selects no row: zeros
        expected = np.stack([padded[i] if i < 35 else np.zeros(4) for i in asked[d]])
        np.testing.assert_array_equal(np.asarray(got[d]), expected)


@pytest.mark.parametrize("rows", [2, 3])  # each step's batch: the gradients scaled by its rows
def test_mxnet_sgd_with_a_schedule_over_three_devices_matches_one_device(
    three, monkeypatch, rows, compiles
):
    """The imperative store as MXNet code drives it: ``mx.optimizer.SGD`` with momentum, weight
    decay, a ``FactorScheduler`` and ``rescale_grad`` set per batch size, one key at a time.
    Over 3 devices (values split padded) it gives a one-device store's numbers, and changing
    learning rates compile nothing from the third step on."""
    import jaxkv.mx as mx

    monkeypatch.setenv("MXNET_KVSTORE_BIGARRAY_BOUND", str(BOUND))

    def run(devices):
        kv = jaxkv.KVStore("device", devices=devices)
        sched = mx.lr_scheduler.FactorScheduler(step=1, factor=0.5, base_lr=0.1)
        kv.set_optimizer(
            mx.optimizer.SGD(
                learning_rate=0.1, momentum=0.9, wd=1e-3, rescale_grad=1 / rows, lr_scheduler=sched
            )
        )
        for k in SHAPES:
            kv.init(k, jaxkv.nd.array(START[k]))
        counts = []
        for step in range(4):
            grads = _grads(step)
            with compiles() as counted:
                for k in SHAPES:
                    total = sum(g[k] for g in grads)  # one device: the three devices' sum
                    per = [g[k] for g in grads] if len(devices) == D else [total]
                    kv.push(k, [jaxkv.nd.array(x, jaxkv.cpu(i)) for i, x in enumerate(per)])
                jaxkv.nd.waitall()
            counts.append(counted.count)
        outs = {k: jaxkv.nd.zeros(SHAPES[k], jaxkv.cpu(0)) for k in SHAPES}
        for k in SHAPES:
            kv.pull(k, out=outs[k])
        return {k: o.asnumpy() for k, o in outs.items()}, counts, kv

    split, counts, kv = run(three)
    assert counts[2:] == [0, 0], counts
    assert set(held_per_device(kv.state, "table").values()) == {12 * 4 * 4}
    whole, _, _ = run(three[:1])
    for k in SHAPES:
        np.testing.assert_allclose(split[k], whole[k], rtol=2e-6, atol=2e-6, err_msg=k)
