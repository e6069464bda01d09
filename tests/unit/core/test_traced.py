"""jaxkv/_src/core/traced.py: which leaves are a device's block and of what shape, each device
keeping exactly its own rows of a sum, and the refusals of blocks without what they need."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxkv
from jaxkv._src.core import traced
from jaxkv._src.state import policy

D = 4  # devices; a sharded (8, 3) value keeps 2 rows on each (rows per device != D)
AX = "kv"  # the store's own mesh axis
W = np.arange(24, dtype=np.float32).reshape(8, 3) - 10.0
B = np.array([1.0, -2.0, 3.0], np.float32)
SDS = jax.ShapeDtypeStruct


def _store(devices, layout="keys", **values):
    """A store over ``D`` devices where values of 8 or more elements are sharded (or, with
    ``layout='flat'``, lie in one bucket split over the devices)."""
    empty = jaxkv.empty(devices[:D], bigarray_bound=8, layout=layout)
    return jaxkv.init(empty, {k: jnp.asarray(v) for k, v in (values or {"w": W, "b": B}).items()})


def _in_step(state, fn, *data, run=True):
    """``fn(state, *data)`` inside ``shard_map`` over the store's mesh, each of ``data``
    stacked per device (device d's is ``data[d]``), giving back a state: run, or only
    traced."""
    specs = jaxkv.specs(state, AX)
    step = jax.shard_map(
        fn, mesh=state.mesh, in_specs=(specs, *[P(AX)] * len(data)), out_specs=specs
    )
    data = [
        jax.device_put(x.reshape(-1, *x.shape[2:]), NamedSharding(state.mesh, P(AX))) for x in data
    ]
    if run:
        return jax.jit(step)(state, *data)
    return jax.make_jaxpr(step)(state, *data)


@pytest.mark.parametrize(
    ("shape", "n", "rows"),
    [((8, 3), 4, (2, 3)), ((8,), 8, (1,)), ((6, 3), 4, None), ((3,), 4, None), ((), 4, None)],
)
def test_a_block_of_rows_exists_only_where_the_rows_divide(shape, n, rows):
    assert traced._rows(shape, n) == rows


def test_the_expected_block_is_the_rows_per_key_and_a_padded_piece_in_a_split_bucket(devices):
    keys = _store(devices, w=W, v=np.zeros((6, 2), np.float32), b=B, s=np.float32(1))
    assert traced._expected_block(keys, "w", 4) == (2, 3)
    assert traced._expected_block(keys, "w", 8) == (1, 3)
    assert traced._expected_block(keys, "w", 3) is None  # 8 rows do not divide by 3
    # 6 rows do not divide by 4: a split bucket of its own, a padded quarter of 12 elements
    assert keys.flat_layout.parts == (D,)
    assert traced._expected_block(keys, "v", 4) == (3,)
    assert traced._expected_block(keys, "s", 1) is None  # a scalar has no rows
    flat = _store(devices, "flat", w=W, v=np.zeros((6, 2), np.float32), b=B)
    assert flat.flat_layout.parts == (D,)
    assert traced._expected_block(flat, "w", D) == (2, 3)  # rows where they divide
    assert traced._expected_block(flat, "v", D) == (3,)  # else 12 elements' padded quarter
    assert traced._expected_block(flat, "b", D) == (1,)
    assert traced._expected_block(flat, "w", 2) is None  # split over D devices, not 2


def test_a_leaf_is_a_block_where_its_shape_is_not_the_whole_or_its_bucket_is_a_chunk(devices):
    keys = _store(devices)
    assert not traced.is_block(keys, "w", keys["w"])
    assert traced.is_block(keys, "w", SDS((2, 3), jnp.float32))
    assert not traced.is_block(keys, "b", keys["b"])
    flat = _store(devices, "flat")
    assert not any(traced.is_block(flat, k, flat[k]) for k in ("w", "b"))
    seen = {}

    def step(state):
        seen.update({k: (traced.is_block(state, k, state[k]), state[k].shape) for k in "wb"})
        return state

    _in_step(flat, step, run=False)
    # inside the step the bucket's leaf is this device's chunk: "b" too is a block, (1,)
    assert seen == {"w": (True, (2, 3)), "b": (True, (1,))}


def _refused(state, fn, match):
    with pytest.raises(jaxkv.KVStoreError, match=match):
        _in_step(state, fn, run=False)


def test_blocks_pushed_without_the_axis_they_are_split_over_are_refused(devices):
    state = _store(devices)
    _refused(
        state,
        lambda s: jaxkv.push(s, "w", jnp.ones((2, 3))),
        r"keys \['w'\]: each is only this device's block.*expected axis_name=.*given none",
    )
    np.testing.assert_array_equal(np.asarray(state["w"]), W)  # the state is unchanged


def test_a_block_of_another_shape_is_refused_naming_the_expected_shapes(devices):
    state = _store(devices)
    seen = []

    def step(s):
        leaf = SDS((3, 3), jnp.float32)  # neither (8, 3) nor its (2, 3) block over 4 devices
        with pytest.raises(
            jaxkv.KVStoreError,
            match=r"key 'w': its leaf has shape \(3, 3\), "
            r"expected the whole shape \(8, 3\) or its block over axis \('kv',\) "
            r"\(4 devices\)",
        ):
            traced._block_size(s, {"w": leaf}, (AX,))
        seen.append(traced._block_size(s, {"w": s["w"]}, (AX,)))
        return s

    _in_step(state, step, run=False)
    assert seen == [D]


def test_an_optimizer_state_leaf_is_a_block_only_of_the_whole_value_s_rows_over_n():
    momentum = optax.sgd(0.1, momentum=0.5)
    stored = [SDS((2, 3), jnp.float32)]
    state = _store(jax.devices("cpu"))

    def opt(shape):
        return (optax.TraceState(trace={"w": SDS(shape, jnp.float32)}), optax.EmptyState())

    def blocks(shape, n, tx=momentum):
        whole = traced._check_structure(state, tx, ["w"], stored, opt(shape))
        flags = traced._opt_blocks(["w"], whole, opt(shape), n)
        return flags[0].trace["w"]

    assert blocks((8, 3), D) is False  # the whole value
    assert blocks((2, 3), D) is True  # its rows over 4 devices
    for shape, n in [((4, 3), D), ((2, 3), None), ((1, 3), D)]:
        with pytest.raises(
            jaxkv.KVStoreError,
            match=rf"keys \['w'\]: an optimizer-state leaf has shape \({shape[0]}, 3\), "
            r"expected \(8, 3\) or its block",
        ):
            blocks(shape, n)
    with pytest.raises(jaxkv.KVStoreError, match=r"keys \['w'\]: the optimizer state .* structure"):
        blocks((2, 3), D, optax.adam(0.1))


def test_an_optax_push_to_blocks_without_optimizer_state_is_refused(devices):
    _refused(
        _store(devices),
        lambda s: jaxkv.push(s, "w", jnp.ones((8, 3)), updater=optax.sgd(0.1), axis_name=AX),
        r"keys \['w'\]: expected optimizer state for the keys .* given none",
    )


def test_a_store_with_compression_refuses_traced_pushes_naming_the_keys(devices):
    state = jaxkv.init(
        jaxkv.empty(devices[:D], compression={"type": "fp16"}), {"b": jnp.asarray(B)}
    )
    with pytest.raises(
        jaxkv.KVStoreError, match=r"keys \['b'\]: a store with gradient compression"
    ):
        jax.make_jaxpr(lambda s, g: jaxkv.push(s, "b", g))(state, jnp.ones(3))
    np.testing.assert_array_equal(np.asarray(state["b"]), B)


def test_each_device_keeps_its_own_rows_of_every_kind_of_contribution(devices):
    """Pushed to a sharded key at once: a whole-shape value varying by device (reduce-
    scattered), a whole-shape value the same on every device (already summed: each device
    keeps its own rows of it), and a block-shaped one (this device's rows of the sum)."""
    state = _store(devices)
    rng = np.random.default_rng(0)
    g = rng.integers(-9, 9, size=(D, 8, 3)).astype(np.float32)
    block = rng.integers(-9, 9, size=(D, 2, 3)).astype(np.float32)
    summed = np.arange(24, dtype=np.float32).reshape(8, 3) * 3.0  # made on every device alike

    def step(s, g, block):
        return jaxkv.push(s, "w", [g, jnp.asarray(summed), block], axis_name=AX)

    new = _in_step(state, step, g, block)
    np.testing.assert_array_equal(np.asarray(new["w"]), g.sum(0) + summed + block.reshape(8, 3))


def test_a_whole_value_already_summed_alone_leaves_each_device_its_own_rows(devices):
    state = _store(devices)
    summed = np.arange(24, dtype=np.float32).reshape(8, 3) + 0.5

    def step(s):
        return jaxkv.push(s, "w", jnp.asarray(summed), axis_name=AX)

    np.testing.assert_array_equal(np.asarray(_in_step(state, step)["w"]), summed)


LIMIT = policy.SCATTER_FUSE_BELOW


@pytest.mark.parametrize(
    ("sizes", "fuse_all", "scatters"),
    [
        ([LIMIT, 8, LIMIT - 2], False, 2),  # one at the limit alone, the rest together
        ([LIMIT - 2, 8, LIMIT - 4], False, 1),  # all below it: together
        ([LIMIT, 8, LIMIT - 2], True, 1),  # a split bucket's keys: all together
    ],
)
def test_values_at_the_scatter_fusion_limit_are_reduce_scattered_alone(
    devices, sizes, fuse_all, scatters
):
    mesh = jax.sharding.Mesh(np.array(devices[:2]), ("d",))

    def body(*xs):  # each device's whole-shape value, varying: to be reduce-scattered
        out = traced._sum_blocks(list(enumerate(xs)), ("d",), 2, fuse_all)
        return tuple(out[i] for i in range(len(xs)))

    step = jax.shard_map(body, mesh=mesh, in_specs=(P("d"),) * 3, out_specs=(P("d"),) * 3)
    args = [SDS((2 * n,), jnp.float32) for n in sizes]  # nothing allocated: only lowered
    text = jax.jit(step).lower(*args).as_text()
    assert text.count("stablehlo.reduce_scatter") == scatters


def test_gather_gives_whole_values_from_blocks_per_key_and_from_a_split_bucket(devices):
    v = np.arange(12, dtype=np.float32).reshape(6, 2) * -1.0  # rows do not divide by 4: padded
    for layout in ("keys", "flat"):
        state = _store(devices, layout, w=W, v=v, b=B)
        specs = jaxkv.specs(state, AX)

        def step(s):
            whole = traced.gather(s, {k: s[k] for k in ("w", "v", "b")}, AX)
            return {k: x[None] for k, x in whole.items()}  # each device's copy

        got = jax.jit(jax.shard_map(step, mesh=state.mesh, in_specs=(specs,), out_specs=P(AX)))(
            state
        )
        for k, expected in {"w": W, "v": v, "b": B}.items():
            np.testing.assert_array_equal(
                np.asarray(got[k]), np.broadcast_to(expected, (D, *expected.shape))
            )


def _reverse(key, pushed, stored):
    return stored - pushed[::-1]  # moves rows: no block holds its own result


def _halve(key, pushed, stored):
    return stored * 0.5 - pushed  # elementwise


@pytest.mark.parametrize("updater", [_reverse, _halve])
def test_keys_of_a_split_bucket_padded_or_not_update_as_whole_values(devices, updater):
    v = np.arange(12, dtype=np.float32).reshape(6, 2) / 4.0  # its block: a padded piece
    state = _store(devices, "flat", w=W, v=v)
    rng = np.random.default_rng(1)
    gw = rng.integers(-9, 9, size=(D, 8, 3)).astype(np.float32)
    gv = rng.integers(-9, 9, size=(D, 6, 2)).astype(np.float32)

    def step(s, gw, gv):
        return jaxkv.push(s, ["w", "v"], [gw, gv], updater=updater, axis_name=AX)

    new = _in_step(state, step, gw, gv)
    for k, start, g in [("w", W, gw), ("v", v, gv)]:
        np.testing.assert_array_equal(np.asarray(new[k]), updater(k, g.sum(0), start))


def test_optax_on_a_padded_split_bucket_keeps_each_device_s_piece_of_its_state(devices):
    """Clipping by the global norm cannot run over a padded bucket: each key is gathered,
    updated whole, and each device keeps its piece of the value and of the momentum."""
    v = np.arange(6, dtype=np.float32) / 4.0  # 6 elements over 4 devices: padded
    clip = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.5, momentum=0.5))
    state = jaxkv.init_optimizer(_store(devices, "flat", w=W, v=v), clip)
    rng = np.random.default_rng(2)
    gw = rng.integers(-9, 9, size=(D, 8, 3)).astype(np.float32)
    gv = rng.integers(-9, 9, size=(D, 6)).astype(np.float32)

    def step(s, gw, gv):
        return jaxkv.push(s, ["v", "w"], [gv, gw], updater=clip, axis_name=AX)

    new = _in_step(state, step, gw, gv)
    total = {"w": gw.sum(0), "v": gv.sum(0)}
    norm = np.sqrt(sum((t.astype(np.float64) ** 2).sum() for t in total.values()))
    ((_, (trace, _)),) = new.opt_states.values()  # (clip's, (momentum's, lr's))
    for k, start in [("w", W), ("v", v)]:
        np.testing.assert_allclose(np.asarray(new[k]), start - 0.5 * total[k] / norm, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(trace.trace[k]), total[k] / norm, rtol=1e-5)
