"""The connector's settings, read from vLLM's `kv_connector_extra_config` (keys are listed in the package docstring).

Validated when the engine starts, with messages that name the key, so that a typo fails the engine at start-up
instead of silently running with a default.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_TARGET = "unix:///run/kvbroker/kvbroker.sock"
KEY_PREFIX = "kvbroker_"


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    target: str = DEFAULT_TARGET
    """Local API of this node's kvbrokerd (`kvbroker_target`; else $KVBROKER_TARGET; else the default socket)."""
    peer_address: str = ""
    """Address decode nodes dial to reach this node's daemon (`kvbroker_peer_address`); default: the daemon's own
    advertised peer address."""
    pull_timeout_s: float = 30.0
    """Deadline of one request's pull (`kvbroker_pull_timeout_s`); past it the blocks are recomputed locally."""
    link_timeout_s: float = 5.0
    """Deadline of linking to a prefill node's daemon on first use (`kvbroker_link_timeout_s`)."""
    release_timeout_s: float = 600.0
    """The most a prefill node keeps a finished request's blocks, however long decode nodes renew their lease
    (`kvbroker_release_timeout_s`): the grant's cap."""
    hold_lease_s: float = 30.0
    """Lease of a prefill node's grant on a finished request's blocks (`kvbroker_hold_lease_s`): the blocks are freed
    this long after the decode node last renewed it (it renews while the request waits in its queue), or at once when
    the decode node releases it."""
    prefill_daemons: str = ""
    """The prefill daemons a decode node pulls from (`kvbroker_prefill_daemons`): "CLUSTER_ID=HOST:PORT" entries,
    comma-separated (IPv6: "7=[::1]:7100"). A request naming any other cluster is computed locally; addresses never
    come from requests."""
    lease_ttl_s: float = 30.0
    """The KV memory belongs to the engine's kvbroker session; if the engine dies without cleaning up, the daemon
    frees it this long after the last renewal (`kvbroker_lease_ttl_s`)."""
    max_concurrent_pulls: int = 4
    """`kvbroker_max_concurrent_pulls`: no longer used (still accepted, so that existing configs load): a step's pulls
    all go as one message of the worker's pull session, and the daemon bounds what runs at once."""
    model_id: str = ""
    """Model identity compared between prefill and decode (`kvbroker_model_id`); default: a hash of the model's
    architecture config, so that two engines serving different models never exchange KV."""
    idle_wait_s: float = 0.01
    """On a step that computes nothing while pulls are in flight, `get_finished` waits up to this long for one to end
    (`kvbroker_idle_wait_s`; 0 turns it off). Otherwise vLLM spins through empty steps holding the GIL: the pull
    thread gets it only once per switch interval (5 ms) each time it needs it, and the engine learns of the finished
    pull a step late. On an engine with nothing to compute, new requests and aborts wait at most this long."""
    token_units: bool = False
    """Address the KV cache itself in units of a few tokens instead of one head's block (`kvbroker_token_units`).
    No longer needed: with the default (off) the engine serves its KV in head units and, through a view of the same
    memory, in token units, and a pull between engines of different block sizes uses both token views while one
    between equal block sizes keeps the head units (`remap.settle`). Still accepted for existing configs: such an
    engine pulls every request in token units (which costs planning time on long prompts even between equal block
    sizes: BENCHMARKS.md, "Heterogeneous P/D") and meets default engines through their views."""
    log_transfers: bool = False
    """Log every pull (request, blocks, bytes, time, backend) at INFO (`kvbroker_log_transfers`)."""

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        extra = dict(extra or {})
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, raw in extra.items():
            if not key.startswith(KEY_PREFIX):
                continue  # other connectors' keys (e.g. under MultiConnector) are not ours to judge
            name = key[len(KEY_PREFIX):]
            field = fields.get(name)
            if field is None:
                known = ", ".join(sorted(KEY_PREFIX + n for n in fields))
                raise ValueError(f"kv_connector_extra_config: unknown key {key!r} (known: {known})")
            values[name] = _coerce(key, field.type, raw)
        if "target" not in values and os.environ.get("KVBROKER_TARGET"):
            values["target"] = os.environ["KVBROKER_TARGET"]
        config = cls(**values)
        config._check()
        return config

    def _check(self) -> None:
        for name in ("pull_timeout_s", "link_timeout_s", "release_timeout_s", "hold_lease_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"kv_connector_extra_config: {KEY_PREFIX}{name} must be > 0 seconds")
        if not 0.0 <= self.idle_wait_s <= 1.0:
            raise ValueError(f"kv_connector_extra_config: {KEY_PREFIX}idle_wait_s must be in [0, 1] seconds")
        if self.lease_ttl_s < 1.0:
            raise ValueError(f"kv_connector_extra_config: {KEY_PREFIX}lease_ttl_s must be >= 1 second")
        if not 1 <= self.max_concurrent_pulls <= 256:
            raise ValueError(f"kv_connector_extra_config: {KEY_PREFIX}max_concurrent_pulls must be in [1, 256]")
        if len(self.model_id) > 64 or any(not c.isprintable() or c.isspace() for c in self.model_id):
            raise ValueError(f"kv_connector_extra_config: {KEY_PREFIX}model_id must be at most 64 printable "
                             "characters without spaces")
        if not 0.1 <= self.hold_lease_s <= min(3600.0, self.release_timeout_s):
            raise ValueError(f"kv_connector_extra_config: {KEY_PREFIX}hold_lease_s must be in [0.1, 3600] seconds and "
                             f"at most {KEY_PREFIX}release_timeout_s")
        self.trusted_prefill()
        if not self.target:
            raise ValueError(f"kv_connector_extra_config: {KEY_PREFIX}target must name the kvbrokerd local API")


    def trusted_prefill(self) -> dict[int, str]:
        """`prefill_daemons` as {cluster id: peer address}; ValueError naming the key if it is malformed."""
        out: dict[int, str] = {}
        for entry in filter(None, (e.strip() for e in self.prefill_daemons.split(","))):
            cluster, eq, address = entry.partition("=")
            host, colon, port = address.rpartition(":")
            # HOST:PORT only (a bracketed IPv6 literal may hold colons): never a gRPC scheme such as unix:.
            bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
            if not (eq and cluster.strip().isdigit() and colon and bare and port.isdigit()) or "/" in address \
                    or (":" in bare and bare == host) or "[" in bare or any(c.isspace() for c in address) \
                    or len(address) > 512:
                raise ValueError(f"kv_connector_extra_config: {KEY_PREFIX}prefill_daemons entry {entry!r} is not "
                                 "CLUSTER_ID=HOST:PORT")
            out[int(cluster)] = address
        return out


def _coerce(key: str, type_name: Any, raw: Any) -> Any:
    # JSON configs (`--kv-transfer-config '{...}'`) deliver numbers and booleans typed, but environment-driven
    # launchers often deliver strings; accept both, refuse anything ambiguous.
    type_name = str(type_name)
    try:
        if type_name == "bool":
            if isinstance(raw, bool):
                return raw
            if isinstance(raw, str) and raw.lower() in ("true", "1", "yes", "false", "0", "no"):
                return raw.lower() in ("true", "1", "yes")
            raise ValueError
        if type_name == "int":
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError
            return int(raw)
        if type_name == "float":
            if isinstance(raw, bool):
                raise ValueError
            return float(raw)
        if not isinstance(raw, str):
            raise ValueError
        return raw
    except (TypeError, ValueError):
        raise ValueError(f"kv_connector_extra_config: {key} must be a {type_name}, got {raw!r}") from None
