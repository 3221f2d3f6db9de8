"""What a heterogeneous prefill/decode pull costs against a homogeneous pull of the same bytes.

    PYTHONPATH=client:server python bench/vllm_hetero.py [--tokens 2048] [--layers 16] [--heads 8] [--rounds 30]

Two local kvbrokerd daemons (shm backend), a prefill cache per prefill TP rank and one decode cache per case, laid
out exactly as the vLLM connector lays them out (vLLM's CPU attention: [block, head, K|V, token, dim], fp16, head
size 128). Each case runs the connector's own plan (`remap.plan_pull`) as a decode worker does, inside the timed
region: one pull by grant per prefill rank read, side by side in one message of a pull session, naming the units of
that rank's cache as the plan's runs (`block_runs`). It is timed against a homogeneous pull (TP=1, blocks of 32 ->
TP=1, blocks of 32) of the same number of bytes, made the same way: for a decode rank that takes half the heads, the
baseline is a homogeneous pull of half the tokens. Each round makes the baseline's pull, then the case's, so that
both see the same moments of a noisy machine; the figures are the medians of `--rounds` rounds after one warm-up,
`ratio` = heterogeneous / homogeneous.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kvbroker import KvCacheExtParam
from kvbroker._local import LocalDaemon
from kvbroker.integrations.vllm.layout import KvLayout
from kvbroker.integrations.vllm.remap import UnitPull, plan_pull, settle
from kvbroker.types import CacheIndex, Grant, SessionPull

HEAD = 128


def layout(tp: int, block: int, blocks: int, layers: int, heads: int, units: str = "head") -> KvLayout:
    """`units`: "head" (no token view), "token" (`kvbroker_token_units`), "views" (default settings: head units and a
    token view of the same memory)."""
    per = heads // tp
    return KvLayout(num_layers=layers, num_blocks=blocks, block_size=block, num_kv_heads=per, head_size=HEAD,
                    dtype="float16", page_bytes=per * 2 * block * HEAD * 2, model_id="bench", tp_size=tp,
                    total_kv_heads=heads, token_units=units == "token", token_view=units == "views")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--only", default="", help="run only the cases whose name contains this")
    args = ap.parse_args()
    tokens, layers, heads = args.tokens, args.layers, args.heads
    blocks = tokens // 32 + 2
    # (name, prefill tp, prefill block, decode tp, decode block, decode rank, units); each against a homogeneous
    # pull (TP 1, blocks of 32, head units, a grant without views) of the same bytes. "views": default settings (the
    # grant covers each rank's token view too, the plan is `settle`'s: head units between equal block sizes, the
    # views' token units otherwise).
    cases = [("tp1 -> tp1, blocks 32 (homogeneous)", 1, 32, 1, 32, 0, "head"),
             ("tp1 -> tp1, blocks 32, default settings (views)", 1, 32, 1, 32, 0, "views"),
             ("tp2 -> tp1 (gathers 2 ranks)", 2, 32, 1, 32, 0, "head"),
             ("tp1 -> tp2 (rank 1 of 2: half the heads)", 1, 32, 2, 32, 1, "head"),
             ("tp1 -> tp1, blocks 32, token units", 1, 32, 1, 32, 0, "token"),
             ("blocks 32 -> 64, token units", 1, 32, 1, 64, 0, "token"),
             ("blocks 64 -> 32, token units", 1, 64, 1, 32, 0, "token"),
             ("blocks 32 -> 64, default settings (views)", 1, 32, 1, 64, 0, "views"),
             ("blocks 64 -> 32, default settings (views)", 1, 64, 1, 32, 0, "views"),
             ("tp2 blocks 64 -> tp1 blocks 32, default settings (views)", 2, 64, 1, 32, 0, "views")]
    cases = [c for c in cases if args.only in c[0]]
    rows = []
    with tempfile.TemporaryDirectory() as tmp, LocalDaemon(Path(tmp), 61, backends=("shm",)) as p_daemon, \
            LocalDaemon(Path(tmp), 62, backends=("shm",)) as d_daemon, p_daemon.client() as p, \
            d_daemon.client(timeout=60) as d:
        from kvbroker import ClusterInfo
        d.link_clusters([ClusterInfo(p_daemon.cluster_id, p_daemon.peer_address)], timeout=10)

        session = d.open_pull_session()
        ext = KvCacheExtParam(tensor_num_per_layer=1)

        def pull(grant: Grant, dst: int, plan: Callable[[], list[UnitPull]], first_slot: int = 0) -> float:
            """One request's pull as the connector's worker makes it: the plan, then its runs, one pull per prefill
            rank, side by side in one message of its pull session."""
            started = time.perf_counter()
            futures = session.submit([SessionPull(CacheIndex(p_daemon.cluster_id, 0), dst, (), (), ext, grant,
                                                  first_slot + one.remote_rank, block_runs=one.runs)
                                      for one in plan()])
            for f in futures:
                f.result(timeout=60)
            return time.perf_counter() - started

        def granted(caches: list[int], blocks: list[int], units: int, views: tuple[list[int], int] = ([], 1)
                    ) -> Grant:
            grant = p.create_grant(caches, blocks, 600.0, units_per_block=units, view_cache_ids=views[0],
                                   view_units_per_block=views[1])
            # As the connector's grant keeper does from the request's arrival: renewed through the decode daemon,
            # which then knows the grant's blocks and pulls without redeeming it first.
            d.renew_grant(grant, 600.0, cluster_id=p_daemon.cluster_id)
            return grant

        baselines: dict[int, tuple[Grant, int, Callable[[], list[UnitPull]]]] = {}
        for name, p_tp, p_block, d_tp, d_block, rank, units in cases:
            described_theirs = layout(p_tp, p_block, blocks, layers, heads, units)
            described_ours = layout(d_tp, d_block, blocks, layers, heads, units)
            src = [p.allocate_cache(described_theirs.desc()) for _ in range(p_tp)]
            views = [p.allocate_cache(described_theirs.token_layout().desc(), view_of=c)
                     for c in src] if units == "views" else []
            dst = d.allocate_cache(described_ours.desc())
            dst_view = d.allocate_cache(described_ours.token_layout().desc(), view_of=dst) if units == "views" else None
            settled = settle(described_ours, described_theirs)
            assert settled is not None
            ours, theirs = settled
            by_view = ours.token_units and not described_ours.token_units
            first_slot = p_tp if by_view else 0
            target = dst_view.cache_id if by_view and dst_view is not None else dst.cache_id
            p_blocks = list(range(1, tokens // p_block + 1))
            d_blocks = list(range(1, tokens // d_block + 1))
            plan = plan_pull(ours, rank, theirs, d_blocks, p_blocks, 0, tokens)
            nbytes = sum(int((u.runs.length * u.runs.count).sum()) for u in plan) * ours.unit_bytes * layers
            grant = granted([c.cache_id for c in src], p_blocks, described_theirs.grant_units,
                            ([v.cache_id for v in views], described_theirs.token_layout().grant_units))
            if nbytes not in baselines:  # the same bytes, homogeneous: TP 1, blocks of 32, fewer tokens
                same = layout(1, 32, blocks, layers, heads)
                h_src, h_dst = p.allocate_cache(same.desc()), d.allocate_cache(same.desc())
                n_tokens = nbytes // (same.page_bytes * layers) * 32
                h_blocks = list(range(1, n_tokens // 32 + 1))
                baselines[nbytes] = (granted([h_src.cache_id], h_blocks, same.grant_units), h_dst.cache_id,
                                     functools.partial(plan_pull, same, 0, same, h_blocks, h_blocks, 0, n_tokens))
            # Round by round, the baseline's pull then the case's: both see the same moments of a noisy machine.
            times: tuple[list[float], list[float]] = ([], [])
            for i in range(args.rounds + 1):
                base = pull(*baselines[nbytes])
                this = pull(grant, target, functools.partial(_settled_plan, described_ours, rank, described_theirs,
                                                             d_blocks, p_blocks, tokens), first_slot)
                if i:
                    times[0].append(base)
                    times[1].append(this)
            p.release_grant(grant)
            seconds, baseline = statistics.median(times[1]), statistics.median(times[0])
            rows.append({"case": name, "MiB": round(nbytes / 2**20, 1), "units_per_layer": sum(
                len(u.dst_units) for u in plan), "runs_per_layer": sum(
                _runs(u.src_units.tolist(), u.dst_units.tolist()) for u in plan), "wire_runs": sum(
                len(u.runs.length) for u in plan), "ms": round(seconds * 1e3, 2),
                "homogeneous_ms": round(baseline * 1e3, 2), "ratio": round(seconds / baseline, 2)})
            print(json.dumps(rows[-1]), flush=True)
            for c in views + src:
                p.deallocate_cache(c.cache_id)
            if dst_view is not None:
                d.deallocate_cache(dst_view.cache_id)
            d.deallocate_cache(dst.cache_id)
    print("| case | MiB | units / runs per layer | ms | homogeneous ms | ratio |\n"
          "| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['case']} | {r['MiB']} | {r['units_per_layer']} / {r['runs_per_layer']} | {r['ms']} "
              f"| {r['homogeneous_ms']} | {r['ratio']} |")


def _settled_plan(ours: KvLayout, rank: int, theirs: KvLayout, local: list[int], remote: list[int], tokens: int
                  ) -> list[UnitPull]:
    """The worker's plan: the units settled from the two layouts (`remap.settle`), then the runs."""
    settled = settle(ours, theirs)
    assert settled is not None
    return plan_pull(settled[0], rank, settled[1], local, remote, 0, tokens)


def _runs(src: list[int], dst: list[int]) -> int:
    return 1 + sum(1 for i in range(1, len(src)) if not (src[i] == src[i - 1] + 1 and dst[i] == dst[i - 1] + 1))


if __name__ == "__main__":
    main()
