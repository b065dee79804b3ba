"""VAE spatial patch parallel (seed 004): the latent frame is split over N ranks along height and
width; convolutions exchange halos with their neighbours, VAE attention gathers K/V, upsampling
extends borders then crops, group norms all-reduce their statistics, and a two-stage gather
puts the frame together. It wraps a diffusers VAE's layers from outside, for one decode.

    grid = plan_grid(world_size, latent_h, latent_w)      # grid.py: the split, uneven allowed
    comm = PatchComm(grid)                                # comm.py: halos, gathers, all-reduce
    video = parallel_decode(vae, z, comm)                 # decode.py: on rank 0, None elsewhere
    with patch_parallel(decoder_parts(vae), comm): ...    # layers.py: the rules, for custom calls
    run_ranks(4, fn, ...)                                 # launch.py: local CPU ranks (tests, bench)
"""

from .comm import PatchComm
from .decode import decoder_parts, parallel_decode, plain_decode
from .grid import PatchGrid, PatchGridError, plan_grid, split_sizes
from .layers import Layer, PatchParallelMode, patch_parallel, plan_layers

__all__ = ["Layer", "PatchComm", "PatchGrid", "PatchGridError", "PatchParallelMode",
           "decoder_parts", "parallel_decode", "patch_parallel", "plain_decode", "plan_grid",
           "plan_layers", "split_sizes"]
