"""The tcp backend: a zero-copy stream between hosts (wire format, data server, channel, backend)."""
