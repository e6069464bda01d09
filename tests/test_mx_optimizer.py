"""``jaxkv.mx.optimizer``: MXNet 1.9.1's SGD and Adam as optax transformations, MXNet's numbers.

The expected numbers were recorded from Apache MXNet 1.9.1 by conformance/record_optimizers.py
(conformance/data/mxnet_optimizers.json): dense trajectories through ``get_updater`` (and a
``local`` store, which gave the same bits), and row-sparse pushes from two devices into a
store, with ``lazy_update`` True and False, over a weight stored dense or row-sparse. Every
weight and every state array (SGD's momentum, Adam's mean and var) must be the recorded float32
bits: the transformations run MXNet's float32 operations in MXNet's order.

The lazy row-sparse path is checked with a reference application written here, the way a store
runs it: the touched rows of the weight and of the per-parameter state leaves (found with
``optax.tree_utils.tree_map_params``) go through ``transformation(row_sparse=True)``, and
are scattered back; the scalar leaves (Adam's count) come from the update.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.tree_utils import tree_map_params

import jaxkv
import jaxkv.mx as mx
from jaxkv._src.mxnet.optimizers import float32 as _f32
from jaxkv.mx import optimizer

DATA = json.loads(
    (Path(__file__).parent.parent / "conformance" / "data" / "mxnet_optimizers.json").read_text()
)
DENSE = {case["name"]: case for case in DATA["dense"]}
SPARSE = {case["name"]: case for case in DATA["row_sparse"]}


def f32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


def assert_bits(got, want, what: str) -> None:
    """Equal float32 values (0.0 == -0.0), with the largest difference in ulps if not."""
    got, want = np.asarray(got, np.float32), f32(want)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    if not np.array_equal(got, want):
        ulps = np.abs(got.view(np.int32).astype(np.int64) - want.view(np.int32).astype(np.int64))
        bad = int(np.sum(got != want))
        raise AssertionError(f"{what}: {bad} of {got.size} differ, by up to {ulps.max()} ulps")


def assert_bits_where_representable(got, want, before, what: str) -> None:
    """MXNet's row-sparse SGD without momentum computes ``(1 - lr*wd)*w - lr*g`` as a new weight,
    not as a step added to ``w``; the update ``new - w`` is exact (Sterbenz) when ``new`` and
    ``w`` have one sign and are within a factor 2 of each other. Elsewhere ``w + (new - w)`` may
    round one ulp away: equal bits required everywhere else, at most one ulp there."""
    got, want, before = (np.asarray(x, np.float32) for x in (got, want, before))
    close = (np.sign(want) == np.sign(before)) & (np.abs(want) <= 2 * np.abs(before))
    close &= np.abs(before) <= 2 * np.abs(want)
    assert_bits(got[close], want[close], what)
    ulps = np.abs(got.view(np.int32).astype(np.int64) - want.view(np.int32).astype(np.int64))
    assert ulps[~close].max(initial=0) <= 1, what


def state_arrays(tx: optax.GradientTransformation, state) -> list[jax.Array]:
    """The per-parameter leaves of a state in MXNet's order (momentum; mean, var)."""
    marked = tree_map_params(tx, lambda x: ("param", x), state, transform_non_params=lambda _: None)
    is_mark = lambda x: isinstance(x, tuple) and len(x) == 2 and x[0] == "param"  # noqa: E731
    return [m[1] for m in jax.tree.leaves(marked, is_leaf=is_mark) if m is not None]


def make_step(tx: optax.GradientTransformation):
    def step(w, g, state):
        updates, state = tx.update(g, state, w)
        return optax.apply_updates(w, updates), state

    return step


# -- dense: every recorded trajectory, bit for bit ------------------------------------------
@pytest.mark.parametrize("name", sorted(DENSE))
def test_dense_trajectories_match_mxnet(name, call):
    case = DENSE[name]
    assert case["kvstore_agrees"]  # MXNet's store and updater gave the same bits
    opt = optimizer.create(case["optimizer"], **case["kwargs"])
    tx = opt.transformation()
    step_fn = make_step(tx)  # one function: under jit, one compilation per weight shape
    for index, rec in case["weights"].items():
        w = jnp.asarray(f32(rec["init"]))
        state = tx.init(w)
        for step, (g, want, want_states) in enumerate(
            zip(rec["grads"], rec["trajectory"], rec["states"], strict=True)
        ):
            w, state = call(step_fn, w, jnp.asarray(f32(g)), state)
            assert_bits(w, want, f"{name} weight {index} step {step}")
            got_states = state_arrays(tx, state)
            assert len(got_states) == len(want_states)
            for k, (s, ws) in enumerate(zip(got_states, want_states, strict=True)):
                assert_bits(s, ws, f"{name} weight {index} step {step} state {k}")


def test_dense_cases_cover_the_arguments():
    """The recording exercises every argument the formulas use, for both optimizers."""
    used = {(c["optimizer"], k) for c in DATA["dense"] for k in c["kwargs"]}
    for arg in ("learning_rate", "wd", "rescale_grad", "clip_gradient"):
        assert ("sgd", arg) in used and ("adam", arg) in used
    assert {("sgd", "momentum"), ("adam", "beta1"), ("adam", "beta2"), ("adam", "epsilon")} <= used
    assert ("adam", "begin_num_update") in used
    assert {c["optimizer"] for c in DATA["dense"] if not c["kwargs"]} == {"sgd", "adam"}


# -- row-sparse: lazy (touched rows only) and standard (every row) ---------------------------
def lazy_push(tx, w, state, rows, data):
    """A row-sparse push as a store runs it lazily: gather, update the rows, scatter back."""
    uniq, inverse = np.unique(np.asarray(rows), return_inverse=True)
    summed = jax.ops.segment_sum(jnp.asarray(data), jnp.asarray(inverse), len(uniq))
    idx = jnp.asarray(uniq)
    rows_state = tree_map_params(tx, lambda x: x[idx], state)
    updates, new_rows_state = tx.update(summed, rows_state, w[idx])
    w = w.at[idx].set(optax.apply_updates(w[idx], updates))
    is_param = tree_map_params(tx, lambda _: True, state, transform_non_params=lambda _: False)
    state = jax.tree.map(
        lambda p, full, part: full.at[idx].set(part) if p else part,
        is_param,
        state,
        new_rows_state,
    )
    return w, state, summed, uniq


def std_push(tx, w, state, rows, data):
    """A row-sparse push with lazy_update=False: the densified gradient, every row."""
    g = jnp.zeros_like(w).at[jnp.asarray(rows)].add(jnp.asarray(data))
    updates, state = tx.update(g, state, w)
    return optax.apply_updates(w, updates), state


# A "_dense" case is its "_rsp" twin stored dense in MXNet: the same pushes, numbers and
# trajectory (test_row_sparse_recording_shows_lazy_and_std_semantics), so the same computation
# here. make test replays the "_rsp" ones; make test-deep and make conformance replay both.
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.deep) if n.endswith("_dense") else n
        for n in sorted(SPARSE)
    ],
)
def test_row_sparse_pushes_match_mxnet(name):
    case = SPARSE[name]
    assert case["accepted"] and case["updater_agrees"]
    opt = optimizer.create(case["optimizer"], **case["kwargs"])
    lazy = opt.lazy_update
    assert lazy is case["kwargs"]["lazy_update"]
    tx = opt.transformation(row_sparse=True)
    w = jnp.asarray(f32(case["init"]))
    state = tx.init(w)
    lazy_step = jax.jit(lambda w, s, r, d: lazy_push(tx, w, s, r, d), static_argnums=2)
    std_step = jax.jit(lambda w, s, r, d: std_push(tx, w, s, r, d), static_argnums=2)
    new_weight_kernel = isinstance(opt, optimizer.SGD) and not opt.momentum and opt.wd
    for n, (push, merged, want, want_states) in enumerate(
        zip(case["pushes"], case["merged"], case["trajectory"], case["states"], strict=True)
    ):
        rows = tuple(r for part in push for r in part["rows"])  # both devices: duplicates
        data = f32([row for part in push for row in part["data"]])
        before = w
        if lazy:
            w, state, summed, uniq = lazy_step(w, state, rows, data)
            assert list(uniq) == merged["rows"]  # the store's sum: sorted distinct rows
            assert_bits(summed, merged["data"], f"{name} push {n} summed gradient")
        else:
            w, state = std_step(w, state, rows, data)
        if new_weight_kernel:
            assert_bits_where_representable(w, want, before, f"{name} push {n} weight")
        else:
            assert_bits(w, want, f"{name} push {n} weight")
        got_states = state_arrays(tx, state)
        assert len(got_states) == len(want_states)
        for k, (s, ws) in enumerate(zip(got_states, want_states, strict=True)):
            assert_bits(s, ws, f"{name} push {n} state {k}")


def test_row_sparse_recording_shows_lazy_and_std_semantics():
    """What MXNet did, as recorded: lazily, rows outside the gradient keep their weight (with
    weight decay too); in the standard update they move; a dense stored weight takes
    row-sparse pushes with the same numbers as a row-sparse one."""
    obs = DATA["observations"]
    assert {n for n in obs if "_lazy_" in n} == {n for n in SPARSE if "_lazy_" in n}
    for n, o in obs.items():
        assert o["rows_never_touched"] == [5]
        if "_lazy_" in n:
            assert o["untouched_rows_kept"], n
        else:
            assert o["untouched_rows_changed"], n  # every std case has wd or momentum or Adam
    for n, case in SPARSE.items():
        if n.endswith("_dense"):
            assert case["trajectory"] == SPARSE[n[: -len("dense")] + "rsp"]["trajectory"], n


def test_lazy_differs_from_dense_transformation_where_mxnet_does():
    """row_sparse=True is not a no-op: plain SGD with weight decay rounds as MXNet's
    row-sparse kernel ((1 - lr*wd)*w - lr*g), not as its dense one; the recording has both."""
    opt = optimizer.SGD(learning_rate=0.1, wd=0.05)
    case = SPARSE["sgd_wd_std_rsp"]
    w = jnp.asarray(f32(case["init"]))
    rows = [r for part in case["pushes"][0] for r in part["rows"]]
    data = f32([row for part in case["pushes"][0] for row in part["data"]])
    dense_tx, sparse_tx = opt.transformation(), opt.transformation(row_sparse=True)
    got_sparse, _ = std_push(sparse_tx, w, sparse_tx.init(w), rows, data)
    got_dense, _ = std_push(dense_tx, w, dense_tx.init(w), rows, data)
    assert_bits(got_sparse, case["trajectory"][0], "row-sparse kernel")
    assert not np.array_equal(np.asarray(got_dense), f32(case["trajectory"][0]))
    np.testing.assert_allclose(got_dense, f32(case["trajectory"][0]), rtol=1e-6, atol=1e-7)


def test_mxnet_needs_sorted_distinct_row_ids():
    """For information: MXNet's row-sparse pushes lose rows unless ids are sorted and distinct
    (jaxkv's store sums any ids); the recorded cases above use sorted ids per device."""
    probe = DATA["row_id_probe"]
    assert probe["two_devices_sorted"]["matches_row_sum"] == {"lazy": True, "std": True}
    assert probe["two_devices_unsorted"]["matches_row_sum"] == {"lazy": False, "std": False}
    assert probe["one_device_duplicate"]["matches_row_sum"]["lazy"] is False


# -- Adam's bias-corrected learning rate -----------------------------------------------------
@pytest.mark.parametrize(
    "lr, beta1, beta2",
    [
        (0.001, 0.9, 0.999),
        (0.01, 0.8, 0.99),
        (0.1, 0.9, 0.9999),
        (3e-4, 0.5, 0.999),
        (1.0, 0, 0),
        (2e-3, 0.95, 0.99999),
    ],
)
def test_bias_corrected_lr_is_mxnets_float32(lr, beta1, beta2):
    """MXNet computes lr * sqrt(1 - beta2**t) / (1 - beta1**t) in float64 and rounds it to
    float32; jaxkv's double-float32 gives the same float32 (optax's float32 formula is up to
    hundreds of ulps off)."""
    ts = np.concatenate([np.arange(1, 20001), [10**5, 10**6, 10**7, 2**31 - 1]]).astype(np.int32)
    zero = jnp.zeros((), jnp.int32)
    got = jax.jit(jax.vmap(lambda t, z: _f32.bias_corrected_lr(lr, beta1, beta2, t, z),
                           in_axes=(0, None)))(ts, zero)  # fmt: skip
    want = f32([lr * math.sqrt(1 - beta2 ** int(t)) / (1 - beta1 ** int(t)) for t in ts])
    assert_bits(got, want, "lr_t")


# -- constructors, attributes, refusals ------------------------------------------------------
ATTRIBUTES = [
    "lr",
    "learning_rate",
    "wd",
    "rescale_grad",
    "clip_gradient",
    "lr_scheduler",
    "begin_num_update",
    "multi_precision",
    "momentum",
    "lazy_update",
    "beta1",
    "beta2",
    "epsilon",
]


@pytest.mark.parametrize("name, cls", [("sgd", optimizer.SGD), ("adam", optimizer.Adam)])
def test_defaults_are_mxnets(name, cls):
    mxnet = DATA["defaults"][name]
    opt = cls()
    for attr in ATTRIBUTES:
        if attr in mxnet:
            assert getattr(opt, attr) == mxnet[attr], attr
            assert type(getattr(opt, attr)) is type(mxnet[attr]), attr
        else:
            assert not hasattr(opt, attr), attr
    assert (opt.lr, opt.learning_rate) == ((0.01, 0.01) if name == "sgd" else (0.001, 0.001))


def test_attributes_and_positional_arguments_as_mxnet():
    sgd = optimizer.SGD(0.9, False, learning_rate=0.2, wd=1e-4, clip_gradient=5)
    assert (sgd.momentum, sgd.lazy_update, sgd.lr, sgd.learning_rate) == (0.9, False, 0.2, 0.2)
    assert (sgd.wd, sgd.clip_gradient, sgd.rescale_grad) == (1e-4, 5.0, 1.0)
    adam = optimizer.Adam(0.1, 0.8, 0.99, 1e-6, False, rescale_grad=0.5, begin_num_update=4)
    assert (adam.lr, adam.beta1, adam.beta2, adam.epsilon) == (0.1, 0.8, 0.99, 1e-6)
    assert (adam.lazy_update, adam.rescale_grad, adam.begin_num_update) == (False, 0.5, 4)
    assert isinstance(sgd, optimizer.Optimizer) and isinstance(adam, optimizer.Optimizer)
    assert repr(adam).startswith("Adam(learning_rate=0.1, beta1=0.8")
    sgd.set_learning_rate(0.3)
    assert sgd.learning_rate == 0.3
    assert mx.optimizer is optimizer


def test_create_is_case_insensitive():
    assert type(optimizer.create("sgd")) is optimizer.SGD
    assert type(optimizer.create("SGD", momentum=0.5)) is optimizer.SGD
    assert type(optimizer.create("aDaM", learning_rate=0.1)) is optimizer.Adam
    assert isinstance(optimizer.create("ccSGD"), optimizer.SGD)
    assert optimizer.create("Adam", beta1=0.5).beta1 == 0.5


def test_create_refuses_other_names():
    with pytest.raises(jaxkv.KVStoreError) as info:
        optimizer.create("bogus_optimizer")
    assert isinstance(info.value, ValueError)  # MXNet raises ValueError: Cannot find optimizer
    message = str(info.value)
    assert "'bogus_optimizer'" in message and "'adam'" in message and "'rmsprop'" in message


def test_the_one_mxnet_name_not_here_is_refused_clearly():
    """``NDabs`` (MXNet's re-export of ``nd.abs`` in ``mx.optimizer``) is the one name of
    MXNet's ``mx.optimizer.__all__`` that jaxkv.mx.optimizer lacks."""
    with pytest.raises(jaxkv.KVStoreError) as info:
        mx.optimizer.NDabs  # noqa: B018
    assert isinstance(info.value, AttributeError)
    assert "NDabs" in str(info.value) and "'adam'" in str(info.value)
    with pytest.raises(AttributeError) as plain:
        mx.optimizer.no_such_name  # noqa: B018
    assert not isinstance(plain.value, jaxkv.KVStoreError)


def test_every_name_of_mxnets_registry_creates_its_optimizer():
    for name in DATA["registry"]:
        opt = optimizer.create(name)
        assert isinstance(opt, optimizer.Optimizer) and type(opt).__name__.lower() == name
        assert type(optimizer.create(name.upper())) is type(opt)


@pytest.mark.parametrize(
    "cls, kwargs, named",
    [
        (optimizer.SGD, {"momentm": 0.9}, "momentm"),
        (optimizer.Adam, {"beta3": 0.9}, "beta3"),
        (optimizer.SGD, {"lr_scheduler": object()}, "lr_scheduler"),
        (optimizer.Adam, {"sym": object()}, "sym"),
        (optimizer.SGD, {"param_idx2name": [(0, "fc_bias")]}, "param_idx2name"),
        (optimizer.SGD, {"begin_num_update": -1}, "begin_num_update"),
        (optimizer.SGD, {"momentum": -0.5}, "momentum"),
        (optimizer.SGD, {"learning_rate": "0.1"}, "learning_rate"),
        (optimizer.Adam, {"beta1": 1.0}, "beta1"),
        (optimizer.Adam, {"beta2": 1.5}, "beta2"),
    ],
)
def test_unsupported_arguments_refused(cls, kwargs, named):
    with pytest.raises(jaxkv.KVStoreError, match=named):
        cls(**kwargs)


def test_harmless_defaults_accepted():
    opt = optimizer.SGD(
        param_idx2name={}, param_dict={}, lr_scheduler=None, sym=None, multi_precision=False
    )
    assert opt.lr == 0.01 and opt.multi_precision is False and opt.lr_scheduler is None


def test_only_what_shapes_the_computation_freezes_once_compiled():
    """The learning rate, weight decay, rescale_grad and clip_gradient are numbers the store
    passes at every push (they may change); momentum decides the state and freezes."""
    opt = optimizer.SGD(learning_rate=0.5, momentum=0.9)
    opt.lr = 0.25  # before: as MXNet
    opt.set_learning_rate(0.125)
    tx = opt.transformation()
    assert opt.transformation() is tx  # one object: a store's compiled step is reused
    w = jnp.ones(2)
    updates, _ = tx.update(jnp.ones(2), tx.init(w), w)
    np.testing.assert_array_equal(updates, [-0.125, -0.125])
    opt.lr, opt.wd, opt.clip_gradient = 0.1, 0.01, 1.0  # accepted: read at the next push
    opt.set_learning_rate(0.2)
    assert opt.lr == 0.2 and opt.learning_rate == 0.2
    for name in ("momentum", "lazy_update"):
        with pytest.raises(jaxkv.KVStoreError, match=f"SGD.{name}.*kv.set_optimizer"):
            setattr(opt, name, 0.5)
    assert opt.momentum == 0.9 and opt.lazy_update is True


def test_multi_precision_keeps_a_float32_copy_of_float16_weights_only():
    """MXNet keeps a float32 master copy of float16 weights under multi_precision=True, runs the
    update on it and casts; float32 weights ignore the flag, as MXNet's. (Against MXNet's own
    numbers: tests/test_mx_lr_training.py's float16 scenarios.)"""
    opt = optimizer.SGD(multi_precision=True, learning_rate=0.5)
    tx = opt.transformation()
    w = jnp.ones(2)
    updates, state = tx.update(jnp.ones(2), tx.init(w), w)
    np.testing.assert_array_equal(updates, [-0.5, -0.5])
    assert state.slots == ()
    w16 = jnp.asarray([1.0, 2048.0], jnp.float16)  # float16's spacing is 2 here
    state = tx.init(w16)
    (copy,) = state.slots
    assert copy.dtype == jnp.float32
    g = jnp.asarray([0.0, -1.0], jnp.float16)
    for _ in range(2):  # each step adds 0.5 to the copy, too little for float16 to show
        updates, state = tx.update(g, state, w16)
        w16 = jaxkv._src.core.updater.apply_updates(w16, updates)
        assert w16.dtype == jnp.float16
    np.testing.assert_array_equal(state.slots[0], np.float32([1.0, 2049.0]))
    np.testing.assert_array_equal(w16, np.float16([1.0, 2048.0]))  # 2049 rounds to even
    with pytest.raises(jaxkv.KVStoreError, match="mixing float16 and other weights"):
        tx.init({"a": jnp.ones(2, jnp.float16), "b": jnp.ones(2)})


# -- the transformation's contract -----------------------------------------------------------
CONFIGS = [
    optimizer.SGD,
    lambda: optimizer.SGD(momentum=0.9, wd=0.1),
    optimizer.Adam,
    lambda: optimizer.Adam(wd=0.1, clip_gradient=1.0, begin_num_update=7),
]


@pytest.mark.parametrize("make", CONFIGS)
@pytest.mark.parametrize("row_sparse", [False, True])
def test_tree_map_params_finds_exactly_the_per_parameter_leaves(make, row_sparse):
    tx = make().transformation(row_sparse=row_sparse)
    params = {"w": jnp.ones((6, 3)), "b": jnp.ones(5, jnp.float32)}
    state = tx.init(params)
    _, state = tx.update(params, state, params)
    cut = tree_map_params(tx, lambda x: x[:2], state)
    flagged = tree_map_params(tx, lambda _: 1, state, transform_non_params=lambda _: 0)
    leaves, cut_leaves = jax.tree.leaves(state), jax.tree.leaves(cut)
    per_param = [x for x, f in zip(leaves, jax.tree.leaves(flagged), strict=True) if f]
    others = [x for x, f in zip(leaves, jax.tree.leaves(flagged), strict=True) if not f]
    # per-parameter leaves: the parameters' shapes and dtypes, and cut to 2 rows
    n_moments = 2 if isinstance(make(), optimizer.Adam) else (1 if make().momentum else 0)
    assert len(per_param) == 2 * n_moments
    assert sorted(x.shape for x in per_param) == sorted([(5,), (6, 3)] * n_moments)
    assert all(x.dtype == jnp.float32 for x in per_param)
    for x, c, f in zip(leaves, cut_leaves, jax.tree.leaves(flagged), strict=True):
        assert c.shape == ((2, *x.shape[1:]) if f else x.shape)
    # every other leaf is a scalar: the update count, int32
    assert [(x.shape, x.dtype) for x in others] == [((), jnp.int32)]
    assert int(state.count) == make().begin_num_update + 1


@pytest.mark.parametrize("make", CONFIGS)
def test_update_compiles_once(make):
    tx = make().transformation()
    traces = []

    @jax.jit
    def step(w, g, state):
        traces.append(1)  # runs only while tracing
        return make_step(tx)(w, g, state)

    w = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
    state = tx.init(w)
    for i in range(3):
        w, state = step(w, jnp.full((4, 3), 0.1 * (i + 1)), state)
    assert len(traces) == 1
    assert int(state.count) == make().begin_num_update + 3


def test_update_needs_params_and_float_weights():
    tx = optimizer.Adam().transformation()
    w = jnp.ones(3)
    with pytest.raises(jaxkv.KVStoreError, match="params"):
        tx.update(w, tx.init(w), None)
    with pytest.raises(jaxkv.KVStoreError, match="floating"):
        optimizer.SGD(momentum=0.9).transformation().init(jnp.ones(3, jnp.int32))


def test_float16_weights_keep_their_dtype():
    """MXNet computes in the weight's type; so do these (only float32 is checked bit for bit)."""
    for make in CONFIGS:
        tx = make().transformation()
        w = jnp.ones(4, jnp.float16)
        updates, state = tx.update(jnp.ones(4, jnp.float16), tx.init(w), w)
        assert updates.dtype == jnp.float16
        assert all(x.dtype == jnp.float16 for x in state_arrays(tx, state))


# -- 'test': the optimizer MXNet's own KVStore tests set -------------------------------------
def test_the_test_optimizer_adds_the_rescaled_gradient(call):
    """MXNet's ``Test.update``: ``weight[:] += grad * rescale_grad`` (two float32 roundings:
    the product, then the sum), whatever the learning rate, weight decay or clipping."""
    rng = np.random.default_rng(5)
    opt = optimizer.create("test", rescale_grad=0.37, learning_rate=9.0, wd=0.5, clip_gradient=0.1)
    tx = opt.transformation()
    step_fn = make_step(tx)
    w = f32(rng.uniform(-1, 1, (3, 5)))
    want = w.copy()
    state = tx.init(jnp.asarray(w))
    got = jnp.asarray(w)
    for _ in range(4):
        g = f32(rng.uniform(-2, 2, (3, 5)))
        want = f32(want + f32(g * np.float32(0.37)))
        got, state = call(step_fn, got, jnp.asarray(g), state)
        assert_bits(got, want, "test optimizer")
    assert int(state.count) == 4


def test_the_test_optimizer_in_a_store_as_mxnets_nightly_tests_use_it():
    """MXNet's nightly dist_device_sync test, one process: keys pushed one at a time from each
    device under ``create('test', rescale_grad=2)`` pull ``1 + 2 * devices * (i + 1)``."""
    kv = mx.kv.create("local")
    kv.set_optimizer(optimizer.create("test", rescale_grad=2))
    for k in ("9", "99"):
        kv.init(k, mx.nd.ones((2, 3)))
    devices = [mx.cpu(d) for d in range(2)]
    for i in range(3):
        for k in ("9", "99"):
            kv.push(k, [mx.nd.ones((2, 3), ctx) for ctx in devices])
            out = mx.nd.zeros((2, 3))
            kv.pull(k, out=out)
            np.testing.assert_array_equal(out.asnumpy(), np.full((2, 3), 1 + 2 * 2 * (i + 1)))
