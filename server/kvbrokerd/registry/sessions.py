"""Client sessions and their leases: a model server that dies without cleaning up does not leak its caches.

A client names a session (a random id) when it allocates or registers caches and renews the session's lease with
KeepAlive. When a lease expires, the reaper releases the session's caches (waiting for transfers that use them),
and the daemon carries on.

A lease measures the client's silence, not the daemon's: while the daemon does not run (SIGSTOP, a host too loaded
to schedule it) it cannot hear KeepAlives either. The reaper notices such a stall by waking up late and moves every
lease's expiry on by the stall, so that leases count only time the daemon ran; after a stall as long as a session's
TTL, every KeepAlive of that session went unheard, so it gets at least a full TTL from the resume. A client that is
really gone still loses its caches: short stalls only shift its expiry, never reset it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from kvbrokerd.errors import LlmError, param_invalid
from kvbrokerd.limits import MAX_LEASE_TTL_S, MAX_SESSION_ID_BYTES, check_text
from kvbrokerd.registry.caches import Registry

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 30.0
MIN_TTL_S = 1.0
MAX_SESSIONS = 4096
REAP_INTERVAL_S = 0.5
STALL_S = 0.25
"""A reaper round this much later than planned means the daemon did not run in between."""


@dataclass
class Session:
    ttl_s: float
    expires: float  # time.monotonic()


class SessionTable:
    def __init__(self, registry: Registry) -> None:
        self._registry = registry
        self._sessions: dict[str, Session] = {}
        self._reaper: asyncio.Task[None] | None = None

    def touch(self, session_id: str, ttl_s: float | None = None) -> Session:
        """Creates or renews a session's lease (ttl_s None: keep the session's own, or the default)."""
        check_text("session_id", session_id, MAX_SESSION_ID_BYTES, required=True)
        if ttl_s is not None and not MIN_TTL_S <= ttl_s <= MAX_LEASE_TTL_S:
            param_invalid(f"lease ttl must be in [{MIN_TTL_S}, {MAX_LEASE_TTL_S}] s, got {ttl_s}")
        session = self._sessions.get(session_id)
        if session is None:
            if len(self._sessions) >= MAX_SESSIONS:
                param_invalid(f"too many client sessions ({MAX_SESSIONS})")
            session = self._sessions[session_id] = Session(ttl_s or DEFAULT_TTL_S, 0.0)
        elif ttl_s is not None:
            session.ttl_s = ttl_s
        session.expires = time.monotonic() + session.ttl_s
        return session

    def __len__(self) -> int:
        return len(self._sessions)

    def expires_unix(self, owner: str) -> float:
        session = self._sessions.get(owner)
        return 0.0 if session is None else time.time() + max(0.0, session.expires - time.monotonic())

    def start(self) -> None:
        self._reaper = asyncio.create_task(self._reap_forever())

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper

    async def _reap_forever(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(REAP_INTERVAL_S)
            late = time.monotonic() - last - REAP_INTERVAL_S
            if late > STALL_S:
                # The stall may have begun anywhere in the interval: count the whole interval, erring for clients.
                self.forgive_stall(late + REAP_INTERVAL_S)
            await self.reap()
            last = time.monotonic()

    def forgive_stall(self, stalled_s: float) -> None:
        """The daemon did not run for `stalled_s`: that time does not count against any lease."""
        now = time.monotonic()
        for session in self._sessions.values():
            session.expires += stalled_s
            if stalled_s >= session.ttl_s:
                session.expires = max(session.expires, now + session.ttl_s)
        if self._sessions:
            log.warning("the daemon did not run for %.1f s (stopped or starved of CPU): %d client leases extended by "
                        "that time", stalled_s, len(self._sessions))

    async def reap(self) -> None:
        now = time.monotonic()
        expired = {sid for sid, s in self._sessions.items() if s.expires <= now}
        if not expired:
            return
        busy = set()
        for entry in self._registry.list():
            if entry.owner in expired:
                try:
                    await self._registry.remove(entry.cache_id, daemon_owned=None, wait_s=0.0)
                    log.warning("lease of session %s expired: released cache %d", entry.owner, entry.cache_id)
                except LlmError:
                    busy.add(entry.owner)  # in use by a transfer: try again on the next round
        for sid in expired - busy:
            del self._sessions[sid]
