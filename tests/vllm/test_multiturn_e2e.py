"""End to end over HTTP: a conversation's second turn through the P/D proxy reuses the first turn's KV.

The decode server, asked by the proxy (`--turn-ttl`) to keep the turn, grants its finished turn's blocks (prompt and
generated tokens) to whoever continues the conversation; the next turn's prefill server pulls them from the decode
server's daemon instead of computing the history, and computes only the new tokens. The answer must carry the
tokens a single server gives, and say how many history tokens the prefill server pulled. A turn whose grant lapsed
(the decode server's hold lease) is computed whole, and is just as right.

The prefill server runs without prefix caching, so that what it does not pull it computes (and so that asking it
directly is a single server's answer). Runs in the vLLM venv (tests/vllm/run.sh).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

if os.environ.get("KVBROKER_REQUIRE_VLLM"):
    import vllm  # type: ignore[import-not-found,unused-ignore]  # noqa: F401  (CI: missing vLLM fails, never skips)
else:
    pytest.importorskip("vllm", reason="vLLM is not installed here (its own venv: tests/vllm/setup_venv.sh)")

from kvbroker._local import LocalDaemon
from kvbroker.integrations.vllm_proxy import PdProxy, ProxyConfig, Upstream
from tests.helpers import wait_until
from tests.vllm.test_openai_proxy_e2e import (
    MODEL_NAME,
    ROOT,
    SERVER_START_TIMEOUT_S,
    Server,
    daemon_metrics,
    post_json,
    prompt_of,
    total,
)

pytestmark = pytest.mark.timeout(600)

BLOCK = 32  # the servers' --block-size
HOLD_LEASE_S = 8.0
"""The decode server's hold on a finished turn (`kvbroker_hold_lease_s`): short, so that a lapsed one is quick to
wait for; the next turn's prefill renews it from the moment it arrives."""


class Deployment:
    def __init__(self, prefill: Server, decode: Server, proxy: PdProxy, d_daemon: LocalDaemon) -> None:
        self.prefill, self.decode, self.d_daemon = prefill, decode, d_daemon
        host, port = proxy.address
        self.proxy_url = f"http://{host}:{port}"


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    workdir = tmp_path_factory.mktemp("turns")
    model = workdir / "tiny"
    subprocess.run([sys.executable, str(ROOT / "examples" / "vllm_pd" / "make_tiny_model.py"), str(model)],
                   check=True, capture_output=True)
    p_daemon = LocalDaemon(workdir, 1).start()
    d_daemon = LocalDaemon(workdir, 2, extra_args=["--metrics-listen", "127.0.0.1:0"]).start()
    servers: list[Server] = []
    try:
        # Each trusts the other's daemon: the decode server pulls prompts, the prefill server pulls finished turns.
        servers = [Server(model, p_daemon.target, workdir / "prefill.log", f"{d_daemon.cluster_id}="
                          f"{d_daemon.peer_address}", extra_args=("--no-enable-prefix-caching",)),
                   Server(model, d_daemon.target, workdir / "decode.log",
                          f"{p_daemon.cluster_id}={p_daemon.peer_address}",
                          extra_config={"kvbroker_hold_lease_s": HOLD_LEASE_S})]
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        for server in servers:
            server.wait_ready(deadline)
        prefill, decode = servers
        config = ProxyConfig((Upstream.parse("prefill", prefill.url),), (Upstream.parse("decode", decode.url),),
                             turn_ttl=HOLD_LEASE_S * 10)  # longer: a lapsed grant reaches the prefill server
        with PdProxy(config, "127.0.0.1", 0) as proxy:
            yield Deployment(prefill, decode, proxy, d_daemon)
    finally:
        for server in servers:
            server.stop()
        assert d_daemon.stop() == 0, d_daemon.log_tail()
        assert p_daemon.stop() == 0, p_daemon.log_tail()


def completion(prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}


def turn_one(deployment: Deployment, seed: int) -> tuple[list[int], list[int]]:
    """A first turn through the proxy: (its prompt, its answer's tokens)."""
    prompt = prompt_of(70, seed)
    answer = post_json(deployment.proxy_url, "/v1/completions", completion(prompt, 30))
    tokens = answer["choices"][0]["token_ids"]
    assert len(tokens) == 30
    return prompt, tokens


def history_blocks(prompt: list[int], answer: list[int]) -> int:
    """Tokens in the decode server's whole blocks once the turn ended (the last answer token has no KV yet)."""
    return (len(prompt) + len(answer) - 1) // BLOCK * BLOCK


def test_a_second_turn_pulls_the_first_turns_kv_and_answers_as_a_single_server(deployment: Deployment) -> None:
    prompt, answer = turn_one(deployment, 1)
    second = prompt + answer + prompt_of(20, 2)
    pd = post_json(deployment.proxy_url, "/v1/completions", completion(second, 12))
    single = post_json(deployment.prefill.url, "/v1/completions", completion(second, 12))

    assert pd["choices"][0]["token_ids"] == single["choices"][0]["token_ids"]
    params = pd["kv_transfer_params"]
    # The prefill server pulled the whole history it could (96 of 120 prompt tokens) and computed the rest.
    assert params["kvbroker_history_tokens_pulled"] == history_blocks(prompt, answer) == 96, params
    assert params["kvbroker_tokens_pulled"] > 0, params  # and the decode server pulled the prompt from it


def test_a_turn_whose_grant_lapsed_is_computed_whole_and_still_right(deployment: Deployment) -> None:
    prompt, answer = turn_one(deployment, 3)
    # Nobody continues the conversation within the decode server's hold lease: its grant (and hold) lapses. (No
    # grant left on the decode daemon: this one's and any an earlier test's last turn left.)
    wait_until(lambda: total(daemon_metrics(deployment.d_daemon), "kvbroker_grants") == 0,
               timeout=HOLD_LEASE_S * 6, poll=0.5, what="the decode server's turn grant lapsing")
    assert total(daemon_metrics(deployment.d_daemon), "kvbroker_grants_ended_total", outcome="lapsed") >= 1
    second = prompt + answer + prompt_of(20, 4)
    pd = post_json(deployment.proxy_url, "/v1/completions", completion(second, 12))
    single = post_json(deployment.prefill.url, "/v1/completions", completion(second, 12))

    assert pd["choices"][0]["token_ids"] == single["choices"][0]["token_ids"]
    assert pd["kv_transfer_params"].get("kvbroker_history_tokens_pulled", 0) == 0, pd["kv_transfer_params"]


def test_a_streamed_first_turn_is_reused_too(deployment: Deployment) -> None:
    """Most chat clients stream: the proxy reads the turn from the events it relays."""
    prompt = prompt_of(70, 5)
    request = urllib.request.Request(f"{deployment.proxy_url}/v1/completions", method="POST",
                                     data=json.dumps({**completion(prompt, 30), "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        events = [json.loads(line[len(b"data: "):]) for line in response.read().split(b"\n")
                  if line.startswith(b"data: {")]
    answer = [t for e in events for c in e.get("choices", []) for t in c.get("token_ids") or []]
    assert len(answer) == 30, events[:3]
    second = prompt + answer + prompt_of(20, 6)
    pd = post_json(deployment.proxy_url, "/v1/completions", completion(second, 12))
    single = post_json(deployment.prefill.url, "/v1/completions", completion(second, 12))

    assert pd["choices"][0]["token_ids"] == single["choices"][0]["token_ids"]
    assert pd["kv_transfer_params"]["kvbroker_history_tokens_pulled"] == history_blocks(prompt, answer) == 96
