"""The decode worker D: pulls a request's KV blocks from the prefill node through its own kvbrokerd, rebuilds the
model's cache from them and decodes greedily.

    python -m examples.pd_generation.decode --kvbroker unix:///run/kvbroker/kvbroker.sock --dtype bf16

Requests on stdin, answers on stdout, one JSON object per line:

    {"op": "decode", "id": "r1", "handoff": {...}, "steps": 24}  ->  {"id": "r1", "tokens": [...], ...}

`"layer_split": true` pulls the first half of the layers, then the second half (as a layer-wise engine would).
`"fault"` exists only for the example's negative controls: it breaks the transfer on purpose, to prove that the
checks catch a broken transfer ("skip-block", "swap-blocks" or "short-rebuild").
"""

from __future__ import annotations

import argparse
import base64
import time

import kvbroker
from examples.pd_generation.lines import Message, serve
from examples.pd_generation.model import DTYPES, build_model, decode, kv_hashes, weight_hash
from examples.pd_generation.paged import BlockPool, cache_desc, load_kv, paged_views
from kvbroker import CacheIndex, ClusterInfo, KvCacheExtParam, LlmStatus

FAULTS = ("skip-block", "swap-blocks", "short-rebuild")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kvbroker", required=True, help="this node's kvbrokerd, e.g. unix:///path/kvbroker.sock")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (the prefill side must use the same)")
    parser.add_argument("--num-blocks", type=int, default=256)
    args = parser.parse_args(argv)

    model = build_model(args.dtype, args.seed)
    layers = model.config.num_hidden_layers
    with kvbroker.Client(args.kvbroker) as kv:
        cache = kv.allocate_cache(cache_desc(model.config, args.dtype, args.num_blocks))
        paged = paged_views(cache)
        pool = BlockPool(args.num_blocks, seed=2)
        linked: set[int] = set()

        def handle(req: Message) -> Message:
            h, fault = req["handoff"], req.get("fault")
            if h["cluster_id"] not in linked:
                link = kv.link_clusters([ClusterInfo(h["cluster_id"], h["peer_address"])], timeout=10.0)[0]
                if not link.ok and link.status != LlmStatus.LLM_ALREADY_LINK:
                    raise RuntimeError(f"cannot link to the prefill node: {link.status.name}: {link.message}")
                linked.add(h["cluster_id"])
            src_blocks, num_tokens = list(h["block_table"]), h["num_tokens"]
            dst_blocks = pool.take(len(src_blocks))
            pulled_src, pulled_dst = src_blocks, dst_blocks
            # Negative controls only: each fault is a bug a real transfer path could have.
            if fault == "skip-block":
                pulled_src, pulled_dst = src_blocks[1:], dst_blocks[1:]
            elif fault == "swap-blocks":
                pulled_src = [src_blocks[1], src_blocks[0], *src_blocks[2:]]
            elif fault == "short-rebuild":
                num_tokens -= 1
            ranges = [(0, layers // 2 - 1), (layers // 2, layers - 1)] if req.get("layer_split") else [(-1, -1)]
            try:
                start, moved = time.perf_counter(), 0
                for r in ranges:
                    result = kv.pull_kv_blocks(CacheIndex(h["cluster_id"], h["cache_id"]), cache, pulled_src,
                                               pulled_dst, KvCacheExtParam(src_layer_range=r, dst_layer_range=r),
                                               timeout=10.0)
                    moved += result.bytes_moved
                pull_s = time.perf_counter() - start
                prompt_kv = load_kv(paged, dst_blocks, num_tokens, model.config)
            finally:
                # load_kv copied the blocks out, so they can go back to the pool before decoding starts.
                pool.give(dst_blocks)
            rebuilt_hashes = kv_hashes(prompt_kv)
            tokens, logits = decode(model, prompt_kv, h["first_token"], req["steps"])
            return {"id": req["id"], "tokens": tokens, "kv_hashes": rebuilt_hashes, "dst_blocks": dst_blocks,
                    "bytes_moved": moved, "pull_s": pull_s, "backend": result.backend,
                    "logits": base64.b64encode(logits.astype("<f4").tobytes()).decode()}

        try:
            serve(lambda: {"ready": "decode", "weight_hash": weight_hash(model)}, handle)
        finally:
            paged.clear()
            kv.deallocate_cache(cache)


if __name__ == "__main__":
    main()
