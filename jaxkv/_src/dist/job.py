"""Joining a multi-process job: ``python -m jaxkv.launch``, a SLURM or Open MPI job, or an
earlier ``jax.distributed.initialize()``.

The launcher passes the coordinator address, the number of processes, this process's id and
the number of CPU devices per process in ``JAXKV_*`` environment variables; importing jaxkv
then joins the job, before JAX starts its backends. Under SLURM (``srun``) or Open MPI
(``mpirun``) without the launcher, :func:`join_cluster` (a ``dist_sync`` store calls it) joins
through JAX's own cluster detection. Collectives run on JAX's own engines: gloo between CPU
processes, NCCL between GPUs.

Gloo's TCP transport binds to one local address and tells its peers to connect there. JAX
leaves the choice to gloo, which takes what the machine's host name resolves to (often
127.0.0.1 or 127.0.1.1 in /etc/hosts, which peers on other hosts cannot reach). So a joined
process installs JAX's CPU backend with gloo pinned: to the interface named in ``JAXKV_IFNAME``
when it is set, else to the local address of the route toward the coordinator
(:func:`local_address`).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

import jax
import numpy as np

from jaxkv._src import jax_internals as _fast

logger = logging.getLogger("jaxkv")

ENV_COORDINATOR = "JAXKV_COORDINATOR"
ENV_NUM_PROCESSES = "JAXKV_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXKV_PROCESS_ID"
ENV_DEVICES_PER_PROCESS = "JAXKV_DEVICES_PER_PROCESS"
ENV_LOCAL_RANK = "JAXKV_LOCAL_RANK"
ENV_NODE_RANK = "JAXKV_NODE_RANK"
ENV_RESTART_COUNT = "JAXKV_RESTART_COUNT"
ENV_IFNAME = "JAXKV_IFNAME"
ENV_HEARTBEAT_TIMEOUT = "JAXKV_HEARTBEAT_TIMEOUT"
ENV_COLLECTIVE_TIMEOUT = "JAXKV_COLLECTIVE_TIMEOUT"

#: Seconds without a heartbeat after which JAX's coordination service declares a process dead
#: and ends the job (JAX's own default is 100 s). ``JAXKV_HEARTBEAT_TIMEOUT`` overrides it.
DEFAULT_HEARTBEAT_TIMEOUT = 60


def heartbeat_timeout() -> int:
    """The heartbeat timeout in seconds: ``JAXKV_HEARTBEAT_TIMEOUT``, else the default."""
    value = os.environ.get(ENV_HEARTBEAT_TIMEOUT, "")
    return int(value) if value else DEFAULT_HEARTBEAT_TIMEOUT


def split_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[IPV6]:PORT`` as ``(host, port)``."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, given {address!r}")
    return host.strip("[]"), int(port)


def local_address(coordinator: str) -> str:
    """This machine's address on the route toward ``coordinator`` (``HOST:PORT``).

    A UDP socket "connected" to the coordinator sends nothing; the kernel picks the route and
    with it the source address, which ``getsockname`` reads back: 127.0.0.1 for a coordinator on
    this machine, the address of the interface that reaches another host otherwise.
    """
    host, port = split_address(coordinator)
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)
        return s.getsockname()[0]


def gloo_binding(coordinator: str) -> dict[str, str]:
    """How gloo should choose its address: ``{'interface': JAXKV_IFNAME}`` when that is set,
    else ``{'hostname': local_address(coordinator)}``."""
    ifname = os.environ.get(ENV_IFNAME)
    if ifname:
        return {"interface": ifname}
    return {"hostname": local_address(coordinator)}


def pin_gloo(binding: dict[str, str]) -> bool:
    """Make JAX's CPU backend create its gloo collectives with ``binding`` (gloo's ``hostname``
    or ``interface``). Call it after ``jax.distributed.initialize`` and before JAX starts its
    backends. JAX offers no public setting for this, so it replaces the CPU backend's factory
    with JAX's own one given gloo collectives made here (private names: ``_fast.py``); where
    those are missing (another JAX, or ``JAXKV_NO_FAST_PATHS=1``), it logs a warning and leaves
    gloo's default (the host name's address). Returns whether the pin is in place."""
    backend = _fast.gloo_cpu_backend(binding)
    if backend is None:
        logger.warning(
            "jaxkv: cannot choose gloo's address (no such hook in this JAX, or "
            "JAXKV_NO_FAST_PATHS is set); it uses the host name's"
        )
        return False
    from jax.extend.backend import register_backend_factory

    register_backend_factory("cpu", backend, priority=0, fail_quietly=False)
    return True


def _use_gloo() -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")


def exit_on_uncaught_exception() -> None:
    """Make an uncaught exception end this process at once, with status 1, after its traceback.

    A process that has joined a JAX job otherwise waits at exit (JAX's shutdown, run by
    ``atexit``) for every other process to finish, up to 5 minutes, while the others wait for it
    in their next collective: the job hangs. Exiting at once (``os._exit``: atexit handlers do
    not run) lets the launcher see the failure and stop or restart the job.
    """
    import sys

    previous = sys.excepthook

    def hook(
        kind: type[BaseException], value: BaseException, traceback: TracebackType | None
    ) -> None:
        try:
            previous(kind, value, traceback)
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):  # exiting anyway
                    stream.flush()
            os._exit(1)

    sys.excepthook = hook


def join_launched_job() -> None:
    """Initialise ``jax.distributed`` when this process was started by ``jaxkv.launch``."""
    coordinator = os.environ.get(ENV_COORDINATOR)
    if not coordinator or jax.distributed.is_initialized():
        return
    _use_gloo()
    per_process = os.environ.get(ENV_DEVICES_PER_PROCESS)
    if per_process:
        jax.config.update("jax_num_cpu_devices", int(per_process))
    process_id = int(os.environ[ENV_PROCESS_ID])
    binding = gloo_binding(coordinator)
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=int(os.environ[ENV_NUM_PROCESSES]),
        process_id=process_id,
        heartbeat_timeout_seconds=heartbeat_timeout(),
    )
    pin_gloo(binding)
    exit_on_uncaught_exception()
    logger.info("jaxkv: joined %s as process %d, gloo on %s", coordinator, process_id, binding)


def detected_cluster() -> str | None:
    """``'slurm'`` or ``'ompi'`` when this process is one task of several in a SLURM step or an
    Open MPI job (the variables JAX's cluster detection reads), else ``None``."""
    env = os.environ
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_PROCID", "SLURM_LOCALID")
    if all(name in env for name in slurm) and int(env.get("SLURM_NTASKS", "1")) > 1:
        return "slurm"
    if "OMPI_MCA_orte_hnp_uri" in env and int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        return "ompi"
    return None


def join_cluster() -> bool:
    """Join a SLURM or Open MPI job through JAX's cluster detection
    (``jax.distributed.initialize()`` with no arguments), unless ``jax.distributed`` is already
    initialised or no such job is found. Gloo is pinned toward the coordinator JAX picked (the
    step's first node). Returns whether this process is in a multi-process job.

    Raises ``RuntimeError`` (JAX's) when JAX has already started its backends: a job found this
    way must be joined before the first JAX computation.
    """
    if jax.distributed.is_initialized():
        return True
    cluster = detected_cluster()
    if cluster is None:
        return False
    _use_gloo()
    jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat_timeout())
    state = _fast.distributed_state()
    coordinator = getattr(state, "coordinator_address", None)
    if coordinator:
        pin_gloo(gloo_binding(coordinator))
    exit_on_uncaught_exception()
    # (not jax.process_index(): that would start the backends)
    logger.info(
        "jaxkv: joined the %s job as process %s", cluster, getattr(state, "process_id", "?")
    )
    return True


def restart_count() -> int:
    """How many times ``jaxkv.launch --max-restarts`` has restarted this job (0 at first)."""
    return int(os.environ.get(ENV_RESTART_COUNT, "0") or 0)


def process_devices() -> list[jax.Device]:
    """The first device of each process, in process order: where a ``dist_sync`` store keeps
    its values (one copy per process). A push sums the values from a process's devices there
    first, then across processes, so the bytes between processes do not grow with the devices
    in each; a pull copies to the devices asked for."""
    first: dict[int, jax.Device] = {}
    for d in jax.devices():
        first.setdefault(d.process_index, d)
    return [first[i] for i in sorted(first)]


#: Seconds a ``dist_sync`` store's collective may wait for the other processes before this
#: process ends itself (``JAXKV_COLLECTIVE_TIMEOUT`` overrides it; 0 turns the watch off).
DEFAULT_COLLECTIVE_TIMEOUT = 90

#: The exit status of a process whose collective waited longer than that (as ``timeout``'s).
EXIT_HUNG = 124


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
            self._pending.pop(handle or 0, None)

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
            period = min([1.0] + [entry[2] / 4 for _, entry in pending])


def _hung(what: str, waited: float, timeout: float) -> None:
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
        token = _first(value.addressable_shards[0].data)
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
                with watched(what) if watch else contextlib.nullcontext():
                    yield turn
            finally:
                self._last = turn


_ORDER = _Order()


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


def ordered(what: str, fn: Callable[..., Any], *args: Any, spans: bool | None = None) -> Any:
    """``fn(*args)``, a jitted computation; where it runs on other processes' devices too (an
    argument does, or ``spans`` says so), as this process's next collective turn (see
    :class:`_Order`): XLA may add collectives to any computation over several processes'
    devices (resharding an operand, say), not only to those that ask for one."""
    if jax.process_count() == 1:
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


# The host-side collectives: over one device per process (the first), so that a result read on
# this process's device means the whole computation has finished here. JAX's multihost_utils run
# over every device and read the first one's result only: the others' part may still be running
# when they return, and then meet the next collective in either order (a hang, 1 run of 200 of
# the stress test with 3 processes of 2 devices).


@functools.lru_cache(maxsize=1)
def _process_mesh() -> Any:
    from jax.sharding import Mesh

    return Mesh(np.array(process_devices(), dtype=object), ("processes",))


@functools.lru_cache(maxsize=1)
def _host_collectives() -> tuple[Callable, Callable]:
    from jax.sharding import NamedSharding, PartitionSpec

    whole = NamedSharding(_process_mesh(), PartitionSpec())
    add_up = jax.jit(lambda rows: rows.sum(axis=0, dtype=rows.dtype), out_shardings=whole)
    gather = jax.jit(lambda rows: rows, out_shardings=whole)
    return add_up, gather


def _rows(x: np.ndarray) -> jax.Array:
    """A global ``(processes, *x.shape)`` array whose row for this process is ``x``."""
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = _process_mesh()
    home = process_devices()[jax.process_index()]
    sharding = NamedSharding(mesh, PartitionSpec("processes"))
    shape = (jax.process_count(), *x.shape)
    return jax.make_array_from_single_device_arrays(
        shape, sharding, [jax.device_put(x[None], home)]
    )


def _mine(x: jax.Array) -> np.ndarray:
    """This process's copy of a replicated result, as a host array (finished when read)."""
    return np.asarray(x.addressable_shards[0].data)


def all_gather(x: np.ndarray, what: str = "all-gather of every process's values") -> np.ndarray:
    """``x`` (a host array of the same shape and dtype in every process) from every process,
    stacked in process order, after this process's earlier collectives (``what`` names the
    turn for the watchdog)."""
    x = np.asarray(x)
    if jax.process_count() == 1:
        return x[None]
    with collective(what):
        return _mine(_host_collectives()[1](_rows(x)))


def from_rank_zero(tree: Any) -> Any:
    """``tree`` (host arrays) as rank 0 has it, on every process, after this process's earlier
    collectives: bit for bit (the bytes of every leaf, summed with the other processes' zeros
    in one all-reduce)."""
    if jax.process_count() == 1:
        return tree
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    leaves = [np.asarray(x, order="C") for x in leaves]  # (ascontiguousarray: at least 1-d)
    raw = [x.reshape(-1).view(np.uint8) for x in leaves]
    buffer = np.concatenate(raw) if raw else np.zeros(0, np.uint8)
    if jax.process_index() != 0:
        buffer = np.zeros_like(buffer)
    with collective("broadcast of rank 0's values"):
        summed = _mine(_host_collectives()[0](_rows(buffer)))
    out, start = [], 0
    for x, r in zip(leaves, raw):
        out.append(summed[start : start + r.size].view(x.dtype).reshape(x.shape))
        start += r.size
    return jax.tree_util.tree_unflatten(treedef, out)


def barrier(name: str) -> None:
    """Wait until every process reaches this point (a no-op in a single-process job), after
    this process's earlier collectives. Processes that reach barriers of different names are
    refused: they run different code."""
    if jax.process_count() == 1:
        return
    digest = np.frombuffer(hashlib.sha256(name.encode()).digest()[:8], np.uint8)
    every = all_gather(digest, f"barrier ({name})")
    if not (every == digest).all():
        from jaxkv._src.errors import KVStoreError

        raise KVStoreError(
            f"barrier {name!r}: expected every process at this barrier, given processes at "
            "different ones; every process must make the same jaxkv calls in the same order"
        )


join_launched_job()
