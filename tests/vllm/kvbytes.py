"""The bytes of a request's prompt KV in an engine's cache, read through its daemon (test-only access): each
(token, head, dimension) of K and V where the engine's layout (its tag's `memory`: the attention ISA's) puts it."""

from __future__ import annotations

import numpy as np

from kvbroker._local import LocalDaemon
from kvbroker.integrations.vllm.layout import layout_of_tag
from kvbroker.shm import Cache
from tests.unit.test_vllm_remap_runs import _elements
from tests.vllm.engines import Engine


def prompt_kv(engine: Engine, daemon: LocalDaemon, req_id: str, prompt_len: int) -> list[bytes]:
    """Per layer: the prompt's K and V of the finished request `req_id`, as bytes in (token, head, dim) order."""
    return blocks_kv(engine, daemon, engine.call("block_ids", req_id), prompt_len)


def blocks_kv(engine: Engine, daemon: LocalDaemon, block_ids: list[int], num_tokens: int) -> list[bytes]:
    """Per layer: the K and V of the first `num_tokens` tokens held in the engine's blocks `block_ids` (in token
    order), as bytes in (token, head, dim) order."""
    info = engine.call("connector")
    layout = layout_of_tag(info["layout_tag"])
    blocks = np.asarray(block_ids, dtype=np.int64)
    tokens = np.arange(num_tokens)
    elements = np.concatenate([_elements(layout, blocks[tokens // layout.block_size], head,
                                         tokens % layout.block_size) for head in range(layout.num_kv_heads)])
    with daemon.client() as c:
        record = next(r for r in c.list_caches() if r.cache_id == info["cache_id"])
    cache = Cache.map(record)
    try:
        return [np.ascontiguousarray(layer.reshape(-1)[elements]).tobytes() for layer in cache.tensors]
    finally:
        cache.close()
