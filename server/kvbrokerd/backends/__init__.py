"""Data-plane backends: one module per backend, each defining `BACKEND` (a `base.Backend` subclass).

Adding a backend is one module plus one line here. Modules are imported only when a daemon allows that backend, so
an optional engine's library (NIXL, HIXL) is never loaded by a daemon that does not use it.
"""

from __future__ import annotations

import importlib

from kvbrokerd.backends.base import Backend

MODULES: dict[str, str] = {
    "shm": "kvbrokerd.backends.shm.backend",
    "tcp": "kvbrokerd.backends.tcp.backend",
    "nixl": "kvbrokerd.backends.nixl.backend",
    "hccl": "kvbrokerd.backends.hccl.backend",
}
"""Backend name -> module, in the default order of preference."""

DEFAULT_BACKENDS = ("shm", "tcp")


def backend_class(name: str) -> type[Backend]:
    """The backend class named `name` (KeyError for an unknown name)."""
    cls: type[Backend] = importlib.import_module(MODULES[name]).BACKEND
    return cls


def unavailable(name: str) -> str | None:
    """Why backend `name` cannot run here (unknown, or its library missing), or None."""
    if name not in MODULES:
        return f"unknown backend {name!r} (known: {', '.join(MODULES)})"
    try:
        cls = backend_class(name)
    except ImportError as e:  # pragma: no cover - a broken install
        return f"backend {name!r} cannot be loaded: {e}"
    return cls.unavailable()
