"""Test-wide settings, applied before any test imports JAX."""

import os

# The dev requirements carry libtpu for the deviceless TPU compiles (tests/test_tpu_aot.py). With
# it installed, every JAX process would first try to open a TPU (and take libtpu's process
# lock); the tests run on the CPU and reach libtpu only through jax.experimental.topologies.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
