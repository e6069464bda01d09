"""jaxkv/_src/mxnet/optimizers/lr_scheduler.py: each scheduler's edges (when a decay shows, the
floor, the warm-up, state kept between calls, past ``max_update``), the refusals and their order,
and the log messages. The expected values are MXNet 1.9.1's (tests/test_mx_lr_scheduler.py checks
many more against its recording)."""

import logging
import math

import numpy as np
import pytest

import jaxkv
from jaxkv._src.mxnet.optimizers import lr_scheduler as lrs

LOGGER = "jaxkv._src.mxnet.optimizers.lr_scheduler"


def test_the_errors_are_kvstore_errors_and_mxnets_builtins():
    assert issubclass(lrs.SchedulerArgumentError, jaxkv.KVStoreError)
    assert issubclass(lrs.SchedulerArgumentError, ValueError)
    assert issubclass(lrs.SchedulerAssertionError, jaxkv.KVStoreError)
    assert issubclass(lrs.SchedulerAssertionError, AssertionError)
    assert issubclass(lrs.SchedulerZeroDivisionError, jaxkv.KVStoreError)
    assert issubclass(lrs.SchedulerZeroDivisionError, ZeroDivisionError)


def test_defaults_are_mxnets():
    sched = lrs.FactorScheduler(step=3)
    assert (sched.base_lr, sched.factor, sched.stop_factor_lr) == (0.01, 1, 1e-8)
    assert (sched.warmup_steps, sched.warmup_begin_lr, sched.warmup_mode) == (0, 0, "linear")
    poly = lrs.PolyScheduler(max_update=10)
    assert (poly.power, poly.final_lr, poly.max_steps, poly.base_lr_orig) == (2, 0, 10, 0.01)
    cosine = lrs.CosineScheduler(max_update=10, warmup_steps=4)
    assert (cosine.final_lr, cosine.max_steps, cosine.warmup_final_lr) == (0, 6, 0.01)


def test_a_factor_decay_shows_one_update_after_its_step():
    sched = lrs.FactorScheduler(step=5, factor=0.5, base_lr=1.0)
    assert [sched(n) for n in (0, 5, 6, 10, 11)] == [1.0, 1.0, 0.5, 0.5, 0.25]
    assert sched.count == 10


def test_a_factor_jump_applies_every_decay_and_a_step_back_keeps_them():
    sched = lrs.FactorScheduler(step=2, factor=0.5, base_lr=1.0)
    assert sched(9) == 1.0 * 0.5**4
    assert sched.count == 8
    assert sched(0) == 0.0625  # not 1.0: base_lr keeps the decays


def test_the_factor_floor_is_stop_factor_lr(caplog):
    sched = lrs.FactorScheduler(step=1, factor=0.1, stop_factor_lr=1e-3, base_lr=1.0)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert sched(4) == 0.0010000000000000002  # 1.0 * 0.1 * 0.1 * 0.1: just above it
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert messages == [
        "Update[4]: Change learning rate to 1.00000e-01",
        "Update[4]: Change learning rate to 1.00000e-02",
        "Update[4]: Change learning rate to 1.00000e-03",
    ]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert sched(5) == 1e-3  # 1e-4 < 1e-3: floored, and said at every decay
    assert [r.getMessage() for r in caplog.records] == [
        "Update[5]: now learning rate arrived at 1.00000e-03, will not change in the future"
    ]


def test_schedulers_log_to_their_module_logger_not_the_root(caplog):
    with caplog.at_level(logging.INFO):
        lrs.MultiFactorScheduler(step=[1], factor=0.5)(2)
    assert [(r.name, r.levelno) for r in caplog.records] == [(LOGGER, logging.INFO)]


def test_the_warmup_counts_toward_the_factor_steps():
    sched = lrs.FactorScheduler(step=2, factor=0.1, base_lr=1.0, warmup_steps=3)
    assert [sched(n) for n in range(3)] == [0.0, 1 / 3, 2 / 3]
    assert sched(3) == 0.1  # count went 0 -> 2 at once: the warm-up ends below base_lr


def test_the_warmup_ends_at_the_constructors_base_lr_and_changes_nothing():
    sched = lrs.FactorScheduler(step=1, factor=0.5, base_lr=1.0, warmup_steps=2)
    sched(10)
    assert sched.base_lr < 0.01
    assert sched(1) == 0.5  # halfway from 0 to warmup_final_lr (1.0), not to base_lr
    assert sched.count == 9


def test_constant_warmup_returns_warmup_begin_lr_as_given():
    sched = lrs.PolyScheduler(max_update=10, base_lr=1, warmup_steps=3, warmup_mode="constant")
    assert repr(sched(1)) == "0"  # MXNet's int default passes through
    assert repr(lrs.CosineScheduler(5, warmup_steps=2)(0)) == "0.0"  # 0 + 0.0 in linear mode


def test_multi_factor_decays_after_each_listed_update_and_keeps_them():
    steps = [2, 4, 8]
    sched = lrs.MultiFactorScheduler(step=steps, factor=0.5, base_lr=1.0)
    assert [sched(n) for n in (2, 3, 4, 5, 9, 100)] == [1.0, 0.5, 0.5, 0.25, 0.125, 0.125]
    assert (sched.cur_step_ind, sched.count) == (3, 8)
    assert sched(0) == 0.125
    assert sched.step is steps  # kept, not copied, as MXNet does


def test_poly_past_max_update_returns_the_last_rate_computed():
    assert lrs.PolyScheduler(max_update=10, base_lr=1.0)(11) == 1.0  # nothing computed yet
    sched = lrs.PolyScheduler(max_update=10, base_lr=1.0, final_lr=0.1)
    assert sched(5) == 0.1 + 0.9 * 0.25
    assert sched(50) == 0.1 + 0.9 * 0.25
    assert sched(10) == 0.1
    assert sched(50) == 0.1
    assert sched(0) == 1.0  # recomputed: no state but the last value


def test_poly_powers():
    for pwr, want in ((1, 0.75), (2, 0.5625), (0.5, math.sqrt(0.75))):
        assert lrs.PolyScheduler(max_update=4, base_lr=1.0, pwr=pwr)(1) == want


def test_a_warmup_past_max_update_leaves_no_decay():
    sched = lrs.PolyScheduler(max_update=5, base_lr=1.0, warmup_steps=8)
    assert sched.max_steps == -3
    assert [sched(n) for n in (0, 4, 8, 100)] == [0.0, 0.5, 1.0, 1.0]


@pytest.mark.parametrize("cls", [lrs.PolyScheduler, lrs.CosineScheduler])
def test_a_warmup_until_max_update_raises_there_and_changes_nothing(cls):
    sched = cls(max_update=4, base_lr=1.0, warmup_steps=4)
    assert sched(3) == 0.75
    with pytest.raises(lrs.SchedulerZeroDivisionError, match=r"num_update 4 .*max_update \(4"):
        sched(4)
    with pytest.raises(ZeroDivisionError):
        sched(4)
    assert sched.base_lr == 1.0
    assert sched(5) == 1.0


def test_cosine_halfway_and_rising():
    sched = lrs.CosineScheduler(max_update=10, base_lr=1.0)
    assert sched(5) == (1 + math.cos(math.pi * 5 / 10)) / 2
    assert sched(10) == 0.0
    rising = lrs.CosineScheduler(max_update=2, base_lr=0.1, final_lr=0.5)
    # At 0: final_lr + (base_lr - final_lr), one ulp off base_lr here, as in MXNet.
    assert [rising(n) for n in range(3)] == [0.09999999999999998, 0.3, 0.5]


def test_a_negative_num_update_is_a_warmup_as_in_mxnet():
    # Below the warm-up's start, the line goes on; with no warm-up, MXNet divides by zero.
    assert lrs.LRScheduler(base_lr=1.0, warmup_steps=4).get_warmup_lr(-2) == -0.5
    for sched in (lrs.PolyScheduler(max_update=4), lrs.MultiFactorScheduler(step=[1])):
        with pytest.raises(lrs.SchedulerZeroDivisionError, match="num_update -4 is negative"):
            sched(-4)
    assert repr(lrs.FactorScheduler(step=2, warmup_mode="constant")(-4)) == "0"


ARG, ASSERT = lrs.SchedulerArgumentError, lrs.SchedulerAssertionError


@pytest.mark.parametrize(
    ("kwargs", "error", "argument"),
    [
        ({"warmup_steps": 2.0}, ASSERT, "warmup_steps"),
        ({"warmup_steps": np.int64(2)}, ASSERT, "warmup_steps"),
        ({"warmup_steps": -1}, ARG, "warmup_steps"),
        ({"warmup_begin_lr": 0.5}, ARG, "warmup_begin_lr"),
        ({"warmup_mode": "cosine"}, ARG, "warmup_mode"),
        # MXNet's order: the type of warmup_steps, warmup_begin_lr, warmup_steps, warmup_mode.
        ({"warmup_steps": -1, "warmup_begin_lr": 0.5}, ARG, "warmup_begin_lr"),
        ({"warmup_steps": 0.5, "warmup_mode": "x"}, ASSERT, "warmup_steps"),
    ],
)
def test_the_base_refusals_in_mxnets_order(kwargs, error, argument):
    with pytest.raises(error) as info:
        lrs.LRScheduler(**kwargs)
    message = str(info.value)
    assert message.startswith(f"LRScheduler: {argument} expected"), message
    assert f"given {kwargs[argument]!r}" in message or f"{kwargs[argument]!r}" in message


def test_warmup_steps_may_be_a_bool_as_in_mxnet():
    assert lrs.LRScheduler(base_lr=1.0, warmup_steps=True).get_warmup_lr(0) == 0.0


@pytest.mark.parametrize(
    ("cls", "kwargs", "error", "needle"),
    [
        (lrs.FactorScheduler, {"step": 0}, ARG, "step expected at least 1, given 0"),
        (lrs.FactorScheduler, {"step": 0.99}, ARG, "given 0.99"),
        (lrs.FactorScheduler, {"step": 1, "factor": 1.01}, ARG, "factor expected at most 1"),
        (lrs.FactorScheduler, {"step": 0, "factor": 2}, ARG, "step expected"),
        (lrs.FactorScheduler, {"step": 0, "warmup_steps": -1}, ARG, "warmup_steps expected"),
        (lrs.MultiFactorScheduler, {"step": (1, 2)}, ASSERT, "non-empty list, given tuple"),
        (lrs.MultiFactorScheduler, {"step": []}, ASSERT, "given list []"),
        (lrs.MultiFactorScheduler, {"step": 3}, ASSERT, "given int 3"),
        (lrs.MultiFactorScheduler, {"step": [2, 2]}, ARG, "strictly increasing"),
        (lrs.MultiFactorScheduler, {"step": [2, 0]}, ARG, "strictly increasing"),
        (lrs.MultiFactorScheduler, {"step": [0, 2]}, ARG, "step[0] is 0"),
        (lrs.MultiFactorScheduler, {"step": [1], "factor": 3}, ARG, "factor expected"),
        (lrs.PolyScheduler, {"max_update": 10.0}, ASSERT, "an int, given float 10.0"),
        (lrs.PolyScheduler, {"max_update": 0}, ARG, "max_update expected at least 1, given 0"),
        (lrs.CosineScheduler, {"max_update": np.int32(5)}, ASSERT, "max_update expected an int"),
        (lrs.CosineScheduler, {"max_update": -1}, ARG, "given -1"),
        (lrs.CosineScheduler, {"max_update": 0.5, "warmup_mode": "x"}, ARG, "warmup_mode"),
    ],
)
def test_the_schedulers_refusals(cls, kwargs, error, needle):
    with pytest.raises(error) as info:
        cls(**kwargs)
    assert needle in str(info.value)


def test_get_warmup_lr_refuses_past_the_warmup_and_a_changed_mode():
    sched = lrs.LRScheduler(base_lr=1.0, warmup_steps=2)
    with pytest.raises(lrs.SchedulerAssertionError, match=r"less than warmup_steps \(2\), given 2"):
        sched.get_warmup_lr(2)
    sched.warmup_mode = "cosine"
    with pytest.raises(lrs.SchedulerArgumentError, match="given 'cosine'"):
        sched.get_warmup_lr(1)


def test_the_base_class_call_is_for_subclasses():
    with pytest.raises(NotImplementedError, match=r"define __call__\(self, num_update\)"):
        lrs.LRScheduler()(0)


def test_a_subclass_keeps_the_base_state():
    class Constant(lrs.LRScheduler):
        def __call__(self, num_update):
            return (
                self.get_warmup_lr(num_update) if num_update < self.warmup_steps else self.base_lr
            )

    sched = Constant(base_lr=0.3, warmup_steps=3, warmup_begin_lr=0.0, warmup_mode="constant")
    assert [sched(n) for n in range(5)] == [0.0, 0.0, 0.0, 0.3, 0.3]
    assert vars(sched) == {
        "base_lr": 0.3,
        "warmup_steps": 3,
        "warmup_final_lr": 0.3,
        "warmup_begin_lr": 0.0,
        "warmup_mode": "constant",
    }
