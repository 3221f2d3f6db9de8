"""vLLM KV connector: disaggregated prefill/decode through the node's kvbrokerd sidecars.

    KVTransferConfig(kv_connector="KvBrokerConnector", kv_connector_module_path="kvbroker.integrations.vllm",
                     kv_role="kv_both", kv_load_failure_policy="recompute",
                     kv_connector_extra_config={"kvbroker_target": "unix:///run/kvbroker/kvbroker.sock",
                                                # decode engines: the prefill daemons they pull from
                                                "kvbroker_prefill_daemons": "1=10.0.0.1:7100"})

OpenAI server (`python -m vllm.entrypoints.openai.api_server ...`):

    --kv-transfer-config '{"kv_connector": "KvBrokerConnector",
                           "kv_connector_module_path": "kvbroker.integrations.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"kvbroker_target": "unix:///run/kvbroker/kvbroker.sock",
                                                         "kvbroker_prefill_daemons": "1=10.0.0.1:7100"}}'

For vLLM 0.32-0.34 (its connector API is experimental; `compat` says what differs). The request protocol is
NixlConnector's: send the prefill request with `kv_transfer_params={"do_remote_decode": True}` (and usually
`max_tokens=1`), then send the decode request with the prefill output's `kv_transfer_params`, unchanged (offline:
`SamplingParams(extra_args={"kv_transfer_params": ...})`; OpenAI API: the body's `kv_transfer_params`).
`kvbroker.integrations.vllm.params` shows every key; this is kvbroker request protocol 2 (`kvbroker_protocol`): the
params carry a grant and the prefill daemon's cluster id, no cache ids, block ids to pull or addresses, since they
come back through the HTTP client and nothing in them is trusted.

What it does:
- The engine's paged KV buffer is allocated by the daemon (shared memory owned by the engine's lease: freed when the
  engine exits, or `kvbroker_lease_ttl_s` after it dies) and used by vLLM in place; transfers never copy through the
  engine. One kvbroker cache per TP rank, one tensor per layer.
- GPU engines (not yet run on a GPU; docs/vllm.md): vLLM keeps its KV buffer in VRAM; with vLLM's `kv_buffer_device`
  "cuda" (its default there) the daemon serves it in place through CUDA IPC (`--backends nixl`), with "cpu" through a
  daemon host buffer the connector stages to and from (any backend). The layout is read from vLLM's KV views
  (`cuda_layout`); what cannot be served is refused at start-up.
- The decode engine links its daemon to a prefill node's daemon on first use (then reuses the link) and pulls
  asynchronously: it keeps serving other requests while a pull runs. It dials only the daemons of its
  `kvbroker_prefill_daemons` setting: a request naming any other cluster is computed locally, and no address is ever
  taken from a request; a healthy link is never torn down because of one.
- A failed or partial pull reports the blocks that did not land; with `kv_load_failure_policy="recompute"` vLLM
  recomputes them (with vLLM's default, "fail", the request fails): never wrong tokens.
- The prefill engine keeps a finished request's blocks while their grant lives: its daemon grants them when the
  request finishes (an unguessable id and secret, for these blocks only), the decode engine renews the grant from the
  moment the request arrives (however long it queues), pulls by it (the prefill daemon names the cache and blocks)
  and releases it after its pull; else it lapses `kvbroker_hold_lease_s` after the last renewal, and renewals never
  keep it past `kvbroker_release_timeout_s`. The grant's end comes from the prefill engine's own daemon.
- CPU engines may differ in TP size (either way, where one divides the other; GQA replicas and MLA included) and in
  block size (one dividing the other), with default settings: each engine serves its KV in head units and, through
  a view of the same memory, in token units, and each request settles from the two layout tags which it pulls
  (head units between equal block sizes, as always; token units otherwise). Each decode rank pulls its heads'
  tokens from the prefill ranks holding them (one pull by the request's grant per prefill rank, naming units the
  grant covers), as runs the daemon moves in place (`remap.py`). What
  changes the meaning of the bytes (model, dtype, memory layout, head size, layers, KV heads) must match: otherwise
  the KV is refused before any byte moves, with a log line naming the field, counted in the stats
  (`num_refused`, `refused_<field>`), and the decode engine computes the prompt itself. GPU engines of one shape
  pull rank to rank, block to block; host-staged ones of different TP or block sizes, in units read from vLLM's KV
  views, served as a daemon view of the host buffer (`cuda_remap.py`; device-direct engines and LHBNC pages other
  than MLA's move between equal shapes only).
- Metrics: the decode output's `kv_transfer_params` (the OpenAI response's, too) report where the prompt's KV came
  from: `kvbroker_prompt_tokens`, `kvbroker_tokens_pulled` (from the prefill side), `kvbroker_tokens_cached` (the
  local prefix cache), `kvbroker_tokens_recomputed`, `kvbroker_refused` (why, when refused), and for a pull
  `kvbroker_transfer_ms`, `kvbroker_transfer_bytes`, `kvbroker_backend`; vLLM's KV connector stats ("KV Transfer
  metrics" log line) sum pulls, failures, refusals (by field), bytes and transfer times per interval, and
  recomputes and expired holds by reason; vLLM's `/metrics` has them as `vllm:kvbroker_*` series (`prom.py`);
  `kvbroker_log_transfers` adds an INFO line per pull ("kvbroker pull: request R, N blocks, B bytes in T ms over
  BACKEND (X GB/s)").
- Loads are asynchronous (vLLM schedules a request once its whole pull has landed), so layer-by-layer loading would
  overlap nothing: the decode step after a pull computes one token. The pull itself runs as one transfer.

Settings (`kv_connector_extra_config`; all optional):
    kvbroker_target             local API of this node's kvbrokerd (default $KVBROKER_TARGET, else
                                unix:///run/kvbroker/kvbroker.sock)
    kvbroker_peer_address       address decode nodes dial for this node's daemon (default: the daemon's own)
    kvbroker_pull_timeout_s     deadline of one request's pull (default 30)
    kvbroker_link_timeout_s     deadline of linking to a prefill node's daemon (default 5)
    kvbroker_prefill_daemons    decode: the prefill daemons it pulls from, "CLUSTER_ID=HOST:PORT" comma-separated
                                (IPv6: "7=[::1]:7100"); default none: every request is computed locally
    kvbroker_hold_lease_s       prefill: a finished request's grant lapses this long after its last renewal
                                (default 30; at most kvbroker_release_timeout_s)
    kvbroker_release_timeout_s  prefill: the most renewals can keep a request's blocks held (the grant's cap;
                                default 600)
    kvbroker_lease_ttl_s        how long after an engine dies its KV memory is freed (default 30)
    kvbroker_max_concurrent_pulls  unused (accepted for old configs): a step's pulls go as one message
    kvbroker_model_id           model identity compared between engines (default: hash of the model's config)
    kvbroker_idle_wait_s        on a step with nothing to compute, how long `get_finished` waits for a pull in flight
                                to end, so vLLM learns of it at once instead of spinning (default 0.01; 0: off)
    kvbroker_log_transfers      log every pull at INFO (default false)
    kvbroker_token_units        address the KV cache itself in 16-token units (default false); no longer needed:
                                engines of different block sizes remap through their token views by themselves.
                                Still accepted, and such an engine meets default engines of any block size

Importing `kvbroker` does not import vLLM; this package imports it when `KvBrokerConnector` (or another of the names
below) is first used, so its vLLM-free parts (`config`, `params`, `layout`, `scheduler`, `worker`) load without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvBrokerConnector", "KvBrokerHandshake", "KvBrokerMetadata", "KvBrokerStats"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvbroker.integrations.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
