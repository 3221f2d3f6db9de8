"""Backend choice: it follows --backends order and what both daemons can do; shm falls back to tcp when the peer's
shared memory cannot be opened (here: the peer runs in its own mount namespace with a private /dev/shm)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kvbroker import CacheDesc, CacheIndex, LlmStatus
from kvbroker._local import LocalDaemon
from tests.conftest import cluster_of
from tests.helpers import fill

PRIVATE_SHM = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
               'mount -t tmpfs -o size=256m tmpfs /dev/shm && exec "$@"', "sh"]


def _can_unshare() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run([*PRIVATE_SHM, "true"], capture_output=True)
    return probe.returncode == 0


def _link_and_pull(src: LocalDaemon, dst: LocalDaemon) -> str:
    desc = CacheDesc(num_tensors=2, shape=(8, 64))
    with src.client() as s, dst.client() as d:
        [result] = d.link_clusters([cluster_of(src)])
        assert result.ok, result
        a, b = s.allocate_cache(desc), d.allocate_cache(desc)
        fill(a, 1)
        pulled = d.pull_kv_blocks(CacheIndex(src.cluster_id, a.cache_id), b, [1, 2, 7], [0, 5, 6])
        for t in range(2):
            assert np.array_equal(b.tensors[t][[0, 5, 6]].view(np.uint8), a.tensors[t][[1, 2, 7]].view(np.uint8))
        [link] = d.list_links()
        assert link.backend == pulled.backend
        return pulled.backend


@pytest.mark.parametrize(("src_backends", "dst_backends", "chosen"), [
    (("shm", "tcp"), ("shm", "tcp"), "shm"),
    (("shm", "tcp"), ("tcp", "shm"), "tcp"),
    (("tcp",), ("shm", "tcp"), "tcp"),
    (("shm",), ("tcp", "shm"), "shm"),
])
def test_choice_follows_backends_order(tmp_path: Path, src_backends: tuple[str, ...], dst_backends: tuple[str, ...],
                                       chosen: str) -> None:
    with LocalDaemon(tmp_path, 1, backends=src_backends) as src, LocalDaemon(tmp_path, 2, backends=dst_backends) as d:
        assert _link_and_pull(src, d) == chosen


def test_no_common_backend_refuses_the_link(tmp_path: Path) -> None:
    with LocalDaemon(tmp_path, 1, backends=("tcp",)) as src, LocalDaemon(tmp_path, 2, backends=("shm",)) as dst:
        with dst.client() as d:
            [result] = d.link_clusters([cluster_of(src)])
        assert result.status == LlmStatus.LLM_LINK_FAILED and "no common backend" in result.message


_FILL_IN_NAMESPACE = """
import sys, numpy as np, kvbroker
with kvbroker.Client(sys.argv[1]) as c:
    cache = c.allocate_cache(kvbroker.CacheDesc(num_tensors=2, shape=(8, 64)))
    for i, t in enumerate(cache.tensors):
        t[...] = np.arange(t.size, dtype=np.float16).reshape(t.shape) + i
    print(cache.cache_id)
"""


@pytest.mark.skipif(not _can_unshare(), reason="needs root and unshare(1) to give a daemon a private /dev/shm")
def test_shm_falls_back_to_tcp_when_peer_memory_is_not_shared(tmp_path: Path) -> None:
    import sys

    with LocalDaemon(tmp_path, 1, wrapper=PRIVATE_SHM) as src, LocalDaemon(tmp_path, 2) as dst, dst.client() as d:
        assert src.proc is not None
        # The source's model server must live in the source's namespace to map its memory.
        out = subprocess.run(["nsenter", "--target", str(src.proc.pid), "--mount", sys.executable, "-c",
                              _FILL_IN_NAMESPACE, src.target], check=True, capture_output=True, text=True)
        src_cache_id = int(out.stdout.strip())
        [result] = d.link_clusters([cluster_of(src)])
        assert result.ok, result
        [link] = d.list_links()
        assert link.backend == "tcp"
        dst_cache = d.allocate_cache(CacheDesc(num_tensors=2, shape=(8, 64)))
        pulled = d.pull_kv_blocks(CacheIndex(1, src_cache_id), dst_cache, [1, 2, 7], [0, 5, 6])
        assert pulled.backend == "tcp"
        for i, t in enumerate(dst_cache.tensors):
            source = np.arange(t.size, dtype=np.float16).reshape(t.shape) + i
            assert np.array_equal(t[[0, 5, 6]], source[[1, 2, 7]])


@pytest.mark.skipif(not _can_unshare(), reason="needs root and unshare(1) to give a daemon a private /dev/shm")
def test_shm_only_daemons_cannot_link_without_shared_memory(tmp_path: Path) -> None:
    with LocalDaemon(tmp_path, 1, backends=("shm",), wrapper=PRIVATE_SHM) as src, \
            LocalDaemon(tmp_path, 2, backends=("shm",)) as dst, dst.client() as d:
        [result] = d.link_clusters([cluster_of(src)])
        assert result.status == LlmStatus.LLM_LINK_FAILED
