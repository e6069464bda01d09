"""jaxkv/_src/core/compression.py: 2-bit codes at and around the threshold, and their packing."""

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxkv._src.core import compression

T = 0.5


def _mesh():
    return Mesh(np.array(jax.devices("cpu")[:2]), ("kv",))


def test_a_value_at_the_threshold_is_sent_and_one_below_is_kept():
    """Each device adds its block to its residual and sends +t where that reaches t, -t where
    it reaches -t (both edges included), else 0, keeping the rest."""
    blocks = np.array([[T, -T, 0.49, -0.49], [0.25, 0.0, 0.3, -0.2]], np.float32)
    residuals = np.array([[0.0, 0.0, 0.0, 0.0], [0.25, -T, 0.2, -0.3]], np.float32)
    run = jax.jit(
        jax.shard_map(
            lambda b, r: compression.compress(("2bit", T), [(True, True)], [b[0]], [r[0]], "kv"),
            mesh=_mesh(),
            in_specs=(P("kv"), P("kv")),
            out_specs=P("kv"),
        )
    )
    (sent,), (kept,) = run(blocks, residuals)
    np.testing.assert_array_equal(np.asarray(sent).reshape(2, 4), [[T, -T, 0, 0], [T, -T, T, -T]])
    np.testing.assert_allclose(
        np.asarray(kept).reshape(2, 4), [[0, 0, 0.49, -0.49], [0, 0, 0, 0]], atol=1e-7
    )


def test_a_device_that_pushed_nothing_sends_zero_and_keeps_its_residual():
    blocks = np.full((2, 3), T, np.float32)
    residuals = np.full((2, 3), 0.125, np.float32)
    run = jax.jit(
        jax.shard_map(
            lambda b, r: compression.compress(("2bit", T), [(True, False)], [b[0]], [r[0]], "kv"),
            mesh=_mesh(),
            in_specs=(P("kv"), P("kv")),
            out_specs=P("kv"),
        )
    )
    (sent,), (kept,) = run(blocks, residuals)
    np.testing.assert_array_equal(np.asarray(sent).reshape(2, 3), [[T] * 3, [0] * 3])
    np.testing.assert_array_equal(np.asarray(kept).reshape(2, 3), [[0.125] * 3, [0.125] * 3])


def test_sixteen_codes_fill_a_word_and_the_seventeenth_starts_the_next():
    codes = np.array([1] * 16 + [2], np.uint32)
    words = np.asarray(compression._pack(codes))
    assert words.tolist() == [0x55555555, 2]
    assert np.asarray(compression._pack(np.full(16, 3, np.uint32))).tolist() == [0xFFFFFFFF]


def test_the_exchange_decodes_and_sums_every_process_code_at_the_edges():
    """Two "processes" (one device each): codes at exactly +-t are sent, the rest kept."""
    blocks = np.array([[T, 0.2, -T], [T, -0.6, 0.4]], np.float32)
    residuals = np.zeros((2, 3), np.float32)
    run = jax.jit(
        jax.shard_map(
            lambda b, r: compression.exchange(("2bit", T), [False], [b[0]], [r[0]], "kv"),
            mesh=_mesh(),
            in_specs=(P("kv"), P("kv")),
            out_specs=P("kv"),
        )
    )
    (total,), (kept,) = run(blocks, residuals)
    np.testing.assert_array_equal(np.asarray(total).reshape(2, 3), [[2 * T, -T, -T]] * 2)
    np.testing.assert_allclose(
        np.asarray(kept).reshape(2, 3), [[0, 0.2, 0], [0, -0.1, 0.4]], atol=1e-7
    )
