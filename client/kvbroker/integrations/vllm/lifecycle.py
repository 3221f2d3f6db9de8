"""A server told to stop (SIGTERM, SIGINT) gives its engine's KV memory back to the daemon before it exits; only a
crash leaves it to the session's lease (`kvbroker_lease_ttl_s`).

vLLM's API server stops its engine by SIGTERM and, with the default `--shutdown-timeout 0`, SIGKILL right after:
neither the engine core nor its worker processes, which own the caches (each worker's client session), get to run
`shutdown()`. The API server process itself exits cleanly, after its engine's processes are gone. So the worker names
its session after the engine (`session_id`), and the front end, which knows the engine id from the same config,
releases every cache of those sessions at its exit (`release_at_exit`, armed by `build_prom_metrics`, the connector
hook vLLM calls in the front end). A worker that does get to shut down (offline `LLM`, a shutdown timeout) frees its
own cache first; the front end then finds nothing left. The engine id is vLLM's (`kv_transfer_config.engine_id`, a
fresh UUID unless set): two servers given the same one on one daemon would free each other's caches at exit.
"""

from __future__ import annotations

import atexit
import logging
import threading
import uuid

from kvbroker._client import Client
from kvbroker.status import LlmError

log = logging.getLogger(__name__)

SESSION_PREFIX = "vllm-engine:"
_RELEASE_TIMEOUT_S = 5.0
_armed: set[tuple[str, str]] = set()
_armed_lock = threading.Lock()


def session_id(engine_id: str, rank: int) -> str:
    """The daemon session of one worker of engine `engine_id`: named after the engine, so that its front end can find
    it, and unique per process (a restarted worker never renews its predecessor's session)."""
    return f"{SESSION_PREFIX}{engine_id}:{rank}:{uuid.uuid4().hex[:12]}"


def release_engine_caches(target: str, engine_id: str, timeout_s: float = _RELEASE_TIMEOUT_S) -> int:
    """Releases every cache the daemon at `target` holds for the workers of engine `engine_id`; returns how many."""
    prefix = f"{SESSION_PREFIX}{engine_id}"
    released = 0
    with Client(target, timeout=timeout_s, lease_ttl=None) as client:
        for record in client.list_caches():
            if not record.owner.startswith(prefix):
                continue
            try:
                if record.daemon_owned:
                    client.deallocate_cache(record.cache_id)
                else:  # a GPU engine's registered VRAM
                    client.unregister_kv_cache(record.cache_id)
                released += 1
            except LlmError as e:  # gone meanwhile, or busy: the lease frees it anyway
                log.warning("kvbroker connector: could not free KV cache %d of engine %s at exit (%s)",
                            record.cache_id, engine_id, e.message)
    return released


def _release_quietly(target: str, engine_id: str) -> None:
    try:
        released = release_engine_caches(target, engine_id)
    except LlmError as e:  # the daemon is gone or unreachable: nothing to free, or the lease will
        log.warning("kvbroker connector: could not free engine %s's KV memory at exit (%s); its daemon frees it one "
                    "lease later", engine_id, e.message)
        return
    if released:
        log.info("kvbroker connector: freed engine %s's %d KV cache(s) at exit", engine_id, released)


def release_at_exit(target: str, engine_id: str) -> None:
    """Arms, once per engine, the release of engine `engine_id`'s caches when this (front-end) process exits."""
    with _armed_lock:
        if (target, engine_id) in _armed:
            return
        _armed.add((target, engine_id))
    atexit.register(_release_quietly, target, engine_id)
