"""Run by tests/test_launch.py without the launcher, with the variables ``srun`` sets: runs
kvstore_job.py's checks, whose ``create('dist_sync')`` joins through JAX's SLURM detection.

    slurm_job.py N
"""

import os
import sys

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

jax.config.update("jax_num_cpu_devices", 2)

import kvstore_job  # noqa: E402

kvstore_job.main()
assert jax.process_index() == int(os.environ["SLURM_PROCID"])
