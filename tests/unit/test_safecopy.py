"""kvbrokerd._safecopy: memmove that turns a page vanishing under it into FaultError, and leaves every other fault
alone (issue 10, finding 3). What faults runs in a child process, so that a signal that got through fails the test
instead of killing the test runner. The child imports the extension before anything else installs a handler,
as the daemon does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvbroker._local import LocalDaemon

try:
    from kvbrokerd import _safecopy
except ImportError:  # pragma: no cover - a machine without a C compiler: the kernel copy is used instead
    _safecopy = None  # type: ignore[assignment]

needs_extension = pytest.mark.skipif(_safecopy is None, reason="kvbrokerd._safecopy is not built here")
MIB = 1 << 20

# Helpers of every child (and `sc`, the extension): `segment` makes a tmpfs file mapped read-write and returns its
# fd, mapping, a numpy view and the mapping's address; `pattern(n)` the bytes a source is filled with; `runs` what
# `sc.copy_runs` takes for (dst, src, n) triples.
PRELUDE = """
import json, mmap, os, signal, sys, threading
import numpy as np
if os.environ.get("KVBROKER_SAFECOPY") != "0":  # as the daemon: turned off, never loaded
    from kvbrokerd import _safecopy as sc

BLOCK = np.random.default_rng(1).integers(0, 256, 4099, dtype=np.uint8)  # an odd period: a shifted byte shows

def pattern(n):
    return np.resize(BLOCK, n)

def segment(path, size, filled=False):
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.ftruncate(fd, size)
    m = mmap.mmap(fd, size)
    view = np.frombuffer(m, np.uint8)
    if filled:
        view[:] = pattern(size)
    return fd, m, view, view.ctypes.data

def runs(*triples):
    return tuple(np.array(column, dtype=np.uint64) for column in zip(*triples))

def fault(e):
    return {"side": e.side, "copied": e.copied, "size": e.size, "signal": e.signal, "address": e.address,
            "run": e.run}
"""


def _child(code: str, *args: str, python_args: tuple[str, ...] = (),
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *python_args, "-c", PRELUDE + code, *args], capture_output=True,
                          text=True, timeout=60, env={**os.environ, **(env or {})})


def _runs(*triples: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    dst, src, n = zip(*triples, strict=True)
    return (np.asarray(dst, dtype=np.uint64), np.asarray(src, dtype=np.uint64), np.asarray(n, dtype=np.uint64))


def _result(out: subprocess.CompletedProcess[str]) -> Any:
    assert out.returncode == 0, f"the child died ({out.returncode}):\n{out.stderr}"
    assert "Fatal Python error" not in out.stderr, out.stderr
    return json.loads(out.stdout)


def test_the_extension_is_built_where_a_compiler_and_headers_are() -> None:
    """Keeps the tests below from skipping silently where the install step could have built it."""
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    compiler = any(os.access(Path(d) / cc, os.X_OK) for d in os.environ.get("PATH", "").split(os.pathsep)
                   for cc in ("cc", "gcc"))
    if not (compiler and headers.exists()):
        pytest.skip("no C compiler or no Python headers: the kernel copy is the expected fallback")
    assert _safecopy is not None, "pip install -e . should have built kvbrokerd._safecopy here"


# -- copies that do not fault ----------------------------------------------------------------------------------------

@needs_extension
@pytest.mark.parametrize("size", [0, 1, 7, 4095, 4096, 4097, MIB - 1, MIB, MIB + 13, 3 * MIB + 4099])
@pytest.mark.parametrize("src_shift,dst_shift", [(0, 0), (1, 0), (0, 3), (13, 61)])
def test_copies_every_byte_at_any_size_and_alignment(size: int, src_shift: int, dst_shift: int) -> None:
    assert _safecopy is not None
    src = np.random.default_rng(size).integers(0, 256, size + 64, dtype=np.uint8)
    dst = np.zeros(size + 64, dtype=np.uint8)
    _safecopy.copy_runs(*_runs((dst.ctypes.data + dst_shift, src.ctypes.data + src_shift, size)))
    assert np.array_equal(dst[dst_shift:dst_shift + size], src[src_shift:src_shift + size])
    assert not dst[:dst_shift].any() and not dst[dst_shift + size:].any(), "wrote outside the destination"


@needs_extension
def test_bad_arguments_are_refused_before_any_byte_moves() -> None:
    assert _safecopy is not None
    buf = np.zeros(32, dtype=np.uint8)
    a = buf.ctypes.data
    buf[16:] = 7
    for run in [(a, 0, 1), (0, a + 16, 1),  # a null address
                (a, a + 16, 2**64 - 2),  # a length past the end of the address space (a negative one, as uint64)
                (a, 2**64 - 8, 16), (2**64 - 8, a + 16, 16)]:  # a range that wraps
        with pytest.raises(ValueError):
            _safecopy.copy_runs(*_runs(run))
    good = _runs((a, a + 16, 8))
    for args in [([a], [a + 16], [8]),  # not buffers: never converted
                 (good[0].astype(np.int64), *good[1:]), (good[0], np.array(["x"]), good[2]),  # not uint64
                 (*good[:2], b"12345678")]:
        with pytest.raises(TypeError):
            _safecopy.copy_runs(*args)
    with pytest.raises(TypeError):
        _safecopy.copy_runs(*good[:2])  # type: ignore[call-arg]
    assert not buf[:16].any(), "a refused call moved bytes"
    _safecopy.copy_runs(*_runs((0, 0, 0)))  # nothing to copy: nothing touched
    _safecopy.copy_runs(*(np.zeros(0, np.uint64) for _ in range(3)))


# -- memory that vanishes -------------------------------------------------------------------------------------------

TRUNCATED_BEFORE = """
shm, side, start, length, before = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
size, keep = 8 << 20, (5 << 20) + 4096 + 100
sfd, sm, src, src_at = segment(shm + "/src", size, filled=True)
dfd, dm, dst, dst_at = segment(shm + "/dst", size)
os.ftruncate(sfd if side == "source" else dfd, keep)
first = np.zeros(before, np.uint8)  # `before` bytes of a run ahead of the one that faults, into memory that stays
ahead = [(first.ctypes.data, src_at, before)] if before else []
try:
    sc.copy_runs(*runs(*ahead, (dst_at + start, src_at + start, length)))
    print(json.dumps(None))
except sc.FaultError as e:
    ok = bool((dst[start:start + e.copied] == pattern(size)[start:start + e.copied]).all())
    ok = ok and bool((first == pattern(size)[:before]).all())
    base = src_at if side == "source" else dst_at
    print(json.dumps({**fault(e), "landed": ok, "message": str(e), "offset": e.address - base}))
"""


@needs_extension
@pytest.mark.parametrize("before", [0, 3 * MIB + 5], ids=["one-run", "second-run"])
@pytest.mark.parametrize("side", ["source", "destination"])
@pytest.mark.parametrize("start,length", [(64, (8 << 20) - 128), ((5 << 20) - 8192, 16384 + 1)],
                         ids=["large", "small"])  # small: faults in the run's first step
def test_memory_truncated_before_the_copy_is_a_fault_error_with_what_landed(shm_dir: Path, side: str, start: int,
                                                                           length: int, before: int) -> None:
    assert _safecopy is not None
    got = _result(_child(TRUNCATED_BEFORE, str(shm_dir), side, str(start), str(length), str(before)))
    assert got is not None, "the copy read or wrote past the end of a truncated file without a fault"
    keep = (5 << 20) + 4096 + 100
    assert got["side"] == side and got["signal"] == signal.SIGBUS and got["size"] == length
    assert got["run"] == (1 if before else 0), got
    assert got["copied"] == (keep - start) // _safecopy.STEP * _safecopy.STEP, got
    assert got["landed"], "the bytes reported as copied are not the source's"
    assert keep // 4096 * 4096 <= got["offset"] < start + length, got
    assert side in got["message"]


TRUNCATED_DURING = """
shm, side = sys.argv[1], sys.argv[2]
size, keep = 64 << 20, 24 << 20
sfd, sm, src, src_at = segment(shm + "/src", size, filled=True)
dfd, dm, dst, dst_at = segment(shm + "/dst", size)
first_copy_done, faults, copies = threading.Event(), [], [0]

def copier():
    while True:
        try:
            sc.copy_runs(*runs((dst_at, src_at, size)))
        except sc.FaultError as e:
            faults.append(e)
            return
        copies[0] += 1
        first_copy_done.set()

thread = threading.Thread(target=copier)
thread.start()
first_copy_done.wait(30)
os.ftruncate(sfd if side == "source" else dfd, keep)  # while the copier goes on, without the GIL
thread.join(30)
[e] = faults
# Past `keep` a truncated destination has no pages left to look at (what the copy wrote there is gone).
seen = min(e.copied, keep) if side == "destination" else e.copied
landed = bool((dst[:seen] == pattern(size)[:seen]).all())
os.ftruncate(sfd if side == "source" else dfd, size)  # the memory is back (zeros where it had vanished)
sc.copy_runs(*runs((dst_at, src_at, size)))
print(json.dumps({**fault(e), "landed": landed, "copies": copies[0], "again": bool((dst[:keep] == src[:keep]).all())}))
"""


@needs_extension
@pytest.mark.parametrize("side", ["source", "destination"])
def test_memory_truncated_while_another_thread_copies_it_is_a_fault_error(shm_dir: Path, side: str) -> None:
    assert _safecopy is not None
    got = _result(_child(TRUNCATED_DURING, str(shm_dir), side))
    assert got["side"] == side and got["signal"] == signal.SIGBUS and got["run"] == 0, got
    # The fault is at the truncation or, if the copy had passed it when the file shrank, further on.
    assert 24 * MIB <= got["copied"] < 64 * MIB and got["copied"] % _safecopy.STEP == 0, got
    assert got["landed"] and got["again"], got
    assert got["copies"] >= 1


SEVERAL_THREADS = """
shm = sys.argv[1]
size = 4 << 20
good = segment(shm + "/good", size, filled=True)
bad = segment(shm + "/bad", size, filled=True)
os.ftruncate(bad[0], MIB_KEEP := 1 << 20)
results = {}

def worker(i):
    dst = np.zeros(size, np.uint8)
    outcome = []
    for _ in range(25):
        dst[:] = 0
        try:
            sc.copy_runs(*runs((dst.ctypes.data, (bad if i % 2 else good)[3], size)))
            outcome.append("ok" if (dst == pattern(size)).all() else "wrong bytes")
        except sc.FaultError as e:
            right = e.side == "source" and e.copied == MIB_KEEP and (dst[:MIB_KEEP] == pattern(MIB_KEEP)).all()
            outcome.append("fault" if right else f"wrong fault {fault(e)}")
    results[i] = sorted(set(outcome))

threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps(results))
"""


@needs_extension
def test_several_threads_copy_and_fault_at_once_each_with_its_own_outcome(shm_dir: Path) -> None:
    got = _result(_child(SEVERAL_THREADS, str(shm_dir)))
    assert got == {str(i): ["fault"] if i % 2 else ["ok"] for i in range(8)}


UNMAPPED = """
page = mmap.mmap(-1, 4096)
address = np.frombuffer(page, np.uint8).ctypes.data
del page  # nothing holds it: the address is unmapped now
target = np.zeros(4096, np.uint8)
try:
    sc.copy_runs(*runs((target.ctypes.data, address, 4096)))
except sc.FaultError as e:
    print(json.dumps(fault(e) | {"at": e.address - address}))
"""


@needs_extension
def test_an_unmapped_source_is_a_sigsegv_fault_error() -> None:
    got = _result(_child(UNMAPPED))
    assert got["side"] == "source" and got["signal"] == signal.SIGSEGV and got["copied"] == 0 and got["run"] == 0, got


# -- every other fault is left alone --------------------------------------------------------------------------------

REAL_CRASHES = {
    # A plain read of a truncated mapping: a bug outside any guarded copy.
    "sigbus": """
fd, m, view, at = segment(sys.argv[1] + "/seg", 1 << 20, filled=True)
os.ftruncate(fd, 4096)
print("before", flush=True)
int(view[8192])
print("survived", flush=True)
""",
    "sigsegv": """
import ctypes
print("before", flush=True)
ctypes.string_at(16)
print("survived", flush=True)
""",
    # A guarded copy is running on another thread: its guard must not catch this thread's fault.
    "sigbus-beside-a-copy": """
fd, m, view, at = segment(sys.argv[1] + "/seg", 64 << 20, filled=True)
target = np.zeros(64 << 20, np.uint8)
stop = threading.Event()
def copier():
    while not stop.is_set():
        sc.copy_runs(*runs((target.ctypes.data, at, 32 << 20)))
threading.Thread(target=copier, daemon=True).start()
os.ftruncate(fd, 48 << 20)
print("before", flush=True)
int(view[60 << 20])
print("survived", flush=True)
""",
    "sent-sigbus": """
print("before", flush=True)
os.kill(os.getpid(), signal.SIGBUS)
print("survived", flush=True)
""",
}


@needs_extension
@pytest.mark.parametrize("faulthandler", [False, True], ids=["plain", "faulthandler"])
@pytest.mark.parametrize("crash", sorted(REAL_CRASHES))
def test_a_fault_outside_a_guarded_copy_still_kills_the_process(shm_dir: Path, crash: str,
                                                                faulthandler: bool) -> None:
    """With faulthandler enabled first (as `python -X faulthandler` does), it still reports the crash."""
    out = _child(REAL_CRASHES[crash], str(shm_dir), python_args=("-X", "faulthandler") if faulthandler else ())
    want = signal.SIGSEGV if crash == "sigsegv" else signal.SIGBUS
    assert out.returncode == -want, (out.returncode, out.stdout, out.stderr)
    assert out.stdout.splitlines() == ["before"], out.stdout
    if faulthandler:
        assert "Fatal Python error" in out.stderr, out.stderr


FAULTHANDLER_FIRST = """
import faulthandler
assert faulthandler.is_enabled()
fd, m, view, at = segment(sys.argv[1] + "/seg", 4 << 20, filled=True)
os.ftruncate(fd, 1 << 20)
target = np.zeros(4 << 20, np.uint8)
for _ in range(3):
    try:
        sc.copy_runs(*runs((target.ctypes.data, at, 4 << 20)))
    except sc.FaultError as e:
        last = fault(e)
print(json.dumps({**last, "in_place": sc.handler_in_place()}))
"""


@needs_extension
def test_faulthandler_enabled_first_sees_nothing_of_a_guarded_fault(shm_dir: Path) -> None:
    out = _child(FAULTHANDLER_FIRST, str(shm_dir), python_args=("-X", "faulthandler"))
    got = _result(out)
    assert out.stderr == "", out.stderr
    assert got["side"] == "source" and got["copied"] == MIB and got["in_place"], got


# -- which copy kvbrokerd uses ---------------------------------------------------------------------------------------

@needs_extension
@pytest.mark.parametrize("case", ["built", "off", "missing"])
def test_memcopy_says_which_copy_it_uses_and_falls_back_to_the_kernel(case: str) -> None:
    code = ("import logging, sys\n"
            "if sys.argv[1] == 'missing':\n    sys.modules['kvbrokerd._safecopy'] = None  # as if never built\n"
            "from kvbrokerd.backends.common import memcopy\n"
            "import json\n"
            "level, line = memcopy.copy_path()\n"
            "print(json.dumps({'level': logging.getLevelName(level), 'line': line,\n"
            "                  'loaded': 'kvbrokerd._safecopy' in sys.modules and sys.modules['kvbrokerd._safecopy'] "
            "is not None, 'maps_registered': memcopy.maps_to_copy(False)}))\n")
    out = subprocess.run([sys.executable, "-c", code, case], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "KVBROKER_SAFECOPY": "0" if case == "off" else "1"})
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    if case == "built":
        assert got == {"level": "INFO", "line": "memory copies: fault-safe memmove (kvbrokerd._safecopy) for every run",
                       "loaded": True, "maps_registered": True}
        return
    assert not got["loaded"] and not got["maps_registered"], got  # no handler installed, registered memory unmapped
    assert "the kernel (pread" in got["line"]
    if case == "off":
        assert got["level"] == "INFO" and "turned off (KVBROKER_SAFECOPY=0)" in got["line"], got
    else:
        assert got["level"] == "WARNING" and "not available" in got["line"] and "C compiler" in got["line"], got


@pytest.mark.parametrize("setting", ["1", "0"])
def test_the_daemon_logs_its_copy_path_at_start(tmp_path: Path, setting: str) -> None:
    with LocalDaemon(tmp_path, 1, backends=("shm",), env={"KVBROKER_SAFECOPY": setting}) as daemon:
        assert daemon.stop() == 0, daemon.log_tail()
    lines = [line for line in daemon.log_path.read_text().splitlines() if "memory copies:" in line]
    assert len(lines) == 1, daemon.log_tail(40)
    if setting == "0":
        assert "turned off" in lines[0]
    elif _safecopy is not None:
        assert "fault-safe memmove" in lines[0]


STABLE_MEMORY_TRUNCATED = """
import concurrent.futures, time
from kvbroker.types import CacheDesc, DataType
from kvbrokerd.backends.common import memcopy
from kvbrokerd.registry.endpoint import Endpoint
from kvbrokerd.errors import LlmError
from kvbrokerd.dataplane.plan import Progress
from kvbrokerd.transfers.planner import LayerSelection, plan_blocks

shm, side = sys.argv[1], sys.argv[2]
desc = CacheDesc(num_tensors=2, shape=(64, 256 << 10), data_type=DataType.UINT8)  # 32 MiB: two copy threads
n = desc.num_tensors * desc.tensor_nbytes
src, dst = segment(shm + "/src", n, filled=True), segment(shm + "/dst", n)
def side_of(seg, label):  # daemon-owned memory (memmove's rule), no size re-check: it shrinks after the check
    return Endpoint(label, [seg[3], seg[3] + desc.tensor_nbytes], [seg[0]] * 2, [0, desc.tensor_nbytes],
                            True, lambda: None)
os.ftruncate((src if side == "source" else dst)[0], desc.tensor_nbytes + 40 * (256 << 10))
blocks = np.arange(64, dtype=np.uint64)
plan = plan_blocks(desc, desc, blocks, blocks, LayerSelection())
progress = Progress(plan)
try:
    memcopy.copy_plan(side_of(src, "the source"), side_of(dst, "the destination"), plan, progress,
                      time.monotonic() + 30, concurrent.futures.ThreadPoolExecutor(1), threads=2)
except LlmError as e:
    print(json.dumps({"status": e.status.name, "message": e.message,
                      "failed": progress.failed_dst_blocks().tolist()}))
"""


@pytest.mark.parametrize("side", ["source", "destination"])
@pytest.mark.parametrize("safecopy", ["1", "0"])
def test_daemon_owned_memory_truncated_under_two_copy_threads(shm_dir: Path, side: str, safecopy: str) -> None:
    """memmove's memory is daemon-owned: only a process of the daemon's own user can truncate it. With the extension
    even that is an error, with the blocks that did not land; without it, that process can still kill the daemon
    (docs/THREAT_MODEL.md)."""
    if safecopy == "1" and _safecopy is None:
        pytest.skip("kvbrokerd._safecopy is not built here")
    out = _child(STABLE_MEMORY_TRUNCATED, str(shm_dir), side, env={"KVBROKER_SAFECOPY": safecopy})
    if safecopy == "0":
        assert out.returncode == -signal.SIGBUS, (out.returncode, out.stderr)
        return
    got = _result(out)
    assert got["status"] == "LLM_KV_CACHE_NOT_EXIST", got
    assert f"the {side}: its memory" in got["message"], got
    # Tensor 0 and blocks 0-39 of tensor 1 are still there; what failed is at least the rest of tensor 1.
    assert set(range(40, 64)) <= set(got["failed"]), got


# -- many runs in one call ------------------------------------------------------------------------------------------

@needs_extension
def test_copy_runs_copies_every_run_and_nothing_between() -> None:
    assert _safecopy is not None
    rng = np.random.default_rng(3)
    src = rng.integers(0, 256, 4 << 20, dtype=np.uint8)
    dst = np.zeros(4 << 20, dtype=np.uint8)
    s, d = src.ctypes.data, dst.ctypes.data
    runs = [(d + 100, s + 5000, 70000), (d + 80000, s + 10, 1), (d + 90000, s + 900000, 0), (d + 500000, s, 300000),
            (d + MIB + 3, s + 7, 2 * MIB + 13)]  # more than one step
    _safecopy.copy_runs(*_runs(*runs))
    expected = np.zeros_like(dst)
    for to, frm, n in runs:
        expected[to - d : to - d + n] = src[frm - s : frm - s + n]
    assert np.array_equal(dst, expected)


@needs_extension
def test_copy_runs_refuses_bad_runs_before_any_byte_moves() -> None:
    assert _safecopy is not None
    buf = np.zeros(64, dtype=np.uint8)
    a = buf.ctypes.data
    bad = [_runs((a, a + 8, 16)), _runs((a + 8, a, 16)),  # overlaps itself (either way round)
           _runs((a, a + 32, 8), (0, a, 8)),  # a null address after a good run: refused before the good one moves
           _runs((a, 2**64 - 4, 16))]
    buf[32:40] = 7
    for args in bad:
        with pytest.raises(ValueError):
            _safecopy.copy_runs(*args)
    assert not buf[:8].any(), "a run before the refused one was copied"
    dst, src, n = _runs((a, a + 32, 8))
    with pytest.raises(ValueError):
        _safecopy.copy_runs(dst, src, np.concatenate([n, n]))  # lengths differ
    with pytest.raises(TypeError):
        _safecopy.copy_runs(dst, src, n.astype(np.int64))  # not uint64: never reinterpreted
    with pytest.raises((TypeError, BufferError, ValueError)):  # a strided view: never read as if contiguous
        two_dst, two_src, two_n = _runs((a, a + 32, 4), (a + 8, a + 40, 4))
        _safecopy.copy_runs(np.repeat(two_dst, 2)[::2], two_src, two_n)


TRUNCATED_RUNS = """
shm = sys.argv[1]
size, keep = 8 << 20, 5 << 20
sfd, sm, src, src_at = segment(shm + "/src", size, filled=True)
dfd, dm, dst, dst_at = segment(shm + "/dst", size)
os.ftruncate(sfd, keep)
run = 1 << 20
starts = np.arange(0, size, run, dtype=np.uint64)  # runs 0-4 are inside what is left, 5-7 are not
try:
    sc.copy_runs(dst_at + starts, src_at + starts, np.full(len(starts), run, dtype=np.uint64))
    print(json.dumps(None))
except sc.FaultError as e:
    landed = bool((dst[: e.run * run] == pattern(size)[: e.run * run]).all())
    print(json.dumps({**fault(e), "landed": landed}))
"""


@needs_extension
def test_copy_runs_says_which_run_faulted_and_the_runs_before_it_landed(shm_dir: Path) -> None:
    got = _result(_child(TRUNCATED_RUNS, str(shm_dir)))
    assert got is not None, "copied from a truncated file without a fault"
    assert got["run"] == 5 and got["side"] == "source" and got["signal"] == signal.SIGBUS, got
    assert got["landed"], "a run reported as landed holds other bytes than the source's"


# -- strided entries (copy_strided) ---------------------------------------------------------------------------------

def _entries(*entries: tuple[int, int, int, int, int, int]) -> tuple[np.ndarray, ...]:
    """(dst, src, n, count, dst_step, src_step) columns of `sc.copy_strided`."""
    return tuple(np.array(column, dtype=np.uint64) for column in zip(*entries, strict=True))


@needs_extension
@pytest.mark.parametrize("stream", [False, True])
def test_copy_strided_copies_every_repetition_and_nothing_between(stream: bool) -> None:
    """Every short size that has its own copy loop, a long one, gaps on either side, a step of zero on a single
    repetition; `stream`: the call is large enough for streaming stores (whole aligned lines with gaps)."""
    assert _safecopy is not None
    rng = np.random.default_rng(4)
    size = 24 << 20
    src = rng.integers(0, 256, size, dtype=np.uint8)
    dst = np.zeros(size, dtype=np.uint8)
    s = src.ctypes.data
    d = dst.ctypes.data + (-dst.ctypes.data) % 64  # line-aligned, where streaming applies
    entries = [(d + 64, s + 3, 64, 1000, 128, 64), (d + 200_000, s + 7, 16, 300, 48, 16),
               (d + 300_001, s + 100_000, 32, 17, 33, 40), (d + 400_000, s + 11, 128, 90, 256, 128),
               (d + 500_000, s + 5, 256, 40, 512, 300), (d + 600_000, s + 9, 5000, 7, 6000, 5001),
               (d + 700_000, s + 1, 100, 1, 0, 0), (d + MIB, s + 2 * MIB, 3 * MIB + 5, 2, 4 * MIB, 3 * MIB + 5)]
    if stream:  # past STREAM_MIN_BYTES in all, line-aligned destinations: 64-byte repetitions with gaps, back to
        # back (a 64 -> 32 remap's K rows), and entries done once (its V rows)
        entries += [(d + 10 * MIB, s + 12 * MIB, 64, 70_000, 128, 64),
                    (d + 20 * MIB, s + 21 * MIB + 3, 64, 3000, 64, 128),
                    (d + 21 * MIB, s + 22 * MIB + 1, 8192, 1, 0, 0), (d + 22 * MIB, s + 5, 3 * 64, 1, 0, 0)]
    _safecopy.copy_strided(*_entries(*entries))
    expected = np.zeros_like(dst)
    for to, frm, n, count, to_step, frm_step in entries:
        for k in range(count):
            at, base = to - dst.ctypes.data + k * to_step, frm - s + k * frm_step
            expected[at : at + n] = src[base : base + n]
    assert np.array_equal(dst, expected)


@needs_extension
def test_copy_strided_refuses_bad_entries_before_any_byte_moves() -> None:
    assert _safecopy is not None
    buf = np.zeros(256, dtype=np.uint8)
    a = buf.ctypes.data
    buf[128:] = 7
    good = (a, a + 128, 8, 2, 16, 8)
    bad = [(a, a + 4, 8, 1, 0, 0),  # one repetition overlaps itself
           (a, a + 128, 8, 3, 64, 0),  # repetition 2 writes [128, 136), which it reads
           (0, a, 8, 2, 8, 8),  # a null address
           (a, a + 128, 16, 2**62, 2**62, 16),  # its last repetition passes the end of the address space
           (a, a + 128, 2**64 - 1, 2, 0, 0)]
    for entry in bad:
        with pytest.raises(ValueError, match="entry 1 "):
            _safecopy.copy_strided(*_entries(good, entry))  # refused before the good entry moves
        assert not buf[:128].any(), "an entry before the refused one was copied"
    dst, src, n, count, dst_step, src_step = _entries(good)
    with pytest.raises(ValueError):
        _safecopy.copy_strided(dst, src, np.concatenate([n, n]), count, dst_step, src_step)
    with pytest.raises(TypeError):
        _safecopy.copy_strided(dst, src, n, count.astype(np.int64), dst_step, src_step)
    with pytest.raises(TypeError):
        _safecopy.copy_strided(dst, src, n, count, dst_step)  # type: ignore[call-arg]


TRUNCATED_STRIDED = """
shm = sys.argv[1]
size, keep = 8 << 20, 5 << 20
sfd, sm, src, src_at = segment(shm + "/src", size, filled=True)
dfd, dm, dst, dst_at = segment(shm + "/dst", size)
os.ftruncate(sfd if sys.argv[2] == "source" else dfd, keep)
# entry 0 reads and writes within what is left; entry 1 reads (or writes) 64 bytes every 64 KiB from 4 MiB on: its
# repetition 16 is the first past the end
steps = np.array([0, 1 << 16], dtype=np.uint64)
try:
    sc.copy_strided(np.array([dst_at, dst_at + (4 << 20)], dtype=np.uint64),
                    np.array([src_at + 4096, src_at + (4 << 20)], dtype=np.uint64),
                    np.array([1 << 20, 64], dtype=np.uint64), np.array([1, 64], dtype=np.uint64), steps, steps)
    print(json.dumps(None))
except sc.FaultError as e:
    expected = pattern(size)
    landed = bool((dst[: 1 << 20] == expected[4096 : 4096 + (1 << 20)]).all())
    for k in range(e.repeat):  # the repetitions before the fault
        at = (4 << 20) + k * (1 << 16)
        landed = landed and bool((dst[at : at + 64] == expected[at : at + 64]).all())
    print(json.dumps({**fault(e), "repeat": e.repeat, "landed": landed}))
"""


@needs_extension
@pytest.mark.parametrize("side", ["source", "destination"])
def test_copy_strided_says_which_entry_and_repetition_faulted(shm_dir: Path, side: str) -> None:
    """A truncated segment under a strided copy is a FaultError, never a dead process: it names the entry and the
    repetition, and every repetition before it landed."""
    got = _result(_child(TRUNCATED_STRIDED, str(shm_dir), side))
    assert got is not None, "copied across a truncated file without a fault"
    assert got["run"] == 1 and got["repeat"] == 16 and got["side"] == side, got
    assert got["signal"] == signal.SIGBUS, got
    assert got["landed"], "a repetition reported as landed holds other bytes than the source's"


STRIDED_PLAN_FAULT = """
import concurrent.futures, time
from kvbrokerd.backends.common import memcopy
from kvbrokerd.errors import LlmError
from kvbrokerd.registry.endpoint import Endpoint
from kvbrokerd.dataplane.plan import Plan, Progress
shm, bpb = sys.argv[1], 4096
sfd, sm, src, src_at = segment(shm + "/src", 8 << 20, filled=True)
dfd, dm, dst, dst_at = segment(shm + "/dst", 8 << 20)
os.ftruncate(sfd, 5 << 20)  # source blocks from 1280 on are gone: repetition 640 of the entry below faults
one = lambda v: np.array([v], dtype=np.uint64)
# one entry: source block 2k -> destination block 2k + 1, for k < 1000
plan = Plan(np.zeros(1, np.uint32), one(0), np.zeros(1, np.uint32), one(bpb), one(bpb), np.zeros(0, np.uint64), bpb,
            count=one(1000), src_stride=one(2 * bpb), dst_stride=one(2 * bpb))
progress = Progress(plan)
endpoint = lambda at, fd: Endpoint("cache", [at], [fd], [0], False, lambda: None)
try:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        memcopy.copy_plan(endpoint(src_at, sfd), endpoint(dst_at, dfd), plan, progress, time.monotonic() + 30, pool,
                          threads=1)
    print(json.dumps(None))
except LlmError as e:
    expected = pattern(8 << 20)
    landed = all((dst[(2 * k + 1) * bpb : (2 * k + 2) * bpb] == expected[2 * k * bpb : (2 * k + 1) * bpb]).all()
                 for k in range(640))
    print(json.dumps({"status": e.status.name, "failed": progress.failed_dst_blocks().tolist(),
                      "moved": progress.bytes_moved, "landed": bool(landed)}))
"""


@needs_extension
def test_a_strided_copy_that_faults_reports_exactly_the_repetitions_that_did_not_land(shm_dir: Path) -> None:
    got = _result(_child(STRIDED_PLAN_FAULT, str(shm_dir)))
    assert got is not None, "copied from a truncated file without a fault"
    assert got["status"] == "LLM_KV_CACHE_NOT_EXIST" and got["landed"], got
    assert got["failed"] == [2 * k + 1 for k in range(640, 1000)] and got["moved"] == 640 * 4096
