"""LinkClusters dials only HOST:PORT (issue 30, finding 9): a unix: or unix-abstract: address made the daemon connect to
another local service's socket and send it an HTTP/2 preface; now it is LLM_PARAM_INVALID before any connection."""

from __future__ import annotations

import os
import select
import socket
from pathlib import Path

from kvbroker import ClusterInfo, LlmStatus
from kvbroker._local import LocalDaemon


def test_unix_peer_addresses_are_refused_before_any_connection(tmp_path: Path) -> None:
    path = str(tmp_path / "other-service.sock")
    abstract = f"kvbroker-test-{os.getpid()}-{os.urandom(4).hex()}"
    listeners = [socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX)]
    try:
        listeners[0].bind(path)
        listeners[1].bind("\0" + abstract)
        for s in listeners:
            s.listen(8)
        addresses = [f"unix:{path}", f"unix://{path}", f"unix-abstract:{abstract}", f"unix-abstract:///{abstract}",
                     "unix:7100", "dns:///127.0.0.1:7100", "ipv4:127.0.0.1:7100", ":7100", "127.0.0.1", "127.0.0.1:0"]
        with LocalDaemon(tmp_path, 1) as d, d.client() as c:
            results = c.link_clusters([ClusterInfo(10 + i, a) for i, a in enumerate(addresses)], timeout=2.0)
            assert [r.status for r in results] == [LlmStatus.LLM_PARAM_INVALID] * len(addresses), results
            assert all("remote_address" in r.message for r in results)
            assert c.list_links() == []
        readable, _, _ = select.select(listeners, [], [], 0)
        assert readable == [], "the daemon connected to a unix socket"
    finally:
        for s in listeners:
            s.close()
