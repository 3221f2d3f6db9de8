"""Several KV cache groups (vLLM's hybrid allocator: sliding-window and full-attention layers): how the connector
reads their placement, what a prefill engine grants and says, and which tokens of each group a decode engine pulls.
The end-to-end check with real engines is tests/vllm/test_hetero_e2e.py."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbroker._client import Client
from kvbroker.integrations.vllm.config import ConnectorConfig
from kvbroker.integrations.vllm.groups import GroupMismatch, group_parts
from kvbroker.integrations.vllm.layout import KvLayout, UnsupportedLayoutError, layout_from_vllm, layout_of_tag
from kvbroker.integrations.vllm.params import (
    MAX_GROUPS,
    BadTransferParams,
    WorkerEndpoint,
    parse_remote,
    prefill_output_params,
)
from kvbroker.integrations.vllm.remap import refusal
from kvbroker.integrations.vllm.scheduler import SchedulerSide
from kvbroker.types import Grant
from tests.unit.test_vllm_connector import FakeRequest

PAGE = 16384
GRANT = Grant(bytes(range(16)), bytes(range(32)))


@dataclass(frozen=True)
class FullAttentionSpec:
    block_size: int = 32
    num_kv_heads: int = 1
    head_size: int = 64
    dtype: str = "torch.float32"
    page_size_bytes: int = PAGE
    sliding_window: int | None = None


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    sliding_window: int | None = 64


@dataclass(frozen=True)
class UnknownSpec:
    block_size: int = 32
    page_size_bytes: int = PAGE
    dtype: str = "torch.float32"


def _config(specs: list[Any], layers: list[int], num_blocks: int = 100, offset: int = 0) -> Any:
    """vLLM's placement of several groups: each from byte 0, layer i of every group on the same region."""
    size = PAGE * num_blocks * max(layers)
    tensors = [SimpleNamespace(size=size, layers=[f"g{g}.l{i}" for i in range(n)], layer_stride=PAGE * num_blocks,
                               block_stride=PAGE, offset=offset if g else 0) for g, n in enumerate(layers)]
    groups = [SimpleNamespace(kv_cache_spec=spec, layer_names=t.layers) for spec, t in zip(specs, tensors,
                                                                                           strict=True)]
    return SimpleNamespace(kv_cache_groups=groups, kv_cache_tensors=tensors, num_blocks=num_blocks,
                           num_blocks_of=lambda t: num_blocks)


def _layout(groups: str = "swa64:1,full:1", block: int = 32, token_units: bool = True) -> KvLayout:
    return KvLayout(1, 100, block, 1, 64, "float32", block * 2 * 64 * 4, "m1", 1, token_units=token_units,
                    groups=groups)


# -- placement ---------------------------------------------------------------------------------------------------
def test_groups_over_one_buffer_are_one_cache_of_the_largest_groups_layers() -> None:
    layout = layout_from_vllm(_config([SlidingWindowSpec(), FullAttentionSpec(), SlidingWindowSpec()], [2, 2, 1]),
                              "m1", tp_size=1)
    assert (layout.num_layers, layout.groups, layout.windows) == (2, "swa64:2,full:2,swa64:1", (64, None, 64))
    assert layout.desc().num_tensors == 2 and layout.buffer_bytes == PAGE * 100 * 2
    assert "groups=swa64:2,full:2,swa64:1" in layout.tag() and "groups=" in layout.daemon_tag()
    assert layout_of_tag(layout.tag()) == KvLayout(2, 0, 32, 1, 64, "float32", PAGE, "m1", 1,
                                                   total_kv_heads=1, groups=layout.groups, token_view=True)
    # One full-attention group, with or without a window for the kernel (hybrid allocator off), is plain "full".
    assert layout_from_vllm(_config([FullAttentionSpec(sliding_window=64)], [3]), "m1", tp_size=1).groups == "full"


@pytest.mark.parametrize(("config", "on_gpu", "message"), [
    (_config([SlidingWindowSpec(), FullAttentionSpec()], [1, 1]), True, "--disable-hybrid-kv-cache-manager"),
    (_config([FullAttentionSpec(), UnknownSpec()], [1, 1]), False, "UnknownSpec is not a paged attention spec"),
    (_config([FullAttentionSpec(), FullAttentionSpec(head_size=128)], [1, 1]), False, "differ in head_size"),
    (_config([SlidingWindowSpec(), FullAttentionSpec()], [1, 1], offset=PAGE), False, "not layer-outermost"),
    (SimpleNamespace(kv_cache_groups=[], kv_cache_tensors=[], num_blocks=1), False, "no KV cache"),
])
def test_groups_that_cannot_share_one_cache_are_refused_at_start_up(config: Any, on_gpu: bool,
                                                                     message: str) -> None:
    with pytest.raises(UnsupportedLayoutError, match=message):
        layout_from_vllm(config, "m1", tp_size=1, on_gpu=on_gpu)


def test_an_engine_with_the_hybrid_allocator_off_is_refused_by_field_groups() -> None:
    hma_on, hma_off = _layout(), _layout(groups="full")
    found = refusal(hma_off, hma_on.tag())
    assert found is not None and found.field == "groups" and "local full vs remote swa64:1,full:1" in found.message


@pytest.mark.parametrize("groups", ["", "swa", "swa0", "full,", "sliding", "full:0", "full;rm -rf", "full:1" * 3])
def test_a_malformed_groups_field_is_an_unreadable_tag(groups: str) -> None:
    with pytest.raises(ValueError, match="groups"):
        layout_of_tag(_layout().tag().replace("groups=swa64:1,full:1", f"groups={groups}"))


# -- request protocol --------------------------------------------------------------------------------------------
ENDPOINTS = {0: WorkerEndpoint(0, 1, "127.0.0.1:1", 5, _layout().tag())}


def test_one_block_list_per_group_round_trips_and_one_group_stays_flat() -> None:
    params = prefill_output_params(ENDPOINTS, "engine-p", "p-req", [[0, 7, 8], [3, 4, 5]], 90, GRANT)
    assert params["remote_block_ids"] == [[0, 7, 8], [3, 4, 5]]  # as NixlConnector sends a hybrid model's
    assert parse_remote(params).block_ids == ((0, 7, 8), (3, 4, 5))
    flat = prefill_output_params(ENDPOINTS, "engine-p", "p-req", [[3, 4]], 60, GRANT)
    assert flat["remote_block_ids"] == [3, 4] and parse_remote(flat).block_ids == ((3, 4),)


@pytest.mark.parametrize(("ids", "message"), [
    ([[1]] * (MAX_GROUPS + 1), "65 KV cache groups"),
    ([[1] * 40000, [2] * 40000], "80000 blocks; at most 65536"),
    ([[1, 2], 3], "malformed"),
    ([[1, "x"]], "malformed"),
    ("12", "malformed"),
])
def test_group_block_lists_from_the_http_client_are_bounded(ids: Any, message: str) -> None:
    params = {**prefill_output_params(ENDPOINTS, "engine-p", "p-req", [[1]], 10, GRANT), "remote_block_ids": ids}
    with pytest.raises(BadTransferParams, match=message):
        parse_remote(params)


# -- which tokens of each group move -----------------------------------------------------------------------------
def test_a_sliding_window_group_moves_only_its_window_full_attention_everything() -> None:
    ours = theirs = _layout()
    # 200 tokens in blocks of 32: 7 blocks; the window (64) keeps the blocks of tokens 128..199 on both sides.
    local = [[0, 0, 0, 0, 21, 22, 23], [11, 12, 13, 14, 15, 16, 17]]
    remote = [[0, 0, 0, 0, 61, 62, 63], [51, 52, 53, 54, 55, 56, 57]]
    swa, full = group_parts(ours, theirs, local, remote, 0, 200)
    assert (swa.start_token, swa.end_token, swa.local_blocks, swa.remote_blocks) == (128, 200, (21, 22, 23),
                                                                                     (61, 62, 63))
    assert (full.start_token, full.local_blocks, full.remote_blocks) == (0, tuple(local[1]), tuple(remote[1]))


def test_a_window_is_clipped_to_whole_blocks_of_the_larger_size() -> None:
    # Prefill blocks of 32 keep tokens 128.. ; decode blocks of 64 kept 128.. too (the blocks cover 0..255).
    swa, _ = group_parts(_layout(block=64), _layout(block=32), [[0, 0, 31, 32], [1, 2, 3, 4]],
                         [[0, 0, 0, 0, 61, 62, 63], [5, 6, 7, 8, 9, 10, 11]], 0, 200)
    assert (swa.start_token, swa.local_blocks, swa.remote_blocks) == (128, (31, 32), (61, 62, 63))
    # Decode blocks of 32, prefill blocks of 64 (which kept less: its block 1 covers tokens 64..127).
    swa, _ = group_parts(_layout(block=32), _layout(block=64), [[0, 0, 0, 20, 21, 22, 23], list(range(1, 8))],
                         [[0, 0, 41, 42], [5, 6, 7, 8]], 0, 200)
    assert (swa.start_token, swa.local_blocks, swa.remote_blocks) == (128, (21, 22, 23), (41, 42))


@pytest.mark.parametrize(("remote_swa", "message"), [
    ([0, 0, 0, 0, 0, 62, 63], "cover tokens from 160, the request needs them from 137"),
    ([0, 0, 0, 0, 61, 0, 63], "was dropped"),
    ([0, 0, 0, 0, 61], "do not cover"),
])
def test_a_window_the_prefill_side_no_longer_holds_is_refused(remote_swa: list[int], message: str) -> None:
    with pytest.raises(GroupMismatch, match=message):
        group_parts(_layout(), _layout(), [[0, 0, 0, 0, 21, 22, 23], list(range(1, 8))],
                    [remote_swa, list(range(51, 58))], 0, 200)


@given(st.integers(1, 400), st.integers(0, 12), st.sampled_from([32, 64]), st.sampled_from([32, 64]),
       st.integers(1, 300))
def test_every_token_a_window_needs_is_in_its_part(end: int, hit_blocks: int, ours_bs: int, theirs_bs: int,
                                                   window: int) -> None:
    start = min(hit_blocks * ours_bs, (end - 1) // ours_bs * ours_bs)
    groups = f"swa{window},full"
    ours, theirs = _layout(groups, ours_bs), _layout(groups, theirs_bs)

    def blocks(bs: int, base: int) -> list[list[int]]:
        n = -(-end // bs)
        kept = max(0, end - window) // bs  # vLLM drops the blocks wholly before the window
        return [[0] * kept + list(range(base, base + n - kept)), list(range(base + 100, base + 100 + n))]

    swa, full = group_parts(ours, theirs, blocks(ours_bs, 1000), blocks(theirs_bs, 5000), start, end)
    assert (full.start_token, full.end_token) == (start, end)
    assert start <= swa.start_token <= max(start, end - window + 1) and swa.end_token == end
    assert len(swa.local_blocks) == -(-end // ours_bs) - swa.start_token // ours_bs
    assert 0 not in swa.local_blocks and 0 not in swa.remote_blocks


# -- scheduler ---------------------------------------------------------------------------------------------------
def test_prefill_grants_every_groups_kept_blocks_and_decode_pulls_a_part_per_group(tmp_path: Any) -> None:
    from kvbroker import CacheDesc
    from kvbroker._local import LocalDaemon

    tag = _layout().tag()
    granted: list[list[int]] = []

    class Recording(Client):
        def create_grant(self, cache_ids: Any, blocks: Any, *args: Any, **kwargs: Any) -> Grant:
            granted.append(list(blocks))
            return super().create_grant(cache_ids, blocks, *args, **kwargs)

    with LocalDaemon(tmp_path, 1) as daemon, daemon.client() as c:
        # Granted in engine blocks of 256 units (token units: 16 elements of one head's K or V).
        cache = c.allocate_cache(CacheDesc(num_tensors=1, shape=(32 * 256, 4)))
        prefill = SchedulerSide(ConnectorConfig(target=daemon.target, hold_lease_s=60), "engine-p", 32,
                                client=Recording(daemon.target))
        prefill.set_endpoints({0: WorkerEndpoint(0, 1, "127.0.0.1:1", cache.cache_id, tag)})
        req = FakeRequest("p-req", 200, {"do_remote_decode": True}, num_computed_tokens=200)
        delay, params = prefill.request_finished(req, ([0, 0, 0, 0, 21, 22, 23, 24], list(range(1, 9))), True)
        assert delay and params is not None
        assert params["remote_block_ids"] == [[0, 0, 0, 0, 21, 22, 23], [1, 2, 3, 4, 5, 6, 7]]
        assert granted == [[21, 22, 23, 1, 2, 3, 4, 5, 6, 7]]  # no null block, each block once
        # Block lists for another number of groups than the engine has: nothing granted, nothing held.
        other = FakeRequest("p-2", 200, {"do_remote_decode": True}, num_computed_tokens=200)
        assert prefill.request_finished(other, ([1, 2, 3, 4, 5, 6, 7],), True) == (False, None)
        assert len(granted) == 1 and list(prefill.take_plan().holds) == ["p-req"]
        assert 50 < c.renew_grant(Grant.from_token(params["kvbroker_grant"])) <= 60
        prefill.shutdown()

    decode = SchedulerSide(ConnectorConfig(target="unix:///nonexistent.sock", prefill_daemons="1=127.0.0.1:1"),
                           "engine-d", 32)
    decode.set_endpoints({0: WorkerEndpoint(0, 2, "127.0.0.1:2", 9, tag)})
    decode.grants._stop = True
    dreq = FakeRequest("d-req", 200, params)
    assert decode.num_new_matched_tokens(dreq, 0) == (200, True)
    groups = ([0, 0, 0, 0, 71, 72, 73], [81, 82, 83, 84, 85, 86, 87])
    decode.after_alloc(dreq, groups[0], groups[0], 200, groups=groups)
    (pull,) = decode.take_plan().pulls
    assert pull.refused == "" and (pull.start_token, pull.end_token) == (0, 200)
    assert [(p.start_token, p.local_blocks, p.remote_blocks) for p in pull.parts] == [
        (128, (71, 72, 73), (21, 22, 23)), (0, tuple(groups[1]), (1, 2, 3, 4, 5, 6, 7))]
    assert set(pull.local_blocks) == {71, 72, 73, *groups[1]}
    # Lists that do not line up: refused (recomputed), never a partial pull.
    bad = FakeRequest("d-2", 200, {**params, "do_remote_prefill": True,
                                   "remote_block_ids": [[0] * 7, list(range(1, 8))]})
    decode.num_new_matched_tokens(bad, 0)
    decode.after_alloc(bad, groups[0], groups[0], 200, groups=groups)
    (pull,) = decode.take_plan().pulls
    assert "block lists do not line up: group 0" in pull.refused and not pull.parts
