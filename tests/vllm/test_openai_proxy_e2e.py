"""End to end over HTTP: two vLLM OpenAI servers with KvBrokerConnector, their kvbrokerd sidecars and the P/D proxy.

The quick start of docs/vllm.md as a test: the proxy's answer (prefill on one server, decode on the other, KV pulled
through the daemons) must carry exactly the tokens the prefill server gives when asked directly (a single server),
for completions and chat, streamed or not, and the decode server must report that it pulled the KV. A pull also moves
the series an operator watches: the connector's vllm:kvbroker_* on vLLM's /metrics and the daemons' kvbroker_*.

Runs in the vLLM venv (tests/vllm/run.sh); the main suite skips it when vLLM is not installed.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("KVBROKER_REQUIRE_VLLM"):
    import vllm  # type: ignore[import-not-found,unused-ignore]  # noqa: F401  (CI: missing vLLM fails, never skips)
else:
    pytest.importorskip("vllm", reason="vLLM is not installed here (its own venv: tests/vllm/setup_venv.sh)")

from kvbroker._local import LocalDaemon
from kvbroker.integrations.vllm_proxy import PdProxy, ProxyConfig, Upstream
from tests.helpers import wait_until
from tests.metrics_doc import differences, documented_series, exposed_series

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[2]
SERVER_START_TIMEOUT_S = 400.0
MODEL_NAME = "tiny"
LEASE_TTL_S = 30.0
"""The engine session's lease (`kvbroker_lease_ttl_s`'s default): how long a crashed engine's cache outlives it."""
SERVER_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "OMP_NUM_THREADS": "1",
              "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """`python -m vllm.entrypoints.openai.api_server` with KvBrokerConnector, as docs/vllm.md starts it."""

    def __init__(self, model: Path, kvbroker_target: str, log_path: Path, trusted: str = "",
                 extra_config: dict[str, Any] | None = None, extra_args: Sequence[str] = (),
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        kv_config = {"kv_connector": "KvBrokerConnector", "kv_connector_module_path": "kvbroker.integrations.vllm",
                     "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                     "kv_connector_extra_config": {"kvbroker_target": kvbroker_target,
                                                   "kvbroker_prefill_daemons": trusted, **(extra_config or {})}}
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(self.port),
                "--enforce-eager", "--block-size", "32", "--max-model-len", "1024",
                "--kv-cache-memory-bytes", str(64 << 20), "--kv-transfer-config", json.dumps(kv_config), *extra_args]
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, **SERVER_ENV, **(env or {})})

    def wait_ready(self, deadline: float) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                pytest.fail(f"vLLM server exited with {self.proc.returncode}:\n{self.log_tail()}")
            return request(self.url, "GET", "/health", None)[0] == 200

        try:
            wait_until(ready, timeout=max(0.0, deadline - time.monotonic()), poll=1.0, tolerate=(OSError,),
                       what="the vLLM server's /health answering 200")
        except AssertionError as e:
            raise AssertionError(f"{e}:\n{self.log_tail()}") from None

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def request(base: str, method: str, path: str, body: dict[str, Any] | None) -> tuple[int, bytes]:
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body),
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def post_json(base: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    status, raw = request(base, "POST", path, body)
    assert status == 200, raw
    answer = json.loads(raw)
    assert isinstance(answer, dict)
    return answer


class Deployment:
    def __init__(self, prefill: Server, decode: Server, proxy: PdProxy, daemons: tuple[LocalDaemon, LocalDaemon]
                 ) -> None:
        self.prefill, self.decode = prefill, decode
        host, port = proxy.address
        self.proxy_url = f"http://{host}:{port}"
        self.p_daemon, self.d_daemon = daemons


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "tiny"
    subprocess.run([sys.executable, str(ROOT / "examples" / "vllm_pd" / "make_tiny_model.py"), str(path)],
                   check=True, capture_output=True)
    return path


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory, model: Path) -> Iterator[Deployment]:
    workdir = tmp_path_factory.mktemp("openai")
    metrics = ["--metrics-listen", "127.0.0.1:0"]
    p_daemon = LocalDaemon(workdir, 1, extra_args=metrics).start()
    d_daemon = LocalDaemon(workdir, 2, extra_args=metrics).start()
    servers: list[Server] = []
    try:
        servers = [Server(model, p_daemon.target, workdir / "prefill.log"),
                   Server(model, d_daemon.target, workdir / "decode.log",
                          f"{p_daemon.cluster_id}={p_daemon.peer_address}")]
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        for server in servers:
            server.wait_ready(deadline)
        prefill, decode = servers
        config = ProxyConfig((Upstream.parse("prefill", prefill.url),), (Upstream.parse("decode", decode.url),))
        with PdProxy(config, "127.0.0.1", 0) as proxy:
            yield Deployment(prefill, decode, proxy, (p_daemon, d_daemon))
    finally:
        for server in servers:
            server.stop()
        assert d_daemon.stop() == 0, d_daemon.log_tail()
        assert p_daemon.stop() == 0, p_daemon.log_tail()


def prompt_of(length: int, seed: int) -> list[int]:
    # Token ids of the tiny model's vocabulary above its special tokens; distinct per prompt (no prefix cache hits).
    return [10 + (seed * 7919 + i * 104729) % 500 for i in range(length)]


@pytest.mark.parametrize("length", [17, 64, 75])
def test_a_completion_through_the_proxy_has_the_single_server_tokens(deployment: Deployment, length: int) -> None:
    body = {"model": MODEL_NAME, "prompt": prompt_of(length, length), "max_tokens": 10, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    single = post_json(deployment.prefill.url, "/v1/completions", body)
    pd = post_json(deployment.proxy_url, "/v1/completions", body)

    assert pd["choices"][0]["token_ids"] == single["choices"][0]["token_ids"]
    assert len(pd["choices"][0]["token_ids"]) == 10
    # The decode server reports the pull it made (a decode server that recomputed the prompt reports none).
    pulled = pd["kv_transfer_params"]
    assert pulled["kvbroker_transfer_bytes"] > 0, pulled
    assert pulled["kvbroker_backend"] in ("shm", "tcp"), pulled


def test_a_streamed_chat_through_the_proxy_has_the_single_server_text(deployment: Deployment) -> None:
    messages = [{"role": "user", "content": "Tell me a story about caches, blocks, layers and links."}]
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    single = post_json(deployment.prefill.url, "/v1/chat/completions", body)

    status, raw = request(deployment.proxy_url, "POST", "/v1/chat/completions", {**body, "stream": True})
    assert status == 200, raw
    events = [line.removeprefix(b"data: ") for line in raw.split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    text = "".join(
        choice["delta"].get("content") or "" for event in events[:-1] for choice in json.loads(event)["choices"]
    )
    assert text == single["choices"][0]["message"]["content"]
    assert text
    assert_says_where_its_kv_came_from(events)


def assert_says_where_its_kv_came_from(events: list[bytes]) -> None:
    """Issue 31 item 4: a streamed answer's last event before [DONE] carries the decode server's
    kv_transfer_params, as a non-streamed answer does (streams.py)."""
    last = json.loads(events[-2])
    assert last["choices"] == [], last
    params = last["kv_transfer_params"]
    assert params["kvbroker_tokens_pulled"] > 0 and params["kvbroker_transfer_bytes"] > 0, params
    assert all("kv_transfer_params" not in json.loads(event) for event in events[:-2])


def test_a_streamed_completion_through_the_proxy_says_where_its_kv_came_from(deployment: Deployment) -> None:
    body = {"model": MODEL_NAME, "prompt": prompt_of(70, 5), "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "stream": True}
    status, raw = request(deployment.proxy_url, "POST", "/v1/completions", body)
    assert status == 200, raw
    events = [line.removeprefix(b"data: ") for line in raw.split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    assert_says_where_its_kv_came_from(events)


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Samples:
    from prometheus_client.parser import text_string_to_metric_families

    status, raw = request(url, "GET", "/metrics", None)
    assert status == 200, raw
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(raw.decode()) for s in family.samples}


def total(samples: Samples, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


def daemon_metrics(daemon: LocalDaemon) -> Samples:
    with daemon.client() as c:
        return scrape(f"http://{c.get_cluster_info().metrics_address}")


def test_a_pull_moves_the_connectors_series_on_vllms_metrics_and_the_daemons(deployment: Deployment) -> None:
    """Issue 20 item 3, scraped for real: one request through the proxy moves the decode engine's vllm:kvbroker_*
    series (labelled as vLLM labels its own: model_name, engine), the decode daemon's transfer series for the prefill
    peer, and the prefill daemon's count of holds released. Deltas: the module's other tests pulled before."""
    peer = str(deployment.p_daemon.cluster_id)
    vllm_before, d_before = scrape(deployment.decode.url), daemon_metrics(deployment.d_daemon)
    p_before = daemon_metrics(deployment.p_daemon)
    body = {"model": MODEL_NAME, "prompt": prompt_of(70, 9), "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    pulled = post_json(deployment.proxy_url, "/v1/completions", body)["kv_transfer_params"]["kvbroker_transfer_bytes"]
    assert pulled > 0

    def moved(name: str, samples: Samples, before: Samples, **labels: str) -> float:
        return total(samples, name, **labels) - total(before, name, **labels)

    # vLLM's front end gets the connector's stats with the engine's next scheduler stats: wait for them.
    ours = {"model_name": MODEL_NAME, "engine": "0"}
    def pull_counted() -> Samples | None:
        now = scrape(deployment.decode.url)
        return now if moved("vllm:kvbroker_pull_bytes_sum", now, vllm_before, **ours) >= pulled else None

    vllm_after = wait_until(pull_counted, timeout=30, poll=0.5, what="the pull on the decode server's /metrics")
    assert vllm_after is not None
    assert moved("vllm:kvbroker_pulls_total", vllm_after, vllm_before, **ours) >= 1
    assert moved("vllm:kvbroker_pull_seconds_count", vllm_after, vllm_before, **ours) >= 1
    assert moved("vllm:kvbroker_recomputes_total", vllm_after, vllm_before) == 0  # every pull landed
    assert ("vllm:kvbroker_recomputes_total", tuple(sorted({**ours, "reason": "hold_expired"}.items()))) in vllm_after
    # Every connector series the dashboard charts is on vLLM's /metrics.
    dashboard = json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())
    charted = {name for panel in dashboard["panels"] for t in panel.get("targets", [])
               for name in re.findall(r"vllm:kvbroker_\w+", t["expr"])}
    assert charted and charted <= {name for name, _ in vllm_after}, charted - {name for name, _ in vllm_after}

    # docs/vllm.md's list is what the real page exposes, names and label values (issue 31 item 6).
    status, page = request(deployment.decode.url, "GET", "/metrics", None)
    assert status == 200
    assert differences(documented_series("vllm:kvbroker_"), exposed_series(page.decode(), "vllm:kvbroker_")) == []

    # The decode daemon: the pull, by peer and backend, in counts, bytes and latency.
    d_after = daemon_metrics(deployment.d_daemon)
    assert moved("kvbroker_transfers_total", d_after, d_before, peer=peer, outcome="DONE") >= 1
    assert moved("kvbroker_transfer_bytes_total", d_after, d_before, peer=peer, outcome="DONE") >= pulled
    assert moved("kvbroker_transfer_seconds_count", d_after, d_before, peer=peer, stage="total") >= 1
    assert {dict(ls).get("backend") for n, ls in d_after if n == "kvbroker_transfers_total"} <= {"shm", "tcp"}
    # The prefill daemon: the request's hold, released by the decode node once pulled.
    wait_until(lambda: moved("kvbroker_grants_ended_total", daemon_metrics(deployment.p_daemon), p_before,
                             outcome="released") >= 1, timeout=30, poll=0.5, what="the prefill hold released")



def _owners(daemon: LocalDaemon) -> set[str]:
    """The sessions owning the caches `daemon` holds now (one per engine)."""
    with daemon.client(lease_ttl=None) as c:
        return {record.owner for record in c.list_caches()}


def test_a_server_stopped_by_sigterm_or_sigint_frees_its_kv_memory_at_once(model: Path, tmp_path: Path) -> None:
    """Issue 31 item 5: a server told to stop releases its engine's cache (its daemon session's) before it exits,
    instead of leaving it to the session's lease (`kvbroker_lease_ttl_s`, 30 s): only a crash waits for the lease.
    Two servers on a daemon of their own, one stopped by each signal."""
    daemon = LocalDaemon(tmp_path, 3).start()
    servers: list[Server] = []
    try:
        servers = [Server(model, daemon.target, tmp_path / f"{name}.log") for name in ("term", "int")]
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        for server in servers:
            server.wait_ready(deadline)
        body = {"model": MODEL_NAME, "prompt": prompt_of(40, 3), "max_tokens": 2}
        owners = set()
        for server, signum in zip(servers, (signal.SIGTERM, signal.SIGINT), strict=True):
            post_json(server.url, "/v1/completions", body)
            before = _owners(daemon)
            signalled = time.monotonic()
            server.proc.send_signal(signum)
            server.proc.wait(60)
            exited = time.monotonic() - signalled

            def released(before: set[str] = before) -> set[str] | None:
                return before - _owners(daemon) or None

            # Well under the lease: a few seconds cover a busy machine, never a lease.
            gone = wait_until(released, timeout=LEASE_TTL_S / 3, poll=0.2,
                              what=f"a cache released after {signum.name} (the server exited {exited:.1f} s after it)")
            assert gone is not None and len(gone) == 1, gone
            assert "lease of session" not in daemon.log_tail(200), daemon.log_tail()
            owners |= gone
        assert not _owners(daemon) and len(owners) == 2
    finally:
        for server in servers:
            server.stop()
        assert daemon.stop() == 0, daemon.log_tail()
