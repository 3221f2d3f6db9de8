"""The fleet test: prefill and decode nodes (one network namespace and one kvbrokerd each, see fleetnet.py) under a
steady stream of pulls while nodes are SIGKILLed and restarted, as pods churn.

  prefill node  allocates one cache, fills it with random bytes (kept here as the truth) and publishes
                (cluster id, peer address, cache id) in the fleet's directory, as a prefill engine hands out its
                kv_transfer_params
  decode node   --concurrency workers, each pulling --blocks random blocks of a random directory entry into its own
                blocks of the node's cache, linking on first use like the vLLM connector (_ensure_link: link, and
                on a stale link unlink --force + link; a LINK_FAILED/TIMEOUT pull forgets the link); never unlinks
                a peer that vanished (a fleet client cannot know which died)
  churn         every --churn-every s one node (roles alternating by --kill-roles) is SIGKILLed, stays down
                --down-time s, and comes back: with its cluster id and address (a restart: new instance epoch) or,
                by --restart-mode, as a new pod (new cluster id, new namespace, new address). A node keeps its
                host's shm directory, as a pod keeps its host's /dev/shm.

Backend: tcp, the cross-host path the fleet models (the namespaces share /dev/shm, so shm would also link, but
shm cannot cross hosts). Every daemon runs this tree's code (PYTHONPATH = this repo's client/ and server/).

What it checks (the report's "checks"; the run exits 1 with --strict if one fails):
  accounted      every pull landed with its bytes verified, or failed with an LlmError saying exactly what did
                 not land: blocks missing from `failed_dst_blocks` hold the source's bytes, and an error without
                 a report (a refusal) wrote no byte (the destination blocks still hold the sentinel written before
                 the pull). Pulls whose decode daemon was killed under them are counted apart (their cache is gone).
  deadlines      no pull call returned later than its deadline + --deadline-grace, and none ended with a bare
                 DEADLINE_EXCEEDED (the daemon answers with its report before the deadline)
  segments       after each restart the host's shm directory holds files of the live daemon only (the killed
                 one's are cleaned up at start), and after the final SIGTERM it is empty
  fds            each daemon alive at the end holds at most --fd-slack more fds than once it had run --warmup s
  links          at the end (after --settle s without churn) each decode daemon holds at most as many links as
                 there are live prefill nodes, + --link-slack; and no link was refused for room
                 (LLM_OUT_OF_MEMORY). Issue 20 item 1 (links that reclaim themselves) is what makes this hold.

  sudo .venv/bin/python bench/fleet.py --nodes 6 --duration 180 --churn-every 10 --save /tmp/fleet.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "client"), str(ROOT / "server")]

import numpy as np  # noqa: E402
from fleetnet import Net, Node, available  # noqa: E402

from kvbroker import AsyncClient, CacheDesc, CacheIndex, ClusterInfo, DataType, LinkState, LlmError, LlmStatus  # noqa: E402
from kvbroker._local import LocalDaemon  # noqa: E402

SENTINEL = 0xA5
PEER_PORT = 7100
PREFILL_BASE_ID, DECODE_BASE_ID = 1000, 5000
"""Cluster ids: prefill nodes count up from 1000, decode nodes from 5000 (a new pod takes the next one)."""
LINK_TIMEOUT_S = 2.0


def log(msg: str) -> None:
    print(f"[fleet {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q)) if values else 0.0


@dataclass
class Entry:
    """A prefill node's published cache: what a decode node is told to pull from."""

    cluster_id: int
    address: str
    cache_id: int
    truth: list[np.ndarray]


@dataclass
class Host:
    index: int
    role: str
    shm_dir: Path
    node: Node | None = None
    cluster_id: int = 0
    daemon: LocalDaemon | None = None
    client: AsyncClient | None = None
    cache: Any = None
    generation: int = 0
    up: asyncio.Event = field(default_factory=asyncio.Event)
    linked: dict[int, str] = field(default_factory=dict)
    link_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    killed: int = 0
    ready_at: float = 0.0
    fd_baseline: int | None = None
    """fds of this incarnation once it has run --warmup s (links made, pools filled); None before."""

    @property
    def address(self) -> str:
        assert self.node is not None
        return f"{self.node.ip}:{PEER_PORT}"


class Fleet:
    def __init__(self, args: argparse.Namespace) -> None:
        self.a = args
        self.rng = random.Random(args.seed)
        self.net = Net(args.delay, args.rate, require_netem=args.require_netem)
        self.workdir = Path(tempfile.mkdtemp(prefix="kvfleet-"))
        self.shm_root = Path("/dev/shm") / f"kvfleet-{self.net.tag}"
        n_decode = args.decode if args.decode is not None else args.nodes // 2
        roles = ["prefill"] * (args.nodes - n_decode) + ["decode"] * n_decode
        self.hosts = [Host(i, role, self.shm_root / f"host{i}") for i, role in enumerate(roles)]
        self.next_id = {"prefill": PREFILL_BASE_ID, "decode": DECODE_BASE_ID}
        self.directory: dict[int, Entry] = {}
        self.stopping = False
        self.t0 = 0.0
        self.pulls: list[dict[str, Any]] = []
        self.violations: list[tuple[str, str]] = []
        """(check, what happened): "accounted" or "deadlines"."""
        self.link_refusals: Counter[str] = Counter()
        self.samples: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.orphans: list[str] = []
        self.exit_codes: list[int | None] = []

    def now(self) -> float:
        return time.monotonic() - self.t0

    # -- nodes ---------------------------------------------------------------------------------------------------
    async def start_host(self, host: Host, *, new_identity: bool) -> None:
        if new_identity or host.node is None:
            if host.node is not None:
                self.net.remove_node(host.node)
            host.node = await asyncio.to_thread(self.net.add_node)
            host.cluster_id = self.next_id[host.role]
            self.next_id[host.role] += 1
        host.shm_dir.mkdir(parents=True, exist_ok=True)
        extra = ["--peer-listen", host.address, "--shm-dir", str(host.shm_dir), *self.a.daemon_arg]
        if self.a.max_links:
            extra += ["--max-links", str(self.a.max_links)]
        if self.a.peer_link_ttl:
            extra += ["--peer-link-ttl", str(self.a.peer_link_ttl)]
        pythonpath = os.pathsep.join([str(ROOT / "client"), str(ROOT / "server"), os.environ.get("PYTHONPATH", "")])
        daemon = LocalDaemon(self.workdir, host.cluster_id, backends=("tcp",), wrapper=Net.wrapper(host.node),
                             extra_args=extra, env={"PYTHONPATH": pythonpath.rstrip(os.pathsep)})
        host.daemon = await asyncio.to_thread(daemon.start)
        host.client = AsyncClient(daemon.target, timeout=10.0)
        if host.role == "prefill":
            desc = CacheDesc(self.a.tensors, (self.a.cache_blocks, self.a.block_bytes), DataType.UINT8)
            host.cache = await host.client.allocate_cache(desc)
            rng = np.random.default_rng(self.rng.randrange(1 << 32))
            for t in host.cache.tensors:
                t[:] = rng.integers(0, 256, size=t.shape, dtype=np.uint8)
            truth = [t.copy() for t in host.cache.tensors]
            self.directory[host.index] = Entry(host.cluster_id, host.address, host.cache.cache_id, truth)
        else:
            desc = CacheDesc(self.a.tensors, (self.a.concurrency * self.a.blocks, self.a.block_bytes), DataType.UINT8)
            host.cache = await host.client.allocate_cache(desc)
            host.linked.clear()
        host.ready_at, host.fd_baseline = self.now(), None
        host.up.set()

    async def kill_host(self, host: Host) -> None:
        assert host.daemon is not None and host.daemon.proc is not None
        host.up.clear()
        host.generation += 1  # before any await: no worker touches this incarnation's cache from here on
        host.killed += 1
        host.daemon.proc.send_signal(signal.SIGKILL)
        await asyncio.to_thread(host.daemon.proc.wait)
        if host.client is not None:
            await host.client.close()  # unmaps our views of its segments (the files stay until a restart)
        host.client, host.cache = None, None

    def segments_of_dead_instances(self, host: Host) -> list[str]:
        """Files in the host's shm dir whose daemon instance is dead: its instance lock can be taken (the kernel
        drops a dead holder's flock). Probed only while the host's daemon is up and past its start-up clean-up."""
        dead = []
        for lock in host.shm_dir.glob("kvbroker-*.lock"):
            try:
                fd = os.open(lock, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                dead.append(lock.name.removesuffix(".lock"))
            except BlockingIOError:
                pass
            finally:
                os.close(fd)  # drops our lock at once
        return [p.name for p in host.shm_dir.iterdir() if any(p.name.startswith(d) for d in dead)]

    # -- decode workers ------------------------------------------------------------------------------------------
    async def ensure_link(self, host: Host, entry: Entry) -> None:
        """The vLLM connector's _ensure_link (worker.py), on the async client."""
        client = host.client
        assert client is not None
        async with host.link_lock:
            if host.linked.get(entry.cluster_id) == entry.address:
                return
            info = ClusterInfo(entry.cluster_id, entry.address)
            result = (await client.link_clusters([info], timeout=LINK_TIMEOUT_S))[0]
            if result.status == LlmStatus.LLM_ALREADY_LINK and not any(
                    link.remote_cluster_id == entry.cluster_id and link.state == LinkState.READY
                    and link.remote_address == entry.address for link in await client.list_links()):
                await client.unlink_clusters([info], force=True, timeout=LINK_TIMEOUT_S)
                result = (await client.link_clusters([info], timeout=LINK_TIMEOUT_S))[0]
            if not result.ok and result.status != LlmStatus.LLM_ALREADY_LINK:
                if result.status == LlmStatus.LLM_OUT_OF_MEMORY:
                    self.link_refusals[result.message[:80]] += 1
                raise LlmError(result.status, f"link to {entry.cluster_id}: {result.message}")
            host.linked[entry.cluster_id] = entry.address

    async def worker(self, host: Host, w: int) -> None:
        rng = random.Random(self.rng.randrange(1 << 32))
        mine = list(range(w * self.a.blocks, (w + 1) * self.a.blocks))
        while not self.stopping:
            if not host.up.is_set() or not self.directory:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(host.up.wait(), 0.5)
                continue
            gen = host.generation
            try:
                await self.pull_once(host, rng, mine)
            except asyncio.CancelledError:
                if self.stopping or host.generation == gen:
                    raise
                # grpc.aio cancels the calls of a channel we closed: the decode node was killed under this pull.
                self.pulls.append({"t": self.now(), "decode": host.cluster_id, "outcome": "decode_killed",
                                   "status": "CANCELLED", "ms": 0.0})
            except Exception as e:  # anything but an LlmError is a pull that did not say what happened
                self.pulls.append({"t": self.now(), "decode": host.cluster_id, "outcome": "error",
                                   "status": type(e).__name__, "ms": 0.0})
                self.violations.append(("accounted", f"a pull raised {e!r}, not an LlmError"))

    async def pull_once(self, host: Host, rng: random.Random, mine: list[int]) -> None:
        entry = self.directory[rng.choice(sorted(self.directory))]
        src = rng.sample(range(self.a.cache_blocks), self.a.blocks)
        dst = rng.sample(mine, len(mine))
        gen, client, cache = host.generation, host.client, host.cache
        assert client is not None and cache is not None
        for t in cache.tensors:
            t[dst] = SENTINEL
        rec: dict[str, Any] = {"t": self.now(), "decode": host.cluster_id, "prefill": entry.cluster_id}
        try:
            await self.ensure_link(host, entry)
        except LlmError as e:
            rec.update(outcome="link_failed", status=e.status.name, ms=0.0)
            if host.generation != gen:
                rec["outcome"] = "decode_killed"
            self.pulls.append(rec)
            await asyncio.sleep(0.05)  # a peer that cannot be linked is not retried in a tight loop
            return
        t0 = time.monotonic()
        err: LlmError | None = None
        try:
            await client.pull_kv_blocks(CacheIndex(entry.cluster_id, entry.cache_id), cache, src, dst,
                                        timeout=self.a.pull_timeout)
        except LlmError as e:
            err = e
        elapsed = time.monotonic() - t0
        rec["ms"] = elapsed * 1e3
        if elapsed > self.a.pull_timeout + self.a.deadline_grace:
            self.violations.append(("deadlines", f"a pull returned {elapsed:.2f} s after it started (deadline "
                                                 f"{self.a.pull_timeout} s): {err!r}"))
        if host.generation != gen:
            rec.update(outcome="decode_killed", status=err.status.name if err else "LLM_SUCCESS")
            self.pulls.append(rec)
            return
        if err is None:
            rec.update(outcome="ok", status="LLM_SUCCESS")
            bad = self.check_blocks(cache, entry, src, dst, set())
            if bad:
                self.violations.append(("accounted", f"a successful pull from {entry.cluster_id} left {len(bad)} "
                                                     "blocks wrong"))
        else:
            rec.update(outcome="failed", status=err.status.name)
            if err.status in (LlmStatus.LLM_LINK_FAILED, LlmStatus.LLM_TIMEOUT, LlmStatus.LLM_NOT_YET_LINK):
                host.linked.pop(entry.cluster_id, None)  # as the connector does: link again on the next use
            answered = set(err.details) - {"grpc_code"}
            failed = err.failed_dst_blocks
            if not answered:
                rec["bare"] = err.details.get("grpc_code", "")
                if err.status == LlmStatus.LLM_TIMEOUT:
                    self.violations.append(("deadlines", f"a pull ended with a bare DEADLINE_EXCEEDED: {err}"))
            if failed is None:
                rec["report"] = False
                bad = self.check_untouched(cache, dst)
                if bad:
                    self.violations.append(("accounted", f"a pull failed without a report ({err.status.name}) but "
                                                         f"wrote {len(bad)} of its destination blocks"))
            else:
                rec.update(report=True, failed_blocks=len(failed))
                bad = self.check_blocks(cache, entry, src, dst, set(failed))
                if bad:
                    self.violations.append(("accounted", f"a failed pull ({err.status.name}) left {len(bad)} "
                                                         "blocks its report does not list without the source's bytes"))
        self.pulls.append(rec)

    def check_blocks(self, cache: Any, entry: Entry, src: list[int], dst: list[int], failed: set[int]) -> list[int]:
        bad = []
        for s, d in zip(src, dst, strict=True):
            if d in failed:
                continue
            if any(not np.array_equal(t[d], truth[s]) for t, truth in zip(cache.tensors, entry.truth, strict=True)):
                bad.append(d)
        return bad

    def check_untouched(self, cache: Any, dst: list[int]) -> list[int]:
        return [d for d in dst if any(bool((t[d] != SENTINEL).any()) for t in cache.tensors)]

    # -- churn and sampling --------------------------------------------------------------------------------------
    async def churn(self) -> None:
        if self.a.churn_every <= 0:
            return
        roles = self.a.kill_roles.split(",")
        turn: Counter[str] = Counter()
        kills = 0
        while True:
            at = self.a.warmup + (kills + 1) * self.a.churn_every
            if at > self.a.duration - self.a.settle or (self.a.kills is not None and kills >= self.a.kills):
                return
            await asyncio.sleep(max(0.0, at - self.now()))
            role = roles[kills % len(roles)]
            candidates = [h for h in self.hosts if h.role == role and h.up.is_set()]
            if role == "prefill" and len([h for h in self.hosts if h.role == "prefill"]) < 2:
                candidates = []  # the only prefill node: killing it would leave nothing to pull
            if not candidates:
                kills += 1
                continue
            victim = candidates[turn[role] % len(candidates)]
            turn[role] += 1
            mode = self.a.restart_mode
            new = mode == "new" or (mode == "alternate" and turn[role] % 2 == 1)  # per role: new, same, ...
            await self.kill_and_restart(victim, new)
            kills += 1

    async def kill_and_restart(self, host: Host, new_identity: bool) -> None:
        old_id, old_addr = host.cluster_id, host.address
        t_kill = self.now()
        log(f"t={t_kill:.1f}s SIGKILL {host.role} {old_id} at {old_addr}")
        stale = min(self.a.dead_entries_for, self.a.down_time)
        if stale <= 0:
            self.directory.pop(host.index, None)  # its requests die with it: only pulls in flight meet the death
        await self.kill_host(host)
        await asyncio.sleep(stale)
        self.directory.pop(host.index, None)  # no more requests name it (a router noticed the death)
        await asyncio.sleep(self.a.down_time - stale)
        await self.start_host(host, new_identity=new_identity)
        orphans = self.segments_of_dead_instances(host)
        self.orphans += [f"host{host.index} after restart: {name}" for name in orphans]
        self.events.append({"t_kill": t_kill, "t_ready": self.now(), "role": host.role, "old_cluster": old_id,
                            "old_address": old_addr, "new_cluster": host.cluster_id, "new_address": host.address,
                            "new_identity": new_identity, "orphaned_segments": orphans})
        log(f"t={self.now():.1f}s {host.role} back as {host.cluster_id} at {host.address}"
            f"{' (new pod)' if new_identity else ' (restart)'}")

    async def sample(self) -> dict[str, Any]:
        links: dict[str, dict[str, int]] = {}
        fds: dict[str, int] = {}
        for host in self.hosts:
            if not host.up.is_set() or host.client is None or host.daemon is None or host.daemon.proc is None:
                continue
            gen = host.generation
            try:
                states = Counter(link.state.name for link in await host.client.list_links(timeout=2.0))
            except LlmError:
                continue
            except asyncio.CancelledError:
                if self.stopping or host.generation == gen:
                    raise
                continue  # the node was killed during the call (its closed channel cancels the call)
            links[str(host.cluster_id)] = dict(states)
            with contextlib.suppress(OSError):
                fds[str(host.cluster_id)] = len(os.listdir(f"/proc/{host.daemon.proc.pid}/fd"))
        return {"t": round(self.now(), 2), "links": links, "fds": fds,
                "links_total": sum(sum(s.values()) for s in links.values()),
                "links_broken": sum(s.get("BROKEN", 0) for s in links.values()),
                "live_prefill": sum(1 for h in self.hosts if h.role == "prefill" and h.up.is_set()),
                "pulls": len(self.pulls), "bench_fds": len(os.listdir("/proc/self/fd"))}

    async def sampler(self) -> None:
        while not self.stopping:
            s = await self.sample()
            self.samples.append(s)
            for host in self.hosts:
                if host.fd_baseline is None and s["t"] - host.ready_at >= self.a.warmup and host.up.is_set():
                    host.fd_baseline = s["fds"].get(str(host.cluster_id))
            await asyncio.sleep(self.a.sample_every)

    # -- the run -------------------------------------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        self.net.up()
        log(f"run {self.net.tag}: {len(self.hosts)} nodes; links shaped: (set when the first node is made)")
        await asyncio.gather(*(self.start_host(h, new_identity=True) for h in self.hosts))
        log(f"shaping: {self.net.shaping}")
        self.t0 = time.monotonic()
        workers = [asyncio.create_task(self.worker(h, w)) for h in self.hosts if h.role == "decode"
                   for w in range(self.a.concurrency)]
        sampler = asyncio.create_task(self.sampler())
        churn = asyncio.create_task(self.churn())
        await asyncio.sleep(self.a.duration)
        await churn
        final = await self.sample()
        self.stopping = True
        # Every worker is inside one bounded call at most (a link: LINK_TIMEOUT_S x 3, a pull: its deadline).
        await asyncio.wait_for(asyncio.gather(*workers, sampler), self.a.pull_timeout + 3 * LINK_TIMEOUT_S + 10)
        return await self.finish(final)

    async def finish(self, final: dict[str, Any]) -> dict[str, Any]:
        fds = {}
        for host in self.hosts:
            end = final["fds"].get(str(host.cluster_id))
            if host.fd_baseline is not None and end is not None:
                fds[str(host.cluster_id)] = {"after_warmup": host.fd_baseline, "end": end, "restarted": host.killed}
        for host in self.hosts:
            if host.client is not None:
                await host.client.close()
        for host in self.hosts:
            if host.daemon is not None:
                self.exit_codes.append(await asyncio.to_thread(host.daemon.stop))
        for host in self.hosts:
            left = sorted(p.name for p in host.shm_dir.iterdir()) if host.shm_dir.exists() else []
            self.orphans += [f"host{host.index} after SIGTERM: {name}" for name in left]
        return self.report(final, fds)

    def report(self, final: dict[str, Any], fds: dict[str, dict[str, int]]) -> dict[str, Any]:
        a = self.a
        ok = [p["ms"] for p in self.pulls if p["outcome"] == "ok"]
        by_status = Counter(f"{p['outcome']}:{p['status']}" for p in self.pulls)
        decode_links = {cid: sum(s.values()) for cid, s in final["links"].items() if int(cid) >= DECODE_BASE_ID}
        bound = final["live_prefill"] + a.link_slack
        per_second = Counter(int(p["t"]) for p in self.pulls if p["outcome"] == "ok")
        fd_growth = {cid: v["end"] - v["after_warmup"] for cid, v in fds.items()}
        checks = {
            "accounted": not any(kind == "accounted" for kind, _ in self.violations),
            "deadlines": not any(kind == "deadlines" for kind, _ in self.violations),
            "segments": not self.orphans,
            "fds": all(g <= a.fd_slack for g in fd_growth.values()),
            "links": all(n <= bound for n in decode_links.values()) and not self.link_refusals,
            "clean_exit": all(c == 0 for c in self.exit_codes),
        }
        return {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "config": {k: v for k, v in vars(a).items()},
            "shaping": self.net.shaping,
            "nodes": {"prefill": sum(h.role == "prefill" for h in self.hosts),
                      "decode": sum(h.role == "decode" for h in self.hosts)},
            "pulls": {"total": len(self.pulls), "ok": len(ok),
                      "per_second": len(ok) / a.duration,
                      "per_second_min": min((per_second.get(s, 0) for s in range(int(a.warmup), int(a.duration))),
                                            default=0),
                      "p50_ms": percentile(ok, 50), "p99_ms": percentile(ok, 99), "max_ms": max(ok, default=0.0),
                      "bytes_each": a.blocks * a.tensors * a.block_bytes,
                      "by_outcome_status": dict(sorted(by_status.items())),
                      "failed_with_report": sum(1 for p in self.pulls if p.get("report") is True),
                      "failed_without_report": sum(1 for p in self.pulls if p.get("report") is False),
                      "slowest_failure_ms": max((p["ms"] for p in self.pulls if p["outcome"] == "failed"),
                                                default=0.0)},
            "links": {"final_per_decode": decode_links, "bound_per_decode": bound,
                      "max_total": max((s["links_total"] for s in self.samples), default=0),
                      "max_broken": max((s["links_broken"] for s in self.samples), default=0),
                      "final_total": final["links_total"], "final_broken": final["links_broken"],
                      "refused_for_room": dict(self.link_refusals),
                      "series": [{"t": s["t"], "total": s["links_total"], "broken": s["links_broken"]}
                                 for s in self.samples]},
            "samples": self.samples,
            "fds": {"surviving_daemons": fds, "growth": fd_growth, "bench_process": [
                self.samples[0]["bench_fds"] if self.samples else 0, final["bench_fds"]]},
            "churn": self.events,
            "orphaned_segments": self.orphans,
            "daemon_exit_codes": self.exit_codes,
            "violations": [f"{kind}: {what}" for kind, what in self.violations[:50]],
            "violations_total": len(self.violations),
            "checks": checks,
        }

    def teardown(self) -> list[str]:
        for host in self.hosts:
            if host.daemon is not None and host.daemon.proc is not None and host.daemon.proc.poll() is None:
                host.daemon.proc.kill()
                host.daemon.proc.wait()
        left = self.net.down()
        with contextlib.suppress(OSError):
            for d in self.shm_root.glob("host*"):
                for f in d.iterdir():
                    f.unlink()
                d.rmdir()
            self.shm_root.rmdir()
        return left


def summary(r: dict[str, Any]) -> str:
    p, lk = r["pulls"], r["links"]
    lines = [
        f"fleet: {r['nodes']['prefill']} prefill + {r['nodes']['decode']} decode nodes, "
        f"{r['config']['duration']:g} s, {len(r['churn'])} kills; links: {r['shaping']}",
        f"pulls: {p['total']} ({p['ok']} ok), {p['per_second']:.1f} ok/s (slowest second {p['per_second_min']}), "
        f"{p['bytes_each'] >> 10} KiB each; p50 {p['p50_ms']:.2f} ms, p99 {p['p99_ms']:.2f} ms, "
        f"max {p['max_ms']:.1f} ms",
        "by outcome:status: " + ", ".join(f"{k} {v}" for k, v in p["by_outcome_status"].items()),
        f"failures with a report: {p['failed_with_report']}, without (refused, nothing written): "
        f"{p['failed_without_report']}; slowest failure {p['slowest_failure_ms']:.0f} ms",
        f"links held: max {lk['max_total']} (max BROKEN {lk['max_broken']}), final {lk['final_total']} "
        f"(BROKEN {lk['final_broken']}); per decode daemon at the end {lk['final_per_decode']} vs bound "
        f"{lk['bound_per_decode']}; refused for room: {sum(lk['refused_for_room'].values())}",
        f"fds of the daemons alive at the end (after warm-up -> end): {r['fds']['surviving_daemons']}",
        f"orphaned segments: {len(r['orphaned_segments'])}; daemon exit codes: {r['daemon_exit_codes']}",
        "checks: " + ", ".join(f"{k} {'PASS' if v else 'FAIL'}" for k, v in r["checks"].items()),
    ]
    lines += [f"  violation: {v}" for v in r["violations"][:10]]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=6, help="nodes in all (default 6)")
    ap.add_argument("--decode", type=int, default=None, help="decode nodes among them (default half)")
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of pulls (default 120)")
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds before the first kill (default 5)")
    ap.add_argument("--settle", type=float, default=15.0,
                    help="seconds without churn at the end, before the link bound is checked (default 15)")
    ap.add_argument("--churn-every", type=float, default=10.0, help="seconds between kills; 0: none (default 10)")
    ap.add_argument("--kills", type=int, default=None, help="at most this many kills (default: no limit)")
    ap.add_argument("--kill-roles", default="prefill,decode", help="roles killed in turn (default prefill,decode)")
    ap.add_argument("--restart-mode", choices=("same", "new", "alternate"), default="alternate",
                    help="same: same cluster id and address (new epoch); new: a new pod (new cluster id, namespace "
                         "and address); alternate: new, same, new, ... (default)")
    ap.add_argument("--down-time", type=float, default=2.0, help="seconds a killed node stays down (default 2)")
    ap.add_argument("--dead-entries-for", type=float, default=0.0,
                    help="seconds a killed prefill node's cache stays in the directory, i.e. decode nodes still "
                         "try it (default 0: only the pulls in flight at the kill meet the dead node, and its links "
                         "are never used again, the case where links pile up)")
    ap.add_argument("--delay", default="0.5ms", help="netem delay on each node's egress (default 0.5ms)")
    ap.add_argument("--rate", default="10gbit", help="rate of each node's egress (default 10gbit)")
    ap.add_argument("--require-netem", action="store_true", help="fail where the kernel has no netem")
    ap.add_argument("--tensors", type=int, default=2)
    ap.add_argument("--block-bytes", type=parse_size, default=16 << 10, help="bytes per block (default 16K)")
    ap.add_argument("--cache-blocks", type=int, default=512, help="blocks of each prefill cache (default 512)")
    ap.add_argument("--blocks", type=int, default=16, help="blocks per pull (default 16)")
    ap.add_argument("--concurrency", type=int, default=4, help="concurrent pulls per decode node (default 4)")
    ap.add_argument("--pull-timeout", type=float, default=5.0, help="deadline of each pull (default 5 s)")
    ap.add_argument("--deadline-grace", type=float, default=1.0,
                    help="how late past its deadline a pull may return here before it counts as late (this "
                         "process's event loop on a loaded machine; default 1 s)")
    ap.add_argument("--sample-every", type=float, default=1.0, help="seconds between link/fd samples (default 1)")
    ap.add_argument("--link-slack", type=int, default=0, help="links a decode daemon may hold above the live "
                    "prefill nodes at the end (default 0)")
    ap.add_argument("--fd-slack", type=int, default=16, help="fds a surviving daemon may gain (default 16)")
    ap.add_argument("--max-links", type=int, default=0, help="--max-links of every daemon (default: theirs)")
    ap.add_argument("--peer-link-ttl", type=float, default=0.0, help="--peer-link-ttl of every daemon")
    ap.add_argument("--daemon-arg", action="append", default=[], help="one more daemon argument (repeatable), "
                    "e.g. --daemon-arg=--auto-relink")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="print the JSON report on stdout")
    ap.add_argument("--save", default="", help="also write the JSON report to this file")
    ap.add_argument("--strict", action="store_true", help="exit 1 if a check fails")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    why = available()
    if why:
        print(f"fleet: cannot run here: {why}", file=sys.stderr)
        return 2
    fleet = Fleet(args)
    loop = asyncio.new_event_loop()

    def interrupted(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    try:
        report = loop.run_until_complete(fleet.run())
    finally:
        left = fleet.teardown()
        loop.close()
        if left:
            print(f"fleet: namespaces that would not go: {left}", file=sys.stderr)
    report["namespaces_left"] = left
    print(summary(report), file=sys.stderr)
    text = json.dumps(report, indent=1)
    if args.save:
        Path(args.save).write_text(text)
    if args.json:
        print(text)
    return 1 if args.strict and not all(report["checks"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
