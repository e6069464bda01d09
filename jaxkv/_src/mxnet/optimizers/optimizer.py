"""MXNet's ``Optimizer``: its arguments, its bookkeeping (update counts, learning rates from a
schedule, per-parameter multipliers) and its registry; each optimizer runs as an optax
transformation with MXNet's numbers.

An MXNet optimizer does two things at every update of a parameter (an *index*, the store's key):
its Python code counts the update (``_update_count``: the index's count, and ``num_update``,
the largest count) and works out the numbers its kernel takes (the learning rate, from
``lr_scheduler(num_update)`` or ``lr``, times the index's ``lr_mult``; the weight decay times
``wd_mult``; Adam's bias correction, in float64), and then a C++ kernel updates the weight and
the state in float32. jaxkv keeps that split:

- :meth:`Optimizer.next_update` is the Python part, on the host, at the moment MXNet would run
  it (each push of the key, in MXNet's order), giving the kernel's numbers (the *scalars*);
- :meth:`Optimizer.transformation` is the kernel, an ``optax.GradientTransformationExtraArgs``
  whose ``update(grads, state, params, scalars=...)`` takes those numbers as an argument of the
  computation (so a new learning rate never recompiles it) and returns updates that, added to
  the weight (``optax.apply_updates``), give MXNet's new weight: the same float32 operations
  in the same order as MXNet's CPU kernels (``src/operator/optimizer_op-inl.h``), eagerly and
  under ``jit``. The store passes the scalars at every push (``kv.set_optimizer``).

Called without ``scalars`` (an optax user's own loop), the update uses the numbers the optimizer
had when :meth:`Optimizer.transformation` was first called, and works out what depends on the
step (Adam's bias correction) from the state's count.

Each transformation's state is an :class:`OptimizerState`: the key's update count and, per
parameter, arrays of the parameter's shape and dtype (SGD's momentum; Adam's mean and var), so
``optax.tree_utils.tree_map_params`` finds them: a row-sparse push gathers the touched rows of
those, runs the transformation on them, and scatters them back. A store keeps one state per
key, as MXNet's updater does.

**Row-sparse gradients and** ``lazy_update``. MXNet runs different kernels for a row-sparse
gradient (after the store has summed the devices' rows). ``lazy_update=True`` (the default):
only the rows in the gradient change, weight and state alike (weight decay too). ``False``
(MXNet's "standard" update): every row changes, as if the gradient were dense with zeros in the
rows it lacks. ``transformation(row_sparse=True)`` runs MXNet's row-sparse kernels, which order
a few operations differently from the dense ones; one state serves both.
"""

from __future__ import annotations

import builtins
import inspect
import logging
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxkv._src.errors import KVStoreError, shown
from jaxkv._src.mxnet.optimizers import float32 as f32
from jaxkv._src.mxnet.optimizers.lr_scheduler import finite, nonfinite

__all__ = [
    "LearningRateError",
    "MissingOptimizerError",
    "Optimizer",
    "OptimizerArgumentError",
    "OptimizerState",
    "UnknownOptimizerError",
    "create",
    "missing",
    "register",
]

logger = logging.getLogger("jaxkv")

# An index's update count or host entry that it does not have (yet).
ABSENT = object()


class _Mark:
    """What :meth:`Optimizer.bookkeeping` gives: ``num_update``, the schedule's state and the
    optimizer's host scalars at that moment, and ``before``: each index a later
    :meth:`Optimizer.next_update` counted, with its count and host entry as they were the first
    time (so a mark costs what the updates after it touch, not every index counted so far)."""

    __slots__ = ("__weakref__", "before", "host", "num_update", "scheduler")

    def __init__(self, num_update: int, scheduler: dict | None, host: Any) -> None:
        self.num_update = num_update
        self.scheduler = scheduler
        self.host = host
        self.before: dict[Any, tuple[Any, Any]] = {}


# MXNet 1.9.1's optimizer registry (mx.optimizer.Optimizer.opt_registry), lower-case names.
MXNET_OPTIMIZERS = (
    "adadelta",
    "adagrad",
    "adam",
    "adamax",
    "ccsgd",
    "dcasgd",
    "ftml",
    "ftrl",
    "groupadagrad",
    "lamb",
    "lars",
    "lbsgd",
    "nadam",
    "nag",
    "rmsprop",
    "sgd",
    "sgld",
    "signum",
    "test",
)


class UnknownOptimizerError(KVStoreError, ValueError):
    """``create(name)`` with a name no optimizer is registered under (MXNet: ``ValueError``)."""


class MissingOptimizerError(KVStoreError, AttributeError):
    """``mx.optimizer.<Name>``: a name of MXNet's that jaxkv does not provide."""


class OptimizerArgumentError(KVStoreError, TypeError):
    """An argument MXNet's optimizer does not take, or one jaxkv cannot give MXNet's numbers for
    (a NaN or infinite learning rate, weight decay or ``rescale_grad``), or a compiled-in
    hyperparameter changed after the store compiled it."""


class LearningRateError(KVStoreError, UserWarning):
    """``set_learning_rate`` on an optimizer with an ``lr_scheduler`` (MXNet raises a
    ``UserWarning``)."""


_REGISTRY: dict[str, type[Optimizer]] = {}


def register(klass: builtins.type[Optimizer]) -> builtins.type[Optimizer]:
    """Register an optimizer class under its lower-case name, for :func:`create` (MXNet's
    ``mx.optimizer.register``, usable as a class decorator; a name registered again is
    overridden with a warning, as in MXNet).

    Args:
      klass: a subclass of :class:`Optimizer`.

    Returns:
      ``klass`` itself.
    """
    if not (isinstance(klass, type) and issubclass(klass, Optimizer)):
        raise OptimizerArgumentError(
            f"register: expected a subclass of jaxkv.mx.optimizer.Optimizer, given {klass!r}"
        )
    name = klass.__name__.lower()
    if name in _REGISTRY and _REGISTRY[name] is not klass:
        old = _REGISTRY[name]
        warnings.warn(
            f"WARNING: New optimizer {klass.__module__}.{klass.__name__} is overriding existing "
            f"optimizer {old.__module__}.{old.__name__}",
            stacklevel=2,
        )
    _REGISTRY[name] = klass
    return klass


def _available() -> str:
    return ", ".join(repr(n) for n in sorted(_REGISTRY))


def missing(name: str) -> MissingOptimizerError:
    """The error for ``mx.optimizer.<name>``, a name of MXNet's that jaxkv does not provide.

    Args:
      name: the attribute asked for.

    Returns:
      The error to raise, naming it and listing what exists here.
    """
    return MissingOptimizerError(
        f"mx.optimizer.{name}: MXNet 1.9.1 has it, jaxkv does not (create names: "
        f"{_available()}); or pass any optax GradientTransformation to kv.set_optimizer"
    )


def create(name: str, **kwargs: Any) -> Optimizer:
    """An optimizer by name, as ``mx.optimizer.create`` (case-insensitive).

    Args:
      name: a registered name (MXNet's: ``'sgd'``, ``'adam'``, ``'rmsprop'``, ...), any case.
      **kwargs: the optimizer's arguments.

    Returns:
      The optimizer.

    Raises:
      KVStoreError: (``UnknownOptimizerError``) no optimizer has that name.

    Examples:
      >>> from jaxkv.mx import optimizer
      >>> optimizer.create("Adam", learning_rate=0.1)
      Adam(learning_rate=0.1, beta1=0.9, beta2=0.999, epsilon=1e-08, lazy_update=True)
    """
    key = str(name).lower()
    if key not in _REGISTRY:
        known = " (MXNet 1.9.1 has it; jaxkv does not)" if key in MXNET_OPTIMIZERS else ""
        raise UnknownOptimizerError(
            f"Cannot find optimizer {name!r}{known}: expected one of {_available()}; or pass "
            "any optax GradientTransformation to kv.set_optimizer"
        )
    return _REGISTRY[key](**kwargs)


def number(owner: str, name: str, value: object) -> float:
    """``value`` as a Python float, or an ``OptimizerArgumentError`` naming the argument."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise OptimizerArgumentError(
            f"{owner}: {name} expected a number, given {type(value).__name__} {value!r}"
        )
    return float(value)


def rate(owner: str, name: str, value: object) -> float:
    """:func:`number`, refusing NaN and infinities (a learning rate, weight decay or
    ``rescale_grad``: MXNet takes them; see :class:`Optimizer`)."""
    x = number(owner, name, value)
    finite(OptimizerArgumentError, owner, name, x, float32=True)
    return x


# The numbers refused when NaN or infinite, whenever they are set (opt.lr = ... too).
RATES = frozenset({"lr", "wd", "rescale_grad"})


def _finite_mults(owner: str, name: str, mults: dict) -> None:
    """Refuse a NaN or infinite multiplier of ``set_lr_mult`` / ``set_wd_mult``."""
    for key, value in dict(mults).items():
        finite(OptimizerArgumentError, owner, f"{name}[{key!r}]", value, float32=True)


class OptimizerState(NamedTuple):
    """The state of an MXNet optimizer for one key: its update count and its per-parameter
    arrays (``slots``: SGD's momentum; Adam's mean and var; each a tree like the parameters)."""

    count: jax.Array  # type: ignore[assignment]  # int32 scalar: updates of this key so far
    slots: tuple  # per slot, a tree of the parameters' shapes and dtypes


# The transformation's view of the scalars: name -> float32 scalar (an array of the
# computation, or a constant).
Scalars = Mapping[str, Any]


class Optimizer:
    """The base of MXNet's optimizers: the arguments they all take, with MXNet 1.9.1's defaults
    and bookkeeping.

    Args:
      rescale_grad: the gradient is multiplied by it first (often ``1 / batch_size``).
      param_idx2name: index -> parameter name; a name not ending in ``_weight`` or ``_gamma``
        gets weight decay multiplier 0 (MXNet's rule), and ``set_lr_mult``/``set_wd_mult``
        may name parameters.
      wd: weight decay (L2 regularisation) coefficient.
      clip_gradient: clip the (rescaled) gradient to ``[-clip_gradient, clip_gradient]``;
        ``None``, 0 or negative: no clipping (as MXNet).
      learning_rate: the learning rate; ``None``: the scheduler's ``base_lr``, else 0.01. Given
        with a scheduler whose ``base_lr`` differs, it replaces that ``base_lr`` (with a
        warning), as in MXNet.
      lr_scheduler: an ``mx.lr_scheduler`` schedule (or any callable of ``num_update`` with a
        ``base_lr``), called at each update with the optimizer's ``num_update``.
      sym: only ``None`` (jaxkv has no symbols).
      begin_num_update: the update count each key starts from.
      multi_precision: MXNet's float32 master copy of float16 weights: the state keeps the
        copy (its last slot), the update runs on it in float32, and the weight becomes its
        float16 cast, as in MXNet; other weights ignore it.
      param_dict: index -> an object with ``lr_mult`` and ``wd_mult`` (Gluon's parameters),
        which take precedence over ``set_lr_mult``/``set_wd_mult``, as in MXNet.

    **NaN and infinite rates are refused when set.** MXNet 1.9.1 takes a NaN or infinite
    learning rate (then its SGD leaves the weights unchanged, its Adam makes them NaN); jaxkv
    refuses it, with an
    ``OptimizerArgumentError`` naming the argument and the value, wherever it is set:
    ``learning_rate``, :meth:`set_learning_rate`, ``opt.lr = ...``, and likewise ``wd`` and
    ``rescale_grad`` (arguments or attributes); a refusal changes nothing. A schedule refuses
    its own (``mx.lr_scheduler``), and a learning rate that is still NaN or infinite when an
    update reads it (a schedule of your own, a Gluon parameter's ``lr_mult``) refuses that
    push, which changes nothing either. A rate given as a JAX array is checked where it is
    concrete (once, when set), never inside a computation.

    Raises:
      KVStoreError: (``OptimizerArgumentError``) an argument MXNet's optimizers do not take,
        one whose numbers jaxkv does not reproduce (named in the message), or a NaN or
        infinite ``learning_rate``, ``wd`` or ``rescale_grad``.
    """

    # The kernel's numbers, in the order of the scalars' vector (see next_update).
    SCALARS: ClassVar[tuple[str, ...]] = ("lr", "wd", "rescale_grad", "clip_gradient")
    # The scalars MXNet hands a fused operator as float parameters (decimal strings, which its
    # parser does not always round to the nearest float32: float32.parsed); the others are
    # rounded to the nearest, as MXNet's NDArray arithmetic (double parameters) gives them.
    TEXT_SCALARS: ClassVar[frozenset[str]] = frozenset()
    # Attributes compiled into the transformation (frozen once it exists): what decides the
    # state's structure or the kernel's branches.
    STATIC: ClassVar[frozenset[str]] = frozenset({"multi_precision", "lazy_update"})
    # Whether a row-sparse gradient updates only its rows (MXNet's lazy_update).
    lazy_update: bool = True

    _frozen = False

    def __init__(
        self,
        rescale_grad: float = 1.0,
        param_idx2name: dict | None = None,
        wd: float = 0.0,
        clip_gradient: float | None = None,
        learning_rate: float | None = None,
        lr_scheduler: Any = None,
        sym: object = None,
        begin_num_update: int = 0,
        multi_precision: bool = False,
        param_dict: dict | None = None,
        **kwargs: Any,
    ) -> None:
        owner = type(self).__name__
        if kwargs:
            raise OptimizerArgumentError(
                f"{owner}: unexpected keyword argument(s) {sorted(kwargs)}: expected MXNet "
                f"1.9.1's arguments {sorted(self._arguments())}"
            )
        if sym is not None:
            raise OptimizerArgumentError(
                f"{owner}: sym={sym!r}: jaxkv has no symbols, expected sym=None (set "
                "multipliers with set_lr_mult / set_wd_mult)"
            )
        if param_idx2name is None:
            param_idx2name = {}
        if not isinstance(param_idx2name, dict):
            raise OptimizerArgumentError(
                f"{owner}: param_idx2name expected a dict of parameter indexes to names, "
                f"given {type(param_idx2name).__name__}"
            )
        if isinstance(begin_num_update, bool) or not isinstance(begin_num_update, int):
            raise OptimizerArgumentError(
                f"{owner}: begin_num_update expected an int >= 0, given {begin_num_update!r}"
            )
        if not 0 <= begin_num_update < 2**31 - 1:
            raise OptimizerArgumentError(
                f"{owner}: begin_num_update expected an int in [0, 2**31 - 1), "
                f"given {begin_num_update!r}"
            )
        if lr_scheduler is not None and not (
            callable(lr_scheduler) and hasattr(lr_scheduler, "base_lr")
        ):
            raise OptimizerArgumentError(
                f"{owner}: lr_scheduler expected an mx.lr_scheduler schedule (a callable of "
                f"num_update with a base_lr), given {lr_scheduler!r}"
            )
        self.rescale_grad = rate(owner, "rescale_grad", rescale_grad)
        self.lr_scheduler = lr_scheduler
        if lr_scheduler is None and learning_rate is None:
            learning_rate = 0.01
        self.lr = None if learning_rate is None else rate(owner, "learning_rate", learning_rate)
        if lr_scheduler is not None and self.lr is not None and lr_scheduler.base_lr != self.lr:
            warnings.warn(
                "learning rate from ``lr_scheduler`` has been overwritten by "
                "``learning_rate`` in optimizer.",
                UserWarning,
                stacklevel=2,
            )
            lr_scheduler.base_lr = self.lr
        self.wd = rate(owner, "wd", wd)
        self.lr_mult: dict = {}
        self.wd_mult: dict = {}
        self.begin_num_update = begin_num_update
        self.num_update = begin_num_update
        self._index_update_count: dict = {}
        self._marks: weakref.WeakSet[_Mark] = weakref.WeakSet()  # bookkeeping()'s, still held
        self._text_columns: tuple[bool, ...] | None = None  # which SCALARS are parsed, once
        self.clip_gradient = (
            None if clip_gradient is None else number(owner, "clip_gradient", clip_gradient)
        )
        self.multi_precision = bool(multi_precision)
        self.idx2name = dict(param_idx2name)
        self.param_dict = dict(param_dict) if param_dict else {}
        self._transformations: dict[tuple, optax.GradientTransformationExtraArgs] = {}
        self._bound_cache: dict[tuple, optax.GradientTransformationExtraArgs] = {}
        self.set_lr_mult({})
        self.set_wd_mult({})

    @classmethod
    def _arguments(cls) -> set[str]:
        names: set[str] = set()
        for klass in cls.__mro__:
            if "__init__" in vars(klass) and issubclass(klass, Optimizer):
                params = inspect.signature(vars(klass)["__init__"]).parameters.values()
                names |= {p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD}
        return names - {"self"}

    def __setattr__(self, name: str, value: object) -> None:
        if self._frozen and name in self.STATIC:
            raise OptimizerArgumentError(
                f"{type(self).__name__}.{name}: cannot change it after the store compiled this "
                "optimizer (kv.set_optimizer, or transformation()): it decides the state or "
                f"the computation. Give kv.set_optimizer a new optimizer with {name}={value!r} "
                "(the learning rate, weight decay, rescale_grad and clip_gradient may change)"
            )
        if name in RATES and value is not None:  # opt.lr = nan: refused, lr kept
            finite(OptimizerArgumentError, type(self).__name__, name, value, float32=True)
        super().__setattr__(name, value)

    # -- MXNet's bookkeeping -------------------------------------------------------------
    @property
    def learning_rate(self) -> float:
        """The learning rate now, the scheduler's at ``num_update`` if there is one, else ``lr``."""
        if self.lr_scheduler is not None:
            return float(self.lr_scheduler(self.num_update))
        return float(self.lr)  # type: ignore[arg-type]

    def set_learning_rate(self, lr: float) -> None:
        """Set the learning rate; the store uses it from the next push, every state kept.

        Args:
          lr: the new learning rate, a finite number.

        Raises:
          KVStoreError: (``LearningRateError``, also a ``UserWarning`` as MXNet's) the
            optimizer has an ``lr_scheduler``; (``OptimizerArgumentError``) ``lr`` is not a
            number, or is NaN or infinite (MXNet 1.9.1 takes it): the learning rate stays as
            it was.

        Examples:
          >>> import jaxkv
          >>> from jaxkv.mx import optimizer
          >>> opt = optimizer.SGD(learning_rate=0.1)
          >>> try:
          ...     opt.set_learning_rate(float("nan"))
          ... except jaxkv.KVStoreError as e:
          ...     print(str(e).split(" (")[0])
          SGD: lr expected a finite number, given nan
          >>> opt.lr
          0.1
        """
        if self.lr_scheduler is not None:
            raise LearningRateError(
                f"{type(self).__name__}: LRScheduler of the optimizer has already been defined. "
                "Note that set_learning_rate can mutate the value of the learning rate of the "
                "optimizer only when the LRScheduler of the optimizer is undefined (expected "
                f"lr_scheduler=None, given {self.lr_scheduler!r})"
            )
        self.lr = rate(type(self).__name__, "lr", lr)

    def set_lr_scale(self, args_lrscale: dict) -> None:  # noqa: ARG002 - MXNet's signature
        """Deprecated in MXNet, which raises ``DeprecationWarning``: use :meth:`set_lr_mult`."""
        raise DeprecationWarning("set_lr_scale is deprecated: use set_lr_mult")

    def set_lr_mult(self, args_lr_mult: dict) -> None:
        """Set a learning-rate multiplier per parameter, by index or by name.

        Args:
          args_lr_mult: index or name (``param_idx2name``'s) -> multiplier; replaces all.

        Raises:
          KVStoreError: (``OptimizerArgumentError``) a multiplier is NaN or infinite (it would
            make the learning rate so); the multipliers stay as they were.
        """
        _finite_mults(type(self).__name__, "lr_mult", args_lr_mult)
        self.lr_mult = dict(args_lr_mult)

    def set_wd_mult(self, args_wd_mult: dict) -> None:
        """Set a weight-decay multiplier per parameter, by index or by name; parameters named
        (``param_idx2name``) without a ``_weight`` or ``_gamma`` suffix get 0 unless given.

        Args:
          args_wd_mult: index or name -> multiplier; replaces all.

        Raises:
          KVStoreError: (``OptimizerArgumentError``) a multiplier is NaN or infinite; the
            multipliers stay as they were.
        """
        _finite_mults(type(self).__name__, "wd_mult", args_wd_mult)
        mult = {}
        for n in self.idx2name.values():
            if not (str(n).endswith("_weight") or str(n).endswith("_gamma")):
                mult[n] = 0.0
        mult.update(args_wd_mult)
        self.wd_mult = mult

    def _update_count(self, index: Any) -> None:
        """Count an update of ``index`` (or of each of a list), as MXNet's does."""
        for idx in index if isinstance(index, list | tuple) else [index]:
            if idx not in self._index_update_count:
                self._index_update_count[idx] = self.begin_num_update
            self._index_update_count[idx] += 1
            self.num_update = max(self._index_update_count[idx], self.num_update)

    def _get_lrs(self, indices: list) -> list[Any]:
        lr = self.lr_scheduler(self.num_update) if self.lr_scheduler is not None else self.lr
        lrs = [lr for _ in indices]
        for i, index in enumerate(indices):
            if index in self.param_dict:
                lrs[i] *= self.param_dict[index].lr_mult
            elif index in self.lr_mult:
                lrs[i] *= self.lr_mult[index]
            elif index in self.idx2name:
                lrs[i] *= self.lr_mult.get(self.idx2name[index], 1.0)
        for index, lr in zip(indices, lrs):
            # Host numbers only: a JAX array is not read back here (it was checked when set).
            if isinstance(lr, float | int | np.floating) and nonfinite(lr, float32=True):
                source = (
                    f"lr_scheduler {type(self.lr_scheduler).__name__} at num_update "
                    f"{self.num_update}"
                    if self.lr_scheduler is not None
                    else f"lr {self.lr!r}"
                )
                raise OptimizerArgumentError(
                    f"{type(self).__name__}: the learning rate of index {index!r} expected a "
                    f"finite number, given {lr!r} (from {source}, times the index's lr_mult); "
                    "this update is refused and changes nothing"
                )
        return lrs

    def _get_lr(self, index: Any) -> float:
        return self._get_lrs([index])[0]

    def _get_wds(self, indices: list) -> list[float]:
        wds = [self.wd for _ in indices]
        for i, index in enumerate(indices):
            if index in self.param_dict:
                wds[i] *= self.param_dict[index].wd_mult
            elif index in self.wd_mult:
                wds[i] *= self.wd_mult[index]
            elif index in self.idx2name:
                wds[i] *= self.wd_mult.get(self.idx2name[index], 1.0)
        return wds

    def _get_wd(self, index: Any) -> float:
        return self._get_wds([index])[0]

    def _clip_scalar(self) -> float:
        """``clip_gradient`` as the kernel gets it: MXNet passes it only when truthy, and the
        kernel clips when it is >= 0 (-1: no clipping)."""
        return self.clip_gradient if self.clip_gradient else -1.0

    def inputs(self, index: Any) -> tuple[float, ...]:
        """What MXNet's Python reads for an update of ``index`` (float64), in ``SCALARS``
        order, before anything that depends on the step: the learning rate (the schedule's at
        ``num_update``, times the multiplier), the weight decay (times its multiplier), and the
        optimizer's own numbers. Reads the optimizer (a stateful schedule may move); changes
        nothing else. ``index=None``: no multipliers."""
        return (self._get_lr(index), self._get_wd(index), self.rescale_grad, self._clip_scalar())

    def scalars(self, index: Any) -> tuple[float, ...]:
        """The numbers MXNet's Python gives the kernel for an update of ``index``, counted
        already (float64; the kernel takes them as float32): :meth:`inputs`, and what depends
        on the index's update count (Adam's bias correction)."""
        return self.inputs(index)

    def _advance(self, index: Any) -> None:
        """What else MXNet's update changes on the host at an update of ``index``, before the
        kernel's numbers are read (none here)."""

    def bookkeeping(self) -> _Mark:
        """A mark of what :meth:`next_update` changes from now on (the counts, ``num_update``,
        the schedule's own state, the optimizer's host state), for :meth:`restore_bookkeeping`
        when the push it was counted for is refused. It keeps only what the updates after it
        touch (each index as it was the first time), O(indices touched), not a copy of every
        index counted so far."""
        scheduler = self.lr_scheduler
        mark = _Mark(
            self.num_update,
            None if scheduler is None else dict(vars(scheduler)),
            self._host_scalars(),
        )
        self._marks.add(mark)
        return mark

    def restore_bookkeeping(self, mark: _Mark) -> None:
        """Undo :meth:`next_update` calls made since :meth:`bookkeeping` gave ``mark``."""
        self._put_back(mark.num_update, mark.before, mark.scheduler, mark.host)
        self._marks.discard(mark)

    def _entries(self, index: Any) -> tuple[Any, Any]:
        """``index``'s update count and host entry, as :meth:`_put_back` takes them."""
        return self._index_update_count.get(index, ABSENT), self._host_entry(index)

    def _put_back(
        self, num_update: int, before: Mapping[Any, tuple[Any, Any]], scheduler: Any, host: Any
    ) -> None:
        self.num_update = num_update
        for index, (count, entry) in before.items():
            if count is ABSENT:
                self._index_update_count.pop(index, None)
            else:
                self._index_update_count[index] = count
            self._set_host_entry(index, entry)
        if scheduler is not None:
            vars(self.lr_scheduler).clear()
            vars(self.lr_scheduler).update(scheduler)
        self._set_host_scalars(host)

    def _host_state(self) -> Any:
        """The optimizer's own host state that :meth:`_advance` changes (none here), whole: as
        :meth:`record` saves it."""
        return None

    def _set_host_state(self, state: Any) -> None:
        """Put back what :meth:`_host_state` gave."""

    def _host_scalars(self) -> Any:
        """The part of :meth:`_host_state` that any update changes (none here)."""
        return None

    def _set_host_scalars(self, scalars: Any) -> None:
        """Put back what :meth:`_host_scalars` gave."""

    def _host_entry(self, index: Any) -> Any:  # noqa: ARG002
        """The part of :meth:`_host_state` that an update of ``index`` changes (none here)."""
        return None

    def _set_host_entry(self, index: Any, entry: Any) -> None:
        """Put back what :meth:`_host_entry` gave for ``index``."""

    # -- saved with the states (MXNet's dump_optimizer) ------------------------------------
    def record(self) -> dict[str, Any]:
        """What MXNet's ``save_optimizer_states(fname, dump_optimizer=True)`` keeps of the
        optimizer (it pickles the whole object), as JSON: the class and its arguments, the
        numbers that may change (learning rate, weight decay, ``rescale_grad``,
        ``clip_gradient``, the multipliers), the bookkeeping (each index's update count,
        ``num_update``) and the schedule's state. :meth:`restore_record` puts them back."""
        scheduler = self.lr_scheduler
        return {
            "class": type(self).__name__,
            "args": as_json(self._repr_args()),
            "numbers": as_json(
                {
                    "lr": self.lr,
                    "wd": self.wd,
                    "rescale_grad": self.rescale_grad,
                    "clip_gradient": self.clip_gradient,
                    "lr_mult": self.lr_mult,
                    "wd_mult": self.wd_mult,
                }
            ),
            "num_update": self.num_update,
            "begin_num_update": self.begin_num_update,
            "counts": as_json(self._index_update_count),
            "scheduler": None
            if scheduler is None
            else {"class": type(scheduler).__name__, "state": as_json(dict(vars(scheduler)))},
            "host": as_json(self._host_state()),
        }

    def restore_record(self, record: Any, where: str) -> Callable[[], None]:
        """Check a :meth:`record` (read from the file ``where``) against this optimizer, and
        return what puts it back; refuses (before anything changes) a record of another
        class, of other arguments (besides the learning rate) or of another schedule: MXNet
        would replace its optimizer by the file's, jaxkv keeps the kernel it compiled."""
        owner = type(self).__name__
        try:
            if not isinstance(record, dict):
                raise TypeError("not an object")
            saved_class = record["class"]
            if saved_class != owner:
                raise KVStoreError(
                    f"{where}: the saved optimizer is {saved_class}, expected this store's "
                    f"{owner}; call kv.set_optimizer(mx.optimizer.{saved_class}(...)) with the "
                    "saved run's arguments before loading"
                )
            args = from_json(record["args"])
            mine = {k: v for k, v in self._repr_args().items() if k != "learning_rate"}
            theirs = {k: v for k, v in dict(args).items() if k != "learning_rate"}
            if mine != theirs:
                raise KVStoreError(
                    f"{where}: the saved {owner} has arguments {theirs}, expected this store's "
                    f"{mine}; set an optimizer made with the saved run's arguments first"
                )
            scheduler = self.lr_scheduler
            saved_scheduler = record["scheduler"]
            mine_name = None if scheduler is None else type(scheduler).__name__
            theirs_name = None if saved_scheduler is None else saved_scheduler["class"]
            if mine_name != theirs_name:
                raise KVStoreError(
                    f"{where}: the saved {owner} has lr_scheduler {theirs_name}, expected this "
                    f"store's {mine_name}; set an optimizer with the saved run's schedule first"
                )
            numbers = dict(from_json(record["numbers"]))
            for name in ("lr", "wd", "rescale_grad"):
                if numbers[name] is not None and nonfinite(numbers[name], float32=True):
                    raise KVStoreError(
                        f"{where}: the saved {owner}'s {name} expected a finite number, given "
                        f"{numbers[name]!r} (jaxkv refuses a NaN or infinite rate); nothing "
                        "was loaded"
                    )
            counts = dict(from_json(record["counts"]))
            num_update = int(record["num_update"])
            begin = int(record["begin_num_update"])
            host = from_json(record["host"])
            sched_state = (
                None if saved_scheduler is None else dict(from_json(saved_scheduler["state"]))
            )
        except KVStoreError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise KVStoreError(
                f"{where}: expected the saved optimizer's record (save_optimizer_states with "
                f"dump_optimizer=True), given a malformed one ({type(e).__name__}: {e})"
            ) from None

        def put_back() -> None:
            self.lr = numbers["lr"]
            self.wd = numbers["wd"]
            self.rescale_grad = numbers["rescale_grad"]
            self.clip_gradient = numbers["clip_gradient"]
            self.lr_mult = dict(numbers["lr_mult"])
            self.wd_mult = dict(numbers["wd_mult"])
            self.begin_num_update = begin
            self.num_update = num_update
            self._index_update_count.clear()
            self._index_update_count.update(counts)
            if sched_state is not None:
                vars(self.lr_scheduler).clear()
                vars(self.lr_scheduler).update(sched_state)
            self._set_host_state(host)

        return put_back

    def next_update(self, indices: list) -> np.ndarray:
        """Run MXNet's bookkeeping for one update of each of ``indices``, in order (as MXNet's
        updater calls ``update`` once per key): count it, then read the kernel's numbers.

        Returns:
          float32 array ``(len(indices), len(SCALARS))``: each row the ``scalars`` argument of
          that key's update.

        Raises:
          KVStoreError: (``OptimizerArgumentError``) a learning rate read is NaN or infinite
            (a schedule or multiplier gave it); an exception raised here changes nothing
            (counts, ``num_update``, the schedule's state are put back).
        """
        scheduler = self.lr_scheduler
        before = {index: self._entries(index) for index in indices}  # what the loop changes
        if self._marks:  # (iterating a WeakSet costs, even an empty one's)
            for mark in list(self._marks):  # a mark keeps each index as it was the first time
                for index, entry in before.items():
                    mark.before.setdefault(index, entry)
        saved = (
            self.num_update,
            None if scheduler is None else dict(vars(scheduler)),
            self._host_scalars(),
        )
        rows = []
        try:
            for index in indices:
                self._update_count(index)
                self._advance(index)
                rows.append(self.scalars(index))
        except BaseException:
            num_update, sched_state, host = saved
            self._put_back(num_update, before, sched_state, host)
            raise
        return self._table(rows)

    def _table(self, rows: list[tuple[float, ...]]) -> np.ndarray:
        """:meth:`next_update`'s rows as the kernel takes them: float32, each ``TEXT_SCALARS``
        column as MXNet's operator parses its float parameter (:func:`float32.parsed`)."""
        text = self._text_columns
        if text is None:
            text = tuple(name in self.TEXT_SCALARS for name in self.SCALARS)
            self._text_columns = text
        parsed = [[f32.parsed(x) if p else x for x, p in zip(row, text)] for row in rows]
        return np.array(parsed, np.float64).astype(np.float32).reshape(len(rows), len(text))

    # -- the kernel ----------------------------------------------------------------------
    def slot_names(self) -> tuple[str, ...]:
        """The per-parameter state arrays (in :attr:`OptimizerState.slots` order)."""
        return ()

    def init_slot(self, name: str, weight: jax.Array) -> jax.Array:  # noqa: ARG002
        """A fresh ``name`` slot for ``weight``: zeros of its shape and dtype by default."""
        return jnp.zeros_like(weight)

    def kernel(
        self,
        g: jax.Array,
        w: jax.Array,
        slots: tuple[jax.Array, ...],
        s: Scalars,
        t: jax.Array,
        z: jax.Array,
        row_sparse: bool,
    ) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """One parameter's update: MXNet's kernel on gradient ``g`` and weight ``w``.

        Args:
          g: the (summed) gradient, in the weight's dtype.
          w: the weight.
          slots: the parameter's state arrays.
          s: the scalars (``SCALARS`` names -> float32 scalars).
          t: the key's update count including this update (int32).
          z: an opaque int32 zero for ``float32.rounded``.
          row_sparse: whether this is MXNet's row-sparse kernel.

        Returns:
          ``(update, new_slots)``: ``w + update`` is MXNet's new weight.
        """
        raise NotImplementedError

    def traced_scalars(
        self,
        inputs: tuple[float, ...],
        t: jax.Array,  # noqa: ARG002 - subclasses' scalars may depend on the step
        z: jax.Array,  # noqa: ARG002
    ) -> dict[str, Any]:
        """The scalars inside the computation, from :meth:`inputs` (compiled in) and the
        key's update count ``t`` (Adam's bias correction): used when the update is called
        without ``scalars`` (an optax loop; row-sparse pushes)."""
        return {n: jnp.float32(v) for n, v in zip(self.SCALARS, inputs)}

    def check_weight(self, w: jax.Array) -> None:
        """Refuse a parameter this optimizer cannot update with MXNet's numbers."""
        if not jnp.issubdtype(jnp.result_type(w), jnp.floating):
            raise KVStoreError(
                f"{type(self).__name__}: expected floating-point parameters, given dtype "
                f"{jnp.result_type(w)} (MXNet's optimizers update float weights)"
            )

    def _master_copy(self, weights: list) -> bool:
        """Whether the state keeps a float32 copy of the weights (``multi_precision`` with
        float16 weights, as MXNet's ``create_state_multi_precision``)."""
        if not self.multi_precision:
            return False
        half = [jnp.result_type(w) == jnp.float16 for w in weights]
        if any(half) and not all(half):
            raise OptimizerArgumentError(
                f"{type(self).__name__}: multi_precision=True over a tree mixing float16 and "
                "other weights: expected one dtype per tree (a store updates each key alone)"
            )
        return bool(half) and all(half)

    def transformation(
        self,
        *,
        row_sparse: bool = False,
        inputs: tuple[float, ...] | None = None,
        master: bool = False,
        check: bool = True,
    ) -> optax.GradientTransformationExtraArgs:
        """This optimizer as an optax transformation with MXNet's numbers.

        The first call freezes the attributes in ``STATIC``. The same arguments give the
        same object (its compiled pushes are reused).

        Args:
          row_sparse: ``False`` for a dense gradient; ``True`` for a row-sparse one, run on
            its rows (``lazy_update=True``) or on the densified gradient (``False``): MXNet's
            row-sparse kernels. Both make the same state.
          inputs: the numbers an update called without ``scalars`` uses (:meth:`inputs`'s
            form), compiled in; default: :meth:`inputs` of no particular index at the first
            call.
          master: whether the state has a float32 master copy where ``init`` cannot tell from
            the parameters (``optax.tree_utils.tree_map_params`` calls it with a placeholder,
            as a push of rows does): ``multi_precision`` over float16 weights.
          check: refuse row-sparse gradients here (:meth:`check_row_sparse` of ``inputs``);
            ``False`` where the caller has checked each key's own (the store does).

        Returns:
          An ``optax.GradientTransformationExtraArgs``; ``update(grads, state, params,
          scalars=None)`` needs ``params`` and is jittable. ``scalars``: a float32 vector of
          ``SCALARS`` (a row of :meth:`next_update`), an argument of the computation.
        """
        row_sparse = bool(row_sparse)
        if row_sparse and check:
            self.check_row_sparse(self.inputs(None) if inputs is None else inputs)
        object.__setattr__(self, "_frozen", True)
        master = bool(master) and self.multi_precision
        if inputs is None:
            if (row_sparse, master) not in self._transformations:
                built = self._build(row_sparse, self.inputs(None), master)
                self._transformations[(row_sparse, master)] = built
            return self._transformations[(row_sparse, master)]
        return self._bound(row_sparse, tuple(float(x) for x in inputs), master)

    def check_row_sparse(self, inputs: tuple[float, ...]) -> None:
        """Refuse row-sparse gradients where MXNet's row-sparse kernel cannot run with
        ``inputs`` (:meth:`inputs` of the key pushed): the store calls it at every push of
        rows, before anything changes (none refused here)."""

    def _bound(
        self, row_sparse: bool, inputs: tuple[float, ...], master: bool = False
    ) -> optax.GradientTransformationExtraArgs:
        """The transformation with ``inputs`` compiled in: the last 8 kept."""
        cache = self._bound_cache
        key = (row_sparse, inputs, master)
        if key in cache:
            cache[key] = cache.pop(key)  # most recent last
        else:
            cache[key] = self._build(row_sparse, inputs, master)
            while len(cache) > 8:
                cache.pop(next(iter(cache)))
        return cache[key]

    def _build(
        self, row_sparse: bool, inputs: tuple[float, ...], master_hint: bool = False
    ) -> optax.GradientTransformationExtraArgs:
        owner = type(self).__name__
        names = self.slot_names()
        begin = self.begin_num_update

        def init(params: optax.Params) -> OptimizerState:
            leaves = jax.tree.leaves(params)
            for leaf in leaves:
                self.check_weight(leaf)
            # No leaves: tree_map_params's placeholder, whose dtype the caller tells.
            if self._master_copy(leaves) if leaves else master_hint:  # state of a float32 copy
                master = jax.tree.map(lambda w: w.astype(jnp.float32), params)
                slots = tuple(
                    jax.tree.map(lambda w, n=n: self.init_slot(n, w), master) for n in names
                )
                return OptimizerState(count=jnp.asarray(begin, jnp.int32), slots=(*slots, master))
            slots = tuple(jax.tree.map(lambda w, n=n: self.init_slot(n, w), params) for n in names)
            return OptimizerState(count=jnp.asarray(begin, jnp.int32), slots=slots)

        def update(
            updates: optax.Updates,
            state: OptimizerState,
            params: optax.Params | None = None,
            *,
            scalars: Any = None,
            **extra_args: Any,  # noqa: ARG001 - optax passes every extra argument to each
        ) -> tuple[optax.Updates, OptimizerState]:
            if params is None:
                raise KVStoreError(
                    f"{owner}: update needs params (weight decay and MXNet's update use the "
                    "weight): call update(grads, state, params)"
                )
            z = f32.opaque_zero(state.count)
            t = f32.next_count(state.count)
            if scalars is None:
                s = self.traced_scalars(inputs, t, z)
            else:
                scalars = jnp.asarray(scalars, jnp.float32)
                s = {n: scalars[i] for i, n in enumerate(self.SCALARS)}
            grads, treedef = jax.tree.flatten(updates)
            weights = jax.tree.leaves(params)
            per_slot = [jax.tree.leaves(slot) for slot in state.slots]
            master = self._master_copy(weights)
            new_updates: list[Any] = []
            new_slots: list[list[Any]] = [[] for _ in per_slot]
            for j, (g, w) in enumerate(zip(grads, weights)):
                mine = tuple(p[j] for p in per_slot)
                if master:  # MXNet's update of the float32 copy, the weight its float16 cast
                    w32, mine = mine[-1], mine[:-1]
                    u, ss = self.kernel(g.astype(jnp.float32), w32, mine, s, t, z, row_sparse)
                    new32 = w32 + u
                    # float32(new) - float32(w), added to w in float32 and cast, gives
                    # float16(new) exactly: within two float32 ulps of a float16 number.
                    u = new32.astype(w.dtype).astype(jnp.float32) - w.astype(jnp.float32)
                    ss = (*ss, new32)
                else:
                    u, ss = self.kernel(g.astype(w.dtype), w, mine, s, t, z, row_sparse)
                new_updates.append(u)
                for acc, x in zip(new_slots, ss):
                    acc.append(x)
            return jax.tree.unflatten(treedef, new_updates), OptimizerState(
                count=t, slots=tuple(jax.tree.unflatten(treedef, x) for x in new_slots)
            )

        return optax.GradientTransformationExtraArgs(init, update)

    # -- repr ----------------------------------------------------------------------------
    def _repr_args(self) -> dict[str, object]:
        return {"learning_rate": self.lr}

    def __repr__(self) -> str:
        args = self._repr_args()
        extra = {
            "wd": (self.wd, 0.0),
            "rescale_grad": (self.rescale_grad, 1.0),
            "clip_gradient": (self.clip_gradient, None),
            "begin_num_update": (self.begin_num_update, 0),
            "lr_scheduler": (self.lr_scheduler, None),
        }
        args.update({k: v for k, (v, default) in extra.items() if v != default})
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in args.items())})"


def clipped(g: jax.Array, c: jax.Array) -> jax.Array:
    """MXNet's ``clip(g, -c, c)`` where ``c >= 0``, ``g`` itself otherwise (no clipping)."""
    return jnp.where(c >= 0, jnp.clip(g, -jnp.abs(c), jnp.abs(c)), g)


def cast(x: Any, dtype: Any) -> jax.Array:
    """A float32 scalar as the kernel sees it in the weight's type (C++'s ``DType(param)``)."""
    return jnp.asarray(x, jnp.float32).astype(dtype)


def as_json(x: Any) -> Any:
    """``x`` (numbers, strings, lists, tuples, dicts of them) as JSON that :func:`from_json`
    reads back as it was: tuples and dicts (whose keys may be ints) tagged."""
    if x is None or isinstance(x, bool | str):
        return x
    if isinstance(x, int | np.integer):
        return int(x)
    if isinstance(x, float | np.floating):
        return float(x)
    if isinstance(x, list):
        return [as_json(v) for v in x]
    if isinstance(x, tuple):
        return {"tuple": [as_json(v) for v in x]}
    if isinstance(x, dict):
        return {"dict": [[as_json(k), as_json(v)] for k, v in x.items()]}
    raise KVStoreError(
        f"the optimizer's record: expected numbers, strings, lists and dicts, given "
        f"{type(x).__name__} {x!r}"
    )


def from_json(x: Any) -> Any:
    """What :func:`as_json` gave, as it was."""
    if isinstance(x, list):
        return [from_json(v) for v in x]
    if isinstance(x, dict):
        if set(x) == {"tuple"}:
            return tuple(from_json(v) for v in x["tuple"])
        if set(x) == {"dict"}:
            return {_hashable(from_json(k)): from_json(v) for k, v in x["dict"]}
        raise ValueError(f"an untagged object {x!r}")
    return x


def _hashable(k: Any) -> Any:
    if isinstance(k, list):
        raise ValueError(f"a list as a key: {shown(k)}")
    return k
