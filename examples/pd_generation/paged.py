"""The paged KV layout both sides agree on, and the copies between it and the model's own cache.

One kvbroker cache per node holds every layer: tensor 2i is layer i's K, tensor 2i+1 its V (`tensor_num_per_layer=2`,
kvbroker's default), each `[num_blocks, BLOCK_SIZE, kv_heads, head_dim]`. A request owns a block table: token t sits
in block `table[t // BLOCK_SIZE]`, row `t % BLOCK_SIZE`. The model's cache holds `[1, kv_heads, seq, head_dim]` per
layer, so K and V are transposed on the way in and out.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Sequence

import torch
from transformers import DynamicCache, LlamaConfig

from examples.pd_generation.model import DTYPES, layer_kv
from kvbroker import Cache, CacheDesc, DataType

BLOCK_SIZE = 16


def cache_desc(config: LlamaConfig, dtype: str, num_blocks: int) -> CacheDesc:
    # The daemons refuse a pull between caches with different tags, so a decode node configured for another model,
    # dtype or block layout fails before any byte moves instead of decoding garbage.
    kv_heads, head_dim = config.num_key_value_heads, config.head_dim
    assert kv_heads is not None and head_dim is not None, "LlamaConfig derives both when not given"
    tag = f"llama-h{config.hidden_size}-l{config.num_hidden_layers}/{dtype}/K,V per layer/[block,{BLOCK_SIZE},head,dim]"
    return CacheDesc(num_tensors=2 * config.num_hidden_layers,
                     shape=(num_blocks, BLOCK_SIZE, kv_heads, head_dim),
                     data_type=DTYPES[dtype][1], layout_tag=tag)


def blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


def paged_views(cache: Cache) -> list[torch.Tensor]:
    """torch tensors over the cache's shared memory (no copy): writes land where the daemon reads them.

    Made from the client's numpy arrays, which keep the mapping alive; a `torch.frombuffer` over the mapping would
    not, and reading it after `deallocate_cache` crashes the process."""
    views = []
    for array in cache.tensors:
        if cache.desc.data_type == DataType.BFLOAT16:
            # numpy has no bfloat16, so kvbroker maps bf16 tensors as uint16: reinterpret the same 2-byte elements.
            views.append(torch.from_numpy(array.view("int16")).view(torch.bfloat16))
        else:
            views.append(torch.from_numpy(array))
    return views


def slot_mapping(block_table: Sequence[int], num_tokens: int) -> torch.Tensor:
    """Row of each token in the cache flattened to `[num_blocks * BLOCK_SIZE, kv_heads, head_dim]`."""
    pos = torch.arange(num_tokens)
    return torch.tensor(list(block_table))[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE


def store_kv(kv: DynamicCache, paged: list[torch.Tensor], block_table: Sequence[int]) -> None:
    """Prefill side: copies every layer's K and V into the blocks of `block_table`."""
    slots = slot_mapping(block_table, kv.get_seq_length())
    for i, kv_pair in enumerate(layer_kv(kv)):
        for j, t in enumerate(kv_pair):
            paged[2 * i + j].flatten(0, 1)[slots] = t[0].transpose(0, 1)


def load_kv(paged: list[torch.Tensor], block_table: Sequence[int], num_tokens: int,
            config: LlamaConfig) -> DynamicCache:
    """Decode side: rebuilds the model's cache from the blocks of `block_table`.

    Indexing with the slot mapping copies, so the model's cache owns its memory: the blocks can be freed (and
    overwritten by the next pull) as soon as this returns."""
    slots = slot_mapping(block_table, num_tokens)
    kv = DynamicCache(config=config)
    for i in range(config.num_hidden_layers):
        k, v = (paged[2 * i + j].flatten(0, 1)[slots].transpose(0, 1).unsqueeze(0) for j in (0, 1))
        kv.update(k, v, i)
    return kv


class BlockPool:
    """An engine's free list of blocks.

    Shuffled, so that a request's blocks are scattered the way they are in an engine that has run for a while (a
    transfer that mixed up block numbers could not pass by luck); FIFO, so that a freed block is reused as late as
    possible."""

    def __init__(self, num_blocks: int, seed: int) -> None:
        blocks = list(range(num_blocks))
        random.Random(seed).shuffle(blocks)
        self._free = collections.deque(blocks)

    def take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"out of KV blocks: {n} wanted, {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def give(self, blocks: Sequence[int]) -> None:
        self._free.extend(blocks)
