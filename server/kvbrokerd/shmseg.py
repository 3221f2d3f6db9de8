"""Daemon-owned POSIX shared-memory segments: naming, creation, and clean-up of segments left by dead daemons.

Segments are files in the shm directory (normally /dev/shm, where shm_open puts them) so that they are opened and
mapped without Python's resource tracker. Names carry the owning daemon's pid so that a restarted daemon can unlink
what a SIGKILLed one left behind.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "kvbroker-"
_OWNED = re.compile(rf"^{PREFIX}(\d+)-[0-9a-f]+-")


def segment_name(instance: str, suffix: str) -> str:
    return f"{PREFIX}{os.getpid()}-{instance}-{suffix}"


def create_segment(shm_dir: Path, name: str, size: int) -> Path:
    """Creates a zero-filled segment readable and writable by the owner only; refuses to reuse a name."""
    path = shm_dir / name
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)
    return path


def free_bytes(shm_dir: Path) -> int:
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_segments(shm_dir: Path) -> list[str]:
    """Unlinks segments whose owning daemon process no longer exists; returns their names."""
    removed = []
    for entry in shm_dir.iterdir():
        m = _OWNED.match(entry.name)
        if m and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
            entry.unlink(missing_ok=True)
            removed.append(entry.name)
    if removed:
        log.warning("removed %d shm segments left by dead daemons: %s", len(removed), ", ".join(removed[:8]))
    return removed
