"""MXNet 1.9.1's learning-rate schedulers (``mx.lr_scheduler``): its numbers, state and refusals.

A scheduler is called with ``num_update``, the number of updates so far, and returns the
learning rate for it: :class:`FactorScheduler` (times ``factor`` every ``step`` updates),
:class:`MultiFactorScheduler` (times ``factor`` at each update listed), :class:`PolyScheduler`
(a polynomial decay to ``final_lr``) and :class:`CosineScheduler` (half a cosine down to
``final_lr``), each with an optional warm-up (:meth:`LRScheduler.get_warmup_lr`). Subclass
:class:`LRScheduler` and define ``__call__(self, num_update)`` to write your own.

These are plain Python, as MXNet's are: the same float64 operations in the same order (so the
same floats, bit for bit: ``tests/test_mx_lr_scheduler.py`` checks them against MXNet's own,
recorded by ``conformance/record_schedules.py``), the same attributes, and the same state.
Every scheduler keeps its last learning rate in ``base_lr``, and the first two count as they
go, which makes them depend on the order of the calls:

- :class:`FactorScheduler` and :class:`MultiFactorScheduler` only ever decrease ``base_lr``:
  a call with a smaller ``num_update`` than an earlier one returns the learning rate already
  reached, and a jump forward applies every decay in between (one loop turn, and one log
  message, per ``step``).
- :class:`PolyScheduler` and :class:`CosineScheduler` recompute ``base_lr`` for any
  ``num_update`` up to ``max_update``, and past it return the last one computed: past
  ``max_update`` their first call returns the initial ``base_lr``, not ``final_lr``.
- During the warm-up (``num_update < warmup_steps``) every scheduler returns the warm-up rate
  and changes nothing. The warm-up ends at the ``base_lr`` given to the constructor
  (``warmup_final_lr``), whatever ``base_lr`` has become since. A negative ``num_update``
  counts as a warm-up step: the warm-up's line goes on below ``warmup_begin_lr``, and with no
  warm-up (in the default linear mode) MXNet divides by zero (here
  :class:`SchedulerZeroDivisionError`, a ``ZeroDivisionError``).

MXNet's refusals are kept: where its constructors raise ``ValueError`` or fail an ``assert``,
these raise ``SchedulerArgumentError`` (a ``ValueError``) or
:class:`SchedulerAssertionError` (an ``AssertionError``), both ``jaxkv.KVStoreError``, naming
the argument, what was expected and what was given. The checks run in MXNet's order, so several
bad arguments give the error MXNet gives; unlike MXNet's ``assert``, they run under
``python -O`` too. A NaN or infinite rate (``base_lr``, ``warmup_begin_lr``, ``final_lr``,
``factor``, ``stop_factor_lr``, ``pwr``), which MXNet takes, is refused too
(``SchedulerArgumentError``), after MXNet's own checks: it would give a NaN or infinite
learning rate. Messages MXNet logs with ``logging.info`` go to this module's logger
(``logging.getLogger("jaxkv._src.mxnet.optimizers.lr_scheduler")``), at ``INFO``.
"""

from __future__ import annotations

import logging
import math
from typing import ClassVar

import jax
import numpy as np

from jaxkv._src.errors import KVStoreError

__all__ = [
    "CosineScheduler",
    "FactorScheduler",
    "LRScheduler",
    "MultiFactorScheduler",
    "PolyScheduler",
    "SchedulerArgumentError",
    "SchedulerAssertionError",
    "SchedulerZeroDivisionError",
]

_LOG = logging.getLogger(__name__)
_WARMUP_MODES = ("linear", "constant")


class SchedulerArgumentError(KVStoreError, ValueError):
    """An argument MXNet's scheduler refuses with ``ValueError``: a value out of its range; or
    one jaxkv refuses where MXNet takes it: a NaN or infinite rate."""


class SchedulerAssertionError(KVStoreError, AssertionError):
    """An argument MXNet's scheduler refuses with a failed ``assert``: ``warmup_steps`` or
    ``max_update`` not an ``int``, ``step`` not a non-empty list; or ``get_warmup_lr`` called
    past the warm-up."""


class SchedulerZeroDivisionError(KVStoreError, ZeroDivisionError):
    """A call where MXNet divides by zero: a negative ``num_update`` with no warm-up (a
    linear warm-up of no steps), or a :class:`PolyScheduler` or :class:`CosineScheduler` whose
    warm-up lasts until ``max_update`` called at ``max_update`` (a decay of no steps)."""


# Magnitudes from here up round to infinity in float32 (half-way to 2**128, the tie to even).
FLOAT32_OVERFLOW = 2.0**128 - 2.0**103


def nonfinite(value: object, float32: bool = False) -> bool:
    """Whether ``value`` is a concrete number (or array of numbers) that is NaN or infinite, or
    with ``float32`` whose float32 value (as an update takes it) is; a traced value, or
    anything that is not a number, is not looked at (``False``)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int | float):
        try:
            x = float(value)
        except OverflowError:  # an int beyond every float
            return True
        return not (abs(x) < FLOAT32_OVERFLOW if float32 else math.isfinite(x))
    if isinstance(value, jax.core.Tracer):
        return False
    try:
        a = np.asarray(value)
    except (TypeError, ValueError):
        return False
    if a.dtype.kind not in "fc":
        return False
    a = np.abs(a.astype(np.complex128 if a.dtype.kind == "c" else np.float64))
    return not bool((a < FLOAT32_OVERFLOW).all() if float32 else np.isfinite(a).all())


def finite(
    error: type[KVStoreError], owner: str, name: str, value: object, float32: bool = False
) -> None:
    """Refuse a NaN or infinite ``value`` of the rate ``name`` (with ``float32``: one whose
    float32 value is) with ``error``, naming the owner, the argument, what is expected and
    what was given; anything else passes."""
    if nonfinite(value, float32):
        in32 = "" if nonfinite(value) else ", infinite in float32 as the update takes it"
        raise error(
            f"{owner}: {name} expected a finite number, given {value!r}{in32} (jaxkv refuses "
            "a NaN or infinite rate when it is set, where MXNet 1.9.1 takes it: see "
            "docs/migrating-from-mxnet.md)"
        )


class LRScheduler:
    """Base class of the learning-rate schedulers: a warm-up, and ``__call__`` to override.

    A subclass defines ``__call__(self, num_update)``, returning the learning rate after
    ``num_update`` updates (the largest number of updates applied to any weight); it may call
    :meth:`get_warmup_lr` while ``num_update < self.warmup_steps``, as MXNet's schedulers do.

    Args:
      base_lr: the learning rate (where the warm-up ends; ``warmup_final_lr`` keeps it).
      warmup_steps: the number of updates of the warm-up, an ``int`` (``0``: none).
      warmup_begin_lr: the learning rate the warm-up starts from, at most ``base_lr``.
      warmup_mode: ``'linear'`` (from ``warmup_begin_lr`` to ``base_lr`` in equal increments)
        or ``'constant'`` (``warmup_begin_lr`` throughout the warm-up).

    Raises:
      KVStoreError: (``SchedulerAssertionError``, an ``AssertionError``) ``warmup_steps`` is
        not an ``int``; (``SchedulerArgumentError``, a ``ValueError``) ``warmup_begin_lr`` is
        larger than ``base_lr``, ``warmup_steps`` is negative, or ``warmup_mode`` is another
        string. In this order, MXNet's. Then (``SchedulerArgumentError``, jaxkv's own)
        ``base_lr`` or ``warmup_begin_lr`` is NaN or infinite, or a linear warm-up between them
        would compute an infinite rate (their difference overflows); a subclass's own
        arguments are checked before these.

    Examples:
      >>> from jaxkv.mx import lr_scheduler
      >>> class Halving(lr_scheduler.LRScheduler):
      ...     def __call__(self, num_update):
      ...         if num_update < self.warmup_steps:
      ...             return self.get_warmup_lr(num_update)
      ...         return self.base_lr * 0.5 ** (num_update // 10)
      >>> sched = Halving(base_lr=0.4, warmup_steps=2, warmup_begin_lr=0.1)
      >>> [sched(n) for n in (0, 1, 2, 10, 25)]
      [0.1, 0.25, 0.4, 0.2, 0.1]
    """

    # Whether the subclass's constructor calls refuse_nonfinite itself, after its own checks
    # (MXNet's order: the built-in schedules do); otherwise the constructor here does.
    checks_rates: ClassVar[bool] = False

    def __init__(
        self,
        base_lr: float = 0.01,
        warmup_steps: int = 0,
        warmup_begin_lr: float = 0,
        warmup_mode: str = "linear",
    ) -> None:
        owner = type(self).__name__
        self.base_lr = base_lr
        if not isinstance(warmup_steps, int):
            raise SchedulerAssertionError(
                f"{owner}: warmup_steps expected an int, given "
                f"{type(warmup_steps).__name__} {warmup_steps!r}"
            )
        self.warmup_steps = warmup_steps
        self.warmup_final_lr = base_lr
        self.warmup_begin_lr = warmup_begin_lr
        if self.warmup_begin_lr > self.warmup_final_lr:
            raise SchedulerArgumentError(
                f"{owner}: warmup_begin_lr expected at most base_lr ({base_lr!r}), given "
                f"{warmup_begin_lr!r}"
            )
        if self.warmup_steps < 0:
            raise SchedulerArgumentError(
                f"{owner}: warmup_steps expected 0 or more, given {warmup_steps!r}"
            )
        if warmup_mode not in _WARMUP_MODES:
            raise SchedulerArgumentError(
                f"{owner}: warmup_mode expected 'linear' or 'constant', given {warmup_mode!r}"
            )
        self.warmup_mode = warmup_mode
        if not self.checks_rates:
            self.refuse_nonfinite()

    def refuse_nonfinite(self, **rates: object) -> None:
        """Refuse a NaN or infinite ``base_lr``, ``warmup_begin_lr`` or ``rates`` (the
        subclass's own, by argument name; a learning rate also where its float32 value is
        infinite), and a linear warm-up whose ``(base_lr - warmup_begin_lr) * num_update``
        overflows (it would compute an infinite rate from finite ones), with
        ``SchedulerArgumentError``: jaxkv's own check, after MXNet's."""
        owner = type(self).__name__
        given = {"base_lr": self.warmup_final_lr, "warmup_begin_lr": self.warmup_begin_lr}
        for name, value in {**given, **rates}.items():
            # A learning rate as the update takes it (float32); a factor or power as is.
            lr = name.endswith("_lr")
            finite(SchedulerArgumentError, owner, name, value, float32=lr)
        if self.warmup_mode == "linear" and self.warmup_steps > 0:
            span, last = self.warmup_final_lr - self.warmup_begin_lr, self.warmup_steps - 1
            if nonfinite(last) or nonfinite(span * float(last)):
                raise SchedulerArgumentError(
                    f"{owner}: base_lr and warmup_begin_lr expected a difference the linear "
                    f"warm-up can scale by its warmup_steps, given {self.warmup_final_lr!r} and "
                    f"{self.warmup_begin_lr!r} over {len(str(self.warmup_steps))}-digit "
                    "warmup_steps: the warm-up's rate overflows to infinity"
                )

    def get_warmup_lr(self, num_update: int) -> float:
        """The learning rate of the warm-up after ``num_update`` updates.

        Args:
          num_update: the number of updates, less than ``warmup_steps``.

        Returns:
          ``'linear'``: ``warmup_begin_lr + (warmup_final_lr - warmup_begin_lr) * num_update
          / warmup_steps``; ``'constant'``: ``warmup_begin_lr`` (as given: ``0``, an ``int``,
          by default).

        Raises:
          KVStoreError: (``SchedulerAssertionError``) ``num_update`` is not less than
            ``warmup_steps``; (``SchedulerZeroDivisionError``) ``num_update`` is negative and
            ``warmup_steps`` is 0, in linear mode (every scheduler calls this method for a
            negative ``num_update`` when there is no warm-up); (``SchedulerArgumentError``)
            ``warmup_mode`` was changed to another string after construction.

        Examples:
          >>> from jaxkv.mx import lr_scheduler
          >>> sched = lr_scheduler.LRScheduler(base_lr=0.5, warmup_steps=4, warmup_begin_lr=0.1)
          >>> [sched.get_warmup_lr(n) for n in range(4)]
          [0.1, 0.2, 0.30000000000000004, 0.4]
        """
        owner = type(self).__name__
        if not num_update < self.warmup_steps:
            raise SchedulerAssertionError(
                f"{owner}.get_warmup_lr: num_update expected less than warmup_steps "
                f"({self.warmup_steps!r}), given {num_update!r}"
            )
        if self.warmup_mode == "linear":
            if self.warmup_steps == 0:
                raise SchedulerZeroDivisionError(
                    f"{owner}: num_update {num_update!r} is negative and warmup_steps is 0, so "
                    "the linear warm-up has no steps to divide by (MXNet 1.9.1 raises "
                    "ZeroDivisionError here too)"
                )
            span = self.warmup_final_lr - self.warmup_begin_lr
            increase = span * float(num_update) / float(self.warmup_steps)
            return self.warmup_begin_lr + increase
        if self.warmup_mode == "constant":
            return self.warmup_begin_lr
        raise SchedulerArgumentError(
            f"{owner}.get_warmup_lr: warmup_mode expected 'linear' or 'constant', given "
            f"{self.warmup_mode!r}"
        )

    def __call__(self, num_update: int) -> float:
        """The learning rate after ``num_update`` updates: a subclass defines it.

        Args:
          num_update: the largest number of updates applied to any weight so far.

        Returns:
          The learning rate.

        Raises:
          NotImplementedError: always, here.
        """
        raise NotImplementedError(
            f"{type(self).__name__}.__call__: a subclass of LRScheduler must define "
            "__call__(self, num_update)"
        )


def _no_factor_above_one(owner: str, factor: float) -> None:
    if factor > 1.0:
        raise SchedulerArgumentError(
            f"{owner}: factor expected at most 1 (the learning rate only decreases), given "
            f"{factor!r}"
        )


class FactorScheduler(LRScheduler):
    """Multiplies the learning rate by ``factor`` every ``step`` updates, down to a floor.

    After the warm-up, ``base_lr`` is multiplied by ``factor`` once for every ``step`` that
    ``count`` (which starts at 0) can advance while ``num_update > count + step``: the first
    decay comes at ``num_update == step + 1``, not at ``step``, and the warm-up's updates count
    too. A learning rate below ``stop_factor_lr`` becomes ``stop_factor_lr``. Each decay logs
    ``Update[num_update]: Change learning rate to ...`` (at the floor: ``... now learning rate
    arrived at ..., will not change in the future``). ``base_lr`` and ``count`` keep the
    decays: a later call with a smaller ``num_update`` returns the decayed learning rate.

    Args:
      step: the number of updates between decays, at least 1 (a float is taken).
      factor: the multiplier, at most 1.
      stop_factor_lr: the floor of the learning rate.
      base_lr: the initial learning rate.
      warmup_steps: as in :class:`LRScheduler`.
      warmup_begin_lr: as in :class:`LRScheduler`.
      warmup_mode: as in :class:`LRScheduler`.

    Raises:
      KVStoreError: :class:`LRScheduler`'s refusals, then (``SchedulerArgumentError``)
        ``step`` less than 1, then ``factor`` larger than 1; then a NaN or infinite rate
        (``factor``, ``stop_factor_lr`` too), as :class:`LRScheduler`.

    Examples:
      >>> from jaxkv.mx import lr_scheduler
      >>> sched = lr_scheduler.FactorScheduler(step=2, factor=0.5, base_lr=1.0)
      >>> [sched(n) for n in range(8)]
      [1.0, 1.0, 1.0, 0.5, 0.5, 0.25, 0.25, 0.125]
      >>> sched.base_lr, sched.count, sched(0)
      (0.125, 6, 0.125)
    """

    checks_rates: ClassVar[bool] = True

    def __init__(
        self,
        step: float,
        factor: float = 1,
        stop_factor_lr: float = 1e-8,
        base_lr: float = 0.01,
        warmup_steps: int = 0,
        warmup_begin_lr: float = 0,
        warmup_mode: str = "linear",
    ) -> None:
        super().__init__(base_lr, warmup_steps, warmup_begin_lr, warmup_mode)
        if step < 1:
            raise SchedulerArgumentError(
                f"FactorScheduler: step expected at least 1, given {step!r}"
            )
        _no_factor_above_one("FactorScheduler", factor)
        self.step = step
        self.factor = factor
        self.stop_factor_lr = stop_factor_lr
        self.count: float = 0
        self.refuse_nonfinite(factor=factor, stop_factor_lr=stop_factor_lr)

    def __call__(self, num_update: int) -> float:
        """The learning rate after ``num_update`` updates, applying the decays reached.

        Args:
          num_update: the number of updates.

        Returns:
          The warm-up's learning rate, or ``base_lr`` after the decays up to ``num_update``.
        """
        if num_update < self.warmup_steps:
            return self.get_warmup_lr(num_update)
        # A loop, not a test: a jump (training resumed at a later update) applies every decay.
        while num_update > self.count + self.step:
            self.count += self.step
            self.base_lr *= self.factor
            if self.base_lr < self.stop_factor_lr:
                self.base_lr = self.stop_factor_lr
                _LOG.info(
                    "Update[%d]: now learning rate arrived at %0.5e, will not change in the future",
                    num_update,
                    self.base_lr,
                )
            else:
                _LOG.info("Update[%d]: Change learning rate to %0.5e", num_update, self.base_lr)
        return self.base_lr


class MultiFactorScheduler(LRScheduler):
    """Multiplies the learning rate by ``factor`` after each update listed in ``step``.

    After the warm-up, ``base_lr`` is multiplied by ``factor`` for each listed update that
    ``num_update`` exceeds (``num_update > step[k]``: the decay at ``step[k]`` shows from
    ``step[k] + 1`` on), each logging ``Update[num_update]: Change learning rate to ...``.
    ``cur_step_ind`` (the decays applied) and ``count`` (the last listed update passed) keep
    them: a later call with a smaller ``num_update`` returns the decayed learning rate. The
    list is kept, not copied.

    Args:
      step: the updates after which to decay: a ``list`` (not a tuple), non-empty, strictly
        increasing, of values at least 1.
      factor: the multiplier, at most 1.
      base_lr: the initial learning rate.
      warmup_steps: as in :class:`LRScheduler`.
      warmup_begin_lr: as in :class:`LRScheduler`.
      warmup_mode: as in :class:`LRScheduler`.

    Raises:
      KVStoreError: :class:`LRScheduler`'s refusals, then (``SchedulerAssertionError``)
        ``step`` not a non-empty list, then (``SchedulerArgumentError``) from the first value
        on, one not larger than the one before it or less than 1, then ``factor`` larger
        than 1; then a NaN or infinite rate (``factor`` too), as :class:`LRScheduler`.

    Examples:
      >>> from jaxkv.mx import lr_scheduler
      >>> sched = lr_scheduler.MultiFactorScheduler(step=[2, 5], factor=0.1, base_lr=1.0)
      >>> [sched(n) for n in range(8)]
      [1.0, 1.0, 1.0, 0.1, 0.1, 0.1, 0.010000000000000002, 0.010000000000000002]
      >>> sched.cur_step_ind, sched.count
      (2, 5)
    """

    checks_rates: ClassVar[bool] = True

    def __init__(
        self,
        step: list[int],
        factor: float = 1,
        base_lr: float = 0.01,
        warmup_steps: int = 0,
        warmup_begin_lr: float = 0,
        warmup_mode: str = "linear",
    ) -> None:
        super().__init__(base_lr, warmup_steps, warmup_begin_lr, warmup_mode)
        owner = "MultiFactorScheduler"
        if not (isinstance(step, list) and len(step) >= 1):
            raise SchedulerAssertionError(
                f"{owner}: step expected a non-empty list, given {type(step).__name__} {step!r}"
            )
        for i, value in enumerate(step):
            if i != 0 and step[i] <= step[i - 1]:
                raise SchedulerArgumentError(
                    f"{owner}: step expected a strictly increasing list, given {step!r} "
                    f"(step[{i}] is {step[i]!r}, after {step[i - 1]!r})"
                )
            if value < 1:
                raise SchedulerArgumentError(
                    f"{owner}: step expected values of at least 1, given {step!r} "
                    f"(step[{i}] is {value!r})"
                )
        _no_factor_above_one(owner, factor)
        self.step = step
        self.cur_step_ind = 0
        self.factor = factor
        self.count = 0
        self.refuse_nonfinite(factor=factor)

    def __call__(self, num_update: int) -> float:
        """The learning rate after ``num_update`` updates, applying the decays reached.

        Args:
          num_update: the number of updates.

        Returns:
          The warm-up's learning rate, or ``base_lr`` after the decays up to ``num_update``.
        """
        if num_update < self.warmup_steps:
            return self.get_warmup_lr(num_update)
        # A loop, not a test: a jump past several listed updates applies each decay.
        while self.cur_step_ind <= len(self.step) - 1:
            if not num_update > self.step[self.cur_step_ind]:
                return self.base_lr
            self.count = self.step[self.cur_step_ind]
            self.cur_step_ind += 1
            self.base_lr *= self.factor
            _LOG.info("Update[%d]: Change learning rate to %0.5e", num_update, self.base_lr)
        return self.base_lr


def _max_update(owner: str, max_update: int) -> None:
    if not isinstance(max_update, int):
        raise SchedulerAssertionError(
            f"{owner}: max_update expected an int, given {type(max_update).__name__} {max_update!r}"
        )
    if max_update < 1:
        raise SchedulerArgumentError(
            f"{owner}: max_update expected at least 1, given {max_update!r}"
        )


def _no_decay_steps(sched: PolyScheduler | CosineScheduler, num_update: int) -> None:
    """Refuses the division by ``max_steps == 0`` MXNet attempts (its ZeroDivisionError)."""
    if sched.max_steps == 0:
        raise SchedulerZeroDivisionError(
            f"{type(sched).__name__}: num_update {num_update!r} is past a warm-up that ends at "
            f"max_update ({sched.max_update!r}, warmup_steps {sched.warmup_steps!r}), so the "
            "decay has no steps to divide by (MXNet 1.9.1 raises ZeroDivisionError here too)"
        )


class PolyScheduler(LRScheduler):
    """Decays the learning rate to ``final_lr`` along a polynomial of power ``pwr``.

    After the warm-up, and up to ``max_update``, the learning rate is ``final_lr + (base_lr -
    final_lr) * (1 - (num_update - warmup_steps) / (max_update - warmup_steps)) ** pwr``, with
    the initial ``base_lr`` (``base_lr_orig``); the result is kept in ``base_lr``. Past
    ``max_update`` the learning rate last computed is returned: ``final_lr`` if the last call
    up to ``max_update`` was at ``max_update``, the initial ``base_lr`` if there was none. With
    ``warmup_steps > max_update`` the decay never runs: after the warm-up the rate is the
    initial ``base_lr`` for good. With ``warmup_steps == max_update`` the call at
    ``max_update`` raises.

    Args:
      max_update: the update at which the learning rate reaches ``final_lr``, an ``int`` of at
        least 1.
      base_lr: the initial learning rate.
      pwr: the power of the decay.
      final_lr: the learning rate at ``max_update``.
      warmup_steps: as in :class:`LRScheduler`.
      warmup_begin_lr: as in :class:`LRScheduler`.
      warmup_mode: as in :class:`LRScheduler`.

    Raises:
      KVStoreError: :class:`LRScheduler`'s refusals, then (``SchedulerAssertionError``)
        ``max_update`` not an ``int``, then (``SchedulerArgumentError``) less than 1; then a
        NaN or infinite rate (``final_lr`` and ``pwr`` too), as :class:`LRScheduler`. A call
        at ``max_update`` when ``warmup_steps == max_update``: ``SchedulerZeroDivisionError``,
        a ``ZeroDivisionError``.

    Examples:
      >>> from jaxkv.mx import lr_scheduler
      >>> sched = lr_scheduler.PolyScheduler(max_update=4, base_lr=1.0, pwr=2)
      >>> [sched(n) for n in range(6)]
      [1.0, 0.5625, 0.25, 0.0625, 0.0, 0.0]
      >>> lr_scheduler.PolyScheduler(max_update=4, base_lr=1.0)(5)  # nothing computed yet
      1.0
    """

    checks_rates: ClassVar[bool] = True

    def __init__(
        self,
        max_update: int,
        base_lr: float = 0.01,
        pwr: float = 2,
        final_lr: float = 0,
        warmup_steps: int = 0,
        warmup_begin_lr: float = 0,
        warmup_mode: str = "linear",
    ) -> None:
        super().__init__(base_lr, warmup_steps, warmup_begin_lr, warmup_mode)
        _max_update("PolyScheduler", max_update)
        self.power = pwr
        self.base_lr_orig = self.base_lr
        self.max_update = max_update
        self.final_lr = final_lr
        self.max_steps = self.max_update - self.warmup_steps
        self.refuse_nonfinite(final_lr=final_lr, pwr=pwr)

    def __call__(self, num_update: int) -> float:
        """The learning rate after ``num_update`` updates, kept in ``base_lr``.

        Args:
          num_update: the number of updates.

        Returns:
          The warm-up's learning rate, the decayed one, or past ``max_update`` the last one.

        Raises:
          KVStoreError: (``SchedulerZeroDivisionError``) ``num_update == max_update ==
            warmup_steps``.
        """
        if num_update < self.warmup_steps:
            return self.get_warmup_lr(num_update)
        if num_update <= self.max_update:
            _no_decay_steps(self, num_update)
            done = float(num_update - self.warmup_steps) / float(self.max_steps)
            self.base_lr = self.final_lr + (self.base_lr_orig - self.final_lr) * pow(
                1 - done, self.power
            )
        return self.base_lr


class CosineScheduler(LRScheduler):
    """Decays the learning rate to ``final_lr`` along half a cosine.

    After the warm-up, and up to ``max_update``, the learning rate is ``final_lr + (base_lr -
    final_lr) * (1 + cos(pi * (num_update - warmup_steps) / (max_update - warmup_steps))) /
    2``, with the initial ``base_lr`` (``base_lr_orig``); the result is kept in ``base_lr``.
    Past ``max_update`` the last learning rate computed is returned, as in
    :class:`PolyScheduler` (whose notes on ``warmup_steps >= max_update`` hold here too). A
    ``final_lr`` above ``base_lr`` is taken: the learning rate then rises. At the decay's start
    the rate is ``final_lr + (base_lr - final_lr)``, which can be one ulp off ``base_lr``
    (``0.5 + (0.1 - 0.5)`` is ``0.09999999999999998``), as in MXNet.

    Args:
      max_update: the update at which the learning rate reaches ``final_lr``, an ``int`` of at
        least 1.
      base_lr: the initial learning rate.
      final_lr: the learning rate at ``max_update``.
      warmup_steps: as in :class:`LRScheduler`.
      warmup_begin_lr: as in :class:`LRScheduler`.
      warmup_mode: as in :class:`LRScheduler`.

    Raises:
      KVStoreError: as :class:`PolyScheduler`.

    Examples:
      >>> from jaxkv.mx import lr_scheduler
      >>> sched = lr_scheduler.CosineScheduler(max_update=4, base_lr=1.0, final_lr=0.2)
      >>> [sched(n) for n in range(6)]
      [1.0, 0.882842712474619, 0.6000000000000001, 0.317157287525381, 0.2, 0.2]
    """

    checks_rates: ClassVar[bool] = True

    def __init__(
        self,
        max_update: int,
        base_lr: float = 0.01,
        final_lr: float = 0,
        warmup_steps: int = 0,
        warmup_begin_lr: float = 0,
        warmup_mode: str = "linear",
    ) -> None:
        super().__init__(base_lr, warmup_steps, warmup_begin_lr, warmup_mode)
        _max_update("CosineScheduler", max_update)
        self.base_lr_orig = base_lr
        self.max_update = max_update
        self.final_lr = final_lr
        self.max_steps = self.max_update - self.warmup_steps
        self.refuse_nonfinite(final_lr=final_lr)

    def __call__(self, num_update: int) -> float:
        """The learning rate after ``num_update`` updates, kept in ``base_lr``.

        Args:
          num_update: the number of updates.

        Returns:
          The warm-up's learning rate, the decayed one, or past ``max_update`` the last one.

        Raises:
          KVStoreError: (``SchedulerZeroDivisionError``) ``num_update == max_update ==
            warmup_steps``.
        """
        if num_update < self.warmup_steps:
            return self.get_warmup_lr(num_update)
        if num_update <= self.max_update:
            _no_decay_steps(self, num_update)
            angle = math.pi * (num_update - self.warmup_steps) / self.max_steps
            self.base_lr = (
                self.final_lr + (self.base_lr_orig - self.final_lr) * (1 + math.cos(angle)) / 2
            )
        return self.base_lr
