"""Ascend hardware check for the `hccl` backend: two NPUs, one command, every byte verified, GB/s printed.

    python tests/device/ascend_check.py                       # NPUs 0 and 1, RoCE through the device NICs
    python tests/device/ascend_check.py --devices 0,2 --protocol hccs:device --mib 512 --out result.json

Needs CANN >= 9.0 with HIXL's Python binding (`import hixl`), pyACL (`import acl`), two visible NPUs and configured
device NICs (docs/ascend.md). Without them it prints SKIP and the reason, and exits 0. It has never run on Ascend
hardware: the project's CI has none (the adapter's contract suite runs against tests/contract/hixl_contract_standin).

Part 1 (adapter, NPU memory): two processes, one per NPU, each with a real `HcclBackend`. The source allocates NPU
memory and fills it with a seeded pattern; the destination registers its own NPU memory, links, and READs it with
a scattered block plan and with one contiguous run; then a second source buffer registered AFTER the link (the
registration-epoch re-link path); then a WRITE back into the source, which the source verifies; then a READ
abandoned at a 0.2 ms deadline, checking that no byte lands after the error (the request is ended by a
disconnect), and a READ that must work again after it. It also records the status HIXL gives a descriptor on
unregistered memory with the pool off (undocumented).

Part 2 (daemons): two `kvbrokerd --backends hccl,tcp` processes (one per NPU), linked with a token; the destination
pulls a host cache from the source; the result must name backend `hccl` and every byte must match. Host caches live
in /dev/shm: HIXL documents MEM_HOST as aclrtMallocHost memory on A2/A3, so a refusal here is a finding to report,
not a crash.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import multiprocessing
import multiprocessing.connection
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, cast

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "client"), str(ROOT / "server"), str(ROOT)]

BLOCK_BYTES = 64 << 10
SEED = 20260
ACL_MEM_MALLOC_HUGE_ONLY = 1  # 2 MB pages: what HIXL documents for HCCS
ACL_MEMCPY_HOST_TO_DEVICE = 1
ACL_MEMCPY_DEVICE_TO_HOST = 2


def skip_reason(devices: list[int]) -> str | None:
    for module in ("hixl", "acl"):
        try:
            importlib.import_module(module)
        except ImportError as e:
            return f"`import {module}` failed ({e}): install CANN >= 9.0 with HIXL and source set_env.sh"
    acl: Any = importlib.import_module("acl")
    count, ret = acl.rt.get_device_count()
    if ret != 0 or count < 2:
        return f"needs two NPUs, found {count if ret == 0 else 0} (acl.rt.get_device_count ret {ret})"
    if len(set(devices)) != 2 or max(devices) >= count:
        return f"--devices {devices} must name two different NPUs of the {count} visible"
    return None


# -- NPU memory: torch_npu when present, pyACL otherwise ---------------------------------------------------------------
class NpuBuffer:
    def __init__(self, device: int, nbytes: int) -> None:
        self.nbytes = nbytes
        self._tensor: Any = None
        self._acl: Any = None
        try:
            torch: Any = importlib.import_module("torch")
            importlib.import_module("torch_npu")
            self._tensor = torch.zeros(nbytes, dtype=torch.uint8, device=f"npu:{device}")
            self.address = int(self._tensor.data_ptr())
        except ImportError:
            self._acl = importlib.import_module("acl")
            self.address, ret = self._acl.rt.malloc(nbytes, ACL_MEM_MALLOC_HUGE_ONLY)
            if ret != 0:
                raise RuntimeError(f"acl.rt.malloc({nbytes}) failed: {ret}") from None

    def write(self, data: np.ndarray) -> None:
        if self._tensor is not None:
            torch: Any = importlib.import_module("torch")
            self._tensor.copy_(torch.from_numpy(data).to(self._tensor.device))
            return
        ret = self._acl.rt.memcpy(self.address, self.nbytes, int(data.ctypes.data), self.nbytes,
                                  ACL_MEMCPY_HOST_TO_DEVICE)
        if ret != 0:
            raise RuntimeError(f"acl.rt.memcpy H2D failed: {ret}")

    def read(self) -> np.ndarray:
        if self._tensor is not None:
            return cast(np.ndarray, self._tensor.cpu().numpy())
        out = np.empty(self.nbytes, np.uint8)
        ret = self._acl.rt.memcpy(int(out.ctypes.data), self.nbytes, self.address, self.nbytes,
                                  ACL_MEMCPY_DEVICE_TO_HOST)
        if ret != 0:
            raise RuntimeError(f"acl.rt.memcpy D2H failed: {ret}")
        return out

    def free(self) -> None:
        if self._acl is not None:
            self._acl.rt.free(self.address)
        self._tensor = None


def pattern(seed: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


# -- part 1: two adapter processes ------------------------------------------------------------------------------------
def _backend(device: int, engine: str, protocol: str, entries: list[Any]) -> Any:
    from kvbrokerd.backends.hccl.backend import HcclBackend, HcclSettings
    from kvbrokerd.dataplane.seam import LocalContext

    class Entries:  # the adapter prunes registrations of caches its registry no longer lists
        max_caches = 4096

        def list(self) -> list[Any]:
            return entries

    options = {"GlobalResourceConfig": json.dumps({"comm_resource_config.protocol_desc": [protocol]})}
    ctx = LocalContext(cluster_id=device + 1, registry=cast(Any, Entries()), shm_dir=Path(tempfile.gettempdir()),
                       peer_host="127.0.0.1", parts_executor=cast(Any, None), secret_for=lambda _: None)
    backend = HcclBackend(ctx, HcclSettings(device=device, engine=engine, options=options))
    asyncio.run(backend.start())
    return backend


def _entry(cache_id: int, buf: NpuBuffer) -> Any:
    from kvbroker.types import CacheDesc, DataType, Placement, TensorLocation
    from kvbrokerd.registry.caches import CacheEntry

    desc = CacheDesc(num_tensors=1, shape=(buf.nbytes // BLOCK_BYTES, BLOCK_BYTES), data_type=DataType.UINT8,
                     placement=Placement.DEVICE)
    return CacheEntry(cache_id, desc, (TensorLocation("npu", 0),), False, {}, [], addresses=[buf.address])


def source_process(conn: multiprocessing.connection.Connection, device: int, engine: str, protocol: str,
                   nbytes: int) -> None:
    entries: list[Any] = []
    backend = None
    try:
        backend = _backend(device, engine, protocol, entries)
        first = NpuBuffer(device, nbytes)
        first.write(pattern(SEED, nbytes))
        entries.append(_entry(1, first))
        conn.send(("ready", backend.advertise(), asyncio.run(backend.describe_cache(entries[0]))))
        assert conn.recv() == "second"
        second = NpuBuffer(device, nbytes)  # registered only now, after the destination linked
        second.write(pattern(SEED + 1, nbytes))
        entries.append(_entry(2, second))
        conn.send(("second", asyncio.run(backend.describe_cache(entries[1]))))
        what, blocks, seed = conn.recv()
        assert what == "verify-push"
        got = first.read().reshape(-1, BLOCK_BYTES)
        expected = pattern(seed, len(blocks) * BLOCK_BYTES).reshape(-1, BLOCK_BYTES)
        conn.send(("push-verified", bool(np.array_equal(got[blocks], expected))))
        assert conn.recv() == "done"
        backend.close()
        conn.send(("closed", True))
    except Exception:
        conn.send(("error", traceback.format_exc()))
    finally:
        if backend is not None:
            backend.close()


def destination_process(conn: multiprocessing.connection.Connection, device: int, engine: str, protocol: str,
                        nbytes: int) -> None:
    from kvbrokerd.backends.hccl.backend import HcclChannel
    from kvbrokerd.dataplane.pairs import block_array
    from kvbrokerd.dataplane.plan import Progress
    from kvbrokerd.dataplane.seam import PeerInfo, RemoteCache
    from kvbrokerd.transfers.planner import LayerSelection, plan_blocks

    results: dict[str, Any] = {}
    entries: list[Any] = []
    backend = None

    def pull(channel: HcclChannel, remote: Any, dst: Any, src_blocks: np.ndarray, dst_blocks: np.ndarray) -> float:
        plan = plan_blocks(remote.desc, dst.desc, block_array(src_blocks, "src"), block_array(dst_blocks, "dst"),
                           LayerSelection())
        started = time.perf_counter()
        channel.pull(remote, dst, plan, Progress(plan), time.monotonic() + 120)
        return plan.total_bytes / (time.perf_counter() - started) / 1e9

    try:
        what, advert, description = conn.recv()
        assert what == "ready"
        backend = _backend(device, engine, protocol, entries)
        dst_buf = NpuBuffer(device, nbytes)
        dst = _entry(10, dst_buf)
        entries.append(dst)
        backend.registration(dst)  # before the link, as HIXL wants
        channel = asyncio.run(backend.connect(PeerInfo(1, "127.0.0.1:0", b""), advert))
        assert isinstance(channel, HcclChannel)
        blocks = nbytes // BLOCK_BYTES

        def remote_of(cache_id: int, info: bytes) -> Any:
            return RemoteCache(cache_id, dst.desc, (), backend_info={"hccl": info})

        first = remote_of(1, description)
        order = np.random.default_rng(SEED).permutation(blocks)
        results["read_scattered_gbps"] = pull(channel, first, dst, order, np.arange(blocks))
        expected = pattern(SEED, nbytes).reshape(blocks, BLOCK_BYTES)
        results["read_scattered_ok"] = bool(np.array_equal(dst_buf.read().reshape(blocks, BLOCK_BYTES),
                                                           expected[order]))
        dst_buf.write(np.zeros(nbytes, np.uint8))
        every = np.arange(blocks)
        results["read_contiguous_gbps"] = max(pull(channel, first, dst, every, every) for _ in range(3))
        results["read_contiguous_ok"] = bool(np.array_equal(dst_buf.read(), expected.reshape(-1)))

        conn.send("second")
        what, description2 = conn.recv()
        second = remote_of(2, description2)
        results["read_after_relink_gbps"] = pull(channel, second, dst, every, every)
        results["read_after_relink_ok"] = bool(np.array_equal(dst_buf.read(), pattern(SEED + 1, nbytes)))
        results["relinks"] = channel.connects

        # WRITE: our buffer's first blocks, filled with a new pattern, into the source's first buffer.
        n = min(blocks, 64)
        dst_buf.write(np.concatenate([pattern(SEED + 2, n * BLOCK_BYTES), np.zeros(nbytes - n * BLOCK_BYTES,
                                                                                    np.uint8)]))
        targets = np.arange(blocks - n, blocks)
        plan = plan_blocks(dst.desc, first.desc, block_array(np.arange(n), "src"), block_array(targets, "dst"),
                           LayerSelection())
        channel.push(dst, first, plan, Progress(plan), time.monotonic() + 60)
        conn.send(("verify-push", targets, SEED + 2))
        what, ok = conn.recv()
        results["write_ok"] = ok

        # A request abandoned at its deadline: kvbroker disconnects (HIXL's documented way to end it) and reports
        # the blocks failed. Nothing may land after that, or a caller reusing those blocks would be corrupted.
        dst_buf.write(np.zeros(nbytes, np.uint8))
        plan = plan_blocks(first.desc, dst.desc, block_array(every, "src"), block_array(every, "dst"),
                           LayerSelection())
        try:
            channel.pull(first, dst, plan, Progress(plan), time.monotonic() + 0.0002)
            results["abandon"] = "completed before the deadline (try a larger --mib)"
        except Exception as e:
            results["abandon"] = f"{type(e).__name__}: {e}"
            at_error = dst_buf.read()
            time.sleep(1.0)  # the scenario, not a wait: the window a late write would land in (HIXL shows none)
            results["no_late_writes_ok"] = bool(np.array_equal(dst_buf.read(), at_error))
        pull(channel, first, dst, every, every)
        now = expected.copy()
        now[targets] = pattern(SEED + 2, n * BLOCK_BYTES).reshape(n, BLOCK_BYTES)  # the WRITE above
        results["read_after_abandon_ok"] = bool(np.array_equal(dst_buf.read(), now.reshape(-1)))

        hixl: Any = importlib.import_module("hixl")
        unregistered = NpuBuffer(device, 2 << 20)
        desc = hixl.TransferOpDesc(unregistered.address, int(json.loads(description)["addresses"][0]), BLOCK_BYTES)
        ret = backend.call(lambda e: e.transfer_sync(channel.remote_engine, hixl.TransferOp.READ, [desc], 5000))
        results["unregistered_local_status"] = int(ret)
        unregistered.free()
        conn.send("done")
        channel.close()
        backend.close()
        results["teardown_ok"] = True
        conn.send(("results", results))
    except Exception:
        conn.send(("error", traceback.format_exc()))
    finally:
        if backend is not None:
            backend.close()


def run_adapter_check(devices: list[int], protocol: str, nbytes: int, port: int) -> dict[str, Any]:
    spawn = multiprocessing.get_context("spawn")  # ACL and torch_npu do not survive fork
    src_end, src_child = spawn.Pipe()
    dst_end, dst_child = spawn.Pipe()
    src_engine, dst_engine = f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"
    procs = [spawn.Process(target=source_process, args=(src_child, devices[0], src_engine, protocol, nbytes)),
             spawn.Process(target=destination_process, args=(dst_child, devices[1], dst_engine, protocol, nbytes))]
    for p in procs:
        p.start()
    try:
        return _relay(src_end, dst_end)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def _relay(src: multiprocessing.connection.Connection, dst: multiprocessing.connection.Connection
           ) -> dict[str, Any]:
    """Passes messages between the two processes until the destination reports (a 5-minute bound in all)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        for here, there in ((src, dst), (dst, src)):
            if here.poll(0.05):
                msg = here.recv()
                if isinstance(msg, tuple) and msg[0] == "error":
                    return {"error": msg[1]}
                if isinstance(msg, tuple) and msg[0] == "results":
                    return cast(dict[str, Any], msg[1])
                if isinstance(msg, tuple) and msg[0] == "closed":
                    continue
                there.send(msg)
    return {"error": "timed out after 300 s"}


# -- part 2: two daemons -----------------------------------------------------------------------------------------------
def run_daemon_check(devices: list[int], protocol: str, nbytes: int, port: int) -> dict[str, Any]:
    from kvbroker import CacheDesc, CacheIndex, ClusterInfo, DataType
    from kvbroker._local import LocalDaemon

    options = json.dumps({"GlobalResourceConfig": json.dumps({"comm_resource_config.protocol_desc": [protocol]})})
    blocks = nbytes // BLOCK_BYTES
    desc = CacheDesc(num_tensors=2, shape=(blocks // 2, BLOCK_BYTES), data_type=DataType.UINT8)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.pathsep.join([str(ROOT / "server"), str(ROOT / "client"), os.environ.get("PYTHONPATH", "")])
        env = [{"KVBROKER_HCCL_DEVICE": str(d), "KVBROKER_HCCL_ENGINE": f"127.0.0.1:{port + 10 + i}",
                "KVBROKER_HCCL_OPTIONS": options, "PYTHONPATH": path} for i, d in enumerate(devices)]
        with LocalDaemon(Path(tmp), 1, backends=("hccl", "tcp"), env=env[0]) as src, \
                LocalDaemon(Path(tmp), 2, backends=("hccl", "tcp"), env=env[1]) as dst, \
                src.client() as s, dst.client() as d:
            [linked] = d.link_clusters([ClusterInfo(remote_cluster_id=1, remote_address=src.peer_address)])
            out["link"] = linked.ok and d.list_links()[0].backend
            a, b = s.allocate_cache(desc), d.allocate_cache(desc)
            for i, t in enumerate(a.tensors):
                t.reshape(-1)[:] = pattern(SEED + 10 + i, t.nbytes)
            every = list(range(desc.num_blocks))
            try:
                started = time.perf_counter()
                result = d.pull_kv_blocks(CacheIndex(1, a.cache_id), b, every, every)
                out["pull_gbps"] = result.bytes_moved / (time.perf_counter() - started) / 1e9
                out["backend"] = result.backend
                out["pull_ok"] = result.backend == "hccl" and all(
                    np.array_equal(x, y) for x, y in zip(a.tensors, b.tensors, strict=True))
            except Exception as e:  # a refusal (e.g. MEM_HOST of /dev/shm memory) is the finding
                out["pull_ok"] = False
                out["error"] = f"{type(e).__name__}: {e}"
            out["logs"] = {"src": src.log_tail(10), "dst": dst.log_tail(10)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Ascend hardware check for the hccl backend (two NPUs).")
    parser.add_argument("--devices", default="0,1", help="two NPU ids: source,destination [0,1]")
    parser.add_argument("--protocol", default="roce:device", help="HIXL protocol_desc: roce:device or hccs:device")
    parser.add_argument("--mib", type=int, default=256, help="bytes per buffer, in MiB [256]")
    parser.add_argument("--port", type=int, default=26100, help="first of the engine ports the check uses [26100]")
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    devices = [int(d) for d in args.devices.split(",")]
    reason = skip_reason(devices)
    if reason:
        print(f"SKIP: {reason}")
        return 0
    nbytes = args.mib << 20
    report: dict[str, Any] = {"devices": devices, "protocol": args.protocol, "bytes": nbytes,
                              "cann": os.environ.get("ASCEND_TOOLKIT_HOME", "")}
    print(f"part 1: adapter over HIXL, NPU {devices[0]} -> NPU {devices[1]}, {args.mib} MiB, {args.protocol}")
    report["adapter"] = run_adapter_check(devices, args.protocol, nbytes, args.port)
    print(f"part 2: two kvbrokerd --backends hccl,tcp on NPUs {devices}")
    try:
        report["daemons"] = run_daemon_check(devices, args.protocol, nbytes, args.port)
    except Exception as e:  # e.g. a daemon that would not start: its log tail is in the message
        report["daemons"] = {"pull_ok": False, "error": f"{type(e).__name__}: {e}"}
    adapter, daemons = report["adapter"], report.get("daemons", {})
    checks = {k: v for k, v in adapter.items() if k.endswith("_ok")}
    checks["daemon_pull_ok"] = daemons.get("pull_ok", False)
    for key, value in {**adapter, **{f"daemon_{k}": v for k, v in daemons.items() if k != "logs"}}.items():
        shown = f"{value:.2f} GB/s" if key.endswith("gbps") else value
        print(f"  {key:32} {shown}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    passed = "error" not in adapter and all(checks.values())
    print("PASS" if passed else "FAIL (send the output and `ascend-dmi`/plog excerpts with the report)")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
