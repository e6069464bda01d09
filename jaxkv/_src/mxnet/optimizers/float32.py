"""float32 arithmetic in MXNet's order under XLA: each product rounded on its own, and the
learning-rate coefficients MXNet's Python computes in float64 computed in double-float32.

XLA fuses a product into the sum that uses it (an FMA: one rounding where MXNet's CPU kernels
round twice); :func:`rounded` keeps them apart at no cost, with an int32 zero XLA cannot see is
zero (:func:`opaque_zero`). The pairs (``hi + lo``, about 44 bits) of :func:`pair`, :func:`mul`,
:func:`div`, :func:`sqrt_pair` and :func:`power` give ``float32(x)`` of an expression MXNet
evaluates in float64, from a step count known only inside the computation.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "Pair",
    "bias_corrected_lr",
    "constant",
    "div",
    "fast_two_sum",
    "mul",
    "next_count",
    "opaque_zero",
    "over",
    "parsed",
    "pair",
    "power",
    "root",
    "rounded",
    "sqrt_pair",
    "sub",
    "sum_of_squares",
    "two_prod",
    "two_sum",
]


def parsed(x: float) -> np.float32:
    """``x`` as an MXNet operator parses its float parameter: Python hands it the decimal string
    ``str(x)``, and dmlc-core's ``strtof`` (``ParseFloat<float>``) reads it as the integer part
    in float32 plus the float32 of the fraction's digits (at most 19) over their power of ten in
    double, then scales by the exponent in float32: not always the float32 nearest to ``x``
    (8 of 1,000 bias-corrected cosine learning rates are an ulp off), MXNet's number."""
    return _parsed_text(str(float(x)))


@functools.lru_cache(maxsize=1024)  # an optimizer's constants are parsed at every update
def _parsed_text(text: str) -> np.float32:
    f32 = np.float32
    negative = text.startswith("-")
    text = text.lstrip("+-")
    if text in ("inf", "nan"):
        value = f32(np.inf if text == "inf" else np.nan)
        return -value if negative else value
    mantissa, _, exponent = text.lower().partition("e")
    whole, _, fraction = mantissa.partition(".")
    value = f32(int(whole or "0") % (1 << 64))
    if fraction:
        digits = fraction[:19]
        value = f32(value + f32(np.float64(int(digits)) / np.float64(10 ** len(digits))))
    if exponent:
        e = min(abs(int(exponent)), 38)
        scale = f32(1.0)
        while e >= 8:
            scale, e = f32(scale * f32(1e8)), e - 8
        while e > 0:
            scale, e = f32(scale * f32(10.0)), e - 1
        value = f32(value / scale) if exponent.startswith("-") else f32(value * scale)
    return -value if negative else value


def constant(x: float, dtype: Any) -> np.ndarray:
    """A hyperparameter as MXNet's kernels see it: a C++ float, then cast to the weight's type."""
    return np.asarray(np.float32(x), dtype=dtype)


def opaque_zero(count: jax.Array) -> jax.Array:
    """An int32 zero that XLA and LLVM cannot see is zero: the count's bit 31 (it is >= 0)."""
    return jax.lax.shift_right_logical(count, jnp.int32(31))


def rounded(x: jax.Array | np.ndarray, zero: jax.Array) -> jax.Array:
    """``x`` itself, rounded on its own before the sum that uses it.

    XLA fuses a product into the sum or difference that uses it (one FMA, one rounding) on CPUs
    and GPUs that have FMA; MXNet's CPU kernels round the product first. Or-ing the product's
    bits with an opaque zero is free in a fused loop and keeps the two operations apart, so the
    result is MXNet's to the bit under ``jit`` too.
    """
    x = jnp.asarray(x)
    itype = jnp.dtype(f"int{jnp.dtype(x.dtype).itemsize * 8}")
    bits = jax.lax.bitcast_convert_type(x, itype)
    return jax.lax.bitcast_convert_type(bits | zero.astype(itype), x.dtype)


def next_count(count: jax.Array) -> jax.Array:
    return jnp.where(count < jnp.iinfo(jnp.int32).max, count + 1, count)


# -- lr * sqrt(1 - beta2**t) / (1 - beta1**t) in double-float32 -----------------------------
# A value is a pair (hi, lo) of float32 scalars, hi + lo exactly, |lo| <= ulp(hi) / 2: about 44
# bits. Error-free sums and products (Knuth's TwoSum, Dekker's TwoProduct with Veltkamp's split)
# as in Dekker (1971), "A floating-point technique for extending the available precision".
Pair = tuple[jax.Array, jax.Array]
_SPLIT = np.float32(4097.0)  # 2**12 + 1 splits a float32 into two 12-bit halves


def pair(x: float) -> Pair:
    hi = np.float32(x)
    return jnp.asarray(hi), jnp.asarray(np.float32(x - float(hi)))


def two_sum(a: jax.Array, b: jax.Array, z: jax.Array) -> Pair:
    s = rounded(a + b, z)  # opaque: XLA would simplify (a + b) - a to b
    v = rounded(s - a, z)
    return s, (a - (s - v)) + (b - v)


def fast_two_sum(a: jax.Array, b: jax.Array, z: jax.Array) -> Pair:  # |a| >= |b|
    s = rounded(a + b, z)
    return s, b - (s - a)


def _split(a: jax.Array, z: jax.Array) -> Pair:
    c = rounded(_SPLIT * a, z)
    hi = c - rounded(c - a, z)
    return hi, a - hi


def two_prod(a: jax.Array, b: jax.Array, z: jax.Array) -> Pair:
    # Products of the halves are exact, so an FMA there changes nothing; a * b must be rounded.
    p = rounded(a * b, z)
    ah, al = _split(a, z)
    bh, bl = _split(b, z)
    return p, ((ah * bh - p) + ah * bl + al * bh) + al * bl


def mul(x: Pair, y: Pair, z: jax.Array) -> Pair:
    p, e = two_prod(x[0], y[0], z)
    return fast_two_sum(p, e + (rounded(x[0] * y[1], z) + rounded(x[1] * y[0], z)), z)


def sub(x: Pair, y: Pair, z: jax.Array) -> Pair:
    s, e = two_sum(x[0], -y[0], z)
    return fast_two_sum(s, e + (x[1] - y[1]), z)


def div(x: Pair, y: Pair, z: jax.Array) -> Pair:
    q1 = x[0] / y[0]
    r = sub(x, mul(y, (q1, jnp.zeros_like(q1)), z), z)
    return fast_two_sum(q1, r[0] / y[0], z)


def sqrt_pair(x: Pair, z: jax.Array) -> Pair:
    s = jnp.sqrt(x[0])
    p, e = two_prod(s, s, z)
    safe = jnp.where(s > 0, s, jnp.ones_like(s))
    r = jnp.where(s > 0, (((x[0] - p) - e) + x[1]) / (2 * safe), jnp.zeros_like(s))
    return fast_two_sum(s, r, z)


def power(beta: float, t: jax.Array, z: jax.Array) -> Pair:
    """``beta ** t`` for a traced int32 ``t >= 1``: the product of ``beta ** (2**k)`` over the
    bits ``k`` of ``t``, those powers computed in float64 here, multiplied pairwise in a tree
    (five vectorised products: a small graph that compiles fast).

    Bits stop where ``beta ** (2**k) < 2**-60``: beyond, ``1 - beta**t`` is 1 in float64.
    """
    powers: list[float] = []
    while len(powers) < 31 and beta ** (2 ** len(powers)) >= 2.0**-60:
        powers.append(beta ** (2 ** len(powers)))
    bits = len(powers)
    size = 1 << max(bits - 1, 0).bit_length()  # a power of two >= bits
    hi = np.ones(size, np.float32)
    lo = np.zeros(size, np.float32)
    for k, p in enumerate(powers):
        hi[k] = np.float32(p)
        lo[k] = np.float32(p - float(hi[k]))
    take = ((t >> jnp.arange(size, dtype=jnp.int32)) & 1) == 1
    acc: Pair = (jnp.where(take, hi, np.float32(1)), jnp.where(take, lo, np.float32(0)))
    while acc[0].shape[0] > 1:
        acc = mul((acc[0][0::2], acc[1][0::2]), (acc[0][1::2], acc[1][1::2]), z)
    zero = jnp.zeros((), jnp.float32)
    tiny = t >= 2**bits if bits < 31 else jnp.zeros((), bool)
    return jnp.where(tiny, zero, acc[0][0]), jnp.where(tiny, zero, acc[1][0])


def bias_corrected_lr(
    lr: float, beta1: float, beta2: float, t: jax.Array, z: jax.Array
) -> jax.Array:
    """MXNet's ``float32(lr * sqrt(1 - beta2**t) / (1 - beta1**t))`` (computed in float64).

    ``z``: an opaque int32 zero (:func:`opaque_zero`), which keeps XLA from fusing products
    into sums: the error-free transformations need every product rounded.
    """
    one = pair(1.0)
    c1 = sub(one, power(beta1, t, z), z)
    c2 = sub(one, power(beta2, t, z), z)
    return mul(pair(lr), div(sqrt_pair(c2, z), c1, z), z)[0]


def root(x: jax.Array, z: jax.Array) -> jax.Array:
    """``sqrt(x)``, correctly rounded, kept apart from the division that uses it: XLA rewrites
    ``a / sqrt(b)`` as ``a * rsqrt(b)``, which is not (an ulp away in some elements)."""
    return rounded(jnp.sqrt(x), z)


def over(a: jax.Array, b: jax.Array | np.ndarray, z: jax.Array) -> jax.Array:
    """``a / b``, correctly rounded where ``b`` broadcasts (a scalar, a column): XLA turns a
    division by a broadcast into a product with its reciprocal, which is not. ``b`` is
    spread to the quotient's shape with a zero of each element's own, which XLA cannot see
    is one number (``z``: an opaque zero, :func:`opaque_zero`)."""
    shape = jnp.broadcast_shapes(jnp.shape(a), jnp.shape(b))
    if tuple(jnp.shape(b)) == tuple(shape):
        return a / b
    a = jnp.broadcast_to(a, shape)
    itype = jnp.dtype(f"int{jnp.dtype(a.dtype).itemsize * 8}")
    zero = jax.lax.bitcast_convert_type(a, itype) & z.astype(itype)
    bits = jax.lax.bitcast_convert_type(jnp.broadcast_to(b, shape).astype(a.dtype), itype)
    return a / jax.lax.bitcast_convert_type(bits | zero, a.dtype)


def sum_of_squares(x: jax.Array, z: jax.Array) -> jax.Array:
    """``sum(x * x)`` in float32, each square rounded. MXNet adds them one by one; XLA adds them
    in another order: the sum may differ by a few float32 ulps."""
    x = x.astype(jnp.float32)
    return jnp.sum(rounded(x * x, z))
