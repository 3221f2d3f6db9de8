"""The data-plane backends this daemon can run: the built-in engines (one package each under backends/) and any
engine installed from elsewhere that registers in the `kvbrokerd.backends` entry point group, e.g. in its
pyproject.toml:

    [project.entry-points."kvbrokerd.backends"]
    rdma = "mypackage.rdma:RdmaBackend"

The entry's name is the backend's name (`Backend.name`); its value is the `Backend` subclass. Backend modules are
imported only when asked for, and they load their engine's library (NIXL, HIXL) only when started, so a daemon that
does not allow an engine never loads it.
"""

from __future__ import annotations

import functools
import importlib
import logging
from importlib import metadata

from kvbrokerd.dataplane.seam import Backend

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "kvbrokerd.backends"

BUILTIN: dict[str, str] = {
    "shm": "kvbrokerd.backends.shm.backend:ShmBackend",
    "tcp": "kvbrokerd.backends.tcp.backend:TcpBackend",
    "nixl": "kvbrokerd.backends.nixl.backend:NixlBackend",
    "hccl": "kvbrokerd.backends.hccl.backend:HcclBackend",
}
"""Built-in backend name -> `module:class`, in the default order of preference."""


@functools.cache
def registered() -> dict[str, str]:
    """Every backend this install knows: name -> `module:class`, built-ins first, then entry points by name. An
    entry point that reuses a built-in's name is ignored (with a warning): it cannot replace a built-in engine."""
    found = dict(BUILTIN)
    for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        if ep.name in BUILTIN:
            log.warning("backend entry point %s = %s ignored: %r is a built-in backend", ep.name, ep.value, ep.name)
            continue
        found.setdefault(ep.name, ep.value)
    return found


@functools.cache
def backend_class(name: str) -> type[Backend]:
    """The backend class named `name`: KeyError for an unknown name, ImportError or TypeError for an entry that
    does not load as a `Backend` of that name."""
    module, _, attr = registered()[name].partition(":")
    cls = getattr(importlib.import_module(module), attr)
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise TypeError(f"{registered()[name]} is not a kvbrokerd Backend class")
    if cls.name != name:
        raise TypeError(f"{registered()[name]} calls itself {cls.name!r}, registered as {name!r}")
    return cls


def loadable() -> dict[str, type[Backend]]:
    """The registered backends whose classes load, by name (one that does not is logged and left out)."""
    classes = {}
    for name in registered():
        try:
            classes[name] = backend_class(name)
        except (ImportError, AttributeError, TypeError) as e:
            log.warning("backend %r cannot be loaded: %s", name, e)
    return classes


def default_backends() -> tuple[str, ...]:
    """The backends a daemon allows when --backends is not given, in order of preference."""
    return tuple(name for name, cls in loadable().items() if cls.default)


def unavailable(name: str) -> str | None:
    """Why backend `name` cannot run here (unknown, not loadable, or its library missing), or None."""
    if name not in registered():
        return f"unknown backend {name!r} (known: {', '.join(registered())})"
    try:
        cls = backend_class(name)
    except (ImportError, AttributeError, TypeError) as e:
        return f"backend {name!r} cannot be loaded: {e}"
    return cls.unavailable()


def device_kinds() -> dict[str, tuple[str, tuple[int, int]]]:
    """Device memory kind -> (the first backend that imports it, its IPC handle sizes (smallest, largest))."""
    kinds: dict[str, tuple[str, tuple[int, int]]] = {}
    for name, cls in loadable().items():
        for kind in cls.capabilities.device_kinds:
            kinds.setdefault(kind.name, (name, kind.handle_bytes))
    return kinds
