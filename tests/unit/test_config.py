"""Configuration precedence (flags > env > TOML > defaults) and validation messages that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbrokerd.config import ConfigError, load


def test_defaults_and_required_cluster_id() -> None:
    with pytest.raises(ConfigError, match="cluster_id"):
        load([], {})
    config, show = load(["--cluster-id", "3"], {})
    assert config.cluster_id == 3 and config.backends == ("shm", "tcp") and not show
    assert config.listen == "unix:///run/kvbroker/kvbroker.sock"


def test_precedence_flags_env_file(tmp_path: Path) -> None:
    toml = tmp_path / "kv.toml"
    toml.write_text('cluster_id = 1\nbackends = ["tcp"]\nlog_level = "debug"\npeer_listen = "127.0.0.1:7000"\n')
    env = {"KVBROKER_CONFIG": str(toml), "KVBROKER_LOG_LEVEL": "warning", "KVBROKER_CLUSTER_ID": "2"}
    config, _ = load(["--cluster-id", "5"], env)
    assert config.cluster_id == 5  # flag beats env and file
    assert config.log_level == "warning"  # env beats file
    assert config.backends == ("tcp",) and config.peer_listen == "127.0.0.1:7000"  # file beats defaults


@pytest.mark.parametrize(("args", "field"), [
    (["--cluster-id", "x"], "cluster_id"),
    (["--cluster-id", "-1"], "cluster_id"),
    (["--cluster-id", "1", "--backends", "rdma"], "backends"),
    (["--cluster-id", "1", "--peer-listen", "nohost"], "peer_listen"),
    (["--cluster-id", "1", "--log-level", "loud"], "log_level"),
    (["--cluster-id", "1", "--data-port", "70000"], "data_port"),
])
def test_bad_values_name_the_field(args: list[str], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        load(args, {})


def test_unknown_toml_key(tmp_path: Path) -> None:
    toml = tmp_path / "kv.toml"
    toml.write_text("cluster_id = 1\nclusterid = 2\n")
    with pytest.raises(ConfigError, match="unknown key 'clusterid'"):
        load(["--config", str(toml)], {})


@pytest.mark.parametrize(("args", "env", "expected"), [
    (["--data-tls"], {}, True),
    (["--data-tls", "false"], {}, False),
    ([], {"KVBROKER_DATA_TLS": "false"}, False),
    ([], {"KVBROKER_DATA_TLS": "yes"}, True),
    ([], {}, False),
])
def test_booleans_are_parsed_not_truthy(args: list[str], env: dict[str, str], expected: bool, tmp_path: Path) -> None:
    pem = tmp_path / "x.pem"
    pem.write_text("-")
    tls = ["--tls-cert", str(pem), "--tls-key", str(pem), "--tls-ca", str(pem)]
    config, _ = load(["--cluster-id", "1", *tls, *args], env)
    assert config.data_tls is expected


def test_tls_needs_all_three_files(tmp_path: Path) -> None:
    pem = tmp_path / "x.pem"
    pem.write_text("-")
    with pytest.raises(ConfigError, match="all three"):
        load(["--cluster-id", "1", "--tls-cert", str(pem)], {})
    with pytest.raises(ConfigError, match="tls_ca: cannot read"):
        load(["--cluster-id", "1", "--tls-cert", str(pem), "--tls-key", str(pem), "--tls-ca", "/nope.pem"], {})
    with pytest.raises(ConfigError, match="data_tls"):
        load(["--cluster-id", "1", "--data-tls"], {})
