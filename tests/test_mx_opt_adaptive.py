"""``jaxkv.mx.optimizer``'s AdaGrad, GroupAdaGrad, RMSProp, AdaDelta and Ftrl through a store,
against MXNet 1.9.1's recorded numbers (``conformance/record_opt_adaptive.py``,
``conformance/data/mxnet_opt_adaptive.json``).

Each recorded configuration trains two keys for 5 steps through ``mx.kv.create('device')``,
pushed one key at a time or as a list (as recorded), the values on 2 devices (MXNet's two
parts) or on 8 (8 parts that add up, in any order, to exactly MXNet's sum of the two). Every
pulled weight and ``num_update`` must be MXNet's, bit for bit, except Ftrl's weights: MXNet
writes Ftrl's new weight from scratch, and where no float32 update reaches it from the old one
(a weight that shrinks to less than about half the step), the pulled weight is within an ulp
of the step of MXNet's; its state keeps the difference, so ``z``, ``n`` and the weight plus
that residual are MXNet's bit for bit (checked through the transformation, eagerly and under
``jit``). Row-sparse pushes: lazily (AdaGrad, GroupAdaGrad, Ftrl, as MXNet's row-sparse
kernels) or every row (RMSProp, AdaDelta, as MXNet densifies).
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
from optax.tree_utils import tree_map_params

import jaxkv
import jaxkv.mx as mx
from jaxkv.mx import optimizer

DATA = json.loads(
    (Path(__file__).parent.parent / "conformance/data/mxnet_opt_adaptive.json").read_text()
)
DENSE = {c["name"]: c for c in DATA["dense"]}
SPARSE = {c["name"]: c for c in DATA["row_sparse"]}
NAMES = ("AdaGrad", "GroupAdaGrad", "RMSProp", "AdaDelta", "Ftrl")


def f32(x) -> np.ndarray:
    return np.asarray(x, np.float32)


def ulps(got, want) -> np.ndarray:
    got, want = f32(got), f32(want)
    return np.abs(got.view(np.int32).astype(np.int64) - want.view(np.int32).astype(np.int64))


def check(got, want, what: str) -> None:
    """Equal values (0.0 == -0.0)."""
    got, want = f32(got), f32(want)
    assert got.shape == want.shape, what
    differ = got != want
    assert not differ.any(), f"{what}: {int(differ.sum())} differ, {ulps(got, want).max()} ulps"


class WrittenWhole:
    """Ftrl's weights, which MXNet writes whole: each element MXNet's, or within an ulp of
    the step of its last update (from jaxkv's weight before it) where no float32 update
    reaches MXNet's. ``differing``: how many elements differed, over the checks."""

    def __init__(self, init) -> None:
        self.before = self.theirs = f32(init)
        self.step = np.zeros_like(self.before)
        self.differing = 0

    def check(self, got, want, what: str) -> None:
        got, want = f32(got), f32(want)
        assert got.shape == want.shape, what
        moved = (want != self.theirs) | (got != self.before)
        step = np.maximum(np.abs(want - self.before), np.abs(got - self.before))
        self.step = np.where(moved, step, self.step)
        within = np.abs(got - want) <= np.spacing(self.step)
        assert within.all(), f"{what}: {int((~within).sum())} beyond an ulp of their step"
        self.differing += int((got != want).sum())
        self.before, self.theirs = got, want


def check_states(name: str, mine: list, theirs: list, what: str) -> None:
    """The state arrays MXNet keeps: GroupAdaGrad's history is one number per row in MXNet,
    in every element of the row here; Ftrl's residual (the last array) is jaxkv's own."""
    if name.startswith("ftrl"):
        mine = mine[:-1]
    if name.startswith("groupadagrad"):
        for h in mine:
            assert np.all(np.asarray(h) == np.asarray(h)[:, :1]), what
        mine = [np.asarray(h)[:, :1] for h in mine]
    assert len(mine) == len(theirs), what
    for s, ws in zip(mine, theirs, strict=True):
        check(s, ws, f"{what} state")


def _key(k: str):
    return int(k) if k.isdigit() else k


def build(case: dict) -> optimizer.Optimizer:
    kwargs = dict(case["kwargs"])
    if "schedule" in case:
        sched = case["schedule"]
        kwargs["lr_scheduler"] = getattr(mx.lr_scheduler, sched["class"])(**sched["kwargs"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a schedule's base_lr replaced, as MXNet warns
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
    last = total - part * np.float32(7)
    return [*([part] * 7), last.astype(np.float32)]


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
def replay(case: dict, n_devices: int) -> list[dict]:
    opt = build(case)
    shapes = {int(k): tuple(v) for k, v in case["shapes"].items()}
    kv = mx.kv.create("device")
    kv.set_optimizer(opt)
    keys = sorted(shapes)
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
        outs = {k: mx.nd.zeros(shapes[k]) for k in keys}
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
    whole = {k: WrittenWhole(v) for k, v in case["init"].items()}
    for step, (mine, theirs) in enumerate(zip(replay(case, n_devices), case["record"])):
        assert mine["num_update"] == theirs["num_update"], (name, step)
        for k, w in mine["weights"].items():
            what = f"{name} step {step} key {k}"
            if case["optimizer"] == "ftrl":
                whole[str(k)].check(w, theirs["weights"][str(k)], what)
            else:
                check(w, theirs["weights"][str(k)], what)


def test_ftrl_weights_differ_only_where_no_update_reaches_mxnets():
    """The documented exception is a minority, and real: some elements do differ (so the
    tolerance is needed), most are MXNet's bits."""
    differing = total = 0
    for name in ("ftrl_default", "ftrl_full", "ftrl_schedule"):
        case = DENSE[name]
        whole = {k: WrittenWhole(v) for k, v in case["init"].items()}
        for mine, theirs in zip(replay(case, 2), case["record"], strict=True):
            for k, w in mine["weights"].items():
                whole[str(k)].check(w, theirs["weights"][str(k)], name)
                total += w.size
        differing += sum(x.differing for x in whole.values())
    assert 0 < differing < total // 4, (differing, total)


def test_the_recording_covers_every_argument_and_both_push_modes():
    used = {(c["optimizer"], k) for c in DATA["dense"] for k in c["kwargs"]}
    for opt in ("adagrad", "groupadagrad", "rmsprop", "adadelta", "ftrl"):
        for arg in ("rescale_grad", "clip_gradient", "begin_num_update"):
            assert (opt, arg) in used, (opt, arg)
        if opt != "groupadagrad":  # it takes no weight decay
            assert (opt, "wd") in used, opt
        modes = {c["mode"] for c in DATA["dense"] if c["optimizer"] == opt}
        assert modes == {"one", "list"}, opt
        assert any(c["optimizer"] == opt and not c["kwargs"] for c in DATA["dense"]), opt
        extras = {x for c in DATA["dense"] if c["optimizer"] == opt for x in c}
        assert {"lr_mult"} <= extras, opt
    assert {("adagrad", "eps"), ("groupadagrad", "eps"), ("adadelta", "rho")} <= used
    assert {("rmsprop", x) for x in ("gamma1", "gamma2", "epsilon", "centered")} <= used
    assert {("rmsprop", "clip_weights"), ("ftrl", "lamda1"), ("ftrl", "beta")} <= used
    assert {c["optimizer"] for c in DATA["dense"] if "schedule" in c} == {
        "adagrad",
        "groupadagrad",
        "rmsprop",
        "ftrl",
    }
    assert {c["name"] for c in DATA["dense"] if "wd_mult" in c} >= {
        "adagrad_full",
        "groupadagrad_wd_mult_zero",
        "rmsprop_full",
        "adadelta_full",
        "ftrl_full",
    }


# -- the states, through the transformation, eagerly and under jit --------------------------
def state_arrays(tx, state) -> list[jax.Array]:
    marked = tree_map_params(tx, lambda x: ("param", x), state, transform_non_params=lambda _: None)
    is_mark = lambda x: isinstance(x, tuple) and len(x) == 2 and x[0] == "param"  # noqa: E731
    return [m[1] for m in jax.tree.leaves(marked, is_leaf=is_mark) if m is not None]


# make test: each configuration once, eager and jit taking turns (every configuration runs
# under jit through a store in test_a_store_trains_as_mxnets); both for each in make test-deep.
@pytest.mark.parametrize(
    ("name", "call"), rotating(sorted(DENSE), ["eager", "jit"]), indirect=["call"]
)
def test_the_transformation_keeps_mxnets_states(name, call):
    """Every state array MXNet keeps, bit for bit (RMSProp centered: ``n``, ``g``, ``delta``;
    Ftrl: ``z``, ``n``, and beside them the residual: the weight plus it is MXNet's)."""
    case = DENSE[name]
    opt = build(case)
    keys = sorted(int(k) for k in case["shapes"])
    weights = {k: jnp.asarray(f32(case["init"][str(k)])) for k in keys}
    states: dict = {}

    def step(w, g, state, scalars):
        updates, state = tx.update(g, state, w, scalars=scalars)
        return optax.apply_updates(w, updates), state

    tx = opt.transformation()
    whole = {k: WrittenWhole(case["init"][str(k)]) for k in keys}
    for n, (merged, theirs) in enumerate(zip(case["merged"], case["record"], strict=True)):
        rows = opt.next_update(keys)  # MXNet's bookkeeping, key by key in the store's order
        for i, k in enumerate(keys):
            if k not in states:
                states[k] = tx.init(weights[k])
            g = jnp.asarray(f32(merged[str(k)]))
            weights[k], states[k] = call(step, weights[k], g, states[k], jnp.asarray(rows[i]))
            what = f"{name} step {n} key {k}"
            want = theirs["weights"][str(k)]
            mine = state_arrays(tx, states[k])
            if case["optimizer"] == "ftrl":
                check(weights[k] + mine[-1], want, f"{what} weight + residual")
                whole[k].check(weights[k], want, what)
            else:
                check(weights[k], want, what)
            check_states(name, mine, theirs["states"][str(k)], what)
        assert opt.num_update == theirs["num_update"]


@pytest.mark.parametrize(
    "case", DATA["multi_precision"], ids=lambda c: c["optimizer"] + str(c["kwargs"].get("centered"))
)
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
def _mine(name: str) -> str:
    """The record jaxkv follows: a row-sparse stored weight's (jaxkv's store keeps no storage
    type; MXNet's lazy kernels run for it)."""
    return name[: -len("dense")] + "rsp" if name[: -len("dense")] + "rsp" in SPARSE else name


def _parts(push: list, shape: tuple) -> list:
    return [
        mx.nd.sparse.row_sparse_array(
            (f32(p["data"]), p["rows"]), shape=shape, ctx=mx.cpu(p["ctx"])
        )
        for p in push
    ]


@pytest.mark.parametrize("name", sorted(n for n in SPARSE if _mine(n) == n))
def test_row_sparse_pushes_through_a_store_as_mxnets(name):
    case = SPARSE[name]
    opt = optimizer.create(case["optimizer"], **case["kwargs"])
    shape = tuple(np.shape(case["init"]))
    kv = mx.kv.create("device")
    kv.set_optimizer(opt)
    kv.init(0, mx.nd.array(f32(case["init"])))
    before = f32(case["init"])
    whole = WrittenWhole(case["init"])
    for n, (push, want, moved, pushed) in enumerate(
        zip(case["pushes"], case["trajectory"], case["rows_moved"], case["rows_pushed"])
    ):
        kv.push(0, _parts(push, shape))
        out = mx.nd.zeros(shape)
        kv.pull(0, out=out)
        got = out.asnumpy()
        if case["optimizer"] == "ftrl":
            whole.check(got, want, f"{name} push {n}")
        else:
            check(got, want, f"{name} push {n}")
        mine = [r for r in range(shape[0]) if not np.array_equal(got[r], before[r])]
        assert mine == moved, (name, n)
        assert (moved == pushed) is opt.lazy_update, (name, n)  # lazy: the pushed rows only
        before = got
    assert opt.num_update == case["num_update"]


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
        lambda p, full, part: full.at[idx].set(part) if p else part, is_param, state, new_rows_state
    )
    return w, state


def dense_push(tx, w, state, rows, data):
    """A row-sparse push densified (MXNet's without a row-sparse kernel): every row."""
    g = jnp.zeros_like(w).at[jnp.asarray(rows)].add(jnp.asarray(data))
    updates, state = tx.update(g, state, w)
    return optax.apply_updates(w, updates), state


@pytest.mark.parametrize("name", sorted(n for n in SPARSE if _mine(n) == n))
def test_row_sparse_kernels_keep_mxnets_states(name):
    """The row-sparse transformation on the summed rows (lazily) or on the densified gradient,
    eagerly: every weight and state array MXNet recorded."""
    case = SPARSE[name]
    opt = optimizer.create(case["optimizer"], **case["kwargs"])
    tx = opt.transformation(row_sparse=True)
    w = jnp.asarray(f32(case["init"]))
    state = tx.init(w)
    push_rows = lazy_push if opt.lazy_update else dense_push
    whole = WrittenWhole(case["init"])
    for n, (push, want, want_states) in enumerate(
        zip(case["pushes"], case["trajectory"], case["states"], strict=True)
    ):
        rows = [r for part in push for r in part["rows"]]
        data = f32([row for part in push for row in part["data"]])
        w, state = push_rows(tx, w, state, rows, data)
        mine = state_arrays(tx, state)
        if case["optimizer"] == "ftrl":
            check(w + mine[-1], want, f"{name} push {n} weight + residual")
            whole.check(w, want, f"{name} push {n}")
        else:
            check(w, want, f"{name} push {n}")
        check_states(name, mine, want_states, f"{name} push {n}")


def test_row_sparse_semantics_follow_mxnets_kernels():
    """Lazy where MXNet has a row-sparse kernel (AdaGrad, GroupAdaGrad, Ftrl), every row where
    it densifies (RMSProp, AdaDelta); for AdaGrad and GroupAdaGrad a weight stored dense or
    row-sparse takes the same numbers; Ftrl's differ, and jaxkv follows the row-sparse one."""
    lazy = {c["optimizer"] for c in SPARSE.values() if c["rows_moved"] == c["rows_pushed"]}
    assert lazy == {"adagrad", "groupadagrad", "ftrl"}
    for case in SPARSE.values():
        opt = optimizer.create(case["optimizer"], **case["kwargs"])
        assert opt.lazy_update is (case["optimizer"] in lazy)
        other = SPARSE.get(case["name"][: -len("rsp")] + "dense")
        if case["name"].endswith("_rsp") and other is not None:
            same = other["trajectory"] == case["trajectory"]
            assert same is (case["optimizer"] != "ftrl"), case["name"]


@pytest.mark.parametrize("name", ["ftrl_rsp_dense", "ftrl_clip_rsp_dense"])
def test_ftrl_of_a_dense_stored_weight_is_a_push_of_the_densified_gradient(name):
    """MXNet's Ftrl with a dense stored weight densifies a row-sparse gradient (every row's
    weight recomputed, 0 for a row never pushed); in jaxkv, pushing the dense gradient gives
    those numbers."""
    case = SPARSE[name]
    assert case["rows_moved"][0] == list(range(6))  # row 5, never pushed, becomes 0
    assert case["trajectory"][0][5] == [0.0, 0.0, 0.0]
    kv = mx.kv.create("device")
    kv.set_optimizer(optimizer.create(case["optimizer"], **case["kwargs"]))
    kv.init(0, mx.nd.array(f32(case["init"])))
    whole = WrittenWhole(case["init"])
    for n, (push, want) in enumerate(zip(case["pushes"], case["trajectory"], strict=True)):
        kv.push(0, [p.tostype("default") for p in _parts(push, (6, 3))])
        whole.check(np.asarray(kv.pull(0)), want, f"{name} push {n}")


# -- what MXNet does where jaxkv refuses ------------------------------------------------------
def _refused_push(opt, value, message, shape=(6, 3)):
    kv = mx.kv.create("device")
    kv.set_optimizer(opt)
    kv.init(0, mx.nd.ones(shape))
    with pytest.raises(optimizer.OptimizerArgumentError, match=message):
        kv.push(0, value)
    assert opt.num_update == 0  # refused: not counted
    out = mx.nd.zeros(shape)
    kv.pull(0, out=out)
    np.testing.assert_array_equal(out.asnumpy(), np.ones(shape))


def _rows():
    return mx.nd.sparse.row_sparse_array((f32(np.ones((2, 3))), [1, 3]), shape=(6, 3))


def test_adagrad_row_sparse_with_weight_decay_is_refused_as_mxnet_cannot_run_it():
    obs = DATA["observations"]["adagrad_row_sparse_wd"]
    assert obs["store_weight_moved"] is False and obs["num_update"] == 1
    assert "_sparse_adagrad_update" in obs["updater_raises"]
    _refused_push(optimizer.AdaGrad(wd=0.1), _rows(), r"wd expected 0 \(after wd_mult\)")
    opt = optimizer.AdaGrad(wd=0.1)
    opt.set_wd_mult({0: 0.0})  # no weight decay for this key: MXNet's kernel runs
    kv = mx.kv.create("device")
    kv.set_optimizer(opt)
    kv.init(0, mx.nd.ones((6, 3)))
    kv.push(0, _rows())
    assert opt.num_update == 1


def test_groupadagrad_weight_decay_and_1d_weights_are_refused_as_mxnet_asserts():
    obs = DATA["observations"]
    assert obs["groupadagrad_wd"]["store_weight_moved"] is False
    assert "Weight decay is not supported" in obs["groupadagrad_wd"]["updater_raises"]
    assert obs["groupadagrad_1d_weight"].startswith("AssertionError")
    dense = [mx.nd.ones((6, 3), ctx=mx.cpu(d)) for d in range(2)]
    message = r"wd expected 0 \(after wd_mult\) for index 0, given 0.1"
    _refused_push(optimizer.GroupAdaGrad(wd=0.1), dense, message)
    _refused_push(optimizer.GroupAdaGrad(wd=0.1), _rows(), message)
    with pytest.raises(optimizer.OptimizerArgumentError, match=r"2-D weights.*given shape \(5,\)"):
        optimizer.GroupAdaGrad().transformation().init(jnp.ones(5))
    kv = mx.kv.create("device")
    kv.set_optimizer(optimizer.GroupAdaGrad())
    kv.init(0, mx.nd.ones(5))
    with pytest.raises(jaxkv.KVStoreError, match="2-D weights"):  # at the push or the pull
        kv.push(0, mx.nd.ones(5))
        kv.pull(0)


def test_adadelta_row_sparse_with_a_negative_clip_is_refused_as_mxnet_cannot_clip_it():
    obs = DATA["observations"]["adadelta_row_sparse_negative_clip"]
    assert obs["store_weight_moved"] is False
    assert "operator = clip" in obs["updater_raises"]
    _refused_push(optimizer.AdaDelta(clip_gradient=-0.2), _rows(), "clip_gradient=-0.2")
    assert "adadelta_clip_negative" in DENSE  # dense, MXNet clips with those bounds: as here


# -- the functional use: transformation() under jit ---------------------------------------
@pytest.mark.parametrize(
    "name",
    ["adagrad_full", "groupadagrad_full", "rmsprop_full", "rmsprop_centered_full"]
    + ["adadelta_full", "ftrl_full"],
)
def test_transformation_under_jit_without_scalars(name):
    """An optax loop, no store: ``update(g, state, w)`` under ``jax.jit`` with the numbers the
    optimizer had (no multipliers: the key-free ``inputs(None)``), equal to the eager one."""
    case = DENSE[name]
    opt = build({"optimizer": case["optimizer"], "kwargs": case["kwargs"]})
    tx = opt.transformation()
    params = {k: jnp.asarray(f32(v)) for k, v in case["init"].items()}

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
    for a, b in zip(jax.tree.leaves(jit_s), jax.tree.leaves(eager_s), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(jit_s.count) == opt.begin_num_update + len(case["merged"])


@pytest.mark.parametrize("name", ["adagrad_schedule", "rmsprop_schedule", "ftrl_schedule"])
def test_a_new_learning_rate_compiles_nothing(name, compiles):
    case = DENSE[name]
    opt = build(case)
    kv = mx.kv.create("device")
    kv.set_optimizer(opt)
    kv.init(0, mx.nd.ones((4, 2)))

    def push():
        kv.push(0, [mx.nd.ones((4, 2), ctx=mx.cpu(d)) for d in range(2)])
        return np.asarray(kv.pull(0))

    for _ in range(3):
        push()
    rates = []
    with compiles() as counter:
        for _ in range(4):
            push()
            rates.append(opt.learning_rate)
    assert counter.count == 0
    assert len(set(rates)) > 1  # the schedule moved


def test_schedules_keep_or_replace_base_lr_as_mxnet():
    """RMSProp gives its learning_rate to the schedule (MXNet warns); Ftrl does not."""
    rms, ftrl = DENSE["rmsprop_schedule"], DENSE["ftrl_schedule"]
    opt = build(rms)
    assert opt.lr_scheduler.base_lr == rms["kwargs"]["learning_rate"] == 0.05
    opt = build(ftrl)
    assert opt.lr_scheduler.base_lr == ftrl["schedule"]["kwargs"]["base_lr"] == 0.2
    assert opt.lr == DATA["defaults"]["Ftrl"]["lr"]
    with pytest.warns(UserWarning, match="overwritten"):
        optimizer.RMSProp(lr_scheduler=mx.lr_scheduler.FactorScheduler(step=2, base_lr=0.2))


# -- defaults and arguments --------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_defaults_are_mxnets(name):
    assert set(DATA["defaults"]) == set(NAMES)
    opt = getattr(optimizer, name)()
    for attr, value in DATA["defaults"][name].items():
        assert getattr(opt, attr) == value, (name, attr)
    assert type(optimizer.create(name.lower())) is type(opt)
    assert getattr(mx.optimizer, name) is type(opt)


def test_the_names_are_registered_and_exported():
    for name in NAMES:
        assert name in mx.optimizer.__all__
        assert isinstance(optimizer.create(name), optimizer.Optimizer)
    assert type(optimizer.create("groupadagrad")) is optimizer.GroupAdaGrad
