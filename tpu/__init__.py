"""The JAX backend and what it needs to run on a TPU slice, as a library (the commands live in
`commands/`, the two deviceless compiles too: `python -m commands.aot` and
`python -m commands.vae_aot`).

- Stage 2: `backend` (the stages jitted through torchax, weights as arguments), `scan` (the
  middle's blocks as rolled loops), `attention` (its lowerings), `compile` (compile counting and
  the persistent cache), `distributed` and `loading` (multi-host start, sharded weights).
- Stage 3: `vae` (the one decoder) over one plan per VAE family (`vae_wan`, `vae_hunyuan`,
  `vae_pixels`; shared parts in `vae_plan`, `vae_strips`), each call a chain of block programs
  (`vae_chain`).
- Deviceless compiles: `aot` and `vae_aot` (a typed request checked and compiled into a report),
  `topology` (chips, slice shapes), `aot_backend`, `program` (what a compiled program costs),
  `hlo`, `hbm` and `placement` (read from its optimized HLO).

Import torchax only through `compat.torchax_compat.import_torchax()` (torch 2.13 compatibility).
"""

from .compile import compile_counts

# Counting starts with the package, before any module of it imports torchax (which compiles its
# random key): a command's totals are then everything its process compiled.
compile_counts()
