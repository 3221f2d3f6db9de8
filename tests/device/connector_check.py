"""The vLLM connector's GPU data path, without vLLM: part of tests/device/cuda_check.py (`--connector-only` runs it
alone; `--dry-run` runs it on the CPU, CPU tensors standing in for device tensors).

Two processes, as a prefill and a decode engine would be: each builds vLLM-shaped per-layer KV views on cuda:0 (one
int8 backing allocation viewed per layer as [blocks, kv_heads, block_size, 2 * head_size], physical order LBNHC:
what vLLM 0.32 gives FlashAttention/Triton), and runs the connector's WorkerSide against its own daemon:
register_gpu (read the runs, register or allocate), the prefill stages what a step wrote (host-staged), the decode
pulls by block ids (a scattered pull, every byte verified on the GPU against the prefill's seeded pattern, blocks
outside the plan untouched; then whole-cache pulls for GB/s), and the release reaches the prefill worker. Modes:
"host" (host-staged, the daemons' default backends: no NIXL) and "device" (device-direct, `--backends nixl`).
Baselines: torch device-to-device copy_ and pinned device-to-host copy_ of the same bytes; each mode's whole-cache
pull must reach its floor relative to them (tests/device/verdicts.py), and device-direct's daemons run with
UCX_PROTO_INFO=y, the transport UCX picked read back from their logs (`ucx`).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

SEED = 4099
LAYERS, HEADS, BLOCK_TOKENS, HEAD = 32, 8, 16, 128  # a Llama-3-8B-like TP rank, bf16
PAGE = HEADS * BLOCK_TOKENS * 2 * HEAD * 2  # bytes of one block of one layer (K and V)


def num_blocks_for(mib: int) -> int:
    return max(8, (mib << 20) // (PAGE * LAYERS))


def kv_views(torch: Any, device: str, num_blocks: int) -> dict[str, Any]:
    """Per-layer [B, H, N, 2*head] bf16 views of one backing allocation, physical order (L, B, N, H, C)."""
    buf = torch.zeros(LAYERS * num_blocks * PAGE, dtype=torch.int8, device=device).view(torch.bfloat16)
    c = 2 * HEAD
    strides = (BLOCK_TOKENS * HEADS * c, c, HEADS * c, 1)  # B, H, N, C
    return {f"model.layers.{i}.self_attn.attn": torch.as_strided(
        buf, (num_blocks, HEADS, BLOCK_TOKENS, c), strides, i * num_blocks * PAGE // 2) for i in range(LAYERS)}


def fill(torch: Any, views: dict[str, Any], seed: int) -> None:
    gen = torch.Generator(device=next(iter(views.values())).device).manual_seed(seed)
    for t in views.values():
        t.copy_(torch.randn(t.shape, generator=gen, device=t.device, dtype=torch.float32).to(torch.bfloat16))


def _layout(num_blocks: int) -> Any:
    from kvbroker.integrations.vllm.layout import KvLayout

    return KvLayout(num_layers=LAYERS, num_blocks=num_blocks, block_size=BLOCK_TOKENS, num_kv_heads=HEADS,
                    head_size=HEAD, dtype="bfloat16", page_bytes=PAGE, model_id="cuda-check", tp_size=1)


def _sync(torch: Any, device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def prefill_process(conn: Any, target: str, mode: str, device: str, num_blocks: int) -> None:
    """The prefill engine: KV computed (seeded), staged if host-staged, held until the decode releases it."""
    try:
        import torch

        from kvbroker import Client
        from kvbroker.integrations.vllm.config import ConnectorConfig
        from kvbroker.integrations.vllm.params import release_topic
        from kvbroker.integrations.vllm.worker import WorkerSide

        if device.startswith("cuda"):
            torch.cuda.set_device(0)
        views = kv_views(torch, device, num_blocks)
        fill(torch, views, SEED)
        _sync(torch, device)
        worker = WorkerSide(ConnectorConfig(target=target, release_timeout_s=60), "engine-p", 0, _layout(num_blocks))
        try:
            worker.register_gpu(views, mode, "LBNHC", saves=True)
            assert worker.gpu is not None and worker.endpoint is not None
            stage_s = 0.0
            if mode == "host":  # one prefill step that wrote every block, layer by layer
                t0 = time.perf_counter()
                for name in views:
                    worker.gpu.save_layer(name, range(num_blocks))
                worker.gpu.wait_for_save()
                stage_s = time.perf_counter() - t0
            # What the scheduler does when the request finishes: its daemon grants the blocks to a decode node.
            # Two grants: the scattered blocks the decode's first pull reads (in its order: the same seeded draw), and
            # every block for the whole-cache pulls.
            scattered = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(SEED))[: num_blocks // 2]
            with Client(target) as c:
                grants = {label: c.create_grant([worker.endpoint.cache_id], blocks, 120.0, label=label,
                                                event_topics=[release_topic("engine-p", 0)]).token()
                          for label, blocks in (("p-0", scattered.tolist()), ("p-1", list(range(num_blocks))))}
            worker.start([], {"p-0": 120.0, "p-1": 120.0})
            conn.send({"cluster_id": worker.endpoint.cluster_id, "peer_address": worker.endpoint.peer_address,
                       "grants": grants, "layout_tag": worker.endpoint.layout_tag, "stage_s": stage_s})
            # Serve until the decode says it is done, noting the grant's end (the decode releases it after its pulls).
            released, deadline = False, time.monotonic() + 600
            while not conn.poll(0.05) and time.monotonic() < deadline:
                released = released or "p-1" in worker.finished(0.0)[0]
            end = time.monotonic() + 30
            while not released and time.monotonic() < end:
                released = "p-1" in worker.finished(0.05)[0]
            conn.send({"released": released})
        finally:
            worker.shutdown()  # unregisters (device-direct: the daemon closes its mapping) before the memory is freed
        conn.send({"closed": True})
    except BaseException as e:
        conn.send({"error": f"{type(e).__name__}: {e}"})
        raise


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 2) if seconds > 0 else 0.0


def baselines(torch: Any, views: dict[str, Any], rounds: int) -> dict[str, float]:
    """torch copy_ of the cache's bytes device-to-device and device-to-pinned-host (CUDA only)."""
    src = next(iter(views.values())).untyped_storage()
    nbytes = src.nbytes()
    flat = torch.empty(0, dtype=torch.uint8, device=next(iter(views.values())).device).set_(src)
    dst = torch.empty_like(flat)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = {}
    for name, target in (("torch_d2d_GBps", dst), ("torch_d2h_pinned_GBps", host)):
        best = float("inf")
        for _ in range(rounds):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            target.copy_(flat, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        out[name] = _gbps(nbytes, best)
    return out


def run_mode(mode: str, device: str, work: Path, mib: int, rounds: int, env: dict[str, str],
             floor: float | None = None) -> dict[str, Any]:
    """One mode end to end; raises AssertionError naming the failed step. A pull under the mode's floor comes back
    with "ok": False and the reason (every figure kept)."""
    import torch

    from kvbroker import Client, Grant
    from kvbroker._local import LocalDaemon
    from kvbroker.integrations.vllm.config import ConnectorConfig
    from kvbroker.integrations.vllm.params import PullSpec, RemoteKv
    from kvbroker.integrations.vllm.worker import WorkerSide
    from tests.device.verdicts import floor_verdict, ucx_summary

    num_blocks = num_blocks_for(mib)
    backends = ("nixl",) if mode == "device" else None
    if mode == "device":
        env = {**env, "UCX_PROTO_INFO": "y"}
    out: dict[str, Any] = {"mode": mode, "blocks": num_blocks, "cache_bytes": LAYERS * num_blocks * PAGE}
    ctx = mp.get_context("spawn")
    started = time.monotonic()
    steps: dict[str, float] = {}
    out["step_s"] = steps  # seconds from the start to the end of each step (where the time goes)

    def step(name: str) -> None:
        steps[name] = round(time.monotonic() - started, 2)
    with LocalDaemon(work, 11 if mode == "host" else 21, backends=backends, env=env) as p_daemon, \
            LocalDaemon(work, 12 if mode == "host" else 22, backends=backends, env=env) as d_daemon:
        out["daemon_logs"] = [str(p_daemon.log_path), str(d_daemon.log_path)]
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=prefill_process, args=(child, p_daemon.target, mode, device, num_blocks))
        step("daemons")
        proc.start()
        decode = None
        try:
            if not parent.poll(240):
                raise AssertionError("the prefill process did not register within 240 s")
            info = parent.recv()
            step("prefill_registered")
            if "error" in info:
                raise AssertionError(f"prefill process: {info['error']}")
            out["stage_d2h_GBps"] = _gbps(out["cache_bytes"], info["stage_s"]) if info["stage_s"] else None
            views = kv_views(torch, device, num_blocks)
            expected = kv_views(torch, device, num_blocks)
            fill(torch, expected, SEED)  # the same seeded pattern the prefill process computed
            decode = WorkerSide(ConnectorConfig(target=d_daemon.target, pull_timeout_s=120, link_timeout_s=30,
                                                prefill_daemons=f"{info['cluster_id']}={info['peer_address']}"),
                                "engine-d", 0, _layout(num_blocks))
            grants = {label: Grant.from_token(token) for label, token in info["grants"].items()}
            decode.register_gpu(views, mode, "LBNHC", saves=False)
            step("decode_registered")
            out["runs"] = decode.cache.desc.num_tensors if decode.cache else 0
            def remote_of(blocks: list[int], rid: str) -> RemoteKv:
                return RemoteKv(cluster_id=info["cluster_id"], grant=grants[rid], block_ids=(tuple(blocks),),
                                request_id=rid,
                                engine_id="engine-p", layout_tag=info["layout_tag"],
                                num_tokens=len(blocks) * BLOCK_TOKENS, tp_size=1)

            def pull(rid: str, src: list[int], dst: list[int], remote_id: str) -> float:
                assert decode is not None
                t0 = time.perf_counter()
                decode.start([PullSpec(rid, tuple(dst), tuple(src), remote_of(src, remote_id))], {})
                deadline = time.monotonic() + 180
                while rid not in decode.finished(0.05)[1]:
                    if time.monotonic() > deadline:
                        raise AssertionError(f"pull {rid} did not finish within 180 s")
                seconds = time.perf_counter() - t0
                errors = decode.take_load_errors()
                if errors:
                    raise AssertionError(f"pull {rid}: {len(errors)} blocks failed (daemon logs: {out['daemon_logs']})")
                return seconds

            # 1. Scattered pull by block ids, every byte compared on the device, other blocks untouched.
            gen = torch.Generator().manual_seed(SEED)
            n = num_blocks // 2
            src = torch.randperm(num_blocks, generator=gen)[:n].tolist()
            dst = torch.randperm(num_blocks, generator=gen)[:n].tolist()
            pull("d-1", src, dst, "p-0")  # the grant of exactly these blocks, in this order
            step("scattered_pull")
            _sync(torch, device)
            others = sorted(set(range(num_blocks)) - set(dst))
            out["scattered_bytes_ok"] = all(bool(torch.equal(views[k][dst], expected[k][src])) for k in views)
            out["untouched_ok"] = all(not bool(views[k][others].view(torch.int16).any()) for k in views)
            transfers = decode.transfers.take_requests()
            out["backend"] = transfers["d-1"].backend if "d-1" in transfers else ""
            if not (out["scattered_bytes_ok"] and out["untouched_ok"]):
                raise AssertionError(f"{mode}: scattered pull bytes wrong: {out}")
            # 2. Whole-cache pulls (the same prefill blocks again; the hold is still on).
            every = list(range(num_blocks))
            times = [pull(f"d-w{i}", every, every, "p-1") for i in range(rounds)]
            _sync(torch, device)
            out["whole_bytes_ok"] = all(bool(torch.equal(views[k], expected[k])) for k in views)
            out["pull_GBps"] = _gbps(out["cache_bytes"], min(times))
            out["pull_GBps_median"] = _gbps(out["cache_bytes"], sorted(times)[len(times) // 2])
            step("whole_pulls")
            if not out["whole_bytes_ok"]:
                raise AssertionError(f"{mode}: whole-cache pull bytes wrong")
            # 3. The decode's scheduler releases the grant (as vLLM's does once the pull finished); the grant's end
            #    reaches the prefill worker, which frees the blocks; then it unregisters and exits.
            with Client(d_daemon.target) as c:
                for grant in grants.values():
                    c.release_grant(grant, cluster_id=info["cluster_id"])
            parent.send("done")
            reply = parent.recv() if parent.poll(60) else {}
            out["release_received"] = bool(reply.get("released"))
            if not out["release_received"]:
                raise AssertionError(f"{mode}: the prefill worker never saw the decode's release ({reply})")
            step("released")
            closed = parent.recv() if parent.poll(60) else {}
            step("prefill_closed")
            if not closed.get("closed"):
                raise AssertionError(f"{mode}: the prefill worker did not close cleanly ({closed})")
            if device.startswith("cuda"):
                out.update(baselines(torch, views, rounds))
        finally:
            if decode is not None:
                decode.shutdown()
            proc.join(60)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        step("decode_closed")
        with p_daemon.client() as cp, d_daemon.client() as cd:
            out["caches_left"] = len(cp.list_caches()) + len(cd.list_caches())
    logs = "".join(Path(p).read_text(errors="replace") for p in out["daemon_logs"])
    out["daemon_log_problems"] = [line[:300] for line in logs.splitlines() if " ERROR " in line or "Traceback" in line]
    if out["caches_left"] or out["daemon_log_problems"]:
        raise AssertionError(f"{mode}: caches left or daemon log problems")
    if mode == "device":
        out["ucx"] = ucx_summary(logs)
    if not device.startswith("cuda"):
        out["floor"] = {"skipped": "CPU tensors: no device memcpy to compare with"}
        return out
    baseline = out.get("torch_d2d_GBps") if mode == "device" else out.get("torch_d2h_pinned_GBps")
    out["floor"] = floor_verdict(mode, out["pull_GBps"], baseline, floor)
    if not out["floor"]["ok"]:
        out.update(ok=False, error=out["floor"]["why"])
    return out


def run(device: str, modes: list[str], work: Path, mib: int, rounds: int, root: Path,
        floors: dict[str, float | None] | None = None) -> dict[str, Any]:
    env = {"PYTHONPATH": os.pathsep.join([str(root / "client"), str(root / "server"), str(root),
                                          os.environ.get("PYTHONPATH", "")])}
    results: dict[str, Any] = {}
    for mode in modes:
        try:
            (work / mode).mkdir(parents=True, exist_ok=True)
            results[mode] = {"ok": True, **run_mode(mode, device, work / mode, mib, rounds, env,
                                                     (floors or {}).get(mode))}
        except BaseException as e:  # one mode's failure must not hide the other's result
            results[mode] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    return results
