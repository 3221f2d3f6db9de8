"""Segment names, safe opening and instance locks (kvbrokerd.registry.shmseg), and the shm backend's distrust of what a
peer names: every check runs against real files in a private directory of /dev/shm."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvbroker.types import CacheDesc, DataType, TensorLocation
from kvbrokerd.backends.shm import backend as shm_backend
from kvbrokerd.backends.shm.control import NONCE_BYTES
from kvbrokerd.dataplane.seam import RemoteCache
from kvbrokerd.errors import LlmError, LlmStatus
from kvbrokerd.registry import shmseg

NOBODY = 65534


def _file(path: Path, size: int, data: bytes = b"") -> Path:
    with open(path, "wb") as f:
        f.truncate(size)
        f.write(data)
    return path


@pytest.mark.parametrize("name", ["", ".", "..", "../x", "a/b", "/etc/passwd", ".hidden", "x\0y", "x" * 201,
                                  "bad name", "x\n"])
def test_bad_names_are_refused(name: str) -> None:
    with pytest.raises(shmseg.SegmentError, match="bad segment name"):
        shmseg.check_name(name)


@pytest.mark.parametrize("name", ["a", "x" * 200, "kvbroker-test-1", "model_kv.0", "a..b"])
def test_plain_names_are_accepted(name: str, shm_dir: Path) -> None:
    """Accepted: the check passes, and a segment of that name opens."""
    shmseg.check_name(name)
    _file(shm_dir / name, 4096)
    seg = shmseg.Segment.open(shm_dir, name, writable=False, owner=os.geteuid(), min_size=4096)
    try:
        assert (seg.name, seg.size) == (name, 4096)
    finally:
        seg.close()


def test_managed_names_carry_their_instance() -> None:
    assert shmseg.instance_of(shmseg.segment_name("0123abcd", "c42")) == "0123abcd"
    assert shmseg.instance_of(shmseg.lock_name("0123abcd")) == "0123abcd"
    for name in ("kvbroker-test-1", "kvbroker-123-0123abcd-c1", "kvbroker-0123ABCD-c1", "kvbroker-0123abcd",
                 "model"):
        assert shmseg.instance_of(name) is None, name


def test_open_refuses_symlinks_fifos_directories_and_strangers(shm_dir: Path, tmp_path: Path) -> None:
    secret = _file(tmp_path / "secret", 4096)
    (shm_dir / "link").symlink_to(secret)
    os.mkfifo(shm_dir / "fifo")
    (shm_dir / "dir").mkdir()
    _file(shm_dir / "foreign", 4096)
    os.chown(shm_dir / "foreign", NOBODY, NOBODY)
    _file(shm_dir / "small", 100)
    cases = {"link": "symbolic link", "fifo": "not a regular file", "dir": "not a regular file",
             "foreign": f"belongs to uid {NOBODY}", "small": "100 bytes"}
    for name, why in cases.items():
        with pytest.raises(shmseg.SegmentError, match=why):
            shmseg.Segment.open(shm_dir, name, writable=False, owner=os.geteuid(), min_size=4096)
    (shm_dir / "dir").rmdir()


def test_created_segments_are_private_and_reserved(shm_dir: Path) -> None:
    seg = shmseg.create_segment(shm_dir, "kvbroker-0123abcd-c1", 1 << 20)
    try:
        st = os.stat(shm_dir / seg.name)
        assert st.st_mode & 0o777 == 0o600
        assert st.st_blocks * 512 >= 1 << 20, "the segment's memory must be allocated, not sparse"
    finally:
        seg.close()


def _hold_lock(path: Path) -> subprocess.Popen[bytes]:
    """Another process (a daemon stand-in) holding an exclusive flock on `path` until killed (its sleep is the
    scenario, not a wait: a live holder)."""
    code = ("import fcntl, os, sys, time\nfd = os.open(sys.argv[1], os.O_RDWR)\nfcntl.flock(fd, fcntl.LOCK_EX)\n"
            "print('locked', flush=True)\ntime.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"locked\n"
    return proc


def test_clean_up_removes_only_instances_whose_lock_is_free(shm_dir: Path) -> None:
    live, dead, lockless = "aaaaaaaa", "bbbbbbbb", "cccccccc"
    for inst in (live, dead):
        _file(shm_dir / shmseg.lock_name(inst), 0)
    for inst in (live, dead, lockless):
        _file(shm_dir / shmseg.segment_name(inst, "c1"), 4096)
    _file(shm_dir / "model-server-memory", 4096)
    holder = _hold_lock(shm_dir / shmseg.lock_name(live))
    try:
        removed = shmseg.remove_stale_segments(shm_dir, own_instance="dddddddd")
    finally:
        holder.kill()
        holder.wait()
    assert sorted(removed) == sorted([shmseg.segment_name(dead, "c1"), shmseg.lock_name(dead)])
    assert sorted(p.name for p in shm_dir.iterdir()) == sorted([
        shmseg.lock_name(live), shmseg.segment_name(live, "c1"), shmseg.segment_name(lockless, "c1"),
        "model-server-memory"])


def test_claimed_instance_is_locked_until_released(shm_dir: Path) -> None:
    lock = shmseg.InstanceLock.claim(shm_dir)
    path = shm_dir / shmseg.lock_name(lock.instance)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert shmseg.instance_alive(fd)
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.release()
        assert not path.exists()
        assert not shmseg.instance_alive(fd)
    finally:
        os.close(fd)


# -- what a peer names --------------------------------------------------------------------------------------------

def _peer(shm_dir: Path, nonce: bytes, instance: str = "0123abcd") -> str:
    """A peer's control page (nonce, 4 slots) and its held instance lock; returns the page's name."""
    name = shmseg.segment_name(instance, "ctl")
    _file(shm_dir / name, NONCE_BYTES + 32, nonce)
    _file(shm_dir / shmseg.lock_name(instance), 0)
    return name


def test_probe_takes_only_a_control_page_name_in_our_directory(shm_dir: Path, tmp_path: Path) -> None:
    nonce = os.urandom(NONCE_BYTES)
    name = _peer(shm_dir, nonce)
    holder = _hold_lock(shm_dir / shmseg.lock_name("0123abcd"))
    try:
        elsewhere = _file(tmp_path / name, NONCE_BYTES + 32, nonce)
        for bad in (str(elsewhere), f"../{tmp_path.name}/{name}", "kvbroker-0123abcd-c1", "secret", ""):
            assert shm_backend.probe(bad, nonce, shm_dir) is None, bad
        assert shm_backend.probe(name, os.urandom(NONCE_BYTES), shm_dir) is None
        control = shm_backend.probe(name, nonce, shm_dir)
        assert control is not None and control.daemon_alive()
    finally:
        holder.kill()
        holder.wait()
    assert not control.daemon_alive()
    assert shm_backend.probe(name, nonce, shm_dir) is None, "a dead daemon's control page is not a peer"


def test_peer_segments_must_be_plain_files_of_the_peer_owner(shm_dir: Path, tmp_path: Path) -> None:
    nonce = os.urandom(NONCE_BYTES)
    name = _peer(shm_dir, nonce)
    holder = _hold_lock(shm_dir / shmseg.lock_name("0123abcd"))
    try:
        control = shm_backend.probe(name, nonce, shm_dir)
        assert control is not None
        secret = _file(tmp_path / "secret", 4096, b"root only")
        os.chmod(secret, 0o600)
        (shm_dir / "link").symlink_to(secret)
        _file(shm_dir / "foreign", 4096)
        os.chown(shm_dir / "foreign", NOBODY, NOBODY)
        _file(shm_dir / shmseg.segment_name("99999999", "c1"), 4096)
        desc = CacheDesc(num_tensors=1, shape=(4, 1024), data_type=DataType.UINT8)
        cases = {str(secret): LlmStatus.LLM_LINK_FAILED, f"../../{secret}": LlmStatus.LLM_LINK_FAILED,
                 "link": LlmStatus.LLM_LINK_FAILED, "foreign": LlmStatus.LLM_LINK_FAILED,
                 shmseg.segment_name("99999999", "c1"): LlmStatus.LLM_LINK_FAILED,
                 "missing": LlmStatus.LLM_KV_CACHE_NOT_EXIST}
        for segment, status in cases.items():
            remote = RemoteCache(cache_id=1, desc=desc, tensors=(TensorLocation(segment, 0),))
            for writable in (False, True):
                with pytest.raises(LlmError) as err:
                    shm_backend._Opened.open(remote, control, shm_dir, writable=writable)
                assert err.value.status == status, (segment, err.value)
        assert secret.read_bytes().startswith(b"root only")
    finally:
        holder.kill()
        holder.wait()


def test_peer_tensor_count_must_match_its_description(shm_dir: Path) -> None:
    nonce = os.urandom(NONCE_BYTES)
    name = _peer(shm_dir, nonce)
    holder = _hold_lock(shm_dir / shmseg.lock_name("0123abcd"))
    try:
        control = shm_backend.probe(name, nonce, shm_dir)
        assert control is not None
        _file(shm_dir / "model", 8192)
        desc = CacheDesc(num_tensors=2, shape=(4, 1024), data_type=DataType.UINT8)
        remote = RemoteCache(cache_id=1, desc=desc, tensors=(TensorLocation("model", 0),))
        with pytest.raises(LlmError) as err:
            shm_backend._Opened.open(remote, control, shm_dir, writable=False)
        assert err.value.status == LlmStatus.LLM_LINK_FAILED and "located 1" in err.value.message
    finally:
        holder.kill()
        holder.wait()


_COPY_FROM_SHRUNK_SOURCE = """
import concurrent.futures, os, sys, time
from pathlib import Path
import numpy as np
from kvbroker.types import CacheDesc, DataType
from kvbrokerd.registry import shmseg
from kvbrokerd.backends.common import memcopy
from kvbrokerd.errors import LlmError
from kvbrokerd.dataplane.plan import Progress
from kvbrokerd.transfers.planner import LayerSelection, plan_blocks

shm_dir, mode = Path(sys.argv[1]), sys.argv[2]
desc = CacheDesc(num_tensors=1, shape=(16, 4096), data_type=DataType.UINT8)
src = shmseg.Segment.open(shm_dir, "src", writable=True, owner=None, min_size=desc.tensor_nbytes)
dst = shmseg.Segment.open(shm_dir, "dst", writable=True, owner=None, min_size=desc.tensor_nbytes)
def side(seg, label):
    # no size re-check: the memory shrinks after it, during the copy
    return memcopy.Endpoint(label, [memcopy.base_address(seg.map())], [seg.fd], [0], False, lambda: None)
src_side, dst_side = side(src, "the source"), side(dst, "the destination")
os.ftruncate((src if mode == "source" else dst).fd, 4096 * 3)
blocks = np.arange(16, dtype=np.uint64)  # as block_array gives them
plan = plan_blocks(desc, desc, blocks, blocks[::-1].copy(), LayerSelection())
progress = Progress(plan)
try:
    memcopy.copy_plan(src_side, dst_side, plan, progress, time.monotonic() + 10,
                      concurrent.futures.ThreadPoolExecutor(1))
except LlmError as e:
    print(e.status.name, e.message, sorted(progress.failed_dst_blocks().tolist()))
"""


@pytest.mark.parametrize("mode", ["source", "destination"])
def test_a_copy_through_memory_that_shrinks_under_it_is_an_error_not_a_signal(shm_dir: Path, mode: str) -> None:
    """The kernel copy, with nothing checked before: what a truncation in the middle of a copy looks like. Run in
    a child process, so that a SIGBUS would fail this test instead of killing the test runner."""
    _file(shm_dir / "src", 16 * 4096, bytes(range(256)) * 256)
    _file(shm_dir / "dst", 16 * 4096)
    out = subprocess.run([sys.executable, "-c", _COPY_FROM_SHRUNK_SOURCE, str(shm_dir), mode],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"the copier died ({out.returncode}): {out.stderr}"
    status, _, rest = out.stdout.partition(" ")
    assert status == "LLM_KV_CACHE_NOT_EXIST", out.stdout
    assert ("shrank during the copy" if mode == "source" else "vanished during the copy") in rest
    failed = [int(b) for b in rest[rest.index("[") + 1 : rest.index("]")].split(",")]
    # Blocks 0-2 of each side survive the truncation to 3 pages: with dst = reversed src, what landed is exact.
    assert len(failed) >= 13 and all(0 <= b < 16 for b in failed)
