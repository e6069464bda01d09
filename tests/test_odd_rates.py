"""NaN and infinite learning rates (and weight decays, rescale_grads, multipliers, schedules)
refused wherever they enter jaxkv's MXNet optimizers, each refusal changing nothing."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _variants import rotating

import jaxkv
import jaxkv.mx as mx
from jaxkv.mx import lr_scheduler, optimizer

NAN, INF = float("nan"), float("inf")
BAD = [NAN, INF, -INF, 1e39]  # 1e39: finite, but infinite in float32, as the update takes it
STORES = ["jaxkv", "mx"]
W0 = np.arange(4, dtype=np.float32)
G = np.full(4, 0.5, np.float32)


def _store(kind):
    if kind == "jaxkv":
        return jaxkv.KVStore("local", devices=jax.devices("cpu")[:1])
    return mx.kv.create("local")


def _trained(kind, opt, steps):
    kv = _store(kind)
    kv.set_optimizer(opt)
    kv.init(0, mx.nd.array(W0))
    _push(kv, steps)
    return kv


def _push(kv, steps):
    for _ in range(steps):
        kv.push(0, mx.nd.array(G))


def _weights(kv):
    out = mx.nd.zeros(W0.shape)
    kv.pull(0, out=out)
    return out.asnumpy()


def _sgd():
    return optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=0.01)


def _refused(call, error, name, value):
    """``call()`` raises ``error`` (a ``jaxkv.KVStoreError``) naming ``name`` and ``value``."""
    with pytest.raises(error) as info:
        call()
    assert isinstance(info.value, jaxkv.KVStoreError)
    assert f"{name} expected a finite number, given {value!r}" in str(info.value)


@functools.cache
def _fresh(kind, pushes):
    return _weights(_trained(kind, _sgd(), pushes))


def _same_as_fresh(kind, kv, pushed):
    """Two more pushes give the numbers of a fresh store that never saw the refusal."""
    _push(kv, 2)
    np.testing.assert_array_equal(_weights(kv), _fresh(kind, pushed + 2))
    assert np.isfinite(_weights(kv)).all()


# -- set when the optimizer is made -----------------------------------------------------------
@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize("name", ["learning_rate", "wd", "rescale_grad"])
def test_sgd_refuses_a_nonfinite_rate(name, value):
    _refused(lambda: optimizer.SGD(**{name: value}), optimizer.OptimizerArgumentError, name, value)


@pytest.mark.parametrize("value", BAD)
def test_create_refuses_a_nonfinite_learning_rate_for_every_optimizer(value):
    names = sorted(
        n.lower()
        for n in optimizer.__all__
        if isinstance(getattr(optimizer, n), type)
        and issubclass(getattr(optimizer, n), optimizer.Optimizer)
        and n != "Optimizer"
    )
    assert {"sgd", "adam", "nag", "rmsprop", "adadelta", "test"} <= set(names)
    for n in names:
        _refused(
            lambda n=n: optimizer.create(n, learning_rate=value),
            optimizer.OptimizerArgumentError,
            "learning_rate",
            value,
        )


# -- set on an optimizer a store uses -----------------------------------------------------------
SETTERS = {  # how the rate is set -> the name the refusal gives, the call
    "set_learning_rate": ("lr", lambda opt, v: opt.set_learning_rate(v)),
    "opt.lr": ("lr", lambda opt, v: setattr(opt, "lr", v)),
    "opt.wd": ("wd", lambda opt, v: setattr(opt, "wd", v)),
    "opt.rescale_grad": ("rescale_grad", lambda opt, v: setattr(opt, "rescale_grad", v)),
    "set_lr_mult": ("lr_mult[0]", lambda opt, v: opt.set_lr_mult({0: v})),
    "set_wd_mult": ("wd_mult[0]", lambda opt, v: opt.set_wd_mult({0: v})),
}
# Each (store, value) pair; make test runs each setter with one of them in turn.
SETTINGS = [(STORES[i % 2], BAD[(i + i // 4) % 4]) for i in range(8)]


def _numbers(opt):
    return (opt.lr, opt.wd, opt.rescale_grad, dict(opt.lr_mult), dict(opt.wd_mult))


@pytest.mark.parametrize(("setter", "setting"), rotating(list(SETTERS), SETTINGS))
def test_a_rate_set_on_a_stores_optimizer_is_refused_and_changes_nothing(setter, setting):
    kind, value = setting
    name, set_rate = SETTERS[setter]
    opt = _sgd()
    kv = _trained(kind, opt, 2)
    before = _numbers(opt)
    _refused(lambda: set_rate(opt, value), optimizer.OptimizerArgumentError, name, value)
    assert _numbers(opt) == before
    _same_as_fresh(kind, kv, 2)


def test_a_concrete_array_is_checked_a_traced_one_is_not():
    opt = _sgd()
    _refused(
        lambda: setattr(opt, "lr", jnp.asarray(NAN)),
        optimizer.OptimizerArgumentError,
        "lr",
        jnp.asarray(NAN),
    )
    assert opt.lr == 0.1

    @jax.jit
    def set_traced(x):  # no check, and no device sync, inside a computation
        opt.lr = x
        return x

    set_traced(jnp.float32(NAN))
    opt.lr = 0.1  # the tracer out again


def test_set_optimizer_refuses_a_schedule_that_gives_nan_and_keeps_the_optimizer():
    kind = "jaxkv"

    class Broken(lr_scheduler.LRScheduler):  # a schedule of the user's own
        def __call__(self, num_update):
            return NAN

    kv = _trained(kind, _sgd(), 2)
    with pytest.raises(optimizer.OptimizerArgumentError, match=r"learning rate .* given nan"):
        kv.set_optimizer(optimizer.SGD(lr_scheduler=Broken(base_lr=0.1)))
    _same_as_fresh(kind, kv, 2)


def test_a_saved_record_with_a_nonfinite_rate_is_refused():
    opt = _sgd()
    record = opt.record()
    record["numbers"] = {
        "dict": [[k, NAN if k == "lr" else v] for k, v in record["numbers"]["dict"]]
    }
    with pytest.raises(jaxkv.KVStoreError, match=r"opt\.states: the saved SGD's lr .* given nan"):
        opt.restore_record(record, "opt.states")
    assert opt.lr == 0.1


# -- schedules -----------------------------------------------------------------------------------
SCHEDULES = {
    "base_lr": lambda v: lr_scheduler.FactorScheduler(step=2, base_lr=v),
    "warmup_begin_lr": lambda v: lr_scheduler.LRScheduler(warmup_begin_lr=-abs(v)),
    "factor": lambda v: lr_scheduler.MultiFactorScheduler(step=[2], factor=-abs(v)),
    "stop_factor_lr": lambda v: lr_scheduler.FactorScheduler(step=2, stop_factor_lr=v),
    "final_lr": lambda v: lr_scheduler.CosineScheduler(max_update=4, final_lr=v),
    "pwr": lambda v: lr_scheduler.PolyScheduler(max_update=4, pwr=v),
}


@pytest.mark.parametrize("value", [NAN, INF])
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_schedules_refuse_a_nonfinite_rate(name, value):
    shown = value if name not in ("warmup_begin_lr", "factor") else -abs(value)
    if name == "pwr" and value == INF:  # a finite power: pow(x, inf) is 0 or 1
        shown = -INF
    _refused(lambda: SCHEDULES[name](shown), lr_scheduler.SchedulerArgumentError, name, shown)


def test_schedules_refuse_finite_rates_whose_schedule_overflows():
    # The warm-up's (base_lr - warmup_begin_lr) * num_update overflows before its division.
    with pytest.raises(lr_scheduler.SchedulerArgumentError, match="base_lr and warmup_begin_lr"):
        lr_scheduler.LRScheduler(base_lr=1e30, warmup_steps=10**300)
    with pytest.raises(lr_scheduler.SchedulerArgumentError, match="base_lr and warmup_begin_lr"):
        lr_scheduler.CosineScheduler(max_update=2, base_lr=1e30, warmup_steps=10**400)
    lr_scheduler.LRScheduler(base_lr=1e30, warmup_steps=10**300, warmup_mode="constant")


@pytest.mark.parametrize("kind", STORES)
def test_a_schedule_that_overflows_later_refuses_that_push_and_changes_nothing(kind):
    # Finite arguments, taken: the second decay gives (-1e30)**2, infinite in float32.
    sched = lr_scheduler.FactorScheduler(step=1, factor=-1e30, stop_factor_lr=-1e38, base_lr=1.0)
    opt = optimizer.SGD(lr_scheduler=sched)
    kv = _trained(kind, opt, 2)
    weights, counted, state = _weights(kv), opt.num_update, dict(vars(sched))
    assert np.isfinite(weights).all()
    with pytest.raises(optimizer.OptimizerArgumentError, match=r"index 0 .* given 1.0*1e\+60"):
        _push(kv, 1)
        _weights(kv)
    assert opt.num_update == counted == 2
    assert vars(sched) == state
    np.testing.assert_array_equal(_weights(kv), weights)
