"""jaxkv/_src/mxnet/optimizers/adam.py: MXNet 1.9.1's Adam (dense and row-sparse kernels) against a
NumPy float32 model of the documented formula, and its refusals."""

import numpy as np
import pytest

from jaxkv.mx import optimizer

from ._optimizer_models import GRADS, W0, _adam_model, _run


@pytest.mark.parametrize(("beta", "ok"), [(0.0, True), (float(np.nextafter(1.0, 0.0)), True),
                                          (1.0, False), (-1e-12, False)])  # fmt: skip
@pytest.mark.parametrize("name", ["beta1", "beta2"])
def test_adams_betas_lie_in_zero_to_one_open_above(name, beta, ok):
    if ok:
        assert getattr(optimizer.Adam(**{name: beta}), name) == beta
        return
    with pytest.raises(optimizer.OptimizerArgumentError, match=rf"{name} expected in \[0, 1\)"):
        optimizer.Adam(**{name: beta})


ADAM_CASES = {
    "defaults": {},
    "from_begin": {"begin": 5, "lr": 0.01},  # t counts from begin_num_update + 1
    "decay": {"wd": 0.1, "lr": 0.05},
    "decay_and_clip": {"wd": 0.1, "clip": 3.0, "rescale": 2.0, "lr": 0.05},  # clips some
    "zero_betas": {"b1": 0.0, "b2": 0.0, "lr": 0.1},
}


@pytest.mark.parametrize("case", list(ADAM_CASES))
def test_adam_on_a_dense_gradient_follows_mxnets_formula(case):
    a = {"lr": 0.001, "b1": 0.9, "b2": 0.999, "eps": 1e-8, **ADAM_CASES[case]}
    opt = optimizer.Adam(
        learning_rate=a["lr"],
        beta1=a["b1"],
        beta2=a["b2"],
        epsilon=a["eps"],
        wd=a.get("wd", 0.0),
        rescale_grad=a.get("rescale", 1.0),
        clip_gradient=a.get("clip"),
        begin_num_update=a.get("begin", 0),
    )
    got, state = _run(opt)
    want, m, v = _adam_model(W0, GRADS, **a)
    np.testing.assert_array_equal(np.asarray(state.slots[0]), m)
    np.testing.assert_array_equal(np.asarray(state.slots[1]), v)
    np.testing.assert_array_equal(got, want)
    assert int(state.count) == a.get("begin", 0) + len(GRADS)


@pytest.mark.parametrize(
    ("row_sparse", "lazy", "clip", "square_first"),
    [
        (False, True, None, False),
        (False, False, 1.5, False),  # a dense gradient never squares first
        (True, True, None, False),
        (True, True, 1.5, True),  # the lazy row-sparse kernel, when clipping
        (True, False, None, True),  # the standard row-sparse kernel
    ],
)
def test_adam_squares_the_gradient_first_only_in_mxnets_row_sparse_kernels(
    row_sparse, lazy, clip, square_first
):
    opt = optimizer.Adam(learning_rate=0.01, lazy_update=lazy, clip_gradient=clip)
    _, state = _run(opt, GRADS[:1], row_sparse=row_sparse)
    _, _, v = _adam_model(W0, GRADS[:1], 0.01, 0.9, 0.999, 1e-8, clip=clip, sq=square_first)
    _, _, other = _adam_model(W0, GRADS[:1], 0.01, 0.9, 0.999, 1e-8, clip=clip, sq=not square_first)
    assert (v != other).any()  # these gradients tell the two orders apart
    np.testing.assert_array_equal(np.asarray(state.slots[1]), v)
