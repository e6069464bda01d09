"""jaxkv/_src/mxnet/optimizers/momentum.py: MXNet 1.9.1's NAG, Signum (and signSGD), SGLD, DCASGD,
LARS and LBSGD against NumPy float32 models of their kernels (each operation rounded in MXNet's
order), the update that reaches a new weight, their bookkeeping, refusals and edge cases."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv.mx as mx
from jaxkv._src.mxnet.optimizers.momentum import mx_clip, reaching, sign
from jaxkv.mx import optimizer

from ._optimizer_models import GRADS, ONE, W0, _clip, _on_cpu, _run, f32

LR, WD, RS, CLIP = 0.05, 0.02, 0.5, 0.4


def _np_sign(x):
    return (x > 0).astype(f32) - (x < 0).astype(f32)


def _step(g, lr, rescale, clip):
    """MXNet's SGD step: ``lr * clip(rescale * g)``, or ``(lr * rescale) * g`` unclipped."""
    if clip is None:
        return (f32(lr) * f32(rescale)) * g
    return f32(lr) * _clip(f32(rescale) * g, clip)


# -- the models --------------------------------------------------------------------------------
def _nag_model(w, grads, lr, momentum, wd=0.0, rescale=1.0, clip=None):
    mom = np.zeros_like(w)
    lr, m, wd = f32(lr), f32(momentum), f32(wd)
    for g in grads:
        if momentum == 0:  # sgd_update
            w = (ONE - lr * wd) * w - _step(g, lr, rescale, clip)
            continue
        scaled = f32(rescale) * g if clip is None else _clip(f32(rescale) * g, clip)
        kept = m * mom
        new = (w - kept) + (m + ONE) * (kept - lr * (scaled + wd * w))
        mom = kept - lr * (scaled + wd * new)  # the weight is already the new one
        w = new
    return w, mom


def _signum_model(w, grads, lr, momentum, wd=0.0, wd_lh=0.0, rescale=1.0, clip=None):
    mom = np.zeros_like(w)
    lr, m, wd = f32(lr), f32(momentum), f32(wd)
    for g in grads:
        if momentum == 0:  # signsgd_update: rescale and clip ignored
            w = (ONE - lr * wd) * w - lr * _np_sign(g)
            continue
        rest = ONE - m
        pushed = (rest * f32(rescale)) * g if clip is None else rest * _clip(f32(rescale) * g, clip)
        mom = (m * mom - (rest * wd) * w) - pushed
        w = (ONE - lr * f32(wd_lh)) * w + lr * _np_sign(mom)
    return w, mom


def _dcasgd_model(w, grads, lr, lamda, wd=0.0, rescale=1.0, clip=None):
    prev = w.copy()
    for g in grads:
        g = g * f32(rescale)
        if clip is not None:  # MXNet's clip operator, for any clip_gradient not None
            c = f32(clip)
            g = np.where(g > c, c, np.where(g < -c, -c, g)).astype(f32)
        step = ((g + w * f32(wd)) + ((f32(lamda) * g) * g) * (w - prev)) * f32(-lr)
        prev, w = w, w + step
    return w, prev


def _sgld_drift_model(w, g, lr, wd=0.0, rescale=1.0, clip=None):
    g = g * f32(rescale)
    if clip is not None:
        c = f32(clip)
        g = np.where(g > c, c, np.where(g < -c, -c, g)).astype(f32)
    return w + (g + w * f32(wd)) * f32(-lr / 2)


def _sum_sq(x):
    """MXNet's multi_sum_sq: float32 squares added one by one."""
    total = f32(0)
    for v in np.ravel(x):
        total = f32(total + v * v)
    return total


def _lars_model(w, grads, lr, eta, momentum=0.0, wd=0.0, eps=0.0, rescale=1.0, clip=None):
    mom = np.zeros_like(w)
    for g in grads:
        lr_l = f32(lr)
        w_norm, g_sq = np.sqrt(_sum_sq(w)), _sum_sq(g)
        if w_norm > 0 and g_sq > 0:
            below = (np.sqrt(g_sq) * f32(rescale) + f32(wd) * w_norm) + f32(eps)
            lr_l = ((f32(lr) * f32(eta)) * w_norm) / below
        decay = (lr_l * f32(wd)) * w
        mom = (f32(momentum) * mom - decay - _step(g, lr_l, rescale, clip)).astype(f32)
        w = w + mom
    return w, mom


def _lbsgd_model(w, grads, lr, momentum=0.0, wd=0.0, rescale=1.0, clip=None):
    mom = np.zeros_like(w)
    for n, g in enumerate(grads):
        g = g if n == 0 else np.where(g == 0, f32(0), g).astype(f32)  # 0 + grad
        step = _step(g, lr, rescale, clip)
        if momentum == 0:
            w = (ONE - f32(lr) * f32(wd)) * w - step
            continue
        mom = f32(momentum) * mom - (f32(lr) * f32(wd)) * w - step
        w = w + mom
    return w, mom


# -- the kernels against the models --------------------------------------------------------
NAG_CASES = {
    "sgd_update": {"lr": LR},
    "sgd_update_decay": {"lr": LR, "wd": WD, "rescale": RS, "clip": CLIP},
    "momentum": {"lr": LR, "momentum": 0.9},
    "momentum_decay_clip": {"lr": LR, "momentum": 0.8, "wd": WD, "rescale": RS, "clip": CLIP},
}


@pytest.mark.parametrize("case", list(NAG_CASES))
def test_nag_follows_mxnets_kernels(case):
    a = {"momentum": 0.0, **NAG_CASES[case]}
    opt = optimizer.NAG(
        learning_rate=a["lr"],
        momentum=a["momentum"],
        wd=a.get("wd", 0.0),
        rescale_grad=a.get("rescale", 1.0),
        clip_gradient=a.get("clip"),
    )
    got, state = _run(opt)
    want, mom = _nag_model(W0, GRADS, **a)
    np.testing.assert_array_equal(got, want)
    if a["momentum"]:
        np.testing.assert_array_equal(state.slots[0], mom)
    else:
        assert state.slots == ()


def test_nags_momentum_reads_the_new_weight_as_mxnets_in_place_kernel():
    """MXNet's nag_mom_update writes the weight first and reads it back for the momentum:
    with weight decay the momentum differs from the one of the weight before."""
    opt = optimizer.NAG(learning_rate=0.5, momentum=0.9, wd=0.5)
    _, state = _run(opt, grads=GRADS[:1])
    _, mom_new = _nag_model(W0, GRADS[:1], 0.5, 0.9, wd=0.5)
    before = f32(0.9) * np.zeros_like(W0) - f32(0.5) * (GRADS[0] + f32(0.5) * W0)
    np.testing.assert_array_equal(state.slots[0], mom_new)
    assert not np.array_equal(mom_new, before)


SIGNUM_CASES = {
    "signum": {"lr": LR, "momentum": 0.9},
    "signum_decay_clip": {"lr": LR, "momentum": 0.7, "wd": WD, "rescale": RS, "clip": CLIP},
    "signum_wd_lh": {"lr": LR, "momentum": 0.9, "wd": WD, "wd_lh": 0.1},
    "signsgd": {"lr": LR, "momentum": 0.0},
    "signsgd_decay": {"lr": LR, "momentum": 0.0, "wd": WD, "rescale": -3.0, "clip": 1e-3},
}


@pytest.mark.parametrize("case", list(SIGNUM_CASES))
def test_signum_and_signsgd_follow_mxnets_kernels(case):
    a = SIGNUM_CASES[case]
    opt = optimizer.Signum(
        learning_rate=a["lr"],
        momentum=a["momentum"],
        wd=a.get("wd", 0.0),
        wd_lh=a.get("wd_lh", 0.0),
        rescale_grad=a.get("rescale", 1.0),
        clip_gradient=a.get("clip"),
    )
    got, state = _run(opt)
    want, mom = _signum_model(W0, GRADS, **a)
    np.testing.assert_array_equal(got, want)
    assert len(state.slots) == (1 if a["momentum"] else 0)
    if a["momentum"]:
        np.testing.assert_array_equal(state.slots[0], mom)


def test_signs_are_cpps_zero_for_zero_and_nan():
    x = jnp.asarray([2.0, -0.5, 0.0, -0.0, jnp.nan, jnp.inf], jnp.float32)
    np.testing.assert_array_equal(sign(x), [1, -1, 0, 0, 0, 1])
    opt = optimizer.Signum(learning_rate=0.5, momentum=0.0)
    w = np.ones(6, f32)
    got, _ = _run(opt, grads=[np.asarray(x)], w=w)
    np.testing.assert_array_equal(got, [0.5, 1.5, 1, 1, 1, 0.5])


DCASGD_CASES = {
    "plain": {"lr": LR, "lamda": 0.04},
    "decay_clip": {"lr": LR, "lamda": 0.5, "wd": WD, "rescale": RS, "clip": CLIP},
    "clip_zero": {"lr": LR, "lamda": 0.5, "clip": 0.0},  # MXNet clips to [-0, 0]: no step
    "clip_negative": {"lr": LR, "lamda": 0.5, "clip": -0.3},  # its clip op's order, as MXNet
}


@pytest.mark.parametrize("case", list(DCASGD_CASES))
def test_dcasgd_follows_mxnets_expression(case):
    a = DCASGD_CASES[case]
    opt = optimizer.DCASGD(
        learning_rate=a["lr"],
        lamda=a["lamda"],
        wd=a.get("wd", 0.0),
        rescale_grad=a.get("rescale", 1.0),
        clip_gradient=a.get("clip"),
    )
    got, state = _run(opt)
    want, prev = _dcasgd_model(W0, GRADS, **a)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(state.slots[0], prev)
    if case == "clip_zero":
        np.testing.assert_array_equal(got, W0)


def test_mxnets_clip_operator_for_any_bounds():
    x = jnp.asarray([-2.0, -0.1, 0.0, 0.1, 2.0, jnp.nan], jnp.float32)
    np.testing.assert_array_equal(mx_clip(x, -1.0, 1.0), f32([-1, -0.1, 0, 0.1, 1, np.nan]))
    # crossed bounds (a negative clip_gradient): above hi gives hi, else below lo gives lo
    want = f32([0.3, -0.3, -0.3, -0.3, -0.3, np.nan])
    np.testing.assert_array_equal(mx_clip(x, 0.3, -0.3), want)


class _ZeroNoise(optimizer.SGLD):
    def _noise(self, key, shape, dtype, scale):
        return jnp.zeros(shape, dtype)


@pytest.mark.parametrize(
    "a",
    [
        {"lr": LR},
        {"lr": 0.3, "wd": WD, "rescale": RS, "clip": CLIP},
        {"lr": 0.3, "clip": 0.0},
    ],
)
def test_sglds_deterministic_part_follows_mxnets_expression(a):
    opt = _ZeroNoise(
        learning_rate=a["lr"],
        wd=a.get("wd", 0.0),
        rescale_grad=a.get("rescale", 1.0),
        clip_gradient=a.get("clip"),
    )
    got, state = _run(opt, grads=GRADS[:1])
    np.testing.assert_array_equal(got, _sgld_drift_model(W0, GRADS[0], **a))
    assert state.slots == ()


def test_sgld_noise_is_normal_with_the_square_root_of_the_rate():
    lr, n = 0.09, 40000
    w = np.zeros(n, f32)
    got, _ = _run(optimizer.SGLD(learning_rate=lr), grads=[np.zeros(n, f32)], w=w)
    assert abs(got.mean()) < 5 * math.sqrt(lr / n)
    assert abs(got.var() - lr) < 5 * lr * math.sqrt(2 / n)  # lr/2, sqrt(lr) or 2*lr would fail


def test_sgld_refuses_a_negative_rate_whose_root_mxnet_cannot_take():
    opt = optimizer.SGLD(learning_rate=-0.1)
    with pytest.raises(optimizer.OptimizerArgumentError, match="learning rate expected >= 0"):
        opt.next_update([0])


def test_sglds_seed_comes_from_mx_random():
    mx.random.seed(3)
    a = optimizer.SGLD().inputs(0)
    mx.random.seed(3)
    b = optimizer.SGLD().inputs(0)
    mx.random.seed(4)
    c = optimizer.SGLD().inputs(0)
    assert a == b and a[-2:] != c[-2:]
    assert a[-2:] != optimizer.SGLD().inputs(1)[-2:]  # each key its own stream
    assert all(x == int(x) and 0 <= x < 2**16 for x in a[-2:])  # exact in float32


LARS_CASES = {
    "plain": {"lr": 0.5, "eta": 0.1},
    "momentum": {"lr": 0.5, "eta": 0.1, "momentum": 0.9, "wd": WD},
    "everything": {"lr": 0.5, "eta": 0.3, "momentum": 0.5, "wd": WD, "eps": 1e-3, "rescale": RS,
                   "clip": CLIP},
}  # fmt: skip


@pytest.mark.parametrize("case", list(LARS_CASES))
def test_lars_follows_mxnets_aggregated_path(case):
    """The norms: XLA's order of additions, MXNet's sequential one; on 8 elements they agree,
    so the whole update is MXNet's bits here."""
    a = LARS_CASES[case]
    opt = optimizer.LARS(
        learning_rate=a["lr"],
        eta=a["eta"],
        momentum=a.get("momentum", 0.0),
        wd=a.get("wd", 0.0),
        eps=a.get("eps", 0.0),
        rescale_grad=a.get("rescale", 1.0),
        clip_gradient=a.get("clip"),
    )
    got, state = _run(opt)
    want, mom = _lars_model(W0, GRADS, **a)
    np.testing.assert_array_equal(got, want)
    if a.get("momentum"):
        np.testing.assert_array_equal(state.slots[0], mom)


def test_lars_leaves_the_rate_of_biases_and_of_zero_norms_alone():
    opt = optimizer.LARS(learning_rate=0.5, eta=0.1, param_idx2name={0: "fc_bias", 1: "fc_w"})
    assert opt.inputs(0)[5] == 0.0 and opt.inputs(1)[5] == 1.0 and opt.inputs(2)[5] == 1.0
    assert opt.wd_mult == {"fc_bias": 0.0, "fc_w": 0.0}  # LARS: only *_weight decays
    opt.set_wd_mult({"fc_w": 2.0})
    assert opt.wd_mult == {"fc_bias": 0.0, "fc_w": 2.0}
    tx = opt.transformation()
    # a bias (index 0), and a weight of norm 0 (index 1, which LARS would scale to rate 0)
    for index, w in ((0, W0), (1, np.zeros_like(W0))):
        w, s = _on_cpu(w), jnp.asarray(opt.inputs(index), jnp.float32)
        updates, _ = tx.update(_on_cpu(GRADS[0]), tx.init(w), w, scalars=s)
        np.testing.assert_array_equal(updates, -_step(GRADS[0], 0.5, 1.0, None))
    updates, _ = tx.update(_on_cpu(GRADS[0]), tx.init(_on_cpu(W0)), _on_cpu(W0), scalars=s)
    assert not np.array_equal(updates, -_step(GRADS[0], 0.5, 1.0, None))  # scaled


def test_lars_corrects_the_momentum_when_the_rate_changes():
    sched = mx.lr_scheduler.FactorScheduler(step=1, factor=0.5, base_lr=1.0)
    opt = optimizer.LARS(momentum=0.9, lr_scheduler=sched)
    momentum = optimizer.LARS.SCALARS.index("momentum")
    rows = [opt.next_update([0, 1]) for _ in range(3)]
    # the first update: no previous rate; then each key's update sees the rate of the one
    # before (of any key): halved at key 0, unchanged at key 1
    assert [float(r[0, momentum]) for r in rows] == [f32(0.9), f32(0.45), f32(0.45)]
    assert [float(r[1, momentum]) for r in rows] == [f32(0.9)] * 3
    saved = opt.bookkeeping()
    opt.next_update([0])
    opt.restore_bookkeeping(saved)
    assert (opt.last_lr, opt.cur_lr) == (0.25, 0.25)
    plain = optimizer.LARS(momentum=0.9, lr_scheduler=sched, momentum_correction=False)
    assert float(plain.next_update([0])[0, momentum]) == f32(0.9)


LBSGD_CASES = {
    "plain": {"lr": LR},
    "decay": {"lr": LR, "wd": WD, "rescale": RS, "clip": CLIP},
    "momentum": {"lr": LR, "momentum": 0.9, "wd": WD, "rescale": RS},
}


@pytest.mark.parametrize("case", list(LBSGD_CASES))
def test_lbsgd_follows_mxnets_sgd_kernels(case):
    a = LBSGD_CASES[case]
    opt = optimizer.LBSGD(
        learning_rate=a["lr"],
        momentum=a.get("momentum", 0.0),
        wd=a.get("wd", 0.0),
        rescale_grad=a.get("rescale", 1.0),
        clip_gradient=a.get("clip"),
    )
    got, state = _run(opt)
    want, mom = _lbsgd_model(W0, GRADS, **a)
    np.testing.assert_array_equal(got, want)
    if a.get("momentum"):
        np.testing.assert_array_equal(state.slots[0], mom)


def test_lbsgd_adds_mxnets_zero_to_the_gradient_after_the_first_update():
    """MXNet's cumulated gradient is the gradient itself at a key's first update, then
    ``0 + grad``: a -0.0 becomes 0.0, which shows on a weight of -0.0."""
    opt = optimizer.LBSGD(learning_rate=0.5)
    w = np.full(2, -0.0, f32)
    g = np.asarray([-0.0, 1.0], f32)
    got, _ = _run(opt, grads=[g, g], w=w)
    first = w - f32(0.5) * g  # -0.0 - (-0.0) = 0.0; then 0.0 - 0.0 stays
    assert np.signbit(first[0]) == np.signbit(got[0]) == False  # noqa: E712
    once, _ = _run(optimizer.LBSGD(learning_rate=0.5), grads=[g], w=np.float32([-0.0, 0.0]))
    assert not np.signbit(once[0])  # -0.0 - 0.5 * -0.0 = -0.0 + 0.0


def test_lbsgd_reads_the_rate_before_counting_the_update():
    sched = mx.lr_scheduler.FactorScheduler(step=1, factor=0.5, base_lr=1.0)
    opt = optimizer.LBSGD(lr_scheduler=sched)
    sgd = optimizer.SGD(lr_scheduler=mx.lr_scheduler.FactorScheduler(step=1, factor=0.5))
    lbsgd_rates = [float(opt.next_update([0])[0, 0]) for _ in range(4)]
    sgd_rates = [float(sgd.next_update([0])[0, 0]) for _ in range(4)]
    assert lbsgd_rates == [1.0, 1.0, 0.5, 0.25]  # the rate at num_update 0, 1, 2, 3
    assert sgd_rates == [f32(0.01), f32(0.005), f32(0.0025), f32(0.00125)]  # at 1, 2, 3, 4
    assert opt.inputs(0)[0] == 0.25  # a row-sparse push compiles in the rate it read
    saved = opt.bookkeeping()
    opt.next_update([0])
    opt.restore_bookkeeping(saved)
    assert opt.inputs(0)[0] == 0.25


def test_lbsgd_lars_warmup_is_mxnets_multiplier_within_its_sums():
    """'lars': lr * clip(sqrt(|w|^2 / (|g|^2 + wd |w|^2 + 1e-18)), 0.01, 100), in MXNet's
    float64 from NumPy's float32 sums of squares (pairwise); XLA adds them in its own order
    (here its sum of W0's squares is one ulp from NumPy's): within 1e-6 relative."""
    opt = optimizer.LBSGD(learning_rate=0.3, wd=WD, warmup_strategy="lars")
    got, _ = _run(opt, grads=GRADS[:1])
    w2, g2 = float(np.sum(W0 * W0)), float(np.sum(GRADS[0] * GRADS[0]))
    lars = min(max(math.sqrt(w2 / (g2 + WD * w2 + 1e-18)), 0.01), 100)
    lr = f32(0.3 * lars)
    want = (ONE - lr * f32(WD)) * W0 - (lr * ONE) * GRADS[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
    assert not np.array_equal(got, W0)
    for w, lo in ((np.full(8, 1e-6, f32), 0.01), (np.full(8, 1e6, f32), 100.0)):  # the clamp
        got, _ = _run(optimizer.LBSGD(learning_rate=0.5, warmup_strategy="lars"), GRADS[:1], w=w)
        np.testing.assert_array_equal(got, w - (f32(0.5 * lo) * ONE) * GRADS[0])


# -- the update that reaches a new weight ----------------------------------------------------
def test_reaching_gives_the_new_weight_wherever_a_float32_update_can():
    rng = np.random.default_rng(7)
    w = f32(rng.standard_normal(20000)) * f32(rng.choice([1e-3, 1.0, 1e3], 20000))
    target = f32(w * f32(rng.uniform(-3, 3, 20000)))
    z = jnp.zeros((), jnp.int32)
    u = np.asarray(jax.jit(reaching)(_on_cpu(w), _on_cpu(target), z))
    got = w + u
    # the best any update near target - w can do (w + u is monotone in u)
    near = (target - w)[None, :] + np.spacing(target - w)[None, :] * np.arange(-4, 5)[:, None]
    best = np.abs((w + f32(near)) - target).min(axis=0)
    np.testing.assert_array_equal(np.abs(got - target), best)
    small = np.abs(target - w) < np.abs(target) / 2
    assert small.sum() > 3000
    np.testing.assert_array_equal(got[small], target[small])  # the documented guarantee


def test_reaching_keeps_nan_and_infinities():
    z = jnp.zeros((), jnp.int32)
    w = jnp.asarray([1.0, 1.0, jnp.inf], jnp.float32)
    t = jnp.asarray([jnp.nan, jnp.inf, jnp.inf], jnp.float32)
    got = np.asarray(w + reaching(w, t, z))
    assert np.isnan(got[0]) and got[1] == np.inf and np.isnan(got[2])  # inf - inf


# -- refusals and arguments ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: optimizer.NAG(momentum=-0.1), r"NAG: momentum expected >= 0.*-0.1"),
        (lambda: optimizer.Signum(momentum=-1), "Signum: momentum expected >= 0"),
        (lambda: optimizer.Signum(momentum=0, wd_lh=0.1), "wd_lh=0.1 with momentum=0"),
        (lambda: optimizer.Signum(wd_lh="0.1"), "wd_lh expected a number, given str"),
        (lambda: optimizer.DCASGD(momentum=0.5), r"DCASGD: momentum expected 0, given 0.5"),
        (lambda: optimizer.DCASGD(lamda=None), "lamda expected a number"),
        (lambda: optimizer.LARS(momentum=-0.5), "LARS: momentum expected >= 0"),
        (lambda: optimizer.LARS(eta="big"), "eta expected a number"),
        (lambda: optimizer.LBSGD(batch_scale=4), "batch_scale expected 1, given 4"),
        (lambda: optimizer.LBSGD(warmup_strategy="cosine"), "warmup_strategy expected one of"),
        (lambda: optimizer.LBSGD(updates_per_epoch=None), "updates_per_epoch expected a num"),
        (lambda: optimizer.SGLD(momentum=0.9), r"unexpected keyword argument\(s\) \['momentum"),
    ],
)
def test_arguments_mxnet_would_refuse_or_jaxkv_cannot_honour_are_refused(make, message):
    with pytest.raises(optimizer.OptimizerArgumentError, match=message):
        make()


def test_positional_arguments_are_mxnets():
    assert optimizer.NAG(0.9).momentum == 0.9
    s = optimizer.Signum(0.1, 0.8, 0.01)
    assert (s.lr, s.momentum, s.wd_lh) == (0.1, 0.8, 0.01)
    d = optimizer.DCASGD(0.0, 0.5)
    assert (d.momentum, d.lamda) == (0.0, 0.5)
    lars = optimizer.LARS(0.9, False, 0.01, 1e-4, False)
    assert (lars.momentum, lars.lazy_update, lars.eta, lars.eps) == (0.9, False, 0.01, 1e-4)
    assert lars.momentum_correction is False
    lb = optimizer.LBSGD(0.5, False, "sqrt", 3, 1, 10, 2, 20)
    assert (lb.momentum, lb.warmup_strategy, lb.warmup_epochs, lb.init_updates) == (
        0.5,
        "sqrt",
        3,
        20,
    )
    assert repr(optimizer.NAG(momentum=0.5)) == "NAG(learning_rate=0.01, momentum=0.5)"


def test_what_shapes_the_state_freezes_once_compiled():
    for opt in (optimizer.NAG(momentum=0.9), optimizer.Signum(), optimizer.LBSGD()):
        opt.transformation()
        with pytest.raises(optimizer.OptimizerArgumentError, match="cannot change it after"):
            opt.momentum = 0.0
        opt.lr = 0.5  # a number of the computation: free
    lb = optimizer.LBSGD()
    lb.transformation()
    with pytest.raises(optimizer.OptimizerArgumentError, match="warmup_strategy"):
        lb.warmup_strategy = "lars"


def test_row_sparse_kernels_refused_where_mxnet_needs_the_whole_weight():
    with pytest.raises(optimizer.OptimizerArgumentError, match="LARS: row-sparse gradients"):
        optimizer.LARS().transformation(row_sparse=True)
    with pytest.raises(optimizer.OptimizerArgumentError, match="warmup_strategy='lars'"):
        optimizer.LBSGD(warmup_strategy="lars").transformation(row_sparse=True)
    assert optimizer.LBSGD().transformation(row_sparse=True) is not None


def test_lars_refuses_float16_weights_whose_norms_mxnet_takes_in_float16():
    tx = optimizer.LARS(multi_precision=True).transformation()
    with pytest.raises(optimizer.OptimizerArgumentError, match="LARS: multi_precision=True"):
        tx.init(jnp.ones(4, jnp.float16))
    assert tx.init(jnp.ones(4, jnp.float32)).slots == ()


@pytest.mark.parametrize(
    ("make", "lazy", "slots"),
    [
        (lambda: optimizer.NAG(), True, 0),
        (lambda: optimizer.NAG(momentum=0.5), False, 1),
        (lambda: optimizer.Signum(), False, 1),
        (lambda: optimizer.Signum(momentum=0), False, 0),
        (lambda: optimizer.SGLD(), False, 0),
        (lambda: optimizer.DCASGD(), False, 1),
        (lambda: optimizer.LARS(momentum=0.5), True, 1),
        (lambda: optimizer.LBSGD(momentum=0.5), True, 1),
    ],
)
def test_lazy_rows_and_state_as_mxnets_kernels(make, lazy, slots):
    opt = make()
    assert opt.lazy_update is lazy
    _, state = _run(opt, grads=GRADS[:1])
    assert len(state.slots) == slots
    assert all(s.shape == W0.shape and s.dtype == W0.dtype for s in state.slots)
