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
# `HYPOTHESIS_PROFILE=explore pytest ...` searches new ones (and reports any failure with a reproducible seed). No
# example has a deadline: how long one takes says how busy the machine is, not whether the code is right.
settings.register_profile("gate", derandomize=True, database=None, print_blob=True, deadline=None)
settings.register_profile("explore", derandomize=False, print_blob=True, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "gate"))


@pytest.fixture(scope="session")
def daemon_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("daemons")


def _pair(workdir: Path, backends: tuple[str, ...], first_id: int) -> Iterator[tuple[LocalDaemon, LocalDaemon]]:
    src = LocalDaemon(workdir, first_id, backends=backends).start()
    try:
        dst = LocalDaemon(workdir, first_id + 1, backends=backends, extra_args=["--metrics-listen", "127.0.0.1:0"]
                          ).start()
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


PAIR_BACKENDS = {name: 100 * (i + 1) for i, name in enumerate(backends.registered())}
"""Backend of each linked pair -> the cluster id of its source daemon."""


# Only the names here: loading backend classes at import would load the fault-safe copy before pytest enables
# faulthandler, whose handler would then see (and die of) the SIGBUS that tests provoke on purpose.
@pytest.fixture(scope="session", params=list(backends.registered()))
def linked_pair(request: pytest.FixtureRequest, daemon_dir: Path) -> Iterator[tuple[LocalDaemon, LocalDaemon]]:
    """(source daemon, destination daemon) linked dst -> src, both allowing only the parametrised backend: the
    shared backend suite runs over every registered backend that moves host memory, and one that cannot run here
    (its engine or device missing) is skipped with the reason. The destination serves metrics, so that a test can
    wait for its transfers to end (`tests.helpers.transfers_in_flight`)."""
    if "host" not in backends.backend_class(request.param).capabilities.memory_kinds:
        pytest.skip(f"the {request.param} backend does not move host memory")
    reason = backends.unavailable(request.param)
    if reason is not None:
        pytest.skip(reason)
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
