"""The README's several processes: a dist_sync store over every process of a launched job.

python -m jaxkv.launch -n 2 --devices-per-process 4 examples/dist_sync.py
"""

import jax
import jax.numpy as jnp

import jaxkv

kv = jaxkv.KVStore("dist_sync")  # every process of the job
kv.init("w", jnp.zeros(3))  # rank 0's value counts
grads = [jax.device_put(jnp.ones(3), d) for d in jax.local_devices()]  # one per local device
kv.push("w", grads)  # summed in each process, then across the processes
print(f"rank {kv.rank} of {kv.num_workers}:", kv.pull("w"))
