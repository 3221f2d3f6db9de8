"""Peer addresses are HOST:PORT and nothing else (issue 30, finding 9): never a gRPC scheme such as unix:."""

from __future__ import annotations

import ipaddress
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbrokerd.errors import LlmError, LlmStatus
from kvbrokerd.links.peeraddress import GRPC_SCHEMES, check_peer_address, dial_target, peer_address_problem

_LABEL = st.from_regex(r"\A[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?\Z", fullmatch=True)
_DNS_NAME = st.lists(_LABEL, min_size=1, max_size=4).map(".".join).filter(
    lambda name: not name.split(".")[-1].isdigit() and name not in GRPC_SCHEMES)
_PORT = st.integers(1, 65535).map(str)
_HOST = st.one_of(_DNS_NAME, st.ip_addresses(v=4).map(str), st.ip_addresses(v=6).map(lambda ip: f"[{ip}]"))


def _is_host_port(address: str) -> bool:
    """An oracle written apart from the daemon's: IPv4, [IPv6] or a DNS name not all digits, a colon, 1..65535."""
    m = re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[0-9.]+|[A-Za-z0-9.-]+):([0-9]{1,5})", address)
    if not m or not 1 <= int(m.group(2)) <= 65535:
        return False
    host = m.group(1)
    if host.startswith("["):
        try:
            return isinstance(ipaddress.ip_address(host[1:-1]), ipaddress.IPv6Address)
        except ValueError:
            return False
    try:
        return isinstance(ipaddress.ip_address(host), ipaddress.IPv4Address)
    except ValueError:
        pass
    labels = host.removesuffix(".").split(".")
    return len(host) <= 254 and host.lower().removesuffix(".") not in GRPC_SCHEMES and not labels[-1].isdigit() and \
        all(re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?", label) for label in labels)


@given(_HOST, _PORT)
def test_host_port_is_accepted_as_given(host: str, port: str) -> None:
    assert check_peer_address(f"{host}:{port}") == f"{host}:{port}"
    assert dial_target(f"{host}:{port}") == f"dns:///{host}:{port}"


@given(st.sampled_from(sorted(GRPC_SCHEMES)), st.sampled_from([":", "://", ":///"]), st.text(max_size=40))
def test_a_grpc_scheme_is_refused_whatever_follows(scheme: str, sep: str, rest: str) -> None:
    assert peer_address_problem(f"{scheme}{sep}{rest}") is not None


@given(_HOST, st.one_of(st.integers(-10, 0), st.integers(65536, 10**7)).map(str) | st.sampled_from(["", "+1", "x"]))
def test_a_port_outside_1_to_65535_is_refused(host: str, port: str) -> None:
    assert peer_address_problem(f"{host}:{port}") is not None


@given(st.text(max_size=60))
def test_any_text_is_accepted_only_if_it_is_host_port(text: str) -> None:
    assert (peer_address_problem(text) is None) == _is_host_port(text)


@pytest.mark.parametrize("address", ["unix:/run/other.sock", "unix:///run/other.sock", "unix-abstract:other",
                                     "unix:7100", "dns:///10.0.0.1:7100", "ipv4:10.0.0.1:7100", "ipv6:[::1]:7100",
                                     ":7100", "10.0.0.1", "10.0.0.1:", "10.0.0.1:0", "::1:7100", "[::1:7100",
                                     "[fe80::1%eth0]:7100", "7:7100", "a b:7100", "host:7100/x"])
def test_not_host_port_is_param_invalid(address: str) -> None:
    with pytest.raises(LlmError) as info:
        check_peer_address(address)
    assert info.value.status == LlmStatus.LLM_PARAM_INVALID and "remote_address" in info.value.message
