"""Daemon-side POSIX shared-memory segments: names, safe opening, reserved creation, and instance locks.

Segments are files in the shm directory (normally /dev/shm, where shm_open puts them), opened and mapped without
Python's resource tracker. A daemon instance names its segments `kvbroker-<instance>-<suffix>` and holds an flock on
`kvbroker-<instance>.lock` for its whole life. A starting daemon removes another instance's files only if it can take
that instance's lock: the kernel drops a lock when its holder dies, so the rule holds across PID namespaces and PID
reuse, which a PID in the name cannot tell apart.

Names reach this module from model servers and from peers: `Segment.open` accepts only a plain name inside the
configured directory, never follows a symlink, never blocks on a FIFO, and checks the file's type and owner on the
descriptor it keeps (so later checks see the same inode, whatever happens to the name).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "kvbroker-"
MAX_NAME_LEN = 200
_INSTANCE_HEX = 8
_PLAIN_NAME = re.compile(rf"[A-Za-z0-9_-][A-Za-z0-9._-]{{0,{MAX_NAME_LEN - 1}}}")
_MANAGED = re.compile(rf"{PREFIX}([0-9a-f]{{{_INSTANCE_HEX}}})(?:-[A-Za-z0-9._-]+|\.lock)")
_CLAIM_TRIES = 16


class SegmentError(Exception):
    """A segment that cannot or must not be used; the message says why (the caller picks the LLM status).
    `missing`: the file is absent or smaller than needed (its memory is gone), not merely unacceptable."""

    def __init__(self, message: str, *, missing: bool = False) -> None:
        super().__init__(message)
        self.missing = missing


def segment_name(instance: str, suffix: str) -> str:
    return f"{PREFIX}{instance}-{suffix}"


def lock_name(instance: str) -> str:
    return f"{PREFIX}{instance}.lock"


def instance_of(name: str) -> str | None:
    """The daemon instance a segment or lock name belongs to; None for names no daemon manages."""
    m = _MANAGED.fullmatch(name)
    return m.group(1) if m else None


def check_name(name: str) -> None:
    """A plain file name inside the shm directory: no '/', no NUL, no '.' or '..', no leading dot, bounded."""
    if not _PLAIN_NAME.fullmatch(name):
        raise SegmentError(f"bad segment name {name[:64]!r}: want 1..{MAX_NAME_LEN} characters of [A-Za-z0-9._-], "
                           "not starting with '.'")


class Segment:
    """One segment file, open for as long as this object lives. Size re-checks (fstat) and kernel copies (pread)
    use the descriptor; `map` maps it read-only or read-write, as it was opened."""

    def __init__(self, name: str, fd: int, size: int, uid: int, writable: bool,
                 mapping: mmap.mmap | None = None) -> None:
        """`mapping`: another Segment's mapping of the same file, shared (the memory at the same addresses); either
        one's `close` unmaps it only once no buffer of the other's uses it."""
        self.name = name
        self.fd = fd
        self.size = size
        self.uid = uid
        self.writable = writable
        self._mmap: mmap.mmap | None = mapping

    @classmethod
    def open(cls, shm_dir: Path, name: str, *, writable: bool, owner: int | None, min_size: int = 1) -> Segment:
        """Opens `shm_dir/name`, a regular file of uid `owner` (None: any) of at least `min_size` bytes."""
        check_name(name)
        flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(shm_dir / name, flags)
        except OSError as e:
            why = "it is a symbolic link" if e.errno == errno.ELOOP else e.strerror
            raise SegmentError(f"cannot open segment {name!r} in {shm_dir}: {why}",
                               missing=e.errno == errno.ENOENT) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise SegmentError(f"segment {name!r} in {shm_dir} is not a regular file")
            if owner is not None and st.st_uid != owner:
                raise SegmentError(f"segment {name!r} in {shm_dir} belongs to uid {st.st_uid}, not {owner}")
            if st.st_size < min_size:
                raise SegmentError(f"segment {name!r} in {shm_dir} has {st.st_size} bytes, {min_size} needed",
                                   missing=True)
        except BaseException:
            os.close(fd)
            raise
        return cls(name, fd, st.st_size, st.st_uid, writable)

    def map(self) -> mmap.mmap:
        """The whole segment mapped shared (made once): read-only unless the segment was opened writable."""
        if self._mmap is None:
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if self.writable else 0)
            self._mmap = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED, prot)
        return self._mmap

    def current_size(self) -> int:
        return os.fstat(self.fd).st_size

    def close(self) -> None:
        """Unmaps and closes; numpy views still alive keep the mapping until they are dropped."""
        if self._mmap is not None:
            with contextlib.suppress(BufferError):
                self._mmap.close()
            self._mmap = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        # Remote segments are dropped, not closed: a copy that still holds one keeps its descriptor valid.
        with contextlib.suppress(Exception):
            self.close()


def create_segment(shm_dir: Path, name: str, size: int) -> Segment:
    """Creates a segment readable and writable by the owner only, with its memory reserved: on tmpfs a sparse file
    fails at the first write that finds the filesystem full, with SIGBUS in whoever touches that page (the model
    server or this daemon). Raises OSError (ENOSPC, EFBIG, EEXIST...) with nothing left behind."""
    check_name(name)
    path = shm_dir / name
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    return Segment(name, fd, size, os.geteuid(), writable=True)


def free_bytes(shm_dir: Path) -> int:
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


class InstanceLock:
    """This daemon's claim on its instance name: an exclusive flock held until `release` (or death)."""

    def __init__(self, shm_dir: Path, instance: str, fd: int) -> None:
        self.shm_dir = shm_dir
        self.instance = instance
        self._fd = fd

    @classmethod
    def claim(cls, shm_dir: Path) -> InstanceLock:
        """Creates and locks a lock file under a fresh instance name. A name that exists (a collision) or whose
        new file another daemon's clean-up locked first is given up for another."""
        for _ in range(_CLAIM_TRIES):
            instance = secrets.token_hex(_INSTANCE_HEX // 2)
            path = shm_dir / lock_name(instance)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            except FileExistsError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)  # a starting daemon's clean-up took it for a dead instance's; it removes the file
                continue
            return cls(shm_dir, instance, fd)
        raise OSError(errno.EEXIST, f"no free instance name in {shm_dir} after {_CLAIM_TRIES} tries")

    def release(self) -> None:
        """Unlinks the lock file, then unlocks: call after this instance's segments are gone."""
        if self._fd >= 0:
            (self.shm_dir / lock_name(self.instance)).unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = -1


def instance_alive(lock_fd: int) -> bool:
    """Whether the daemon holding the lock file open as `lock_fd` still runs (its exclusive lock is still held).
    A dead instance's lock is taken and dropped again at once, so a clean-up can miss it for that instant only."""
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(lock_fd, fcntl.LOCK_UN)
    return False


def remove_stale_segments(shm_dir: Path, own_instance: str) -> list[str]:
    """Unlinks the segments and lock files of instances whose lock nobody holds; returns the names removed.
    Files of an instance without a lock file, or whose lock file this user cannot open, are left alone."""
    by_instance: dict[str, list[str]] = {}
    for entry in os.scandir(shm_dir):
        instance = instance_of(entry.name)
        if instance is not None and instance != own_instance:
            by_instance.setdefault(instance, []).append(entry.name)
    removed: list[str] = []
    for instance, names in by_instance.items():
        lock = lock_name(instance)
        if lock not in names:
            continue
        try:
            fd = os.open(shm_dir / lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # The name must still lead to the file we locked: another clean-up may have removed it meanwhile.
            if os.stat(shm_dir / lock, follow_symlinks=False).st_ino != os.fstat(fd).st_ino:
                continue
            for name in sorted(names, key=lambda n: n == lock):  # the lock file last
                with contextlib.suppress(FileNotFoundError):
                    (shm_dir / name).unlink()
                    removed.append(name)
        except OSError:
            continue  # alive (BlockingIOError), or removed under us
        finally:
            os.close(fd)
    if removed:
        log.warning("removed %d shm files left by dead daemons: %s", len(removed), ", ".join(removed[:8]))
    return removed
