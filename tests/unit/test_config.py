"""Configuration precedence (flags > env > TOML > defaults) and validation messages that name the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbrokerd.backends.hccl.engine import HcclSettings
from kvbrokerd.backends.tcp.backend import TcpSettings
from kvbrokerd.config import ConfigError, load, to_toml


def _token(tmp_path: Path, mode: int = 0o600, text: str = "s3cret-token-of-the-deployment") -> str:
    path = tmp_path / "token"
    path.write_text(text)
    path.chmod(mode)
    return str(path)


def test_defaults_and_required_cluster_id(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cluster_id"):
        load([], {})
    config, show = load(["--cluster-id", "3", "--peer-token-file", _token(tmp_path)], {})
    assert config.cluster_id == 3 and config.backends == ("shm", "tcp") and not show
    assert config.listen == "unix:///run/kvbroker/kvbroker.sock"


def test_peer_authentication_is_required_and_names_the_three_ways(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="peer authentication") as info:
        load(["--cluster-id", "3"], {})
    for way in ("--peer-token-file", "--tls-cert", "--insecure-peers"):
        assert way in str(info.value)
    assert load(["--cluster-id", "3", "--insecure-peers"], {})[0].insecure_peers
    assert load(["--cluster-id", "3"], {"KVBROKER_PEER_TOKEN_FILE": _token(tmp_path)})[0].peer_token_file


@pytest.mark.parametrize(("mode", "text", "problem"), [
    (0o644, "s3cret-token-of-the-deployment", "readable by every user"),
    (0o600, "short", "at least 16"),
])
def test_bad_token_files_are_refused(tmp_path: Path, mode: int, text: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        load(["--cluster-id", "3", "--peer-token-file", _token(tmp_path, mode, text)], {})
    with pytest.raises(ConfigError, match="cannot open"):
        load(["--cluster-id", "3", "--peer-token-file", str(tmp_path / "missing")], {})


def test_print_config_needs_no_cluster_id_and_a_bare_listen_path_is_a_socket() -> None:
    config, show = load(["--print-config"], {})
    assert show and config.cluster_id == 0
    config, _ = load(["--cluster-id", "1", "--insecure-peers", "--listen", "/tmp/kv.sock"], {})
    assert config.listen == "unix:///tmp/kv.sock"


def test_precedence_flags_env_file(tmp_path: Path) -> None:
    toml = tmp_path / "kv.toml"
    toml.write_text('cluster_id = 1\nbackends = ["tcp"]\nlog_level = "debug"\npeer_listen = "127.0.0.1:7000"\n')
    env = {"KVBROKER_CONFIG": str(toml), "KVBROKER_LOG_LEVEL": "warning", "KVBROKER_CLUSTER_ID": "2"}
    config, _ = load(["--cluster-id", "5", "--insecure-peers"], env)
    assert config.cluster_id == 5  # flag beats env and file
    assert config.log_level == "warning"  # env beats file
    assert config.backends == ("tcp",) and config.peer_listen == "127.0.0.1:7000"  # file beats defaults


@pytest.mark.parametrize(("args", "field"), [
    (["--cluster-id", "x"], "cluster_id"),
    (["--cluster-id", "-1"], "cluster_id"),
    (["--cluster-id", "1", "--backends", "rdma"], "backends"),
    (["--cluster-id", "1", "--peer-listen", "nohost"], "peer_listen"),
    (["--cluster-id", "1", "--log-level", "loud"], "log_level"),
    (["--cluster-id", "1", "--data-port", "70000"], "backend.tcp.port"),
    (["--cluster-id", "1", "--tcp-port", "70000"], "backend.tcp.port"),
    (["--cluster-id", "1", "--peer-listen", "::1:7100"], "peer_listen"),  # IPv6 needs brackets: [::1]:7100
    (["--cluster-id", "1", "--advertise-address", "[::1:7100"], "advertise_address"),
    (["--cluster-id", "1", "--advertise-address", "[nohost]:7100"], "advertise_address"),
    (["--cluster-id", "1", "--metrics-listen", "[::1]"], "metrics_listen"),
    (["--cluster-id", "1", "--broken-link-ttl", "0.5"], "broken_link_ttl"),
    (["--cluster-id", "1", "--idle-link-ttl", "-1"], "idle_link_ttl"),
    (["--cluster-id", "1", "--idle-link-ttl", "nan"], "idle_link_ttl"),
    (["--cluster-id", "1", "--otlp-traces-endpoint", "collector"], "otlp_traces_endpoint"),
    (["--cluster-id", "1", "--otlp-traces-endpoint", "grpc://collector:4317"], "otlp_traces_endpoint"),
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
    assert config.settings_of("tcp") == TcpSettings(tls=expected)


def test_tls_needs_all_three_files(tmp_path: Path) -> None:
    pem = tmp_path / "x.pem"
    pem.write_text("-")
    with pytest.raises(ConfigError, match="all three"):
        load(["--cluster-id", "1", "--tls-cert", str(pem)], {})
    with pytest.raises(ConfigError, match="tls_ca: cannot read"):
        load(["--cluster-id", "1", "--tls-cert", str(pem), "--tls-key", str(pem), "--tls-ca", "/nope.pem"], {})
    with pytest.raises(ConfigError, match=r"backend\.tcp\.tls"):
        load(["--cluster-id", "1", "--data-tls"], {})


def test_hccl_settings_from_flags_env_and_file(tmp_path: Path) -> None:
    options = {"GlobalResourceConfig": '{"comm_resource_config.protocol_desc": ["roce:device"]}',
               "LocalCommRes": '{"version":"1.3"}'}
    toml = tmp_path / "kv.toml"
    toml.write_text('cluster_id = 1\nhccl_engine = "10.0.0.5:26000"\n'
                    'hccl_options = { LocalCommRes = "{\\"version\\":\\"1.3\\"}" }\n')
    env = {"KVBROKER_CONFIG": str(toml), "KVBROKER_HCCL_DEVICE": "2",
           "KVBROKER_HCCL_OPTIONS": json.dumps(options)}
    config, _ = load(["--insecure-peers", "--hccl-connect-timeout-ms", "5000"], env)
    settings = config.settings_of("hccl")
    assert isinstance(settings, HcclSettings)
    assert (settings.device, settings.engine, settings.connect_timeout_ms) == (2, "10.0.0.5:26000", 5000)
    assert settings.options == options  # the environment's JSON beats the file's table
    config, _ = load(["--insecure-peers"], {"KVBROKER_CONFIG": str(toml)})
    assert config.settings_of("hccl") == HcclSettings(engine="10.0.0.5:26000",  # options: a TOML table
                                                      options={"LocalCommRes": '{"version":"1.3"}'})
    assert load(["--cluster-id", "1", "--insecure-peers"], {})[0].settings_of("hccl") == HcclSettings()


def test_print_config_round_trips_through_the_config_file(tmp_path: Path) -> None:
    options = {"GlobalResourceConfig": '{"a": ["roce:device"], "b\\\\c": 1}', "Rdma Traffic": "quote \" here"}
    config, _ = load(["--cluster-id", "7", "--insecure-peers", "--hccl-options", json.dumps(options),
                      "--hccl-engine", "[fd00::5]:26001", "--shm-dir", str(tmp_path / 'a "quoted" dir')], {})
    toml = tmp_path / "printed.toml"
    toml.write_text(to_toml(config))
    again, _ = load(["--config", str(toml)], {})
    assert again == config and again.settings_of("hccl") == HcclSettings(engine="[fd00::5]:26001", options=options)


@pytest.mark.parametrize(("args", "message"), [
    (["--hccl-device", "-1"], "backend.hccl.device: -1 is not a device id"),
    (["--hccl-device", "npu0"], "backend.hccl.device: 'npu0' is not a valid int"),
    (["--hccl-engine", "npu-host:26000"], "backend.hccl.engine: 'npu-host:26000' is not ip:port"),
    (["--hccl-engine", "0.0.0.0:26000"], "backend.hccl.engine: .* wildcard"),
    (["--hccl-engine", "10.0.0.5"], "backend.hccl.engine: .* needs a port"),
    (["--hccl-connect-timeout-ms", "0"], r"backend.hccl.connect_timeout_ms: 0 is not in \[1, 600000\]"),
    (["--hccl-options", "[1]"], "backend.hccl.options: want an object of strings"),
    (["--hccl-options", '{"RdmaTrafficClass": 132}'], "backend.hccl.options: want an object of strings"),
    (["--hccl-options", "{oops"], "backend.hccl.options: not JSON"),
    (["--hccl-options", '{"BufferPool": "4:8"}'], "backend.hccl.options: BufferPool cannot be set"),
    (["--hccl-options", '{"AutoConnect": "1"}'], "backend.hccl.options: AutoConnect cannot be set"),
])
def test_bad_hccl_settings_name_the_field(args: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load(["--cluster-id", "1", "--insecure-peers", *args], {})


def test_a_bad_hccl_table_in_the_file_names_the_field(tmp_path: Path) -> None:
    toml = tmp_path / "kv.toml"
    toml.write_text("cluster_id = 1\ninsecure_peers = true\n[hccl_options]\nRdmaTrafficClass = 132\n")
    with pytest.raises(ConfigError, match=r"backend\.hccl\.options: want an object of strings"):
        load(["--config", str(toml)], {})


def test_ipv6_literals_are_addresses_wherever_ipv4_ones_are() -> None:
    config, _ = load(["--cluster-id", "1", "--insecure-peers", "--peer-listen", "[::]:7100", "--advertise-address",
                      "[fd00::1]:7100", "--metrics-listen", "[::1]:9100"], {})
    assert (config.peer_listen, config.advertise_address, config.metrics_listen) == \
        ("[::]:7100", "[fd00::1]:7100", "[::1]:9100")


@pytest.mark.parametrize("endpoint", ["collector:4317", "http://127.0.0.1:4317", "https://otel.example:4317",
                                      "[::1]:4317"])
def test_traces_endpoint_from_flag_and_env(endpoint: str) -> None:
    config, _ = load(["--cluster-id", "1", "--insecure-peers", "--otlp-traces-endpoint", endpoint], {})
    assert config.otlp_traces_endpoint == endpoint
    config, _ = load(["--cluster-id", "1", "--insecure-peers"], {"KVBROKER_OTLP_TRACES_ENDPOINT": endpoint})
    assert config.otlp_traces_endpoint == endpoint
    assert load(["--cluster-id", "1", "--insecure-peers"], {})[0].otlp_traces_endpoint == ""  # off by default
