"""Meshes, partition rules, sequence-parallel attention and scalar reductions.

    layout     the Layout interface the stages call (identity on one device)
    jax_sp     a ("cfg", "sp") JAX mesh, global-view GSPMD + shard_map Ulysses attention
    device_order  where each device sits in a mesh: on a TPU slice, sp rows as ICI-neighbour rings
    torch_sp   torch.distributed process groups, local-view shards, Ulysses all-to-all,
               init_torch_parallel for torchrun
"""
