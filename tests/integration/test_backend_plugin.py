"""A backend from outside the repository's engines: `relay` (tests/extbackend) is registered only through the
`kvbrokerd.backends` entry point group, in a throw-away distribution's metadata on the daemons' PYTHONPATH. Its
settings become flags, its name a --backends choice, and a pull between two daemons goes over it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvbroker import CacheDesc, CacheIndex
from kvbroker._local import LocalDaemon
from tests.conftest import cluster_of
from tests.helpers import fill

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def plugin_env(tmp_path: Path) -> dict[str, str]:
    """An environment in which `relay` is installed the way a third-party engine would be: an entry point."""
    dist = tmp_path / "site" / "kvbroker_relay-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvbroker-relay\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[kvbrokerd.backends]\nrelay = tests.extbackend:RelayBackend\n")
    path = [str(tmp_path / "site"), str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {"PYTHONPATH": os.pathsep.join(path)}


def _kvbrokerd(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvbrokerd", "--cluster-id", "1", "--insecure-peers", *args],
                          capture_output=True, text=True, timeout=60, env={**os.environ, **env})


def test_an_entry_point_backend_carries_a_real_pull(tmp_path: Path, plugin_env: dict[str, str]) -> None:
    options = ["--relay-banner", "plugin42"]
    with LocalDaemon(tmp_path, 1, backends=("relay",), extra_args=options, env=plugin_env) as src, \
            LocalDaemon(tmp_path, 2, backends=("relay",), extra_args=options, env=plugin_env) as dst:
        desc = CacheDesc(num_tensors=4, shape=(16, 256))
        with src.client() as s, dst.client() as d:
            [linked] = d.link_clusters([cluster_of(src)])
            assert linked.ok, linked
            a, b = s.allocate_cache(desc), d.allocate_cache(desc)
            fill(a, 3)
            before = [t.copy() for t in b.tensors]
            pulled = d.pull_kv_blocks(CacheIndex(src.cluster_id, a.cache_id), b, [3, 0, 15], [1, 9, 2])
            assert pulled.backend == "relay"
            for t in range(desc.num_tensors):
                assert np.array_equal(b.tensors[t][[1, 9, 2]].view(np.uint8), a.tensors[t][[3, 0, 15]].view(np.uint8))
                untouched = [i for i in range(16) if i not in (1, 9, 2)]
                assert np.array_equal(b.tensors[t][untouched], before[t][untouched])
            assert [link.backend for link in d.list_links()] == ["relay"]
        assert "backends relay=plugin42:" in src.log_tail(50)  # its own setting reached it


def test_an_entry_point_backend_has_flags_and_a_config_table(plugin_env: dict[str, str]) -> None:
    printed = _kvbrokerd(plugin_env, "--relay-banner", "xyz", "--print-config")
    assert printed.returncode == 0, printed.stderr
    assert '[backend.relay]\nport = 0  # ' in printed.stdout and 'banner = "xyz"' in printed.stdout
    refused = _kvbrokerd(plugin_env, "--backends", "relay", "--relay-banner", "not one word")
    assert refused.returncode == 2 and "backend.relay.banner: 'not one word' is not alphanumeric" in refused.stderr


def test_without_its_entry_point_the_backend_is_unknown() -> None:
    refused = _kvbrokerd({}, "--backends", "relay")
    assert refused.returncode == 2 and "unknown backend 'relay'" in refused.stderr
