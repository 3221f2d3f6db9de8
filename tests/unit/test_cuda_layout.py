"""cuda_layout.read_runs on per-layer KV views built here with torch on the CPU, their shapes and strides WRITTEN OUT
by hand (no vLLM in this suite; tests/vllm/test_cuda_layouts.py builds them with vLLM's own functions for every
backend). The logic only reads shapes, strides and addresses, so CPU tensors exercise all of it."""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[examples]')")

import torch

from kvbroker.integrations.vllm.cuda_layout import block_ranges, read_runs, run_tensors
from kvbroker.integrations.vllm.layout import UnsupportedLayoutError

L, B, H, N, C = 3, 5, 2, 4, 8  # layers, blocks, kv heads, tokens per block, content (bf16 elements)
PAGE = H * N * C * 2


def _views(order: str, buf: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Per-layer [B, H, N, C] bf16 views of one buffer, physical order `order` over (L, B, H, N, C), as vLLM 0.32's
    create_kv_cache_views makes them (written out: element strides from the order)."""
    sizes = {"L": L, "B": B, "H": H, "N": N, "C": C}
    strides, acc = {}, 1
    for d in reversed(order):
        strides[d] = acc
        acc *= sizes[d]
    flat = (buf if buf is not None else torch.zeros(acc * 2, dtype=torch.int8)).view(torch.bfloat16)
    return {f"layer{i}": torch.as_strided(flat, (B, H, N, C), tuple(strides[d] for d in "BHNC"), i * strides["L"])
            for i in range(L)}


@pytest.mark.parametrize(("order", "signature"), [
    ("LBNHC", f"{L}x{PAGE}/l1"),          # FlashAttention / Triton (NHD)
    ("LBHNC", f"{L}x{PAGE}/l1"),          # FlashInfer's HND
    ("LHBNC", f"{L * H}x{N * C * 2}/l{H}"),  # head-major outside the block: one run per head and layer
    ("BLHNC", f"1x{L * PAGE}/l1"),        # block-outermost: a block holds every layer's page
    ("BHLNC", f"1x{L * PAGE}/l1"),
])
def test_every_vllm_layout_order_reads_into_dense_runs(order: str, signature: str) -> None:
    views = _views(order)
    runs = read_runs(views)
    assert runs.signature() == signature and runs.num_blocks == B
    tensors = run_tensors(views, runs)
    views["layer1"][3].fill_(1.0)  # one block of one layer: found in run slot 3, nowhere else
    ones = sum(int((t.view(torch.bfloat16) == 1.0).sum()) for t in tensors)
    in_block3 = sum(int((t[3].view(torch.bfloat16) == 1.0).sum()) for t in tensors)
    assert ones == in_block3 == H * N * C


def test_legacy_flash_attention_shape_two_runs_per_layer() -> None:
    """Older vLLM's FlashAttention view [2, num_blocks, block_size, kv_heads, head_size] (block_dim=1): K and V are
    each a dense run per layer."""
    buf = torch.zeros(L * 2 * B * N * H * C, dtype=torch.bfloat16)
    views = {f"layer{i}": buf[i * 2 * B * N * H * C:(i + 1) * 2 * B * N * H * C].view(2, B, N, H, C)
             for i in range(L)}
    runs = read_runs(views, block_dim=1)
    assert runs.signature() == f"{2 * L}x{N * H * C * 2}/l2"
    assert runs.layer_runs["layer1"] == (2, 3)


def test_mla_latent_cache_one_run_per_layer() -> None:
    """MLA: one latent vector per token (kv_lora_rank + rope = 576), no heads: [B, 1, N, 576]."""
    flat = torch.zeros(L * B * N * 576, dtype=torch.bfloat16)
    views = {f"layer{i}": flat[i * B * N * 576:(i + 1) * B * N * 576].view(B, 1, N, 576) for i in range(L)}
    assert read_runs(views).signature() == f"{L}x{N * 576 * 2}/l1"


def test_a_tensor_shared_by_several_layers_is_one_set_of_runs() -> None:
    views = _views("LBNHC")
    views["layer3"] = views["layer0"]
    runs = read_runs(views)
    assert len(runs.starts) == L and runs.layer_runs["layer3"] == runs.layer_runs["layer0"]


@pytest.mark.parametrize(("make", "words"), [
    (lambda v: {k: t[:, :, :2] for k, t in v.items()}, "interleave"),                 # padded pages
    (lambda v: {"a": v["layer0"], "b": v["layer0"][:, :1]}, "overlap"),               # two layers, same bytes
    (lambda v: {"a": v["layer0"], "b": torch.zeros(B, H, N, C, dtype=torch.bfloat16)}, "allocations"),
    (lambda v: {"a": v["layer0"], "b": v["layer1"][:3]}, "blocks"),
    (lambda v: {}, "no KV cache layers"),
])
def test_what_cannot_be_served_is_refused_with_the_reason(make, words: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(UnsupportedLayoutError, match=words):
        read_runs(make(_views("LBNHC")))


def test_block_ranges_merge_consecutive_ids() -> None:
    assert block_ranges([5, 1, 2, 3, 9, 2]) == [(1, 4), (5, 6), (9, 10)]
    assert block_ranges([]) == []
