"""``jaxkv.mx.optimizer``'s NAG, Signum, SGLD, DCASGD, LARS and LBSGD through a store, against
MXNet 1.9.1's recorded numbers (``conformance/record_opt_momentum.py``,
``conformance/data/mxnet_opt_momentum.json``).

Each recorded configuration trains two keys for 5 steps through ``mx.kv.create('device')``,
pushed one key at a time or as a list (as recorded), the values on 2 devices (MXNet's two
parts) or on 8 (8 parts that add up, in any order, to exactly MXNet's sum of the two). Every
pulled weight and ``num_update`` must be MXNet's, bit for bit, except where the optimizer's
docstring says otherwise, for the reason it gives:

- NAG with momentum, Signum with ``wd_lh``, signSGD, NAG and LBSGD without momentum and with
  weight decay write a new weight that is not ``weight + step``; the update reaches it exactly
  wherever a float32 update can, and elsewhere (a weight crossing zero) is one ulp away: at
  most one ulp, in a few elements;
- LBSGD with ``warmup_strategy='lars'`` adds its squares in another order than NumPy:
  within 1e-6 relative (its momentum, a difference of larger terms: within 1e-6 of its largest
  element).

SGLD's recorded numbers are its deterministic part (MXNet's noise replaced by zeros when
recording; here a subclass whose noise is zeros); its noise is checked for MXNet's
distribution. The states (momentum, DCASGD's previous weight) are checked through the
transformation, eagerly and under ``jit``.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _variants import rotating

import jaxkv
import jaxkv.mx as mx
from jaxkv.mx import optimizer

DATA = json.loads(
    (Path(__file__).parent.parent / "conformance/data/mxnet_opt_momentum.json").read_text()
)
DENSE = {c["name"]: c for c in DATA["dense"]}
SPARSE = {c["name"]: c for c in DATA["row_sparse"]}
SHAPES = {int(k): tuple(v) for k, v in DATA["shapes"].items()}

# Configurations whose new weight is not weight + step: at most one ulp where unreachable.
REACHED = {"nag_wd", "nag_momentum", "nag_full", "signum_full", "signsgd_wd", "lbsgd_wd"}
REACHED_SPARSE = {"nag_rsp", "nag_momentum_rsp", "signsgd_rsp", "lbsgd_rsp"}
SUMS = {"lbsgd_lars"}  # squares summed in another order: 1e-6 relative


class ZeroNoiseSGLD(optimizer.SGLD):
    """SGLD's deterministic part: its noise replaced by zeros, as in the recording."""

    def _noise(self, key, shape, dtype, scale):
        return jnp.zeros(shape, dtype)


def f32(x) -> np.ndarray:
    return np.asarray(x, np.float32)


def ulps(got, want) -> np.ndarray:
    got, want = f32(got), f32(want)
    return np.abs(got.view(np.int32).astype(np.int64) - want.view(np.int32).astype(np.int64))


def check(got, want, name: str, what: str, reached: set, sums: set = frozenset()) -> int:
    """Equal bits, or the tolerance ``name``'s documented reason allows; the number of
    elements that are not equal."""
    got, want = f32(got), f32(want)
    assert got.shape == want.shape, what
    if name in sums:
        # 1e-6 relative, or 1e-6 of the array's largest element where a value is a small
        # difference of larger terms (the momentum)
        atol = 1e-6 * float(np.abs(want).max(initial=0))
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=atol, err_msg=what)
    elif name in reached:
        assert ulps(got, want).max(initial=0) <= 1, f"{what}: {ulps(got, want).max()} ulps"
    else:
        assert np.array_equal(got, want), f"{what}: {int((got != want).sum())} differ"
    return int((got != want).sum())


def _key(k: str):
    return int(k) if k.isdigit() else k


def build(case: dict) -> optimizer.Optimizer:
    kwargs = dict(case["kwargs"])
    if "param_idx2name" in case:
        kwargs["param_idx2name"] = {_key(k): v for k, v in case["param_idx2name"].items()}
    if "schedule" in case:
        sched = case["schedule"]
        kwargs["lr_scheduler"] = getattr(mx.lr_scheduler, sched["class"])(**sched["kwargs"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a schedule's base_lr replaced, as MXNet warns
        if case["optimizer"] == "sgld":
            opt = ZeroNoiseSGLD(**kwargs)
        else:
            opt = optimizer.create(case["optimizer"], **kwargs)
    if "lr_mult" in case:
        opt.set_lr_mult({_key(k): v for k, v in case["lr_mult"].items()})
    if "wd_mult" in case:
        opt.set_wd_mult({_key(k): v for k, v in case["wd_mult"].items()})
    return opt


def eight_parts(total: np.ndarray) -> list[np.ndarray]:
    """8 float32 arrays of one sign per element that add up to exactly ``total`` in any order:
    7 multiples of 8 ulps of ``total`` (toward zero), the rest the 8th; every partial sum is a
    multiple of an ulp of ``total`` no larger than it, so exact."""
    total = f32(total)
    grid = np.spacing(np.abs(total)).astype(np.float32) * np.float32(8)
    part = (np.trunc(total / np.float32(8) / grid) * grid).astype(np.float32)
    parts = [part] * 7
    last = total - part * np.float32(7)
    assert np.array_equal(sum(parts[1:], parts[0]) + last, total)
    return [*parts, last.astype(np.float32)]


def test_eight_parts_add_up_to_the_total_in_any_order():
    rng = np.random.default_rng(0)
    total = f32(rng.uniform(-2, 2, 1000)) * f32(rng.choice([1e-30, 1e-3, 1, 1e30], 1000))
    parts = eight_parts(total)
    for order in (range(8), reversed(range(8)), [3, 7, 0, 5, 1, 6, 2, 4]):
        acc = np.zeros_like(total)
        for i in order:
            acc = acc + parts[i]
        assert np.array_equal(acc, total)
    assert all(np.count_nonzero(p) > 900 for p in parts)


# -- dense: every recorded configuration, through the store ---------------------------------
def replay(case: dict, n_devices: int, opt=None) -> list[dict]:
    opt = opt if opt is not None else build(case)
    kv = mx.kv.create("device")
    kv.set_optimizer(opt)
    keys = sorted(SHAPES)
    for k in keys:
        kv.init(k, mx.nd.array(f32(case["init"][str(k)])))
    got = []
    for grads, merged in zip(case["grads"], case["merged"], strict=True):
        parts = {}
        for k in keys:
            values = [f32(x) for x in grads[str(k)]]
            if n_devices == 8:
                values = eight_parts(f32(merged[str(k)]))
            assert np.array_equal(sum(values[1:], values[0]), f32(merged[str(k)]))
            parts[k] = [mx.nd.array(x, ctx=mx.cpu(d)) for d, x in enumerate(values)]
        outs = {k: mx.nd.zeros(SHAPES[k]) for k in keys}
        if case["mode"] == "one":
            for k in keys:
                kv.push(k, parts[k])
                kv.pull(k, out=outs[k])
        else:
            kv.push(keys, [parts[k] for k in keys])
            kv.pull(keys, out=[outs[k] for k in keys])
        got.append({"weights": {k: outs[k].asnumpy() for k in keys}, "num_update": opt.num_update})
    return got


# make test: each case once, on 2 or 8 devices in turn; make conformance and test-deep: both.
@pytest.mark.parametrize(("name", "n_devices"), rotating(sorted(DENSE), [2, 8]))
def test_a_store_trains_as_mxnets(name, n_devices):
    case = DENSE[name]
    differing = 0
    for step, (mine, theirs) in enumerate(zip(replay(case, n_devices), case["record"])):
        assert mine["num_update"] == theirs["num_update"], (name, step)
        for k, w in mine["weights"].items():
            what = f"{name} step {step} key {k}"
            differing += check(w, theirs["weights"][str(k)], name, what, REACHED, SUMS)
    if name in REACHED:  # the documented exception is rare: a few elements in 115
        assert differing <= 3, (name, differing)


def test_the_recording_covers_every_argument_and_both_push_modes():
    used = {(c["optimizer"], k) for c in DATA["dense"] for k in c["kwargs"]}
    for opt in ("nag", "signum", "dcasgd", "sgld", "lars", "lbsgd"):
        for arg in ("learning_rate", "wd", "rescale_grad", "clip_gradient"):
            assert (opt, arg) in used, (opt, arg)
        modes = {c["mode"] for c in DATA["dense"] if c["optimizer"] == opt}
        assert modes == {"one", "list"}, opt
        assert any(c["optimizer"] == opt and not c["kwargs"] for c in DATA["dense"]), opt
        extras = {x for c in DATA["dense"] if c["optimizer"] == opt for x in c}
        assert {"lr_mult"} <= extras or opt == "lars", opt
    assert {("nag", "momentum"), ("signum", "wd_lh"), ("dcasgd", "lamda")} <= used
    assert {("lars", "eta"), ("lars", "eps"), ("lars", "momentum_correction")} <= used
    assert {("lbsgd", "warmup_strategy"), ("lbsgd", "begin_num_update")} <= used
    assert {c["name"] for c in DATA["dense"] if "schedule" in c} >= {
        "lars_schedule",
        "lbsgd_schedule",
    }


# -- the states, through the transformation, eagerly and under jit --------------------------
def state_arrays(tx, state) -> list[jax.Array]:
    marked = optax.tree_utils.tree_map_params(
        tx, lambda x: ("param", x), state, transform_non_params=lambda _: None
    )
    is_mark = lambda x: isinstance(x, tuple) and len(x) == 2 and x[0] == "param"  # noqa: E731
    return [m[1] for m in jax.tree.leaves(marked, is_leaf=is_mark) if m is not None]


# make test: each configuration once, eager and jit taking turns (every configuration runs
# under jit through a store in test_a_store_trains_as_mxnets); both for each in make test-deep.
@pytest.mark.parametrize(
    ("name", "call"), rotating(sorted(DENSE), ["eager", "jit"]), indirect=["call"]
)
def test_the_transformation_keeps_mxnets_states(name, call):
    case = DENSE[name]
    opt = build(case)
    keys = sorted(SHAPES)
    states = {}
    weights = {k: jnp.asarray(f32(case["init"][str(k)])) for k in keys}

    def step(w, g, state, scalars):
        updates, state = tx.update(g, state, w, scalars=scalars)
        return optax.apply_updates(w, updates), state

    tx = opt.transformation()
    for n, (merged, theirs) in enumerate(zip(case["merged"], case["record"], strict=True)):
        rows = opt.next_update(keys)  # MXNet's bookkeeping, key by key in the store's order
        for i, k in enumerate(keys):
            if k not in states:
                states[k] = tx.init(weights[k])
            g = jnp.asarray(f32(merged[str(k)]))
            weights[k], states[k] = call(step, weights[k], g, states[k], jnp.asarray(rows[i]))
            what = f"{name} step {n} key {k}"
            check(weights[k], theirs["weights"][str(k)], name, what, REACHED, SUMS)
            mine = state_arrays(tx, states[k])
            assert len(mine) == len(theirs["states"][str(k)]), what
            for s, want in zip(mine, theirs["states"][str(k)]):
                check(s, want, name, f"{what} state", REACHED, SUMS)


@pytest.mark.parametrize("case", DATA["multi_precision"], ids=lambda c: c["optimizer"])
def test_float16_weights_under_multi_precision_as_mxnets(case):
    """MXNet's float32 master copy of float16 weights: the kernel runs on the copy, the weight
    is its float16 cast (the base's path, with these kernels)."""
    tx = optimizer.create(case["optimizer"], **case["kwargs"]).transformation()
    w = jnp.asarray(f32(case["init"]), jnp.float16)
    state = tx.init(w)
    for n, (g, want) in enumerate(zip(case["grads"], case["trajectory"], strict=True)):
        updates, state = tx.update(jnp.asarray(f32(g), jnp.float16), state, w)
        w = (w.astype(updates.dtype) + updates).astype(w.dtype)  # as the store adds it
        assert w.dtype == jnp.float16 and updates.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(w, np.float32), f32(want), err_msg=f"step {n}")


# -- row-sparse pushes ------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(SPARSE))
def test_row_sparse_pushes_through_a_store_as_mxnets(name):
    case = SPARSE[name]
    opt = build(case)
    shape = tuple(np.shape(case["init"]))
    kv = mx.kv.create("device")
    kv.set_optimizer(opt)
    kv.init(0, mx.nd.array(f32(case["init"])))
    before = f32(case["init"])
    for n, (push, want, moved, pushed) in enumerate(
        zip(case["pushes"], case["trajectory"], case["rows_moved"], case["rows_pushed"])
    ):
        parts = [
            mx.nd.sparse.row_sparse_array(
                (f32(p["data"]), p["rows"]), shape=shape, ctx=mx.cpu(p["ctx"])
            )
            for p in push
        ]
        kv.push(0, parts)
        out = mx.nd.zeros(shape)
        kv.pull(0, out=out)
        got = out.asnumpy()
        check(got, want, name, f"{name} push {n}", REACHED_SPARSE)
        mine = [r for r in range(shape[0]) if not np.array_equal(got[r], before[r])]
        assert mine == moved, (name, n)
        assert (moved == pushed) is opt.lazy_update, (name, n)  # lazy: the pushed rows only
        before = got


def test_row_sparse_semantics_follow_mxnets_kernels():
    """Lazy where MXNet has a row-sparse kernel (NAG without momentum and LBSGD: sgd_update,
    sgd_mom_update), every row where it densifies (NAG with momentum, Signum, DCASGD, SGLD)."""
    lazy = {n for n, c in SPARSE.items() if c["rows_moved"] == c["rows_pushed"]}
    assert lazy == {"nag_rsp", "lbsgd_rsp", "lbsgd_momentum_rsp"}
    for name in SPARSE:
        assert build(SPARSE[name]).lazy_update is (name in lazy), name


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: optimizer.LARS(momentum=0.9), "LARS: row-sparse gradients"),
        (lambda: optimizer.LBSGD(warmup_strategy="lars"), "warmup_strategy='lars' with row-sp"),
    ],
)
def test_row_sparse_pushes_mxnet_scales_by_the_whole_weight_are_refused(make, message):
    assert DATA["observations"]["lars_row_sparse_rows_moved"] == [1, 3]  # MXNet: lazy rows
    opt = make()
    kv = mx.kv.create("device")
    kv.set_optimizer(opt)
    kv.init(0, mx.nd.ones((6, 3)))
    part = mx.nd.sparse.row_sparse_array((f32(np.ones((2, 3))), [1, 3]), shape=(6, 3))
    with pytest.raises(optimizer.OptimizerArgumentError, match=message):
        kv.push(0, part)
    assert opt.num_update == 0  # refused: not counted
    out = mx.nd.zeros((6, 3))
    kv.pull(0, out=out)
    np.testing.assert_array_equal(out.asnumpy(), np.ones((6, 3)))


# -- what MXNet does where jaxkv refuses ------------------------------------------------------
def test_dcasgd_momentum_is_refused_as_mxnet_never_runs_it():
    obs = DATA["observations"]["dcasgd_momentum"]
    assert obs["store_weight_moved"] is False
    assert "truth value of an NDArray" in obs["updater_raises"]
    with pytest.raises(optimizer.OptimizerArgumentError, match=r"momentum expected 0.*if mom"):
        optimizer.DCASGD(momentum=0.9)
    assert optimizer.DCASGD(momentum=0).momentum == 0.0


def test_lbsgd_batch_scale_is_refused_as_mxnets_store_counts_a_gradient_twice():
    obs = DATA["observations"]["lbsgd_batch_scale_2"]
    assert obs == {
        "one_device_is_mean": True,
        "two_devices_is_mean": False,
        "two_devices_counts_second_twice": True,
    }
    with pytest.raises(optimizer.OptimizerArgumentError, match="batch_scale expected 1, given 2"):
        optimizer.LBSGD(batch_scale=2)
    assert optimizer.LBSGD(batch_scale=1.0).batch_scale == 1.0


def test_signsgd_refuses_wd_lh_as_mxnet():
    assert "Cannot find argument 'wd_lh'" in DATA["observations"]["signsgd_wd_lh"]
    with pytest.raises(optimizer.OptimizerArgumentError, match="wd_lh=0.1 with momentum=0"):
        optimizer.Signum(momentum=0.0, wd_lh=0.1)


# -- SGLD's noise ------------------------------------------------------------------------------
def _sgld_steps(seed: int, n: int = 4000, lr: float = 0.04, steps: int = 3) -> np.ndarray:
    """Zero gradients on zero weights of keys 0 and 1: each step adds only the noise."""
    mx.random.seed(seed)
    kv = mx.kv.create("device")
    kv.set_optimizer(optimizer.SGLD(learning_rate=lr))
    for k in (0, 1):
        kv.init(k, mx.nd.zeros((n,)))
    out = []
    before = np.zeros((2, n), np.float32)
    for _ in range(steps):
        kv.push([0, 1], [[mx.nd.zeros((n,), ctx=mx.cpu(d)) for d in range(2)]] * 2)
        now = np.stack([np.asarray(kv.pull(k)) for k in (0, 1)])
        out.append(now - before)
        before = now
    return np.stack(out)  # (steps, keys, n)


def test_sgld_noise_has_mxnets_distribution():
    rec = DATA["sgld_noise"]
    lr, n = rec["learning_rate"], rec["size"]
    noise = _sgld_steps(seed=3, n=n, lr=lr).astype(np.float64)
    # mean 0 and variance lr: 5 standard errors (a variance of lr/2, 2*lr or sqrt(lr) fails)
    se_var = lr * np.sqrt(2 / n)
    for x in noise.reshape(-1, n):
        assert abs(x.mean()) < 5 * np.sqrt(lr / n)
        assert abs(x.var() - lr) < 5 * se_var
    for var in rec["var"]:  # MXNet's own draws, recorded: the same distribution
        assert abs(var - lr) < 5 * se_var
    # independent between steps and keys (MXNet's recorded correlation is near 0 too)
    assert abs(rec["corr_first_two"]) < 5 / np.sqrt(n)
    flat = noise.reshape(-1, n)
    corr = np.corrcoef(flat)[np.triu_indices(len(flat), 1)]
    assert np.abs(corr).max() < 5 / np.sqrt(n)
    # gaussian: about 68% within one standard deviation, 95% within two
    within = np.mean(np.abs(flat) < np.sqrt(lr))
    assert abs(within - 0.6827) < 0.02
    assert abs(np.mean(np.abs(flat) < 2 * np.sqrt(lr)) - 0.9545) < 0.01


def test_sgld_noise_follows_mx_random_seed():
    a, b, c = _sgld_steps(5, n=64, steps=2), _sgld_steps(5, n=64, steps=2), _sgld_steps(6, n=64)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a[0], c[0])


def test_sgld_adds_its_noise_to_mxnets_deterministic_step():
    """With the same seed, SGLD's first step is the zero-noise one (MXNet's recorded weight)
    plus the noise the same optimizer draws on a zero weight and gradient."""
    case = DENSE["sgld_full"]
    w, g = (
        jnp.asarray(f32(case[x]["0"] if x == "init" else case[x][0]["0"]))
        for x in ("init", "merged")
    )

    def first_step(cls, w, g):
        mx.random.seed(11)
        opt = cls(**case["kwargs"])
        opt.set_lr_mult({_key(k): v for k, v in case["lr_mult"].items()})
        tx = opt.transformation()
        updates, _ = tx.update(g, tx.init(w), w, scalars=opt.next_update([0])[0])
        return np.asarray(optax.apply_updates(w, updates))

    exact = first_step(ZeroNoiseSGLD, w, g)
    np.testing.assert_array_equal(exact, f32(case["record"][0]["weights"]["0"]))
    noise = first_step(optimizer.SGLD, jnp.zeros_like(w), jnp.zeros_like(g))
    noisy = first_step(optimizer.SGLD, w, g)
    assert np.abs(noise).min() > 0
    # noisy = float32(exact + noise), reached: within an ulp of the float32 sum
    assert np.all(np.abs(noisy - (exact + noise)) <= np.spacing(np.abs(exact + noise)))


# -- the functional use: transformation() under jit ---------------------------------------
@pytest.mark.parametrize(
    "name",
    ["nag_full", "signum_full", "dcasgd_full", "sgld_full", "lars_momentum", "lbsgd_momentum"],
)
def test_transformation_under_jit_without_scalars(name):
    """An optax loop, no store: ``update(g, state, w)`` under ``jax.jit`` with the numbers the
    optimizer had (no multipliers: the key-free ``inputs(None)``), equal to the eager one."""
    case = DENSE[name]
    opt = build({"optimizer": case["optimizer"], "kwargs": case["kwargs"]})
    tx = opt.transformation()
    params = {k: jnp.asarray(f32(case["init"][k])) for k in ("0", "1")}

    def step(p, g, state):
        updates, state = tx.update(g, state, p)
        return optax.apply_updates(p, updates), state

    jitted = jax.jit(step)
    eager_p, jit_p = params, params
    eager_s = jit_s = tx.init(params)
    for merged in case["merged"]:
        g = {k: jnp.asarray(f32(v)) for k, v in merged.items()}
        eager_p, eager_s = step(eager_p, g, eager_s)
        jit_p, jit_s = jitted(jit_p, g, jit_s)
    for k in params:
        np.testing.assert_array_equal(np.asarray(jit_p[k]), np.asarray(eager_p[k]))
        assert not np.array_equal(np.asarray(jit_p[k]), np.asarray(params[k]))
    assert int(jit_s.count) == opt.begin_num_update + len(case["merged"])


def test_sgld_noise_differs_per_parameter_of_one_tree():
    tx = optimizer.SGLD(learning_rate=1.0).transformation()
    params = {"a": jnp.zeros(256), "b": jnp.zeros(256)}
    updates, state = jax.jit(tx.update)(params, tx.init(params), params)
    assert not np.array_equal(updates["a"], updates["b"])
    again, _ = jax.jit(tx.update)(params, state, params)
    assert not np.array_equal(again["a"], updates["a"])  # and per step


def test_a_new_learning_rate_or_momentum_correction_compiles_nothing(compiles):
    sched = mx.lr_scheduler.FactorScheduler(step=1, factor=0.9, base_lr=0.1)
    opt = optimizer.LARS(momentum=0.9, lr_scheduler=sched)
    kv = mx.kv.create("device")
    kv.set_optimizer(opt)
    kv.init(0, mx.nd.ones((4, 2)))

    def push():
        kv.push(0, [mx.nd.ones((4, 2), ctx=mx.cpu(d)) for d in range(2)])
        return np.asarray(kv.pull(0))

    for _ in range(3):
        push()
    with compiles() as counter:
        for _ in range(3):
            push()
    assert counter.count == 0
    assert opt.cur_lr != opt.last_lr  # the momentum was corrected at each push


# -- defaults and arguments --------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(DATA["defaults"]))
def test_defaults_are_mxnets(name):
    opt = getattr(optimizer, name)()
    for attr, value in DATA["defaults"][name].items():
        assert getattr(opt, attr) == value, (name, attr)
    assert type(optimizer.create(name.lower())) is type(opt)
    assert getattr(mx.optimizer, name) is type(opt)


def test_the_names_are_registered_and_exported():
    for name in ("NAG", "Signum", "SGLD", "DCASGD", "LARS", "LBSGD"):
        assert name in mx.optimizer.__all__
        assert isinstance(optimizer.create(name), optimizer.Optimizer)
        assert isinstance(optimizer.create(name), jaxkv.mx.optimizer.Optimizer)
