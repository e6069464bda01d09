"""jaxkv/_src/mxnet/optimizers/adaptive.py: MXNet 1.9.1's AdaGrad, GroupAdaGrad, RMSProp (plain and
centered), AdaDelta and Ftrl against NumPy float32 models of their kernels (each operation
rounded in MXNet's order), eagerly and under ``jit``; their bookkeeping, refusals and edge
cases."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxkv.mx as mx
from jaxkv._src.mxnet.optimizers import float32 as _f32
from jaxkv._src.mxnet.optimizers.adaptive import _kahan_rows, _plain_rows
from jaxkv._src.mxnet.optimizers.float32 import over, root
from jaxkv.mx import optimizer

from ._optimizer_models import G_BIG, GRADS, ONE, W0, W_BIG, _on_cpu, f32

LR, WD, RS, CLIP = 0.05, 0.02, 0.5, 0.4
W2 = W_BIG.reshape(32, 8)  # GroupAdaGrad takes 2-D weights
G2 = [G_BIG.reshape(32, 8), (G_BIG[::-1] * f32(3)).reshape(32, 8)]
GRADS_BIG = [G_BIG, G_BIG[::-1] * f32(3)]


# -- the models --------------------------------------------------------------------------------
def _ndarray_clip(g, clip):
    """MXNet's clip operator (its NDArray expressions), for any clip_gradient not None."""
    if clip is None:
        return g
    lo, hi = -f32(clip), f32(clip)
    return np.where(g > hi, hi, np.where(g < lo, lo, g)).astype(f32)


def _kernel_clip(g, clip):
    """A C++ kernel's clip: given when truthy, applied when >= 0."""
    if not clip or clip < 0:
        return g
    c = f32(clip)
    return np.where(g > c, c, np.where(g < -c, -c, g)).astype(f32)


def _sign(x):
    return (x > 0).astype(f32) - (x < 0).astype(f32)


def _kahan(sq):
    total, residual = np.zeros(sq.shape[0], f32), np.zeros(sq.shape[0], f32)
    for j in range(sq.shape[1]):
        y = sq[:, j] - residual
        t = total + y
        residual, total = (t - total) - y, t
    return total


def _plain(sq):
    total = np.zeros(sq.shape[0], f32)
    for j in range(sq.shape[1]):
        total = total + sq[:, j]
    return total


def _adagrad_model(w, grads, lr, eps=1e-7, wd=0.0, rescale=1.0, clip=None, sparse=False):
    h = np.zeros_like(w)
    for g in grads:
        g = g * f32(rescale)
        g = _kernel_clip(g, clip) if sparse else _ndarray_clip(g, clip)
        h = h + g * g
        div = g / np.sqrt(h + f32(eps))
        w = w - div * f32(lr) if sparse else w + (div + w * f32(wd)) * f32(-lr)
    return w, h


def _group_model(w, grads, lr, eps=1e-5, rescale=1.0, clip=None, sparse=False):
    h = np.zeros((w.shape[0], 1), f32)
    for g in grads:
        g = g * f32(rescale)
        g = _kernel_clip(g, clip) if sparse else _ndarray_clip(g, clip)
        total = _plain(g * g) if sparse else _kahan(g * g)
        h = h + (total / f32(w.shape[1]))[:, None]
        w = w - (f32(lr) * g) / np.sqrt(h + f32(eps))
    return w, h


def _rmsprop_model(w, grads, lr, g1=0.9, g2=0.9, eps=1e-8, centered=False, wd=0.0, rescale=1.0,
                   clip=None, clip_weights=None):  # fmt: skip
    n, mean, delta = np.zeros_like(w), np.zeros_like(w), np.zeros_like(w)
    rest = ONE - f32(g1)
    for g in grads:
        g = _kernel_clip(f32(rescale) * g + f32(wd) * w, clip)
        if centered:
            n = (rest * g) * g + f32(g1) * n
            mean = rest * g + f32(g1) * mean
            delta = f32(g2) * delta - (f32(lr) * g) / np.sqrt((n - mean * mean) + f32(eps))
            w = w + delta
        else:
            n = rest * (g * g) + f32(g1) * n
            w = w - f32(lr) * (g / np.sqrt(n + f32(eps)))
        if clip_weights and clip_weights >= 0:
            w = _kernel_clip(w, clip_weights)
    return w, ((n, mean, delta) if centered else (n,))


def _adadelta_model(w, grads, rho=0.9, eps=1e-5, wd=0.0, rescale=1.0, clip=None):
    acc_g, acc_delta = np.zeros_like(w), np.zeros_like(w)
    rest = f32(1.0 - rho)  # MXNet's Python: 1 - rho in float64
    for g in grads:
        g = _ndarray_clip(g * f32(rescale), clip)
        acc_g = acc_g * f32(rho) + (rest * g) * g
        delta = (np.sqrt(acc_delta + f32(eps)) / np.sqrt(acc_g + f32(eps))) * g
        acc_delta = acc_delta * f32(rho) + (rest * delta) * delta
        w = w - (delta + w * f32(wd))
    return w, (acc_g, acc_delta)


def _ftrl_model(w, grads, lr=0.1, lamda1=0.01, beta=1.0, wd=0.0, rescale=1.0, clip=None, zn=None):
    z, n = (np.zeros_like(w), np.zeros_like(w)) if zn is None else zn
    lr = f32(lr)
    for g in grads:
        g = _kernel_clip(g * f32(rescale), clip)
        z = z + (g - ((np.sqrt(n + g * g) - np.sqrt(n)) * w) / lr)
        n = n + g * g
        below = (f32(beta) + np.sqrt(n)) / lr + f32(wd)
        w = ((_sign(z) * f32(lamda1) - z) / below) * (np.abs(z) > f32(lamda1)).astype(f32)
    return w, (z, n)


def _steps(opt, w, grads, jit=False, row_sparse=False):
    """The weights and state after ``grads``, eagerly or under ``jit`` (the count traced, so
    every product is kept apart from its sum as on a store)."""
    tx = opt.transformation(row_sparse=row_sparse)

    def step(w, g, state):
        updates, state = tx.update(g, state, w)
        return optax.apply_updates(w, updates), state

    step = jax.jit(step) if jit else step
    w = _on_cpu(w)
    state = tx.init(w)
    for g in grads:
        w, state = step(w, _on_cpu(g), state)
    return np.asarray(w), state


# -- the kernels against the models --------------------------------------------------------
ADAGRAD = {
    "plain": {"lr": LR},
    "everything": {"lr": LR, "eps": 1e-3, "wd": WD, "rescale": RS, "clip": CLIP},
    "clip_zero": {"lr": LR, "wd": WD, "clip": 0.0},  # MXNet's expression clips to 0: decay only
    "clip_negative": {"lr": LR, "clip": -0.3},  # its clip operator, bounds crossed
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("case", list(ADAGRAD))
def test_adagrad_follows_mxnets_expression(case, jit):
    a = ADAGRAD[case]
    opt = optimizer.AdaGrad(
        learning_rate=a["lr"],
        eps=a.get("eps", 1e-7),
        wd=a.get("wd", 0.0),
        rescale_grad=a.get("rescale", 1.0),
        clip_gradient=a.get("clip"),
    )
    w, grads = (W_BIG, GRADS_BIG) if jit else (W0, GRADS)
    got, state = _steps(opt, w, grads, jit=jit)
    want, h = _adagrad_model(w, grads, **a)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(state.slots[0], h)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("clip", [None, CLIP, 0.0, -0.3])
def test_adagrads_row_sparse_kernel_is_mxnets_sparse_adagrad_update(clip, jit):
    """``weight - div * lr``, clipping only for a positive clip_gradient."""
    opt = optimizer.AdaGrad(learning_rate=LR, rescale_grad=RS, clip_gradient=clip)
    w, grads = (W_BIG, GRADS_BIG) if jit else (W0, GRADS)
    got, state = _steps(opt, w, grads, jit=jit, row_sparse=True)
    want, h = _adagrad_model(w, grads, LR, rescale=RS, clip=clip, sparse=True)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(state.slots[0], h)
    if clip == 0.0:  # the dense expression clips to 0, the kernel does not clip
        dense, _ = _steps(opt, w, grads, jit=jit)
        assert not np.array_equal(dense, got)


GROUP = {
    "plain": {"lr": LR},
    "everything": {"lr": LR, "eps": 1e-3, "rescale": RS, "clip": CLIP},
    "clip_zero": {"lr": LR, "clip": 0.0},
}


@pytest.mark.parametrize("row_sparse", [False, True])
@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("case", list(GROUP))
def test_groupadagrad_follows_mxnets_expression_and_kernel(case, jit, row_sparse):
    a = GROUP[case]
    opt = optimizer.GroupAdaGrad(
        learning_rate=a["lr"],
        eps=a.get("eps", 1e-5),
        rescale_grad=a.get("rescale", 1.0),
        clip_gradient=a.get("clip"),
    )
    got, state = _steps(opt, W2, G2, jit=jit, row_sparse=row_sparse)
    want, h = _group_model(W2, G2, **a, sparse=row_sparse)
    np.testing.assert_array_equal(got, want)
    history = np.asarray(state.slots[0])
    assert history.shape == W2.shape  # every element of a row holds the row's history
    np.testing.assert_array_equal(history, np.broadcast_to(h, W2.shape))


def test_groupadagrad_sums_rows_as_mxnet_kahan_dense_plain_row_sparse():
    """MXNet's mean (a CPU reduction) adds with Kahan's compensation, its row-sparse kernel
    without: the two differ in some rows, each is MXNet's."""
    rng = np.random.default_rng(5)
    sq = f32(rng.uniform(0, 4, (400, 7))) ** 2
    z = _f32.opaque_zero(jnp.int32(0))
    kahan = jax.jit(_kahan_rows)(jnp.asarray(sq), z)
    plain = jax.jit(_plain_rows)(jnp.asarray(sq), z)
    np.testing.assert_array_equal(kahan, _kahan(sq))
    np.testing.assert_array_equal(plain, _plain(sq))
    assert 0 < int(np.sum(np.asarray(kahan) != np.asarray(plain))) < 400
    dense, _ = _steps(optimizer.GroupAdaGrad(learning_rate=LR), W2, G2)
    sparse, _ = _steps(optimizer.GroupAdaGrad(learning_rate=LR), W2, G2, row_sparse=True)
    assert not np.array_equal(dense, sparse)


RMSPROP = {
    "plain": {"lr": LR},
    "everything": {"lr": LR, "g1": 0.8, "eps": 1e-6, "wd": WD, "rescale": RS, "clip": CLIP},
    "clip_weights": {"lr": LR, "clip_weights": 0.5},  # clipped by less than 0.25: reached
    "centered": {"lr": LR, "centered": True, "g2": 0.7},
    "centered_everything": {"lr": LR, "centered": True, "g1": 0.85, "g2": 0.7, "eps": 1e-5,
                            "wd": WD, "rescale": RS, "clip": CLIP, "clip_weights": 0.5},
    "negative_clips": {"lr": LR, "clip": -0.3, "clip_weights": -0.2},  # MXNet: neither clips
}  # fmt: skip


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("case", list(RMSPROP))
def test_rmsprop_follows_mxnets_kernels(case, jit):
    a = RMSPROP[case]
    opt = optimizer.RMSProp(
        learning_rate=a["lr"],
        gamma1=a.get("g1", 0.9),
        gamma2=a.get("g2", 0.9),
        epsilon=a.get("eps", 1e-8),
        centered=a.get("centered", False),
        clip_weights=a.get("clip_weights"),
        wd=a.get("wd", 0.0),
        rescale_grad=a.get("rescale", 1.0),
        clip_gradient=a.get("clip"),
    )
    w, grads = (W_BIG, GRADS_BIG) if jit else (W0, GRADS)
    got, state = _steps(opt, w, grads, jit=jit)
    want, slots = _rmsprop_model(w, grads, **a)
    np.testing.assert_array_equal(got, want)
    assert len(state.slots) == len(slots) == (3 if a.get("centered") else 1)
    for mine, theirs in zip(state.slots, slots, strict=True):
        np.testing.assert_array_equal(mine, theirs)
    if case == "clip_weights":
        assert np.abs(got).max() == f32(0.5) and np.sum(np.abs(got) == f32(0.5)) > got.size // 4


def test_rmsprop_clipped_weights_within_an_ulp_of_the_step_where_unreachable():
    """A weight far outside a clip_weights of finer bits: no float32 update reaches MXNet's
    clipped weight; the one given is the nearest reachable."""
    w = f32([0.9, -0.95, 0.7, 0.05])
    opt = optimizer.RMSProp(learning_rate=1e-3, clip_weights=0.1)
    got, _ = _steps(opt, w, [f32([1e-3, 1e-3, 1e-3, 1e-3])])
    want, _ = _rmsprop_model(w, [f32([1e-3] * 4)], 1e-3, clip_weights=0.1)
    assert np.all(np.abs(got - want) <= np.spacing(np.abs(want - w)))
    assert not np.array_equal(got, want)  # the exception is real here
    assert got[3] == want[3]  # inside the range: the plain step


ADADELTA = {
    "plain": {},
    "everything": {"rho": 0.8, "eps": 1e-4, "wd": WD, "rescale": RS, "clip": CLIP},
    "clip_zero": {"wd": WD, "clip": 0.0},
    "clip_negative": {"rho": 0.95, "clip": -0.2},
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("case", list(ADADELTA))
def test_adadelta_follows_mxnets_expression(case, jit):
    a = ADADELTA[case]
    opt = optimizer.AdaDelta(
        rho=a.get("rho", 0.9),
        epsilon=a.get("eps", 1e-5),
        wd=a.get("wd", 0.0),
        rescale_grad=a.get("rescale", 1.0),
        clip_gradient=a.get("clip"),
    )
    w, grads = (W_BIG, GRADS_BIG) if jit else (W0, GRADS)
    got, state = _steps(opt, w, grads, jit=jit)
    want, slots = _adadelta_model(w, grads, **a)
    np.testing.assert_array_equal(got, want)
    for mine, theirs in zip(state.slots, slots, strict=True):
        np.testing.assert_array_equal(mine, theirs)


def test_adadelta_takes_one_minus_rho_from_float64_as_mxnets_python():
    rho = 0.9
    assert f32(1.0 - rho) != ONE - f32(rho)  # the two roundings differ for MXNet's default
    opt = optimizer.AdaDelta(rho=rho)
    assert opt.next_update([0])[0][optimizer.AdaDelta.SCALARS.index("one_minus_rho")] == f32(
        1.0 - rho
    )


class _Counting(mx.lr_scheduler.FactorScheduler):
    calls = 0

    def __call__(self, num_update):
        type(self).calls += 1
        return super().__call__(num_update)


def test_adadelta_uses_no_learning_rate_and_calls_no_schedule_as_mxnet():
    sched = _Counting(step=1, factor=0.5, base_lr=0.3)
    opt = optimizer.AdaDelta(lr_scheduler=sched)
    rows = opt.next_update([0, 1, 0])
    assert _Counting.calls == 0 and opt.num_update == 2  # counted, as MXNet's _update_count
    assert "lr" not in optimizer.AdaDelta.SCALARS and rows.shape == (3, 7)
    a, _ = _steps(optimizer.AdaDelta(learning_rate=0.5), W0, GRADS)
    b, _ = _steps(optimizer.AdaDelta(learning_rate=5.0), W0, GRADS)
    np.testing.assert_array_equal(a, b)


FTRL = {
    "plain": {},
    "everything": {"lr": LR, "lamda1": 0.05, "beta": 0.5, "wd": WD, "rescale": RS, "clip": CLIP},
    "no_l1": {"lr": 0.3, "lamda1": 0.0},
}


@pytest.mark.parametrize("row_sparse", [False, True])
@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("case", list(FTRL))
def test_ftrl_keeps_mxnets_state_and_weight_in_weight_plus_residual(case, jit, row_sparse):
    """z and n bit for bit; MXNet's weight is weight + residual exactly; the weight itself is
    MXNet's wherever a float32 update reaches it, and within an ulp of the step
    elsewhere. The row-sparse kernel is the dense one (on the pushed rows)."""
    a = FTRL[case]
    opt = optimizer.Ftrl(
        learning_rate=a.get("lr", 0.1),
        lamda1=a.get("lamda1", 0.01),
        beta=a.get("beta", 1.0),
        wd=a.get("wd", 0.0),
        rescale_grad=a.get("rescale", 1.0),
        clip_gradient=a.get("clip"),
    )
    w, grads = (W_BIG, GRADS_BIG) if jit else (W0, GRADS)
    tx = opt.transformation(row_sparse=row_sparse)
    step = jax.jit(tx.update) if jit else tx.update
    state = tx.init(_on_cpu(w))
    mine = _on_cpu(w)
    theirs, zn = w, None
    differ = 0
    for g in grads:
        updates, state = step(_on_cpu(g), state, mine)
        mine = np.asarray(optax.apply_updates(mine, updates))
        theirs, zn = _ftrl_model(theirs, [g], **a, zn=zn)
        z, n = zn
        z_mine, n_mine, residual = (np.asarray(x) for x in state.slots)
        np.testing.assert_array_equal(z_mine, z)
        np.testing.assert_array_equal(n_mine, n)
        np.testing.assert_array_equal(mine + residual, theirs)
        reached = mine == theirs
        np.testing.assert_array_equal(residual[reached], 0)
        moved = np.abs(np.asarray(updates))  # within an ulp of the float32 update
        assert np.all(np.abs(mine - theirs) <= np.spacing(moved))
        differ += int(np.sum(~reached))
        mine = _on_cpu(mine)
    if jit:
        assert differ > 0  # on 256 elements some weights shrink too far to be reached


def test_ftrl_zeroes_weights_within_lamda1_and_reaches_zero_exactly():
    w = f32([0.5, -0.25, 0.75, 0.125])
    g = f32([0.004, -0.004, 3.0, 0.0])
    got, state = _steps(optimizer.Ftrl(learning_rate=1.0, lamda1=0.5), w, [g])
    want, (z, _) = _ftrl_model(w, [g], lr=1.0, lamda1=0.5)
    np.testing.assert_array_equal(got + np.asarray(state.slots[2]), want)
    assert got[3] == 0.0 and np.abs(z[3]) <= 0.5  # a zero gradient on a weight: |z| small
    assert np.count_nonzero(got) == np.count_nonzero(want)


def test_ftrl_leaves_a_schedules_base_lr_alone_as_mxnet():
    sched = mx.lr_scheduler.FactorScheduler(step=2, factor=0.5, base_lr=0.4)
    opt = optimizer.Ftrl(lr_scheduler=sched)  # no warning: MXNet gives it no learning_rate
    assert sched.base_lr == 0.4 and opt.lr == 0.1
    assert opt.next_update([0])[0][0] == f32(0.4)
    rms = optimizer.RMSProp(learning_rate=0.05, lr_scheduler=None)
    assert rms.next_update([0])[0][0] == f32(0.05)


# -- XLA's rewrites, kept out -----------------------------------------------------------------
def test_divisions_stay_correctly_rounded_under_jit():
    """XLA turns ``a / sqrt(b)`` into ``a * rsqrt(b)`` and a division by a broadcast into a
    product with its reciprocal; ``root`` and ``over`` keep MXNet's rounding."""
    rng = np.random.default_rng(2)
    a, b = f32(rng.uniform(0.1, 4, 4000)), f32(rng.uniform(0.1, 4, 4000))
    c = f32(rng.uniform(0.1, 4, (4000, 1)))
    count = jnp.int32(3)
    plain_root = jax.jit(lambda a, b: a / jnp.sqrt(b))(a, b)
    plain_over = jax.jit(lambda a, s: a / s)(a, f32(3))
    # At least one rewrite is real with this XLA (older XLAs divide by a scalar as written),
    # so the assertions below can fail.
    assert not (
        np.array_equal(plain_root, a / np.sqrt(b)) and np.array_equal(plain_over, a / f32(3))
    )

    def kept(a, b, c, s, count):
        z = _f32.opaque_zero(count)
        return a / root(b, z), over(a, s, z), over(a[:, None] * b[:, None], c, z)

    got_root, got_scalar, got_column = jax.jit(kept)(a, b, c, f32(3), count)
    np.testing.assert_array_equal(got_root, a / np.sqrt(b))
    np.testing.assert_array_equal(got_scalar, a / f32(3))
    np.testing.assert_array_equal(got_column, (a[:, None] * b[:, None]) / c)


# -- bookkeeping, refusals, edges -------------------------------------------------------------
@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: optimizer.AdaGrad(eps="small"), "AdaGrad: eps expected a number, given str"),
        (lambda: optimizer.AdaGrad(momentum=0.9), r"unexpected keyword argument\(s\)"),
        (lambda: optimizer.GroupAdaGrad(eps=None), "GroupAdaGrad: eps expected a number"),
        (lambda: optimizer.RMSProp(gamma1="0.9"), "RMSProp: gamma1 expected a number"),
        (lambda: optimizer.RMSProp(gamma2=[0.9]), "gamma2 expected a number, given list"),
        (lambda: optimizer.RMSProp(clip_weights="1"), "clip_weights expected a number"),
        (lambda: optimizer.RMSProp(epsilon=None), "epsilon expected a number"),
        (lambda: optimizer.AdaDelta(rho=None), "AdaDelta: rho expected a number, given NoneT"),
        (lambda: optimizer.Ftrl(lamda1="1"), "Ftrl: lamda1 expected a number, given str"),
        (lambda: optimizer.Ftrl(learning_rate=None), "Ftrl: learning_rate expected a number"),
        (lambda: optimizer.Ftrl(beta=True), "beta expected a number, given bool"),
    ],
)
def test_arguments_mxnet_would_fail_on_are_refused(make, message):
    with pytest.raises(optimizer.OptimizerArgumentError, match=message):
        make()


def test_row_sparse_refusals_where_mxnet_cannot_run_its_kernel():
    with pytest.raises(optimizer.OptimizerArgumentError, match=r"AdaGrad: row-sparse.*given 0.1"):
        optimizer.AdaGrad(wd=0.1).transformation(row_sparse=True)
    opt = optimizer.AdaGrad(wd=0.1)
    opt.set_wd_mult({0: 0.0})
    assert opt.transformation(row_sparse=True, inputs=opt.inputs(0)) is not None
    with pytest.raises(optimizer.OptimizerArgumentError, match="clip_gradient=-0.2"):
        optimizer.AdaDelta(clip_gradient=-0.2).transformation(row_sparse=True)
    for clip in (None, 0.0, 0.3):
        assert optimizer.AdaDelta(clip_gradient=clip).transformation(row_sparse=True)
    assert optimizer.AdaDelta(clip_gradient=-0.2).transformation() is not None  # dense: runs


def test_groupadagrad_refuses_weight_decay_before_counting_and_other_shapes():
    opt = optimizer.GroupAdaGrad(wd=0.1)
    with pytest.raises(optimizer.OptimizerArgumentError, match="index 1, given 0.1"):
        opt.next_update([1])
    assert opt.num_update == 0 and opt._index_update_count == {}
    opt.set_wd_mult({1: 0.0})
    assert opt.next_update([1]).shape == (1, 6) and opt.num_update == 1
    tx = optimizer.GroupAdaGrad(wd=0.1).transformation()  # an optax loop: the numbers given
    w = _on_cpu(W2)
    with pytest.raises(optimizer.OptimizerArgumentError, match="wd expected 0"):
        tx.update(_on_cpu(G2[0]), tx.init(w), w)
    for bad in (W0, W0.reshape(2, 2, 2)):
        with pytest.raises(optimizer.OptimizerArgumentError, match="expected 2-D weights"):
            optimizer.GroupAdaGrad().transformation().init(_on_cpu(bad))


def test_what_shapes_the_state_freezes_once_compiled():
    opt = optimizer.RMSProp()
    assert opt.slot_names() == ("n",)
    opt.transformation()
    with pytest.raises(optimizer.OptimizerArgumentError, match="cannot change it after"):
        opt.centered = True
    opt.gamma1, opt.clip_weights, opt.lr = 0.5, 0.3, 0.1  # numbers of the computation: free
    assert opt.next_update([0])[0][optimizer.RMSProp.SCALARS.index("clip_weights")] == f32(0.3)
    assert optimizer.RMSProp(centered=1).slot_names() == ("n", "mean", "delta")


@pytest.mark.parametrize(
    ("make", "lazy", "slots"),
    [
        (optimizer.AdaGrad, True, 1),
        (optimizer.RMSProp, False, 1),
        (lambda: optimizer.RMSProp(centered=True), False, 3),
        (optimizer.AdaDelta, False, 2),
        (optimizer.Ftrl, True, 3),
    ],
)
def test_lazy_rows_and_state_as_mxnets_kernels(make, lazy, slots):
    opt = make()
    assert opt.lazy_update is lazy
    _, state = _steps(opt, W0, GRADS[:1])
    assert len(state.slots) == slots
    assert all(s.shape == W0.shape and s.dtype == W0.dtype for s in state.slots)
    assert optimizer.GroupAdaGrad().lazy_update is True


def test_positional_arguments_defaults_and_repr_are_mxnets():
    a = optimizer.AdaGrad(1e-3)
    assert a.float_stable_eps == 1e-3 and a.lr == 0.01
    r = optimizer.RMSProp(0.01, 0.8, 0.7, 1e-6, True, 0.5)
    assert (r.lr, r.gamma1, r.gamma2, r.epsilon, r.centered, r.clip_weights) == (
        0.01,
        0.8,
        0.7,
        1e-6,
        True,
        0.5,
    )
    d = optimizer.AdaDelta(0.8, 1e-4)
    assert (d.rho, d.epsilon) == (0.8, 1e-4)
    f = optimizer.Ftrl(0.05, 0.2, 0.5)
    assert (f.lamda1, f.lr, f.beta) == (0.05, 0.2, 0.5)
    assert optimizer.GroupAdaGrad(1e-4).float_stable_eps == 1e-4
    assert repr(optimizer.AdaGrad()) == "AdaGrad(learning_rate=0.01, eps=1e-07)"
    assert repr(optimizer.RMSProp(centered=True, clip_weights=1.0)) == (
        "RMSProp(learning_rate=0.001, gamma1=0.9, gamma2=0.9, epsilon=1e-08, centered=True, "
        "clip_weights=1.0)"
    )
    assert repr(optimizer.AdaDelta(wd=0.1)) == "AdaDelta(rho=0.9, epsilon=1e-05, wd=0.1)"
    assert repr(optimizer.Ftrl()) == "Ftrl(lamda1=0.01, learning_rate=0.1, beta=1.0)"
    assert repr(optimizer.GroupAdaGrad()) == "GroupAdaGrad(learning_rate=0.01, eps=1e-05)"


@pytest.mark.parametrize(
    "make",
    [
        optimizer.AdaGrad,
        lambda: optimizer.RMSProp(centered=True),
        optimizer.AdaDelta,
        optimizer.Ftrl,
    ],
)
def test_float16_weights_keep_their_dtype(make):
    got, state = _steps(make(), W0.astype(np.float16), [g.astype(np.float16) for g in GRADS])
    assert got.dtype == np.float16 and np.all(np.isfinite(got))
    assert all(s.dtype == jnp.float16 for s in state.slots)
    assert not np.array_equal(got, W0.astype(np.float16))
