"""jaxkv/_src/mxnet/optimizers/sgd.py: MXNet 1.9.1's SGD (dense and row-sparse kernels) and 'test'
optimizer against NumPy float32 models of the documented formulas."""

import numpy as np
import pytest

from jaxkv.mx import optimizer

from ._optimizer_models import GRADS, ONE, W0, _on_cpu, _run, _sgd_model, f32


def test_sgd_keeps_momentum_state_only_for_a_positive_momentum():
    assert _run(optimizer.SGD(momentum=0.0), grads=GRADS[:1])[1].slots == ()
    (tiny,) = _run(optimizer.SGD(momentum=1e-30), grads=GRADS[:1])[1].slots
    assert tiny.shape == W0.shape
    with pytest.raises(optimizer.OptimizerArgumentError, match="momentum expected >= 0.*-0.1"):
        optimizer.SGD(momentum=-0.1)


@pytest.mark.parametrize(("clip", "used"), [(None, None), (0, None), (-1.0, None), (0.5, 0.5)])
def test_the_gradient_is_clipped_only_by_a_positive_clip_gradient(clip, used):
    opt = optimizer.SGD(learning_rate=0.5, clip_gradient=clip)
    assert opt.inputs(None)[3] == (-1.0 if used is None else used)  # the kernel's clip
    got, _ = _run(opt, grads=GRADS[:1])
    np.testing.assert_array_equal(got, _sgd_model(W0, GRADS[:1], 0.5, clip=used))


SGD_CASES = {
    "plain": {"lr": 0.1},
    "decay": {"lr": 0.1, "wd": 0.3},
    "momentum": {"lr": 0.1, "wd": 0.01, "momentum": 0.9},
    "clipped": {"lr": 0.2, "rescale": 0.5, "clip": 0.4, "momentum": 0.5},
}


@pytest.mark.parametrize("case", list(SGD_CASES))
def test_sgd_on_a_dense_gradient_follows_mxnets_formula(case):
    a = SGD_CASES[case]
    opt = optimizer.SGD(
        learning_rate=a["lr"],
        wd=a.get("wd", 0.0),
        rescale_grad=a.get("rescale", 1.0),
        momentum=a.get("momentum", 0.0),
        clip_gradient=a.get("clip"),
    )
    got, state = _run(opt)
    np.testing.assert_array_equal(got, _sgd_model(W0, GRADS, **a))
    assert int(state.count) == len(GRADS)


@pytest.mark.parametrize("wd", [0.0, 0.3])
def test_sgd_on_row_sparse_rows_updates_as_its_row_sparse_kernel(wd):
    lr = 0.1
    tx = optimizer.SGD(learning_rate=lr, wd=wd).transformation(row_sparse=True)
    w, g = _on_cpu(W0), GRADS[0]
    updates, _ = tx.update(_on_cpu(g), tx.init(w), w)
    step = (f32(lr) * ONE) * g
    # sgd_update's (1 - lr*wd) * w - step, as an update; without decay, exactly -step.
    want = -step if wd == 0 else ((ONE - f32(lr) * f32(wd)) * W0 - step) - W0
    np.testing.assert_array_equal(np.asarray(updates), want)


def test_the_test_optimizer_adds_the_rescaled_gradient_and_nothing_else():
    opt = optimizer.Test(rescale_grad=0.5, learning_rate=9.0, wd=0.5, clip_gradient=0.1)
    got, state = _run(opt)
    np.testing.assert_array_equal(got, (W0 + GRADS[0] * f32(0.5)) + GRADS[1] * f32(0.5))
    assert int(state.count) == 2
