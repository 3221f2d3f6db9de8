"""Who publishes which caches live: the registry only keeps ids apart and calls its hooks; the shm backend owns its
control page (shm_control.py) and live-cache slots follow the registry (liveslots.py). Real files in a private
directory of /dev/shm."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvbroker.types import CacheDesc
from kvbrokerd.backends.common.liveslots import LiveSlots
from kvbrokerd.backends.shm import backend as shm_backend
from kvbrokerd.dataplane.seam import LocalContext
from kvbrokerd.registry.caches import CacheEntry, Registry

DESC = CacheDesc(num_tensors=1, shape=(2, 64))


@pytest.fixture
def registry(shm_dir: Path) -> Iterator[Registry]:
    registry = Registry(shm_dir, max_caches=4)
    registry.open()
    yield registry
    registry.close()


def _backend(registry: Registry) -> shm_backend.ShmBackend:
    ctx = LocalContext(cluster_id=1, registry=registry, shm_dir=registry.shm_dir, peer_host="127.0.0.1",
                       parts_executor=concurrent.futures.ThreadPoolExecutor(1), secret_for=lambda _: None)
    return shm_backend.ShmBackend(ctx)


def test_the_registry_publishes_nothing_for_peers(registry: Registry, shm_dir: Path) -> None:
    entry = registry.allocate(DESC)
    names = {p.name for p in shm_dir.iterdir()}
    assert names == {f"kvbroker-{registry.instance}.lock", entry.tensors[0].segment}


def test_the_shm_backend_publishes_its_page_and_keeps_the_slots(registry: Registry, shm_dir: Path) -> None:
    before = registry.allocate(DESC)  # added before the backend starts: marked at start
    backend = _backend(registry)
    assert backend.advertise() == b""  # nothing to advertise before start
    asyncio.run(backend.start())
    ad = json.loads(backend.advertise())
    assert ad["segment"] == f"kvbroker-{registry.instance}-ctl"
    assert (shm_dir / ad["segment"]).stat().st_mode & 0o777 == 0o600
    peer = shm_backend.probe(ad["segment"], bytes.fromhex(ad["nonce"]), shm_dir)
    assert peer is not None and peer.is_live(before.cache_id)
    after = registry.allocate(DESC)
    assert peer.is_live(after.cache_id)
    asyncio.run(registry.remove(before.cache_id, daemon_owned=True))
    assert not peer.is_live(before.cache_id) and peer.is_live(after.cache_id)
    backend.close()
    assert not (shm_dir / ad["segment"]).exists()
    assert not peer.is_live(after.cache_id), "a peer that still holds the page sees every cache gone"
    backend.close()  # idempotent
    assert registry.on_add == [] and registry.on_remove == []


def test_live_ids_never_share_a_slot(registry: Registry) -> None:
    entries = [registry.allocate(DESC) for _ in range(4)]
    assert len({e.cache_id % 4 for e in entries}) == 4
    asyncio.run(registry.remove(entries[1].cache_id, daemon_owned=True))
    again = registry.allocate(DESC)
    assert again.cache_id % 4 == entries[1].cache_id % 4 and again.cache_id > entries[-1].cache_id


def test_a_removal_never_clears_the_slot_of_a_newer_cache() -> None:
    words = np.zeros(4, np.uint64)
    slots = LiveSlots(words)
    old, new = CacheEntry(9, DESC, (), False, {}, []), CacheEntry(13, DESC, (), False, {}, [])
    slots.added(old)
    slots.added(new)  # same slot: the registry let 9 go, then handed out 13, before 9's removal hooks ran
    slots.removed(old)
    assert words[1] == 13
    slots.removed(new)
    assert words[1] == 0
