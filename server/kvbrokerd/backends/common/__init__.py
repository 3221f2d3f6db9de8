"""Helpers that more than one engine uses: the fault-safe memory copy, socket I/O with deadlines, the staging
buffer, live-slot pages, CUDA IPC imports and the local-copy channel."""
