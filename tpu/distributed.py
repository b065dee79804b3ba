"""Multi-host start: the JAX distributed runtime, initialized before anything touches JAX.

`jax.distributed.initialize` must run before the first JAX computation of the process, and
importing the backend already makes one (torchax's default environment draws a random key), so
the stage-2 command calls `initialize` right after its flags are checked and before it imports
`tpu.backend`. On Cloud TPU every argument is found from the VM's metadata; elsewhere they come
from the flags or from JAX_COORDINATOR_ADDRESS and the cluster's environment (SLURM, Open MPI).
"""

from __future__ import annotations

import jax

from sampling.errors import UsageError

# JAX's words for a part of the layout it could not find -> ours
_LAYOUT = (("coordinator_address", "coordinator address"), ("Number of processes", "process count"),
           ("process id", "process id"))


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> tuple[int, int]:
    """Start (or join) the job's distributed runtime; (this process's index, process count)."""
    if jax.config.jax_platforms and "cpu" in jax.config.jax_platforms.split(","):
        # CPU devices of several processes talk through gloo (the default has no cross-process
        # collectives); TPU and GPU use their own interconnect
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(coordinator_address=coordinator_address,
                                   num_processes=num_processes, process_id=process_id)
    except ValueError as exc:
        # what neither the flags nor the cluster's environment gave: JAX says so before it
        # starts anything (jax/_src/distributed.py), as a traceback a user cannot act on
        found = [name for key, name in _LAYOUT if key in str(exc)]
        why = (f"JAX found no {found[0]}: this host is not a TPU slice, where JAX finds the "
               "job's layout itself" if found else f"JAX refused the job's layout ({exc})")
        raise UsageError(f"--multihost: {why}; pass --coordinator_address HOST:PORT, "
                         "--num_processes N and --process_id I on every host, or run on a TPU "
                         "slice") from None
    return jax.process_index(), jax.process_count()


def is_writer() -> bool:
    """Process 0 prints, writes stage files, reports and telemetry for the whole job."""
    return jax.process_index() == 0
