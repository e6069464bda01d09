"""Run by tests/test_dist.py: rank 1 dies at once; rank 0 would wait forever at a barrier."""

import os
import time

import jax

import jaxkv

if jax.process_index() == 1:
    os._exit(3)  # a crash: no clean shutdown
kv = jaxkv.create("dist_sync")
kv.barrier()  # never completes: the launcher must stop this process
time.sleep(600)
