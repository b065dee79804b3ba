"""The torch backend (CUDA, Ascend NPU, CPU): the same stages and gate as the JAX backend.

Today: eager execution (`TorchBackend`), the reference the JAX backend is checked against.
torch.compile, offload and the fused-op selection arrive with the torch-backend issue.
"""
