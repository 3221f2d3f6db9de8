"""`KvBrokerConnector`: vLLM's KV connector interface (v1; vLLM 0.32-0.34, see compat.py) bound to the scheduler
and worker sides.

vLLM builds one instance with role SCHEDULER (engine core) and one per worker with role WORKER; each delegates to
`SchedulerSide` or `WorkerSide`, which hold the logic and do not depend on vLLM's classes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.request import RequestStatus

from kvbroker.integrations.vllm import compat, gpu, spans, streams
from kvbroker.integrations.vllm import stats as stats_mod
from kvbroker.integrations.vllm.config import ConnectorConfig
from kvbroker.integrations.vllm.layout import UnsupportedLayoutError, in_stage, layout_from_vllm, model_identity
from kvbroker.integrations.vllm.lifecycle import release_at_exit
from kvbroker.integrations.vllm.params import PullSpec, WorkerEndpoint
from kvbroker.integrations.vllm.prom import KvBrokerPromMetrics
from kvbroker.integrations.vllm.scheduler import SchedulerSide
from kvbroker.integrations.vllm.stages import Stages, whole
from kvbroker.integrations.vllm.worker import WorkerSide

_FINISHED_NORMALLY = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


@dataclasses.dataclass
class KvBrokerHandshake(KVConnectorHandshakeMetadata):
    """One worker's kvbroker cache, sent once to the scheduler side."""

    endpoint: WorkerEndpoint


@dataclasses.dataclass
class KvBrokerMetadata(KVConnectorMetadata):
    """One step's work for the workers."""

    pulls: list[PullSpec] = dataclasses.field(default_factory=list)
    holds: dict[str, float] = dataclasses.field(default_factory=dict)
    idle: bool = False
    """The step computes no token: its `get_finished` may wait for a pull to end (`ConnectorConfig.idle_wait_s`)."""


@dataclasses.dataclass
class KvBrokerWorkerMetadata(KVConnectorWorkerMetadata):
    """Pulls the workers finished this step (request id -> time, bytes, backend), for the requests' outputs."""

    transfers: dict[str, stats_mod.RequestTransfer] = dataclasses.field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KvBrokerWorkerMetadata:
        if isinstance(other, KvBrokerWorkerMetadata):
            for req_id, transfer in other.transfers.items():
                mine = self.transfers.get(req_id)
                self.transfers[req_id] = transfer if mine is None else mine.combine(transfer)
        return self


@dataclasses.dataclass
class KvBrokerStats(KVConnectorStats):
    """Pulls, failures, bytes and per-request transfer times of the last interval, summed over workers."""

    data: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.data:
            self.data = stats_mod.empty()

    def reset(self) -> None:
        self.data = stats_mod.empty()

    def aggregate(self, other: KVConnectorStats) -> KvBrokerStats:
        if not other.is_empty():
            self.data = stats_mod.merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return stats_mod.summarize(self.data)

    def is_empty(self) -> bool:
        return stats_mod.is_empty(self.data)


def allow_amx() -> bool:
    """Asks Linux for this process's AMX tiles (arch_prctl ARCH_REQ_XCOMP_PERM) where the CPU has them; True when
    granted. vLLM's CPU attention kernel uses AMX (bfloat16, blocks of a multiple of 32 tokens) without asking: a
    plain engine gets the permission in passing (oneDNN asks on the first large matmul of a prefill), but the first
    model step of a P/D decode engine is a decode over pulled KV, whose small matmuls do not ask, and the engine
    died of SIGILL in `cpu_attention_with_kv_cache`. The permission is the process's, for every thread."""
    return bool(torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx())


def attention_isa(vllm_config: Any, kv_cache_config: Any) -> str:
    """The ISA of the CPU attention kernels this engine will run, chosen as vLLM's CPU attention backend chooses it
    (`_get_attn_isa`: model dtype, block size, head size, KV cache dtype, CPU): it lays out the KV in a block."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    spec = next((g.kv_cache_spec for g in kv_cache_config.kv_cache_groups if hasattr(g.kv_cache_spec, "head_size")),
                None)
    if spec is None:
        return "vec"  # no attention group: layout_from_vllm refuses the model
    return str(_get_attn_isa(vllm_config.model_config.dtype, int(spec.block_size), int(spec.head_size),
                             vllm_config.cache_config.cache_dtype))


class KvBrokerConnector(KVConnectorBase_V1, SupportsHMA):
    """Disaggregated prefill/decode through the node's kvbrokerd (see the package docstring for the settings).

    Declares `SupportsHMA`: vLLM keeps its hybrid allocator on (a sliding-window group keeps only its window's
    blocks) and hands the connector one block list per KV cache group, all of which move."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer_config = vllm_config.kv_transfer_config
        self.config = ConnectorConfig.from_extra_config(transfer_config.kv_connector_extra_config)
        self.engine_id: str = transfer_config.engine_id
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(self.config, self.engine_id, vllm_config.cache_config.block_size)
            self._scheduler.spans = spans.for_engine(self.engine_id, str(vllm_config.model_config.served_model_name))
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            model_id = self.config.model_id or model_identity(vllm_config.model_config.hf_config)
            self._gpu_mode = ""
            on_gpu = vllm_config.device_config.device_type != "cpu"
            if on_gpu:  # validated at start-up: a typo must not fall back to another mode
                self._gpu_mode = gpu.mode_for(transfer_config.kv_buffer_device)
            else:
                allow_amx()
            layout = layout_from_vllm(kv_cache_config, model_id, vllm_config.parallel_config.tensor_parallel_size,
                                      vllm_config.model_config.get_total_num_kv_heads(), self.config.token_units,
                                      on_gpu=on_gpu, cpu_isa="vec" if on_gpu else attention_isa(vllm_config,
                                                                                               kv_cache_config))
            split, stage = _pipeline_split(vllm_config, kv_cache_config, on_gpu)
            layout = in_stage(layout, split, stage)
            tp_size = vllm_config.parallel_config.tensor_parallel_size
            self._worker = WorkerSide(self.config, self.engine_id, get_tensor_model_parallel_rank(), layout,
                                      slot=stage * tp_size + get_tensor_model_parallel_rank())

    @property
    def scheduler_side(self) -> SchedulerSide:
        assert self._scheduler is not None, "called on the worker-side connector"
        return self._scheduler

    @property
    def worker_side(self) -> WorkerSide:
        assert self._worker is not None, "called on the scheduler-side connector"
        return self._worker

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return compat.SLEEP_MODE

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        return compat.kv_cache_access(kv_transfer_config.kv_buffer_device)

    # -- worker side ----------------------------------------------------------------------------------------------
    def get_mem_pool_context(self) -> Any:
        # GPU engines keep vLLM's own allocation (vLLM 0.34's extensible KV cache refuses any context).
        return None if self._gpu_mode else self.worker_side.allocation_context()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if gpu.on_gpu(kv_caches):
            config = self._vllm_config
            self.worker_side.register_gpu(
                kv_caches, self._gpu_mode or gpu.mode_for(config.kv_transfer_config.kv_buffer_device),
                getattr(config.cache_config, "kv_cache_layout", None),
                saves=config.kv_transfer_config.kv_role != "kv_consumer")
        else:
            self.worker_side.register(kv_caches)

    def get_handshake_metadata(self) -> KvBrokerHandshake | None:
        endpoint = self.worker_side.endpoint
        return None if endpoint is None else KvBrokerHandshake(endpoint)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvBrokerMetadata)
        self.worker_side.start(meta.pulls, meta.holds)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: a request is scheduled only once its whole pull has landed

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        # Nothing to save when the daemon serves the KV memory itself (CPU engine, GPU device-direct); host-staged:
        # this layer's new blocks go to the host buffer on a side stream, overlapped with the next layers.
        staged = self.worker_side.gpu
        if isinstance(staged, gpu.HostStaged):
            staged.save_from_metadata(layer_name, attn_metadata, self.worker_side.layout.block_size)

    def wait_for_save(self) -> None:
        if self.worker_side.gpu is not None:
            self.worker_side.gpu.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        meta = self._connector_metadata
        idle = isinstance(meta, KvBrokerMetadata) and meta.idle
        sending, recving = self.worker_side.finished(self.config.idle_wait_s if idle else 0.0)
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.take_load_errors()

    def get_kv_connector_stats(self) -> KvBrokerStats | None:
        # Workers: their pulls and expired holds; the scheduler side: the requests it refused to pull.
        log = self._worker.transfers if self._worker is not None else self.scheduler_side.stats
        data = log.take()
        return None if data is None else KvBrokerStats(data=data)

    def build_connector_worker_meta(self) -> KvBrokerWorkerMetadata | None:
        transfers = self.worker_side.transfers.take_requests()
        return KvBrokerWorkerMetadata(transfers) if transfers else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvBrokerStats:
        return KvBrokerStats(data=data or stats_mod.empty())

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        # vLLM calls this in the front end (the API server), the one process of a server that outlives a SIGTERM:
        # from there the engine's caches go back to the daemon when the server stops (lifecycle.py), and streamed
        # answers get the request's kv_transfer_params (streams.py).
        streams.install()
        transfer_config = getattr(vllm_config, "kv_transfer_config", None)
        if transfer_config is not None and transfer_config.engine_id:
            config = ConnectorConfig.from_extra_config(transfer_config.kv_connector_extra_config)
            release_at_exit(config.target, transfer_config.engine_id)
        return KvBrokerPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # -- scheduler side -------------------------------------------------------------------------------------------
    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
                                             ) -> None:
        # Every worker of every pipeline stage, in the order a grant names their caches: stage-major.
        tp_size = 1 + max((tp for _, tp in metadata), default=0)
        self.set_xfer_handshake_metadata({pp * tp_size + tp: m for (pp, tp), m in metadata.items()})

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        endpoints = {rank: m.endpoint for rank, m in metadata.items() if isinstance(m, KvBrokerHandshake)}
        if endpoints:
            self.scheduler_side.set_endpoints(endpoints)

    def update_connector_output(self, connector_output: Any) -> None:
        self.scheduler_side.on_step_output()  # vLLM calls this at every step that ran the model or moved KV
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, KvBrokerWorkerMetadata):
            self.scheduler_side.on_transfers(meta.transfers)
        if connector_output.finished_recving:
            self.scheduler_side.on_pulls_ended(set(connector_output.finished_recving))
        if connector_output.finished_sending and self.scheduler_side.spans is not None:
            self.scheduler_side.spans.holds_ended(connector_output.finished_sending)

    def on_new_request(self, request: Any) -> None:
        self.scheduler_side.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler_side.num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        groups = blocks.get_block_ids() if blocks.blocks else ([],)
        # vLLM's list of the blocks not from the local prefix cache exists for one group only.
        new_blocks = blocks.get_unhashed_block_ids() if blocks.blocks and len(groups) == 1 else groups[0]
        self.scheduler_side.after_alloc(request, groups[0], new_blocks, num_external_tokens, groups=groups)

    def build_connector_meta(self, scheduler_output: Any) -> KvBrokerMetadata:
        plan = self.scheduler_side.take_plan()
        return KvBrokerMetadata(pulls=plan.pulls, holds=plan.holds,
                                idle=scheduler_output.total_num_scheduled_tokens == 0)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.request_finished(request, block_ids, request.status in _FINISHED_NORMALLY)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        # The pull writes blocks of every group while the engine steps: vLLM must not zero them meanwhile. (A
        # sliding-window group's blocks before its window are left as they are: its kernel never reads them.)
        config = self._kv_cache_config
        return tuple(config.transfer_group_ids) if config is not None else ()


def _pipeline_split(vllm_config: Any, kv_cache_config: Any, on_gpu: bool) -> tuple[Stages, int]:
    """How vLLM split the model's layers into pipeline stages, and this worker's stage; the layers of its KV cache
    must be exactly its stage's, in order (each tensor of the daemon's cache is then one layer)."""
    size = int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1))
    groups = kv_cache_config.kv_cache_groups
    if size == 1:
        return whole(max(1, len(groups[0].layer_names) if groups else 1)), 0
    if len(groups) != 1:
        raise UnsupportedLayoutError(f"pipeline parallelism with {len(groups)} KV cache groups is not supported by "
                                     "KvBrokerConnector (one group of attention KV is)")
    if on_gpu:
        raise UnsupportedLayoutError("pipeline parallelism on GPU engines is not supported by KvBrokerConnector yet "
                                     "(CPU engines move KV between any pipeline splits)")
    from vllm.distributed.parallel_state import get_pp_group
    from vllm.distributed.utils import get_pp_indices
    from vllm.model_executor.models.utils import extract_layer_index

    layers = int(vllm_config.model_config.get_total_num_hidden_layers())
    split = Stages(tuple(get_pp_indices(layers, stage, size)[0] for stage in range(size)), layers)
    stage = int(get_pp_group().rank_in_group)
    held = [extract_layer_index(name) for group in groups for name in group.layer_names]
    if held != list(split.layers_of(stage)):
        raise UnsupportedLayoutError(f"pipeline stage {stage} holds the KV of layers {held[:8]}, not its layers "
                                     f"{split.layers_of(stage)} in order")
    return split, stage
