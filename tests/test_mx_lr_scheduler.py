"""``jaxkv.mx.lr_scheduler``: MXNet 1.9.1's learning-rate schedulers, the same floats and state.

The expected outcomes were recorded from Apache MXNet 1.9.1 by conformance/record_schedules.py
(conformance/data/mxnet_schedules.json): every scheduler configuration called with monotonic,
mixed (forward and back) and late sequences of ``num_update``, a fresh scheduler per sequence.
Every call must return the recorded value exactly (``==`` and the same ``repr``: the same
float64 bits, and an ``int`` where MXNet returns one) or raise where MXNet raised (a
``KVStoreError`` deriving from MXNet's exception type), log the same messages, and leave the
scheduler with the same attributes. Constructor refusals must raise the recorded builtin type
(as a ``KVStoreError``) with a message naming the argument MXNet's check is about.
"""

from __future__ import annotations

import builtins
import inspect
import json
import logging
from pathlib import Path

import pytest

import jaxkv
import jaxkv.mx as mx
from jaxkv._src.mxnet.optimizers import lr_scheduler as _lrs
from jaxkv.mx import lr_scheduler

DATA = json.loads(
    (Path(__file__).parent.parent / "conformance" / "data" / "mxnet_schedules.json").read_text()
)
LOGGER = "jaxkv._src.mxnet.optimizers.lr_scheduler"
RUNS = [
    pytest.param(case, seq, id=f"{case['name']}-{seq}")
    for case in DATA["schedules"]
    for seq in case["runs"]
]

# MXNet's refusal messages, and the argument each is about (our message must name it).
ARGUMENT_OF = {
    "Base lr has to be higher than warmup_begin_lr": "warmup_begin_lr",
    "Warmup steps has to be positive or 0": "warmup_steps",
    "Supports only linear and constant modes of warmup": "warmup_mode",
    "Schedule step must be greater or equal than 1 round": "step",
    "Schedule step must be an increasing integer list": "step",
    "Factor must be no more than 1 to make lr reduce": "factor",
    "maximum number of updates must be strictly positive": "max_update",
}


class Logged(logging.Handler):
    """The messages this module logs during one call, as MXNet's recording holds them."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.messages: list[list[str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append([record.levelname, record.getMessage()])


@pytest.fixture
def logged():
    handler, logger = Logged(), logging.getLogger(LOGGER)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def outcome(call, logged: Logged) -> dict:
    """What ``call()`` returned (as ``repr``) or raised, and what it logged: the recording's
    format. A raise must be a ``KVStoreError``; it is recorded as the builtin it derives from."""
    logged.messages = []
    try:
        result = {"value": repr(call())}
    except jaxkv.KVStoreError as e:
        builtin = next(c for c in type(e).__mro__ if c.__module__ == "builtins" and c is not object)
        result = {"raises": builtin.__name__}
    result["logged"] = logged.messages
    return result


def attributes(obj: object) -> dict:
    return {name: repr(value) for name, value in sorted(vars(obj).items())}


@pytest.mark.parametrize("name", sorted(DATA["signatures"]))
def test_constructors_take_mxnets_arguments_and_defaults(name):
    params = inspect.signature(getattr(lr_scheduler, name)).parameters.values()
    got = [[p.name, p.kind.name, None if p.default is p.empty else repr(p.default)] for p in params]
    assert got == DATA["signatures"][name]


@pytest.mark.parametrize(("case", "seq"), RUNS)
def test_every_call_gives_mxnets_value_logs_and_state(case, seq, logged):
    run = case["runs"][seq]
    sched = getattr(lr_scheduler, case["class"])(**case["kwargs"])
    for n, want in zip(run["num_update"], run["calls"], strict=True):
        got = outcome(lambda n=n: sched(n), logged)
        assert got == {k: v for k, v in want.items() if k != "message"}, n
        if "value" in want:  # the same repr is the same float64; == says it once more
            assert float(got["value"]) == float(want["value"]), n
    assert attributes(sched) == run["after"]


@pytest.mark.parametrize("case", DATA["warmup"], ids=lambda c: c["name"])
def test_the_warmup_gives_mxnets_values(case, logged):
    sched = lr_scheduler.LRScheduler(**case["kwargs"])
    for n, want in zip(case["num_update"], case["calls"], strict=True):
        got = outcome(lambda n=n: sched.get_warmup_lr(n), logged)
        assert got == want, n
        assert float(got["value"]) == float(want["value"])


@pytest.mark.parametrize(
    "case", DATA["refusals"], ids=lambda c: f"{c['class']}-{json.dumps(c['kwargs'])}"
)
def test_constructors_refuse_what_mxnet_refuses(case):
    kwargs = {k: tuple(v) if k in case["tuple_args"] else v for k, v in case["kwargs"].items()}
    with pytest.raises(jaxkv.KVStoreError) as info:
        getattr(lr_scheduler, case["class"])(**kwargs)
    assert isinstance(info.value, getattr(builtins, case["raises"]))
    if case["raises"] == "AssertionError":  # MXNet's assert on a type says nothing
        steps = kwargs.get("warmup_steps", 0)
        argument = "warmup_steps" if not isinstance(steps, int) else None
        argument = argument or ("step" if case["class"] == "MultiFactorScheduler" else "max_update")
    else:
        argument = ARGUMENT_OF[case["message"]]
    message = str(info.value)
    assert f" {argument} expected" in message, message
    assert "given" in message, message


def _changed_mode():
    sched = lr_scheduler.LRScheduler(base_lr=0.1, warmup_steps=4)
    sched.warmup_mode = "cosine"
    return sched.get_warmup_lr(1)


CALLS = {
    "get_warmup_lr_at_end": lambda: lr_scheduler.LRScheduler(warmup_steps=3).get_warmup_lr(3),
    "get_warmup_lr_past_end": lambda: lr_scheduler.LRScheduler(warmup_steps=3).get_warmup_lr(9),
    "get_warmup_lr_no_warmup": lambda: lr_scheduler.LRScheduler().get_warmup_lr(0),
    "base_call": lambda: lr_scheduler.LRScheduler()(1),
    "warmup_mode_changed": _changed_mode,
    "poly_zero_steps": lambda: lr_scheduler.PolyScheduler(5, warmup_steps=5)(5),
    "cosine_zero_steps": lambda: lr_scheduler.CosineScheduler(5, warmup_steps=5)(5),
    "negative_no_warmup": lambda: lr_scheduler.FactorScheduler(step=2)(-1),
}


@pytest.mark.parametrize("case", DATA["call_refusals"], ids=lambda c: c["name"])
def test_calls_raise_where_mxnet_raises(case):
    with pytest.raises(getattr(builtins, case["raises"])) as info:
        CALLS[case["name"]]()
    # The abstract __call__ is no refusal of an input: a plain NotImplementedError, as MXNet's.
    assert isinstance(info.value, jaxkv.KVStoreError) == (case["name"] != "base_call")


def test_factor_schedulers_keep_mxnets_state_between_calls(logged):
    """FactorScheduler and MultiFactorScheduler lower base_lr as they go and never raise it."""
    for name in ("factor_stop", "factor_warmup_linear", "multi_steps", "multi_warmup_linear"):
        case = next(c for c in DATA["schedules"] if c["name"] == name)
        run = case["runs"]["mixed"]
        sched = getattr(lr_scheduler, case["class"])(**case["kwargs"])
        for n in run["num_update"]:
            if n >= 0:  # -1 with no warm-up divides by zero (test above)
                sched(n)
        assert repr(sched.base_lr) == run["after"]["base_lr"], name
        assert repr(sched.count) == run["after"]["count"], name
        # A later, smaller num_update (past the warm-up) returns the learning rate reached.
        n = case["kwargs"].get("warmup_steps", 0)
        assert sched(n) == float(run["after"]["base_lr"]), name


def test_a_user_subclass_schedules_with_the_base_classs_warmup():
    class Step(lr_scheduler.LRScheduler):
        def __init__(self, every, **kwargs):
            super().__init__(**kwargs)
            self.every = every

        def __call__(self, num_update):
            if num_update < self.warmup_steps:
                return self.get_warmup_lr(num_update)
            return self.base_lr * 0.1 ** (num_update // self.every)

    sched = Step(10, base_lr=1.0, warmup_steps=4, warmup_begin_lr=0.2)
    # MXNet 1.9.1's LRScheduler(base_lr=1.0, warmup_steps=4, warmup_begin_lr=0.2) gives these.
    assert [sched(n) for n in range(4)] == [0.2, 0.4, 0.6000000000000001, 0.8]
    assert [sched(n) for n in (4, 10, 25)] == [1.0, 0.1, 1.0 * 0.1**2]
    assert isinstance(sched, lr_scheduler.LRScheduler)
    with pytest.raises(jaxkv.KVStoreError, match="warmup_mode"):
        Step(10, warmup_mode="cosine")


def test_the_face_forwards_the_implementation():
    assert mx.lr_scheduler is lr_scheduler
    assert lr_scheduler.__all__ == _lrs.__all__
    for name in lr_scheduler.__all__:
        assert getattr(lr_scheduler, name) is getattr(_lrs, name)
    assert set(DATA["signatures"]) <= set(lr_scheduler.__all__)
