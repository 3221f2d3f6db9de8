"""NIXL (UCX backend, DRAM) block READs between two agents in two processes; prints one JSON object.

Run by kvbench.py with the python of bench/.venvs/nixl (see bench/setup_peers.sh):
    bench/.venvs/nixl/bin/python bench/peers/nixl_bench.py --ucx tcp      # UCX_TLS=tcp UCX_NET_DEVICES=lo
    bench/.venvs/nixl/bin/python bench/peers/nixl_bench.py --ucx default  # UCX picks (same host: shm / CMA)
    ... --memory shm   # both buffers are /dev/shm file mappings, like kvbroker's caches (default: anonymous memory)
The initiator (this process) READs every block of the target's cache into its own, in the same scattered order as
kvbroker's pull (peer_common.Layout), one prepared transfer per whole-cache pull, polled to completion.
"""

from __future__ import annotations

import argparse
import base64
import mmap
import os
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

UCX_ENV = {"tcp": {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}, "default": {}}
# Measured on the 2-core machine: same-host (CMA) copies run in the polling thread, so busy polling is fastest;
# over UCX tcp a busy poll competes with the progress threads of both agents, and a 1 ms sleep is fastest.
POLL_SLEEP_US = {"tcp": 1000.0, "default": 0.0}


def make_agent(name: str) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


def register(agent: Any, buf: np.ndarray) -> None:
    agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")


def alloc(nbytes: int, memory: str) -> np.ndarray:
    """The buffer the agent registers: anonymous memory, or a /dev/shm file mapping as kvbroker's caches are (which
    matters: the kernel gives anonymous memory transparent huge pages and shmem none, and CMA copies pin every page).
    The file is unlinked at once; the mapping lives as long as the array."""
    if memory == "anon":
        return np.empty(nbytes, dtype=np.uint8)
    path = f"/dev/shm/kvbench-nixl-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
        os.unlink(path)
    return np.frombuffer(mm, dtype=np.uint8)


def block_descs(addr: int, nbytes: int, block: int) -> np.ndarray:
    """Nx3 (address, length, device) descriptors, one per block of a flat buffer."""
    n = nbytes // block
    d = np.zeros((n, 3), dtype=np.uint64)
    d[:, 0] = addr + np.arange(n, dtype=np.uint64) * np.uint64(block)
    d[:, 1] = block
    return d


def target(args: argparse.Namespace) -> None:
    ctl = Ctl.connect(args.ctl)
    cache_bytes = args.tensors * parse_size(args.tensor_bytes)
    buf = alloc(cache_bytes, args.memory)
    agent = make_agent("kvbench-target")
    register(agent, buf)
    ctl.send({"meta": base64.b64encode(agent.get_agent_metadata()).decode(), "addr": buf.ctypes.data})
    for _ in serve_fills(ctl, buf):
        pass  # nothing more to do per block size: the initiator READs


def initiator(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    with target_process(__file__, argv) as ctl:
        hello = ctl.recv()
        cache_bytes = args.tensors * parse_size(args.tensor_bytes)
        dst = alloc(cache_bytes, args.memory)
        dst[:] = 255  # first touch outside timing
        agent = make_agent("kvbench-initiator")
        register(agent, dst)
        remote = agent.add_remote_agent(base64.b64decode(hello["meta"]))
        total = parse_size(args.total_bytes)
        poll_sleep = (POLL_SLEEP_US[args.ucx] if args.poll_sleep_us is None else args.poll_sleep_us) / 1e6
        out: dict[str, Any] = {}
        for lay in request_fills(args, ctl):
            local_h = agent.prep_xfer_dlist("NIXL_INIT_AGENT", block_descs(dst.ctypes.data, cache_bytes, lay.block),
                                            "DRAM")
            remote_h = agent.prep_xfer_dlist(remote, block_descs(int(hello["addr"]), cache_bytes, lay.block), "DRAM")
            src_off, dst_off = lay.offsets()
            src_idx = (src_off // lay.block).astype(np.int32)
            dst_idx = (dst_off // lay.block).astype(np.int32)

            def pull(local_h: Any = local_h, remote_h: Any = remote_h, src_idx: np.ndarray = src_idx,
                     dst_idx: np.ndarray = dst_idx) -> None:
                handle = agent.make_prepped_xfer("READ", local_h, dst_idx, remote_h, src_idx)
                state = agent.transfer(handle)
                while state == "PROC":
                    if poll_sleep:
                        time.sleep(poll_sleep)
                    state = agent.check_xfer_state(handle)
                if state != "DONE":
                    raise RuntimeError(f"NIXL transfer ended in state {state}")
                agent.release_xfer_handle(handle)

            r = timed_trials(lay, total, args.trials, pull)
            check_pattern(dst, src_off, dst_off, lay.block)
            out[str(lay.block)] = r
            agent.release_dlist_handle(local_h)
            agent.release_dlist_handle(remote_h)
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_common_args(parser)
    parser.add_argument("--memory", choices=("anon", "shm"), default="anon",
                        help="anon: np.empty buffers; shm: /dev/shm file mappings, the memory kvbroker's caches use")
    parser.add_argument("--ucx", choices=sorted(UCX_ENV), default="default",
                        help="tcp: UCX_TLS=tcp UCX_NET_DEVICES=lo; default: UCX chooses (same-host transports)")
    parser.add_argument("--poll-sleep-us", type=float, default=None,
                        help="sleep between completion polls; default: NIXL's fastest here (busy-poll for same host, "
                             "1 ms for tcp, where busy polling starves UCX's progress threads on 2 cores)")
    args = parser.parse_args()
    os.environ.update(UCX_ENV[args.ucx])  # before nixl/UCX load; the target inherits it
    if args.role == "target":
        target(args)
        return
    argv = sys.argv[1:]
    t0 = time.perf_counter()
    results = initiator(args, argv)
    import nixl

    emit({
        "subject": f"nixl-{'tcp' if args.ucx == 'tcp' else 'samehost'}" + ("-shm" if args.memory == "shm" else ""),
        "results": results,
        "info": {"nixl_version": getattr(nixl, "__version__", "1.5.1"), "ucx_env": UCX_ENV[args.ucx],
                 "poll_sleep_us": POLL_SLEEP_US[args.ucx] if args.poll_sleep_us is None else args.poll_sleep_us,
                 "seconds": time.perf_counter() - t0},
    })


if __name__ == "__main__":
    main()
