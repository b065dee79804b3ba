"""Sampling, shared by both backends: schedulers, CFG, expert switching, stage files, the loop.

Backends reach it through one small interface (`sampling.loop.Backend`); nothing here knows
whether tensors live in torch, torchax or JAX.
"""

from .platforms import quiet_cpu_default

# Before any command of the package imports JAX: no libtpu noise on a host with only a CPU.
quiet_cpu_default()
