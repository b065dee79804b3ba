"""Compatibility shims below every room that uses them (sharding/, tpu/): torchax under this torch."""
