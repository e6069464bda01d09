"""jaxkv/_src/mxnet/optimizers/adam_family.py: MXNet 1.9.1's Adamax, Nadam, FTML and LAMB against
NumPy float32 models of their kernels (each operation rounded in MXNet's order; what MXNet
computes in double, in float64), their host bookkeeping, refusals and edge cases."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxkv._src.mxnet.optimizers import adam_family as fam
from jaxkv._src.mxnet.optimizers import float32 as fl
from jaxkv.mx import optimizer

from ._optimizer_models import GRADS, ONE, W0, _on_cpu, _run, f32

LR, WD, RS, CLIP = 0.05, 0.02, 0.5, 0.4
W_BIG = np.random.default_rng(11).uniform(-1, 1, 4096).astype(f32)
G_BIG = [np.random.default_rng(s).uniform(-1, 1, 4096).astype(f32) for s in (12, 13, 14)]


def _run_scalars(opt, grads=GRADS, w=W0, index=0, jit=True):
    """The store's path: MXNet's bookkeeping on the host (``next_update``) gives the kernel's
    numbers at each update, under ``jit`` (or eagerly)."""
    tx = opt.transformation()
    w = _on_cpu(w)
    state = tx.init(w)
    step = lambda g, state, w, s: tx.update(g, state, w, scalars=s)  # noqa: E731
    step = jax.jit(step) if jit else step
    for g in grads:
        updates, state = step(_on_cpu(g), state, w, opt.next_update([index])[0])
        w = optax.apply_updates(w, updates)
    return np.asarray(w), state


def _mx_clip(x, c):
    """MXNet's NDArray ``clip(x, -c, c)`` for any ``c``."""
    lo, hi = -f32(c), f32(c)
    return np.where(x > hi, hi, np.where(x < lo, lo, x)).astype(f32)


def _cpp_clip(x, c):
    """The C++ kernels' clip: only for ``c >= 0`` (MXNet passes it when truthy)."""
    if not c or c < 0:
        return x
    return np.where(x > f32(c), f32(c), np.where(x < -f32(c), -f32(c), x)).astype(f32)


# -- the models --------------------------------------------------------------------------------
def _adamax_model(w, grads, lr, b1=0.9, b2=0.999, wd=0.0, rescale=1.0, clip=None, begin=0):
    mean, u = np.zeros_like(w), np.zeros_like(w)
    for i, g in enumerate(grads):
        t = begin + i + 1
        lr_t = lr / (1.0 - b1**t)
        g = g * f32(rescale) + w * f32(wd)
        if clip is not None:
            g = _mx_clip(g, clip)
        mean = mean * f32(b1) + g * f32(1.0 - b1)
        kept = u * f32(b2)
        u = np.where(np.isnan(kept) | (kept > np.abs(g)), kept, np.abs(g)).astype(f32)
        with np.errstate(invalid="ignore", divide="ignore"):
            w = w - (mean * f32(lr_t)) / u
    return w, mean, u


def _nadam_model(w, grads_by_index, lr, b1=0.9, b2=0.999, eps=1e-8, decay=0.004, wd=0.0,
                 rescale=1.0, clip=None, begin=0):  # fmt: skip
    """MXNet's Nadam over several indices: ``grads_by_index`` a list of ``(index, grad)`` in
    update order, one weight per index; ``m_schedule`` the optimizer's, over all of them."""
    ws, means, vars_, counts = {}, {}, {}, {}
    schedule = 1.0
    for index, g in grads_by_index:
        w_i = ws.get(index, w)
        m = means.get(index, np.zeros_like(w))
        v = vars_.get(index, np.zeros_like(w))
        counts[index] = t = counts.get(index, begin) + 1
        g = g * f32(rescale) + w_i * f32(wd)
        if clip is not None:
            g = _mx_clip(g, clip)
        momentum_t = b1 * (1.0 - 0.5 * (pow(0.96, t * decay)))
        momentum_t_1 = b1 * (1.0 - 0.5 * (pow(0.96, (t + 1) * decay)))
        schedule = schedule * momentum_t
        schedule_next = schedule * momentum_t_1
        m = m * f32(b1) + g * f32(1.0 - b1)
        v = v * f32(b2) + (g * f32(1.0 - b2)) * g
        g_prime = g / f32(1.0 - schedule)
        m_prime = m / f32(1.0 - schedule_next)
        v_prime = v / f32(1.0 - pow(b2, t))
        m_bar = g_prime * f32(1.0 - momentum_t) + m_prime * f32(momentum_t_1)
        ws[index] = w_i - (m_bar * f32(lr)) / (np.sqrt(v_prime) + f32(eps))
        means[index], vars_[index] = m, v
    return ws, means, vars_, schedule


def _ftml_model(w, grads, lr, b1=0.6, b2=0.999, eps=1e-8, wd=0.0, rescale=1.0, clip=None,
                begin=0):  # fmt: skip
    d, v, z = np.zeros_like(w), np.zeros_like(w), np.zeros_like(w)
    for i, g in enumerate(grads):
        t = begin + i + 1
        p1, p2 = f32(float(f32(b1)) ** t), f32(float(f32(b2)) ** t)  # as powf, at these t
        g = _cpp_clip(f32(rescale) * g + f32(wd) * w, clip)
        v = f32(b2) * v + (ONE - f32(b2)) * (g * g)
        d_t = ((ONE - p1) / f32(lr)) * (np.sqrt(v / (ONE - p2)) + f32(eps))
        z = (f32(b1) * z + (ONE - f32(b1)) * g) - (d_t - f32(b1) * d) * w
        d = d_t
        w = -z / d_t
    return w, (d, v, z)


def _sum_sq(x):
    """MXNet's sums of squares: float32 squares added one by one."""
    total = f32(0)
    for e in np.ravel(x):
        total = f32(total + e * e)
    return total


def _lamb_model(w, grads, lr, b1=0.9, b2=0.999, eps=1e-6, wd=0.0, rescale=1.0, clip=None,
                lower=None, upper=None, bias=True, begin=0, phases=False):  # fmt: skip
    mean, var = np.zeros_like(w), np.zeros_like(w)
    for i, g in enumerate(grads):
        t = begin + i + 1
        g = _cpp_clip(g * f32(rescale), clip)
        mean = f32(b1) * mean + (ONE - f32(b1)) * g
        var = f32(b2) * var + ((ONE - f32(b2)) * g) * g
        p1, p2 = f32(float(f32(b1)) ** t), f32(float(f32(b2)) ** t)
        decay = f32(wd) * w
        if phases and bias:  # lamb_update_phase1: mean / (1. - beta1_t) in double
            mean_hat = (mean.astype(np.float64) / (1.0 - np.float64(p1))).astype(f32)
            step = mean_hat / (np.sqrt(var / (ONE - p2)) + f32(eps)) + decay
        elif phases:
            step = mean / (np.sqrt(var) + f32(eps)) + decay
        else:  # multi_lamb_update: the step in double
            m_hat, v_hat = (mean / (ONE - p1), var / (ONE - p2)) if bias else (mean, var)
            q = m_hat.astype(np.float64) / (np.sqrt(v_hat.astype(np.float64)) + float(f32(eps)))
            step = (q + decay.astype(np.float64)).astype(f32)
        r1, r2 = np.sqrt(_sum_sq(w)), np.sqrt(_sum_sq(step))
        if lower:
            r1 = max(r1, f32(lower))
        if upper:
            r1 = min(r1, f32(upper))
        if phases:
            rate = f32(lr) if r1 == 0 or r2 == 0 else (f32(lr) * r1) / r2
        else:
            rate = f32(lr) * (f32(1) if r1 == 0 or r2 == 0 else r1 / r2)
        w = w - rate * step
    return w, mean, var


# -- Adamax -------------------------------------------------------------------------------------
ADAMAX_CASES = {
    "defaults": {"lr": 0.002},
    "from_begin": {"lr": LR, "begin": 7},
    "decay_clip": {"lr": LR, "wd": WD, "rescale": RS, "clip": CLIP},
    "clip_negative": {"lr": LR, "clip": -0.3},  # MXNet's clip op: every gradient +-0.3
    "betas": {"lr": LR, "b1": 0.0, "b2": 1.0},
}


@pytest.mark.parametrize("path", ["scalars", "traced"])
@pytest.mark.parametrize("case", list(ADAMAX_CASES))
def test_adamax_follows_mxnets_expression(case, path):
    a = ADAMAX_CASES[case]
    opt = optimizer.Adamax(
        learning_rate=a["lr"],
        beta1=a.get("b1", 0.9),
        beta2=a.get("b2", 0.999),
        wd=a.get("wd", 0.0),
        rescale_grad=a.get("rescale", 1.0),
        clip_gradient=a.get("clip"),
        begin_num_update=a.get("begin", 0),
    )
    got, state = _run_scalars(opt) if path == "scalars" else _run(opt)
    want, mean, u = _adamax_model(W0, GRADS, **a)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(state.slots[0], mean)
    np.testing.assert_array_equal(state.slots[1], u)


def test_adamax_divides_zero_by_zero_as_mxnet():
    """A gradient of 0 at the first update (or every gradient clipped to 0): u is 0, and MXNet's
    ``mean / u`` is NaN."""
    g = GRADS[0].copy()
    g[3] = 0.0
    got, _ = _run(optimizer.Adamax(), grads=[g])
    assert np.isnan(got[3]) and not np.isnan(np.delete(got, 3)).any()
    got, _ = _run(optimizer.Adamax(clip_gradient=0.0), grads=GRADS[:1])
    assert np.isnan(got).all()


def test_adamax_bias_correction_is_float64_on_the_host():
    opt = optimizer.Adamax(learning_rate=0.1, begin_num_update=2)
    row = opt.next_update([0])[0]
    assert row[0] == f32(0.1 / (1.0 - 0.9**3))
    t = jnp.asarray([1, 2, 3, 10, 1000, 2**31 - 1], jnp.int32)
    lr_t = jax.vmap(lambda t: opt.traced_scalars(opt.inputs(None), t, jnp.int32(0))["lr"])(t)
    np.testing.assert_array_equal(lr_t, [f32(0.1 / (1.0 - 0.9 ** int(x))) for x in t])


# -- Nadam --------------------------------------------------------------------------------------
NADAM_CASES = {
    "defaults": {"lr": 0.001},
    "decay_clip": {"lr": LR, "wd": WD, "rescale": RS, "clip": CLIP, "begin": 3},
    "schedule": {"lr": LR, "b1": 0.8, "b2": 0.99, "eps": 1e-6, "decay": 0.1},
    "no_schedule_decay": {"lr": LR, "decay": 0.0},
}


@pytest.mark.parametrize("case", list(NADAM_CASES))
def test_nadam_follows_mxnets_expression_with_the_optimizers_schedule(case):
    """Two indices updated in turn: the schedule is one product over both (MXNet's)."""
    a = NADAM_CASES[case]
    opt = optimizer.Nadam(
        learning_rate=a["lr"],
        beta1=a.get("b1", 0.9),
        beta2=a.get("b2", 0.999),
        epsilon=a.get("eps", 1e-8),
        schedule_decay=a.get("decay", 0.004),
        wd=a.get("wd", 0.0),
        rescale_grad=a.get("rescale", 1.0),
        clip_gradient=a.get("clip"),
        begin_num_update=a.get("begin", 0),
    )
    tx = opt.transformation()
    order = [(i % 2, g) for i, g in enumerate([*GRADS, *GRADS[::-1]])]
    weights = {0: _on_cpu(W0), 1: _on_cpu(W0)}
    states = {k: tx.init(w) for k, w in weights.items()}
    for index, g in order:
        s = opt.next_update([index])[0]
        updates, states[index] = tx.update(_on_cpu(g), states[index], weights[index], scalars=s)
        weights[index] = optax.apply_updates(weights[index], updates)
    ws, means, vars_, schedule = _nadam_model(
        W0,
        order,
        a["lr"],
        b1=a.get("b1", 0.9),
        b2=a.get("b2", 0.999),
        eps=a.get("eps", 1e-8),
        decay=a.get("decay", 0.004),
        wd=a.get("wd", 0.0),
        rescale=a.get("rescale", 1.0),
        clip=a.get("clip"),
        begin=a.get("begin", 0),
    )
    assert opt.m_schedule == schedule  # float64, to the bit
    for k in (0, 1):
        np.testing.assert_array_equal(weights[k], ws[k])
        np.testing.assert_array_equal(states[k].slots[0], means[k])
        np.testing.assert_array_equal(states[k].slots[1], vars_[k])


def test_nadams_bookkeeping_is_undone_with_the_counts():
    opt = optimizer.Nadam()
    opt.next_update([0, 1])
    saved = opt.bookkeeping()
    schedule, coefficients = opt.m_schedule, opt.inputs(0)
    opt.next_update([1, 0])
    assert opt.m_schedule != schedule and opt.inputs(0) != coefficients
    opt.restore_bookkeeping(saved)
    assert opt.m_schedule == schedule and opt.inputs(0) == coefficients
    assert opt.num_update == 1


def test_nadams_inputs_carry_the_keys_coefficients_once_counted():
    opt = optimizer.Nadam()
    scheduled = optimizer.Nadam.SCALARS.index("scheduled")
    assert opt.inputs(None)[scheduled] == 0.0 and opt.inputs(0)[scheduled] == 0.0
    row = opt.next_update([0])[0]
    assert opt.inputs(0)[scheduled] == 1.0 and opt.inputs(None)[scheduled] == 0.0
    np.testing.assert_array_equal(np.asarray(opt.inputs(0), np.float64).astype(f32), row)
    # a transformation with them compiled in gives the store's numbers
    tx = opt.transformation(inputs=opt.inputs(0))
    w = _on_cpu(W0)
    exact, _ = tx.update(_on_cpu(GRADS[0]), tx.init(w), w)
    with_scalars, _ = opt.transformation().update(_on_cpu(GRADS[0]), tx.init(w), w, scalars=row)
    np.testing.assert_array_equal(exact, with_scalars)


@pytest.mark.parametrize(("b1", "decay", "begin"), [(0.9, 0.004, 0), (0.99, 0.1, 0),
                                                    (0.5, 0.0, 0), (0.9, 0.004, 1000)])  # fmt: skip
def test_nadams_own_schedule_without_the_store_is_within_ulps(b1, decay, begin):
    """Without scalars, the state's own product, from a closed form in float32: a few ulps
    from the float64 coefficients MXNet computes for an optimizer of that one key."""
    opt = optimizer.Nadam(beta1=b1, schedule_decay=decay, begin_num_update=begin)
    t = np.arange(begin + 1, begin + 3001, dtype=np.int32)
    inputs = opt.inputs(None)
    got = jax.jit(jax.vmap(lambda t: opt.traced_scalars(inputs, t, jnp.int32(0))))(t)
    schedule = 1.0
    want = {n: [] for n in fam._NADAM_COEFFICIENTS}
    for x in t.tolist():
        momentum_t = b1 * (1.0 - 0.5 * pow(0.96, x * decay))
        momentum_t_1 = b1 * (1.0 - 0.5 * pow(0.96, (x + 1) * decay))
        schedule *= momentum_t
        for n, v in zip(
            fam._NADAM_COEFFICIENTS,
            (1 - momentum_t, momentum_t_1, 1 - schedule, 1 - schedule * momentum_t_1,
             1 - pow(0.999, x)),
        ):  # fmt: skip
            want[n].append(v)
    for n in fam._NADAM_COEFFICIENTS:
        wanted = np.asarray(want[n]).astype(f32)
        from_ulps = np.abs(np.asarray(got[n]).view(np.int32) - wanted.view(np.int32))
        assert from_ulps.max() <= 4, (n, int(from_ulps.max()), int(np.argmax(from_ulps)))
    assert np.asarray(got["schedule_rest"])[-1] == 1.0  # the product long below float32's ulp


# -- FTML -----------------------------------------------------------------------------------
FTML_CASES = {
    "defaults": {"lr": 0.01},
    "decay_clip": {"lr": LR, "wd": WD, "rescale": RS, "clip": CLIP},
    "betas_eps": {"lr": LR, "b1": 0.9, "b2": 0.99, "eps": 1e-6, "begin": 4},
    "clip_zero_is_none": {"lr": LR, "clip": 0.0},  # MXNet passes clip_grad only when truthy
}


@pytest.mark.parametrize("path", ["scalars", "traced"])
@pytest.mark.parametrize("case", list(FTML_CASES))
def test_ftml_follows_mxnets_kernel(case, path):
    a = FTML_CASES[case]
    opt = optimizer.FTML(
        learning_rate=a["lr"],
        beta1=a.get("b1", 0.6),
        beta2=a.get("b2", 0.999),
        epsilon=a.get("eps", 1e-8),
        wd=a.get("wd", 0.0),
        rescale_grad=a.get("rescale", 1.0),
        clip_gradient=a.get("clip"),
        begin_num_update=a.get("begin", 0),
    )
    got, state = _run_scalars(opt) if path == "scalars" else _run(opt)
    want, slots = _ftml_model(W0, GRADS, **a)
    np.testing.assert_array_equal(got, want)
    for mine, theirs in zip(state.slots, slots, strict=True):
        np.testing.assert_array_equal(mine, theirs)


def test_ftmls_new_weight_is_reached_within_an_ulp_of_the_step():
    """``-z / d_t`` replaces the weight: exact wherever a float32 update reaches it, and
    everywhere within an ulp of the step (a weight that crosses zero)."""
    for lr, share in ((0.5, 0.7), (0.01, 0.99)):  # steps of about lr: 0.5 crosses zero often
        opt = optimizer.FTML(learning_rate=lr, wd=0.1)
        got, _ = _run_scalars(opt, grads=G_BIG[:1], w=W_BIG)
        want, _ = _ftml_model(W_BIG, G_BIG[:1], lr, wd=0.1)
        step = np.abs(want - W_BIG)
        assert np.all(np.abs(got - want) <= np.spacing(step))
        exact = got == want
        assert exact.mean() > share
        reachable = (W_BIG + (want - W_BIG)) == want  # the naive update reaches it
        assert np.all(exact[reachable])


# -- LAMB -----------------------------------------------------------------------------------
LAMB_CASES = {
    "defaults": {"lr": 0.001},
    "decay_clip": {"lr": LR, "wd": WD, "rescale": RS, "clip": CLIP, "begin": 2},
    "no_bias": {"lr": LR, "wd": WD, "bias": False},
    "lower": {"lr": LR, "lower": 10.0},
    "upper": {"lr": LR, "upper": 0.5, "eps": 1e-3},
    "phases": {"lr": LR, "wd": WD, "clip": CLIP, "phases": True},
    "phases_no_bias": {"lr": LR, "bias": False, "phases": True, "lower": 3.0},
}


@pytest.mark.parametrize("path", ["scalars", "traced"])
@pytest.mark.parametrize("case", list(LAMB_CASES))
def test_lamb_follows_mxnets_kernels(case, path):
    """The mean and var to the bit; the weight within 1e-6 relative (the norms' order of
    summation), and here to the bit: on 8 elements XLA adds in MXNet's order."""
    a = LAMB_CASES[case]
    opt = optimizer.LAMB(
        learning_rate=a["lr"],
        epsilon=a.get("eps", 1e-6),
        lower_bound=a.get("lower"),
        upper_bound=a.get("upper"),
        bias_correction=a.get("bias", True),
        wd=a.get("wd", 0.0),
        rescale_grad=a.get("rescale", 1.0),
        clip_gradient=a.get("clip"),
        begin_num_update=a.get("begin", 0),
    )
    if a.get("phases"):
        opt.aggregate_num = 1
    got, state = _run_scalars(opt) if path == "scalars" else _run(opt)
    want, mean, var = _lamb_model(W0, GRADS, **a)
    np.testing.assert_array_equal(state.slots[0], mean)
    np.testing.assert_array_equal(state.slots[1], var)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_array_equal(got, want)


def test_lambs_norms_on_large_keys_are_within_1e6():
    opt = optimizer.LAMB(learning_rate=0.1, wd=0.01)
    got, state = _run_scalars(opt, grads=G_BIG, w=W_BIG)
    want, mean, var = _lamb_model(W_BIG, G_BIG, 0.1, wd=0.01)
    np.testing.assert_array_equal(state.slots[0], mean)
    np.testing.assert_array_equal(state.slots[1], var)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


def test_lambs_trust_ratio_is_one_where_a_norm_is_zero():
    for phases in (False, True):
        opt = optimizer.LAMB(learning_rate=0.1)
        opt.aggregate_num = 1 if phases else 45
        got, _ = _run(opt, grads=GRADS[:1], w=np.zeros(8, f32))  # r1 = 0
        want, _, _ = _lamb_model(np.zeros(8, f32), GRADS[:1], 0.1, phases=phases)
        np.testing.assert_array_equal(got, want)
        assert np.abs(got).max() > 0.09  # the bare rate: about lr * sign(g)


def test_multi_lambs_step_is_computed_in_double():
    """``float(mean / (sqrt(var) + eps) + wd * w)`` as C's double: a pair of float32s (about
    44 bits) rounded once gives it, where float32 arithmetic misses in about 1% of elements."""
    rng = np.random.default_rng(5)
    n = 200_000
    mean = f32(rng.standard_normal(n) * 0.1)
    var = f32(rng.uniform(0, 1, n) ** 4)
    decay = f32(rng.standard_normal(n) * 0.01)
    eps = f32(1e-6)
    want = (mean.astype(np.float64) / (np.sqrt(var.astype(np.float64)) + float(eps))
            + decay.astype(np.float64)).astype(f32)  # fmt: skip
    got = jax.jit(fam._double_step)(mean, var, jnp.float32(eps), decay, jnp.int32(0))
    np.testing.assert_array_equal(got, want)
    single = mean / (np.sqrt(var) + eps) + decay
    assert (single != want).mean() > 0.001


def test_the_two_phase_kernels_use_stdpow_and_the_aggregated_one_powf():
    opt = optimizer.LAMB(begin_num_update=3605)
    row = opt.next_update([0])[0]  # t = 3606: glibc's powf(0.999f, 3606) is not rounded
    p2 = optimizer.LAMB.SCALARS.index("beta2_t")
    assert row[p2] == f32(fam.powf(0.999, 3606))
    opt = optimizer.LAMB(begin_num_update=3605)
    opt.aggregate_num = 1
    assert opt.next_update([0])[0][p2] == f32(float(f32(0.999)) ** 3606)


# -- helpers --------------------------------------------------------------------------------
def test_a_division_by_a_scalar_is_ieees_under_jit():
    """XLA turns ``x / broadcast(c)`` into ``x * (1 / c)``; ``float32.over`` keeps the division."""
    x = np.random.default_rng(6).uniform(-1, 1, 10_000).astype(f32)
    for c in (f32(0.5498163), f32(0.001), f32(3.0)):
        # (the kernels' zero is opaque: a traced count's bit 31, here an argument)
        got = jax.jit(fl.over)(x, c, jnp.int32(0))
        np.testing.assert_array_equal(got, x / c)


def test_powf_is_cs_float_power():
    assert fam.powf(0.5, 3) == 0.125
    assert fam.powf(0.9, 1) == float(f32(0.9))
    for beta, t in ((0.9, 5), (0.6, 7), (0.999, 12), (0.999, 2958)):
        correctly = float(f32(float(f32(beta)) ** t))
        assert fam.powf(beta, t) == pytest.approx(correctly, rel=2**-23)  # an ulp at most
    assert fam.pow_double(0.999, 3606) == float(f32(float(f32(0.999)) ** 3606))


# -- arguments and refusals -------------------------------------------------------------------
@pytest.mark.parametrize("cls", [optimizer.Adamax, optimizer.Nadam, optimizer.FTML, optimizer.LAMB])
@pytest.mark.parametrize("beta", [1.0, -0.1, 1.5])
def test_beta1_lies_in_zero_to_one(cls, beta):
    with pytest.raises(optimizer.OptimizerArgumentError, match=r"beta1 expected in \[0, 1\)"):
        cls(beta1=beta)
    assert cls(beta1=0.0).beta1 == 0.0


def test_adamaxs_beta2_may_be_one_the_others_not():
    assert optimizer.Adamax(beta2=1.0).beta2 == 1.0
    with pytest.raises(optimizer.OptimizerArgumentError, match=r"beta2 expected in \[0, 1\]"):
        optimizer.Adamax(beta2=1.01)
    for cls in (optimizer.Nadam, optimizer.FTML, optimizer.LAMB):
        with pytest.raises(optimizer.OptimizerArgumentError, match=r"beta2 expected in \[0, 1\)"):
            cls(beta2=1.0)


def test_refusals_name_the_argument_expected_and_given():
    with pytest.raises(optimizer.OptimizerArgumentError, match="schedule_decay expected >= 0"):
        optimizer.Nadam(schedule_decay=-0.1)
    with pytest.raises(optimizer.OptimizerArgumentError, match="epsilon expected a number"):
        optimizer.FTML(epsilon="small")
    with pytest.raises(optimizer.OptimizerArgumentError, match="lower_bound expected a number"):
        optimizer.LAMB(lower_bound="1")
    with pytest.raises(optimizer.OptimizerArgumentError, match=r"unexpected keyword.*momentum"):
        optimizer.Adamax(momentum=0.9)
    with pytest.raises(optimizer.OptimizerArgumentError, match="lazy_update"):
        optimizer.LAMB(lazy_update=True)  # none of the four takes it: no row-sparse kernel


def test_lamb_refuses_a_bad_aggregation_size_as_mxnet(monkeypatch):
    monkeypatch.setenv("MXNET_OPTIMIZER_AGGREGATION_SIZE", "lots")
    with pytest.raises(optimizer.OptimizerArgumentError, match="expected an integer, given 'lots'"):
        optimizer.LAMB()
    for size, want in (("0", 1), ("1", 1), ("7", 7), ("100", 45)):
        monkeypatch.setenv("MXNET_OPTIMIZER_AGGREGATION_SIZE", size)
        assert optimizer.LAMB().aggregate_num == want


@pytest.mark.parametrize(("cls", "name", "value"), [
    (optimizer.LAMB, "aggregate_num", 1), (optimizer.LAMB, "bias_correction", False),
    (optimizer.Nadam, "schedule_decay", 0.1), (optimizer.FTML, "beta1", 0.5),
    (optimizer.Adamax, "beta2", 0.9),
])  # fmt: skip
def test_what_the_kernel_compiles_in_is_frozen_once_compiled(cls, name, value):
    opt = cls()
    setattr(opt, name, value)  # before: allowed
    opt.transformation()
    with pytest.raises(optimizer.OptimizerArgumentError, match=f"{name}: cannot change it"):
        setattr(opt, name, value)
    opt.epsilon = 1e-3  # a scalar of the computation: may change


def test_none_has_a_row_sparse_kernel():
    for cls in (optimizer.Adamax, optimizer.Nadam, optimizer.FTML, optimizer.LAMB):
        assert cls().lazy_update is False


def test_reprs():
    assert repr(optimizer.Adamax()) == "Adamax(learning_rate=0.002, beta1=0.9, beta2=0.999)"
    assert repr(optimizer.LAMB(upper_bound=2, bias_correction=False, wd=0.1)) == (
        "LAMB(learning_rate=0.001, beta1=0.9, beta2=0.999, epsilon=1e-06, upper_bound=2.0, "
        "bias_correction=False, wd=0.1)"
    )
    assert "schedule_decay=0.004" in repr(optimizer.Nadam())
    assert repr(optimizer.FTML()).startswith("FTML(learning_rate=0.01, beta1=0.6")


def test_models_and_kernels_use_mxnets_constants():
    """``1 - beta1`` of Adamax and Nadam is a float64 rounded once (MXNet's Python scalar);
    FTML's and LAMB's is the float32 difference (C++): the two differ for 0.9."""
    assert f32(1.0 - 0.9) != ONE - f32(0.9)
    assert math.isclose(float(f32(1.0 - 0.9)), 0.1, rel_tol=1e-7)
