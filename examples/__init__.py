"""Runnable examples of kvbroker in a model server (run them from the repository root with `python -m`)."""
