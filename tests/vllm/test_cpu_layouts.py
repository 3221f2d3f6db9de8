"""The in-block layouts the connector's tag claims for vLLM's CPU attention ISAs, against what vLLM's own kernel
writes: `cpu_attn_reshape_and_cache` (the op vLLM's CPU attention calls with the ISA it picked) writes a known
pattern into CPU tensors viewed as vLLM's backend views them, and every (token, head, dimension) of K and V must land
where the layout (`layout.cpu_memory(isa)`) and the remap plan (`remap.plan_pull`, through its unit test's
`_elements`) put it. Each element is written four times (its token in two parts, its head, its dimension: each
exact in bfloat16) so that every element of the cache names its source.

The ISAs are those this CPU runs: "vec" and "vec16" everywhere on x86, "amx" where the CPU has AMX (skipped
elsewhere). vLLM picks "amx" only in bfloat16 with blocks of a multiple of 32; float16 is measured too.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

if os.environ.get("KVBROKER_REQUIRE_VLLM"):
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="vLLM is not installed here (its own venv: tests/vllm/setup_venv.sh)")

import torch  # after the guard: torch comes with vLLM's venv, not the main one

try:  # vLLM >= 0.34 keeps the CPU kernels' wrappers in their own module
    from vllm import _cpu_ops as ops
except ImportError:
    from vllm import _custom_ops as ops
if not hasattr(torch.ops._C, "cpu_attn_reshape_and_cache"):
    pytest.skip("vLLM's CPU kernels are not in this build (vLLM's GPU wheel: see docs/vllm.md, newer vLLM versions)",
                allow_module_level=True)

from kvbroker.integrations.vllm.layout import MEMORY_CPU, MEMORY_CPU_AMX, KvLayout, cpu_memory
from tests.unit.test_vllm_remap_runs import _elements

HEADS, BLOCKS = 2, 3


def _written(isa: str, dtype: torch.dtype, block: int, head_size: int) -> np.ndarray:
    """[token, head, dim, K|V] -> element offset in the cache, as the kernel wrote it."""
    num_tokens = block * BLOCKS
    tokens, heads, dims = torch.meshgrid(torch.arange(num_tokens), torch.arange(HEADS), torch.arange(head_size),
                                         indexing="ij")
    seen = []
    # Each coordinate + 1 (0 marks what the kernel left alone), K positive and V negative; each exact in bfloat16.
    for grid in (tokens // 128, tokens % 128, heads, dims):
        kv = torch.zeros(BLOCKS, HEADS, block, 2 * head_size, dtype=dtype)
        key_cache, value_cache = kv.view(BLOCKS, HEADS, 2 * block, head_size).chunk(2, dim=2)  # as cpu_attn.py
        value = (grid + 1).to(dtype).contiguous()
        ops.cpu_attn_reshape_and_cache(value, -value, key_cache, value_cache,
                                       torch.arange(num_tokens, dtype=torch.int64), isa)
        seen.append(kv.flatten().to(torch.float32).numpy())
    high, low, head, dim = (np.abs(s).astype(np.int64) - 1 for s in seen)
    assert (seen[0] != 0).all(), "the kernel left elements unwritten"
    where = np.full((num_tokens, HEADS, head_size, 2), -1, dtype=np.int64)
    where[high * 128 + low, head, dim, (seen[0] < 0).astype(np.int64)] = np.arange(high.size)
    return where


def _claimed(memory: str, block: int, head_size: int) -> np.ndarray:
    layout = KvLayout(1, BLOCKS, block, HEADS, head_size, "bfloat16", HEADS * 2 * block * head_size * 2, "m", 1,
                      memory=memory, token_units=True)
    where = np.empty((block * BLOCKS, HEADS, head_size, 2), dtype=np.int64)
    tokens = np.arange(block * BLOCKS)
    for head in range(HEADS):
        elements = _elements(layout, tokens // block, head, tokens % block).reshape(2, -1, head_size)
        where[:, head, :, 0], where[:, head, :, 1] = elements[0], elements[1]
    return where


CASES = [(isa, dtype, block, head_size) for isa in ("vec", "vec16") for dtype in (torch.float32, torch.bfloat16)
         for block, head_size in ((16, 64), (32, 64), (64, 32), (32, 80))]
CASES += [("amx", dtype, block, head_size) for dtype in (torch.bfloat16, torch.float16)
          for block, head_size in ((32, 64), (64, 32), (64, 128), (128, 64))]


@pytest.mark.parametrize(("isa", "dtype", "block", "head_size"), CASES)
def test_the_layout_the_tag_names_is_where_vllms_kernel_writes(isa: str, dtype: torch.dtype, block: int,
                                                                head_size: int) -> None:
    if isa == "amx" and not torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has no AMX")
    if isa == "amx":
        torch.cpu._init_amx()  # the kernel uses the tiles without asking Linux for them (connector.allow_amx)
    memory = cpu_memory(isa)
    assert memory == (MEMORY_CPU_AMX if isa == "amx" else MEMORY_CPU)
    np.testing.assert_array_equal(_written(isa, dtype, block, head_size), _claimed(memory, block, head_size))


def test_the_vec_and_amx_layouts_differ_so_their_tags_must() -> None:
    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has no AMX")
    torch.cpu._init_amx()
    assert not np.array_equal(_written("vec", torch.bfloat16, 32, 64), _written("amx", torch.bfloat16, 32, 64))
