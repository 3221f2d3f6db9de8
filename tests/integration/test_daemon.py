"""The daemon as an operator runs it: health, reflection, config errors, SIGTERM, and the demo command."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvbroker import CacheDesc
from kvbroker._local import DaemonStartError, LocalDaemon


def _services(target: str) -> set[str]:
    with grpc.insecure_channel(target) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        return {s.name for r in responses for s in r.list_services_response.service}


def _health(target: str, service: str = "") -> int:
    with grpc.insecure_channel(target) as ch:
        return int(health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                       timeout=5).status)


def test_health_and_reflection_on_both_listeners(tmp_path: Path) -> None:
    with LocalDaemon(tmp_path, 1) as d:
        for target, service in ((d.target, "kvbroker.v1.KvBroker"), (d.peer_address, "kvbroker.v1.Peer")):
            assert _health(target) == health_pb2.HealthCheckResponse.SERVING
            assert _health(target, service) == health_pb2.HealthCheckResponse.SERVING
            assert {service, "grpc.health.v1.Health"} <= _services(target)


def test_the_local_api_is_not_served_on_the_peer_port(tmp_path: Path) -> None:
    """The peer port faces the network; allocating or pulling through it would bypass the 0600 unix socket."""
    from kvbroker.v1 import broker_pb2, broker_pb2_grpc

    with LocalDaemon(tmp_path, 1) as d, grpc.insecure_channel(d.peer_address) as ch:
        assert "kvbroker.v1.KvBroker" not in _services(d.peer_address)
        with pytest.raises(grpc.RpcError) as info:
            broker_pb2_grpc.KvBrokerStub(ch).ListCaches(broker_pb2.ListCachesRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_sigterm_exits_zero_and_cleans_up(tmp_path: Path) -> None:
    d = LocalDaemon(tmp_path, 1).start()
    with d.client() as c:
        cache = c.allocate_cache(CacheDesc(num_tensors=1, shape=(4, 4)))
        segment = Path(cache.record.shm_dir) / cache.record.tensors[0].segment
    assert segment.exists()
    d.signal(signal.SIGTERM)
    assert d.proc is not None and d.proc.wait(timeout=15) == 0
    assert not segment.exists()
    assert not d.socket_path.exists()
    assert "stopped" in d.log_tail()


def test_invalid_configuration_names_the_field(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "kvbrokerd", "--cluster-id", "1", "--backends", "shm,rdma"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert "backends" in out.stderr and "rdma" in out.stderr


def test_print_config(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "kvbrokerd", "--print-config"], capture_output=True, text=True,
                         timeout=30, env={"KVBROKER_CLUSTER_ID": "42", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert "cluster_id = 42" in out.stdout


def test_demo_command_moves_verified_blocks_and_leaves_nothing_behind() -> None:
    # The demo's daemons get a shared-memory directory and a temp directory of their own, so that only what this
    # test made is looked at: other kvbroker processes on the machine come and go in /dev/shm as they please.
    shm_dir = Path(tempfile.mkdtemp(prefix="kvtest-demo-", dir="/dev/shm"))
    work_dir = Path(tempfile.mkdtemp(prefix="kvt-"))  # short: unix socket paths are limited to 107 bytes
    try:
        out = subprocess.run([sys.executable, "-m", "kvbroker._cli", "demo", "--layers", "4", "--blocks", "64"],
                             capture_output=True, text=True, timeout=120,
                             env={**os.environ, "KVBROKER_SHM_DIR": str(shm_dir), "TMPDIR": str(work_dir)})
        assert out.returncode == 0, out.stderr + out.stdout
        assert "verified every byte" in out.stdout and "GB/s" in out.stdout
        assert list(shm_dir.iterdir()) == [] and list(work_dir.iterdir()) == []
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
        shutil.rmtree(work_dir, ignore_errors=True)


def _refused_start(d: LocalDaemon) -> list[str]:
    """Starts `d`, which must refuse to start: exit 2 and one line of output that says why, no traceback."""
    with pytest.raises(DaemonStartError):
        d.start()
    assert d.proc is not None and d.proc.returncode == 2, d.log_tail()
    lines = [line for line in d.log_path.read_text().splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines


def test_a_second_daemon_never_takes_a_live_socket(tmp_path: Path) -> None:
    with LocalDaemon(tmp_path, 1) as first:
        [line] = _refused_start(LocalDaemon(tmp_path, 2, local_listen=first.target))
        assert line == (f"kvbrokerd: cannot listen on {first.target}: another daemon answers there (stop it first, or "
                        "give another --listen)")
        assert first.socket_path.is_socket()
        with first.client() as c:
            assert c.get_cluster_info().cluster_id == 1  # still reachable
        assert "Traceback" not in first.log_tail() and "ERROR" not in first.log_tail()


def test_a_stale_socket_is_replaced(tmp_path: Path) -> None:
    d = LocalDaemon(tmp_path, 3)
    with socket.socket(socket.AF_UNIX) as dead:  # what a SIGKILLed daemon leaves: a socket file, no listener
        dead.bind(str(d.socket_path))
    assert d.socket_path.is_socket()
    with d, d.client() as c:
        assert c.get_cluster_info().cluster_id == 3


@pytest.mark.parametrize("which", ["peer API", "local API", "metrics", "tcp data plane"])
def test_a_port_in_use_is_one_line_naming_it(tmp_path: Path, which: str) -> None:
    with socket.create_server(("127.0.0.1", 0)) as holder:
        taken = f"127.0.0.1:{holder.getsockname()[1]}"
        extra = {"peer API": ["--peer-listen", taken], "metrics": ["--metrics-listen", taken],
                 "tcp data plane": ["--data-port", taken.rpartition(":")[2]], "local API": []}[which]
        d = LocalDaemon(tmp_path, 4, extra_args=extra, local_listen=taken if which == "local API" else "")
        [line] = _refused_start(d)
    assert line == f"kvbrokerd: cannot listen on {taken} ({which}): the address is in use by another process"
