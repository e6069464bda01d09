"""jaxkv's own computations whose sums' checks come back as outputs, compared on the host.

A verified sum's check (``verified.py``) inside a user's ``jit`` calls the host only when a
part is off, from a conditional. A host callback anywhere in a computation makes XLA:CPU run
it synchronously at dispatch, across processes: the host waits for the whole computation
(and for the other processes) at every call, where it would go on with the next call's work.
Measured on this machine, 2 processes of one CPU device: a jitted all-reduce with such a
conditional took 4.8 ms to dispatch, one without 0.14 ms; MXNet's embedding loop on
``dist_sync``, 14.8 ms a step with the checks, 12.2 ms without.

So jaxkv's own eager computations (built with :func:`jit`, their ``shard_map``\\ s with
:func:`shard_map`) have no callback: each check's verdict (whether a part is off, and the
checksums that say where) is an output, and the count of runs that picks the slice checked is
an argument, as is a digest of the keys of the call that dispatched it (:func:`digest`: the
checks compare it across devices, where processes pushing different keys met in one sum). The
host compares them once the computation has finished (:func:`settle`): at this process's next
collective turn (``order.py``: every process reaches it at the same call, waits there for every
verdict pending, and has the same all-gathered checksums, so every process raises the same
``SumError``; in one process, at any jaxkv computation after it), at a read of an MXNet out
(``asnumpy``, ``wait_to_read``, ``nd.waitall``), and at the process's exit (the error logged,
exit status 1), so a wrong sum is raised at the next call of jaxkv after the push that made
it.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import contextvars
import functools
import hashlib
import itertools
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

from jaxkv._src.errors import SumError, named
from jaxkv._src.processes import order

__all__ = [
    "collecting",
    "digest",
    "jit",
    "keys_digest",
    "named_now",
    "naming",
    "settle",
    "shard_map",
    "turn",
]

logger = logging.getLogger("jaxkv")

# The traces being built: .jit, the run's count of each jaxkv computation being traced (its
# argument) and the verdicts found in it; .map, the same for each shard_map body inside it.
_traces = threading.local()


class _Trace:
    __slots__ = ("turn", "found")

    def __init__(self, turn: Any) -> None:
        self.turn = turn
        # each check's verdict: (off, arrays, compares): whether a part is off, the arrays its
        # compares read on the host, one compare per pair of arrays (verified._compare)
        self.found: list[tuple[Any, list[Any], list[Callable]]] = []


@contextlib.contextmanager
def _tracing(kind: str, turn: Any) -> Iterator[_Trace]:
    stack = _traces.__dict__.setdefault(kind, [])
    trace = _Trace(turn)
    stack.append(trace)
    try:
        yield trace
    finally:
        stack.pop()


def _innermost(kind: str) -> _Trace | None:
    stack = getattr(_traces, kind, None)
    return stack[-1] if stack else None


# The keys of the call dispatching jaxkv's computations now (see naming).
_naming: contextvars.ContextVar[Any] = contextvars.ContextVar("jaxkv_naming", default=None)


@contextlib.contextmanager
def naming(keys: Any) -> Iterator[None]:
    """The computations dispatched in the ``with`` block are for ``keys`` (a key, a list of
    them, or a mapping or tree by key): a wrong sum's ``SumError`` names them, found at a later
    call (a computation is shared by every key of its shapes: its trace cannot name them)."""
    token = _naming.set(keys)
    try:
        yield
    finally:
        _naming.reset(token)


def named_now() -> str | None:
    """The keys of the call dispatching now (:func:`naming`), as a message names them."""
    keys = _naming.get()
    return None if keys is None else named(keys)


def collecting() -> bool:
    """Whether a check traced now is in the ``shard_map`` of a jaxkv computation built with
    :func:`jit` (its verdict an output: :func:`found`), not in a user's ``jit``."""
    return _innermost("map") is not None


def turn() -> Any:
    """The run's count of the jaxkv computation being traced (inside its ``shard_map``)."""
    trace = _innermost("map")
    assert trace is not None, "turn() is read only where collecting() is true"
    return trace.turn[0]


def keys_digest() -> Any:
    """The digest of the keys this run of the jaxkv computation being traced is for (inside
    its ``shard_map``; :func:`digest`), an argument of the computation as its count is."""
    trace = _innermost("map")
    assert trace is not None, "keys_digest() is read only where collecting() is true"
    return trace.turn[1]


def digest(keys: Any) -> int:
    """The keys of a call (:func:`naming`; ``None``: none named) as a number below 2**24 (a
    ``float32`` holds it exactly), the same for the same keys in any order: the checks of a
    computation's sums compare it across processes (``verified.py``), where two processes
    pushing different keys of one shape would meet in one sum."""
    if keys is None:
        return 0
    if isinstance(keys, Mapping):
        keys = list(keys)
    listed = list(keys) if isinstance(keys, list | tuple) else [keys]
    text = "\0".join(sorted(repr(k) for k in listed)).encode()
    return 1 + int.from_bytes(hashlib.sha256(text).digest()[:3], "little") % (2**24 - 1)


def found(off: Any, arrays: list[Any], compares: list[Callable]) -> None:
    """A check's verdict in the ``shard_map`` being traced: an output of the computation."""
    trace = _innermost("map")
    assert trace is not None, "found() is called only where collecting() is true"
    trace.found.append((off, arrays, compares))


def shard_map(body: Callable, *, mesh: Any, in_specs: Any, out_specs: Any, **kw: Any) -> Callable:
    """``jax.shard_map(body, ...)``; called inside a computation built with :func:`jit`, the
    verdicts of the checks traced in ``body`` are also outputs (one row per device) and the
    run's count an input, passed on to that computation."""
    plain = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **kw)
    every = PartitionSpec(tuple(mesh.axis_names))  # each device's copy, side by side

    def call(*args: Any) -> Any:
        outer = _innermost("jit")
        if outer is None:
            return plain(*args)
        compares: list[list[Callable]] = []

        def wrapped(count: Any, args: tuple) -> tuple[Any, list]:
            with _tracing("map", count) as trace:
                out = body(*args)
            compares[:] = [c for _, _, c in trace.found]
            rows = [(off[None], [a[None] for a in arrays]) for off, arrays, _ in trace.found]
            return out, rows

        mapped = jax.shard_map(
            wrapped,
            mesh=mesh,
            in_specs=(PartitionSpec(), in_specs),
            out_specs=(out_specs, every),
            **kw,
        )
        out, rows = mapped(outer.turn, args)
        for (off, arrays), c in zip(rows, compares):
            outer.found.append((off, arrays, c))
        return out

    return call


class _Checked:
    """A jitted jaxkv computation whose checks' verdicts come back as outputs (see the module
    doc): called as the function it wraps; each call's verdicts wait for :func:`settle`."""

    def __init__(self, fn: Callable, every: int, donate: tuple, static: tuple, kw: dict) -> None:
        self.runs = itertools.count()  # (next() of it is one step: threads count apart)
        self.every = every
        self.compares: dict[tuple, list[list[Callable]]] = {}
        # A computation with no check (its first trace finds none: a row kernel with no sum)
        # is a plain jit, with no count and no verdicts to pass: set at the first call.
        self.plain: Callable | None = None
        self.decided = False
        self.plain_jit = functools.partial(
            jax.jit, fn, donate_argnums=donate, static_argnums=static, **kw
        )

        def traced(count: Any, *args: Any) -> tuple[Any, list]:
            with _tracing("jit", count) as trace:
                out = fn(*args)
            verdicts = [(off, arrays) for off, arrays, _ in trace.found]
            self.compares[_shapes(verdicts)] = [c for _, _, c in trace.found]
            return out, verdicts

        if "out_shardings" in kw:  # (the verdicts placed where XLA puts them)
            kw = {**kw, "out_shardings": (kw["out_shardings"], None)}
        self.jitted = jax.jit(
            traced,
            donate_argnums=tuple(n + 1 for n in donate),
            static_argnums=tuple(n + 1 for n in static),
            **kw,
        )

    def __call__(self, *args: Any) -> Any:
        if self.plain is not None:
            return self.plain(*args)
        if not self.decided:
            self._decide(args)
            if self.plain is not None:
                return self.plain(*args)
        if jax.process_count() == 1:  # (across processes, at the turns: see settle)
            settle()  # the earlier runs' verdicts, where they have finished
        keys = _naming.get()
        # The run's count and its keys' digest (the checks compare it across processes).
        count = np.array(
            [next(self.runs) % self.every if self.every > 1 else 0, digest(keys)], np.int32
        )
        out, verdicts = self.jitted(count, *args)
        if verdicts:
            compares = self.compares.get(_shapes(verdicts), [])
            _pending.append((verdicts, compares, keys))
        return out

    def _decide(self, args: tuple) -> None:
        """At the first call: trace (not compile) the computation; where no check is traced
        in it, it is a plain jit from now on. A later call whose trace would hold a check (other
        shapes taking another branch) then checks it with the host callback, as inside a user's
        ``jit``: checked still, only slower."""
        _, verdicts = self.jitted.trace(np.zeros(2, np.int32), *args).out_info
        if not verdicts:
            self.plain = self.plain_jit()
        self.decided = True


def _shapes(verdicts: list) -> tuple:
    return tuple(
        (tuple(off.shape), tuple(tuple(a.shape) for a in arrays)) for off, arrays in verdicts
    )


def jit(
    fn: Callable,
    every: int,
    *,
    donate_argnums: int | tuple[int, ...] = (),
    static_argnums: int | tuple[int, ...] = (),
    **kw: Any,
) -> Callable:
    """``jax.jit(fn, ...)`` of one of jaxkv's own computations; where sums are checked
    (``every``: ``verified.verify_every()``, above 0), their checks' verdicts come back as
    outputs, compared on the host by :func:`settle`, and the run's count is an argument."""
    donate = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
    static = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
    if every <= 0:
        return jax.jit(fn, donate_argnums=donate, static_argnums=static, **kw)
    return _Checked(fn, every, donate, static, kw)


# Each call's verdicts, oldest first, until compared: (verdicts, compares).
_pending: collections.deque = collections.deque()
_settling = threading.Lock()


def settle(wait: bool = False) -> None:
    """Compare the verdicts of the checked computations that have finished (every one, once
    finished, where ``wait``), oldest first: a part off raises ``SumError`` (as the check's
    host callback would) and the others are compared at a later call. Across processes it
    runs at each collective turn, once the turns before it have finished: every process then
    compares the same computations' verdicts (whatever else has finished), and raises alike."""
    with _settling:
        waiting: collections.deque = collections.deque()
        try:
            while _pending:
                verdicts, compares, keys = entry = _pending.popleft()
                if not wait and not all(off.is_ready() for off, _ in verdicts):
                    waiting.append(entry)  # (compared at a later call)
                    continue
                _compare(verdicts, compares, keys)
        finally:
            _pending.extendleft(reversed(waiting))


def _compare(verdicts: list, compares: list, keys: Any = None) -> None:
    """One computation's verdicts, on the host: the first part off raises, naming ``keys``
    (:func:`naming`) where the call named them."""
    for (off, arrays), checks in zip(verdicts, compares):
        if not np.asarray(off.addressable_shards[0].data).any():
            continue
        host = [np.asarray(a.addressable_shards[0].data)[0] for a in arrays]
        for j, compare in enumerate(checks):
            try:
                compare(host[2 * j], host[2 * j + 1])
            except SumError as e:
                if keys is None:
                    raise
                raise SumError(f"{named(keys)}: {e}") from None


def _at_turn() -> None:
    """At a collective turn: across processes every verdict still pending, waited for (those of
    the turns before it have finished, so the wait is for none of them in practice): a process
    that went on where its verdict was not yet ready would skip the error the others raise,
    and wait alone in the collective they never reach. In one process, those finished."""
    settle(wait=jax.process_count() > 1)


order.on_turn(_at_turn)


def _at_exit() -> None:
    """At the process's exit, the verdicts still pending: a wrong sum ends the process with
    status 1 (its error logged), as a host callback's error would have."""
    try:
        settle(wait=True)
    except Exception as e:  # noqa: BLE001 - reported, then the exit says so
        logger.error("jaxkv: %s", e)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(1)


atexit.register(_at_exit)
