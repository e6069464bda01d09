"""Updaters and optax wrappers that fail, shared by the tests of what a push takes as an
updater and of an updater's errors (tests/test_updater_errors.py, tests/test_rows_updaters.py).
The messages name them by these names."""

import jax
import numpy as np
import optax


class NoTransformation:
    """A wrapper whose ``gradient_transformation()`` gives no transformation."""

    def gradient_transformation(self):
        return "not one"

    def __repr__(self):
        return "NoTransformation()"


class BrokenWrapper:
    """A wrapper whose ``gradient_transformation()`` raises."""

    def gradient_transformation(self):
        raise RuntimeError("cannot make one")

    def __repr__(self):
        return "BrokenWrapper()"


#: How the refusal of a wrapper above names it (its type, then its repr), for
#: ``pytest.raises(match=...)``.
WRAPPER_NAMED = r"updater (NoTransformation|BrokenWrapper) \1\(\)"


def update_converting_a_tracer(updates, state, params=None):
    return {k: np.asarray(u) for k, u in updates.items()}, state


def init_raising(params):
    raise ValueError("this optimizer cannot start")


def update_fine(updates, state, params=None):
    return updates, state


def transformation(init, update):
    return optax.GradientTransformation(init, update)


def in_place(update):
    """``update(key, pushed, stored)`` as the imperative store calls its updaters, with NDArray
    handles (named as ``update`` is)."""

    def imperative(key, inp, stored):
        return update(key, inp.asjax(), stored.asjax())

    imperative.__qualname__ = update.__qualname__
    return imperative


#: name: (an optax updater that fails, the name its error gives, the cause's type): in both
#: tests' tables of failing updaters.
FAILING_OPTAX = {
    "optax-tracer": (
        transformation(optax.init_empty_state, update_converting_a_tracer),
        "update_converting_a_tracer",
        jax.errors.TracerArrayConversionError,
    ),
    "optax-init": (transformation(init_raising, update_fine), "init_raising", ValueError),
}
