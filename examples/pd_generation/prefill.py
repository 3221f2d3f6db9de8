"""The prefill worker P: runs each prompt, leaves its KV in blocks of a kvbroker cache on this node, and hands the
decode side what it needs to pull them (no KV bytes: those move daemon to daemon).

    python -m examples.pd_generation.prefill --kvbroker unix:///run/kvbroker/kvbroker.sock --dtype bf16

Requests on stdin, answers on stdout, one JSON object per line:

    {"op": "prefill", "id": "r1", "prompt": [17, 4, ...]}  ->  {"id": "r1", "handoff": {...}}
    {"op": "release", "id": "r1"}                           ->  {"id": "r1", "released": [blocks]}

A request's blocks stay allocated until it is released: the decode side must have pulled them.
"""

from __future__ import annotations

import argparse

import kvbroker
from examples.pd_generation.lines import Message, serve
from examples.pd_generation.model import DTYPES, build_model, kv_hashes, prefill, weight_hash
from examples.pd_generation.paged import BlockPool, blocks_for, cache_desc, paged_views, store_kv


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kvbroker", required=True, help="this node's kvbrokerd, e.g. unix:///path/kvbroker.sock")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (the decode side must use the same)")
    parser.add_argument("--num-blocks", type=int, default=256)
    args = parser.parse_args(argv)

    model = build_model(args.dtype, args.seed)
    with kvbroker.Client(args.kvbroker) as kv:
        node = kv.get_cluster_info()
        cache = kv.allocate_cache(cache_desc(model.config, args.dtype, args.num_blocks))
        paged = paged_views(cache)
        pool = BlockPool(args.num_blocks, seed=1)
        tables: dict[str, list[int]] = {}

        def handle(req: Message) -> Message:
            if req["op"] == "release":
                pool.give(tables[req["id"]])
                return {"id": req["id"], "released": tables.pop(req["id"])}
            prompt = req["prompt"]
            first_token, prompt_kv = prefill(model, prompt)
            table = tables[req["id"]] = pool.take(blocks_for(len(prompt)))
            store_kv(prompt_kv, paged, table)
            # Everything the decode node needs: where the blocks are (cluster, its peer address to link to, cache,
            # block table), how many tokens they hold, and the token the prefill already chose. The hashes are only
            # there for the example's checks.
            return {"id": req["id"], "handoff": {
                "cluster_id": node.cluster_id, "peer_address": node.peer_address, "cache_id": cache.cache_id,
                "block_table": table, "num_tokens": len(prompt), "first_token": first_token,
                "kv_hashes": kv_hashes(prompt_kv)}}

        try:
            serve(lambda: {"ready": "prefill", "weight_hash": weight_hash(model), "cluster_id": node.cluster_id},
                  handle)
        finally:
            paged.clear()
            kv.deallocate_cache(cache)


if __name__ == "__main__":
    main()
