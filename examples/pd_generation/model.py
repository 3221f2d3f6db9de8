"""The model every process runs, built without any download, and greedy generation split into prefill and decode."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import DynamicLayer

from kvbroker import DataType

# Bit-exact logits across processes need the same reduction order everywhere, hence one fixed thread count; one
# thread also keeps three model processes from fighting over a small machine's cores.
TORCH_THREADS = 1

DTYPES: dict[str, tuple[torch.dtype, DataType]] = {
    "fp32": (torch.float32, DataType.FLOAT32),
    "bf16": (torch.bfloat16, DataType.BFLOAT16),
}


def tiny_llama_config() -> LlamaConfig:
    # initializer_range=0.2 (ten times the default) makes a random model's greedy output varied rather than one
    # token repeated, so a corrupted cache shows in the tokens too; eos_token_id=None lets no request stop early.
    return LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=1000, initializer_range=0.2, bos_token_id=None,
                       eos_token_id=None, pad_token_id=None)


def build_model(dtype: str, seed: int = 0) -> LlamaForCausalLM:
    """The same weights in every process that passes the same seed (check with `weight_hash`)."""
    torch.set_num_threads(TORCH_THREADS)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config())
    model.train(False)
    # torch's Module.to (in place for a module), called directly: transformers' override hides its types.
    torch.nn.Module.to(model, DTYPES[dtype][0])
    return model


def tensor_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().view(torch.uint8).numpy())


def weight_hash(model: LlamaForCausalLM) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor_bytes(t))
    return h.hexdigest()[:16]


def layer_kv(kv: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (K, V), both `[1, kv_heads, seq, head_dim]`."""
    out = []
    for layer in kv.layers:
        if not isinstance(layer, DynamicLayer) or layer.keys is None or layer.values is None:
            raise TypeError(f"expected a filled full-attention layer, got {type(layer).__name__}")
        out.append((layer.keys, layer.values))
    return out


def kv_hashes(kv: DynamicCache, num_tokens: int | None = None) -> list[str]:
    """sha256 of each layer's K, then V (of the first `num_tokens` tokens): equal lists mean equal caches."""
    return [hashlib.sha256(tensor_bytes(t[:, :, :num_tokens])).hexdigest()[:16]
            for kv_pair in layer_kv(kv) for t in kv_pair]


def prefill(model: LlamaForCausalLM, prompt: Sequence[int]) -> tuple[int, DynamicCache]:
    """Runs the prompt; returns the first generated token and the prompt's KV cache."""
    kv = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([list(prompt)]), cache=kv, use_cache=True, logits_to_keep=1)
    return int(out.logits[0, -1].argmax()), kv


def decode(model: LlamaForCausalLM, kv: DynamicCache, token: int, steps: int) -> tuple[list[int], np.ndarray]:
    """Greedy decoding from `token` (already generated, not yet in `kv`): the next `steps` tokens and the logits
    that chose each, as float32 (exact for bf16 too)."""
    tokens, logits = [], []
    with torch.no_grad():
        for _ in range(steps):
            out = model(input_ids=torch.tensor([[token]]), cache=kv, use_cache=True)
            step = out.logits[0, -1].float()
            token = int(step.argmax())
            tokens.append(token)
            logits.append(step.numpy())
    return tokens, np.stack(logits)


@dataclass
class Generation:
    """A greedy generation: `tokens[0]` comes from the prefill, `logits[i]` chose `tokens[i + 1]`."""

    tokens: list[int]
    logits: np.ndarray
    kv_hashes: list[str]


def reference_generation(model: LlamaForCausalLM, prompt: Sequence[int], steps: int) -> Generation:
    """What one process produces with transformers' own `generate()`: the yardstick for the disaggregated run."""
    with torch.no_grad():
        out = model.generate(torch.tensor([list(prompt)]), max_new_tokens=steps + 1, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    logits = np.stack([step[0].float().numpy() for step in out.logits[1:]])
    return Generation(tokens=out.sequences[0, len(prompt):].tolist(), logits=logits,
                      kv_hashes=kv_hashes(out.cache, len(prompt)))
