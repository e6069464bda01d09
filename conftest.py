"""Test set-up shared by tests/ and the doctests: 8 simulated CPU devices, before JAX starts."""

import jax

jax.config.update("jax_num_cpu_devices", 8)
