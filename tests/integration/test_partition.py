"""A network partition between two daemons on their own test hosts (network namespaces joined by a veth pair that
this test creates): a transfer across a cut link ends within its deadline, the link turns BROKEN, and it heals
when the network comes back."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbroker import CacheDesc, CacheIndex, ClusterInfo, DataType, LinkState, LlmError, LlmStatus
from kvbroker._local import LocalDaemon
from tests.helpers import wait_until


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


def _netns_available() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    name = f"kvbprobe{uuid.uuid4().hex[:6]}"
    ok = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    if ok:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return ok


pytestmark = pytest.mark.skipif(not _netns_available(), reason="needs root and `ip netns` to make test hosts")


class Hosts:
    """Two test hosts: namespaces a and b, joined by veth, 10.201.x.1/.2 (our own addresses, nothing else's)."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.a, self.b = f"kvba{tag}", f"kvbb{tag}"
        self.va, self.vb = f"va{tag}", f"vb{tag}"
        octet = int(tag[:2], 16)
        self.ip_a, self.ip_b = f"10.201.{octet}.1", f"10.201.{octet}.2"

    def up(self) -> None:
        for ns in (self.a, self.b):
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "link", "add", self.va, "netns", self.a, "type", "veth", "peer", "name", self.vb, "netns", self.b)
        _run("ip", "-n", self.a, "addr", "add", f"{self.ip_a}/24", "dev", self.va)
        _run("ip", "-n", self.b, "addr", "add", f"{self.ip_b}/24", "dev", self.vb)
        self.link(True)

    def link(self, up: bool) -> None:
        state = "up" if up else "down"
        _run("ip", "-n", self.a, "link", "set", self.va, state)
        _run("ip", "-n", self.b, "link", "set", self.vb, state)

    def down(self) -> None:
        for ns in (self.a, self.b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def wrapper(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    h = Hosts()
    try:
        h.up()
        yield h
    finally:
        h.down()


def test_partition_mid_transfer_then_heal(tmp_path: Path, hosts: Hosts) -> None:
    desc = CacheDesc(num_tensors=2, shape=(256, 64 << 10), data_type=DataType.UINT8)  # 32 MiB
    blocks = list(range(256))
    src = LocalDaemon(tmp_path, 1, backends=("tcp",), wrapper=hosts.wrapper(hosts.a),
                      extra_args=["--peer-listen", f"{hosts.ip_a}:7100"])
    dst = LocalDaemon(tmp_path, 2, backends=("tcp",), wrapper=hosts.wrapper(hosts.b),
                      extra_args=["--peer-listen", f"{hosts.ip_b}:7100"])
    with src, dst, src.client() as s, dst.client() as d:  # local APIs: unix sockets, reachable from here
        a, b = s.allocate_cache(desc), d.allocate_cache(desc)
        assert d.link_clusters([ClusterInfo(1, f"{hosts.ip_a}:7100")])[0].ok
        assert d.pull_kv_blocks(CacheIndex(1, a.cache_id), b, blocks, blocks).backend == "tcp"
        hosts.link(False)
        with pytest.raises(LlmError) as cut:
            d.pull_kv_blocks(CacheIndex(1, a.cache_id), b, blocks, blocks, timeout=2.0)
        # Within its deadline: the daemon's own answer (its transfer report lists the blocks); one after the call's
        # 2 s gRPC deadline would have reached the caller as a bare DEADLINE_EXCEEDED, without a report.
        assert cut.value.status in (LlmStatus.LLM_TIMEOUT, LlmStatus.LLM_LINK_FAILED)
        assert cut.value.failed_dst_blocks
        wait_until(lambda: d.list_links()[0].state == LinkState.BROKEN, what="the cut link BROKEN")
        assert d.get_cluster_info().cluster_id == 2  # the daemon itself is fine
        hosts.link(True)
        wait_until(lambda: d.list_links()[0].state == LinkState.READY, what="the healed link READY")
        assert d.pull_kv_blocks(CacheIndex(1, a.cache_id), b, blocks, blocks, timeout=10).bytes_moved == 32 << 20
