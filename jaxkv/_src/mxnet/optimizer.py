"""MXNet's optimizers (SGD, Adam, and the ``'test'`` of its own tests) as optax
transformations, for the drop-in's kv.set_optimizer.

``jaxkv.mx.optimizer.SGD`` and ``Adam`` take MXNet 1.9.1's arguments and defaults, and
:meth:`Optimizer.transformation` turns one into an :class:`optax.GradientTransformation` whose
``update(grads, state, params)`` returns the updates that, added to the weight
(``optax.apply_updates``), give MXNet's new weight: the same float32 operations in the same
order as MXNet's CPU kernels (``src/operator/optimizer_op-inl.h``), so the numbers agree bit
for bit, eagerly and under ``jit`` (``tests/test_mx_optimizer.py`` checks them against MXNet's
own, recorded by ``conformance/record_optimizers.py``). Two things make that so: XLA would
fuse a product into the sum that uses it (an FMA, one rounding where MXNet rounds twice), which
:func:`_rounded` prevents at no cost; and Adam's bias-corrected learning rate, which MXNet
computes in float64, is computed in double-float32 (:func:`_bias_corrected_lr`). One kernel
cannot be reproduced exactly as an update: MXNet's row-sparse SGD without momentum and with
weight decay computes a new weight, ``(1 - lr*wd)*w - lr*g``, and ``w + (new - w)`` rounds one
ulp away from it in rare elements where the step is larger than the weight.

Each transformation's state holds, per parameter, arrays of the parameter's shape and dtype
(SGD's momentum; Adam's mean and var) and otherwise only scalars (the key's update count, an
int32), so ``optax.tree_utils.tree_map_params`` finds the per-parameter leaves: a row-sparse
push gathers the touched rows of those, runs the transformation on them, and scatters them
back. A store keeps one state per key, as MXNet's updater does, so Adam's step count ``t`` is
the number of updates of that key.

**Row-sparse gradients and** ``lazy_update``. MXNet runs different kernels, with different
semantics, for a row-sparse gradient (after the store has summed the devices' rows: distinct
rows, duplicates added):

- ``lazy_update=True`` (the default): only the rows in the gradient change, weight and state
  alike. Weight decay too applies only to those rows; SGD's momentum and Adam's mean and var of
  the other rows stay as they are, and those rows' weights do not move. Adam's ``t`` still
  counts every update of the key. Run ``transformation(row_sparse=True)`` on the touched rows
  (and the same rows of the per-parameter state).
- ``lazy_update=False`` (MXNet's "standard" update): every row changes, as if the gradient were
  dense with zeros in the rows it lacks: weight decay shrinks every row, momentum keeps moving
  rows the gradient lacks, Adam's moments decay and its weights move there. Run
  ``transformation(row_sparse=True)`` on the densified gradient.

``row_sparse=True`` matters only for the last bits: MXNet's row-sparse kernels order a few
operations differently from the dense ones (SGD without momentum: ``(1 - lr*wd)*w - lr*g``
instead of ``w - (lr*wd*w + lr*g)``; Adam's ``(1 - beta2) * (g * g)`` instead of
``((1 - beta2) * g) * g``, lazily only with ``clip_gradient``). A dense gradient takes
``row_sparse=False``. One state serves both: they make the same state.

Hyperparameters are read when :meth:`Optimizer.transformation` is first called (by
``kv.set_optimizer``): they are compiled into the update. Changing one afterwards (``opt.lr =
0.5``, ``opt.set_learning_rate``) is refused, since the store would not see it.
"""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxkv._src.errors import KVStoreError

__all__ = [
    "SGD",
    "Adam",
    "AdamState",
    "MissingOptimizerError",
    "Optimizer",
    "OptimizerArgumentError",
    "SGDState",
    "Test",
    "TestState",
    "UnknownOptimizerError",
    "ccSGD",
    "create",
    "missing",
]

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
# Names in MXNet's mx.optimizer namespace (its __all__) that jaxkv does not provide.
MXNET_MISSING_NAMES = (
    "AdaDelta",
    "AdaGrad",
    "Adamax",
    "DCASGD",
    "FTML",
    "Ftrl",
    "LAMB",
    "LARS",
    "LBSGD",
    "NAG",
    "NDabs",
    "Nadam",
    "RMSProp",
    "SGLD",
    "Signum",
    "Updater",
    "contrib",
    "get_updater",
    "register",
)


class UnknownOptimizerError(KVStoreError, ValueError):
    """``create(name)`` with a name jaxkv does not implement (MXNet raises ``ValueError``)."""


class MissingOptimizerError(KVStoreError, AttributeError):
    """``mx.optimizer.RMSProp`` and the like: MXNet has it, jaxkv does not."""


class OptimizerArgumentError(KVStoreError, TypeError):
    """An argument MXNet's optimizer does not take, or one jaxkv cannot give MXNet's numbers for,
    or a hyperparameter changed after the store compiled it."""


def _available() -> str:
    return ", ".join(repr(n) for n in sorted(_REGISTRY))


def missing(name: str) -> MissingOptimizerError:
    """The error for ``mx.optimizer.<name>``, a name of MXNet's that jaxkv does not provide.

    Args:
      name: the attribute asked for, e.g. ``"RMSProp"``.

    Returns:
      The error to raise, naming it and listing what exists here.
    """
    return MissingOptimizerError(
        f"mx.optimizer.{name}: MXNet 1.9.1 has it, jaxkv does not. jaxkv's MXNet optimizers "
        f"are SGD, Adam and Test (create names: {_available()}); or pass any optax "
        "GradientTransformation to kv.set_optimizer"
    )


def create(name: str, **kwargs: Any) -> Optimizer:
    """An optimizer by name, as ``mx.optimizer.create`` (case-insensitive).

    Args:
      name: ``'sgd'``, ``'adam'`` or ``'ccsgd'`` (MXNet's deprecated alias of SGD), any case.
      **kwargs: the optimizer's arguments.

    Returns:
      The optimizer.

    Raises:
      KVStoreError: (``UnknownOptimizerError``) any other name, such as MXNet's
        ``'rmsprop'`` or ``'nag'``.

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


def _number(owner: str, name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise OptimizerArgumentError(
            f"{owner}: {name} expected a number, given {type(value).__name__} {value!r}"
        )
    return float(value)


# The hyperparameters compiled into a transformation: frozen once it exists.
_HYPERPARAMETERS = frozenset(
    {
        "lr",
        "wd",
        "rescale_grad",
        "clip_gradient",
        "lazy_update",
        "momentum",
        "beta1",
        "beta2",
        "epsilon",
        "begin_num_update",
    }
)


class Optimizer:
    """The base of MXNet's optimizers: the arguments they all take, MXNet 1.9.1's defaults.

    Args:
      rescale_grad: the gradient is multiplied by it first (often ``1 / batch_size``).
      param_idx2name: only ``None`` or ``{}`` (it sets per-parameter weight decay in MXNet).
      wd: weight decay (L2 regularisation) coefficient.
      clip_gradient: clip the (rescaled) gradient to ``[-clip_gradient, clip_gradient]``;
        ``None``, 0 or negative: no clipping (as MXNet).
      learning_rate: the learning rate; ``None``: 0.01 (SGD) as MXNet.
      lr_scheduler: only ``None``.
      sym: only ``None``.
      begin_num_update: the update count each key starts from (Adam's ``t`` is one more at
        its first update).
      multi_precision: only ``False`` (MXNet's float16 master copy is not implemented).
      param_dict: only ``None`` or ``{}``.

    Raises:
      KVStoreError: (``OptimizerArgumentError``) an argument MXNet's optimizers do not take,
        or one whose numbers jaxkv does not reproduce (named in the message).
    """

    _frozen = False
    # Whether a row-sparse gradient updates only its rows: every optimizer here sets it (SGD
    # and Adam take it as an argument, as MXNet's); annotated here for the store.
    lazy_update: bool

    def __init__(
        self,
        rescale_grad: float = 1.0,
        param_idx2name: dict | None = None,
        wd: float = 0.0,
        clip_gradient: float | None = None,
        learning_rate: float | None = None,
        lr_scheduler: object = None,
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
        # (given, its default, whether the given value is harmless)
        checked = {
            "lr_scheduler": (lr_scheduler, None, lr_scheduler is None),
            "sym": (sym, None, sym is None),
            "param_idx2name": (param_idx2name, None, param_idx2name in (None, {})),
            "param_dict": (param_dict, None, param_dict in (None, {})),
            "multi_precision": (multi_precision, False, multi_precision is False),
        }
        for name, (given, default, harmless) in checked.items():
            if not harmless:
                raise OptimizerArgumentError(
                    f"{owner}: {name}={given!r} is not supported by jaxkv (it would not give "
                    f"MXNet's numbers): expected {name}={default!r}"
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
        self.rescale_grad = _number(owner, "rescale_grad", rescale_grad)
        self.wd = _number(owner, "wd", wd)
        self.clip_gradient = (
            None if clip_gradient is None else _number(owner, "clip_gradient", clip_gradient)
        )
        self.lr = 0.01 if learning_rate is None else _number(owner, "learning_rate", learning_rate)
        self.lr_scheduler = None
        self.begin_num_update = begin_num_update
        self.multi_precision = False
        self._transformations: dict[bool, optax.GradientTransformation] = {}

    @classmethod
    def _arguments(cls) -> set[str]:
        names: set[str] = set()
        for klass in cls.__mro__:
            if "__init__" in vars(klass) and issubclass(klass, Optimizer):
                params = inspect.signature(vars(klass)["__init__"]).parameters.values()
                names |= {p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD}
        return names - {"self"}

    def __setattr__(self, name: str, value: object) -> None:
        if self._frozen and name in _HYPERPARAMETERS:
            raise OptimizerArgumentError(
                f"{type(self).__name__}.{name}: cannot change it after the store compiled this "
                "optimizer (kv.set_optimizer, or transformation()): the store would keep the "
                f"old value. Give kv.set_optimizer a new optimizer with {name}={value!r}"
            )
        super().__setattr__(name, value)

    @property
    def learning_rate(self) -> float:
        """The learning rate (MXNet's property; there is no scheduler here)."""
        return self.lr

    def set_learning_rate(self, lr: float) -> None:
        """Set the learning rate, as MXNet, before the store compiles the optimizer.

        Args:
          lr: the new learning rate.
        """
        self.lr = _number(type(self).__name__, "lr", lr)

    def _clip(self) -> float | None:
        # MXNet passes clip_gradient to its kernels only when truthy, and they clip when >= 0.
        c = self.clip_gradient
        return c if c is not None and c > 0 else None

    def transformation(self, *, row_sparse: bool = False) -> optax.GradientTransformation:
        """This optimizer as an optax transformation with MXNet's numbers.

        The first call freezes the hyperparameters; later calls return the same object.

        Args:
          row_sparse: ``False`` for a dense gradient; ``True`` for a row-sparse one, run on
            its rows (``lazy_update=True``) or on the densified gradient (``False``): MXNet's
            row-sparse kernels, which order a few operations differently. Both make the same
            state.

        Returns:
          An ``optax.GradientTransformation``; ``update`` needs ``params`` and is jittable.
        """
        row_sparse = bool(row_sparse)
        if row_sparse not in self._transformations:
            object.__setattr__(self, "_frozen", True)
            self._transformations[row_sparse] = self._build(row_sparse)
        return self._transformations[row_sparse]

    def _build(self, row_sparse: bool) -> optax.GradientTransformation:
        raise NotImplementedError

    def _repr_args(self) -> dict[str, object]:
        return {"learning_rate": self.lr}

    def __repr__(self) -> str:
        args = self._repr_args()
        extra = {
            "wd": (self.wd, 0.0),
            "rescale_grad": (self.rescale_grad, 1.0),
            "clip_gradient": (self.clip_gradient, None),
            "begin_num_update": (self.begin_num_update, 0),
        }
        args.update({k: v for k, (v, default) in extra.items() if v != default})
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in args.items())})"


def _require_params(params: optax.Params | None, owner: str) -> optax.Params:
    if params is None:
        raise KVStoreError(
            f"{owner}: update needs params (weight decay and MXNet's update use the weight): "
            "call update(grads, state, params)"
        )
    return params


def _constant(x: float, dtype: Any) -> np.ndarray:
    """A hyperparameter as MXNet's kernels see it: a C++ float, then cast to the weight's type."""
    return np.asarray(np.float32(x), dtype=dtype)


def _opaque_zero(count: jax.Array) -> jax.Array:
    """An int32 zero that XLA and LLVM cannot see is zero: the count's bit 31 (it is >= 0)."""
    return jax.lax.shift_right_logical(count, jnp.int32(31))


def _rounded(x: jax.Array | np.ndarray, zero: jax.Array) -> jax.Array:
    """``x`` itself, rounded on its own before the sum that uses it.

    XLA fuses a product into the sum or difference that uses it (one FMA, one rounding) on CPUs
    and GPUs that have FMA; MXNet's CPU kernels round the product first. Or-ing the product's
    bits with an opaque zero is free in a fused loop and keeps the two operations apart, so the
    result is MXNet's to the bit under ``jit`` too.
    """
    x = jnp.asarray(x)
    itype = jnp.dtype(f"int{jnp.dtype(x.dtype).itemsize * 8}")
    bits = jax.lax.bitcast_convert_type(x, itype)
    return jax.lax.bitcast_convert_type(bits | zero.astype(itype), x.dtype)


def _next_count(count: jax.Array) -> jax.Array:
    return jnp.where(count < jnp.iinfo(jnp.int32).max, count + 1, count)


def _check_dtypes(params: optax.Params, owner: str) -> None:
    for leaf in jax.tree.leaves(params):
        if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
            raise KVStoreError(
                f"{owner}: expected floating-point parameters, given dtype "
                f"{jnp.result_type(leaf)} (MXNet's optimizers update float weights)"
            )


class SGDState(NamedTuple):
    """The state of :class:`SGD`: the key's update count, and MXNet's ``mom`` if momentum > 0."""

    count: jax.Array  # type: ignore[assignment]  # int32 scalar: updates of this key so far
    momentum: optax.Updates | None  # per parameter (its shape and dtype): w moves by it; or None


class SGD(Optimizer):
    """MXNet's SGD with momentum and weight decay (``mx.optimizer.SGD``).

    With ``lr``, ``wd``, ``rescale_grad``, ``momentum`` and ``clip_gradient`` as float32
    constants (MXNet's kernels take them as C++ floats), a dense gradient does, as MXNet's
    ``multi_sgd_mom_update`` / ``multi_sgd_update`` (the updater's aggregated path)::

        g = lr * clip(rescale_grad * grad, clip_gradient)   # no clip: (lr * rescale_grad) * grad
        mom = momentum * mom - (lr * wd) * weight - g        # without momentum: mom = 0 first
        weight = weight + mom

    A row-sparse gradient (``transformation(row_sparse=True)``) without momentum does, as
    ``sgd_update``'s row-sparse kernel, ``weight = (1 - lr * wd) * weight - g``; with momentum,
    the formula above. The state's momentum is MXNet's ``mom`` (``None`` without momentum).

    ``lazy_update=True`` (default): a row-sparse gradient changes only its rows (weight decay
    and momentum too). ``False``: every row, as a dense gradient with zeros elsewhere.

    Args:
      momentum: the momentum (0: none, and no momentum state).
      lazy_update: whether a row-sparse gradient updates only its rows.
      **kwargs: :class:`Optimizer`'s arguments (``learning_rate`` defaults to 0.01).

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from jaxkv.mx import optimizer
      >>> opt = optimizer.SGD(learning_rate=0.5, momentum=0.9)
      >>> tx = opt.transformation()
      >>> w = jnp.ones(2)
      >>> state = tx.init(w)
      >>> updates, state = tx.update(jnp.array([1.0, -1.0]), state, w)
      >>> optax.apply_updates(w, updates)
      Array([0.5, 1.5], dtype=float32)
    """

    def __init__(self, momentum: float = 0.0, lazy_update: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.momentum = _number("SGD", "momentum", momentum)
        if self.momentum < 0:
            raise OptimizerArgumentError(
                f"SGD: momentum expected >= 0 (MXNet ignores a negative one), given {momentum!r}"
            )
        self.lazy_update = bool(lazy_update)

    def _repr_args(self) -> dict[str, object]:
        return {
            "learning_rate": self.lr,
            "momentum": self.momentum,
            "lazy_update": self.lazy_update,
        }

    def _build(self, row_sparse: bool) -> optax.GradientTransformation:
        lr, wd, rescale, momentum, clip = (
            self.lr,
            self.wd,
            self.rescale_grad,
            self.momentum,
            self._clip(),
        )
        begin = self.begin_num_update
        # MXNet creates the momentum state when momentum != 0 and uses it when > 0.
        has_momentum = momentum > 0

        def step(g: jax.Array, w: jax.Array, z: jax.Array) -> jax.Array:
            """``lr * clip(rescale * g)`` in MXNet's order, rounded."""
            d = w.dtype
            g = g.astype(d)
            if clip is not None:
                c = _constant(clip, d)
                return _rounded(_constant(lr, d) * jnp.clip(_constant(rescale, d) * g, -c, c), z)
            lr_rescale = _constant(lr, d) * _constant(rescale, d)  # float32 product, as C++
            return _rounded(lr_rescale * g, z)

        def decay(w: jax.Array, z: jax.Array) -> jax.Array:
            """``(lr * wd) * w``, rounded."""
            return _rounded(_constant(lr, w.dtype) * _constant(wd, w.dtype) * w, z)

        def dense(g: jax.Array, w: jax.Array, z: jax.Array) -> jax.Array:
            return -decay(w, z) - step(g, w, z)  # multi_sgd: mom = 0*0 - lr*wd*w - g; w + mom

        def sparse(g: jax.Array, w: jax.Array, z: jax.Array) -> jax.Array:
            if wd == 0:  # (1 - lr*0) * w - g: the update is -g, exactly
                return -step(g, w, z)
            one = np.ones((), w.dtype)
            kept = one - _constant(lr, w.dtype) * _constant(wd, w.dtype)
            # sgd_update's (1 - lr*wd)*w - g, as an update: exact unless the step is larger
            # than the weight (then within one ulp of the step).
            return _rounded(_rounded(kept * w, z) - step(g, w, z), z) - w

        def with_momentum(g: jax.Array, m: jax.Array, w: jax.Array, z: jax.Array) -> jax.Array:
            kept = _rounded(_constant(momentum, w.dtype) * m, z)
            return kept - decay(w, z) - step(g, w, z)

        def init(params: optax.Params) -> optax.OptState:
            _check_dtypes(params, "SGD")
            moms = jax.tree.map(jnp.zeros_like, params) if has_momentum else None
            return SGDState(count=jnp.asarray(begin, jnp.int32), momentum=moms)

        def update(
            updates: optax.Updates, state: optax.OptState, params: optax.Params | None = None
        ) -> tuple[optax.Updates, optax.OptState]:
            params = _require_params(params, "SGD")
            z = _opaque_zero(state.count)
            count = _next_count(state.count)
            if not has_momentum:
                plain = sparse if row_sparse else dense
                new = jax.tree.map(lambda g, w: plain(g, w, z), updates, params)
                return new, SGDState(count=count, momentum=None)
            mom = jax.tree.map(lambda g, m, w: with_momentum(g, m, w, z), updates,
                               state.momentum, params)  # fmt: skip
            return mom, SGDState(count=count, momentum=mom)

        return optax.GradientTransformation(init, update)


class ccSGD(SGD):  # noqa: N801 - MXNet's name
    """[DEPRECATED in MXNet] Same as :class:`SGD`."""


class AdamState(NamedTuple):
    """The state of :class:`Adam`: MXNet's per-key update count and the two moments."""

    count: jax.Array  # type: ignore[assignment]  # int32 scalar: updates so far (t - 1 before one)
    mean: optax.Updates  # per parameter: its shape and dtype
    var: optax.Updates  # per parameter: its shape and dtype


class Adam(Optimizer):
    """MXNet's Adam (``mx.optimizer.Adam``).

    At the key's ``t``-th update (``t`` counts from ``begin_num_update + 1``), MXNet's Python
    computes in float64 ``lr_t = lr * sqrt(1 - beta2**t) / (1 - beta1**t)`` and its kernel
    (``adam_update``), in float32::

        g = grad * rescale_grad + weight * wd
        g = clip(g, clip_gradient)                         # if clip_gradient > 0
        mean = beta1 * mean + (1 - beta1) * g
        var = beta2 * var + ((1 - beta2) * g) * g          # row-sparse: see below
        weight = weight - (lr_t * mean) / (sqrt(var) + epsilon)

    jaxkv computes ``lr_t`` in double-float32 arithmetic (about 44 bits), rounded once to
    float32, so it is MXNet's float32 ``lr_t`` except when that lies within about 2**-40 of a
    rounding boundary. Weight decay is added before clipping (unlike SGD), and epsilon is
    outside the square root.

    A row-sparse gradient (``transformation(row_sparse=True)``): with ``lazy_update=True``
    (default) only its rows change (weight, mean, var; weight decay too), and MXNet's kernel
    computes ``(1 - beta2) * (g * g)`` when clipping; with ``lazy_update=False`` every row
    changes (weight decay and the decay of the moments reach the rows the gradient lacks) and
    the kernel computes ``(1 - beta2) * (g * g)``.

    Args:
      learning_rate: the learning rate (default 0.001).
      beta1: decay of the first moment, in [0, 1).
      beta2: decay of the second moment, in [0, 1).
      epsilon: added to ``sqrt(var)``.
      lazy_update: whether a row-sparse gradient updates only its rows.
      **kwargs: :class:`Optimizer`'s arguments.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from jaxkv.mx import optimizer
      >>> tx = optimizer.Adam(learning_rate=0.1).transformation()
      >>> w = jnp.zeros(2)
      >>> updates, state = tx.update(jnp.array([3.0, -0.5]), tx.init(w), w)
      >>> optax.apply_updates(w, updates), state.count  # float32's 1 - beta2: not quite 0.1
      (Array([-0.10000065,  0.1000006 ], dtype=float32), Array(1, dtype=int32))
    """

    def __init__(
        self,
        learning_rate: float = 0.001,
        beta1: float = 0.9,
        beta2: float = 0.999,
        epsilon: float = 1e-8,
        lazy_update: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.beta1 = _number("Adam", "beta1", beta1)
        self.beta2 = _number("Adam", "beta2", beta2)
        self.epsilon = _number("Adam", "epsilon", epsilon)
        for name, beta in (("beta1", self.beta1), ("beta2", self.beta2)):
            if not 0.0 <= beta < 1.0:
                raise OptimizerArgumentError(
                    f"Adam: {name} expected in [0, 1), given {beta!r} (MXNet's bias correction "
                    "divides by zero or takes the root of a negative number)"
                )
        self.lazy_update = bool(lazy_update)

    def _repr_args(self) -> dict[str, object]:
        return {
            "learning_rate": self.lr,
            "beta1": self.beta1,
            "beta2": self.beta2,
            "epsilon": self.epsilon,
            "lazy_update": self.lazy_update,
        }

    def _build(self, row_sparse: bool) -> optax.GradientTransformation:
        lr, wd, rescale, clip = self.lr, self.wd, self.rescale_grad, self._clip()
        beta1, beta2, eps, begin = self.beta1, self.beta2, self.epsilon, self.begin_num_update
        # MXNet's CPU kernels: (1 - beta2) * (g * g) in the standard row-sparse kernel, and in
        # the lazy one when clipping; ((1 - beta2) * g) * g otherwise.
        square_first = row_sparse and (clip is not None or not self.lazy_update)

        def moments(
            g: jax.Array, m: jax.Array, v: jax.Array, w: jax.Array, z: jax.Array
        ) -> tuple[jax.Array, jax.Array]:
            d = w.dtype
            r = lambda x: _rounded(x, z)  # noqa: E731 - each product rounded, as MXNet's
            g = r(g.astype(d) * _constant(rescale, d)) + r(w * _constant(wd, d))
            if clip is not None:
                g = jnp.clip(g, -_constant(clip, d), _constant(clip, d))
            one = np.ones((), d)
            b1, b2 = _constant(beta1, d), _constant(beta2, d)
            m = r(b1 * m) + r((one - b1) * g)
            v = r(b2 * v) + r((one - b2) * (g * g) if square_first else ((one - b2) * g) * g)
            return m, v

        def init(params: optax.Params) -> optax.OptState:
            _check_dtypes(params, "Adam")
            return AdamState(
                count=jnp.asarray(begin, jnp.int32),
                mean=jax.tree.map(jnp.zeros_like, params),
                var=jax.tree.map(jnp.zeros_like, params),
            )

        def update(
            updates: optax.Updates, state: optax.OptState, params: optax.Params | None = None
        ) -> tuple[optax.Updates, optax.OptState]:
            params = _require_params(params, "Adam")
            z = _opaque_zero(state.count)
            t = _next_count(state.count)
            lr_t = _bias_corrected_lr(lr, beta1, beta2, t, z)
            new = jax.tree.map(lambda g, m, v, w: moments(g, m, v, w, z), updates, state.mean,
                               state.var, params)  # fmt: skip
            mean, var = jax.tree.transpose(
                jax.tree.structure(updates), jax.tree.structure((0, 0)), new
            )

            def delta(m: jax.Array, v: jax.Array) -> jax.Array:
                d = m.dtype
                return -((lr_t.astype(d) * m) / (jnp.sqrt(v) + _constant(eps, d)))

            return jax.tree.map(delta, mean, var), AdamState(count=t, mean=mean, var=var)

        return optax.GradientTransformation(init, update)


# -- lr * sqrt(1 - beta2**t) / (1 - beta1**t) in double-float32 -----------------------------
# A value is a pair (hi, lo) of float32 scalars, hi + lo exactly, |lo| <= ulp(hi) / 2: about 44
# bits. Error-free sums and products (Knuth's TwoSum, Dekker's TwoProduct with Veltkamp's split)
# as in Dekker (1971), "A floating-point technique for extending the available precision".
_Pair = tuple[jax.Array, jax.Array]
_SPLIT = np.float32(4097.0)  # 2**12 + 1 splits a float32 into two 12-bit halves


def _pair(x: float) -> _Pair:
    hi = np.float32(x)
    return jnp.asarray(hi), jnp.asarray(np.float32(x - float(hi)))


def _two_sum(a: jax.Array, b: jax.Array, z: jax.Array) -> _Pair:
    s = _rounded(a + b, z)  # opaque: XLA would simplify (a + b) - a to b
    v = _rounded(s - a, z)
    return s, (a - (s - v)) + (b - v)


def _fast_two_sum(a: jax.Array, b: jax.Array, z: jax.Array) -> _Pair:  # |a| >= |b|
    s = _rounded(a + b, z)
    return s, b - (s - a)


def _split(a: jax.Array, z: jax.Array) -> _Pair:
    c = _rounded(_SPLIT * a, z)
    hi = c - _rounded(c - a, z)
    return hi, a - hi


def _two_prod(a: jax.Array, b: jax.Array, z: jax.Array) -> _Pair:
    # Products of the halves are exact, so an FMA there changes nothing; a * b must be rounded.
    p = _rounded(a * b, z)
    ah, al = _split(a, z)
    bh, bl = _split(b, z)
    return p, ((ah * bh - p) + ah * bl + al * bh) + al * bl


def _mul(x: _Pair, y: _Pair, z: jax.Array) -> _Pair:
    p, e = _two_prod(x[0], y[0], z)
    return _fast_two_sum(p, e + (_rounded(x[0] * y[1], z) + _rounded(x[1] * y[0], z)), z)


def _sub(x: _Pair, y: _Pair, z: jax.Array) -> _Pair:
    s, e = _two_sum(x[0], -y[0], z)
    return _fast_two_sum(s, e + (x[1] - y[1]), z)


def _div(x: _Pair, y: _Pair, z: jax.Array) -> _Pair:
    q1 = x[0] / y[0]
    r = _sub(x, _mul(y, (q1, jnp.zeros_like(q1)), z), z)
    return _fast_two_sum(q1, r[0] / y[0], z)


def _sqrt(x: _Pair, z: jax.Array) -> _Pair:
    s = jnp.sqrt(x[0])
    p, e = _two_prod(s, s, z)
    safe = jnp.where(s > 0, s, jnp.ones_like(s))
    r = jnp.where(s > 0, (((x[0] - p) - e) + x[1]) / (2 * safe), jnp.zeros_like(s))
    return _fast_two_sum(s, r, z)


def _power(beta: float, t: jax.Array, z: jax.Array) -> _Pair:
    """``beta ** t`` for a traced int32 ``t >= 1``: the product of ``beta ** (2**k)`` over the
    bits ``k`` of ``t``, those powers computed in float64 here, multiplied pairwise in a tree
    (five vectorised products: a small graph that compiles fast).

    Bits stop where ``beta ** (2**k) < 2**-60``: beyond, ``1 - beta**t`` is 1 in float64.
    """
    powers: list[float] = []
    while len(powers) < 31 and beta ** (2 ** len(powers)) >= 2.0**-60:
        powers.append(beta ** (2 ** len(powers)))
    bits = len(powers)
    size = 1 << max(bits - 1, 0).bit_length()  # a power of two >= bits
    hi = np.ones(size, np.float32)
    lo = np.zeros(size, np.float32)
    for k, p in enumerate(powers):
        hi[k] = np.float32(p)
        lo[k] = np.float32(p - float(hi[k]))
    take = ((t >> jnp.arange(size, dtype=jnp.int32)) & 1) == 1
    acc: _Pair = (jnp.where(take, hi, np.float32(1)), jnp.where(take, lo, np.float32(0)))
    while acc[0].shape[0] > 1:
        acc = _mul((acc[0][0::2], acc[1][0::2]), (acc[0][1::2], acc[1][1::2]), z)
    zero = jnp.zeros((), jnp.float32)
    tiny = t >= 2**bits if bits < 31 else jnp.zeros((), bool)
    return jnp.where(tiny, zero, acc[0][0]), jnp.where(tiny, zero, acc[1][0])


def _bias_corrected_lr(
    lr: float, beta1: float, beta2: float, t: jax.Array, z: jax.Array
) -> jax.Array:
    """MXNet's ``float32(lr * sqrt(1 - beta2**t) / (1 - beta1**t))`` (computed in float64).

    ``z``: an opaque int32 zero (:func:`_opaque_zero`), which keeps XLA from fusing products
    into sums: the error-free transformations need every product rounded.
    """
    one = _pair(1.0)
    c1 = _sub(one, _power(beta1, t, z), z)
    c2 = _sub(one, _power(beta2, t, z), z)
    return _mul(_pair(lr), _div(_sqrt(c2, z), c1, z), z)[0]


class TestState(NamedTuple):
    """The state of :class:`Test`: the key's update count (MXNet keeps a copy of the weight,
    which nothing reads)."""

    count: jax.Array  # type: ignore[assignment]  # int32 scalar: updates of this key so far


class Test(Optimizer):
    """MXNet's ``'test'`` optimizer (``mx.optimizer.Test``), which its own KVStore tests set:
    ``weight += grad * rescale_grad``, ignoring the learning rate, weight decay and clipping.

    A row-sparse gradient adds its rows only (as MXNet's ``weight[:] += grad`` of a row-sparse
    gradient does).

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from jaxkv.mx import optimizer
      >>> tx = optimizer.create("test", rescale_grad=2).transformation()
      >>> w = jnp.ones(2)
      >>> updates, _ = tx.update(jnp.array([1.0, -1.0]), tx.init(w), w)
      >>> optax.apply_updates(w, updates)
      Array([ 3., -1.], dtype=float32)
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.lazy_update = True

    def _repr_args(self) -> dict[str, object]:
        return {}  # it uses none of the learning rate, wd and clipping

    def _build(self, row_sparse: bool) -> optax.GradientTransformation:
        rescale, begin = self.rescale_grad, self.begin_num_update

        def init(params: optax.Params) -> optax.OptState:
            _check_dtypes(params, "Test")
            return TestState(count=jnp.asarray(begin, jnp.int32))

        def update(
            updates: optax.Updates, state: optax.OptState, params: optax.Params | None = None
        ) -> tuple[optax.Updates, optax.OptState]:
            params = _require_params(params, "Test")
            z = _opaque_zero(state.count)
            # MXNet's grad * rescale_grad, rounded on its own, then weight += it.
            new = jax.tree.map(
                lambda g, w: _rounded(g.astype(w.dtype) * _constant(rescale, w.dtype), z),
                updates,
                params,
            )
            return new, TestState(count=_next_count(state.count))

        return optax.GradientTransformation(init, update)


_REGISTRY: dict[str, type[Optimizer]] = {
    "sgd": SGD,
    "adam": Adam,
    "ccsgd": ccSGD,
    "test": Test,
}
