"""Mooncake Transfer Engine (protocol tcp, P2PHANDSHAKE metadata) block READs between two engines in two processes.

Run by kvbench.py with the python of bench/.venvs/mooncake (see bench/setup_peers.sh):
    bench/.venvs/mooncake/bin/python bench/peers/mooncake_bench.py
The initiator READs every block of the target's registered buffer into its own, in the same scattered order as
kvbroker's pull (peer_common.Layout), with batch_transfer_sync_read in batches of at most --batch requests (its TCP
transport rejects larger batches). Prints one KVBENCH_RESULT JSON line.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np
from peer_common import (
    Ctl,
    add_common_args,
    check_pattern,
    emit,
    parse_size,
    request_fills,
    serve_fills,
    target_process,
    timed_trials,
)

MAX_BATCH = 2048


def make_engine() -> Any:
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    rc = engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"TransferEngine.initialize returned {rc}")
    return engine


def register(engine: Any, buf: np.ndarray) -> None:
    rc = engine.register_memory(buf.ctypes.data, buf.nbytes)
    if rc != 0:
        raise RuntimeError(f"TransferEngine.register_memory returned {rc}")


def target(args: argparse.Namespace) -> None:
    ctl = Ctl.connect(args.ctl)
    buf = np.empty(args.tensors * parse_size(args.tensor_bytes), dtype=np.uint8)
    engine = make_engine()
    register(engine, buf)
    ctl.send({"session": f"127.0.0.1:{engine.get_rpc_port()}", "addr": buf.ctypes.data})
    for _ in serve_fills(ctl, buf):
        pass  # nothing more to do per block size: the initiator READs


def initiator(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    with target_process(__file__, argv) as ctl:
        hello = ctl.recv()
        session, remote_addr = hello["session"], int(hello["addr"])
        dst = np.empty(args.tensors * parse_size(args.tensor_bytes), dtype=np.uint8)
        dst[:] = 255  # first touch outside timing
        engine = make_engine()
        register(engine, dst)
        total = parse_size(args.total_bytes)
        out: dict[str, Any] = {}
        for lay in request_fills(args, ctl):
            src_off, dst_off = lay.offsets()
            # Request lists built once per size (plain ints, as the binding wants), cut into batches.
            batches = []
            for i in range(0, len(src_off), args.batch):
                s, d = src_off[i : i + args.batch], dst_off[i : i + args.batch]
                batches.append(((d + dst.ctypes.data).tolist(), (s + remote_addr).tolist(), [lay.block] * len(s)))

            def pull(batches: list[tuple[list[int], list[int], list[int]]] = batches) -> None:
                for local, remote, lengths in batches:
                    rc = engine.batch_transfer_sync_read(session, local, remote, lengths)
                    if rc != 0:
                        raise RuntimeError(f"batch_transfer_sync_read returned {rc}")

            r = timed_trials(lay, total, args.trials, pull)
            check_pattern(dst, src_off, dst_off, lay.block)
            r["batches_per_pull"] = len(batches)
            out[str(lay.block)] = r
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_common_args(parser)
    parser.add_argument("--batch", type=int, default=MAX_BATCH, help="requests per batch (its tcp queue caps 2048)")
    args = parser.parse_args()
    if args.role == "target":
        target(args)
        return
    t0 = time.perf_counter()
    results = initiator(args, sys.argv[1:])
    from importlib.metadata import version

    emit({"subject": "mooncake-tcp", "results": results,
          "info": {"mooncake_version": version("mooncake-transfer-engine-non-cuda"), "protocol": "tcp",
                   "metadata": "P2PHANDSHAKE", "batch": args.batch, "seconds": time.perf_counter() - t0}})


if __name__ == "__main__":
    main()
