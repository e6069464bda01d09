"""Running an updater: an optax transformation over one optimizer group as one tree, or an
MXNet-style ``updater(key, pushed, stored)`` key by key; the one piece of code the eager push
(``eager.py``) and the push inside the user's trace (``traced.py``) share. Also what is taken
as an updater (an optax wrapper such as ``optax.MultiSteps`` as its transformation), and an
updater's own errors, traced or run, as ``KVStoreError``s naming the keys and the updater."""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import jax
import optax

from jaxkv._src.core.tree_view import inner
from jaxkv._src.errors import KVStoreError, ShapeError, shown
from jaxkv._src.state.kvstate import Key, KVState
from jaxkv._src.state.pairing import as_array

__all__ = [
    "Updater",
    "apply_updater",
    "apply_updates",
    "as_transformation",
    "as_updater",
    "init_state",
    "is_positional",
    "is_pure_updater",
    "optimizer_group",
    "positional",
    "pure_updater",
    "updater_errors",
    "updater_name",
]

_PURE = "__jaxkv_pure_updater__"

# The optax transformations whose numbers do not depend on the keys' names (by id, each kept
# alive while listed; the least recent dropped first): see `positional`.
_POSITIONAL: collections.OrderedDict[int, Any] = collections.OrderedDict()
_POSITIONAL_SIZE = 256


def positional(transformation: Any) -> Any:
    """Mark an optax ``transformation`` as *positional*: its ``init`` and ``update`` treat a
    tree of keys leaf by leaf in the tree's order, never by the keys' names (MXNet's
    optimizers, whose per-key numbers are arguments). A push of it may then run one
    computation for every set of keys of the same shapes and dtypes, the keys renamed by their
    rank. Returns ``transformation``."""
    _POSITIONAL[id(transformation)] = transformation
    _POSITIONAL.move_to_end(id(transformation))
    while len(_POSITIONAL) > _POSITIONAL_SIZE:
        _POSITIONAL.popitem(last=False)
    return transformation


def is_positional(updater: Any) -> bool:
    """Whether ``updater`` gives the same numbers whatever its keys are named: no updater
    (an assignment), or a transformation marked :func:`positional`."""
    return updater is None or _POSITIONAL.get(id(updater)) is updater


def pure_updater(updater: Any) -> Any:
    """Mark ``updater(key, input, stored)`` as pure: it computes its result from its arguments
    only (no Python state, no side effects), so the imperative ``KVStore`` may trace it once
    and compile it, instead of calling it as Python on every push as MXNet does.

    Returns ``updater`` itself; usable as a decorator.

    Examples:
      >>> import jaxkv
      >>> @jaxkv.pure_updater
      ... def update(key, input, stored):
      ...     return stored + 2 * input
      >>> jaxkv.create("local").set_updater(update)
    """
    if not callable(updater):
        raise KVStoreError(
            f"pure_updater: expected a callable updater(key, input, stored), given {updater!r}"
        )
    try:
        setattr(updater, _PURE, True)
    except (AttributeError, TypeError):  # a builtin or a bound method: wrap it
        fn = updater

        def pure(key: Key, pushed: Any, stored: Any) -> Any:
            return fn(key, pushed, stored)

        pure.__qualname__ = getattr(fn, "__qualname__", repr(fn))
        setattr(pure, _PURE, True)
        return pure
    return updater


def is_pure_updater(updater: Any) -> bool:
    """Whether ``updater`` was marked with :func:`pure_updater`."""
    return bool(getattr(updater, _PURE, False))


def _qualname(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def updater_name(updater: Any) -> str:
    """How a message names ``updater``: its qualified name, else its type's; an optax
    transformation by its type and the qualified names of its ``init`` and ``update``
    (``optax.GradientTransformation(init=MultiSteps.init, update=MultiSteps.update)``)."""
    updater = inner(updater)  # the user's own transformation, not the tree's wrapper
    if isinstance(updater, optax.GradientTransformation):
        kind = type(updater).__name__
        return f"optax.{kind}(init={_qualname(updater.init)}, update={_qualname(updater.update)})"
    return _qualname(updater)


def _given(thing: Any) -> str:
    """``thing`` as a message names what was given: its type, then its qualified name (a
    function, a class) or its repr, cut short (``int 3``, ``function <lambda>``)."""
    shown = getattr(thing, "__qualname__", None) or repr(thing)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return f"{type(thing).__name__} {shown}"


# The transformations of wrappers (``optax.MultiSteps``): the same object for the same wrapper,
# so that its pushes find their compiled computations and optimizer states again. The wrapper
# is held beside its transformation, so its id is not reused while it is here.
_WRAPPED: collections.OrderedDict[int, tuple[Any, optax.GradientTransformation]] = (
    collections.OrderedDict()
)
_WRAPPED_MAX = 64
_WRAPPED_LOCK = threading.Lock()


def _transformation_of(wrapper: Any, what: str) -> optax.GradientTransformation | None:
    """``wrapper.gradient_transformation()`` (optax's ``MultiSteps`` and the like), the same
    object for the same wrapper while it is among the last 64; ``None`` if ``wrapper`` has
    no such method."""
    make = getattr(wrapper, "gradient_transformation", None)
    if not callable(make):
        return None
    with _WRAPPED_LOCK:
        known = _WRAPPED.get(id(wrapper))  # (held there: the id is this wrapper's)
        if known is not None:
            _WRAPPED.move_to_end(id(wrapper))
            return known[1]
    try:
        tx = make()
    except Exception as e:
        raise KVStoreError(
            f"{what} {_given(wrapper)}: gradient_transformation() raised {type(e).__name__}: {e}"
        ) from e
    if not isinstance(tx, optax.GradientTransformation):
        raise KVStoreError(
            f"{what} {_given(wrapper)}: gradient_transformation() gave {type(tx).__name__}, "
            "expected an optax.GradientTransformation"
        )
    with _WRAPPED_LOCK:  # (another thread's, made meanwhile, stays the one)
        known = _WRAPPED.setdefault(id(wrapper), (wrapper, tx))
        _WRAPPED.move_to_end(id(wrapper))
        while len(_WRAPPED) > _WRAPPED_MAX:
            _WRAPPED.popitem(last=False)
    return known[1]


_UPDATERS = (
    "None (assign), a callable updater(key, pushed, stored), an optax "
    "GradientTransformation such as optax.sgd(0.1), or an object with a "
    "gradient_transformation() method such as optax.MultiSteps"
)


def as_updater(updater: Any, what: str = "updater") -> Any:
    """``updater`` as a push runs it: ``None``, an optax transformation or a callable as it
    is, and for an optax wrapper that is not a transformation itself (``optax.MultiSteps``)
    the transformation its ``gradient_transformation()`` gives (the same object each time for
    the same wrapper, so its pushes compile once).

    Raises:
      KVStoreError: anything else, naming it and what is accepted (``what`` says which
        argument was given it).
    """
    if updater is None or isinstance(updater, optax.GradientTransformation):
        return updater
    tx = _transformation_of(updater, what)
    if tx is not None:
        return tx
    if callable(updater):
        return updater
    raise KVStoreError(f"{what}: expected {_UPDATERS}, given {_given(updater)}")


def as_transformation(
    optimizer: Any, what: str, example: str = "optax.adam(1e-3)", also: str = ""
) -> optax.GradientTransformation:
    """``optimizer`` as an optax transformation: itself, or what the ``gradient_transformation()``
    of a wrapper (``optax.MultiSteps``) gives, as in :func:`as_updater`.

    Raises:
      KVStoreError: anything else, naming it and what is accepted: ``what`` is the call
        refusing it, ``example`` a transformation to name, ``also`` what else the call takes.
    """
    if isinstance(optimizer, optax.GradientTransformation):
        return optimizer
    tx = _transformation_of(optimizer, what)
    if tx is not None:
        return tx
    raise KVStoreError(
        f"{what}: expected an optax.GradientTransformation such as {example}, "
        f"{also}or an object with a gradient_transformation() method such as "
        f"optax.MultiSteps, given {_given(optimizer)}"
    )


def _keys_named(keys: Sequence[Key], group: bool) -> str:
    if len(keys) == 1 and not group:
        return f"key {keys[0]!r}"
    return f"keys {_group_names(keys)}"


@contextlib.contextmanager
def updater_errors(updater: Any, keys: Sequence[Key], group: bool | None = None) -> Iterator[None]:
    """Any exception that ``updater`` raises inside (traced or run: a Python updater, an
    optax transformation's ``init`` or ``update``) becomes a ``KVStoreError`` naming ``keys``
    and the updater, the original as its ``__cause__``; jaxkv's own ``KVStoreError`` passes
    as it is. ``group``: name the keys as an optimizer group (default: for optax)."""
    try:
        yield
    except KVStoreError:
        raise
    except Exception as e:
        optax_updater = isinstance(updater, optax.GradientTransformation)
        names = _keys_named(list(keys), optax_updater if group is None else group)
        kind = "optimizer" if optax_updater else "updater"
        raise KVStoreError(
            f"{names}: the {kind} {updater_name(updater)} raised {type(e).__name__}: {e}"
        ) from e


def init_state(optimizer: Any, params: dict) -> Any:
    """``optimizer.init(params)``, an exception it raises a ``KVStoreError`` naming the keys
    of ``params`` and the optimizer (:func:`updater_errors`)."""
    with updater_errors(optimizer, list(params), group=True):
        return optimizer.init(params)


class Updater(Protocol):
    """How a pushed value is merged into the stored one.

    Called once per distinct key of a push, inside ``jit``, with the key (a Python ``int`` or
    ``str``), the pushed value summed over devices (already cast to the stored dtype) and the
    stored value; returns the new stored value, of the stored shape. The default is assign.
    An ``optax.GradientTransformation`` may be given instead: the pushed value is then the
    gradient, and the optimizer state is kept in the ``KVState``.
    """

    def __call__(self, key: Key, pushed: jax.Array, stored: jax.Array) -> jax.Array: ...


def _group_names(keys: Sequence[Key]) -> str:
    return "[" + ", ".join(map(repr, keys)) + "]"


def optimizer_group(
    state: KVState, keys: Sequence[Key], unpack: bool = True
) -> tuple[tuple[Key, ...], Any]:
    """The optimizer group an optax push of ``keys`` updates, and its state (``None`` if the
    keys have none yet: they become a new group; with ``unpack=False``, ``True`` in place of
    a state that exists, which under a flat layout would take a computation to unpack).

    An optax push updates the pushed keys as one tree, as ``optax.update`` would. So the
    pushed keys must be exactly one group, or all be without optimizer state; anything else
    is refused, since part of a group's state (a shared step count, a global norm) would
    otherwise be updated for keys that were not pushed.
    """
    keys = tuple(sorted(keys))
    groups = {k: state.opt_group(k) for k in keys}
    if all(g is None for g in groups.values()):
        return keys, None
    group = next(g for g in groups.values() if g is not None)
    if group == keys:
        return group, state.opt_states[group] if unpack else True
    fresh = [k for k, g in groups.items() if g is None]
    others = sorted({g for g in groups.values() if g is not None and g != group})
    given = f"keys {_group_names(keys)}"
    if fresh:
        why = f"keys {_group_names(fresh)} have no optimizer state yet"
    elif others:
        why = f"they span the groups {', '.join(_group_names(g) for g in [group, *others])}"
    else:
        why = f"the group also holds {_group_names([k for k in group if k not in keys])}"
    raise KVStoreError(
        f"{given}: an optax push updates one optimizer group as one tree, expected exactly the "
        f"keys of group {_group_names(group)}, given {_group_names(keys)} ({why}). A group is "
        "the key set of the first optax push of its keys, or of jaxkv.init_optimizer. Push "
        "the same keys together every time (zeros for keys without a gradient), or make the "
        "groups you need with jaxkv.init_optimizer(state, optimizer, keys=...)"
    )


def apply_updates(params: Any, updates: Any) -> Any:
    """``optax.apply_updates``, with an update of a wider float type than its parameter (a
    float32 update of a float16 weight, from a float32 master copy) added in the wider type and
    cast back, whatever JAX's dtype promotion mode (optax's adds them as promotion allows)."""

    def add(p: Any, u: Any) -> Any:
        if p is None:
            return None
        p = jax.numpy.asarray(p)
        u = jax.numpy.asarray(u)
        if (
            u.dtype != p.dtype
            and jax.numpy.issubdtype(p.dtype, jax.numpy.floating)
            and jax.numpy.issubdtype(u.dtype, jax.numpy.floating)
            and u.dtype.itemsize > p.dtype.itemsize
        ):
            return (p.astype(u.dtype) + u).astype(p.dtype)
        return jax.numpy.asarray(p + u).astype(p.dtype)

    return jax.tree.map(add, params, updates, is_leaf=lambda x: x is None)


def apply_updater(
    updater: Any,
    keys: Sequence[Key],
    pushed: Sequence[jax.Array],
    stored: Sequence[jax.Array],
    opt_state: Any,
    extra_args: dict[str, Any] | None = None,
) -> tuple[list[jax.Array], Any]:
    """Run ``updater`` for ``keys``; returns ``(new_values, new_opt_state)``.

    An optax transformation updates the keys as one tree ``{key: value}`` (their group), as
    ``optax.update`` + ``optax.apply_updates`` would, ``extra_args`` passed to its ``update``
    as keyword arguments (optax's ``GradientTransformationExtraArgs``); any other updater runs
    key by key.

    Raises:
      ShapeError: the updater gave a key a value of another shape than the stored one.
      KVStoreError: the updater returned ``None`` or raised (traced or run), naming the keys
        and the updater, the original exception as its ``__cause__``.
    """
    if updater is None:
        new = list(pushed)
    elif isinstance(updater, optax.GradientTransformation):
        params = dict(zip(keys, stored))
        with updater_errors(updater, keys):
            if opt_state is None:
                opt_state = updater.init(params)
            updates, opt_state = updater.update(
                dict(zip(keys, pushed)), opt_state, params, **(extra_args or {})
            )
            result = apply_updates(params, updates)  # updates of a shape that does not add
        new = [result[k] for k in keys]
    else:
        new = []
        for key, p, s in zip(keys, pushed, stored):
            with updater_errors(updater, [key]):
                value = updater(key, p, s)
            if value is None:
                raise KVStoreError(
                    f"key {shown(key)}: the updater {updater_name(updater)} returned None, "
                    "expected the new stored value. MXNet-style in-place updaters (stored += ...) "
                    "work through jaxkv.KVStore; a functional updater must return the new value"
                )
            new.append(value)
    out = []
    for key, value, s in zip(keys, new, stored):
        with updater_errors(updater, [key]):  # a result that is no array
            value = as_array(value)
        if tuple(value.shape) != tuple(s.shape):
            raise ShapeError(
                f"key {shown(key)}: the updater returned shape {tuple(value.shape)}, expected the "
                f"stored shape {tuple(s.shape)} (the updater: {updater_name(updater)})"
            )
        out.append(value.astype(s.dtype))
    return out, opt_state
