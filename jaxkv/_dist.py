"""Joining a multi-process job: ``python -m jaxkv.launch`` or an earlier
``jax.distributed.initialize()``.

The launcher passes the coordinator address, the number of processes, this process's id and
the number of CPU devices per process in ``JAXKV_*`` environment variables; importing jaxkv
then joins the job, before JAX starts its backends. Collectives run on JAX's own engines: gloo
between CPU processes, NCCL between GPUs.
"""

from __future__ import annotations

import logging
import os

import jax

logger = logging.getLogger("jaxkv")

ENV_COORDINATOR = "JAXKV_COORDINATOR"
ENV_NUM_PROCESSES = "JAXKV_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXKV_PROCESS_ID"
ENV_DEVICES_PER_PROCESS = "JAXKV_DEVICES_PER_PROCESS"


def join_launched_job() -> None:
    """Initialise ``jax.distributed`` when this process was started by ``jaxkv.launch``."""
    coordinator = os.environ.get(ENV_COORDINATOR)
    if not coordinator or jax.distributed.is_initialized():
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    per_process = os.environ.get(ENV_DEVICES_PER_PROCESS)
    if per_process:
        jax.config.update("jax_num_cpu_devices", int(per_process))
    process_id = int(os.environ[ENV_PROCESS_ID])
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=int(os.environ[ENV_NUM_PROCESSES]),
        process_id=process_id,
    )
    logger.info("jaxkv: joined %s as process %d", coordinator, process_id)


def barrier(name: str) -> None:
    """Wait until every process reaches this point (a no-op in a single-process job)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def from_rank_zero(tree):
    """``tree`` (host arrays) as rank 0 has it, on every process."""
    if jax.process_count() == 1:
        return tree
    from jax.experimental import multihost_utils

    return multihost_utils.broadcast_one_to_all(tree)


join_launched_job()
