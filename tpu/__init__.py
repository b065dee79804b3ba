"""The JAX backend: torchax programs (probe, middle, tail), attention lowering, compile counting.

Import torchax only through `compat.torchax_compat.import_torchax()` (torch 2.13 compatibility).
The programs themselves arrive with the stage-2 issue.
"""

from .compile import compile_counts

# Counting starts with the package, before any module of it imports torchax (which compiles its
# random key): a command's totals are then everything its process compiled.
compile_counts()
