"""Test set-up shared by tests/ and the doctests: 8 simulated CPU devices, before JAX starts, and
strict dtype promotion, so an implicit cast in jaxkv shows up as an error (as equinox does).
Tests marked ``standard_promotion`` run optax's Adam by hand, which needs standard promotion."""

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_dtype_promotion", "strict")

# Sphinx's configuration is no module of jaxkv (--doctest-modules would import it, and Sphinx,
# which only the docs extra installs); the built site is no test input.
collect_ignore = ["docs/conf.py", "docs/_build"]
