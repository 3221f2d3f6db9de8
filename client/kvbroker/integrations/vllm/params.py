"""The request protocol: what a prefill node returns in a request's `kv_transfer_params` and what a decode node reads
from them. Key names are NixlConnector's where the meaning is the same, so P/D proxies written for it work unchanged;
kvbroker's own addressing is under `kvbroker_*` keys.

Prefill request in:  {"do_remote_decode": True, ["kvbroker_traceparent": ..., "kvbroker_tracestate": ...]}
Prefill output out:  {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [...] (one list
                      per KV cache group when the model has several, as NixlConnector sends them),
                      "remote_engine_id": ..., "remote_request_id": ..., "remote_host": ..., "remote_port": ...,
                      "remote_num_tokens": ..., "tp_size": ..., "kvbroker_protocol": 2, "kvbroker_cluster_id": ...,
                      "kvbroker_grant": "<id hex>.<secret hex>", "kvbroker_layout_tag": "..."}
Decode request in:   the prefill output's params, unchanged (the P/D proxy adds the request's trace, as above, and
                     `"kvbroker_keep_turn": true` where the next turn of the conversation may reuse this one's KV).
Decode output out:   {"kvbroker_prompt_tokens": ..., "kvbroker_tokens_pulled": ..., "kvbroker_tokens_cached": ...,
                      "kvbroker_tokens_recomputed": ..., ["kvbroker_refused": "field: local .. vs remote .."]}, and
                     {"kvbroker_transfer_ms": ..., "kvbroker_transfer_bytes": ..., "kvbroker_backend": "shm"|"tcp"}
                     when the request's KV was pulled; with kvbroker_keep_turn, the finished turn's KV (prompt and
                     generated tokens, whole blocks) handed back as NixlConnector's decode node does:
                     {"do_remote_decode": True, "do_remote_prefill": False, "remote_block_ids": ..., the prefill
                      output's other keys, "remote_num_tokens": <tokens in those blocks>,
                      "kvbroker_block_hashes": ["<32 hex>", ...] (one per block, chained over the token ids)}.
Next turn's prefill request in: {"do_remote_decode": True, ...} as the decode output gave them. The prefill engine
                     pulls the leading blocks whose hashes match its own prompt's tokens (none: it computes them),
                     and its output adds {"kvbroker_history_tokens_pulled": ...}, which the decode output repeats.

The params come back through the HTTP client, so nothing in them is trusted: the grant is a capability for this
request's blocks only (the prefill daemon names the cache and blocks when the decode daemon redeems it), and the
cluster id only selects one of the decode node's configured prefill daemons (`kvbroker_prefill_daemons`).
`remote_host` and `remote_port` are informative (NixlConnector's keys); kvbroker never uses them. `remote_block_ids`
only say which of the grant's blocks hold which tokens (for a remap): the prefill daemon refuses any it did not grant.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvbroker.integrations.vllm.layout import parse_tag
from kvbroker.integrations.vllm.stages import NO_SPLIT
from kvbroker.tracecontext import TraceContext
from kvbroker.types import Grant

PROTOCOL_VERSION = 2
"""1: addressing (peer address, cache ids, block ids) from the params; 2: a grant, redeemed with the prefill daemon."""
MAX_TOPIC_BYTES = 128
TRACE_PARAM = "kvbroker_traceparent"
TRACE_STATE_PARAM = "kvbroker_tracestate"
MAX_BLOCK_IDS = 1 << 16
"""A grant covers at most this many blocks, so params naming more come from no prefill engine: refused before they
are read (they arrive through the HTTP client)."""
MAX_GROUPS = 64
NULL_BLOCK = 0
KEEP_TURN_PARAM = "kvbroker_keep_turn"
BLOCK_HASHES_PARAM = "kvbroker_block_hashes"
HISTORY_PULLED_PARAM = "kvbroker_history_tokens_pulled"
_HASH_HEX = re.compile(r"[0-9a-f]{32}")
"""vLLM's placeholder block id: a sliding-window group's blocks that left the window (no KV behind them)."""


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
    view_cache_id: int = 0
    """The cache's token view (same memory, token units), 0 if none: granted with the cache (`CreateGrant`'s
    view_cache_ids) so that a decode engine of another block size can pull from it."""


@dataclass(frozen=True, slots=True)
class RemoteKv:
    """A prefill node's KV of one request, as its decode node sees it."""

    cluster_id: int
    grant: Grant
    """Its blocks, as the prefill daemon granted them (one cache per TP rank, in rank order)."""
    block_ids: tuple[tuple[int, ...], ...]
    """Per KV cache group, as the params say: which granted block holds which tokens (the grant's blocks are what
    may be pulled); NULL_BLOCK where a sliding-window group dropped a block."""
    request_id: str
    engine_id: str
    layout_tag: str
    num_tokens: int
    tp_size: int
    trace: TraceContext | None = None
    """The request's trace (`trace_of`), which the pulls continue."""


def trace_of(params: Mapping[str, Any]) -> TraceContext | None:
    """The trace a request's params carry (`kvbroker_traceparent`, `kvbroker_tracestate`: the P/D proxy puts the
    request's there), or None: absent, malformed or oversized ones are dropped, never an error. Used for nothing but
    linking spans."""
    parent, state = params.get(TRACE_PARAM), params.get(TRACE_STATE_PARAM)
    if not isinstance(parent, str):
        return None
    return TraceContext.parse(parent, state if isinstance(state, str) else None)


@dataclass(frozen=True, slots=True)
class PullPart:
    """The tokens [start_token, end_token) of one KV cache group: `local_blocks` hold them from our block
    start_token // block_size on, `remote_blocks` from the prefill engine's (block sizes may differ)."""

    local_blocks: tuple[int, ...]
    remote_blocks: tuple[int, ...]
    start_token: int
    end_token: int
    state: bool = False
    """A Mamba group: one block each side, its running state after token end_token - 1, moved whole."""


@dataclass(frozen=True, slots=True)
class PullSpec:
    """One request's pull, from the scheduler to its workers: `remote_blocks[i]` lands in `local_blocks[i]`."""

    request_id: str
    local_blocks: tuple[int, ...]
    """Every local block the pull writes (of every group: what a failure reports)."""
    remote_blocks: tuple[int, ...]
    remote: RemoteKv
    first_block: int = 0
    """The grant's blocks from this index on land in `local_blocks` (the ones before are cached locally)."""
    refused: str = ""
    """Why the scheduler already knows this pull cannot run (then every local block is reported as failed)."""
    start_token: int = 0
    end_token: int = 0
    """The prompt tokens [start_token, end_token) the pull covers: `local_blocks` hold them from our block
    start_token // block_size on, `remote_blocks` from the prefill engine's (block sizes may differ). 0, 0: whole
    blocks, `remote_blocks[i]` into `local_blocks[i]`."""
    parts: tuple[PullPart, ...] = ()
    """With several KV cache groups, one part per group (each its own token range: a sliding window's is shorter);
    empty: one part, the fields above."""


def prefill_output_params(endpoints: Mapping[int, WorkerEndpoint], engine_id: str, request_id: str,
                          block_ids: Sequence[Sequence[int]], num_tokens: int, grant: Grant) -> dict[str, Any]:
    """`block_ids`: per KV cache group (a flat list in the params when there is one group)."""
    first = endpoints[min(endpoints)]
    host, _, port = first.peer_address.rpartition(":")
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": ([int(b) for b in block_ids[0]] if len(block_ids) == 1
                             else [[int(b) for b in group] for group in block_ids]),
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": int(port) if port.isdigit() else 0,
        "remote_num_tokens": int(num_tokens),
        # (NixlConnector's field: the TP size; a pipeline-split engine has that many workers per stage.)
        "tp_size": len(endpoints) // _stage_count(first.layout_tag),
        "kvbroker_protocol": PROTOCOL_VERSION,
        "kvbroker_cluster_id": first.cluster_id,
        "kvbroker_grant": grant.token(),
        "kvbroker_layout_tag": first.layout_tag,
    }


MAX_LAYOUT_TAG_CHARS = 16384
"""A layout tag is a few hundred characters (a GPU engine's runs and geometry, a Mamba state's shapes: a few
thousand); one from a request's params is refused past this, before any hook parses it."""


def _stage_count(layout_tag: str) -> int:
    split = parse_tag(layout_tag).get("pp", NO_SPLIT)
    return 1 if split == NO_SPLIT else split.count(",") + 1


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
            grant=Grant.from_token(params["kvbroker_grant"]),
            block_ids=_group_block_ids(params["remote_block_ids"]),
            request_id=str(params["remote_request_id"]),
            engine_id=str(params["remote_engine_id"]),
            layout_tag=str(params["kvbroker_layout_tag"]),
            num_tokens=_int(params.get("remote_num_tokens", 0)),
            tp_size=_int(params.get("tp_size", 1)),
            trace=trace_of(params),
        )
    except KeyError as e:
        raise BadTransferParams(f"kv_transfer_params lack {e.args[0]!r}") from None
    except BadTransferParams:
        raise
    except (TypeError, ValueError) as e:
        raise BadTransferParams(f"malformed kv_transfer_params: {e}") from None
    if not remote.tp_size:
        raise BadTransferParams("kv_transfer_params name no prefill rank (tp_size 0)")
    if len(remote.layout_tag) > MAX_LAYOUT_TAG_CHARS:
        raise BadTransferParams(f"kvbroker_layout_tag is {len(remote.layout_tag)} characters; at most "
                                f"{MAX_LAYOUT_TAG_CHARS}")
    if len(release_topic(remote.engine_id, remote.tp_size)) > MAX_TOPIC_BYTES:
        raise BadTransferParams(f"remote_engine_id is too long ({len(remote.engine_id)} characters)")
    return remote


def _group_block_ids(ids: Any) -> tuple[tuple[int, ...], ...]:
    """A flat list (one KV cache group) or a list of lists (one per group), bounded before it is read."""
    if not isinstance(ids, list | tuple):
        raise ValueError(f"remote_block_ids is not a list: {type(ids).__name__}")
    groups = ids if ids and all(isinstance(g, list | tuple) for g in ids) else [ids]
    if len(groups) > MAX_GROUPS:
        raise BadTransferParams(f"remote_block_ids names {len(groups)} KV cache groups; at most {MAX_GROUPS}")
    total = sum(len(g) for g in groups)
    if total > MAX_BLOCK_IDS:
        raise BadTransferParams(f"remote_block_ids names {total} blocks; at most {MAX_BLOCK_IDS}")
    return tuple(tuple(_int(b) for b in group) for group in groups)


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"expected an integer, got {value!r}")
    out = int(value)
    if out < 0:
        raise ValueError(f"expected a non-negative integer, got {out}")
    return out


def release_topic(engine_id: str, rank: int) -> str:
    """Topic on which a prefill engine's rank `rank` hears from its own daemon that a grant ended (GrantEvent)."""
    return f"kvbroker.vllm/{engine_id}/{rank}/release"


def parse_release(payload: bytes) -> tuple[str, str]:
    """(request id, outcome) of a grant's end (a GrantEvent whose label is the request id); ValueError if not."""
    from google.protobuf.message import DecodeError

    from kvbroker.v1 import broker_pb2

    event = broker_pb2.GrantEvent()
    try:
        event.ParseFromString(payload)
    except DecodeError:
        raise ValueError("not a grant event") from None
    if not event.label or not event.outcome:
        raise ValueError("not a grant event")
    return event.label, event.outcome


def handed_back_turn(params: Mapping[str, Any] | None) -> bool:
    """A prefill request that carries a decode node's finished turn (NixlConnector's shape: do_remote_decode with
    the decode node's blocks), whose KV it may pull instead of computing it."""
    return (params is not None and bool(params.get("do_remote_decode")) and not params.get("do_remote_prefill")
            and "kvbroker_grant" in params)


def turn_output_params(endpoints: Mapping[int, WorkerEndpoint], engine_id: str, request_id: str,
                       block_ids: Sequence[int], tokens: Sequence[int], grant: Grant) -> dict[str, Any]:
    """A decode request's finished turn, `tokens` (whole blocks of one KV cache group) in `block_ids`, for the next
    turn's prefill engine."""
    out = prefill_output_params(endpoints, engine_id, request_id, [block_ids], len(tokens), grant)
    out.update(do_remote_prefill=False, do_remote_decode=True)
    block_size = len(tokens) // len(block_ids)
    out[BLOCK_HASHES_PARAM] = block_hashes(tokens, block_size, len(block_ids))
    return out


def block_hashes(tokens: Sequence[int], block_size: int, count: int) -> list[str]:
    """One hash per whole block of `tokens` (at most `count`), each over the block's token ids and the hash before
    it: equal hashes up to block i mean equal tokens up to its end."""
    out: list[str] = []
    previous = b""
    for i in range(min(count, len(tokens) // block_size)):
        block = struct.pack(f"<{block_size}Q", *tokens[i * block_size: (i + 1) * block_size])
        previous = hashlib.blake2b(previous + block, digest_size=16).digest()
        out.append(previous.hex())
    return out


def matched_tokens(params: Mapping[str, Any], prompt: Sequence[int], block_size: int) -> int:
    """The tokens at the start of `prompt` whose KV the handed-back turn holds: its leading blocks whose hashes are
    those of the prompt's own tokens, at most the prompt less its last token (which the engine always computes).
    BadTransferParams if the hashes are malformed."""
    hashes = params.get(BLOCK_HASHES_PARAM)
    if not isinstance(hashes, list) or len(hashes) > MAX_BLOCK_IDS:
        raise BadTransferParams(f"{BLOCK_HASHES_PARAM} is not a list of at most {MAX_BLOCK_IDS} hashes")
    if not all(isinstance(h, str) and _HASH_HEX.fullmatch(h) for h in hashes):
        raise BadTransferParams(f"{BLOCK_HASHES_PARAM} holds something other than 32 lowercase hex digits")
    if block_size <= 0:
        raise BadTransferParams(f"the remote block size is {block_size}")
    usable = min(len(hashes), (len(prompt) - 1) // block_size)
    matched = 0
    for ours, theirs in zip(block_hashes(prompt, block_size, usable), hashes, strict=False):
        if ours != theirs:
            break
        matched += 1
    return matched * block_size
