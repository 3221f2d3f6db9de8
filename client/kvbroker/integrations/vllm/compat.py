"""What differs between the vLLM versions the connector supports (0.32, 0.33, 0.34), kept in one place.

The connector is written against 0.32's KV connector API. Read from the three versions' sources, the differences
that reach it are:

- 0.33 added `KVConnectorBase_V1.supports_sleep_mode` (default True) and the `unregister_kv_caches` /
  `restore_kv_caches` hooks around sleep. The daemon serves the KV memory of a CPU engine, and on a GPU engine holds
  a CUDA IPC import of it or copies of its blocks: neither follows the remap of sleep, so the connector says no
  (`SLEEP_MODE`) and vLLM refuses `--enable-sleep-mode` at start-up instead of moving stale bytes.
- 0.34 added `KVConnectorBase_V1.kv_cache_access` (`vllm.config.kv_transfer.KVCacheAccess`) and, on CUDA, the
  extensible KV cache (CUDA VMM memory committed as it grows), on by default for connectors that keep to the default
  `IN_PROCESS`. Device-direct exports vLLM's allocation through legacy CUDA IPC, which cannot export VMM memory:
  `kv_cache_access` says `LEGACY_IPC` there, which keeps vLLM on its plain allocation. Host-staged only copies with
  torch ops in the worker (`IN_PROCESS`). The extensible KV cache also refuses a connector's own allocation context:
  `get_mem_pool_context` must be None on a GPU engine (it only ever served CPU engines).
- 0.34 added `may_load_async` and `supports_lookahead_block_hashes`; their defaults fit (the first reads the
  `do_remote_prefill` flag the connector's requests carry; lookahead hashing stays off).
- 0.34's `MambaSpec.state_alignment` pads each state tensor to a multiple of it within a page: layout.py refuses a
  state padded that way (Mamba state moves on CPU engines only, where it is 1).
- 0.33's OpenAI streams put `kv_transfer_params` on the chunk that carries the finish reason (0.32's carried none);
  `streams.py` still sends its own event before `[DONE]`, so the last event means the same on every version.

Unchanged and relied on: the connector's constructor and hook signatures, `KVConnectorFactory`'s
`kv_connector_module_path` loading, the KV cache spec/group/config fields read by layout.py, `KVCacheLayout` and
`create_kv_cache_views` (the views of cuda_layout.py), `_get_attn_isa`, the `Request` and `SchedulerOutput` fields read
by scheduler.py, and the `kv_transfer_params` flow. tests/vllm/test_vllm_compat.py checks these against whichever vLLM
is installed. Nothing here imports vLLM at module level: the unit tests run without it.
"""

from __future__ import annotations

from typing import Any

SUPPORTED_VERSIONS = ("0.32", "0.33", "0.34")

SLEEP_MODE = False
"""`supports_sleep_mode` (vLLM >= 0.33): the daemon's view of the KV memory cannot follow sleep's remap."""

DEVICE_DIRECT_BUFFER = "cuda"
"""The `kv_buffer_device` of device-direct mode (gpu.MODES): the daemon imports vLLM's allocation by CUDA IPC."""


def kv_cache_access(kv_buffer_device: str) -> Any:
    """`KVConnectorBase_V1.kv_cache_access` (vLLM >= 0.34) for a connector configured with `kv_buffer_device`:
    `LEGACY_IPC` for device-direct (the daemon imports the allocation through cudaIpcGetMemHandle, which cannot name
    VMM memory, so vLLM must not put the KV cache in its extensible VMM allocation), else `IN_PROCESS`."""
    from vllm.config.kv_transfer import KVCacheAccess

    return KVCacheAccess.LEGACY_IPC if kv_buffer_device == DEVICE_DIRECT_BUFFER else KVCacheAccess.IN_PROCESS


def state_alignment(spec: Any) -> int:
    """A Mamba spec's `state_alignment` (vLLM >= 0.34: each state tensor starts on a multiple of it in the page, set
    for FlashInfer's kernels on GPUs); 1 where vLLM has none."""
    return int(getattr(spec, "state_alignment", 1) or 1)


def conv_state_layout() -> str:
    """How vLLM lays a Mamba conv state out: "SD" ((conv_len, channels): its default) or "DS" (channels first:
    `VLLM_SSM_CONV_STATE_LAYOUT=DS`, which it sets for NixlConnector)."""
    try:
        from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout
    except ImportError:  # (a unit test without vLLM; or a vLLM whose conv state has one layout: SD)
        return "SD"
    return str(get_conv_state_layout())
