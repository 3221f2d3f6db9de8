"""Shared fixtures: real kvbrokerd daemons (child processes) on unix sockets and loopback ports chosen by the OS."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from kvbroker import ClusterInfo
from kvbroker._local import LocalDaemon
from kvbrokerd import backends
from tests.helpers import private_shm_dir, remove_dir

# The suite is a gate: it must give the same answer on every run, so hypothesis explores a fixed set of examples.
# `HYPOTHESIS_PROFILE=explore pytest ...` searches new ones (and reports any failure with a reproducible seed).
settings.register_profile("gate", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "gate"))


@pytest.fixture(scope="session")
def daemon_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("daemons")


def _pair(workdir: Path, backends: tuple[str, ...], first_id: int) -> Iterator[tuple[LocalDaemon, LocalDaemon]]:
    src = LocalDaemon(workdir, first_id, backends=backends).start()
    try:
        dst = LocalDaemon(workdir, first_id + 1, backends=backends).start()
        try:
            with dst.client() as c:
                result = c.link_clusters([cluster_of(src)])[0]
                assert result.ok, result
            yield src, dst
        finally:
            assert dst.stop() == 0, dst.log_tail()
    finally:
        assert src.stop() == 0, src.log_tail()


def cluster_of(d: LocalDaemon) -> ClusterInfo:
    return ClusterInfo(remote_cluster_id=d.cluster_id, remote_address=d.peer_address)


def _host_memory_backends() -> list[object]:
    """Every registered backend that moves host memory: the shared backend suite runs over each, and one that
    cannot run here (its engine or device missing) is skipped with the reason."""
    params: list[object] = []
    for name, cls in backends.loadable().items():
        if "host" in cls.capabilities.memory_kinds:
            reason = backends.unavailable(name)
            params.append(pytest.param(name, marks=pytest.mark.skipif(reason is not None, reason=str(reason))))
    return params


PAIR_BACKENDS = {name: 100 * (i + 1) for i, name in enumerate(backends.registered())}
"""Backend of each linked pair -> the cluster id of its source daemon."""


@pytest.fixture(scope="session", params=_host_memory_backends())
def linked_pair(request: pytest.FixtureRequest, daemon_dir: Path) -> Iterator[tuple[LocalDaemon, LocalDaemon]]:
    """(source daemon, destination daemon) linked dst -> src, both allowing only the parametrised backend."""
    first = PAIR_BACKENDS[request.param]
    yield from _pair(daemon_dir / request.param, (request.param,), first)


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A private shm directory for one test (removed with whatever is left in it)."""
    path = private_shm_dir()
    try:
        yield path
    finally:
        remove_dir(path)
