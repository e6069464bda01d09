"""Row pushes across processes agreed inside their own computation: the one push kept between
host agreements, its class, and each process's words (``kernels.agreed``).

A row operation across processes is agreed by one host all-gather before its computation
(``ops._agreed``: refusals, counts, routes, numbers, key). Where a functional ``push_rows`` or
``pushpull_rows`` of one key (or an imperative store's held push of rows run by its
``row_sparse_pull``) is agreed so twice in a row, its class is kept: the padded count
of ids per device, the slots of each route, whether the pushed ids come back. The next push of
that key then skips the host agreement: every process runs the computation of that class at
once, its words behind its rows in the first all-to-all (its status, the class, digests of the
key, of the updater's numbers and of the calls an imperative store held before the push, which
it makes in its own computation or runs after it), and each owner updates only where every
process agrees;
every device returns the same verdict, read on the host before anything else runs. Where they
did not agree (a count outgrew the class, a process refused its arguments or made another
call, the key or the numbers differ), nothing changed, and every process makes the host
agreement, which raises as it always did, or agrees anew, and the push runs as before.

Every process must start each row operation alike, the computation or the host all-gather,
or they wait in collectives that never meet. So the choice rests only on what every process
holds alike: the one class kept, set and forgotten at host agreements (every process gathers
the same values), never on the key a process pushes (processes pushing different keys, one
kept and one not, would start differently). While a class is kept, every row operation that
is not that push (another key, a pull, an imperative store's, a refusal) starts with that
push's computation too, with rows that select nothing and its status saying so
(``ops._meet``): the very program of that push on the process's own table, since JAX 0.12
pairs only one program's collectives across processes (a call on a store that does not hold
the table meets nothing: in one program, neither do the others'); then comes its host
agreement, which forgets the push.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from jaxkv._src.rows.kernels import AGREE

__all__ = [
    "AGREE",
    "OTHER",
    "Class",
    "Kept",
    "agreed_push",
    "agreeing",
    "failed",
    "kept_push",
    "site",
    "words",
]

#: A process's status, the first of its words: it runs the push kept (``kernels.AGREE``) or
#: not: another call, a refusal, or ids that outgrew the class.
OTHER = 1

#: Whether pushes start with their computation (tests compare both ways; set it alike on
#: every process, before the first push).
ENABLED = True


class Class(NamedTuple):
    """A push's size class: ``n`` ids per device (padded), ``c`` slots per route, and whether
    the pushed ids come back (``back``)."""

    n: int
    c: int
    back: bool


class Kept(NamedTuple):
    """The push kept between host agreements: its ``site`` (:func:`site`), what its
    computation is made of besides the table (the key, the updater, whether it donates, its
    extra arguments as given: their types shape the program) and its class.
    Another process meets it by running that same computation, since JAX 0.12 pairs only the
    collectives of one compiled program across processes."""

    site: tuple
    key: Any
    updater: Any
    donate: bool
    extra: dict[str, Any]
    cls: Class
    # The dense pushes held before it that its computation makes too (an imperative store's:
    # ``kernels.Dense`` and their numbers, whose shape the program takes), or None.
    dense: tuple | None = None


_kept: Kept | None = None
_largest: dict[tuple, Class] = {}  # each site's largest class kept yet (never shrinks)
_last: tuple | None = None  # the push agreed at the last host agreement (a site), if one was
_before: tuple | None = None  # the one agreed at the host agreement before the last


def site(devices: tuple, key: Any, shape: tuple[int, ...], dtype: Any) -> tuple:
    """What names a push of rows of ``key`` (a table of ``shape`` and ``dtype``) on a store
    over ``devices``."""
    return (tuple(d.id for d in devices), repr(key), tuple(shape), np.dtype(dtype).name)


def kept_push(where: tuple) -> Kept | None:
    """The push kept, if it is the one at ``where`` (a site)."""
    return _kept if ENABLED and _kept is not None and _kept.site == where else None


def agreeing(meet: Callable[[Kept], None]) -> None:
    """At the start of every host agreement of a row operation across processes: where a push
    is kept, meet the others in its computation (``meet(kept)``: they may be running it), and
    forget it."""
    global _kept, _last, _before
    was, _kept = _kept, None
    _before, _last = _last, None
    if was is not None:
        meet(was)


def agreed_push(where: tuple, keep: Kept | None) -> None:
    """After a host agreement of a functional push at ``where`` (the same on every process):
    keep it (``keep``: its computation and class, ``None`` where it cannot start so) where the
    agreement before was one of the same push, its class grown to the largest kept for it
    yet (a count that varies from step to step then outgrows it a few times only)."""
    global _kept, _last
    if keep is not None and ENABLED and _before == where:
        cls = keep.cls
        was = _largest.get(where)
        if was is not None and was.back == cls.back:  # (a class only grows: fewer misses)
            cls = Class(max(was.n, cls.n), max(was.c, cls.c), cls.back)
        if len(_largest) >= 1024:  # (stores long gone: start again, alike on every process)
            _largest.clear()
        _largest[where] = cls
        _kept = keep._replace(cls=cls)
    _last = where


def failed(where: tuple) -> None:
    """After the push kept at ``where`` ran and the processes did not agree: forget it (the
    host agreement comes next, and keeps it again where it agrees)."""
    global _kept, _last
    _kept = None
    _last = where


def words(
    status: int, cls: Class, named: np.ndarray, numbers: np.ndarray, held: np.ndarray
) -> np.ndarray:
    """A process's ``int32`` words: its status, the class, and the digests of the key
    (``named``), of the updater's extra arguments (``numbers``) and of the calls an
    imperative store held before the push (``held``; zeros for none), 4 ``int64`` each."""
    head = np.array([status, cls.n, cls.c, int(cls.back)], np.int32)
    digests = np.concatenate([named, numbers, held]).astype(np.int64)
    return np.concatenate([head, digests.view(np.int32)])
