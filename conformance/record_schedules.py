"""Records Apache MXNet 1.9.1's ``mx.lr_scheduler``: the learning rates jaxkv must give.

Run with MXNet's own venv (no JAX there; it needs no network, and takes a second):

    "$(bash conformance/setup_mxnet.sh)" conformance/record_schedules.py
    # or: .venv-mxnet/bin/python conformance/record_schedules.py

It writes conformance/data/mxnet_schedules.json, which tests/test_mx_lr_scheduler.py reads:

- ``signatures``: each class's constructor parameters (name, kind, default as ``repr``).
- ``schedules``: for each configuration (a class and keyword arguments), one fresh scheduler
  per sequence of ``num_update`` values: ``monotonic`` (0, 1, 2, ... past the end of the
  schedule), ``mixed`` (jumps forward and back, repeats, a negative one) and ``late`` (starting
  far past the schedule's end, then going back). For every call: what it returned, or what it
  raised, and the messages MXNet logged (at ``INFO``, on the root logger) during it. After the
  sequence: the scheduler's attributes (``vars``), since FactorScheduler and
  MultiFactorScheduler, and PolyScheduler and CosineScheduler too, change their state as they
  are called.
- ``warmup``: ``LRScheduler.get_warmup_lr`` of the base class, linear and constant.
- ``refusals``: constructor arguments MXNet refuses, with the exception's type name and
  message (several bad arguments at once too: which check comes first decides the type).
- ``call_refusals``: calls that raise (``get_warmup_lr`` past the warm-up, the base class's
  ``__call__``, a warm-up mode changed after construction, a decay of zero steps, a negative
  ``num_update`` with no warm-up: a linear warm-up of zero steps).

Every returned value is written as its ``repr``: for a float, the shortest decimal that reads
back to the same float64, so a test compares bits (``float(text) == value``); ``repr`` also
tells an ``int`` (MXNet returns ``0``, not ``0.0``, where its integer defaults pass through)
from a ``float``.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import sys

import mxnet as mx

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "data", "mxnet_schedules.json")
LRS = mx.lr_scheduler
CLASSES = ("LRScheduler", "FactorScheduler", "MultiFactorScheduler", "PolyScheduler",
           "CosineScheduler")  # fmt: skip

# name, class, keyword arguments.
SCHEDULES = [
    ("factor_default", "FactorScheduler", {"step": 5}),
    ("factor_half", "FactorScheduler", {"step": 10, "factor": 0.5, "base_lr": 1.0}),
    (
        "factor_stop",
        "FactorScheduler",
        {"step": 2, "factor": 0.1, "stop_factor_lr": 1e-3, "base_lr": 1.0},
    ),
    ("factor_stop_default", "FactorScheduler", {"step": 1, "factor": 0.1}),
    ("factor_zero", "FactorScheduler", {"step": 4, "factor": 0, "base_lr": 0.5}),
    ("factor_float_step", "FactorScheduler", {"step": 2.5, "factor": 0.7, "base_lr": 0.3}),
    ("factor_int_lr", "FactorScheduler", {"step": 3, "base_lr": 1}),
    (
        "factor_constant_no_warmup",
        "FactorScheduler",
        {"step": 3, "factor": 0.5, "warmup_mode": "constant"},
    ),
    (
        "factor_warmup_linear",
        "FactorScheduler",
        {"step": 3, "factor": 0.9, "base_lr": 0.1, "warmup_steps": 5, "warmup_begin_lr": 0.01},
    ),
    (
        "factor_warmup_constant",
        "FactorScheduler",
        {
            "step": 4,
            "factor": 0.75,
            "base_lr": 0.2,
            "warmup_steps": 6,
            "warmup_begin_lr": 0.02,
            "warmup_mode": "constant",
        },
    ),
    (
        "factor_warmup_stop",
        "FactorScheduler",
        {
            "step": 2,
            "factor": 0.3,
            "stop_factor_lr": 0.004,
            "base_lr": 0.7,
            "warmup_steps": 3,
            "warmup_begin_lr": 0.1,
        },
    ),
    ("multi_one", "MultiFactorScheduler", {"step": [1]}),
    ("multi_steps", "MultiFactorScheduler", {"step": [5, 10, 20], "factor": 0.5, "base_lr": 1.0}),
    (
        "multi_many",
        "MultiFactorScheduler",
        {"step": [1, 2, 3, 7, 11, 13, 29], "factor": 0.3, "base_lr": 0.9},
    ),
    (
        "multi_warmup_linear",
        "MultiFactorScheduler",
        {
            "step": [4, 8, 15],
            "factor": 0.1,
            "base_lr": 0.3,
            "warmup_steps": 6,
            "warmup_begin_lr": 0.05,
        },
    ),
    (
        "multi_warmup_constant",
        "MultiFactorScheduler",
        {
            "step": [9, 18],
            "factor": 0.25,
            "base_lr": 0.04,
            "warmup_steps": 7,
            "warmup_begin_lr": 0.001,
            "warmup_mode": "constant",
        },
    ),
    ("poly_default", "PolyScheduler", {"max_update": 20}),
    ("poly_pwr1", "PolyScheduler", {"max_update": 30, "base_lr": 0.1, "pwr": 1}),
    ("poly_pwr2_final", "PolyScheduler", {"max_update": 25, "base_lr": 0.5, "final_lr": 0.01}),
    (
        "poly_pwr1_final",
        "PolyScheduler",
        {"max_update": 17, "base_lr": 0.3, "pwr": 1, "final_lr": 0.003},
    ),
    ("poly_pwr_half", "PolyScheduler", {"max_update": 13, "base_lr": 0.7, "pwr": 0.5}),
    ("poly_pwr3_int_lr", "PolyScheduler", {"max_update": 9, "base_lr": 2, "pwr": 3}),
    (
        "poly_warmup_linear",
        "PolyScheduler",
        {
            "max_update": 30,
            "base_lr": 0.2,
            "pwr": 2,
            "final_lr": 0.001,
            "warmup_steps": 8,
            "warmup_begin_lr": 0.01,
        },
    ),
    (
        "poly_warmup_constant",
        "PolyScheduler",
        {"max_update": 24, "base_lr": 0.1, "pwr": 1, "warmup_steps": 5, "warmup_mode": "constant"},
    ),
    ("poly_warmup_bool", "PolyScheduler", {"max_update": 6, "base_lr": 0.5, "warmup_steps": True}),
    (
        "poly_warmup_past_end",
        "PolyScheduler",
        {"max_update": 10, "base_lr": 1.0, "warmup_steps": 12, "warmup_begin_lr": 0.1},
    ),
    (
        "poly_warmup_is_end",
        "PolyScheduler",
        {"max_update": 10, "base_lr": 1.0, "warmup_steps": 10},
    ),
    ("cosine_default", "CosineScheduler", {"max_update": 20}),
    ("cosine_final", "CosineScheduler", {"max_update": 33, "base_lr": 0.4, "final_lr": 0.02}),
    ("cosine_int_lr", "CosineScheduler", {"max_update": 7, "base_lr": 3, "final_lr": 1}),
    ("cosine_rising", "CosineScheduler", {"max_update": 11, "base_lr": 0.01, "final_lr": 0.1}),
    (
        "cosine_warmup_linear",
        "CosineScheduler",
        {
            "max_update": 35,
            "base_lr": 0.3,
            "final_lr": 0.003,
            "warmup_steps": 9,
            "warmup_begin_lr": 0.0001,
        },
    ),
    (
        "cosine_warmup_constant",
        "CosineScheduler",
        {
            "max_update": 21,
            "base_lr": 0.05,
            "warmup_steps": 4,
            "warmup_begin_lr": 0.005,
            "warmup_mode": "constant",
        },
    ),
    (
        "cosine_warmup_is_end",
        "CosineScheduler",
        {"max_update": 8, "base_lr": 0.2, "warmup_steps": 8},
    ),
]

# The sequences of num_update each configuration is called with (a fresh scheduler each).
SEQUENCES = {
    "monotonic": list(range(0, 42)),
    "mixed": [0, 3, 3, 27, 9, 50, 2, 14, 100, 1, 0, -1, 21, 22, 6, 40, 11, 11, 35, 5],
    "late": [250, 12, 250, 4, 0, 30],
}

# The base class's get_warmup_lr: keyword arguments, and the num_update values it is called with.
WARMUP = [
    ("linear", {"base_lr": 0.1, "warmup_steps": 7, "warmup_begin_lr": 0.003}, range(-2, 7)),
    ("linear_from_zero", {"base_lr": 0.3, "warmup_steps": 11}, range(0, 11)),
    ("linear_int", {"base_lr": 3, "warmup_steps": 4, "warmup_begin_lr": 1}, range(0, 4)),
    (
        "constant",
        {"base_lr": 0.6, "warmup_steps": 5, "warmup_begin_lr": 0.2, "warmup_mode": "constant"},
        range(-1, 5),
    ),
    ("constant_default", {"warmup_steps": 3, "warmup_mode": "constant"}, range(0, 3)),
]

# Constructor arguments MXNet refuses: class, keyword arguments.
REFUSALS = [
    ("LRScheduler", {"warmup_steps": 2.0}),
    ("LRScheduler", {"warmup_steps": "3"}),
    ("LRScheduler", {"warmup_steps": None}),
    ("LRScheduler", {"warmup_steps": -1}),
    ("LRScheduler", {"base_lr": 0.01, "warmup_begin_lr": 0.02}),
    ("LRScheduler", {"warmup_mode": "cosine"}),
    ("LRScheduler", {"warmup_mode": "Linear"}),
    ("LRScheduler", {"warmup_steps": -1, "warmup_begin_lr": 1.0}),
    ("LRScheduler", {"warmup_steps": -1, "warmup_mode": "cosine"}),
    ("LRScheduler", {"warmup_steps": 1.5, "warmup_begin_lr": 1.0}),
    ("FactorScheduler", {"step": 0}),
    ("FactorScheduler", {"step": 0.5}),
    ("FactorScheduler", {"step": -3}),
    ("FactorScheduler", {"step": 2, "factor": 1.5}),
    ("FactorScheduler", {"step": 2, "factor": 1.0000001}),
    ("FactorScheduler", {"step": 0, "factor": 2}),
    ("FactorScheduler", {"step": 0, "warmup_steps": -2}),
    ("FactorScheduler", {"step": 0, "warmup_steps": 2.0}),
    ("FactorScheduler", {"step": 3, "base_lr": 0.1, "warmup_begin_lr": 0.5}),
    ("MultiFactorScheduler", {"step": 5}),
    ("MultiFactorScheduler", {"step": (1, 2)}),
    ("MultiFactorScheduler", {"step": []}),
    ("MultiFactorScheduler", {"step": [3, 3]}),
    ("MultiFactorScheduler", {"step": [5, 2]}),
    ("MultiFactorScheduler", {"step": [0, 2]}),
    ("MultiFactorScheduler", {"step": [2, 0]}),
    ("MultiFactorScheduler", {"step": [-4, -2]}),
    ("MultiFactorScheduler", {"step": [1, 4], "factor": 2}),
    ("MultiFactorScheduler", {"step": [0], "factor": 2}),
    ("MultiFactorScheduler", {"step": (1, 2), "warmup_mode": "cosine"}),
    ("PolyScheduler", {"max_update": 10.0}),
    ("PolyScheduler", {"max_update": 0}),
    ("PolyScheduler", {"max_update": -5}),
    ("PolyScheduler", {"max_update": 0.0, "warmup_steps": -1}),
    ("PolyScheduler", {"max_update": 10, "warmup_mode": "exp"}),
    ("CosineScheduler", {"max_update": "10"}),
    ("CosineScheduler", {"max_update": 0}),
    ("CosineScheduler", {"max_update": -1}),
    ("CosineScheduler", {"max_update": 10, "base_lr": 0.1, "warmup_begin_lr": 0.2}),
    ("CosineScheduler", {"max_update": 0, "warmup_steps": 3.0}),
]


def log(*args: object) -> None:
    print(*args, file=sys.stderr, flush=True)


class Captured(logging.Handler):
    """Keeps the messages logged while a call runs."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.messages: list[list[str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append([record.levelname, record.getMessage()])


CAPTURED = Captured()


def outcome(call) -> dict:
    """What ``call()`` returned (as ``repr``) or raised, and what it logged."""
    CAPTURED.messages = []
    try:
        result = {"value": repr(call())}
    except Exception as e:  # noqa: BLE001 - every outcome is recorded
        result = {"raises": type(e).__name__, "message": str(e)}
    result["logged"] = CAPTURED.messages
    return result


def attributes(obj: object) -> dict:
    return {name: repr(value) for name, value in sorted(vars(obj).items())}


def signatures() -> dict:
    out = {}
    for name in CLASSES:
        params = inspect.signature(getattr(LRS, name)).parameters.values()
        out[name] = [
            [p.name, p.kind.name, None if p.default is p.empty else repr(p.default)] for p in params
        ]
    return out


def record_schedules() -> list:
    cases = []
    for name, cls, kwargs in SCHEDULES:
        runs = {}
        for seq_name, seq in SEQUENCES.items():
            sched = getattr(LRS, cls)(**kwargs)
            calls = [outcome(lambda n=n, s=sched: s(n)) for n in seq]
            runs[seq_name] = {"num_update": seq, "calls": calls, "after": attributes(sched)}
        cases.append({"name": name, "class": cls, "kwargs": kwargs, "runs": runs})
    return cases


def record_warmup() -> list:
    cases = []
    for name, kwargs, nums in WARMUP:
        sched = LRS.LRScheduler(**kwargs)
        calls = [outcome(lambda n=n, s=sched: s.get_warmup_lr(n)) for n in nums]
        cases.append({"name": name, "kwargs": kwargs, "num_update": list(nums), "calls": calls})
    return cases


def record_refusals() -> list:
    cases = []
    for cls, kwargs in REFUSALS:
        got = outcome(lambda cls=cls, kwargs=kwargs: getattr(LRS, cls)(**kwargs))
        if "raises" not in got:
            raise SystemExit(f"MXNet accepted {cls}({kwargs}): not a refusal")
        # Tuples are not JSON: the test rebuilds them from "tuple_args".
        shown = {k: list(v) if isinstance(v, tuple) else v for k, v in kwargs.items()}
        tuples = sorted(k for k, v in kwargs.items() if isinstance(v, tuple))
        cases.append(
            {
                "class": cls,
                "kwargs": shown,
                "tuple_args": tuples,
                "raises": got["raises"],
                "message": got["message"],
            }  # fmt: skip
        )
    return cases


def record_call_refusals() -> list:
    def changed_mode():
        sched = LRS.LRScheduler(base_lr=0.1, warmup_steps=4)
        sched.warmup_mode = "cosine"
        return sched.get_warmup_lr(1)

    calls = [
        ("get_warmup_lr_at_end", lambda: LRS.LRScheduler(warmup_steps=3).get_warmup_lr(3)),
        ("get_warmup_lr_past_end", lambda: LRS.LRScheduler(warmup_steps=3).get_warmup_lr(9)),
        ("get_warmup_lr_no_warmup", lambda: LRS.LRScheduler().get_warmup_lr(0)),
        ("base_call", lambda: LRS.LRScheduler()(1)),
        ("warmup_mode_changed", changed_mode),
        ("poly_zero_steps", lambda: LRS.PolyScheduler(5, warmup_steps=5)(5)),
        ("cosine_zero_steps", lambda: LRS.CosineScheduler(5, warmup_steps=5)(5)),
        ("negative_no_warmup", lambda: LRS.FactorScheduler(step=2)(-1)),
    ]
    cases = []
    for name, call in calls:
        got = outcome(call)
        if "raises" not in got:
            raise SystemExit(f"{name}: MXNet did not raise")
        cases.append({"name": name, "raises": got["raises"], "message": got["message"]})
    return cases


def main() -> None:
    root = logging.getLogger()
    root.addHandler(CAPTURED)  # before MXNet's first logging.info, so no basicConfig
    root.setLevel(logging.INFO)
    doc = {
        "generated_by": "conformance/record_schedules.py",
        "mxnet_version": mx.__version__,
        "python_version": sys.version.split()[0],
        "signatures": signatures(),
        "schedules": record_schedules(),
        "warmup": record_warmup(),
        "refusals": record_refusals(),
        "call_refusals": record_call_refusals(),
    }
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
        f.write("\n")
    calls = sum(len(r["calls"]) for c in doc["schedules"] for r in c["runs"].values())
    log(
        f"wrote {OUT} ({os.path.getsize(OUT)} bytes): {len(doc['schedules'])} schedules, "
        f"{calls} calls, {len(doc['refusals'])} refusals"
    )


if __name__ == "__main__":
    main()
