"""jaxkv/_src/core/collectives.py: fused sums give each block its own sum, whatever the sizes,
and blocks at the fusion limit are summed alone."""

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxkv._src.core import collectives
from jaxkv._src.jax_internals import varying_axes
from jaxkv._src.state import policy

N = 2  # devices


def _per_device(shapes, seed=0):
    """For each shape, N per-device blocks of distinct values (float32 sums are exact)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(-50, 50, size=(N, *s)).astype(np.float32) for s in shapes]


def _run(fn, stacked):
    mesh = Mesh(np.array(jax.devices("cpu")[:N]), ("kv",))
    body = jax.shard_map(
        lambda *xs: fn([x[0] for x in xs]),
        mesh=mesh,
        in_specs=tuple(P("kv") for _ in stacked),
        out_specs=P("kv"),
    )
    return [np.asarray(x) for x in jax.jit(body)(*stacked)]


def test_fused_psum_gives_each_block_its_own_sum():
    shapes = [(3,), (2, 5), (1,), (4, 1, 2)]
    stacked = _per_device(shapes)
    got = _run(lambda bs: collectives.fused_psum(bs, "kv"), stacked)
    for g, x, s in zip(got, stacked, shapes):
        # every device holds the whole sum: N copies side by side along axis 0
        np.testing.assert_array_equal(g.reshape(N, *s), np.broadcast_to(x.sum(0), (N, *s)))


def test_fused_psum_scatter_leaves_each_device_its_rows_of_each_block():
    shapes = [(2, 3), (4,), (6, 2)]  # first dimensions divisible by N
    stacked = _per_device(shapes, seed=1)
    got = _run(lambda bs: collectives.fused_psum_scatter(bs, N, "kv"), stacked)
    for g, x in zip(got, stacked):
        np.testing.assert_array_equal(g, x.sum(0))  # device i's rows, in device order


def test_blocks_at_the_scatter_fusion_limit_are_summed_alone_and_the_rest_together():
    limit = policy.SCATTER_FUSE_BELOW
    shapes = [(limit,), (limit - 2,), (4,), (2, 3)]
    stacked = _per_device(shapes, seed=2)
    scatter = [True, True, True, False]
    got = _run(lambda bs: collectives.sum_over_devices(bs, scatter, "kv"), stacked)
    for g, x, s, sc in zip(got, stacked, shapes, scatter):
        want = x.sum(0)
        np.testing.assert_array_equal(
            g, want if sc else np.broadcast_to(want, (N, *s)).reshape(-1, *s[1:])
        )


def test_sum_over_devices_never_fuses_blocks_that_vary_over_different_axes(monkeypatch):
    """On a mesh of two axes, blocks varying along 'model' (a tensor-parallel key's) and blocks
    that do not (a replicated key's) are summed over 'kv' in collectives of their own: each
    sum varies along the other axes its block did, no more, and blocks alike still share one
    collective (scattered or not, per dtype)."""
    mesh = Mesh(np.array(jax.devices("cpu")[: 2 * N]).reshape(N, 2), ("kv", "model"))
    shapes = [(4,), (2, 3), (6,), (4, 2), (2,), (8,)]
    model = [False, True, False, True, True, False]  # made to vary along 'model' too
    scatter = [False, False, True, True, True, True]
    stacked = _per_device(shapes, seed=3)
    operands = []  # the varying axes of what each collective sums
    for name in ("psum", "psum_scatter"):
        real = getattr(jax.lax, name)

        def recording(x, *args, _real=real, **kwargs):
            operands.append(varying_axes(x))
            return _real(x, *args, **kwargs)

        monkeypatch.setattr(jax.lax, name, recording)

    def body(*xs):
        blocks = [
            x[0] + jax.lax.axis_index("model").astype(x.dtype) if m else x[0]
            for x, m in zip(xs, model)
        ]
        out = collectives.sum_over_devices(blocks, scatter, "kv")
        for o, m in zip(out, model):
            assert varying_axes(o) - {"kv"} == ({"model"} if m else set())
        return [o[None, None] for o in out]  # out_specs refuse a sum typed wrongly

    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=tuple(P("kv") for _ in stacked),
        out_specs=[P("kv", "model" if m else None) for m in model],
    )
    got = [np.asarray(x) for x in jax.jit(fn)(*stacked)]
    # One collective per (scattered or not, other varying axes): four groups.
    assert len(operands) == 4
    assert sorted(map(sorted, operands)) == [["kv"], ["kv"], ["kv", "model"], ["kv", "model"]]
    for g, x, m, sc in zip(got, stacked, model, scatter):
        cols = 2 if m else 1
        for j in range(cols):  # the sum on the 'model' device j (plus j where it varies)
            want = x.sum(0) + (N * j if m else 0)
            part = g[:, j].reshape(N, -1)
            if sc:
                np.testing.assert_array_equal(part.reshape(-1), want.reshape(-1))
            else:
                np.testing.assert_array_equal(part, np.broadcast_to(want.reshape(-1), part.shape))
