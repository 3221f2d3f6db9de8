"""The daemon's configuration: one frozen object from flags > `KVBROKER_*` environment > TOML file > defaults,
validated at start-up with errors that name the field and the bad value."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import ipaddress
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
from kvbrokerd.dataplane.seam import BackendSettings, DaemonFacts
from kvbrokerd.limits import DEFAULT_SESSION_MESSAGE_PAIRS

LOG_LEVELS = ("debug", "info", "warning", "error")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


@dataclass(frozen=True)
class Config:
    cluster_id: int = field(metadata={"help": "this daemon's cluster id (uint64, unique among linked peers)"})
    cluster_id_from: str = field(default="", metadata={
        "help": "derive the cluster id from this name instead (a pod or node name, or an IPv4 or IPv6 address): "
                "the first 8 bytes of its SHA-256 as a big-endian uint64 (`kvbrokerd --print-config` shows it); "
                "give it or cluster_id, not both"})
    listen: str = field(default="unix:///run/kvbroker/kvbroker.sock",
                        metadata={"help": "local API address: unix:///path (default) or host:port"})
    peer_listen: str = field(default="0.0.0.0:7100", metadata={"help": "peer API address host:port (port 0 = any)"})
    advertise_address: str = field(default="", metadata={"help": "address peers should dial, if not peer_listen"})
    backends: tuple[str, ...] = field(default_factory=_backends.default_backends,
                                      metadata={"help": "data-plane backends allowed, in order of preference"})
    shm_dir: str = field(default="/dev/shm", metadata={"help": "directory of POSIX shared-memory segments"})
    max_caches: int = field(default=4096, metadata={"help": "most caches this daemon holds at once"})
    data_threads: int = field(default=8, metadata={"help": "threads that run data-plane copies and socket I/O"})
    log_level: str = field(default="info", metadata={"help": "debug, info, warning or error"})
    log_format: str = field(default="text", metadata={"help": "text or json"})
    metrics_listen: str = field(default="", metadata={"help": "Prometheus endpoint host:port (empty = off)"})
    otlp_traces_endpoint: str = field(default="", metadata={
        "help": "OpenTelemetry collector that receives this daemon's traces over OTLP/gRPC: host:port (plaintext) "
                "or https://host:port (empty = tracing off); needs kvbroker[trace]; OTEL_SERVICE_NAME and "
                "OTEL_TRACES_SAMPLER(_ARG) apply (docs/tracing.md)"})
    tls_cert: str = field(default="", metadata={"help": "PEM certificate of this daemon (mutual TLS on the peer API)"})
    tls_key: str = field(default="", metadata={"help": "PEM private key of tls_cert"})
    tls_ca: str = field(default="", metadata={"help": "PEM CA bundle that peers' certificates must chain to"})
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
    max_granted_blocks: int = field(default=1 << 22, metadata={
        "help": "most blocks that all live grants together cover (4 bytes each in memory); CreateGrant past it is "
                "refused with LLM_OUT_OF_MEMORY"})
    max_session_message_pairs: int = field(default=DEFAULT_SESSION_MESSAGE_PAIRS, metadata={
        "help": "most block pairs the pulls of one PullKvBlocksSession message may name in all; a message with more "
                "has every pull refused (clients split a larger submit)"})
    peer_links_per_cluster: int = field(default=64, metadata={
        "help": "most links peers may make to us claiming one cluster id; past it a new one displaces that id's "
                "least recently active link (a token holder can claim any id: it can churn a peer's link, never "
                "keep it out)"})
    peer_links_per_network: int = field(default=256, metadata={
        "help": "most links peers may make to us from one source network (see peer_network_prefix_v4/v6); past it "
                "a new one displaces that network's least recently active link; keep it below max_links"})
    peer_network_prefix_v4: int = field(default=24, metadata={
        "help": "the IPv4 prefix length of a source network, which inbound link shares are counted by"})
    peer_network_prefix_v6: int = field(default=64, metadata={
        "help": "the IPv6 prefix length of a source network, which inbound link shares are counted by"})
    broken_link_ttl: float = field(default=60.0, metadata={
        "help": "seconds a link we made may stay BROKEN (its peer dead or unreachable) before it is removed and its "
                "resources freed; a full link table also drops its longest-BROKEN link for a new one (0 = keep "
                "BROKEN links until unlinked)"})
    idle_link_ttl: float = field(default=0.0, metadata={
        "help": "seconds a READY link we made may carry no transfer, lookup or notification before it is removed "
                "(the peer is told); 0 = never"})
    auto_relink: bool = field(default=False, metadata={"help": "re-link by itself when a linked peer restarts"})
    backend_settings: dict[str, BackendSettings] = field(default_factory=lambda: _default_settings(), metadata={
        "help": "each backend's own settings ([backend.NAME] tables; flags --NAME-FIELD)", "table": True})

    def settings_of(self, backend: str) -> BackendSettings:
        """Backend `backend`'s settings (its defaults where none were given)."""
        return self.backend_settings.get(backend) or _backends.backend_class(backend).settings_type()

    def validate(self, *, require_auth: bool = True) -> Config:
        if self.listen.startswith("/"):  # a bare path means a unix socket, as the CLI's --target accepts it
            object.__setattr__(self, "listen", "unix://" + self.listen)
        if not 0 <= self.cluster_id < 2**64:
            raise ConfigError(f"cluster_id: {self.cluster_id} is not a uint64")
        if not self.backends or len(set(self.backends)) != len(self.backends):
            raise ConfigError(f"backends: {','.join(self.backends) or '(empty)'} — name each of "
                              f"{tuple(_backends.registered())} at most once")
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
        for name in ("max_caches", "data_threads", "max_transfers", "parallel_transfers", "max_inflight_bytes",
                     "max_links", "max_granted_blocks", "max_session_message_pairs", "peer_links_per_cluster",
                     "peer_links_per_network"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: {getattr(self, name)} must be >= 1")
        for name, bits in (("peer_network_prefix_v4", 32), ("peer_network_prefix_v6", 128)):
            if not 0 <= getattr(self, name) <= bits:
                raise ConfigError(f"{name}: {getattr(self, name)} must be a prefix length from 0 to {bits}")
        if self.metrics_listen and not _is_host_port(self.metrics_listen):
            raise ConfigError(f"metrics_listen: {self.metrics_listen!r} is not host:port")
        if self.otlp_traces_endpoint:
            _check_traces_endpoint(self.otlp_traces_endpoint)
        tls = [self.tls_cert, self.tls_key, self.tls_ca]
        if any(tls) and not all(tls):
            raise ConfigError("tls_cert, tls_key, tls_ca: give all three for mutual TLS, or none")
        for name in ("tls_cert", "tls_key", "tls_ca"):
            path = getattr(self, name)
            if path and not os.access(path, os.R_OK):
                raise ConfigError(f"{name}: cannot read {path!r}")
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
        if not self.peer_link_ttl >= 3.0:
            raise ConfigError(f"peer_link_ttl: {self.peer_link_ttl} must be >= 3 seconds")
        for name in ("broken_link_ttl", "idle_link_ttl"):
            value = getattr(self, name)
            if not (value == 0 or 1.0 <= value <= 1e9):  # NaN fails both
                raise ConfigError(f"{name}: {value} must be 0 (never) or between 1 and 1e9 seconds")
        facts = DaemonFacts(peer_host=self.peer_listen.rpartition(":")[0].strip("[]"), mutual_tls=all(tls))
        for name, settings in self.backend_settings.items():
            try:
                settings.check(facts)
            except ValueError as e:
                raise ConfigError(f"backend.{name}.{e}") from None
        if require_auth and not (self.peer_token_file or all(tls) or self.insecure_peers):
            raise ConfigError("peer authentication: give --peer-token-file FILE (a secret shared by the deployment's "
                              "daemons, e.g. `head -c 32 /dev/urandom | base64 > FILE; chmod 600 FILE`), or mutual "
                              "TLS with --tls-cert/--tls-key/--tls-ca, or --insecure-peers to accept any peer "
                              "(development only)")
        return self


MAX_CLUSTER_NAME_BYTES = 253
"""cluster_id_from: a DNS name's limit (pod and node names are DNS names)."""


def cluster_id_of(name: str) -> int:
    """The cluster id `cluster_id_from = name` gives: the first 8 bytes of SHA-256(name, UTF-8), big-endian. Stable
    across releases and machines (deploy files and tools may compute it themselves: in a shell,
    `printf %s "$NAME" | sha256sum | cut -c1-16` is its hex); two names collide with probability ~n^2/2^65."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")


def _is_host_port(value: str) -> bool:
    """host:port, where an IPv6 host is a bracketed literal (`[::1]:7100`, `[::]:7100`): `::1:7100` is ambiguous."""
    host, sep, port = value.rpartition(":")
    if not (sep and host and port.isdigit() and int(port) < 65536):
        return False
    if host.startswith("[") or host.endswith("]"):
        if not (host[0] == "[" and host[-1] == "]"):
            return False
        try:
            ipaddress.IPv6Address(host[1:-1].partition("%")[0])
        except ValueError:
            return False
        return True
    return ":" not in host


def _check_traces_endpoint(value: str) -> None:
    scheme, sep, address = value.rpartition("://")
    if (sep and scheme not in ("http", "https")) or not _is_host_port(address.rstrip("/")):
        raise ConfigError(f"otlp_traces_endpoint: {value!r} is neither host:port nor http(s)://host:port")
    from kvbrokerd import tracing

    if not tracing.available():
        raise ConfigError(f"otlp_traces_endpoint: tracing needs OpenTelemetry's SDK and OTLP exporter, which are not "
                          f"installed: {tracing.INSTALL_HINT}")


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


_OPTIONS_EXAMPLE = '{"Name": "value", "Other": "{\\"json\\": \\"quoted\\"}"}'


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


@dataclass(frozen=True)
class _Option:
    """One setting: a field of Config, or a field of a backend's settings (`backend` names it)."""

    field: dataclasses.Field[Any]
    backend: str = ""

    @property
    def stem(self) -> str:
        """The flag's and the environment variable's stem: `data_threads`, `tcp_port`."""
        return f"{self.backend}_{self.field.name}" if self.backend else self.field.name

    @property
    def label(self) -> str:
        """How errors and the config file name it: `data_threads`, `backend.tcp.port`."""
        return f"backend.{self.backend}.{self.field.name}" if self.backend else self.field.name

    @property
    def stems(self) -> tuple[str, ...]:
        """The stem, then former names still accepted (`aliases` in the field's metadata)."""
        return (self.stem, *(a for a in self.field.metadata.get("aliases", ()) if a != self.stem))


def _options() -> list[_Option]:
    options = [_Option(f) for f in dataclasses.fields(Config) if not f.metadata.get("table")]
    for name, cls in _backends.loadable().items():
        options += [_Option(f, name) for f in dataclasses.fields(cls.settings_type)]
    return options


def keys() -> dict[str, list[str]]:
    """Every config file key by table: "" for the top level, "backend.NAME" for each backend with settings."""
    tables: dict[str, list[str]] = {}
    for opt in _options():
        tables.setdefault(f"backend.{opt.backend}" if opt.backend else "", []).append(opt.field.name)
    return tables


def environment_variables() -> set[str]:
    """The KVBROKER_* variables the daemon reads (current names; former names are accepted too)."""
    return {"KVBROKER_CONFIG", *(f"KVBROKER_{opt.stem.upper()}" for opt in _options())}


def _default_settings() -> dict[str, BackendSettings]:
    return {name: cls.settings_type() for name, cls in _backends.loadable().items()}


def load(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> tuple[Config, bool]:
    """(config, print_config) from the command line, `environ` and the TOML file named by --config/KVBROKER_CONFIG."""
    environ = os.environ if environ is None else environ
    options = _options()
    parser = argparse.ArgumentParser(
        prog="kvbrokerd", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="kvbroker daemon: KV-cache block transfers between LLM serving nodes (LLM-DataDist semantics).",
        epilog="Every option also has a KVBROKER_* environment variable and a key in the --config TOML file (a\n"
               "backend's options in its [backend.NAME] table); options win over the environment, which wins over\n"
               "the file. Example:\n"
               "  kvbrokerd --cluster-id 1 --peer-listen 0.0.0.0:7100 --peer-token-file /etc/kvbroker/token")
    parser.add_argument("--config", help="TOML file with any of the keys below (env: KVBROKER_CONFIG)")
    parser.add_argument("--print-config", action="store_true", help="print the effective config and exit")
    for opt in options:
        f = opt.field
        flag: dict[str, Any] = {"nargs": "?", "const": "true"} if f.type in (bool, "bool") else {}  # `--x` = true
        value = _default(f)
        default = "" if value is dataclasses.MISSING else f" [default: {_render(value) or 'none'}]"
        prefix = f"{opt.backend} backend: " if opt.backend else ""
        for i, stem in enumerate(opt.stems):
            text = (f"{prefix}{f.metadata['help']}{default} (env: KVBROKER_{stem.upper()})" if i == 0 else
                    f"former name of --{opt.stem.replace('_', '-')}")
            parser.add_argument("--" + stem.replace("_", "-"), dest=f"{opt.label}#{i}", default=None, help=text,
                                **flag)
    args = vars(parser.parse_args(argv))
    values: dict[str, Any] = {}
    path = args["config"] or environ.get("KVBROKER_CONFIG")
    if path:
        values.update(_read_file(path, options))
    for opt in options:
        # the environment, then the command line; at each level a former name counts only without the current one
        for given in ([environ.get(f"KVBROKER_{stem.upper()}") for stem in opt.stems],
                      [args[f"{opt.label}#{i}"] for i in range(len(opt.stems))]):
            value = next((v for v in given if v is not None), None)
            if value is not None:
                values[opt.label] = value
    derived_from = str(values.get("cluster_id_from", ""))
    if derived_from:
        if "cluster_id" in values:
            raise ConfigError(f"cluster_id_from: {derived_from!r} and cluster_id {values['cluster_id']} are both "
                              "given; give one")
        if len(derived_from.encode()) > MAX_CLUSTER_NAME_BYTES or not derived_from.isprintable():
            raise ConfigError(f"cluster_id_from: {derived_from[:40]!r} must be printable and at most "
                              f"{MAX_CLUSTER_NAME_BYTES} bytes")
        values["cluster_id"] = cluster_id_of(derived_from)
    if "cluster_id" not in values:
        if not args["print_config"]:
            raise ConfigError("cluster_id: required (--cluster-id, --cluster-id-from, KVBROKER_CLUSTER_ID, "
                              "KVBROKER_CLUSTER_ID_FROM or the config file)")
        values["cluster_id"] = 0  # --print-config shows the defaults even before an id is chosen
    typed = {opt.label: _coerce(opt.label, values[opt.label], opt.field.type) for opt in options
             if opt.label in values}
    settings = _default_settings()
    for name, cls in _backends.loadable().items():
        own = {opt.field.name: typed.pop(opt.label) for opt in options if opt.backend == name and opt.label in typed}
        settings[name] = cls.settings_type(**own)
    # --print-config shows a config that still lacks peer authentication (it is how one finds out what to add).
    return (Config(**typed, backend_settings=settings).validate(require_auth=not args["print_config"]),
            bool(args["print_config"]))


def _read_file(path: str, options: Sequence[_Option]) -> dict[str, Any]:
    """The values of a TOML config file by option label; an unknown key or backend is an error."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"config: cannot read {path}: {e}") from None
    by_key: dict[str, _Option] = {}
    for opt in options:
        for stem in opt.stems if not opt.backend else opt.field.metadata.get("aliases", ()):
            by_key[stem] = opt
    values: dict[str, Any] = {}
    tables = data.pop("backend", {})
    if not isinstance(tables, dict):
        raise ConfigError(f"config: backend in {path} is not a table of backends' tables ([backend.NAME])")
    for key, value in data.items():
        known = by_key.get(key.replace("-", "_"))
        if known is None:
            raise ConfigError(f"config: unknown key {key!r} in {path}")
        values.setdefault(known.label, value)  # [backend.NAME] tables win over former top-level names
    for backend, table in tables.items():
        fields = {o.field.name: o for o in options if o.backend == backend}
        if not fields and backend not in _backends.registered():
            raise ConfigError(f"config: unknown backend {backend!r} in [backend] of {path} (known: "
                              f"{', '.join(_backends.registered())})")
        if not isinstance(table, dict):
            raise ConfigError(f"config: backend.{backend} in {path} is not a table")
        for key, value in table.items():
            field_opt = fields.get(key.replace("-", "_"))
            if field_opt is None:
                raise ConfigError(f"config: unknown key {key!r} in [backend.{backend}] of {path}")
            values[field_opt.label] = value
    return values


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
    lines = [f"{f.name} = {_toml_value(getattr(config, f.name))}  # {f.metadata['help']}"
             for f in dataclasses.fields(config) if not f.metadata.get("table")]
    for name, settings in config.backend_settings.items():
        fields = dataclasses.fields(settings)
        if fields:
            lines += ["", f"[backend.{name}]"]
            lines += [f"{f.name} = {_toml_value(getattr(settings, f.name))}  # {f.metadata['help']}" for f in fields]
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml_string(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_string(k)} = {_toml_string(v)}" for k, v in value.items()) + "}"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int | float):
        return str(value)
    return _toml_string(value)


def _toml_string(value: str) -> str:
    """A TOML basic string: JSON's escapes (quotes, backslashes, control characters, \\uXXXX) are TOML's too."""
    return json.dumps(value)
