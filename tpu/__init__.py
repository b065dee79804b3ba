"""The JAX backend: torchax programs (probe, middle, tail), attention lowering, compile counting.

Import torchax only through `compat.torchax_compat.import_torchax()` (torch 2.13 compatibility).
The programs themselves arrive with the stage-2 issue.
"""
