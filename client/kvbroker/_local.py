"""Starts kvbrokerd daemons as child processes on this host (for `kvbroker demo`, benchmarks and tests)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import grpc

from kvbroker._client import DEFAULT_LEASE_TTL_S, Client
from kvbroker.status import LlmError

READY_TIMEOUT_S = 30.0


TOKEN_FILE = "peer.token"


def ensure_token(workdir: Path) -> Path:
    """The peer token shared by every daemon started in `workdir` (made once, readable by this user only)."""
    path = Path(workdir) / TOKEN_FILE
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{TOKEN_FILE}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)  # first writer wins; every daemon of the workdir reads the same token
        tmp.unlink()
    return path


class DaemonStartError(RuntimeError):
    """A daemon exited or did not become ready; the message holds the end of its log."""


class LocalDaemon:
    """One `python -m kvbrokerd` child: local API on a unix socket in `workdir`, peer API on a free loopback port."""

    def __init__(self, workdir: Path, cluster_id: int, *, backends: Sequence[str] | None = None,
                 extra_args: Sequence[str] = (), env: dict[str, str] | None = None,
                 wrapper: Sequence[str] = (), local_listen: str = "") -> None:
        """`wrapper`: a command prefix (e.g. `unshare ...`) to run the daemon in another namespace.
        `local_listen`: a TCP "host:port" for the local API instead of the unix socket. `backends`: None for the
        daemon's default ones."""
        self.workdir = Path(workdir)
        self.cluster_id = cluster_id
        self.socket_path = self.workdir / f"kvbroker-{cluster_id}.sock"
        self.target = local_listen or f"unix://{self.socket_path}"
        self.log_path = self.workdir / f"kvbrokerd-{cluster_id}.log"
        auth = () if any(a.startswith(("--tls-cert", "--peer-token-file", "--insecure-peers")) for a in extra_args) \
            else ("--peer-token-file", str(ensure_token(self.workdir)))
        chosen = () if backends is None else ("--backends", ",".join(backends))
        self.args = ["--cluster-id", str(cluster_id), "--listen", self.target, "--peer-listen", "127.0.0.1:0",
                     *chosen, *auth, *extra_args]
        self.env = env
        self.wrapper = list(wrapper)
        self.peer_address = ""
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> LocalDaemon:
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([*self.wrapper, sys.executable, "-m", "kvbrokerd", *self.args], stdout=log,
                                         stderr=subprocess.STDOUT, env={**os.environ, **(self.env or {})})
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise DaemonStartError(f"kvbrokerd {self.cluster_id} exited with {self.proc.returncode}:\n"
                                       f"{self.log_tail()}")
            if self.socket_path.exists() or not self.target.startswith("unix://"):
                with contextlib.suppress(LlmError, grpc.RpcError), Client(self.target, timeout=1.0) as c:
                    self.peer_address = c.get_cluster_info().peer_address
                    return self
            time.sleep(0.05)
        self.stop()
        raise DaemonStartError(f"kvbrokerd {self.cluster_id} not ready after {READY_TIMEOUT_S} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def client(self, timeout: float | None = 30.0, lease_ttl: float | None = DEFAULT_LEASE_TTL_S) -> Client:
        return Client(self.target, timeout=timeout, lease_ttl=lease_ttl)

    def signal(self, sig: signal.Signals) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout`; returns the exit code. Idempotent."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> LocalDaemon:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def default_backends() -> list[str]:
    """The backends a daemon allows when --backends is not given (asked of `kvbrokerd --print-config`)."""
    out = subprocess.run([sys.executable, "-m", "kvbrokerd", "--print-config"], capture_output=True, text=True,
                         timeout=60)
    if out.returncode != 0:
        raise RuntimeError(f"kvbrokerd --print-config failed: {out.stderr.strip()[-500:]}")
    # The daemon writes TOML strings and arrays as JSON does (config.to_toml): the line needs no TOML parser, which
    # the client's Python 3.10 would lack.
    line = next(li for li in out.stdout.splitlines() if li.startswith("backends = "))
    backends: list[str] = json.loads(line.removeprefix("backends = ").partition("  #")[0])
    return backends
