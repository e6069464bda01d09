"""MXNet 1.9.1's SGD and Adam as NumPy float32 models of the documented formulas (each
operation rounded in MXNet's order), shared by the optimizer modules' unit tests."""

import math

import jax
import numpy as np
import optax

from jaxkv.mx import optimizer

f32 = np.float32


ONE = f32(1)


I32_MAX = 2**31 - 1


W0 = np.random.default_rng(0).standard_normal(8).astype(f32)


GRADS = [np.random.default_rng(s).standard_normal(8).astype(f32) * 2 for s in (1, 2)]


def _clip(x, c):
    return x if c is None else np.clip(x, -f32(c), f32(c))


def _sgd_model(w, grads, lr, wd=0.0, rescale=1.0, momentum=0.0, clip=None):
    """MXNet's dense SGD, each operation rounded to float32 in the documented order."""
    mom = np.zeros_like(w)
    for grad in grads:
        if clip is None:
            step = (f32(lr) * f32(rescale)) * grad
        else:
            step = f32(lr) * _clip(f32(rescale) * grad, clip)
        decay = (f32(lr) * f32(wd)) * w
        mom = (f32(momentum) * mom - decay - step) if momentum > 0 else (-decay - step)
        w = w + mom
    return w


def _adam_model(w, grads, lr, b1, b2, eps, wd=0.0, rescale=1.0, clip=None, begin=0, sq=False):
    """MXNet's Adam: ``lr_t`` in float64 rounded once, the rest in float32."""
    m, v = np.zeros_like(w), np.zeros_like(w)
    for i, grad in enumerate(grads):
        t = begin + i + 1
        lr_t = f32(lr * math.sqrt(1 - b2**t) / (1 - b1**t))
        g = _clip(grad * f32(rescale) + w * f32(wd), clip)
        m = f32(b1) * m + (ONE - f32(b1)) * g
        v = f32(b2) * v + ((ONE - f32(b2)) * (g * g) if sq else ((ONE - f32(b2)) * g) * g)
        w = w - (lr_t * m) / (np.sqrt(v) + f32(eps))
    return w, m, v


def _on_cpu(x):
    """On a CPU device, whatever the default backend (the bits pinned here are a CPU's)."""
    return jax.device_put(x, jax.devices("cpu")[0])


def _run(opt, grads=GRADS, row_sparse=False, w=W0):
    tx = opt.transformation(row_sparse=row_sparse)
    w = _on_cpu(w)
    state = tx.init(w)
    for g in grads:
        updates, state = tx.update(_on_cpu(g), state, w)
        w = optax.apply_updates(w, updates)
    return np.asarray(w), state


# Under jit XLA fuses a product into the sum that uses it (one rounding, not MXNet's two)
# wherever it can: enough elements that some of them round differently.
W_BIG = np.random.default_rng(3).standard_normal(256).astype(f32)


G_BIG = np.random.default_rng(4).standard_normal(256).astype(f32)


JIT_CASES = {
    "sgd": (
        lambda: optimizer.SGD(learning_rate=0.1, wd=0.01, momentum=0.9),
        lambda: _sgd_model(W_BIG, [G_BIG], 0.1, wd=0.01, momentum=0.9),
    ),
    "adam": (
        lambda: optimizer.Adam(learning_rate=0.01, wd=0.1),
        lambda: _adam_model(W_BIG, [G_BIG], 0.01, 0.9, 0.999, 1e-8, wd=0.1)[0],
    ),
}
