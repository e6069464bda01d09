"""The exceptions jaxkv raises.

Every refusal is a :class:`KVStoreError`. Subclasses also derive from the built-in exception an
MXNet or Python user would catch (``KeyError``, ``ValueError``, ``TypeError``), so existing
``except`` clauses keep working. Each message names the key and what was expected versus given.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

# A message's longest size, and a value's longest repr inside one (a key of a million
# characters is named by its start, its end and its length).
_MOST_CHARS = 4000
_MOST_SHOWN = 100

__all__ = [
    "DiskError",
    "DtypeError",
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

    def __init__(self, *args: object) -> None:
        if args and isinstance(args[0], str) and len(args[0]) > _MOST_CHARS:
            args = (_elided(args[0], _MOST_CHARS), *args[1:])
        super().__init__(*args)

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


class DtypeError(KVStoreError, TypeError):
    """A pushed value's dtype is one the key's dtype cannot hold without loss (a float into an
    integer key, ``float32`` into ``float16``): cast it on purpose first."""


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
    DtypeError,
    SumError,
    DiskError,
):
    _cls.__module__ = "jaxkv"
del _cls


def _elided(text: str, most: int) -> str:
    """``text`` itself if short, else its start and end around how much was left out."""
    if len(text) <= most:
        return text
    keep = (most - 40) // 2
    return f"{text[:keep]} ...[{len(text) - 2 * keep} characters]... {text[-keep:]}"


def shown(value: object) -> str:
    """``repr(value)`` for a message: a repr longer than about 100 characters (a key of a
    million characters) shortened to its start and end, with its length."""
    text = repr(value)
    if len(text) <= _MOST_SHOWN:
        return text
    size = len(value) if isinstance(value, str | bytes) else len(text)
    keep = (_MOST_SHOWN - 40) // 2
    return f"{text[:keep]}...{text[-keep:]} ({type(value).__name__} of {size} characters)"


def named(keys: object) -> str:
    """The keys of a call, as a message names them: ``key 'w'`` for one key, ``keys ['a', 'b']``
    for a list, tuple or mapping of them (its first 8, then `` ...``), each :func:`shown`."""
    if isinstance(keys, Mapping):
        keys = list(keys)
    if isinstance(keys, list | tuple):
        more = " ..." if len(keys) > 8 else ""
        return f"keys [{', '.join(shown(k) for k in list(keys)[:8])}{more}]"
    return f"key {shown(keys)}"


def unknown_key(key: object, known: Collection[int | str]) -> UnknownKeyError:
    some = ", ".join(shown(k) for k in sorted(known)[:8])
    more = "" if len(known) <= 8 else f" (and {len(known) - 8} more)"
    return UnknownKeyError(
        f"key {shown(key)} has not been initialised: expected one of [{some}]{more}, "
        f"given {shown(key)}. Call init({shown(key)}, value) first."
    )
