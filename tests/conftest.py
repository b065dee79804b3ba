"""Test-wide settings, applied before any test imports JAX."""

import os

# The dev requirements carry libtpu for the deviceless TPU compiles (tests/test_tpu_aot.py). With
# it installed, every JAX process would first try to open a TPU (and take libtpu's process
# lock); the tests run on the CPU and reach libtpu only through jax.experimental.topologies.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The tests compile hundreds of small XLA programs on the CPU, and LLVM's optimisation passes are
# most of each compile while buying nothing at these sizes: level 0 cuts the JAX tests' time by
# about a third (tests/test_stage2_jax.py 139 s -> 95 s). Results stay within float rounding of
# level 2 (what the tests compare is tolerance-based, or two runs of the same process).
# Subprocesses inherit it; bench/ and the commands keep XLA's default.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_backend_optimization_level" not in _flags:
    os.environ["XLA_FLAGS"] = f"{_flags} --xla_backend_optimization_level=0".strip()
