"""jaxkv/_src/mxnet/optimizers/float32.py: the update count's bound, and beta**t and the bias-
corrected learning rate in double-float32."""

import math

import jax.numpy as jnp
import pytest

from jaxkv._src.mxnet.optimizers import float32 as fl

from ._optimizer_models import I32_MAX, f32


@pytest.mark.parametrize(("count", "after"), [(0, 1), (I32_MAX - 1, I32_MAX), (I32_MAX, I32_MAX)])
def test_the_update_count_stops_at_the_int32_maximum(count, after):
    assert int(fl.next_count(jnp.asarray(count, jnp.int32))) == after


@pytest.mark.parametrize(("beta", "bits"), [(0.5, 6), (0.8, 8), (2.0**-15, 3)])
def test_beta_to_the_t_is_exact_below_the_first_power_under_2_to_the_minus_60_and_zero_past_it(
    beta, bits
):
    # beta ** (2 ** (bits - 1)) is the last power of 2**k not below 2**-60 (2**-15: exactly it).
    assert beta ** (2 ** (bits - 1)) >= 2.0**-60 > beta ** (2**bits)
    z = jnp.zeros((), jnp.int32)
    for t in (1, 3, 2 ** (bits - 1), 2**bits - 1, 2**bits, 2**bits + 1):
        hi, lo = fl.power(beta, jnp.asarray(t, jnp.int32), z)
        got = float(hi) + float(lo)
        if t < 2**bits:
            assert got == pytest.approx(beta**t, rel=2.0**-40, abs=0), t
        else:  # 1 - beta**t is 1 in float64 from here
            assert got == 0.0, t
    # lr_t is then lr itself, not a division by zero.
    t = jnp.asarray(2**bits, jnp.int32)
    lr_t = fl.bias_corrected_lr(0.25, beta, beta, t, z)
    assert float(lr_t) == f32(0.25 * math.sqrt(1 - beta ** (2**bits)) / (1 - beta ** (2**bits)))
