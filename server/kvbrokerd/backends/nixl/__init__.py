"""The nixl backend: NVIDIA NIXL (UCX) for host and CUDA memory."""
