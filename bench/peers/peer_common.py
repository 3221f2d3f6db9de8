"""What every benchmark subject shares: the block layout, the scattered block order, the schedule, the control channel.

Imported by kvbench.py and by the peer scripts, which run in their own venvs (stdlib + numpy only here).

Layout: a cache of `tensors` tensors of `tensor_bytes` each, cut into blocks of `block` bytes. A pull moves every
block of every tensor: source block `src_perm[i]` to destination block `dst_perm[i]` (two random permutations), in
tensor-major order, exactly the byte runs kvbroker's planner makes for `pull_kv_blocks(src_perm, dst_perm)`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import struct
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


def parse_size(text: str) -> int:
    """'64K' / '2M' / '1G' / '4096' -> bytes (binary units)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": KiB, "M": MiB, "G": GiB}.get(t[-1:], 1)
    if mult != 1:
        t = t[:-1]
    return int(float(t) * mult)


def fmt_size(n: int) -> str:
    for unit, mult in (("G", GiB), ("M", MiB), ("K", KiB)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)


@dataclass(frozen=True)
class Layout:
    tensors: int
    tensor_bytes: int
    block: int
    seed: int = 7

    @property
    def blocks_per_tensor(self) -> int:
        return self.tensor_bytes // self.block

    @property
    def pull_bytes(self) -> int:
        """Bytes one pull of every block moves."""
        return self.tensors * self.blocks_per_tensor * self.block

    @property
    def cache_bytes(self) -> int:
        return self.tensors * self.tensor_bytes

    def perms(self) -> tuple[np.ndarray, np.ndarray]:
        """(src blocks, dst blocks): two random permutations of the blocks of one tensor (same for every run)."""
        rng = np.random.default_rng(self.seed * 1_000_003 + self.block)
        nb = self.blocks_per_tensor
        return rng.permutation(nb).astype(np.int64), rng.permutation(nb).astype(np.int64)

    def offsets(self) -> tuple[np.ndarray, np.ndarray]:
        """(src byte offsets, dst byte offsets) in the cache's flat memory, tensor-major, one per block moved."""
        sp, dp = self.perms()
        base = (np.arange(self.tensors, dtype=np.int64) * self.tensor_bytes)[:, None]
        return (base + sp[None, :] * self.block).ravel(), (base + dp[None, :] * self.block).ravel()

    def reps(self, total_bytes: int) -> int:
        """Pulls of the whole cache needed to move at least `total_bytes`."""
        return max(1, -(-total_bytes // self.pull_bytes))


def fill_pattern(flat: np.ndarray, block: int) -> None:
    """Byte value of block k (over the flat buffer) = k % 251: touches every page, and blocks are recognisable."""
    nb = flat.size // block
    flat[: nb * block].reshape(nb, block)[:] = (np.arange(nb) % 251).astype(np.uint8)[:, None]


def check_pattern(dst: np.ndarray, src_off: np.ndarray, dst_off: np.ndarray, block: int, samples: int = 64) -> None:
    """Raises unless sampled destination blocks hold the pattern of the source block they were copied from."""
    idx = np.linspace(0, len(src_off) - 1, min(samples, len(src_off))).astype(np.int64)
    for i in idx:
        want = (int(src_off[i]) // block) % 251
        got = dst[int(dst_off[i]) : int(dst_off[i]) + block]
        if got[0] != want or got[-1] != want:
            raise AssertionError(f"block at dst offset {int(dst_off[i])} holds {int(got[0])}, expected {want}")


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


class Ctl:
    """A length-prefixed JSON control channel over one loopback TCP connection."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    @classmethod
    def connect(cls, port: int, timeout: float = 60.0) -> Ctl:
        deadline = time.monotonic() + timeout
        while True:
            try:
                return cls(socket.create_connection(("127.0.0.1", port), timeout=timeout))
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def send(self, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.sock.sendall(struct.pack("!I", len(data)) + data)

    def recv(self) -> Any:
        (n,) = struct.unpack("!I", self._exact(4))
        return json.loads(self._exact(n))

    def _exact(self, n: int) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self.sock.recv_into(view[got:])
            if k == 0:
                raise ConnectionError("control channel closed")
            got += k
        return bytes(buf)

    def close(self) -> None:
        self.sock.close()


def listen_loopback() -> tuple[socket.socket, int]:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    return srv, srv.getsockname()[1]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """The arguments kvbench passes to every peer script (argparse parser)."""
    parser.add_argument("--sizes", default="64K,256K,2M", help="block sizes")
    parser.add_argument("--total-bytes", default="1G", help="bytes moved per timed trial (whole-cache pulls repeated)")
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--tensor-bytes", default="32M")
    parser.add_argument("--trials", type=int, default=3, help="timed trials per size (median reported)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--role", choices=["initiator", "target"], default="initiator", help=argparse.SUPPRESS)
    parser.add_argument("--ctl", type=int, default=0, help=argparse.SUPPRESS)


def layouts(args: argparse.Namespace) -> list[Layout]:
    tb = parse_size(args.tensor_bytes)
    return [Layout(args.tensors, tb, parse_size(s), args.seed) for s in args.sizes.split(",") if s]


@contextlib.contextmanager
def target_process(script: str, argv: list[str]) -> Iterator[Ctl]:
    """Starts `script --role target` with this interpreter and the same arguments and yields the control channel to
    it; when the body is done, tells the target so ("done"), then closes the channel and waits for the target
    (killing it after 30 s)."""
    import subprocess

    srv, port = listen_loopback()
    srv.settimeout(120.0)
    proc = subprocess.Popen([sys.executable, script, *argv, "--role", "target", "--ctl", str(port)])
    try:
        conn, _ = srv.accept()
    except OSError:
        proc.kill()
        raise
    finally:
        srv.close()
    conn.settimeout(None)
    ctl = Ctl(conn)
    try:
        yield ctl
        ctl.send({"cmd": "done"})
    finally:
        ctl.close()
        try:
            proc.wait(30)
        except Exception:
            proc.kill()


def request_fills(args: argparse.Namespace, ctl: Ctl) -> Iterator[Layout]:
    """The initiator's side of the control loop: for each block size, asks the target to fill its source buffer with
    that size's pattern and waits until it has; yields the size's layout."""
    for lay in layouts(args):
        ctl.send({"cmd": "fill", "block": lay.block})
        ctl.recv()
        yield lay


def serve_fills(ctl: Ctl, buf: np.ndarray) -> Iterator[int]:
    """The target's side of the control loop: for each block size the initiator asks for, fills `buf` with that
    size's pattern, says so, and yields the size (a target that sends, like the socket peer's, then sends it); ends
    when the initiator is done, closing the channel."""
    try:
        while (msg := ctl.recv())["cmd"] != "done":
            block = int(msg["block"])
            fill_pattern(buf, block)
            ctl.send({"ok": True})
            yield block
    finally:
        ctl.close()


def timed_trials(layout: Layout, total_bytes: int, trials: int, pull: Callable[[], object]) -> dict[str, Any]:
    """One untimed warm-up pull (first-touch page faults), then `trials` timed trials of `reps` whole-cache pulls;
    `pull()` does one pull. The timing loop of kvbench.py's in-process subjects and of the NIXL and Mooncake peers."""
    pull()
    reps = layout.reps(total_bytes)
    results = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(reps):
            pull()
        results.append(gbps(reps * layout.pull_bytes, time.perf_counter() - t0))
    return {"gbps": median(results), "trials": results, "bytes_per_trial": reps * layout.pull_bytes}


RESULT_MARK = "KVBENCH_RESULT "


def emit(obj: dict[str, Any]) -> None:
    """Prints the result line kvbench.py looks for (libraries may print their own lines to stdout)."""
    print(RESULT_MARK + json.dumps(obj), flush=True)
