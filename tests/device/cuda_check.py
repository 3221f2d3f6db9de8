"""CUDA device check for the `nixl` backend: one GPU, one command, every byte verified, GB/s printed.

    python tests/device/cuda_check.py                        # 256 MiB per cache, 256 KiB blocks
    python tests/device/cuda_check.py --mib 1024 --out result.json

Needs an NVIDIA GPU, torch with CUDA, cuda-python, kvbroker with the nixl extra and NIXL's wheel for the driver's
CUDA (docs/device.md):  pip install -e '.[nixl]' cuda-python && pip install --no-deps nixl==1.5.1 nixl-cu13==1.5.1
Without a CUDA device it prints "no CUDA device: <why>" and exits 2; any failed step exits 1. Bounded: it gives up
after --limit-s (180 s) and stops its daemons either way.

This process is the model server. It allocates two KV caches with torch (each one allocation holding every tensor,
so each tensor is an interior view: offsets matter), fills the source with a seeded pattern and the destination with
another, and exports them with kvbroker.device (the source with torch_cache, the destination's raw pointers with
cuda_allocation + raw_locations). Two daemons (`kvbrokerd --backends nixl`) each import
one cache by CUDA IPC handle and register it with NIXL as VRAM. The destination's daemon links to the source's and
pulls: a scattered block plan (verified byte for byte on the GPU, blocks outside the plan untouched), then the whole
cache several times (GB/s), then pushes blocks back (verified). Beside it, the same bytes copied device-to-device by
torch (copy_) and by cudaMemcpy: the ceiling for one GPU. Finally both caches are unregistered (the daemons close
their mappings) before this process frees the memory, and the daemons' logs are checked for errors.

Prints one JSON summary (and writes it to --out).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "client"), str(ROOT / "server"), str(ROOT)]

NO_DEVICE_EXIT = 2
SEED = 20261


def no_device_reason() -> str | None:
    """Why this machine cannot run the check (first missing piece), or None."""
    try:
        torch: Any = importlib.import_module("torch")
    except ImportError as e:
        return f"torch is not installed ({e})"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device (torch.cuda.is_available() is False)"
    from kvbrokerd.backends import unavailable
    from kvbrokerd.backends.common.cudaipc import cuda_missing

    return cuda_missing() or unavailable("nixl")


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 2) if seconds > 0 else 0.0


def _best(fn: Callable[[], None], rounds: int, sync: Callable[[], None]) -> float:
    """Shortest wall time of `rounds` runs of fn (synchronised)."""
    best = float("inf")
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def device_baselines(torch: Any, src: Any, dst: Any, rounds: int) -> dict[str, Any]:
    """torch copy_ and cudaMemcpy device-to-device of the same bytes, GB/s."""
    sync = torch.cuda.synchronize
    out: dict[str, Any] = {"torch_copy_GBps": _gbps(src.numel(), _best(lambda: dst.copy_(src), rounds, sync))}
    try:
        from kvbrokerd.backends.common.cudaipc import load_runtime

        rt, _ = load_runtime()
        kind = rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice
        out["cudaMemcpy_GBps"] = _gbps(src.numel(), _best(
            lambda: rt.cudaMemcpy(dst.data_ptr(), src.data_ptr(), src.numel(), kind), rounds, sync))
    except Exception as e:  # the torch number still stands
        out["cudaMemcpy_error"] = f"{type(e).__name__}: {e}"
    return out


def run(args: argparse.Namespace, summary: dict[str, Any]) -> None:
    import numpy as np
    import torch

    from kvbroker import CacheIndex, ClusterInfo
    from kvbroker._local import LocalDaemon
    from kvbroker.device import cuda_allocation, raw_locations, torch_cache

    block = args.block_kib << 10
    num_tensors = args.tensors
    num_blocks = max(8, (args.mib << 20) // (block * num_tensors))
    cache_bytes = num_tensors * num_blocks * block
    summary.update(gpu=torch.cuda.get_device_name(0), torch=torch.__version__, tensors=num_tensors,
                   blocks=num_blocks, block_bytes=block, cache_bytes=cache_bytes)
    torch.cuda.set_device(0)
    gen = torch.Generator(device="cuda").manual_seed(SEED)
    # One allocation per cache, with slack in front: every tensor is an interior view of it.
    src_alloc = torch.empty(cache_bytes + block, dtype=torch.uint8, device="cuda")
    dst_alloc = torch.empty(cache_bytes + block, dtype=torch.uint8, device="cuda")
    src = src_alloc[block:].view(num_tensors, num_blocks, block)
    dst = dst_alloc[block:].view(num_tensors, num_blocks, block)
    src.copy_(torch.randint(0, 256, src.shape, generator=gen, dtype=torch.uint8, device="cuda"))
    dst.fill_(0xA5)
    torch.cuda.synchronize()
    # The source exported through torch (_share_cuda_), the destination through cuda-python (raw pointers).
    src_desc, src_locs = torch_cache(list(src))
    allocation = cuda_allocation(dst.data_ptr())
    dst_desc = src_desc
    dst_locs = raw_locations([(t.data_ptr(), t.numel(), allocation.device) for t in dst], [allocation])
    summary["offsets"] = {"src": [loc.offset for loc in src_locs[:3]], "dst": [loc.offset for loc in dst_locs[:3]]}

    work = Path(tempfile.mkdtemp(prefix="kvb-cuda-check-"))
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT / "client"), str(ROOT / "server"),
                                          os.environ.get("PYTHONPATH", "")])}
    with LocalDaemon(work, 1, backends=("nixl",), env=env) as a, LocalDaemon(work, 2, backends=("nixl",), env=env) as b:
        summary["daemon_logs"] = [str(a.log_path), str(b.log_path)]
        with a.client() as ca, b.client() as cb:
            src_cache = ca.register_kv_cache(src_desc, src_locs)
            dst_cache = cb.register_kv_cache(dst_desc, dst_locs)
            [linked] = cb.link_clusters([ClusterInfo(1, a.peer_address)], timeout=30)
            if not linked.ok:
                raise RuntimeError(f"link failed: {linked}")
            src_ix = CacheIndex(1, src_cache.cache_id)

            # 1. A scattered pull, every byte checked, blocks outside the plan untouched.
            rng = np.random.default_rng(SEED)
            n = num_blocks // 2
            src_blocks = rng.choice(num_blocks, n, replace=False).tolist()
            dst_blocks = rng.choice(num_blocks, n, replace=False).tolist()
            result = cb.pull_kv_blocks(src_ix, dst_cache, src_blocks, dst_blocks, timeout=60)
            torch.cuda.synchronize()
            untouched = sorted(set(range(num_blocks)) - set(dst_blocks))
            landed = bool(torch.equal(dst[:, dst_blocks], src[:, src_blocks]))
            kept = bool((dst[:, untouched] == 0xA5).all()) if untouched else True
            summary["scattered_pull"] = {"backend": result.backend, "bytes": result.bytes_moved, "bytes_ok": landed,
                                         "untouched_ok": kept}
            if result.backend != "nixl" or not landed or not kept:
                raise AssertionError(f"scattered pull: {summary['scattered_pull']}")

            # 2. Whole-cache pulls: throughput.
            every = list(range(num_blocks))
            times = []
            for _ in range(args.rounds):
                dst.fill_(0)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                cb.pull_kv_blocks(src_ix, dst_cache, every, every, timeout=60)
                times.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            whole_ok = bool(torch.equal(dst, src))
            summary["pull_GBps"] = _gbps(cache_bytes, min(times))
            summary["pull_GBps_median"] = _gbps(cache_bytes, sorted(times)[len(times) // 2])
            summary["whole_pull_bytes_ok"] = whole_ok
            if not whole_ok:
                raise AssertionError("whole-cache pull: bytes differ")

            # 3. A push back (one-sided WRITE into the source's imported memory).
            dst[:, :4].fill_(0x3C)
            torch.cuda.synchronize()
            pushed = cb.push_kv_blocks(dst_cache, src_ix, [0, 1, 2, 3], [num_blocks - 4 + i for i in range(4)],
                                       timeout=60)
            torch.cuda.synchronize()
            push_ok = bool((src[:, num_blocks - 4:] == 0x3C).all())
            summary["push"] = {"backend": pushed.backend, "bytes_ok": push_ok}
            if not push_ok:
                raise AssertionError("push: bytes differ")

            # 4. Close before free: the daemons close their mappings inside these calls.
            cb.unregister_kv_cache(dst_cache)
            ca.unregister_kv_cache(src_cache)
            summary["caches_left"] = len(ca.list_caches()) + len(cb.list_caches())

    summary.update(device_baselines(torch, src_alloc, dst_alloc, args.rounds))
    del src, dst, src_alloc, dst_alloc
    torch.cuda.synchronize()
    logs = "".join(Path(p).read_text(errors="replace") for p in summary["daemon_logs"])
    summary["daemon_log_problems"] = [line[:300] for line in logs.splitlines()
                                      if " ERROR " in line or "Traceback" in line or "cudaIpcCloseMemHandle" in line]
    if summary["daemon_log_problems"] or summary["caches_left"]:
        raise AssertionError("daemon logs report problems, or caches were left")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="bytes per cache, MiB")
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--block-kib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--limit-s", type=int, default=180)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    summary: dict[str, Any] = {"check": "cuda", "ok": False}
    reason = no_device_reason()
    if reason is not None:
        summary["skipped"] = f"no CUDA device: {reason}"
        print(summary["skipped"], file=sys.stderr)
        print(json.dumps(summary))
        return NO_DEVICE_EXIT

    def give_up(signum: int, frame: Any) -> None:
        raise TimeoutError(f"the check ran past --limit-s {args.limit_s}")

    signal.signal(signal.SIGALRM, give_up)
    signal.alarm(args.limit_s)
    t0 = time.monotonic()
    try:
        run(args, summary)
        summary["ok"] = True
    except BaseException as e:  # a failure is a result: report it, daemons already stopped by their context managers
        summary["error"] = f"{type(e).__name__}: {e}"
        summary["traceback"] = traceback.format_exc()[-2000:]
    finally:
        signal.alarm(0)
        summary["seconds"] = round(time.monotonic() - t0, 1)
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
