"""Meshes, partition rules, sequence-parallel attention and scalar reductions (JAX and
torch.distributed). Arrives with the parallelism issue.
"""
