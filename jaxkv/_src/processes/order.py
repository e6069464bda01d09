"""The one order of a process's collectives across processes, and the watchdog that ends a
process whose collective waits too long for the others.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax

from jaxkv._src.jax_internals import no_frames_in_locations, per_device

logger = logging.getLogger("jaxkv")


ENV_COLLECTIVE_TIMEOUT = "JAXKV_COLLECTIVE_TIMEOUT"


#: Seconds a ``dist_sync`` store's collective may wait for the other processes before this
#: process ends itself (``JAXKV_COLLECTIVE_TIMEOUT`` overrides it; 0 turns the watch off).
DEFAULT_COLLECTIVE_TIMEOUT = 90


#: The exit status of a process whose collective waited longer than that (as ``timeout``'s).
EXIT_HUNG = 124

#: The start of what a process logs when a collective has waited half the timeout (then
#: :data:`FINISHED` once it finishes), and when it timed out (:data:`TIMED_OUT`, then it exits
#: with :data:`EXIT_HUNG`). The launcher reads them (unresponsive.py): a process that had not
#: said it was waiting when another's collective timed out is the one the others waited for.
WAITING = re.compile(rb"jaxkv: process \d+: a (.+?) has waited \d+ s, half of ")
FINISHED = re.compile(rb"jaxkv: process \d+: a (.+?) finished after \d+ s")
TIMED_OUT = re.compile(rb"jaxkv: process \d+: a (.+?) has waited (\d+) s for the other processes")


def collective_timeout() -> float:
    """The collective timeout in seconds: ``JAXKV_COLLECTIVE_TIMEOUT``, else the default."""
    value = os.environ.get(ENV_COLLECTIVE_TIMEOUT, "")
    return float(value) if value else DEFAULT_COLLECTIVE_TIMEOUT


class _Watchdog:
    """Ends this process when one of its collectives waits too long for the other processes.

    JAX's heartbeats catch a process that stopped (SIGSTOP, a frozen machine), but not one that
    is alive and never reaches the next collective (a deadlock, an endless loop): the others
    would wait for it for ever. Each ``dist_sync`` push, barrier and broadcast is watched from a
    daemon thread; one still unfinished after :func:`collective_timeout` seconds logs why and
    exits the process with :data:`EXIT_HUNG`, so that ``jaxkv.launch`` stops (or restarts) the
    whole job, the hung process included.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # handle -> (what, when it started, the timeout it was armed with, whether it is done)
        self._pending: dict[int, tuple[str, float, float, Callable[[], bool]]] = {}
        self._count = 0
        self._warned: set[int] = set()  # the handles that have waited half their timeout
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    def watch(self, what: str, done: Callable[[], bool]) -> int | None:
        """Watch an operation that is finished once ``done()`` is true; returns its handle, or
        ``None`` where nothing is watched (one process, or the timeout set to 0)."""
        timeout = collective_timeout()
        if jax.process_count() == 1 or timeout <= 0:
            return None
        with self._lock:
            self._count += 1
            self._pending[self._count] = (what, time.monotonic(), timeout, done)
            if self._thread is None and not self._stopping.is_set():
                self._thread = threading.Thread(target=self._run, name="jaxkv-watchdog")
                self._thread.daemon = True
                self._thread.start()
                # Registered after JAX's own clean-up (at its import), so it runs before it.
                atexit.register(self.stop)
            return self._count

    def forget(self, handle: int | None) -> None:
        with self._lock:
            entry = self._pending.pop(handle or 0, None)
            warned = (handle or 0) in self._warned
            self._warned.discard(handle or 0)
        if entry is not None and warned:  # said it was waiting: now it is not
            logger.warning(
                "jaxkv: process %d: a %s finished after %.0f s",
                jax.process_index(),
                entry[0],
                time.monotonic() - entry[1],
            )

    def stop(self) -> None:
        """End the thread as the process ends (an ``atexit`` handler), before JAX shuts down.

        A daemon thread still running at the interpreter's end is ended where it next takes
        the GIL, and one asking jaxlib whether an array is ready while JAX clears its backends
        (its own ``atexit`` clean-up) fails inside jaxlib: either way the whole process aborted
        ("FATAL: exception not rethrown", SIGABRT) after the job had succeeded (seen once in
        CI, in tests/test_dist_stress.py).
        """
        self._stopping.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)

    def _run(self) -> None:
        period = 1.0
        while not self._stopping.wait(period):
            with self._lock:
                pending = list(self._pending.items())
            now = time.monotonic()
            for handle, (what, start, timeout, done) in pending:
                if done():
                    self.forget(handle)
                elif now - start > timeout:
                    _hung(what, now - start, timeout)
                elif now - start > timeout / 2:
                    self._half_way(handle, what, now - start, timeout)
            period = min([1.0] + [entry[2] / 4 for _, entry in pending])

    def _half_way(self, handle: int, what: str, waited: float, timeout: float) -> None:
        """Say, once, that a collective still pending has waited half its timeout."""
        with self._lock:
            if handle not in self._pending or handle in self._warned:
                return
            self._warned.add(handle)
        logger.warning(
            "jaxkv: process %d: a %s has waited %.0f s, half of %s=%g, for the other processes",
            jax.process_index(),
            what,
            waited,
            ENV_COLLECTIVE_TIMEOUT,
            timeout,
        )


def _hung(what: str, waited: float, timeout: float) -> None:
    # The launcher reads its start (TIMED_OUT).
    message = (
        f"jaxkv: process {jax.process_index()}: a {what} has waited {waited:.0f} s for the "
        f"other processes ({ENV_COLLECTIVE_TIMEOUT}={timeout:g}); one of them is hung or far "
        "behind. Ending this process (status 124) so that the launcher stops or restarts the "
        f"job. If some processes legitimately run that much longer between steps (e.g. an "
        f"evaluation on rank 0 only), raise {ENV_COLLECTIVE_TIMEOUT}; 0 turns this off."
    )
    logger.error(message)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # exiting anyway
            stream.flush()
    os._exit(EXIT_HUNG)


_WATCHDOG = _Watchdog()


@jax.jit
def _first(x: jax.Array) -> jax.Array:
    """A tiny array of its own that is ready only once ``x`` is."""
    return x.reshape(-1)[:1]


@contextlib.contextmanager
def watched(what: str) -> Iterator[None]:
    """Watch a blocking call made in the ``with`` block (see :class:`_Watchdog`)."""
    finished = threading.Event()
    handle = _WATCHDOG.watch(what, finished.is_set)
    try:
        yield
    finally:
        finished.set()
        _WATCHDOG.forget(handle)


class _Turn:
    """One turn in :data:`_ORDER`: what runs in it, and how to say that it dispatched an
    asynchronous computation."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.token: jax.Array | None = None

    def issued(self, value: jax.Array) -> None:
        """The computation of this turn that makes ``value`` runs asynchronously: the next
        turn waits until ``value`` is ready, and the watchdog watches it meanwhile."""
        if jax.process_count() == 1:
            return
        # A token of our own: ``value`` itself may be donated to the next computation, and
        # asking a deleted array whether it is ready is not safe.
        token = _first(per_device(value)[0])  # (addressable_shards: ~0.1 ms more a turn)
        self.token = token
        if collective_timeout() > 0:
            _WATCHDOG.watch(self.what, token.is_ready)


class _Order:
    """The one order of this process's collectives.

    XLA:CPU runs computations that do not depend on each other's results in any order, and at
    the same time, on its threads; two computations with collectives among the same devices
    may then reach gloo in one order in one process and in the other order in another (a
    collective mismatch: gloo aborts, "Received data size doesn't match expected size", or
    both wait for ever), even though every process dispatched them in the same order. So every
    jaxkv computation that may communicate with other processes, and every host-side
    collective (barrier, broadcast, all-gather), takes a turn: it starts only once the one
    before it in this process has finished. Every process calls jaxkv in the same order, so
    the collectives run in that order everywhere. One lock makes the turns of several threads
    one sequence too (their order across processes is then the caller's to keep).
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._last: _Turn | None = None
        self._inside = threading.local()  # .depth: the turns this thread is inside

    @contextlib.contextmanager
    def turn(self, what: str, watch: bool) -> Iterator[_Turn]:
        """Wait until the previous turn's computations have finished, then run the ``with``
        block as the next turn (watched by the watchdog while it blocks, if ``watch``)."""
        with self._lock:
            last, self._last = self._last, None
            if last is not None and last.token is not None:
                last.token.block_until_ready()  # watched since it was issued
            turn = _Turn(what)
            try:
                _turned()
            except BaseException:
                self._last = turn
                raise
            inside = self._inside
            inside.depth = getattr(inside, "depth", 0) + 1
            try:
                # (no stack frames in what it traces: callers differ from process to process,
                # and each process must compile one program: jax_internals)
                with watched(what) if watch else contextlib.nullcontext(), no_frames_in_locations():
                    yield turn
            finally:
                inside.depth -= 1
                self._last = turn

    def in_turn(self) -> bool:
        return getattr(self._inside, "depth", 0) > 0


_ORDER = _Order()

# Called at each collective turn, once the turns before it have finished (in one process,
# before each jaxkv computation): the host's comparison of the checks that came back as
# outputs (core/checked.py).
_ON_TURN: list[Callable[[], None]] = []


def on_turn(fn: Callable[[], None]) -> None:
    """Call ``fn()`` at each collective turn once the turns before it have finished (in one
    process, before each jaxkv computation); its errors are the call's."""
    _ON_TURN.append(fn)


def _turned() -> None:
    for fn in _ON_TURN:
        fn()


@contextlib.contextmanager
def collective(what: str, watch: bool = True) -> Iterator[_Turn]:
    """Run the ``with`` block as this process's next collective turn (see :class:`_Order`):
    after every earlier jaxkv computation that communicates with other processes has
    finished. A computation it dispatches that runs on asynchronously is registered with
    ``turn.issued(result)``. ``watch=False``: the block may legitimately take long (a whole
    checkpoint save), so only the collectives inside it, each a turn of its own, are watched.
    In a single-process job it only runs the block."""
    if jax.process_count() == 1:
        yield _Turn(what)
        return
    with _ORDER.turn(what, watch) as turn:
        yield turn


def in_turn() -> bool:
    """Whether this thread runs inside a collective turn now (always, in one process)."""
    return jax.process_count() == 1 or _ORDER.in_turn()


def ordered(what: str, fn: Callable[..., Any], *args: Any, spans: bool | None = None) -> Any:
    """``fn(*args)``, a jitted computation; where it runs on other processes' devices too (an
    argument does, or ``spans`` says so), as this process's next collective turn (see
    :class:`_Order`): XLA may add collectives to any computation over several processes'
    devices (resharding an operand, say), not only to those that ask for one."""
    if jax.process_count() == 1:
        _turned()  # (across processes, at the turns: after the ones before have finished)
        return fn(*args)
    if spans is None:
        spans = any(
            isinstance(x, jax.Array) and not x.is_fully_addressable
            for x in jax.tree_util.tree_leaves(args)
        )
    if not spans:
        return fn(*args)
    with collective(what) as turn:
        out = fn(*args)
        results = [x for x in jax.tree_util.tree_leaves(out) if isinstance(x, jax.Array)]
        if results:
            turn.issued(results[0])
    return out


def put(x: Any, sharding: Any) -> Any:
    """``jax.device_put(x, sharding)``; where a sharding spans several processes, as this
    process's next collective turn (see :class:`_Order`). JAX puts host values (NumPy, Python
    numbers, uncommitted arrays) on the devices of several processes only once it has checked
    that every process passes the same value: an all-gather across the processes, a collective
    of its own. Outside a turn it could meet a collective of an earlier computation still
    running in another process (seen: gloo's "Received data size doesn't match expected size"
    in a 3-process job of random calls, once computations ran on asynchronously)."""
    if jax.process_count() > 1 and not all(
        s.is_fully_addressable for s in jax.tree_util.tree_leaves(sharding)
    ):
        # (JAX waits for its check's result on the host; the transfer after it is each
        # process's own: no later turn need wait for it)
        with collective("put"):
            return jax.device_put(x, sharding)
    return jax.device_put(x, sharding)
