"""Run by tests/test_launch.py without the launcher, with the variables ``srun`` sets: joins
through JAX's SLURM detection (``jaxkv._dist.join_cluster``), then runs kvstore_job.py's checks.

    slurm_job.py N
"""

import os
import sys

import jax

from jaxkv import _dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

jax.config.update("jax_num_cpu_devices", 2)
assert _dist.join_cluster()
assert jax.process_index() == int(os.environ["SLURM_PROCID"])

import kvstore_job  # noqa: E402

kvstore_job.main()
