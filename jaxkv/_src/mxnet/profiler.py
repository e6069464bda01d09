"""MXNet's ``mx.profiler`` on ``jax.profiler``: settings, states, dumps and profiling objects."""

from __future__ import annotations

import atexit
import contextlib
import glob
import gzip
import json
import math
import os
import threading
import time
import warnings
from typing import Any

import jax

from jaxkv._src.errors import KVStoreError

__all__ = [
    "Counter",
    "Domain",
    "Event",
    "Frame",
    "Marker",
    "ProfilerArgumentError",
    "ProfilerStateError",
    "Scope",
    "Task",
    "dump",
    "dump_profile",
    "dumps",
    "pause",
    "profiler_set_config",
    "profiler_set_state",
    "resume",
    "set_config",
    "set_state",
]


class ProfilerArgumentError(KVStoreError, ValueError):
    """An argument of ``mx.profiler`` that MXNet refuses, or one jaxkv cannot honour (a
    parameter server's profile); caught as ``mx.MXNetError`` or as ``ValueError``."""


class ProfilerStateError(KVStoreError, RuntimeError):
    """A profiler call out of order: a JAX trace started elsewhere is running, or a profiling
    object is stopped without having been started (or started twice)."""


# MXNet's profiler configuration (its ProfileConfigParam) and its defaults (the memory profile's
# prefix: none, no memory profile).
_DEFAULTS: dict[str, Any] = {
    "filename": "profile.json",
    "gpu_memory_profile_filename_prefix": None,
    "profile_all": False,
    "profile_symbolic": True,
    "profile_imperative": True,
    "profile_memory": True,
    "profile_api": True,
    "continuous_dump": False,
    "dump_period": 1.0,
    "aggregate_stats": False,
    "profile_process": "worker",
}
_STATES = ("stop", "run")
_FORMATS = ("table", "json")
_SORTS = ("total", "avg", "min", "max", "count")
_MARKER_SCOPES = ("global", "process", "thread", "task", "marker")
_COLUMNS = ("Total Count", "Time (ms)", "Min Time (ms)", "Max Time (ms)", "Avg Time (ms)")


def _flag(value: Any) -> bool:
    """A boolean argument as MXNet parses it from its string form (``True``, ``'1'``, ...)."""
    text = str(value).strip().lower()
    if text in ("true", "1"):
        return True
    if text in ("false", "0"):
        return False
    raise ProfilerArgumentError(f"expected a boolean (True or False), given {value!r}")


def _worker(profile_process: Any) -> None:
    if profile_process == "worker":
        return
    if profile_process == "server":
        raise ProfilerArgumentError(
            "profile_process='server': jaxkv has no parameter servers (dist_sync sums with "
            "collectives among the workers), so there is no server to profile; profile the "
            "workers (profile_process='worker', the default): each process writes its own trace"
        )
    raise ProfilerArgumentError(
        f"profile_process: expected 'worker' or 'server', given {profile_process!r}"
    )


class _Profiler:
    """The process's profiler: its configuration, its state, the trace sessions it ran (JAX
    writes a trace only when it stops one, so a pause ends a session and a resume starts the
    next), their events for ``filename`` and their aggregate for :func:`dumps`."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.config = dict(_DEFAULTS)
        self.state = "stop"
        self.paused = False
        self.tracing = False  # a JAX trace session of ours is running
        self.session_start = 0  # its start, ns since the epoch
        self.first_start: int | None = None  # the first session's since the last finished dump
        self.events: list[dict] = []  # their events, times from first_start
        self.described: set[tuple] = set()  # the metadata events among them
        self.groups: dict[Any, str] = {}  # the trace's process names, by pid
        self.stats: dict[tuple[str, str], list[float]] = {}  # count, total, min, max (us)
        self.finished = False  # a finished dump since the last run: the next run starts afresh

    # -- where things go ------------------------------------------------------------------
    def filename(self) -> str:
        """``filename``, with the process index before its extension in a job of several
        processes (each writes its own)."""
        name = os.fspath(self.config["filename"])
        if jax.process_count() == 1:
            return name
        stem, ext = os.path.splitext(name)
        return f"{stem}.{jax.process_index()}{ext}"

    def trace_dir(self) -> str:
        """The directory of JAX's trace (TensorBoard's log directory): ``filename`` without its
        extension (``profile.json``: ``profile/``), or with ``_trace`` added if it has none."""
        name = self.filename()
        stem, ext = os.path.splitext(name)
        return stem if ext else name + "_trace"

    # -- sessions ---------------------------------------------------------------------------
    def start(self) -> None:
        if self.first_start is None or self.finished:
            self.events, self.described, self.first_start = [], set(), None
            self.finished = False
        try:
            jax.profiler.start_trace(self.trace_dir(), create_perfetto_trace=True)
        except RuntimeError as e:
            raise ProfilerStateError(
                f"mx.profiler: could not start a JAX trace ({e}); a JAX trace started elsewhere "
                "(jax.profiler.trace or start_trace) is running: stop it first, then "
                "set_state('run')"
            ) from None
        self.tracing = True
        self.session_start = time.time_ns()
        if self.first_start is None:
            self.first_start = self.session_start
        if not _EXIT_HOOK:  # MXNet writes its profile at exit: so does this
            atexit.register(_at_exit)
            _EXIT_HOOK.append(True)

    def stop(self) -> None:
        """Stop the running session and take in its events."""
        self.tracing = False
        try:
            jax.profiler.stop_trace()
        except RuntimeError as e:
            raise ProfilerStateError(
                f"mx.profiler: the JAX trace it started was stopped elsewhere ({e}); its events "
                "are in the trace directory"
            ) from None
        self.take_in(self.read_session())

    def read_session(self) -> list[dict]:
        """The events of the session just stopped: the newest run in the trace directory."""
        runs = glob.glob(os.path.join(self.trace_dir(), "plugins", "profile", "*", ""))
        if not runs:
            return []
        newest = max(runs, key=os.path.getmtime)
        files = glob.glob(os.path.join(newest, "perfetto_trace.json.gz"))
        files = files or glob.glob(os.path.join(newest, "*.trace.json.gz"))
        if not files:
            return []
        with gzip.open(files[0], "rt") as f:
            return list(json.load(f).get("traceEvents", []))

    def take_in(self, events: list[dict]) -> None:
        assert self.first_start is not None
        shift = (self.session_start - self.first_start) / 1000  # us
        for e in events:
            if e.get("ph") == "M":  # names of processes and threads: once each
                if e.get("name") == "process_name":
                    self.groups[e.get("pid")] = str(e.get("args", {}).get("name", ""))
                described = (e.get("pid"), e.get("tid"), e.get("name"))
                if described not in self.described:
                    self.described.add(described)
                    self.events.append(e)
                continue
            if "ts" in e:
                e = {**e, "ts": e["ts"] + shift}
            self.events.append(e)
            if e.get("ph") != "X" or str(e.get("name", "")).startswith("$"):
                continue  # Python functions (JAX's Python tracer): in the trace, not in dumps
            group = self.groups.get(e.get("pid"), "")
            dur = float(e.get("dur", 0.0))
            entry = self.stats.get((group, e["name"]))
            if entry is None:
                self.stats[(group, e["name"])] = [1, dur, dur, dur]
            else:
                entry[0] += 1
                entry[1] += dur
                entry[2] = min(entry[2], dur)
                entry[3] = max(entry[3], dur)

    def write(self) -> None:
        """Write ``filename``: every event since the first session, as a Chrome trace."""
        name = self.filename()
        folder = os.path.dirname(name)
        if folder:
            os.makedirs(folder, exist_ok=True)
        with open(name, "w") as f:
            json.dump({"traceEvents": self.events, "displayTimeUnit": "ms"}, f)
        prefix = self.config["gpu_memory_profile_filename_prefix"]
        memory = _flag(self.config["profile_all"]) or _flag(self.config["profile_memory"])
        if prefix is not None and memory:
            prefix = os.fspath(prefix)
            if jax.process_count() > 1:
                prefix = f"{prefix}.{jax.process_index()}"
            if os.path.dirname(prefix):
                os.makedirs(os.path.dirname(prefix), exist_ok=True)
            jax.profiler.save_device_memory_profile(prefix + ".prof")


_PROFILER = _Profiler()
_EXIT_HOOK: list[bool] = []  # whether the exit hook is registered (once per process)


def _at_exit() -> None:
    with contextlib.suppress(Exception):
        if _PROFILER.state == "run":
            set_state("stop")


def set_config(**kwargs: Any) -> None:
    """Configure the profiler, as MXNet's ``mx.profiler.set_config`` (keyword arguments only).

    jaxkv's profiler is JAX's (``jax.profiler``): a trace records the host's Python and every
    XLA computation and op on every device, with jaxkv's work under named scopes
    (``jaxkv.sum``, ``jaxkv.compress``, ``jaxkv.updater``, ``jaxkv.rows.route``, ...).

    Args:
      filename: the Chrome trace (JSON) written when the profiler stops or dumps (default
        ``'profile.json'``): open it in ``chrome://tracing`` or https://ui.perfetto.dev. JAX's
        whole trace (``.xplane.pb`` for TensorBoard's profile plugin and XProf) goes to a
        directory beside it, ``filename`` without its extension (``profile/``). In a job of
        several processes, each process writes its own: ``profile.1.json``, ``profile.1/``.
      gpu_memory_profile_filename_prefix: where given (and ``profile_memory`` or
        ``profile_all`` is on, as by MXNet's default), a snapshot of the live device buffers
        (JAX's device memory profile, pprof format) is written at each stop or dump, to this
        prefix plus ``'.prof'``. Not given: none.
      profile_all, profile_symbolic, profile_imperative, profile_memory, profile_api: accepted;
        a JAX trace records everything it can, whichever is set.
      continuous_dump, dump_period: accepted; JAX writes a trace only when it stops, so
        ``filename`` is written by ``set_state('stop')``, :func:`dump` and at exit.
      aggregate_stats: accepted; :func:`dumps` always has the statistics of what was recorded.
      profile_process: ``'worker'`` (the default); ``'server'`` is refused (no servers here).

    Raises:
      ProfilerArgumentError: an argument MXNet does not have (MXNet refuses it too), a
        non-boolean flag, or ``profile_process='server'``.
      ProfilerStateError: while the profiler runs (MXNet applies a new configuration to the
        next run; stop it first).

    Examples:
      >>> import jaxkv.mx as mx
      >>> mx.profiler.set_config(profile_all=True, filename="trace.json", aggregate_stats=True)
      >>> mx.profiler.set_config(profile_all=False, filename="profile.json")  # MXNet's defaults
    """
    unknown = sorted(set(kwargs) - set(_DEFAULTS))
    if unknown:
        raise ProfilerArgumentError(
            f"mx.profiler.set_config: unknown argument {unknown[0]!r}; expected some of "
            f"{', '.join(_DEFAULTS)}"
        )
    for name, value in kwargs.items():
        if isinstance(_DEFAULTS[name], bool) and name != "profile_process":
            try:
                _flag(value)
            except ProfilerArgumentError as e:
                raise ProfilerArgumentError(f"mx.profiler.set_config: {name}: {e}") from None
    if "dump_period" in kwargs:
        try:
            period = float(kwargs["dump_period"])
        except (TypeError, ValueError):
            period = math.nan
        if not period >= 0:
            raise ProfilerArgumentError(
                f"mx.profiler.set_config: dump_period: expected seconds >= 0, given "
                f"{kwargs['dump_period']!r}"
            )
    for name in ("filename", "gpu_memory_profile_filename_prefix"):
        given = kwargs.get(name, "path")
        if not isinstance(given, str | os.PathLike) or not os.fspath(given):
            raise ProfilerArgumentError(
                f"mx.profiler.set_config: {name}: expected a path, given {given!r}"
            )
    _worker(kwargs.get("profile_process", "worker"))
    with _PROFILER.lock:
        if _PROFILER.state == "run":
            raise ProfilerStateError(
                "mx.profiler.set_config while the profiler runs: call "
                "mx.profiler.set_state('stop') first"
            )
        _PROFILER.config.update(kwargs)
        _PROFILER.first_start = None  # a new configuration starts a new profile


def set_state(state: str = "stop", profile_process: str = "worker") -> None:
    """Start (``'run'``) or stop (``'stop'``) the profiler: ``jax.profiler.start_trace`` into
    the trace directory (see :func:`set_config`), or ``stop_trace``, after which ``filename``
    holds every event since the profiler first ran (or since the last :func:`dump`).

    Raises:
      ProfilerArgumentError: a state other than ``'run'`` or ``'stop'``, or
        ``profile_process='server'``.
      ProfilerStateError: ``'run'`` while a JAX trace started elsewhere runs.
    """
    if state not in _STATES:
        raise ProfilerArgumentError(
            f"mx.profiler.set_state: expected 'run' or 'stop', given {state!r}"
        )
    _worker(profile_process)
    with _PROFILER.lock:
        if state == _PROFILER.state:
            return
        if state == "run":
            _PROFILER.start()
            _PROFILER.state, _PROFILER.paused = "run", False
            return
        _PROFILER.state, _PROFILER.paused = "stop", False
        if _PROFILER.tracing:
            _PROFILER.stop()
        _PROFILER.write()


def dump(finished: bool = True, profile_process: str = "worker") -> None:
    """Write the profile to ``filename`` now (see :func:`set_config`).

    JAX writes a trace only when it stops one: a running profiler is stopped, and with
    ``finished=False`` started again at once (its next events go to a new run in the trace
    directory, and to ``filename`` at the next dump). With ``finished=True`` (MXNet's default)
    the profiler stays stopped, and the next ``set_state('run')`` begins a new profile.

    Raises:
      ProfilerArgumentError: ``profile_process='server'``.
    """
    _worker(profile_process)
    with _PROFILER.lock:
        running = _PROFILER.tracing
        if running:
            _PROFILER.stop()
        _PROFILER.write()
        if finished is True:
            _PROFILER.state, _PROFILER.paused = "stop", False
            _PROFILER.finished = True
        elif running:
            _PROFILER.start()


def dumps(
    reset: bool = False, format: str = "table", sort_by: str = "total", ascending: bool = False
) -> str:
    """Statistics of the events recorded so far, as MXNet's aggregate table: per group of the
    trace (``/host:CPU``, a device) and event name, how often it ran and its total, least,
    greatest and average time in milliseconds.

    They cover the trace sessions that have ended: JAX hands out a trace's events when it stops
    it, so a running profiler's current session is not in them (:func:`pause` or
    ``set_state('stop')`` first). The Python functions JAX's tracer records are in the trace,
    not here.

    Args:
      reset: clear the statistics after this call.
      format: ``'table'`` (text) or ``'json'`` (``{"Time": {group: {name: {...}}},
        "Unit": {"Time": "ms"}}``).
      sort_by: ``'total'``, ``'avg'``, ``'min'``, ``'max'`` or ``'count'``.
      ascending: sort ascending.

    Raises:
      ProfilerArgumentError: another ``format``, ``sort_by``, ``reset`` or ``ascending`` (MXNet
        asserts the same).
    """
    if format not in _FORMATS:
        raise ProfilerArgumentError(
            f"mx.profiler.dumps: format: expected 'table' or 'json', given {format!r}"
        )
    if sort_by not in _SORTS:
        raise ProfilerArgumentError(
            f"mx.profiler.dumps: sort_by: expected one of {', '.join(_SORTS)}, given {sort_by!r}"
        )
    for name, value in (("reset", reset), ("ascending", ascending)):
        if value not in (False, True):
            raise ProfilerArgumentError(
                f"mx.profiler.dumps: {name}: expected False or True, given {value!r}"
            )
    with _PROFILER.lock:
        stats = dict(_PROFILER.stats)
        running = _PROFILER.tracing
        if reset:
            _PROFILER.stats = {}
    column = {"count": 0, "total": 1, "min": 2, "max": 3}

    def key(item: tuple[tuple[str, str], list[float]]) -> float:
        entry = item[1]
        return entry[1] / entry[0] if sort_by == "avg" else entry[column[sort_by]]

    groups: dict[str, list[tuple[str, list[float]]]] = {}
    for (group, name), entry in sorted(stats.items(), key=key, reverse=not ascending):
        groups.setdefault(group, []).append((name, entry))
    if format == "json":
        return json.dumps(
            {
                "Time": {
                    group: {
                        name: dict(zip(_COLUMNS, _row(entry), strict=True)) for name, entry in rows
                    }
                    for group, rows in sorted(groups.items())
                },
                "Unit": {"Time": "ms"},
            }
        )
    lines = ["Profile Statistics:", "\tNote the difference in units for different entries."]
    if running:
        lines.append("\t(The running trace session is not included: JAX hands out a trace's")
        lines.append("\tevents when it stops it; mx.profiler.pause() or set_state('stop') first.)")
    if not groups:
        lines.append("\t(No events recorded yet: mx.profiler.set_state('run') ... 'stop'.)")
    width = min(80, max([40, *(len(name) + 2 for rows in groups.values() for name, _ in rows)]))
    for group, rows in sorted(groups.items()):
        lines += ["", group or "(unnamed)", "=" * 17]
        lines.append("Name".ljust(width) + "".join(c.rjust(17) for c in _COLUMNS))
        lines.append("----".ljust(width) + "".join(("-" * len(c)).rjust(17) for c in _COLUMNS))
        for name, entry in rows:
            count, *times = _row(entry)
            cells = [str(count).rjust(17)] + [f"{t:.4f}".rjust(17) for t in times]
            lines.append(name.ljust(width) + "".join(cells))
    return "\n".join(lines) + "\n"


def _row(entry: list[float]) -> tuple[int, float, float, float, float]:
    """A statistics entry (count, total, min, max in us) as MXNet's columns, in ms."""
    count, total, low, high = entry
    return int(count), total / 1000, low / 1000, high / 1000, total / count / 1000


def pause(profile_process: str = "worker") -> None:
    """Pause a running profiler: JAX's trace session ends (its events are kept for
    ``filename`` and :func:`dumps`) until :func:`resume` starts the next. Nothing when the
    profiler is stopped or paused.

    Raises:
      ProfilerArgumentError: ``profile_process='server'``.
    """
    _worker(profile_process)
    with _PROFILER.lock:
        if _PROFILER.state == "run" and not _PROFILER.paused:
            _PROFILER.paused = True
            if _PROFILER.tracing:
                _PROFILER.stop()


def resume(profile_process: str = "worker") -> None:
    """Resume a paused profiler: a new JAX trace session, a new run in the trace directory.
    Nothing when the profiler is not paused.

    Raises:
      ProfilerArgumentError: ``profile_process='server'``.
      ProfilerStateError: a JAX trace started elsewhere runs.
    """
    _worker(profile_process)
    with _PROFILER.lock:
        if _PROFILER.state == "run" and _PROFILER.paused:
            _PROFILER.start()
            _PROFILER.paused = False


def profiler_set_config(mode: str = "symbolic", filename: str = "profile.json") -> None:
    """MXNet's deprecated form of :func:`set_config` (``mode``: ``'symbolic'`` or ``'all'``)."""
    warnings.warn(
        "profiler.profiler_set_config() is deprecated. Please use profiler.set_config() instead",
        DeprecationWarning,
        stacklevel=2,
    )
    if mode not in ("symbolic", "all", "imperative", "api", "memory"):
        raise ProfilerArgumentError(
            f"mx.profiler.profiler_set_config: mode: expected 'symbolic' or 'all', given {mode!r}"
        )
    set_config(**{f"profile_{mode}": True, "filename": filename})


def profiler_set_state(state: str = "stop") -> None:
    """MXNet's deprecated form of :func:`set_state`."""
    warnings.warn(
        "profiler.profiler_set_state() is deprecated. Please use profiler.set_state() instead",
        DeprecationWarning,
        stacklevel=2,
    )
    set_state(state)


def dump_profile() -> None:
    """MXNet's deprecated form of :func:`dump`."""
    warnings.warn(
        "profiler.dump_profile() is deprecated. Please use profiler.dump() instead",
        DeprecationWarning,
        stacklevel=2,
    )
    dump(True)


# -- profiling objects ---------------------------------------------------------------------


class Domain:
    """A category for profiling objects (MXNet's ``Domain``): recorded as the ``domain``
    argument of their events.

    Examples:
      >>> import jaxkv.mx as mx
      >>> task = mx.profiler.Domain("training").new_task("step")
      >>> task.start()
      >>> task.stop()
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return self.name

    def new_task(self, name: str) -> Task:
        """A :class:`Task` of this domain."""
        return Task(self, name)

    def new_frame(self, name: str) -> Frame:
        """A :class:`Frame` of this domain."""
        return Frame(self, name)

    def new_counter(self, name: str, value: int | None = None) -> Counter:
        """A :class:`Counter` of this domain."""
        return Counter(self, name, value)

    def new_marker(self, name: str) -> Marker:
        """A :class:`Marker` of this domain."""
        return Marker(self, name)


class _Duration:
    """An event from ``start()`` to ``stop()``: a ``jax.profiler.TraceAnnotation``, which
    the trace records when a JAX trace runs (else it costs next to nothing). Start and stop it
    on one thread."""

    def __init__(self, name: str, **args: str) -> None:
        self.name = name
        self._args = args
        self._open: jax.profiler.TraceAnnotation | None = None

    def start(self) -> None:
        """Start the event."""
        if self._open is not None:
            raise ProfilerStateError(f"{self.name!r}: already started; stop() it first")
        self._open = jax.profiler.TraceAnnotation(self.name, **self._args)
        self._open.__enter__()

    def stop(self) -> None:
        """End the event."""
        if self._open is None:
            raise ProfilerStateError(f"{self.name!r}: stop() without start()")
        opened, self._open = self._open, None
        opened.__exit__(None, None, None)

    def __str__(self) -> str:
        return self.name


class Task(_Duration):
    """MXNet's ``Task``: a unit of work between ``start()`` and ``stop()``, recorded as
    an event named ``name`` with its ``domain``."""

    def __init__(self, domain: Domain, name: str) -> None:
        super().__init__(name, domain=str(domain))


class Frame(_Duration):
    """MXNet's ``Frame``: a period between ``start()`` and ``stop()`` (VTune shows frames
    apart; a JAX trace records it as an event, as a :class:`Task`)."""

    def __init__(self, domain: Domain, name: str) -> None:
        super().__init__(name, domain=str(domain))


class Event(_Duration):
    """MXNet's ``Event``: a region between ``start()`` and ``stop()``, with no domain."""

    def __init__(self, name: str) -> None:
        super().__init__(name)


def _instant(name: str, **args: str) -> None:
    """A zero-length event in the trace (JAX's public API has no instant or counter events)."""
    with jax.profiler.TraceAnnotation(name, **args):
        pass


class Counter:
    """MXNet's ``Counter``: a value kept on the host; each change is recorded as a zero-length
    event named ``name`` carrying the new ``value`` (a JAX trace has no counter tracks)."""

    def __init__(self, domain: Domain, name: str, value: int | None = None) -> None:
        self.name = name
        self.domain = domain
        self.value = 0
        if value is not None:
            self.set_value(value)

    def set_value(self, value: int) -> None:
        """Set the counter."""
        self.value = int(value)
        _instant(self.name, domain=str(self.domain), value=str(self.value))

    def increment(self, delta: int = 1) -> None:
        """Add ``delta``."""
        self.set_value(self.value + int(delta))

    def decrement(self, delta: int = 1) -> None:
        """Subtract ``delta``."""
        self.set_value(self.value - int(delta))

    def __iadd__(self, delta: int) -> Counter:
        self.increment(delta)
        return self

    def __isub__(self, delta: int) -> Counter:
        self.decrement(delta)
        return self

    def __str__(self) -> str:
        return self.name


class Marker:
    """MXNet's ``Marker``: :meth:`mark` records an instant, a zero-length event named
    ``name`` with its domain and scope."""

    def __init__(self, domain: Domain, name: str) -> None:
        self.name = name
        self.domain = domain

    def mark(self, scope: str = "process") -> None:
        """Mark the instant; ``scope``: ``'global'``, ``'process'``, ``'thread'``, ``'task'``
        or ``'marker'`` (recorded, as MXNet's, for the viewer).

        Raises:
          ProfilerArgumentError: another scope.
        """
        if scope not in _MARKER_SCOPES:
            raise ProfilerArgumentError(
                f"Marker {self.name!r}: scope: expected one of {', '.join(_MARKER_SCOPES)}, "
                f"given {scope!r}"
            )
        _instant(self.name, domain=str(self.domain), scope=scope)


class Scope:
    """MXNet's ``Scope`` (``with mx.profiler.Scope('layer1'):``): MXNet names the GPU memory
    allocated inside it; here the code inside runs under ``jax.named_scope`` (in a function
    ``jax.jit`` traces, the ops inside carry the name in their HLO op names:
    ``jit(f)/layer1/mul``) and a ``jax.profiler.TraceAnnotation`` (its time on the host is an
    event named after the whole scope, ``outer/inner``).

    Names end with ``':'`` as MXNet's do; with ``append_mode`` the enclosing scope's name comes
    first (``'outer:inner:'``).

    Examples:
      >>> import jax, jax.numpy as jnp, jaxkv.mx as mx
      >>> def f(x):
      ...     with mx.profiler.Scope("layer1") as scope:
      ...         return x * 2
      >>> "layer1/mul" in jax.jit(f).lower(jnp.ones(2)).as_text(debug_info=True)
      True
    """

    _current = threading.local()

    def __init__(self, name: str = "<unk>:", append_mode: bool = False) -> None:
        self.name = name
        self._append_mode = append_mode
        self._old: Scope | None = None
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> Scope:
        self._old = getattr(Scope._current, "value", None)
        given = self.name.rstrip(":") or "<unk>"
        if self._append_mode and self._old is not None and self._old.name != "<unk>:":
            self.name = self._old.name + self.name
        if not self.name.endswith(":"):
            self.name += ":"
        stack = contextlib.ExitStack()
        stack.enter_context(jax.named_scope(given))
        # "a:b" would show as "b" (the trace reads "name:type"): "a/b", as JAX's scopes.
        shown = self.name.rstrip(":").replace(":", "/")
        stack.enter_context(jax.profiler.TraceAnnotation(shown))
        self._stack = stack
        Scope._current.value = self
        return self

    def __exit__(self, *exc: object) -> None:
        Scope._current.value = self._old
        if self._stack is not None:
            self._stack.close()
            self._stack = None
