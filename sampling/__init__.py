"""Sampling, shared by both backends: schedulers, CFG, expert switching, stage files, the loop.

Backends reach it through one small interface (`sampling.loop.Backend`); nothing here knows
whether tensors live in torch, torchax or JAX.
"""
