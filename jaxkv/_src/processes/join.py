"""Joining a multi-process job: ``python -m jaxkv.launch``, a SLURM or Open MPI job, or an
earlier ``jax.distributed.initialize()``.

The launcher passes the coordinator address, the number of processes, this process's id and the
number of CPU devices per process in ``JAXKV_*`` environment variables; importing jaxkv in such a
process joins the job (``jaxkv/__init__.py`` calls :func:`join_launched_job` first), before JAX
starts its backends. Importing this module joins nothing. In a job JAX's own cluster detection
finds without the launcher (SLURM's ``srun``, Open MPI's ``mpirun``, Cloud TPU, Kubernetes: the
environments of JAX's ``ClusterEnv``), :func:`join_cluster` (a ``dist_sync`` store calls it)
joins through that detection. Collectives run on JAX's own engines: gloo between CPU
processes, NCCL between GPUs.

Gloo's TCP transport binds to one local address and tells its peers to connect there. JAX
leaves the choice to gloo, which takes what the machine's host name resolves to (often
127.0.0.1 or 127.0.1.1 in /etc/hosts, which peers on other hosts cannot reach). So a joined
process installs JAX's CPU backend with gloo pinned: to the interface named in ``JAXKV_IFNAME``
when it is set, else to the local address of the route toward the coordinator
(:func:`local_address`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
from types import TracebackType

import jax

from jaxkv._src import jax_internals

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


ENV_COMPILATION_CACHE = "JAXKV_COMPILATION_CACHE"


#: The first JAX release seen to hang a job of several processes in its first collective when
#: some of its processes load that computation from JAX's persistent compilation cache and the
#: others compile it: from it on, the cache's key holds each process's own topology, and only
#: process 0 writes entries, so once the cache is warm process 0 loads every computation and
#: the others compile theirs, and the two do not meet (gloo, CPU; seen with JAX 0.12.1 in a
#: plain ``shard_map`` of one ``psum``, all-gather or reduce-scatter run twice with one cache
#: folder, no jaxkv; JAX 0.10.2 and 0.11.2 run the reduce-scatter's twice).
CACHE_HANGS_FROM = (0, 12)


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
    with JAX's own one given gloo collectives made here (private names: ``jax_internals.py``); where
    those are missing (another JAX, or ``JAXKV_NO_FAST_PATHS=1``), it logs a warning and leaves
    gloo's default (the host name's address). Returns whether the pin is in place."""
    backend = jax_internals.gloo_cpu_backend(binding)
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


def _jax_release() -> tuple[int, ...]:
    """JAX's version as numbers: ``(0, 12, 1)``."""
    info = getattr(jax, "__version_info__", None)
    if info is not None:
        return tuple(int(x) for x in info[:3])
    return tuple(int(x) for x in jax.__version__.split(".")[:3] if x.isdigit())


def _cache_folder() -> str | None:
    """The folder of JAX's persistent compilation cache set so far, or ``None``."""
    folder = getattr(jax.config, "jax_compilation_cache_dir", None)
    return folder or os.environ.get("JAX_COMPILATION_CACHE_DIR") or None


def no_mixed_compilation_cache(num_processes: int) -> bool:
    """In a job of several processes, with a JAX from :data:`CACHE_HANGS_FROM` on, turn JAX's
    persistent compilation cache off in this process (``jax_enable_compilation_cache``), before
    anything is compiled: with it on, once the cache is warm (a job run again, or restarted by
    ``jaxkv.launch --max-restarts``) process 0 loads each computation from it and the others
    compile theirs, and the job hangs in its first collective. Said at WARNING where a cache
    folder is set (each process then compiles what it runs), else at INFO (a folder set later
    is not used); ``JAXKV_COMPILATION_CACHE=keep`` keeps the cache on. Returns whether it was
    turned off."""
    if num_processes < 2 or _jax_release() < CACHE_HANGS_FROM:
        return False
    if os.environ.get(ENV_COMPILATION_CACHE, "").strip().lower() == "keep":
        return False
    if not getattr(jax.config, "jax_enable_compilation_cache", True):
        return False
    jax.config.update("jax_enable_compilation_cache", False)
    folder = _cache_folder()
    (logger.warning if folder else logger.info)(
        "jaxkv: JAX's persistent compilation cache (%s) is off in this job of %d "
        "processes: with JAX %s, once the cache is warm process 0 loads each computation "
        "from it and the other processes compile theirs, and the job hangs in its first "
        "collective. Each process compiles what it runs; %s=keep keeps the cache on.",
        folder or "no folder set yet",
        num_processes,
        jax.__version__,
        ENV_COMPILATION_CACHE,
    )
    return True


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
    num_processes = int(os.environ[ENV_NUM_PROCESSES])
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=num_processes,
        process_id=process_id,
        heartbeat_timeout_seconds=heartbeat_timeout(),
    )
    no_mixed_compilation_cache(num_processes)
    pin_gloo(binding)
    exit_on_uncaught_exception()
    logger.info("jaxkv: joined %s as process %d, gloo on %s", coordinator, process_id, binding)


def detected_cluster() -> str | None:
    """The cluster environment JAX's own detection finds (``'slurm'``, ``'ompi'``, ``'k8s'``,
    ...) when this process is one task of several there, else ``None``: JAX's ``ClusterEnv``
    environments, tried in JAX's order, where jaxkv may use them
    (:func:`jaxkv._src.jax_internals.cluster_environments`); else SLURM's and Open MPI's
    variables, read here."""
    environments = jax_internals.cluster_environments()
    if environments is None:
        return _from_variables()
    for env in environments:
        try:
            if not env.is_env_present():
                continue
            several = env.get_process_count() > 1
        except Exception:  # an environment JAX cannot read in full: not a job to join
            logger.info("jaxkv: %s found but not readable: joining nothing", env.__name__)
            return None
        return _short_name(env.__name__) if several else None
    return None


def _short_name(name: str) -> str:
    """A cluster environment's short name: ``SlurmCluster`` -> ``'slurm'``."""
    return name.removesuffix("Cluster").lower() or name.lower()


def _from_variables() -> str | None:
    """:func:`detected_cluster` by the variables of SLURM (``srun``) and Open MPI
    (``mpirun``), the environments JAX's detection reads them from."""
    env = os.environ
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_PROCID", "SLURM_LOCALID")
    if all(name in env for name in slurm) and int(env.get("SLURM_NTASKS", "1")) > 1:
        return "slurm"
    if "OMPI_MCA_orte_hnp_uri" in env and int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        return "ompi"
    return None


def join_cluster() -> bool:
    """Join a job JAX's cluster detection finds (:func:`detected_cluster`) through it
    (``jax.distributed.initialize()`` with no arguments), unless ``jax.distributed`` is already
    initialised or no such job is found. Gloo is pinned toward the coordinator JAX picked (the
    step's first node). Returns whether this process is in a multi-process job.

    Raises ``RuntimeError`` (JAX's) when JAX has already started its backends: a job found this
    way must be joined before the first JAX computation.
    """
    join_launched_job()  # (the launcher joined its processes already: a no-op then)
    if jax.distributed.is_initialized():
        return True
    cluster = detected_cluster()
    if cluster is None:
        return False
    _use_gloo()
    jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat_timeout())
    state = jax_internals.distributed_state()
    no_mixed_compilation_cache(int(getattr(state, "num_processes", None) or 2))
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
