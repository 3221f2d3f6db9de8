"""CUDA device check: the `nixl` backend on raw VRAM and the vLLM connector's GPU data path; one GPU, one command,
every byte verified, GB/s printed as JSON.

    python tests/device/cuda_check.py --out result.json          # about 2-4 minutes; bounded by --limit-s (480 s)
    python tests/device/cuda_check.py --dry-run                   # no GPU: the connector part on the CPU
    OUT=/tmp/out bash tests/device/run.sh                         # on the device machine: bundle installed first

0. The handle format (seconds): what this torch's `storage._share_cuda_()` returns for a cudaMalloc block (the raw
   64-byte handle, or a version byte and a type byte before it) and that kvbroker.device reads the 64-byte
   cudaIpcMemHandle_t out of it; then the same for a tensor in an expandable segment, which must be refused with the
   reason. A failure here is reported, and the parts below still run (they would fail on it, saying where).

Needs an NVIDIA GPU and torch with CUDA. The raw nixl check and the connector's device-direct mode also need
cuda-python and NIXL's wheel for the driver's CUDA (pip install --no-deps nixl==1.5.1 nixl-cu13==1.5.1); without them
those parts report "skipped" (and why) and the host-staged mode still runs. On a host without a package index,
tests/device/bundle.sh assembles the missing wheels (docs/device.md). Without a CUDA device it prints
"no CUDA device: <why>" and exits 2; any failed part exits 1 (the summary's "failed" names it).

1. Raw nixl check: this process allocates two KV caches with torch (each one allocation holding every tensor, so
   each tensor is an interior view: offsets matter), fills the source with a seeded pattern and the destination
   with another, and exports them with kvbroker.device (the source with torch_cache, the destination's raw pointers
   with cuda_allocation + raw_locations). Two daemons (`kvbrokerd --backends nixl`) each import one cache by CUDA
   IPC handle and register it with NIXL as VRAM. The destination's daemon links to the source's and pulls: a
   scattered block plan (verified byte for byte on the GPU, blocks outside the plan untouched), then the whole cache
   several times (GB/s), then pushes blocks back (verified). Beside it, the same bytes copied device-to-device by
   torch (copy_) and by cudaMemcpy. Finally both caches are unregistered (the daemons close their mappings) before
   this process frees the memory, and the daemons' logs are checked for errors.
   The whole-cache pull must reach a floor relative to the device's own memcpy measured in the same run
   (tests/device/verdicts.py says which and why), and the daemons run with UCX_PROTO_INFO=y: the UCX transport that
   moved the bytes is read from their logs and carried in the result (`ucx`).
2. The connector (tests/device/connector_check.py): a prefill process and this one build vLLM-shaped per-layer KV
   views on cuda:0 and run the connector's worker data path between two daemons, host-staged and device-direct.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
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
UCX_ENV = {"UCX_PROTO_INFO": "y"}  # UCX logs the protocol and transport it picks per operation (verdicts.py)


def no_device_reason() -> str | None:
    """Why this machine cannot run the check at all (no torch, or torch sees no CUDA device), or None."""
    try:
        torch: Any = importlib.import_module("torch")
    except ImportError as e:
        return f"torch is not installed ({e})"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device (torch.cuda.is_available() is False)"
    return None


def nixl_reason() -> str | None:
    """Why the nixl parts (the raw VRAM check, device-direct mode) cannot run here, or None."""
    from kvbrokerd.backends import unavailable
    from kvbrokerd.backends.common.cudaipc import cuda_missing

    return cuda_missing() or unavailable("nixl")


def versions() -> dict[str, str]:
    """The host's versions of what the check relies on (the bundle brings none of these: docs/device.md)."""
    from importlib import metadata

    out = {}
    for name in ("torch", "grpcio", "protobuf", "numpy", "uvloop", "cuda-bindings", "nixl", "nixl-cu13"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "missing"
    return out


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


def handle_format() -> dict[str, Any]:
    """What this torch's `_share_cuda_` writes, for a cudaMalloc block and for an expandable segment, and what
    kvbroker.device makes of each (the block: its 64-byte handle; the segment: a refusal naming the reason)."""
    import torch

    from kvbroker.device import CUDA_HANDLE_BYTES, cuda_ipc_handle, torch_locations

    def describe(handle: bytes) -> dict[str, Any]:
        legacy = len(handle) == CUDA_HANDLE_BYTES
        return {"bytes": len(handle), "version": None if legacy else handle[0],
                "type": None if legacy or len(handle) < 2 else chr(handle[1])}

    out: dict[str, Any] = {"torch": torch.__version__}
    block = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    out["cuda_malloc"] = describe(bytes(block.untyped_storage()._share_cuda_()[1]))  # type: ignore[no-untyped-call]
    [location] = torch_locations([block[4096:]])
    out["cuda_malloc"]["read"] = len(location.device.ipc_handle) == CUDA_HANDLE_BYTES  # type: ignore[union-attr]
    out["cuda_malloc"]["offset"] = location.offset
    del block, location
    settings = getattr(torch.cuda.memory, "_set_allocator_settings", lambda conf: None)
    try:
        settings("expandable_segments:True")
        segment = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        try:
            shared = bytes(segment.untyped_storage()._share_cuda_()[1])  # type: ignore[no-untyped-call]
        except RuntimeError as e:  # torch <= 2.4 cannot share expandable segments at all
            out["expandable_segment"] = {"torch_refused": str(e)[:300]}
        else:
            out["expandable_segment"] = describe(shared)
            if out["expandable_segment"]["type"] != "e":  # the setting did not take: nothing to judge
                out["expandable_segment"]["not_run"] = "expandable segments did not turn on in this torch"
            try:
                cuda_ipc_handle(shared)
                out["expandable_segment"]["refused"] = False
            except ValueError as e:
                out["expandable_segment"]["refused"] = "expandable segment" in str(e)
        del segment
    except Exception as e:  # a torch without the setting: the cudaMalloc part stands
        out["expandable_segment"] = {"not_run": f"{type(e).__name__}: {e}"[:300]}
    finally:
        settings("expandable_segments:False")
        torch.cuda.empty_cache()
    segment_ok = "not_run" in out["expandable_segment"] or out["expandable_segment"].get("refused", True) is not False
    out["ok"] = bool(out["cuda_malloc"]["read"]) and segment_ok
    return out


def run(args: argparse.Namespace, summary: dict[str, Any]) -> None:
    import numpy as np
    import torch

    from kvbroker import CacheIndex, ClusterInfo
    from kvbroker._local import LocalDaemon
    from kvbroker.device import cuda_allocation, raw_locations, torch_cache
    from tests.device.verdicts import floor_verdict, ucx_summary

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

    work = args.work / "raw"
    work.mkdir(parents=True, exist_ok=True)
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT / "client"), str(ROOT / "server"),
                                          os.environ.get("PYTHONPATH", "")]), **UCX_ENV}
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
    summary["ucx"] = ucx_summary(logs)
    memcpy = max(summary.get("torch_copy_GBps", 0.0), summary.get("cudaMemcpy_GBps", 0.0))
    summary["floor"] = floor_verdict("device", summary["pull_GBps"], memcpy, args.floor_device)
    if not summary["floor"]["ok"]:
        raise AssertionError(summary["floor"]["why"])
    summary["daemon_log_problems"] = [line[:300] for line in logs.splitlines()
                                      if " ERROR " in line or "Traceback" in line or "cudaIpcCloseMemHandle" in line]
    if summary["daemon_log_problems"] or summary["caches_left"]:
        raise AssertionError("daemon logs report problems, or caches were left")


def copy_logs(work: Path, logs_dir: Path) -> list[str]:
    """Every daemon log under `work`, copied to `logs_dir` as <part>-<mode>-<file> (the result names them)."""
    logs_dir.mkdir(parents=True, exist_ok=True)
    copied = []
    for log in sorted(work.rglob("*.log")):
        name = "-".join(log.relative_to(work).parts)
        shutil.copyfile(log, logs_dir / name)
        copied.append(name)
    return copied


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="bytes per cache of the raw nixl check, MiB")
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--block-kib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--connector-mib", type=int, default=512, help="KV bytes per engine of the connector part, MiB")
    ap.add_argument("--modes", default="host,device", help="connector modes to run (host-staged, device-direct)")
    ap.add_argument("--connector-only", action="store_true", help="skip the raw nixl check")
    ap.add_argument("--dry-run", action="store_true",
                    help="no GPU: the connector part with CPU tensors standing in for device tensors (host mode)")
    ap.add_argument("--limit-s", type=int, default=480)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--floor-device", type=float, default=None,
                    help="device-direct floor, a fraction of the device-to-device memcpy (tests/device/verdicts.py)")
    ap.add_argument("--floor-host", type=float, default=None,
                    help="host-staged floor, a fraction of the pinned device-to-host memcpy")
    ap.add_argument("--bundle-report", type=Path, help="tests/device/install_bundle.py's report, carried in the result")
    ap.add_argument("--logs-dir", type=Path, help="copy every daemon's log here at the end")
    args = ap.parse_args(argv)
    args.work = Path(tempfile.mkdtemp(prefix="kvb-cuda-check-"))
    summary: dict[str, Any] = {"check": "cuda", "ok": False, "versions": versions()}
    if args.bundle_report is not None and args.bundle_report.exists():
        summary["bundle"] = json.loads(args.bundle_report.read_text())
    modes = [m for m in args.modes.split(",") if m]
    if args.dry_run:
        summary["dry_run"] = "CPU tensors stand in for device tensors; device-direct needs CUDA IPC: not run"
    else:
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
    failed: list[str] = []
    try:
        if not args.dry_run:
            try:
                summary["handle_format"] = handle_format()
            except Exception as e:
                summary["handle_format"] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                                            "traceback": traceback.format_exc()[-2000:]}
            if not summary["handle_format"]["ok"]:
                failed.append("handle_format")
        missing_nixl = None if args.dry_run else nixl_reason()
        if missing_nixl is not None:
            skipped = summary.get("bundle", {}).get("skipped", [])
            summary["degraded"] = (f"host-staged only: NIXL cannot load here ({missing_nixl})"
                                   + (f"; bundle wheels this Python could not take: {', '.join(skipped)}"
                                      if skipped else ""))
        if args.dry_run or args.connector_only:
            pass
        elif missing_nixl is not None:
            summary["raw_nixl"] = {"skipped": missing_nixl}
        else:
            try:
                run(args, summary)
                summary["raw_nixl"] = {"ok": True}
            except Exception as e:  # a failure is a result; the connector part still runs
                summary["raw_nixl"] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                                       "traceback": traceback.format_exc()[-2000:]}
                failed.append("raw_nixl")
        from tests.device import connector_check

        device = "cpu" if args.dry_run else "cuda:0"
        runnable = [m for m in modes if m == "host" or (m == "device" and not args.dry_run and missing_nixl is None)]
        work = args.work / "connector"
        mib = min(args.connector_mib, 8) if args.dry_run else args.connector_mib
        floors = {"device": args.floor_device, "host": args.floor_host}
        results = connector_check.run(device, runnable, work, mib, args.rounds, ROOT, floors)
        for m in modes:
            if m not in runnable:
                results[m] = {"skipped": summary["dry_run"] if args.dry_run else f"no nixl: {missing_nixl}"}
        summary["connector"] = results
        failed += [f"connector.{m}" for m, r in results.items() if r.get("ok") is False]
        summary["ok"] = not failed
    except BaseException as e:  # a failure is a result: report it, daemons already stopped by their context managers
        summary["error"] = f"{type(e).__name__}: {e}"
        summary["traceback"] = traceback.format_exc()[-2000:]
    finally:
        signal.alarm(0)
        summary["seconds"] = round(time.monotonic() - t0, 1)
        summary["failed"] = failed
        if args.logs_dir is not None:
            summary["logs"] = copy_logs(args.work, args.logs_dir)
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
