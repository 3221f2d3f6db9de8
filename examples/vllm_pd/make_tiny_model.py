"""Makes a tiny random Llama checkpoint, with a tokenizer, that vLLM serves on the CPU: no hub access, seconds.

    python examples/vllm_pd/make_tiny_model.py /tmp/tiny-llama

The weights are random (seeded), so the text is gibberish, but it is deterministic gibberish: a decode server that
continues from transferred KV must produce exactly the tokens of a single server. The shapes respect vLLM's CPU
attention (head size >= 32). The tokenizer is a byte-level BPE trained here on a fixed text, with a chat template,
so that `/v1/completions` takes text and `/v1/chat/completions` works too.

Runs in vLLM's environment (torch, transformers, tokenizers); `--help` lists the shape options (the benchmark uses
larger ones than the default).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

# Deterministic training text for the tokenizer: only its merges depend on it, and they only need to be stable.
_CORPUS = (
    "kvbroker moves the key value cache of a prompt from a prefill server to a decode server. "
    "The decode server continues the request as if it had computed the prompt itself. "
    "Disaggregated serving splits the two phases so that each runs on the machines that suit it. "
    "The quick brown fox jumps over the lazy dog while the model writes its next token. "
    "Hello world, how are you today? Tell me a story about caches, blocks, layers and links. "
)
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_SPECIAL_TOKENS = ["<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]


def build_tokenizer(out: Path, vocab_size: int) -> dict[str, int]:
    """Trains and saves the tokenizer; returns the special tokens' ids."""
    # Installed with transformers; typed, but absent where only the daemon is installed.
    from tokenizers import (  # type: ignore[import-not-found,unused-ignore]
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    make_fast: Any = PreTrainedTokenizerFast  # untyped in some transformers releases
    fast = make_fast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>"
    )
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(out)
    bos, eos = tokenizer.token_to_id("<s>"), tokenizer.token_to_id("</s>")
    if bos is None or eos is None:
        raise RuntimeError("the trained tokenizer lost its special tokens")
    return {"bos_token_id": bos, "eos_token_id": eos}


def build(
    out: Path,
    *,
    layers: int = 2,
    hidden_size: int = 128,
    heads: int = 2,
    kv_heads: int = 1,
    max_positions: int = 4096,
    vocab_size: int = 512,
    dtype: str = "float32",
    seed: int = 1234,
) -> Path:
    """Writes config.json, the safetensors weights and the tokenizer into `out` (created if needed)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if hidden_size % heads or heads % kv_heads:
        raise ValueError(
            f"hidden size {hidden_size}, heads {heads}, kv heads {kv_heads}: each must divide the one before"
        )
    if hidden_size // heads < 32:
        raise ValueError(f"head size {hidden_size // heads} < 32: vLLM's CPU attention needs at least 32")
    out.mkdir(parents=True, exist_ok=True)
    special_ids = build_tokenizer(out, vocab_size)
    # Built as a plain dict: the keyword set differs between the transformers of the vLLM venv (< 5.20, which
    # wants torch_dtype) and the one the type checker sees.
    settings: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        # Wide weights spread the logits, so that greedy tokens do not flip on rounding differences between a
        # one-pass prefill and a decode that continues from transferred KV.
        initializer_range=0.5,
        torch_dtype=dtype,
        **special_ids,
    )
    config = LlamaConfig(**settings)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype)).eval()
    model.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="directory to write the checkpoint into")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--max-positions", type=int, default=4096)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    try:
        build(
            args.out,
            layers=args.layers,
            hidden_size=args.hidden_size,
            heads=args.heads,
            kv_heads=args.kv_heads,
            max_positions=args.max_positions,
            dtype=args.dtype,
            seed=args.seed,
        )
    except ValueError as exc:
        parser.error(str(exc))
    print(json.dumps({"model": str(args.out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
