"""kvbrokerd: the kvbroker daemon (a per-node sidecar that owns KV caches and links, and moves KV blocks)."""

__version__ = "0.1.0"
