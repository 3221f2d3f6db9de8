"""The request protocol: what a prefill node returns in a request's `kv_transfer_params` and what a decode node reads
from them. Key names are NixlConnector's where the meaning is the same, so P/D proxies written for it work unchanged;
kvbroker's own addressing is under `kvbroker_*` keys.

Prefill request in:  {"do_remote_decode": True}
Prefill output out:  {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [...],
                      "remote_engine_id": ..., "remote_request_id": ..., "remote_host": ..., "remote_port": ...,
                      "remote_num_tokens": ..., "tp_size": ..., "kvbroker_protocol": 1, "kvbroker_cluster_id": ...,
                      "kvbroker_peer_address": "host:port", "kvbroker_cache_ids": [one per TP rank],
                      "kvbroker_layout_tag": "...", "kvbroker_hold_expires_unix": ...}
Decode request in:   the prefill output's params, unchanged.
Decode output out:   {"kvbroker_prompt_tokens": ..., "kvbroker_tokens_pulled": ..., "kvbroker_tokens_cached": ...,
                      "kvbroker_tokens_recomputed": ..., ["kvbroker_refused": "field: local .. vs remote .."]}, and
                     {"kvbroker_transfer_ms": ..., "kvbroker_transfer_bytes": ..., "kvbroker_backend": "shm"|"tcp"}
                     when the request's KV was pulled.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

PROTOCOL_VERSION = 1
MAX_TOPIC_BYTES = 128


class BadTransferParams(ValueError):
    """kv_transfer_params that claim a remote prefill but cannot be used (missing or malformed fields)."""


@dataclass(frozen=True, slots=True)
class WorkerEndpoint:
    """What one worker (TP rank) tells its scheduler about its KV cache, once, at start-up."""

    rank: int
    cluster_id: int
    peer_address: str
    cache_id: int
    layout_tag: str


@dataclass(frozen=True, slots=True)
class RemoteKv:
    """A prefill node's KV of one request, as its decode node sees it."""

    cluster_id: int
    peer_address: str
    cache_ids: tuple[int, ...]
    """One per tensor-parallel rank of the prefill engine."""
    block_ids: tuple[int, ...]
    request_id: str
    engine_id: str
    layout_tag: str
    num_tokens: int
    hold_expires_unix: float = 0.0
    """When the prefill node frees the blocks if nobody releases them first (0: unknown)."""


@dataclass(frozen=True, slots=True)
class PullSpec:
    """One request's pull, from the scheduler to its workers: `remote_blocks[i]` lands in `local_blocks[i]`."""

    request_id: str
    local_blocks: tuple[int, ...]
    remote_blocks: tuple[int, ...]
    remote: RemoteKv
    refused: str = ""
    """Why the scheduler already knows this pull cannot run (then every local block is reported as failed)."""
    start_token: int = 0
    end_token: int = 0
    """The prompt tokens [start_token, end_token) the pull covers: `local_blocks` hold them from our block
    start_token // block_size on, `remote_blocks` from the prefill engine's (block sizes may differ). 0, 0: whole
    blocks, `remote_blocks[i]` into `local_blocks[i]`."""


@dataclass(frozen=True, slots=True)
class ReleaseSpec:
    """Tell a prefill node that this decode node will not read a request's blocks (aborted, computed locally)."""

    request_id: str
    remote: RemoteKv
    reason: str


def prefill_output_params(endpoints: Mapping[int, WorkerEndpoint], engine_id: str, request_id: str,
                          block_ids: Sequence[int], num_tokens: int, hold_expires_unix: float) -> dict[str, Any]:
    first = endpoints[min(endpoints)]
    host, _, port = first.peer_address.rpartition(":")
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [int(b) for b in block_ids],
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": int(port) if port.isdigit() else 0,
        "remote_num_tokens": int(num_tokens),
        "tp_size": len(endpoints),
        "kvbroker_protocol": PROTOCOL_VERSION,
        "kvbroker_cluster_id": first.cluster_id,
        "kvbroker_peer_address": first.peer_address,
        "kvbroker_cache_ids": [endpoints[r].cache_id for r in sorted(endpoints)],
        "kvbroker_layout_tag": first.layout_tag,
        "kvbroker_hold_expires_unix": round(hold_expires_unix, 3),
    }


def wants_remote_prefill(params: Mapping[str, Any] | None) -> bool:
    return params is not None and bool(params.get("do_remote_prefill"))


def parse_remote(params: Mapping[str, Any]) -> RemoteKv:
    """The prefill node's addressing from a decode request's params; BadTransferParams if it cannot be used."""
    if params.get("kvbroker_protocol") != PROTOCOL_VERSION:
        raise BadTransferParams(
            f"kv_transfer_params come from kvbroker protocol {params.get('kvbroker_protocol')!r}, this connector "
            f"speaks {PROTOCOL_VERSION} (is the prefill engine running KvBrokerConnector?)")
    try:
        remote = RemoteKv(
            cluster_id=_int(params["kvbroker_cluster_id"]),
            peer_address=str(params["kvbroker_peer_address"]),
            cache_ids=tuple(_int(c) for c in params["kvbroker_cache_ids"]),
            block_ids=tuple(_int(b) for b in params["remote_block_ids"]),
            request_id=str(params["remote_request_id"]),
            engine_id=str(params["remote_engine_id"]),
            layout_tag=str(params["kvbroker_layout_tag"]),
            num_tokens=_int(params.get("remote_num_tokens", 0)),
            hold_expires_unix=float(params.get("kvbroker_hold_expires_unix", 0.0)),
        )
    except KeyError as e:
        raise BadTransferParams(f"kv_transfer_params lack {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise BadTransferParams(f"malformed kv_transfer_params: {e}") from None
    if not remote.cache_ids:
        raise BadTransferParams("kv_transfer_params name no kvbroker cache")
    if len(release_topic(remote.engine_id, len(remote.cache_ids))) > MAX_TOPIC_BYTES:
        raise BadTransferParams(f"remote_engine_id is too long ({len(remote.engine_id)} characters)")
    return remote


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"expected an integer, got {value!r}")
    out = int(value)
    if out < 0:
        raise ValueError(f"expected a non-negative integer, got {out}")
    return out


def release_topic(engine_id: str, rank: int) -> str:
    """Notification topic on which a prefill engine's rank `rank` hears that decode nodes are done with blocks."""
    return f"kvbroker.vllm/{engine_id}/{rank}/release"


def release_payload(request_id: str, outcome: str, rank: int = 0, of: int = 1) -> bytes:
    """`rank`: the decode rank that is done; `of`: how many decode ranks will say so to this prefill rank (with
    different TP sizes several read one prefill rank, which may free the blocks only once all of them are done)."""
    return json.dumps({"request_id": request_id, "outcome": outcome, "rank": rank, "of": of}).encode()


def parse_release(payload: bytes) -> tuple[str, str]:
    """(request id, outcome) of a release notification; ValueError if it is not one."""
    msg = json.loads(payload)
    if not isinstance(msg, dict) or not isinstance(msg.get("request_id"), str):
        raise ValueError("not a release notification")
    return msg["request_id"], str(msg.get("outcome", ""))


def release_count(payload: bytes) -> tuple[int, int]:
    """(decode rank, decode ranks expected) of a release notification: (0, 1) for senders that do not say."""
    msg = json.loads(payload)
    rank, of = msg.get("rank", 0), msg.get("of", 1)
    if not isinstance(rank, int) or not isinstance(of, int) or not 0 <= rank < 1 << 16 or not 1 <= of <= 1 << 16:
        raise ValueError("malformed release notification")
    return rank, of
