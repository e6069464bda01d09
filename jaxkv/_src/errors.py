"""The exceptions jaxkv raises.

Every refusal is a :class:`KVStoreError`. Subclasses also derive from the built-in exception an
MXNet or Python user would catch (``KeyError``, ``ValueError``, ``TypeError``), so existing
``except`` clauses keep working. Each message names the key and what was expected versus given.
"""

from __future__ import annotations

from collections.abc import Collection

__all__ = [
    "DiskError",
    "DuplicateKeyError",
    "KVStoreError",
    "KeyTypeError",
    "ShapeError",
    "SumError",
    "UnknownKeyError",
]


class KVStoreError(Exception):
    """Base class of every error jaxkv raises on purpose.

    A call that raises it has changed nothing: the store is exactly as it was before the call.
    """

    def __str__(self) -> str:  # KeyError would otherwise print the repr of the message.
        return str(self.args[0]) if self.args else ""


class UnknownKeyError(KVStoreError, KeyError):
    """A key was used before ``init``."""


class DuplicateKeyError(KVStoreError, KeyError):
    """A key was initialised twice."""


class KeyTypeError(KVStoreError, TypeError):
    """A key is neither ``int`` nor ``str``, or its kind differs from the store's keys."""


class ShapeError(KVStoreError, ValueError):
    """A value or ``out`` has the wrong shape, or lists do not pair up."""


class SumError(KVStoreError):
    """A sum across devices failed its checksum: a collective of the backend gave wrong values
    (verified sums, docs/distributed.md). Unlike other refusals it reports a step that ran."""


class DiskError(KVStoreError, OSError):
    """A file or checkpoint could not be written or read: the message names the path given and
    the OS's reason, and the ``OSError`` is its cause (an ``except OSError`` still catches it)."""


# Tracebacks and reprs name the classes where users import them from (``jaxkv.KVStoreError``).
for _cls in (
    KVStoreError,
    UnknownKeyError,
    DuplicateKeyError,
    KeyTypeError,
    ShapeError,
    SumError,
    DiskError,
):
    _cls.__module__ = "jaxkv"
del _cls


def unknown_key(key: object, known: Collection[int | str]) -> UnknownKeyError:
    shown = sorted(known)[:8]
    more = "" if len(known) <= 8 else f" (and {len(known) - 8} more)"
    return UnknownKeyError(
        f"key {key!r} has not been initialised: expected one of {shown}{more}, "
        f"given {key!r}. Call init({key!r}, value) first."
    )
