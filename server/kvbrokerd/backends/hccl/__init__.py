"""The hccl backend: CANN HIXL for Ascend NPU memory."""
