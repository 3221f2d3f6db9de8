"""The loopback limit: a plain Python socket stream of the same scattered blocks between two processes.

    python bench/peers/socket_peer.py --conns 2

This process (the receiver) starts a sender process, which opens `--conns` TCP connections to it over 127.0.0.1.
For each block size the sender streams every block of its buffer in kvbroker's scattered order with
`sendall(memoryview)`, and the receiver `recv_into`s each block straight into its scattered destination in a
preallocated buffer: no framing, no copies beyond the kernel's. Blocks are dealt round-robin to the connections,
one thread per connection on each side. Prints one KVBENCH_RESULT JSON line.
"""

from __future__ import annotations

import argparse
import functools
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from peer_common import (
    Ctl,
    Layout,
    add_common_args,
    check_pattern,
    emit,
    gbps,
    layouts,
    listen_loopback,
    median,
    parse_size,
    request_fills,
    serve_fills,
    target_process,
)


def tune(sock: socket.socket, bufsize: int) -> None:
    if bufsize:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, bufsize)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, bufsize)


def run_threads(fns: list[Callable[[], None]]) -> None:
    errors: list[BaseException] = []

    def wrap(fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=wrap, args=(fn,)) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def rounds(lay: Layout, total: int, trials: int) -> list[int]:
    """Whole-buffer passes per round: one warm-up round of 1, then `trials` timed rounds."""
    return [1] + [lay.reps(total)] * trials


def sender(args: argparse.Namespace) -> None:
    ctl = Ctl.connect(args.ctl)
    buf = np.empty(args.tensors * parse_size(args.tensor_bytes), dtype=np.uint8)
    mv = buf.data
    port = ctl.recv()["data_port"]
    conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(args.conns)]
    for c in conns:
        tune(c, args.sockbuf)
    total = parse_size(args.total_bytes)
    by_block = {lay.block: lay for lay in layouts(args)}
    for block in serve_fills(ctl, buf):
        lay = by_block[block]
        src_off, _ = lay.offsets()
        shares = [src_off[i :: args.conns].tolist() for i in range(args.conns)]
        for passes in rounds(lay, total, args.trials):

            def send(c: socket.socket, offs: list[int], passes: int = passes, b: int = lay.block) -> None:
                if c.recv(1) != b"g":
                    raise ConnectionError("receiver went away")
                for _ in range(passes):
                    for off in offs:
                        c.sendall(mv[off : off + b])

            run_threads([functools.partial(send, c, s) for c, s in zip(conns, shares, strict=True)])
    for c in conns:
        c.close()


def receiver(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    srv, data_port = listen_loopback()
    with target_process(__file__, argv) as ctl:
        ctl.send({"data_port": data_port})
        conns = [srv.accept()[0] for _ in range(args.conns)]
        srv.close()
        for c in conns:
            tune(c, args.sockbuf)
        buf = np.empty(args.tensors * parse_size(args.tensor_bytes), dtype=np.uint8)
        buf[:] = 255
        mv = buf.data
        total = parse_size(args.total_bytes)
        out: dict[str, Any] = {}
        for lay in request_fills(args, ctl):
            src_off, dst_off = lay.offsets()
            shares = [dst_off[i :: args.conns].tolist() for i in range(args.conns)]
            results = []
            for n, passes in enumerate(rounds(lay, total, args.trials)):

                def recv(c: socket.socket, offs: list[int], passes: int = passes, b: int = lay.block) -> None:
                    c.sendall(b"g")
                    for _ in range(passes):
                        for off in offs:
                            end = off + b
                            while off < end:
                                k = c.recv_into(mv[off:end])
                                if k == 0:
                                    raise ConnectionError("sender went away")
                                off += k

                t0 = time.perf_counter()
                run_threads([functools.partial(recv, c, s) for c, s in zip(conns, shares, strict=True)])
                if n:
                    results.append(gbps(passes * lay.pull_bytes, time.perf_counter() - t0))
            check_pattern(buf, src_off, dst_off, lay.block)
            out[str(lay.block)] = {"gbps": median(results), "trials": results,
                                   "bytes_per_trial": lay.reps(total) * lay.pull_bytes}
        for c in conns:
            c.close()
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_common_args(parser)
    parser.add_argument("--conns", type=int, default=1, help="connections, one thread each per side")
    parser.add_argument("--sockbuf", type=int, default=0, help="SO_SNDBUF/SO_RCVBUF bytes (0: kernel default)")
    args = parser.parse_args()
    if args.role == "target":
        sender(args)
        return
    t0 = time.perf_counter()
    results = receiver(args, sys.argv[1:])
    emit({"subject": f"socket-{args.conns}c", "results": results,
          "info": {"conns": args.conns, "sockbuf": args.sockbuf, "seconds": time.perf_counter() - t0}})


if __name__ == "__main__":
    main()
