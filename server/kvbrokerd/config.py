"""The daemon's configuration: one frozen object from flags > `KVBROKER_*` environment > TOML file > defaults,
validated at start-up with errors that name the field and the bad value."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from kvbrokerd import backends as _backends
from kvbrokerd.backends.hccl.engine import DEFAULT_ENGINE_PORT, HcclSettings

KNOWN_BACKENDS = tuple(_backends.MODULES)
LOG_LEVELS = ("debug", "info", "warning", "error")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


@dataclass(frozen=True)
class Config:
    cluster_id: int = field(metadata={"help": "this daemon's cluster id (uint64, unique among linked peers)"})
    listen: str = field(default="unix:///run/kvbroker/kvbroker.sock",
                        metadata={"help": "local API address: unix:///path (default) or host:port"})
    peer_listen: str = field(default="0.0.0.0:7100", metadata={"help": "peer API address host:port (port 0 = any)"})
    advertise_address: str = field(default="", metadata={"help": "address peers should dial, if not peer_listen"})
    data_port: int = field(default=0, metadata={"help": "tcp data-plane port on the peer host (0 = any free port)"})
    backends: tuple[str, ...] = field(default=_backends.DEFAULT_BACKENDS,
                                      metadata={"help": "data-plane backends allowed, in order of preference"})
    shm_dir: str = field(default="/dev/shm", metadata={"help": "directory of POSIX shared-memory segments"})
    max_caches: int = field(default=4096, metadata={"help": "most caches this daemon holds at once"})
    data_threads: int = field(default=8, metadata={"help": "threads that run data-plane copies and socket I/O"})
    log_level: str = field(default="info", metadata={"help": "debug, info, warning or error"})
    log_format: str = field(default="text", metadata={"help": "text or json"})
    metrics_listen: str = field(default="", metadata={"help": "Prometheus endpoint host:port (empty = off)"})
    tls_cert: str = field(default="", metadata={"help": "PEM certificate of this daemon (mutual TLS on the peer API)"})
    tls_key: str = field(default="", metadata={"help": "PEM private key of tls_cert"})
    tls_ca: str = field(default="", metadata={"help": "PEM CA bundle that peers' certificates must chain to"})
    data_tls: bool = field(default=False, metadata={"help": "TLS on tcp data connections too (needs tls_*)"})
    peer_token_file: str = field(default="", metadata={
        "help": "file holding the deployment's shared peer token (>= 16 bytes, not world-readable); peers prove "
                "it by challenge-response and it never travels"})
    insecure_peers: bool = field(default=False, metadata={
        "help": "accept unauthenticated peers (development only): without this, give peer_token_file or tls_*"})
    peer_link_ttl: float = field(default=120.0, metadata={
        "help": "seconds after which a peer's link to us that has gone silent (no heartbeat) is forgotten"})
    max_transfers: int = field(default=256, metadata={"help": "most transfers in flight; more are refused"})
    parallel_transfers: int = field(default=2, metadata={
        "help": "large transfers copying at once over links whose backend has no turn of its own (tcp has one per "
                "pooled connection); others queue"})
    max_inflight_bytes: int = field(default=16 << 30, metadata={"help": "most bytes in flight over all transfers"})
    max_links: int = field(default=1024, metadata={"help": "most links (each way)"})
    auto_relink: bool = field(default=False, metadata={"help": "re-link by itself when a linked peer restarts"})
    hccl_device: int = field(default=0, metadata={
        "help": "hccl backend: the NPU its HIXL engine binds (logical id, as ASCEND_RT_VISIBLE_DEVICES numbers them)"})
    hccl_engine: str = field(default="", metadata={
        "help": "hccl backend: ip:port (or [v6]:port) peers dial for its HIXL engine, an IP literal (empty = the "
                f"peer listener's IP, port {DEFAULT_ENGINE_PORT} + hccl_device)"})
    hccl_options: dict[str, str] = field(default_factory=dict, metadata={
        "help": "hccl backend: extra HIXL options passed to initialize (GlobalResourceConfig, LocalCommRes, "
                "RdmaTrafficClass, ...): a JSON object of strings (a table in the config file); BufferPool and "
                "AutoConnect are kvbroker's"})
    hccl_connect_timeout_ms: int = field(default=3000, metadata={
        "help": "hccl backend: longest HIXL link set-up in milliseconds (a transfer's deadline may cut it shorter)"})

    def hccl_settings(self) -> HcclSettings:
        """The hccl backend's settings (checked by `validate`)."""
        return HcclSettings(device=self.hccl_device, engine=self.hccl_engine, options=dict(self.hccl_options),
                            connect_timeout_ms=self.hccl_connect_timeout_ms)

    def validate(self, *, require_auth: bool = True) -> Config:
        if self.listen.startswith("/"):  # a bare path means a unix socket, as the CLI's --target accepts it
            object.__setattr__(self, "listen", "unix://" + self.listen)
        if not 0 <= self.cluster_id < 2**64:
            raise ConfigError(f"cluster_id: {self.cluster_id} is not a uint64")
        if not self.backends or len(set(self.backends)) != len(self.backends):
            raise ConfigError(f"backends: {','.join(self.backends) or '(empty)'} — name each of {KNOWN_BACKENDS} at "
                              "most once")
        for name in self.backends:
            reason = _backends.unavailable(name)
            if reason:
                raise ConfigError(f"backends: {reason}")
        if not self.listen.startswith("unix://") and ":" not in self.listen:
            raise ConfigError(f"listen: {self.listen!r} is neither unix:///path nor host:port")
        for name in ("peer_listen", "advertise_address"):
            value = getattr(self, name)
            if value and not _is_host_port(value):
                raise ConfigError(f"{name}: {value!r} is not host:port")
        if not 0 <= self.data_port < 65536:
            raise ConfigError(f"data_port: {self.data_port} is not a port")
        for name in ("max_caches", "data_threads", "max_transfers", "parallel_transfers", "max_inflight_bytes",
                     "max_links"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: {getattr(self, name)} must be >= 1")
        if self.metrics_listen and not _is_host_port(self.metrics_listen):
            raise ConfigError(f"metrics_listen: {self.metrics_listen!r} is not host:port")
        tls = [self.tls_cert, self.tls_key, self.tls_ca]
        if any(tls) and not all(tls):
            raise ConfigError("tls_cert, tls_key, tls_ca: give all three for mutual TLS, or none")
        for name in ("tls_cert", "tls_key", "tls_ca"):
            path = getattr(self, name)
            if path and not os.access(path, os.R_OK):
                raise ConfigError(f"{name}: cannot read {path!r}")
        if self.data_tls and not all(tls):
            raise ConfigError("data_tls: needs tls_cert, tls_key and tls_ca")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"log_level: {self.log_level!r} — choose from {LOG_LEVELS}")
        if self.log_format not in ("text", "json"):
            raise ConfigError(f"log_format: {self.log_format!r} — choose text or json")
        if self.peer_token_file:
            from kvbrokerd.links.linkauth import TokenError, load_token

            try:
                load_token(self.peer_token_file)
            except TokenError as e:
                raise ConfigError(f"peer_token_file: {e}") from None
        if require_auth and not (self.peer_token_file or all(tls) or self.insecure_peers):
            raise ConfigError("peer authentication: give --peer-token-file FILE (a secret shared by the deployment's "
                              "daemons, e.g. `head -c 32 /dev/urandom | base64 > FILE; chmod 600 FILE`), or mutual "
                              "TLS with --tls-cert/--tls-key/--tls-ca, or --insecure-peers to accept any peer "
                              "(development only)")
        if not self.peer_link_ttl >= 3.0:
            raise ConfigError(f"peer_link_ttl: {self.peer_link_ttl} must be >= 3 seconds")
        try:
            self.hccl_settings().validated()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return self


def _is_host_port(value: str) -> bool:
    host, sep, port = value.rpartition(":")
    return bool(sep and host and port.isdigit() and int(port) < 65536)


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


_OPTIONS_EXAMPLE = '{"LocalCommRes": "{\\"version\\": \\"1.3\\"}"}'


def _string_table(name: str, raw: Any) -> dict[str, str]:
    """A table of strings: a TOML table, or a JSON object in a flag or an environment variable."""
    if isinstance(raw, str):
        if not raw.strip():
            return {}
        try:
            raw = json.loads(raw)
        except ValueError as e:
            raise ConfigError(f"{name}: not JSON ({e}); want an object of strings, e.g. {_OPTIONS_EXAMPLE}") from None
    if not isinstance(raw, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in raw.items()):
        raise ConfigError(f"{name}: want an object of strings (values that are JSON themselves are quoted), e.g. "
                          f"{_OPTIONS_EXAMPLE}")
    return dict(raw)


def _coerce(name: str, raw: Any, kind: Any) -> Any:
    if kind in ("dict[str, str]",):
        return _string_table(name, raw)
    if kind in (bool, "bool"):
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()  # never bool("false")
        if text in _TRUE | _FALSE:
            return text in _TRUE
        raise ConfigError(f"{name}: {raw!r} is not a boolean (true/false)")
    try:
        if kind in (int, "int"):
            if isinstance(raw, bool):
                raise ValueError
            return int(raw)
        if kind in (float, "float"):
            if isinstance(raw, bool):
                raise ValueError
            return float(raw)
        if kind in ("tuple[str, ...]",):
            items = raw.split(",") if isinstance(raw, str) else list(raw)
            return tuple(s.strip() for s in items if str(s).strip())
        return str(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: {raw!r} is not a valid {kind}") from None


def load(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> tuple[Config, bool]:
    """(config, print_config) from the command line, `environ` and the TOML file named by --config/KVBROKER_CONFIG."""
    environ = os.environ if environ is None else environ
    fields = [f for f in dataclasses.fields(Config)]
    parser = argparse.ArgumentParser(
        prog="kvbrokerd", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="kvbroker daemon: KV-cache block transfers between LLM serving nodes (LLM-DataDist semantics).",
        epilog="Every option also has a KVBROKER_* environment variable and a key in the --config TOML file; options\n"
               "win over the environment, which wins over the file. Example:\n"
               "  kvbrokerd --cluster-id 1 --peer-listen 0.0.0.0:7100 --peer-token-file /etc/kvbroker/token")
    parser.add_argument("--config", help="TOML file with any of the keys below (env: KVBROKER_CONFIG)")
    parser.add_argument("--print-config", action="store_true", help="print the effective config and exit")
    for f in fields:
        flag: dict[str, Any] = {"nargs": "?", "const": "true"} if f.type in (bool, "bool") else {}  # `--x` = true
        value = _default(f)
        default = "" if value is dataclasses.MISSING else f" [default: {_render(value) or 'none'}]"
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=None,
                            help=f"{f.metadata['help']}{default} (env: KVBROKER_{f.name.upper()})", **flag)
    args = parser.parse_args(argv)
    values: dict[str, Any] = {}
    path = args.config or environ.get("KVBROKER_CONFIG")
    if path:
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"config: cannot read {path}: {e}") from None
        known = {f.name for f in fields}
        for key, value in data.items():
            name = key.replace("-", "_")
            if name not in known:
                raise ConfigError(f"config: unknown key {key!r} in {path}")
            values[name] = value
    for f in fields:
        env = environ.get(f"KVBROKER_{f.name.upper()}")
        if env is not None:
            values[f.name] = env
        cli = getattr(args, f.name)
        if cli is not None:
            values[f.name] = cli
    if "cluster_id" not in values:
        if not args.print_config:
            raise ConfigError("cluster_id: required (--cluster-id, KVBROKER_CLUSTER_ID or the config file)")
        values["cluster_id"] = 0  # --print-config shows the defaults even before an id is chosen
    typed = {f.name: _coerce(f.name, values[f.name], f.type) for f in fields if f.name in values}
    # --print-config shows a config that still lacks peer authentication (it is how one finds out what to add).
    return Config(**typed).validate(require_auth=not args.print_config), bool(args.print_config)


def _default(f: dataclasses.Field[Any]) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _render(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(value)
    if isinstance(value, dict):
        return json.dumps(value) if value else ""
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def to_toml(config: Config) -> str:
    lines = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if isinstance(value, tuple):
            rendered = "[" + ", ".join(_toml_string(v) for v in value) + "]"
        elif isinstance(value, dict):
            rendered = "{" + ", ".join(f"{_toml_string(k)} = {_toml_string(v)}" for k, v in value.items()) + "}"
        elif isinstance(value, bool):
            rendered = str(value).lower()
        elif isinstance(value, int | float):
            rendered = str(value)
        else:
            rendered = _toml_string(value)
        lines.append(f"{f.name} = {rendered}  # {f.metadata['help']}")
    return "\n".join(lines)


def _toml_string(value: str) -> str:
    """A TOML basic string: JSON's escapes (quotes, backslashes, control characters, \\uXXXX) are TOML's too."""
    return json.dumps(value)
